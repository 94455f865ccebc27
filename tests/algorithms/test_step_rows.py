"""One row per step (context rules other than append_only) and one row per trajectory are two
layouts of the same trajectories: a token's return-to-go, GAE or group baseline must not depend on
which row it sits in (the checker's ``layouts`` property, here on rows built by the trainer's own
`advantage_inputs`); and on one row per trajectory the fixes changed no bit."""

import inspect
from dataclasses import replace

import pytest
import torch

from steprl.algorithms import ADVANTAGE_NEEDS_CRITIC, ADVANTAGES, advantages, estimators
from steprl.algorithms.check import synthetic_inputs, varied_rollouts
from steprl.rollout.views import packed_view, per_step_view
from steprl.training.loop.step_batch import advantage_inputs
from steprl.types import EndReason, Step, Trajectory


def _trajectory(rewards: tuple[float, float], group: str) -> Trajectory:
    """Two steps, each prompt extending the last context (so both layouts can be built)."""
    first = Step((1, 2), (3, 4), (-0.1, -0.2), (5,), rewards[0], 0)
    second = Step((1, 2, 3, 4, 5), (6, 7, 8), (-0.3, -0.4, -0.5), (), rewards[1], 0)
    return Trajectory("task", group, "env", (first, second), sum(rewards), EndReason.ANSWERED)


def test_reinforce_pp_return_runs_across_the_rows_of_a_trajectory():
    # gamma < 1: the first step's tokens must see the second step's reward, discounted
    trajs = [_trajectory((0.5, 1.0), "g"), _trajectory((0.0, 0.0), "g")]
    layouts = []
    for to_rows in (lambda t, i: [packed_view(t, i)], per_step_view):
        views = [v for i, t in enumerate(trajs) for v in to_rows(t, i)]
        x = advantage_inputs(trajs, views, torch.tensor([1.5, 0.0]), env_ids={})
        out = estimators.reinforce_pp(x, gamma=0.9)
        layouts.append((out.advantages[x.mask != 0], out.returns[x.mask != 0]))
    (packed_adv, packed_ret), (step_adv, step_ret) = layouts
    torch.testing.assert_close(step_ret, packed_ret)
    torch.testing.assert_close(step_adv, packed_adv)


def test_reinforce_pp_on_trajectory_rows_is_the_row_recursion_bit_for_bit():
    x = synthetic_inputs(varied_rollouts())
    out = estimators.reinforce_pp(x, gamma=0.9)
    a, ret = advantages.reinforce_pp(x.token_rewards, x.mask, gamma=0.9)
    assert torch.equal(out.advantages, a) and torch.equal(out.returns, ret)


def _layouts(values: torch.Tensor | None = None):
    """The two-step trajectories above in both layouts; `values` (2, 5): the critic's value at
    each trajectory's action tokens in order, put on the same tokens in either layout."""
    trajs = [_trajectory((0.5, 1.0), "g"), _trajectory((0.0, 0.0), "g")]
    for to_rows in (lambda t, i: [packed_view(t, i)], per_step_view):
        views = [v for i, t in enumerate(trajs) for v in to_rows(t, i)]
        x = advantage_inputs(trajs, views, torch.tensor([1.5, 0.0]), env_ids={})
        if values is not None:
            x = replace(x, values=x.trajectory_tokens.to_rows(values, tuple(x.mask.shape)))
        yield x


CRITICS = {
    "constant": torch.full((2, 5), 0.5),
    "varied": torch.tensor([[0.3, -0.2, 0.9, 0.1, 0.4], [0.7, 0.0, -0.5, 0.2, 0.6]]),
}


@pytest.mark.parametrize("critic", sorted(CRITICS))
@pytest.mark.parametrize("name", sorted(n for n in ADVANTAGES if ADVANTAGE_NEEDS_CRITIC.get(n)))
def test_critic_estimators_bootstrap_across_the_rows_of_a_trajectory(name, critic):
    # gamma, lam < 1 where the estimator takes them: the first step's last token must bootstrap
    # from the second step's value and carry its GAE, discounted (per row it restarted from 0)
    fn = ADVANTAGES[name]
    params = {k: v for k, v in (("gamma", 0.9), ("lam", 0.8)) if k in inspect.signature(fn).parameters}
    (packed_adv, packed_ret), (step_adv, step_ret) = [
        (out.advantages[x.mask != 0], out.returns[x.mask != 0])
        for x in _layouts(CRITICS[critic])
        for out in [fn(x, **params)]
    ]
    torch.testing.assert_close(step_ret, packed_ret)
    torch.testing.assert_close(step_adv, packed_adv)


def test_trajectory_row_estimators_are_the_row_calculations_bit_for_bit():
    """gae, bi_level_gae and reinforce_pp_baseline as they were before they ran over
    `trajectory_tokens`: on one row per trajectory nothing changes, not even rounding."""
    x = synthetic_inputs(varied_rollouts(), values="random")
    assert x.values is not None
    old = {
        "gae": advantages.gae(x.token_rewards, x.values, x.mask, gamma=0.9, lam=0.8),
        "bi_level_gae": advantages.bi_level_gae(
            x.token_rewards, x.values, x.mask, x.step_end, gamma=0.9, lam=0.8, high_level_gamma=0.5
        ),
    }
    new = {
        "gae": estimators.gae(x, gamma=0.9, lam=0.8),
        "bi_level_gae": estimators.bi_level_gae(x, gamma=0.9, lam=0.8, high_level_gamma=0.5),
    }
    for name, (a, ret) in old.items():
        assert torch.equal(new[name].advantages, a) and torch.equal(new[name].returns, ret), name
    baseline = advantages.reinforce_pp_baseline(x.rewards[x.row_traj], x.group_index[x.row_traj], x.mask)
    assert torch.equal(estimators.reinforce_pp_baseline(x).advantages, baseline)
