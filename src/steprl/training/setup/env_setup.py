"""From the config's `env` and `rollout` sections to what train, eval and SFT share: the env
spec (with tasks from a file when `env.task_file` is set), the env pool over the configured
backend, the prompt format, and a first reset that turns an env that cannot start into one line.

Train, `steprl eval` and the SFT warm start all call these, so they see the same env, the
same tasks and the same first prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

from steprl.config import Config, EnvEntry
from steprl.envs.base import maybe_await
from steprl.envs.policy import Policy
from steprl.envs.registry import EnvParamsError, EnvSpec, check_params, get_spec, load_plugins
from steprl.errors import UserError
from steprl.hosting.backend import EnvRoute, make_backends
from steprl.hosting.pool import EnvPool
from steprl.rollout.chat import PlainFormat, PromptFormat
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.loop import EpisodeRunner
from steprl.training.sources.splits import TaskSplits
from steprl.types import Task


class EnvStartError(UserError):
    """The env failed its first reset (e.g. an MCP server that exits at start-up)."""


def env_spec(cfg: Config) -> EnvSpec:
    """The spec of the run's one env (`steprl check-env`, a single-env run); a list of envs is
    `run_envs`."""
    entries = cfg.env.entries()
    if len(entries) > 1:
        raise UserError(
            f"the config lists {len(entries)} envs ({', '.join(e.key for e in entries)}); "
            "this command takes one: check each with `steprl check-env NAME`"
        )
    load_plugins(cfg.env.plugins)
    return _entry_spec(entries[0], "env")


def _entry_spec(entry: EnvEntry, where: str) -> EnvSpec:
    """`entry.name` resolved, tasks from `entry.task_file`; its params and task params checked
    against what its factory and tasks take (`where`: the config key, for the messages)."""
    spec = get_spec(entry.name, entry.params)
    tf = entry.task_file
    check_params(spec, entry.params, {} if tf is not None else entry.task_params)
    if tf is not None:
        from steprl.envs.task_file import TaskFile, with_task_file

        if entry.task_params:
            raise EnvParamsError(
                f"{where}.task_params {sorted(entry.task_params)} with {where}.task_file: tasks from a "
                "file take no task params; remove them, or put the values in the file's rows"
            )
        spec = with_task_file(spec, TaskFile(**tf.model_dump()))
    return spec


def _agent_loop(task: Task) -> EpisodeRunner | None:
    return None


@dataclass(frozen=True)
class RunEnv:
    """One env of the run, resolved: its config entry and its spec."""

    entry: EnvEntry
    spec: EnvSpec

    @property
    def key(self) -> str:
        return self.entry.key


@dataclass(frozen=True)
class RunEnvs:
    """The run's envs, each spec resolved once (the trainer resolves them and hands them on).

    With several envs, every task a split yields carries its env's key in `task.env`: that is
    how the backend (`RoutedBackend`) builds its env, the metrics group it (`env/<key>/...`) and
    the demonstrations pick its strategies. One env's tasks are left as its generator made them.
    """

    envs: tuple[RunEnv, ...]

    @property
    def several(self) -> bool:
        return len(self.envs) > 1

    def describe(self) -> str:
        if not self.several:
            return self.envs[0].spec.name
        return ", ".join(f"{e.key} (weight {e.entry.weight:g})" for e in self.envs)

    def splits(self, split: str, seed: int) -> dict[str, Callable[[], Iterator[Task]]]:
        """Each env's `split` ("train" or "eval") as a factory of fresh iterators, by key."""
        return {e.key: functools.partial(self._tasks, e, split, seed) for e in self.envs}

    def weights(self) -> dict[str, float]:
        return {e.key: e.entry.weight for e in self.envs}

    def runner_for(self) -> Callable[[Task], EpisodeRunner | None]:
        """Which tasks a harness runs (`env.name: harness`): their runner, by `task.env` with
        several envs; None for the agent loop's tasks."""
        from steprl.gateway.harness_runner import HarnessRunner  # openai and fastapi: only when used

        runners = {e.key: HarnessRunner(e.spec.harness) for e in self.envs if e.spec.harness is not None}
        if not runners:
            return _agent_loop
        if not self.several:
            only = next(iter(runners.values()))
            return lambda task: only
        return lambda task: runners.get(task.env)

    def routes(self) -> tuple[EnvRoute, ...]:
        return tuple(EnvRoute(e.key, e.entry.name, e.entry.params) for e in self.envs)

    def demo_tasks(self, seed: int) -> Callable[[], Iterator[Task]]:
        """The train split the demonstrations play: with several envs, theirs in turn."""
        splits = self.splits("train", seed)
        if not self.several:
            return next(iter(splits.values()))
        return TaskSplits(splits, dict.fromkeys(splits, 1.0))

    def strategies(self) -> dict[str, Policy]:
        """The scripted strategies the demonstrations may use: one env's own, or those every
        env of the run offers, each playing a task with its own env's strategy."""
        if not self.several:
            return dict(self.envs[0].spec.strategies)
        common = set.intersection(*(set(e.spec.strategies) for e in self.envs))
        return {name: _ByEnv({e.key: e.spec.strategies[name] for e in self.envs}) for name in sorted(common)}

    def code(self) -> list[object]:
        """What defines the envs' behaviour (factories, task generators, strategies): a warm
        start's cache key digests their source files."""
        return [obj for e in self.envs for obj in (e.spec.factory, e.spec.tasks, *e.spec.strategies.values())]

    @property
    def name(self) -> str:
        """One env's name, or the run's env keys joined by '+'."""
        return "+".join(e.key for e in self.envs) if self.several else self.envs[0].entry.name

    def _tasks(self, env: RunEnv, split: str, seed: int) -> Iterator[Task]:
        tasks = env.spec.tasks(split, seed, **env.entry.task_params)
        return (replace(t, env=env.key) for t in tasks) if self.several else iter(tasks)


