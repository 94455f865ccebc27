"""One conformance suite for every place an environment can live: in-process, HTTP, Ray.

Every test takes the `backend_name` parameter and builds its envs through
`steprl.hosting.backend.make_backend` (what the trainer does), so the same assertions hold for
an env in the trainer, behind `steprl serve-env` on loopback, and in Ray actors. Reference
transitions come from the registered factory, called directly.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from itertools import islice
from typing import Any

import pytest

from steprl.config import RuntimeSection
from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.base import Env, maybe_await
from steprl.envs.registry import get_spec, make_tasks
from steprl.hosting.backend import EnvBackend, make_backend
from steprl.hosting.pool import EnvPool
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.types import EndReason, Task

BACKENDS = ("inprocess", "http", "ray")
_COMPARED_INFO = ("action_kind", "reward_components", "state_hash")

# ----------------------------------------------------------------------------------------------
# backends, built once per module per (backend, env)


@pytest.fixture(scope="module")
def backends(request) -> Iterator[dict[tuple[str, str], EnvBackend]]:
    made: dict[tuple[str, str], EnvBackend] = {}
    yield made
    for backend in made.values():
        backend.close()


@pytest.fixture(params=BACKENDS)
def backend_name(request) -> str:
    return request.param


@pytest.fixture
def backend_for(backends, backend_name):
    runtime = RuntimeSection(backend=backend_name, env_workers=2, env_call_timeout_s=20.0)

    def get(env: str) -> EnvBackend:
        key = (backend_name, env)
        if key not in backends:
            backends[key] = make_backend(env, {}, runtime)
        return backends[key]

    return get


def _episode(env: Env, task: Task, policy: Any, seed: int) -> list[tuple[Any, ...]]:
    """Drive one episode with a scripted policy through the Env protocol; the record of it."""

    async def run() -> list[tuple[Any, ...]]:
        try:
            first = await maybe_await(env.reset(task, seed))
            record: list[tuple[Any, ...]] = [("reset", first.text, tuple(env.stop_strings))]
            history: list[tuple[str, str]] = []
            rng = random.Random(seed)
            for _ in range(12):
                action = policy(task, history, rng)
                t = await maybe_await(env.step(action))
                info = {k: v for k, v in t.info.items() if k in _COMPARED_INFO}
                record.append((action, t.observation, t.reward, t.terminated, t.truncated, info))
                history.append((action, t.observation))
                if t.terminated or t.truncated:
                    break
            return record
        finally:
            await maybe_await(env.close())

    return asyncio.run(run())


def _reference(env_name: str, task: Task, policy: Any, seed: int) -> list[tuple[Any, ...]]:
    return _episode(get_spec(env_name).factory(), task, policy, seed)


# ----------------------------------------------------------------------------------------------
# the suite


@pytest.mark.parametrize("env_name", ["calculator", "echo"])
@pytest.mark.parametrize("strategy", ["expert", "random"])
def test_transitions_equal_the_in_process_factory(backend_for, env_name, strategy) -> None:
    backend = backend_for(env_name)
    spec = get_spec(env_name)
    for task in islice(make_tasks(env_name, "train", 3), 4):
        got = _episode(backend.make_env(task), task, spec.strategies[strategy], task.seed)
        assert got == _reference(env_name, task, spec.strategies[strategy], task.seed)


def test_env09_stateful_apps_are_deterministic_and_isolated(backend_for) -> None:
    """ENV-08/09 through the backend: the same task gives the same observations and final state
    hash as in-process, twice, with instances of the same world alive at the same time."""
    backend = backend_for("apps")
    expert = get_spec("apps").strategies["expert"]
    tasks = list(islice(make_tasks("apps", "train", 5), 3))
    open_envs = [backend.make_env(t) for t in tasks]  # distinct live instances of the same worlds
    for task, env in zip(tasks, open_envs, strict=True):
        first = _episode(env, task, expert, task.seed)
        again = _episode(backend.make_env(task), task, expert, task.seed)
        assert first == again == _reference("apps", task, expert, task.seed)
        assert first[-1][-1]["state_hash"]  # the final state hash came back through the backend


def test_invalid_action_is_an_observation_and_env_error_is_infra_failed(tokenizer, backend_for) -> None:
    """ENV-11 through the real agent loop: the model's malformed action is shown to it; an
    exception inside the env (here `apps` reset with a task it cannot load) ends the trajectory
    `infra_failed`, with the error kept out of every observation."""
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    fmt = PlainFormat(tokenizer)

    def setup(env: str, script: list[str]) -> RolloutSetup:
        pool = EnvPool(backend_for(env), max_concurrent=8)
        return RolloutSetup(
            pool.make_env,
            ScriptedEngine(script, encode),
            fmt,
            AppendOnly(),
            SamplingParams(),
            Budgets(max_turns=3, max_tokens_per_turn=40),
        )

    task = next(make_tasks("calculator", "train", 0))
    invalid = asyncio.run(rollout_groups([task], 1, setup("calculator", ["hello?"]), seed=0))
    steps = invalid[0].trajectories[0].steps
    assert [s.info["action_kind"] for s in steps] == ["invalid"] * len(steps)
    assert invalid[0].trajectories[0].end in (EndReason.POLICY_ERROR, EndReason.TRUNCATED)

    broken = Task("apps-broken", "Send an email.", "apps", params={"changes": []})  # no "world"
    groups = asyncio.run(rollout_groups([broken] * 2, 2, setup("apps", ["<answer>done</answer>"]), seed=0))
    for traj in (t for g in groups for t in g.trajectories):
        assert traj.end is EndReason.INFRA_FAILED and not traj.trainable
        assert traj.steps == () and traj.outcome_reward == 0.0
        assert "world" in str(traj.info["error"])


def test_pool_bounds_live_instances_on_every_backend(tokenizer, backend_for) -> None:
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    pool = EnvPool(backend_for("echo"), max_concurrent=3)
    tasks = list(islice(make_tasks("echo", "train", 0, turns=2), 6))
    script = [f"<say>{w}</say>" for w in ("alpha", "charlie", "echo", "golf", "india")]
    setup = RolloutSetup(
        pool.make_env,
        ScriptedEngine(script, encode),
        PlainFormat(tokenizer),
        AppendOnly(),
        SamplingParams(),
        Budgets(max_turns=2, max_tokens_per_turn=24),
    )
    groups = asyncio.run(rollout_groups(tasks, 2, setup, seed=0))
    assert sum(len(g.trajectories) for g in groups) == 12
    assert all(t.end is not EndReason.INFRA_FAILED for g in groups for t in g.trajectories)
    assert 1 <= pool.peak <= 3 and pool.live == 0
