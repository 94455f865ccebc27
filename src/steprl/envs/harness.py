"""`env.name: harness`: train an agent written as a harness, a user's async function
`run(task, client) -> reward` that calls the policy through an OpenAI-compatible client.

Agents in practice live in harnesses (the OpenAI Agents SDK, LangGraph, smolagents, a script with
the `openai` client) that send message lists and never see token ids. With this env each RL and
eval episode runs the harness once against the run's gateway (`gateway/harness_runner.py`):
every call is rendered with the model's chat template, sampled by the run's engine with the
episode's seed, and recorded as exact ids and log-probs (appended when the harness kept the
history as sampled, else a counted branch); the harness's return value is the episode's
reward, and the recorded calls become the trajectory that trains.

    env:
      name: harness
      params:
        run: my_pkg.agent:run        # async def run(task, client) -> float (import path)
        tasks: calculator            # the env whose tasks (and demonstrations) the harness plays
        env_params: {}               # that env's env.params
        timeout_s: 300               # an episode still running after this ends env_timeout
      task_params: {}                # that env's task parameters

`tasks` names any env (`env.name` forms: a built-in, a family, an import path): its task
generator gives the harness its tasks (each with `Task.env` harness), its factory and strategies
serve the SFT warm start's demonstrations and `check-env`, exactly as that env would; the warm
start is keyed on them, not on `run` or `timeout_s` (renaming the harness function keeps it).
A harness that raises ends its episode `infra_failed` (counted, never trained on) with the
error; one the gateway refused a call (the turn or token budget of `rollout`) ends `truncated`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from steprl.envs.base import Env
from steprl.envs.spec import EnvSpec, Harness
from steprl.errors import UserError
from steprl.types import Task

#: env.params of the harness env
PARAMS = ("run", "tasks", "env_params", "timeout_s")
#: those that shape no demonstration: a warm start (which plays the env, never the harness) is
#: not keyed on them, so renaming the harness function keeps it
RUN_ONLY = ("run", "timeout_s")


class HarnessParamsError(UserError):
    """A harness env's params that cannot work (one line: which key and what to give)."""


def check_run(fn: object, path: str) -> Callable[..., Any]:
    """The harness function: an `async def` taking (task, client)."""
    if not inspect.iscoroutinefunction(fn):
        raise HarnessParamsError(
            f"env.params.run: {path} is not an async function; write `async def run(task, client) -> float`"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise HarnessParamsError(
            f"env.params.run: {path} must take (task, client); got {inspect.signature(fn)}"
        ) from None
    return fn


def harness_spec(params: Mapping[str, Any], run: Callable[..., Any], inner: EnvSpec) -> EnvSpec:
    """The harness env over `inner` (the env named by `params["tasks"]`)."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise HarnessParamsError(
            f"env.params.{unknown[0]}: not a parameter of env harness; allowed: {', '.join(PARAMS)}"
        )
    timeout = params.get("timeout_s", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise HarnessParamsError(f"env.params.timeout_s: seconds above 0, got {timeout!r}")
    given = params.get("env_params") or {}
    if not isinstance(given, Mapping):
        raise HarnessParamsError(f"env.params.env_params: a mapping (the env's params), got {given!r}")

    def factory(
        run: str | None = None,
        tasks: str | None = None,
        env_params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Env:
        # the env the harness plays, for demonstrations and check-env: RL episodes run the harness
        return inner.factory(**dict(given if env_params is None else env_params))

    def harness_tasks(split: str, seed: int, **task_params: Any) -> Iterator[Task]:
        # the env's tasks, each naming the env that runs it (Task.env, as check-env holds)
        return (replace(t, env="harness") for t in inner.tasks(split, seed, **task_params))

    # the code they run: a warm start's key digests the played env's (`training/setup/policy.py`)
    factory.code_of = inner.factory  # type: ignore[attr-defined]
    harness_tasks.code_of = inner.tasks  # type: ignore[attr-defined]
    # the env's own spec (its tasks, strategies and check-env rules), named harness, with the
    # harness that runs its RL and eval episodes
    return replace(
        inner,
        name="harness",
        factory=factory,
        tasks=harness_tasks,
        description=f"the harness {params['run']} over the tasks of {inner.name}",
        harness=Harness(run=run, path=str(params["run"]), timeout_s=float(timeout)),
    )


__all__ = ["PARAMS", "RUN_ONLY", "HarnessParamsError", "check_run", "harness_spec"]
