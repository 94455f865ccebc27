"""NUM-01..04 (reliability.md): non-finite losses and gradients, gradient spikes, non-finite
rewards, empty batches; and the run-level guards that stop a run (non-finite streak, failing
infrastructure, an evaluation that mostly failed)."""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import replace

import pytest
import torch

from cli_runs import train_hang_env
from step_helpers import SyncSource
from steprl.algorithms import POLICY_LOSSES
from steprl.algorithms.advantages import grpo
from steprl.envs.base import Observation
from steprl.envs.library.calculator import CalculatorEnv
from steprl.envs.registry import ENVS, EnvSpec, get_spec, register
from steprl.errors import RunAborted
from steprl.training.learn.learner import LocalLearner
from steprl.training.loop.held_out import describe_eval
from steprl.training.loop.step_batch import collect_groups, valid
from steprl.training.loop.trainer import train
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Step, Task, Trajectory
from tiny_runs import small_config


def _learner(model, loss_fn=None, grad_clip=1.0):
    spec = POLICY_LOSSES["ppo_clip"]
    return LocalLearner(
        copy.deepcopy(model),
        policy_loss=loss_fn or functools.partial(spec.fn),
        needs_proximal=False,
        aggregation="token-mean",
        loss_scale_factor=None,
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        grad_clip=grad_clip,
        micro_batch_size=8,
        pad_id=0,
        temperature=1.0,
        grad_spike_norm=100.0 * grad_clip,
    )


def _nan_loss(inputs, clip_low: float = 0.2, clip_high: float = 0.2):
    out = POLICY_LOSSES["ppo_clip"].fn(inputs, clip_low=clip_low, clip_high=clip_high)
    return replace(out, loss_per_token=out.loss_per_token * float("nan"))


def _spike_loss(inputs, clip_low: float = 0.2, clip_high: float = 0.2):
    out = POLICY_LOSSES["ppo_clip"].fn(inputs, clip_low=clip_low, clip_high=clip_high)
    return replace(out, loss_per_token=out.loss_per_token * 1e6)


def _params(learner):
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def _update(learner, rows, mini_batches=2):
    return learner.update(
        rows, epochs=1, mini_batches=mini_batches, generator=torch.Generator().manual_seed(0)
    )


def test_num01_a_nan_loss_skips_the_step_and_leaves_parameters_and_optimizer_unchanged(
    small_model, advantage_rows
):
    rows = advantage_rows
    learner = _learner(small_model, _nan_loss)
    before = _params(learner)
    stats = _update(learner, rows)
    assert stats["actor/nonfinite_skips"] == 2 and stats["actor/optimizer_steps"] == 0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    assert learner.optimizer.state_dict()["state"] == {}  # AdamW never stepped: no moments, no count
    assert all(math.isfinite(v) or k == "actor/pg_loss" for k, v in stats.items())


def test_num01_an_inf_in_one_gradient_skips_that_step_only(small_model, advantage_rows):
    rows = advantage_rows
    learner = _learner(small_model)
    weight = next(p for p in learner.model.parameters() if p.requires_grad)
    calls = [0]

    def poison_first(grad):
        calls[0] += 1
        return grad.index_fill(0, torch.tensor([0]), float("inf")) if calls[0] == 1 else grad

    weight.register_hook(poison_first)
    before = _params(learner)
    stats = _update(learner, rows)
    assert stats["actor/nonfinite_skips"] == 1 and stats["actor/optimizer_steps"] == 1
    assert any(not torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())


def test_num02_a_gradient_spike_is_clipped_and_flagged(small_model, advantage_rows):
    rows = advantage_rows
    plain = _learner(small_model)
    base = _update(plain, rows, mini_batches=1)
    spiky = _learner(small_model, _spike_loss)  # every gradient x 1e6
    applied: list[float] = []  # the norm of the gradient the optimizer actually steps with
    real_step = spiky.optimizer.step

    def step(*args, **kwargs):
        applied.append(
            float(torch.norm(torch.stack([p.grad.norm() for p in spiky.params if p.grad is not None])))
        )
        return real_step(*args, **kwargs)

    spiky.optimizer.step = step  # type: ignore[method-assign]
    stats = _update(spiky, rows, mini_batches=1)
    assert stats["actor/grad_spikes"] == 1 and base["actor/grad_spikes"] == 0
    assert stats["actor/grad_norm"] == pytest.approx(base["actor/grad_norm"] * 1e6, rel=1e-3)  # pre-clip
    assert applied == [pytest.approx(1.0, rel=1e-5)]  # clipped to trainer.grad_clip


def _traj(group: str, reward: float, step_reward: float | None = None) -> Trajectory:
    step = Step((1,), (2,), (0.0,), (), reward if step_reward is None else step_reward, 0, {})
    return Trajectory(group, group, "calculator", (step,), reward, EndReason.ANSWERED)


def test_num03_nonfinite_rewards_invalidate_the_trajectory_and_a_constant_group_gets_zero_advantage():
    def rollout(tasks, group_size, first_index):
        rewards = [[float("nan"), 1.0, 0.0, 1.0], [float("inf"), 1.0, 1.0, 1.0]]
        groups = [Group(t, tuple(_traj(f"g{i}", r) for r in rewards[i])) for i, t in enumerate(tasks)]
        groups[1] = Group(groups[1].task, (*groups[1].trajectories[:3], _traj("g1", 1.0, float("-inf"))))
        return groups

    tasks = StreamSource(lambda: iter([Task(f"t{i}", "q", "calculator") for i in range(4)]))
    out = collect_groups(
        SyncSource(tasks, rollout, 4),
        tasks_per_step=2,
        group_filter=lambda r: torch.arange(len(r)),
        regenerations=0,
    )
    assert out.metrics["invalid/nonfinite_reward"] == 3
    assert [len(g.trajectories) for g in out.kept] == [3, 2]
    assert all(valid(t) for g in out.kept for t in g.trajectories)
    rewards = torch.tensor([t.outcome_reward for g in out.kept for t in g.trajectories])
    index = torch.tensor([0, 0, 0, 1, 1])
    a = grpo(rewards, index)  # the constant group {1, 1}: zero advantages, no NaN
    assert torch.isfinite(a).all() and torch.equal(a[3:], torch.zeros(2))


