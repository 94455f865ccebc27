"""PPO-clip and token-mean aggregation against hand-computed values."""

import math

import torch

from steprl.algorithms.losses import aggregate, approx_kl_k3, ppo_clip


def test_token_mean_reference_vector():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(loss, mask).item() == 2.5


def test_token_mean_empty_mask_is_zero_not_nan():
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_token_mean_global_denominator_makes_micro_batches_add_up():
    torch.manual_seed(0)
    loss, mask = torch.randn(8, 5), (torch.rand(8, 5) > 0.4).float()
    whole = aggregate(loss, mask)
    parts = sum(aggregate(loss[i : i + 1], mask[i : i + 1], num_tokens=mask.sum().item()) for i in range(8))
    assert torch.allclose(whole, parts, atol=1e-6)


def test_ppo_clip_hand_computed():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.5, 1.0 with advantages +1, +1, -1, +2
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 1.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    out = ppo_clip(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # +A, ratio 1.5: max(-1.5, -1.2) = -1.2 (clipped); +A, ratio .5: max(-.5, -.8) = -.5
    # -A, ratio 1.5: max(1.5, 1.2) = 1.5 (unclipped); ratio 1: -2
    assert torch.allclose(out.loss_per_token, torch.tensor([[-1.2, -0.5, 1.5, -2.0]]), atol=1e-6)
    assert out.clipped.tolist() == [[True, False, False, False]]


def test_clip_higher_is_asymmetric():
    out = ppo_clip(
        torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.28
    )
    assert math.isclose(out.loss_per_token.item(), -1.25, rel_tol=1e-6)  # inside [0.8, 1.28]


def test_k3_is_zero_at_equality_and_positive_elsewhere():
    x = torch.tensor([-1.0, -2.0])
    assert torch.equal(approx_kl_k3(x, x), torch.zeros(2))
    assert (approx_kl_k3(x, x + 0.3) > 0).all()