@dataclass(frozen=True)
class _ByEnv:
    """One strategy name over several envs: each task played by its own env's strategy."""

    by_env: dict[str, Policy]

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        return self.by_env[task.env](task, history, rng)


def run_envs(cfg: Config) -> RunEnvs:
    """The run's envs (`env`: one, or a list), after importing `env.plugins`."""
    load_plugins(cfg.env.plugins)
    entries = cfg.env.entries()
    where = (lambda k: "env") if len(entries) == 1 else (lambda k: f"env.mix.{k}")
    return RunEnvs(tuple(RunEnv(e, _entry_spec(e, where(k))) for k, e in enumerate(entries)))


def ray_slots(cfg: Config) -> float:
    """The CPUs the run's Ray actors reserve: learner ranks and rollout workers 1 each, env
    actors 0.25 each (`runtime.env_workers` per env, in the trainer and in each rollout worker)."""
    rt = cfg.runtime
    routes = len(cfg.env.entries())
    env_actors = rt.env_workers * routes * (1 + rt.rollout_workers) if rt.backend == "ray" else 0
    return (rt.learner_ranks if rt.learner_ranks > 1 else 0) + rt.rollout_workers + 0.25 * env_actors


def start_ray(cfg: Config, log: Callable[[str], None]) -> None:
    """Start this run's private local Ray with at least the CPUs its actors reserve
    (`ray_slots`), so a run that fits a laptop's memory is not refused for its core count: Ray's
    CPUs are scheduling slots, and the ranks and workers set their own thread counts. A joined
    cluster (`RAY_ADDRESS`), or a Ray this process started already, is left as it is."""
    rt = cfg.runtime
    if os.environ.get("RAY_ADDRESS") or not (rt.backend == "ray" or rt.learner_ranks > 1):
        return
    reserved = ray_slots(cfg)
    cores = os.cpu_count() or 1
    slots = max(cores, math.ceil(reserved))
    if slots > cores:
        log(f"ray: a local instance of {slots} CPU slots on {cores} cores (the actors reserve {reserved:g})")
    from steprl.hosting.ray_backend import ensure_ray  # noqa: PLC0415 - Ray, only when the run uses it

    ensure_ray(num_cpus=slots)


