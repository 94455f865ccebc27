"""EnvPool (one instance per trajectory, bounded concurrency) and the per-step failure budget.

Reliability cases: ENV-11 (env bug vs invalid action) and ENV-12 (30% of a batch infra-fails:
the step is skipped with an alert, no NaN from empty groups), in-process; the conformance suite
runs the env-level cases against HTTP and Ray as well.
"""

from __future__ import annotations

import asyncio
import math
from itertools import islice

import pytest
import torch

from step_helpers import SyncSource
from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.base import Observation, Transition
from steprl.envs.library.calculator import CalculatorEnv
from steprl.envs.registry import ENVS, EnvSpec, get_spec, make_tasks, register
from steprl.hosting.backend import InProcessBackend
from steprl.hosting.pool import EnvPool
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.training.loop.step_batch import collect_groups
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Task, Trajectory


class _SlowEnv:
    """An async env whose steps take a little while, so episodes overlap."""

    stop_strings = ("</answer>",)
    system_prompt = ""

    async def reset(self, task: Task, seed: int) -> Observation:
        await asyncio.sleep(0.002)
        return Observation(task.prompt)

    async def step(self, action: str) -> Transition:
        await asyncio.sleep(0.002)
        return Transition("", 1.0, True, info={"action_kind": "answer"})

    async def close(self) -> None:
        await asyncio.sleep(0)


class _Backend:
    name = "test"

    def __init__(self, factory) -> None:
        self.factory = factory
        self.made = 0

    def make_env(self, task: Task):
        self.made += 1
        return self.factory()

    def close(self) -> None:
        pass


def _setup(make_env, tokenizer, responses=("<answer>1</answer>",)) -> RolloutSetup:
    return RolloutSetup(
        make_env=make_env,
        engine=ScriptedEngine(list(responses), lambda s: tokenizer.encode(s, add_special_tokens=False)),
        fmt=PlainFormat(tokenizer),
        rule=AppendOnly(),
        sampling=SamplingParams(),
        budgets=Budgets(max_turns=3, max_tokens_per_turn=32),
    )


def _tasks(n: int) -> list[Task]:
    return list(islice(make_tasks("calculator", "train", 0), n))


def test_pool_bounds_live_instances_and_frees_every_slot(tokenizer) -> None:
    backend = _Backend(_SlowEnv)
    pool = EnvPool(backend, max_concurrent=4)
    setup = _setup(pool.make_env, tokenizer)
    # two separate event loops, as the trainer uses one per rollout phase
    for seed in (0, 1):
        groups = asyncio.run(rollout_groups(_tasks(10), 4, setup, seed=seed))
        assert all(t.end is EndReason.ANSWERED for g in groups for t in g.trajectories)
    assert 1 < pool.peak <= 4
    assert pool.live == 0
    assert backend.made == 80  # one fresh instance per trajectory


def test_pool_frees_the_slot_when_reset_or_creation_fails(tokenizer) -> None:
    class Broken(_SlowEnv):
        async def reset(self, task: Task, seed: int) -> Observation:
            raise ConnectionError("server gone")

    def fails_to_build():
        raise RuntimeError("no capacity")

    for factory in (Broken, fails_to_build):
        pool = EnvPool(_Backend(factory), max_concurrent=2)
        groups = asyncio.run(rollout_groups(_tasks(3), 3, _setup(pool.make_env, tokenizer), seed=0))
        ends = {t.end for g in groups for t in g.trajectories}
        assert ends == {EndReason.INFRA_FAILED}
        assert pool.live == 0


def test_pool_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="max_concurrent_envs"):
        EnvPool(InProcessBackend("calculator", {}), 0)


class _BuggyCalculator(CalculatorEnv):
    """A calculator whose tool crashes (an env bug) on any expression containing '7'."""

    def step(self, action: str) -> Transition:
        if "<calc>" in action and "7" in action:
            raise ZeroDivisionError("internal bug in the env: secret-host:1234 unreachable")
        return super().step(action)


def test_env11_env_bug_is_infra_failed_but_invalid_action_is_an_observation(tokenizer) -> None:
    task = Task("t", "What is 3+4?", "calculator", answer="7")
    pool = EnvPool(_Backend(_BuggyCalculator), max_concurrent=8)

    invalid = asyncio.run(
        rollout_groups(
            [task], 1, _setup(pool.make_env, tokenizer, ["what is this?", "<answer>7</answer>"]), seed=0
        )
    )[0].trajectories[0]
    assert invalid.end is EndReason.ANSWERED  # the episode went on after the error observation
    assert invalid.steps[0].info["action_kind"] == "invalid"
    assert "error" in PlainFormat(tokenizer).decode(invalid.steps[0].observation_ids).lower()

    bug = asyncio.run(
        rollout_groups([task], 1, _setup(pool.make_env, tokenizer, ["<calc>3+4*7</calc>"]), seed=0)
    )[0].trajectories[0]
    assert bug.end is EndReason.INFRA_FAILED and not bug.trainable
    assert "ZeroDivisionError" in str(bug.info["error"])
    assert bug.steps == ()  # the failing step never became a (model-visible) step
    assert bug.outcome_reward == 0.0


