"""What the trainer does with the health levers (`training/loop/health_run.py`): the learning rate,
the entropy bonus and the KL coefficient it sets on the learner every step, the KL in the reward
it scales, and the group filter's strength; `kl_scale` on a run without a KL term is refused."""

from __future__ import annotations

import copy
import io
import json
from types import SimpleNamespace

import pytest
import torch

from steprl.config import ConfigError, load_config
from steprl.training.controllers import Adjustments
from steprl.training.learn.learner import LocalLearner
from steprl.training.loop.health_run import group_filter
from steprl.training.loop.levers import LEVERS
from tiny_runs import make_learner


def _learner(model: torch.nn.Module) -> LocalLearner:
    return make_learner(copy.deepcopy(model))


class _Run:
    """The loop state the levers read and set (the trainer's `_Run`, without the loop)."""

    def __init__(self, cfg, learner) -> None:
        self.cfg, self.parts = cfg, SimpleNamespace(learner=learner, group_filter=None)
        self.settings, self.reward_kl_coef = Adjustments(), cfg.algorithm.kl_coef


def _before(run: _Run, settings: Adjustments) -> _Run:
    run.settings = settings
    for name in ("lr_scale", "entropy_coef", "kl_coef", "kl_scale"):
        LEVERS[name].apply(run, 1, ())  # type: ignore[arg-type]
    return run


def test_the_levers_set_the_learning_rate_entropy_bonus_and_kl_every_step(small_model):
    learner = _learner(small_model)
    cfg = load_config(None, ["trainer.lr=1e-3", "algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.001"])
    run = _before(_Run(cfg, learner), Adjustments(lr_scale=0.25, kl_scale=2.0, entropy_coef=0.02))
    assert [g["lr"] for g in learner.optimizer.param_groups] == [pytest.approx(2.5e-4)] * len(
        learner.optimizer.param_groups
    )
    assert learner.reg.entropy_coef == 0.02 and learner.reg.kl_coef == pytest.approx(0.2)
    assert run.reward_kl_coef == 0.1  # the KL is in the loss: the reward's coefficient untouched
    _before(run, Adjustments())  # no lever: the config's values again
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert learner.reg.entropy_coef == 0.001 and learner.reg.kl_coef == pytest.approx(0.1)

    in_reward = load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_in=reward"])
    run = _before(_Run(in_reward, learner), Adjustments(kl_scale=3.0))
    assert run.reward_kl_coef == pytest.approx(0.3) and learner.reg.kl_coef == 0.0
    adaptive = Adjustments(kl_coef=0.05, kl_scale=3.0)  # an adaptive controller's value, scaled
    assert _before(run, adaptive).reward_kl_coef == pytest.approx(0.15)


def test_the_filter_lever_drops_groups_whose_rewards_barely_differ():
    def keep_all(rewards: list[torch.Tensor]) -> torch.Tensor:
        return torch.arange(len(rewards))

    rewards = [
        torch.tensor([1.0, 1.0, 1.01, 1.0]),
        torch.tensor([0.0, 1.0, 0.0, 1.0]),
        torch.tensor([2.0] * 4),
    ]
    assert group_filter(keep_all, None) is keep_all  # no lever: the configured filter
    kept = group_filter(keep_all, 0.05)(rewards)
    assert kept.tolist() == [1]


def test_kl_scale_on_a_run_without_a_kl_term_is_refused():
    rule = "[{name: r, when: [{signal: approx_kl, above: 1}], actions: [{kl_scale: {factor: 2}}]}]"
    with pytest.raises(ConfigError, match="kl_scale scales algorithm.kl_coef, which is 0"):
        load_config(None, [f"health.rules={rule}"])
    assert load_config(None, [f"health.rules={rule}", "algorithm.kl_coef=0.1"]).health.enabled