@contextlib.contextmanager
def env_pool(cfg: Config) -> Iterator[EnvPool]:
    """The env pool over `runtime.backend` (one backend per env when the run has several),
    closed however the block ends."""
    routes = [EnvRoute(e.key, e.name, e.params) for e in cfg.env.entries()]
    backend = make_backends(routes, cfg.runtime, tuple(cfg.env.plugins))
    envs = EnvPool(backend, cfg.runtime.max_concurrent_envs)
    try:
        yield envs
    finally:
        envs.close()


def budgets(cfg: Config) -> tuple[int, int, int]:
    """(max_turns, max_tokens_per_turn, max_total_tokens) of `rollout`: RL, eval and demos alike."""
    r = cfg.rollout
    return r.max_turns, r.max_tokens_per_turn, r.max_total_tokens


def system_prompt_mode(cfg: Config) -> str:
    """`rollout.system_prompt` with "auto" resolved: "none" for the tiny model, else "env"."""
    mode = cfg.rollout.system_prompt
    if mode == "auto":
        return "none" if cfg.model.name == "tiny" else "env"
    return mode


def prompt_format(cfg: Config, tokenizer: Any) -> PromptFormat:
    """`model.format`: "chat" (the tokenizer's template, exact deltas), "plain" (BOS + text), or
    "auto": chat when the tokenizer has a template (the tiny one has none)."""
    kind = cfg.model.format
    if kind == "auto":
        kind = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if kind == "chat":
        return ChatFormat(tokenizer, system_prompt=system_prompt_mode(cfg))
    return PlainFormat(tokenizer, system_prompt=system_prompt_mode(cfg))


class TemplateMismatch(UserError):
    """The chat template does not render incrementally as it renders whole (see check-template)."""


#: Context rules whose rows follow the incremental stream: the ones the template check is for.
_CHECKED_RULES = ("append_only", "keep_thinking", "strip_thinking")


def check_prompt_format(fmt: PromptFormat, cfg: Config, log: Callable[[str], None] = print) -> bool:
    """Run the template checker for the run's context rule before any work. Returns True when
    training must use one row per turn: the check failed and `rollout.template_mismatch` is
    "per_turn". A failed check is refused otherwise, in one line saying where and what to set."""
    from steprl.rollout.template_check import check_template, startup_conversations

    ctx = cfg.rollout.context
    if not isinstance(fmt, ChatFormat) or ctx not in _CHECKED_RULES:
        return False
    report = check_template(fmt, startup_conversations(ctx), context=ctx)
    log(f"chat template check: {report.summary()}")
    if report.ok:
        return False
    if cfg.rollout.template_mismatch == "per_turn":
        log(
            "  rollout.template_mismatch=per_turn: training one row per turn, each on the prompt it was shown"
        )
        return True
    raise TemplateMismatch(
        f"the chat template of {cfg.model.name!r} fails the incremental-render check "
        f"({report.breaks[0].describe()}); set rollout.template_mismatch=per_turn to train one row "
        "per turn on exactly what the engine was shown, or fix the template (model.chat_template)"
        + (
            "; for a template that strips earlier reasoning use rollout.context=strip_thinking"
            if ctx != "strip_thinking"
            else ""
        )
    )


def check_env_starts(envs: EnvPool, run: RunEnvs, cfg: Config, log: Callable[[str], None] = print) -> None:
    """Reset one env of each of the run's envs on its first train task and close it, before any
    work. An env that says it cannot start (a `UserError`: an MCP server that exits at start-up,
    with its stderr; a bad command) stops the run here, as one line. Any other failure is logged
    and the run goes on: a flaky env is the failure budget's business (`runtime.failure_budget`)."""
    for key, split in run.splits("train", cfg.run.seed).items():
        task = next(iter(islice(split(), 1)), None)
        if task is None:
            raise EnvStartError(f"env {key!r} has no train tasks; check its task_params or task_file")

        async def first_reset(task: Task = task) -> None:
            env = envs.make_env(task)
            try:
                await maybe_await(env.reset(task, task.seed))
            finally:
                await maybe_await(env.close())

        try:
            asyncio.run(first_reset())
        except UserError:
            raise
        except Exception as exc:
            log(
                f"WARNING: env {key!r} failed its first reset (task {task.id!r}): "
                f"{type(exc).__name__}: {exc}; failed episodes are counted in end/infra_failed"
            )
