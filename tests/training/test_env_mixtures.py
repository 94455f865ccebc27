"""Several envs in one run (issue 26, item 3): `learning_progress` weights follow each env's change
in success with a floor; each env's share of the gradient is exact and leaves the update as it
was; task-level normalisation groups by the env key, so a x10 env weighs no more than a x1 one.
(The registry-wide contract, resume included, is `test_task_sources.py`'s checker.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from steprl.algorithms import POLICY_LOSSES, estimators
from steprl.config import AlgorithmSection
from steprl.rollout.views import packed_view
from steprl.training.learn.batching import collate
from steprl.training.learn.learner import LocalLearner
from steprl.training.loop.step_batch import advantage_inputs, postprocess
from steprl.training.sources import make_source, take
from steprl.training.sources.check import ENVS, synthetic_splits
from steprl.types import EndReason, Group, Step, Task, Trajectory


def _group(task: Task, wins: int, n: int = 4) -> Group:
    return Group(
        task,
        tuple(
            Trajectory(task.id, task.id, task.env, (), float(k < wins), EndReason.ANSWERED) for k in range(n)
        ),
    )


def test_learning_progress_draws_the_env_that_moves_and_keeps_the_floor():
    """env_a's success climbs 0 -> 1, env_b's stays at 0.5: env_a's weight rises toward
    (1 - floor) + floor * its share, env_b keeps floor * its configured share (2/3), and after a
    state round trip the weights and the draws are the same. With floor 1 it is `mixture`."""
    source = make_source("learning_progress", synthetic_splits(0), 0, {"floor": 0.3})
    assert source.metrics() == {
        f"source/weight/{ENVS[0]}": 1 / 3,
        f"source/weight/{ENVS[1]}": 2 / 3,
        f"source/progress/{ENVS[0]}": 0.0,
        f"source/progress/{ENVS[1]}": 0.0,
    }
    for step in range(8):
        for _, task in take(source, 12):
            source.observe(_group(task, min(4, step) if task.env == ENVS[0] else 2))
    w = source.weights()
    assert w == pytest.approx({ENVS[0]: 0.8, ENVS[1]: 0.3 * 2 / 3})
    drawn = [t.env for _, t in take(source, 300)]
    assert drawn.count(ENVS[0]) > 200  # ~0.8 of 300
    again = make_source("learning_progress", synthetic_splits(0), 0, {"floor": 0.3})
    again.load_state_dict(source.state_dict())
    assert again.weights() == source.weights() and take(again, 50) == take(source, 50)
    plain = [
        make_source(n, synthetic_splits(1), 1, p)
        for n, p in (("mixture", {}), ("learning_progress", {"floor": 1.0}))
    ]
    for s in plain:
        for _, task in take(s, 30):
            s.observe(_group(task, 3))
    assert take(plain[0], 100) == take(plain[1], 100)


def _learner(model):
    spec = POLICY_LOSSES["ppo_clip"]
    return LocalLearner(
        copy.deepcopy(model),
        policy_loss=functools.partial(spec.fn),
        needs_proximal=spec.needs_proximal,
        aggregation="token-mean",
        loss_scale_factor=None,
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        grad_clip=1e9,
        micro_batch_size=3,
        pad_id=0,
        temperature=1.0,
    )


def test_grad_share_is_each_envs_gradient_and_leaves_the_update_as_it_was(small_model, advantage_rows):
    """Rows of two envs: `grad_share/<env>` is ||g_e||^2 / sum ||g_e'||^2 with g_e the gradient
    of that env's rows under the mini-batch's denominators (computed here row set by row set),
    and the update's gradient is that of an update without envs (summed in another order)."""
    rows, envs = advantage_rows, ["x"] * 5 + ["y"] * 3  # 5 + 3: a micro-batch of 3 spans both
    n_tokens = float(sum(sum(r.loss_mask) for r in rows))
    n_seqs = float(sum(1 for r in rows if any(r.loss_mask)))
    probe, squared = _learner(small_model), {}
    for env in ("x", "y"):
        idx = [i for i, e in enumerate(envs) if e == env]
        probe.optimizer.zero_grad(set_to_none=True)
        probe._backward(collate([rows[i] for i in idx], 0), idx, None, None, None, n_tokens, n_seqs)
        squared[env] = sum(float(p.grad.double().square().sum()) for p in probe.params if p.grad is not None)
    split, whole = _learner(small_model), _learner(small_model)
    stats = split.update(
        rows, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(0), envs=envs
    )
    whole.update(rows, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(0))
    for env in ("x", "y"):
        assert abs(stats[f"grad_share/{env}"] - squared[env] / sum(squared.values())) < 1e-6
    for a, b in zip(split.params, whole.params, strict=True):  # the gradient the step took
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-5)


