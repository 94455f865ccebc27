"""KL in the reward: hand-computed penalty on the tokens and on the outcome."""

import pytest
import torch

from steprl.algorithms import ADVANTAGES
from steprl.algorithms.inputs import AdvantageInputs
from steprl.rollout.views import Sample
from steprl.training.loop.step_batch import with_kl_in_reward


def test_kl_in_reward_hand_computed():
    sample = Sample((1, 5, 6), (0, 1, 1), (0.0, -1.0, -2.0), 0, (-1, 0, 0))
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0]),
        group_index=torch.tensor([0]),
        env_index=torch.tensor([0]),
        step_traj=torch.tensor([0]),
        step_index=torch.tensor([0]),
        step_rewards=torch.tensor([1.0]),
        anchor_keys=((1,),),
        mask=torch.tensor([[1.0, 1.0]]),
        token_step=torch.tensor([[0, 0]]),
        row_traj=torch.tensor([0]),
        token_rewards=torch.tensor([[0.0, 1.0]]),
    )
    # k1 = behaviour - reference = [-1 - (-1.5), -2 - (-1)] = [0.5, -1.0]; beta 0.1
    out, observed = with_kl_in_reward(inputs, [torch.tensor([-1.5, -1.0])], [sample], beta=0.1, kind="k1")
    assert torch.allclose(out.token_rewards, torch.tensor([[-0.05, 1.1]]))
    assert observed == pytest.approx((0.5 - 1.0) / 2)  # the row's token-mean KL, averaged over rows
    assert torch.allclose(out.rewards, torch.tensor([1.05]))
    assert torch.equal(inputs.rewards, torch.tensor([1.0]))  # the input record is not mutated


def _two_rollouts() -> tuple[AdvantageInputs, list[Sample]]:
    """Two one-step rollouts of one task, same reward and same state, one packed row each, a
    critic that values everything 0: only the KL penalty can tell them apart."""
    views = [Sample((1, 5, 6), (0, 1, 1), (0.0, -1.0, -2.0), i, (-1, 0, 0)) for i in range(2)]
    x = AdvantageInputs(
        rewards=torch.tensor([1.0, 1.0]),
        group_index=torch.tensor([0, 0]),
        env_index=torch.tensor([0, 0]),
        step_traj=torch.tensor([0, 1]),
        step_index=torch.tensor([0, 0]),
        step_rewards=torch.tensor([1.0, 1.0]),
        anchor_keys=((1,), (1,)),
        mask=torch.ones(2, 2),
        token_step=torch.tensor([[0, 0], [1, 1]]),
        row_traj=torch.tensor([0, 1]),
        token_rewards=torch.tensor([[0.0, 1.0], [0.0, 1.0]]),
        values=torch.zeros(2, 2),
    )
    return x, views


def test_kl_in_reward_reaches_each_step_reward():
    x, views = _two_rollouts()
    # rollout 0 matches the reference (no KL); rollout 1: k1 = [0.5, -1.0], beta 0.1 -> +0.05
    ref = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])]
    out, _ = with_kl_in_reward(x, ref, views, beta=0.1, kind="k1")
    assert torch.allclose(out.step_rewards, torch.tensor([1.0, 1.05]))
    assert torch.allclose(out.rewards, torch.tensor([1.0, 1.05]))


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_every_estimator_sees_the_kl_penalty(name):
    """algorithm.kl_in=reward: a different penalty gives different advantages, whichever level
    (trajectory, step, token) the estimator reads its rewards at."""
    x, views = _two_rollouts()
    ref = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])]
    without, _ = with_kl_in_reward(x, ref, views, beta=0.0, kind="k1")
    with_kl, _ = with_kl_in_reward(x, ref, views, beta=0.1, kind="k1")
    fn = ADVANTAGES[name]
    assert not torch.equal(fn(with_kl).advantages, fn(without).advantages)