@pytest.mark.parametrize("replay", [True, False])
def test_a_rollback_serves_the_undone_steps_tasks_again_or_skips_them(tmp_path, replay):
    from cli_runs import TINY_SCRATCH
    from steprl.diagnostics import read_trajectories
    from steprl.training.loop.trainer import train

    rule = (
        "[{name: undo, when: [{signal: approx_kl, above: -1}], steps: 2, budget: 1, then: alert,"
        f" cooldown: 10, actions: [{{rollback: {{k: 1, replay: {str(replay).lower()}}}}}]}}]"
    )
    sets = [
        *TINY_SCRATCH,
        "trainer.total_steps=3",
        "logging.save_trajectories=true",
        "logging.tensorboard=false",
    ]
    cfg = load_config(
        "configs/calculator_tiny.yaml", [*sets, f"run.output_dir={tmp_path}", f"health.rules={rule}"]
    )
    run_dir = train(cfg, log=lambda _: None).run_dir
    fired = [json.loads(line) for line in (run_dir / "health.jsonl").read_text().splitlines()]
    assert [(f["step"], f["rule"]) for f in fired] == [(2, "undo")]
    assert "restored the weights of step 1" in fired[0]["outcome"], fired
    table = read_trajectories(run_dir / "trajectories")
    tasks = {
        s: sorted(
            set(
                t
                for t, st in zip(table["task_id"].to_pylist(), table["step"].to_pylist(), strict=True)
                if st == s
            )
        )
        for s in (1, 2, 3)
    }
    assert len(tasks[2]) == 2 and not set(tasks[1]) & set(tasks[2])
    if replay:  # step 2 was undone: step 3 trains on its tasks again
        assert tasks[3] == tasks[2]
    else:
        assert not set(tasks[3]) & (set(tasks[1]) | set(tasks[2]))


def test_the_ring_serves_each_undone_steps_tasks_once_and_round_trips(small_model):
    """`rollback {k: 2, replay: true}` reads the tasks of the kept steps after the one restored;
    those steps are dropped from the ring, so a second rollback neither restores weights the
    first undid nor serves their tasks twice; the ring's state (tasks as plain data) loads back
    with `weights_only=True`."""
    from steprl.training.learn.health_snapshots import SnapshotRing
    from steprl.types import Task

    ring = SnapshotRing(_learner(small_model), size=4)
    task = {i: Task(f"t{i}", "q", "calculator", params={"i": i}) for i in range(12)}
    for step in range(1, 5):  # steps 1-4 took tasks 2s-2 and 2s-1
        ring.capture(step, [(2 * step - 2, task[2 * step - 2]), (2 * step - 1, task[2 * step - 1])])
    assert ring.restore(2, 4) == 2 and [i for i, _ in ring.trained_after(2)] == []  # 3, 4 dropped
    assert ring.steps == [1, 2]
    ring.capture(5, ())  # the rollback's step: the restored weights, its tasks requeued
    ring.capture(6, [(4, task[4]), (5, task[5])])  # a replayed step
    assert [i for i, _ in ring.trained_after(1)] == [2, 3, 4, 5]  # each once
    buffer = io.BytesIO()
    torch.save(ring.state_dict(), buffer)
    again = SnapshotRing(_learner(small_model), size=4)
    again.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert again.steps == ring.steps and again.trained_after(1) == ring.trained_after(1)


def test_every_lever_has_a_phase_the_trainer_calls():
    from steprl.training.loop.levers import PHASES, check_levers

    check_levers()
    assert {lever.phase for lever in LEVERS.values()} == set(PHASES)
    broken = {
        "snapshot_ring": LEVERS["snapshot_ring"],
        **{k: v for k, v in LEVERS.items() if k != "snapshot_ring"},
    }
    with pytest.raises(AssertionError, match="captures after a rollback"):
        check_levers(broken)
    with pytest.raises(AssertionError, match=r"no lever applying them: \['stop'\]"):
        check_levers({k: v for k, v in LEVERS.items() if k != "stop"})