def _trajectory(env: str, group: str, reward: float) -> Trajectory:
    step = Step((1, 2), (3, 4, 5), (-0.1, -0.2, -0.3), (), reward, 0)
    return Trajectory(group, group, env, (step,), reward, EndReason.ANSWERED)


def test_task_normalize_groups_by_env_key_so_a_x10_env_weighs_as_a_x1_one():
    """Two entries of one env (keys `bandit_x1`, `bandit_x10`) in one batch, rewards 0/1 and 0/10:
    without per-env normalisation the x10 env's advantages are 10x; with it they are equal."""
    trajs = [
        _trajectory(env, f"{env}-{g}", scale * float(k == g))
        for env, scale in (("bandit_x1", 1.0), ("bandit_x10", 10.0))
        for g in range(2)
        for k in range(2)
    ]
    views = [packed_view(t, i) for i, t in enumerate(trajs)]
    x = advantage_inputs(trajs, views, torch.tensor([t.outcome_reward for t in trajs]), env_ids={})
    raw = estimators.dr_grpo(x)
    for normalize, ratio in ((False, 10.0), (True, 1.0)):
        out = postprocess(raw, x, AlgorithmSection(task_normalize=normalize))
        per_env = out.advantages.abs().sum(dim=1).reshape(2, 4).sum(dim=1)
        assert torch.isclose(per_env[1] / per_env[0], torch.tensor(ratio)), (normalize, per_env)


@pytest.mark.e2e
def test_learning_progress_resumes_bit_identical_and_logs_its_weights(tmp_path):
    """Mid-mixture: 2 steps straight against 1 + resume + 1 (the source's averages in the
    checkpoint); every step logs each env's weight, and every step with both envs each one's
    gradient share."""
    from test_resume import MIXTURE, _quiet, _rows, assert_same_run

    from steprl.training.loop.trainer import train
    from tiny_runs import small_config

    base = ["trainer.total_steps=2", "trainer.eval_every=1", f"env.mix={MIXTURE}"]
    base += ["env.source=learning_progress", "env.source_params={floor: 0.5}"]
    cache = tmp_path / "cache"
    straight = train(small_config(tmp_path, "straight", base, cache_dir=cache), log=_quiet)
    train(small_config(tmp_path, "resumed", [*base, "trainer.total_steps=1"], cache_dir=cache), log=_quiet)
    resumed = train(
        small_config(tmp_path, "resumed", [*base, "run.resume=must"], cache_dir=cache), log=_quiet
    )
    assert len(resumed.history) == 1 and resumed.final == straight.final
    assert_same_run(straight.run_dir, resumed.run_dir)
    trained = [r for r in _rows(resumed.run_dir) if "reward/mean" in r]
    for row in trained:
        weights = [row[f"source/weight/{k}"] for k in ("calculator", "bandit")]
        assert abs(sum(weights) - 1) < 1e-9 and min(weights) >= 0.5 / 3  # the floor of bandit's 1/3
        if row.get("env/calculator/count") and row.get("env/bandit/count"):
            assert abs(row["grad_share/calculator"] + row["grad_share/bandit"] - 1) < 1e-9
