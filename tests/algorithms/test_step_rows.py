"""One row per step (context rules other than append_only) and one row per trajectory are two
layouts of the same trajectories: a token's return-to-go must not depend on which row it sits in."""

import torch

from steprl.algorithms import advantages, estimators
from steprl.algorithms.check import synthetic_inputs, varied_rollouts
from steprl.rollout.views import packed_view, per_step_view
from steprl.training.step_batch import advantage_inputs
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
        x = advantage_inputs(trajs, views, torch.tensor([1.5, 0.0]), pad_id=0, env_ids={})
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