def _traj(group: str, reward: float, end: EndReason) -> Trajectory:
    from steprl.types import Step

    step = Step((1,), (2,), (0.0,), (), reward, 0, {"action_kind": "answer"})
    return Trajectory(group, group, "calculator", (step,) if end is EndReason.ANSWERED else (), reward, end)


def _fake_rollout(fail_frac: float):
    """A rollout function whose first `fail_frac` of every group infra-fails."""

    def run(tasks, group_size, first_index):
        groups = []
        for t_index, task in enumerate(tasks):
            n_fail = round(fail_frac * group_size)
            ends = [EndReason.INFRA_FAILED] * n_fail + [EndReason.ANSWERED] * (group_size - n_fail)
            groups.append(
                Group(task, tuple(_traj(f"g{t_index}", float(i % 2), e) for i, e in enumerate(ends)))
            )
        return groups

    return run


def _collect(fail_frac: float, budget: float):
    return collect_groups(
        SyncSource(StreamSource(lambda: iter(_tasks(100))), _fake_rollout(fail_frac), 10),
        tasks_per_step=4,
        group_filter=lambda rewards: torch.arange(len(rewards)),
        regenerations=0,
        failure_budget=budget,
    )


def test_env12_over_budget_batch_is_not_trained_on() -> None:
    over = _collect(0.3, budget=0.25)
    assert over.kept == []
    assert over.metrics["filter/skipped_step"] == 1.0
    assert over.metrics["infra/over_budget_rounds"] == 1.0
    assert over.metrics["infra/failed_frac"] == pytest.approx(0.3)
    assert len(over.rollouts) == 40  # every trajectory is still counted

    within = _collect(0.3, budget=0.5)
    assert len(within.kept) == 4
    assert all(t.trainable for g in within.kept for t in g.trajectories)
    assert all(len(g.trajectories) == 7 for g in within.kept)


def test_env12_all_failed_groups_vanish_instead_of_giving_nan() -> None:
    everything = _collect(1.0, budget=1.0)
    assert everything.kept == []  # no empty group reaches the advantage estimator
    assert everything.metrics["filter/skipped_step"] == 1.0


class _FlakyCalculator(CalculatorEnv):
    """A calculator whose reset fails for ~30% of (task, seed) pairs, deterministically."""

    def reset(self, task: Task, seed: int) -> Observation:
        if seed % 10 < 3:
            raise ConnectionResetError("env server connection reset")
        return super().reset(task, seed)


@pytest.fixture
def flaky_env():
    calc = get_spec("calculator")
    spec = EnvSpec("flaky_calculator", _FlakyCalculator, calc.tasks, calc.strategies, calc.max_turns)
    register(spec, replace=True)
    yield spec.name
    ENVS.pop(spec.name, None)


@pytest.mark.e2e
def test_env12_training_skips_over_budget_steps_with_an_alert(tmp_path, flaky_env) -> None:
    from steprl.config import load_config
    from steprl.training.loop.trainer import train

    cfg = load_config(
        "configs/calculator_tiny.yaml",
        [
            f"env.name={flaky_env}",
            "model.init=scratch",
            "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1",
            "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=64",
            "rollout.tasks_per_step=4",
            "rollout.group_size=10",
            "rollout.max_turns=2",
            "rollout.max_tokens_per_turn=8",
            "trainer.total_steps=2",
            "trainer.eval_tasks=4",
            "trainer.eval_every=0",
            "runtime.failure_budget=0.2",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.save_trajectories=false",
            f"run.output_dir={tmp_path}",
        ],
    )
    lines: list[str] = []
    result = train(cfg, log=lines.append)
    alerts = [line for line in lines if line.startswith("ALERT")]
    assert len(alerts) == 2
    for m in result.history:
        assert m["filter/skipped_step"] == 1.0
        assert m["policy/version"] == 0.0  # no update from a broken batch
        assert m["traj/in"] == m["traj/out"] == 40
        assert m["end/infra_failed"] > 0.2 * 40
        assert all(math.isfinite(v) for v in m.values())
