"""Hand-computed GRPO vectors (reference/algorithms.md §1.1) and its edge cases."""

import torch

from steprl.algorithms import ADVANTAGES, estimators
from steprl.algorithms.advantages import grpo


def test_grpo_reference_vector():
    a = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> 0.5 / 0.57735 = 0.8660
    assert torch.allclose(a, torch.tensor([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-4)


def test_dr_grpo_reference_vector():
    a = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), scale_by_std=False)
    assert torch.equal(a, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_of_one_gives_raw_reward():
    # verl: a singleton group has mean 0 and std 1, so the advantage is the reward itself
    a = grpo(torch.tensor([0.7]), torch.tensor([3]))
    assert torch.allclose(a, torch.tensor([0.7]), atol=1e-5)


def test_all_equal_group_is_exactly_zero_never_nan():
    for value in (0.0, 1.0, 0.1, -0.3):
        a = grpo(torch.full((5,), value), torch.zeros(5, dtype=torch.long))
        assert torch.equal(a, torch.zeros(5)), value
        assert not torch.isnan(a).any()


def test_groups_are_independent_and_order_free():
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([7, 7, 2, 7, 7, 2])
    a = grpo(rewards, groups)
    assert torch.allclose(a[[0, 1, 3, 4]], torch.tensor([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-4)
    assert torch.equal(a[[2, 5]], torch.zeros(2))


def test_registry_names_grpo():
    assert ADVANTAGES["grpo"] is estimators.grpo
