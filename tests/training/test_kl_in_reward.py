"""KL in the reward: hand-computed penalty on the tokens and on the outcome."""

import pytest
import torch

from steprl.algorithms.inputs import AdvantageInputs
from steprl.rollout.views import Sample
from steprl.training.step_batch import with_kl_in_reward


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