def test_num04_a_batch_with_nothing_trainable_is_skipped_cleanly():
    def rollout(tasks, group_size, first_index):
        failed = Trajectory("t", "g", "calculator", (), 0.0, EndReason.INFRA_FAILED, {"error": "gone"})
        return [Group(t, (failed,) * group_size) for t in tasks]

    out = collect_groups(
        SyncSource(StreamSource(lambda: iter([Task("t", "q", "calculator")] * 4)), rollout, 3),
        tasks_per_step=2,
        group_filter=lambda r: torch.arange(len(r)),
        regenerations=0,
    )
    assert out.kept == [] and out.metrics["filter/skipped_step"] == 1.0


# ---- the run stops: non-finite streak, failing infrastructure; evaluations that failed -------


@pytest.fixture
def nan_loss():
    spec = POLICY_LOSSES["ppo_clip"]
    POLICY_LOSSES["nan_test_loss"] = replace(spec, fn=_nan_loss)
    yield "nan_test_loss"
    POLICY_LOSSES.pop("nan_test_loss")


@pytest.mark.e2e
def test_num01_k_nonfinite_steps_in_a_row_abort_with_one_line(tmp_path, nan_loss):
    cfg = small_config(
        tmp_path,
        "nan",
        [
            f"algorithm.policy_loss={nan_loss}",
            "trainer.total_steps=6",
            "trainer.checkpoint_every=1",
            "trainer.max_nonfinite_skips=2",
            "trainer.eval_every=0",
            "model.init=scratch",
        ],
    )
    with pytest.raises(RunAborted) as err:
        train(cfg, log=lambda s: None)
    msg = str(err.value)
    assert (
        msg.startswith("stopped at step 2: 2 steps in a row had a NaN/Inf loss or gradient")
        and "\n" not in msg
    )
    assert "the last good checkpoint is" in msg and "step_000001" in msg
    # as a signal: the step it stopped at is saved, and the last good checkpoint stays beside it
    assert (tmp_path / "runs" / "nan" / "checkpoints" / "step_000001").is_dir()
    assert (tmp_path / "runs" / "nan" / "checkpoints" / "step_000002").is_dir()


class _DeadCalculator(CalculatorEnv):
    def reset(self, task: Task, seed: int) -> Observation:
        raise ConnectionResetError("env server connection reset by peer")


@pytest.fixture
def dead_env():
    calc = get_spec("calculator")
    register(
        EnvSpec("dead_calculator", _DeadCalculator, calc.tasks, calc.strategies, calc.max_turns), replace=True
    )
    yield "dead_calculator"
    ENVS.pop("dead_calculator", None)


@pytest.mark.e2e
def test_failing_infrastructure_stops_the_run_naming_backend_and_error(tmp_path, dead_env):
    cfg = small_config(
        tmp_path,
        "dead",
        [
            f"env.name={dead_env}",
            "model.init=scratch",
            "trainer.total_steps=10",
            "runtime.max_failed_steps=2",
            "trainer.eval_every=0",
        ],
    )
    lines: list[str] = []
    with pytest.raises(RunAborted) as err:
        train(cfg, log=lines.append)
    msg = str(err.value)
    # the evaluation at step 0 fails too: the run stops before any RL step (issue 44, item 15;
    # the failure budget over steps: test_num03 below)
    assert msg.startswith("stopped before training: the evaluation at step 0 failed: 8/8 held-out episodes")
    assert "backend inprocess" in msg and "ConnectionResetError" in msg and "connection reset by peer" in msg
    assert any(line.startswith("warm start: eval failed: 8/8 episodes infra_failed") for line in lines)


def test_an_evaluation_that_mostly_failed_says_so_instead_of_a_success_rate():
    m = {"eval/success": 0.0, "eval/tool_call_rate": 0.0, "eval/infra_failed": 20.0, "eval/tasks": 20.0}
    assert describe_eval(m) == "eval failed: 20/20 episodes infra_failed"
    m |= {"eval/infra_failed": 2.0, "eval/success": 0.5}
    assert describe_eval(m).startswith("held-out success 0.500")


@pytest.mark.e2e
def test_num03_a_run_whose_rewards_are_all_nan_stops_k_steps_in_a_row_with_one_line(tmp_path):
    """Issue 23, item 10: before, every step was skipped and the run exited 0 with no ALERT. A
    NaN reward breaks the env contract: its trajectory ends infra_failed (counted in
    infra/invalid/reward_not_finite), each step over the failure budget is an ALERT, and
    `runtime.max_failed_steps` of them in a row stop the run, non-zero, in one line."""
    rc, out = train_hang_env(
        tmp_path,
        "env.params={bad_on: train, reward_as: nan}",
        "runtime.max_failed_steps=2",
        "trainer.total_steps=10",
    )
    lines = out.splitlines()
    assert rc == 1 and "Traceback" not in out, out
    assert [line.split(":")[0] for line in lines if line.startswith("ALERT")] == [
        "ALERT step 1",
        "ALERT step 2",
    ]
    assert lines[-1].startswith(
        "stopped at step 2: 2 steps in a row had more than 25% of trajectories fail"
    ), out
    assert "ContractError: reward=nan; it must be a finite float" in lines[-1], out
