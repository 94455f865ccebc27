"""Policy-loss library: dual clip, LOOP, decoupled PPO, KL, entropy, value loss, aggregation."""

import math

import pytest
import torch

from steprl.algorithms.losses import (
    AGGREGATION_MODES,
    AdaptiveKLController,
    adaptive_kl_beta,
    aggregate,
    decoupled_ppo,
    entropy_from_logits,
    kl_in_reward,
    kl_penalty,
    loop_clip,
    num_valid_seqs,
    ppo_clip,
    value_loss,
)

NAN = float("nan")


def _log(values):
    return torch.log(torch.tensor([values]))


# ---------------------------------------------------------------------------- ppo_clip dual clip


def test_dual_clip_hand_computed():
    # ratios 5, 2, 5 with advantages -1, -1, +1; c = 3
    logp, old = _log([5.0, 2.0, 5.0]), torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = ppo_clip(logp, old, adv, dual_clip_c=3.0)
    # A<0, ratio 5: clip1 = max(5, 1.2) = 5 > pg3 = 3 -> 3; ratio 2: clip1 = 2 < 3 -> 2
    # A>0, ratio 5: max(-5, -1.2) = -1.2, the dual clip never touches positive advantages
    assert torch.allclose(out.loss_per_token, torch.tensor([[3.0, 2.0, -1.2]]), atol=1e-6)
    assert out.clipped_lower is not None
    assert out.clipped_lower.tolist() == [[True, False, False]]
    assert out.clipped.tolist() == [[False, False, True]]


def test_dual_clip_has_zero_gradient_where_binding():
    logp = _log([5.0, 2.0]).requires_grad_()
    ppo_clip(
        logp, torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]), dual_clip_c=3.0
    ).loss_per_token.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(2.0)


def test_dual_clip_none_is_plain_ppo_and_c_must_exceed_one():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    out = ppo_clip(logp, old, adv)
    assert out.clipped_lower is not None and not out.clipped_lower.any()
    big = ppo_clip(logp, old, adv, dual_clip_c=1e9)  # never binding
    assert torch.equal(big.loss_per_token, out.loss_per_token)
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
            ppo_clip(logp, old, adv, dual_clip_c=c)


# ---------------------------------------------------------------------------- LOOP


def test_loop_clip_hand_computed():
    # eps=0.1: bounds [1/1.1, 1.1]
    logp, old = _log([1.5, 0.5, 1.5, 0.5, 1.0]), torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 0.0]])
    out = loop_clip(logp, old, adv, eps=0.1)
    # A=+1, rho 1.5: min(1.5, 1.1) = 1.1; A=-1, rho .5: min(-.5, -1/1.1) = -0.9091 (clipped)
    # A=-1, rho 1.5: min(-1.5, -0.909) = -1.5; A=+1, rho .5: min(.5, 1.1) = .5; A=0 -> 0
    expected = -torch.tensor([[1.1, -1 / 1.1, -1.5, 0.5, 0.0]])
    assert torch.allclose(out.loss_per_token, expected, atol=1e-6)
    assert out.clipped.tolist() == [[True, True, False, False, False]]


def test_loop_clip_equals_ppo_with_asymmetric_bounds():
    torch.manual_seed(1)
    logp, old, adv = torch.randn(4, 7) * 0.3, torch.randn(4, 7) * 0.3, torch.randn(4, 7)
    eps = 0.1
    loop = loop_clip(logp, old, adv, eps=eps)
    ppo = ppo_clip(logp, old, adv, clip_low=1 - 1 / (1 + eps), clip_high=eps)
    assert torch.allclose(loop.loss_per_token, ppo.loss_per_token, atol=1e-6)
    with pytest.raises(ValueError):
        loop_clip(logp, old, adv, eps=0.0)


# ---------------------------------------------------------------------------- decoupled PPO


def test_decoupled_with_staleness_zero_is_exactly_ppo_clip():
    torch.manual_seed(2)
    base = torch.randn(4, 6) * 0.5
    old = torch.randn(4, 6) * 0.5
    adv = torch.randn(4, 6)
    for mode in ("mask", "truncate", "none"):
        a = base.clone().requires_grad_()
        b = base.clone().requires_grad_()
        ref = ppo_clip(a, old, adv, clip_low=0.2, clip_high=0.28)
        dec = decoupled_ppo(b, old.clone(), old.clone(), adv, clip_low=0.2, clip_high=0.28, behav_mode=mode)
        assert torch.equal(ref.loss_per_token, dec.loss_per_token)
        assert torch.equal(ref.clipped, dec.clipped) and torch.equal(ref.log_ratio, dec.log_ratio)
        ref.loss_per_token.sum().backward()
        dec.loss_per_token.sum().backward()
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)
        assert dec.dropped is not None and not dec.dropped.any()


def test_decoupled_trust_region_is_centred_on_prox_and_weighted_by_behaviour():
    logp, prox = _log([1.5, 1.0]), torch.zeros(1, 2)
    behav = -_log([2.0, 1.0])  # w = pi_prox / pi_behav = 2, 1
    adv = torch.tensor([[1.0, 1.0]])
    out = decoupled_ppo(logp, prox, behav, adv)
    # u = 1.5 -> clipped to 1.2 -> -1.2, times w = 2; u = 1 -> -1
    assert torch.allclose(out.loss_per_token, torch.tensor([[-2.4, -1.0]]), atol=1e-6)
    assert torch.allclose(out.log_ratio, logp)
    assert out.behav_weight is not None
    assert torch.allclose(out.behav_weight, torch.tensor([[2.0, 1.0]]))


def test_decoupled_mask_truncate_none():
    logp = torch.zeros(1, 3, requires_grad=True)
    prox = torch.zeros(1, 3)
    behav = -_log([10.0, 2.0, 5.0])  # w = 10, 2, 5 (the cap is inclusive: 5 is kept)
    adv = torch.ones(1, 3)
    mask = torch.ones(1, 3)
    masked = decoupled_ppo(logp, prox, behav, adv, behav_cap=5.0, behav_mode="mask")
    assert masked.dropped is not None
    assert masked.dropped.tolist() == [[True, False, False]]
    assert torch.allclose(masked.loss_per_token, torch.tensor([[0.0, -2.0, -5.0]]), atol=1e-5)
    assert float((masked.dropped.float() * mask).sum() / mask.sum()) == pytest.approx(1 / 3)
    # AReaL: the denominator keeps the dropped token (original mask)
    assert aggregate(masked.loss_per_token, mask).item() == pytest.approx(-7.0 / 3, abs=1e-5)
    trunc = decoupled_ppo(logp, prox, behav, adv, behav_cap=5.0, behav_mode="truncate")
    assert torch.allclose(trunc.loss_per_token, torch.tensor([[-5.0, -2.0, -5.0]]), atol=1e-5)
    uncapped = decoupled_ppo(logp, prox, behav, adv, behav_cap=None, behav_mode="mask")
    assert torch.allclose(uncapped.loss_per_token, torch.tensor([[-10.0, -2.0, -5.0]]), atol=1e-4)
    none = decoupled_ppo(logp, prox, behav, adv, behav_mode="none")
    assert torch.equal(none.loss_per_token, ppo_clip(logp, prox, adv).loss_per_token)
    # the weight is detached: gradient w.r.t. logp is w * dL/dlogp
    masked.loss_per_token.sum().backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -2.0, -5.0]]), atol=1e-5)


def test_decoupled_rejects_bad_settings():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="behav_mode"):
        decoupled_ppo(x, x, x, x, behav_mode="clip")
    with pytest.raises(ValueError, match="behav_cap"):
        decoupled_ppo(x, x, x, x, behav_cap=0.5)


# ---------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-0.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "kl"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([0.125, 0.0]))
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.tensor([k3, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([k3, 0.0]))
    # k3 is clamped to 10: d = ref - logp = 20 would give exp(20) - 21
    assert kl_penalty(torch.tensor([-20.0]), torch.tensor([0.0]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="allowed"):
        kl_penalty(logp, ref, "full")


@pytest.mark.parametrize("kind", ["k1", "k3", "abs", "low_var_kl", "k2"])
def test_straight_through_kl_has_value_of_kind_and_gradient_of_k2(kind):
    ref = torch.tensor([-0.5, -1.0, -2.0])
    logp = torch.tensor([0.0, -1.5, -1.0], requires_grad=True)
    out = kl_penalty(logp, ref, kind + "+")
    assert torch.allclose(out, kl_penalty(logp.detach(), ref, kind))
    out.sum().backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, logp.detach() - ref)  # d/dlogp 0.5 (logp - ref)^2


def test_kl_in_reward_is_masked_and_gradient_free():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_in_reward(rewards, old, ref, mask, beta=0.1)
    assert torch.allclose(out, torch.tensor([[-0.05, 0.05, 1.0]]))
    assert not out.requires_grad
    with pytest.raises(ValueError):
        kl_in_reward(rewards, old, ref, mask, beta=-1.0)


def test_adaptive_kl_controller():
    assert adaptive_kl_beta(0.1, 0.1, 0.1, 100, 10000) == pytest.approx(0.1)  # on target
    assert adaptive_kl_beta(0.1, 1.0, 0.1, 100, 10000) == pytest.approx(0.1 * (1 + 0.2 * 0.01))  # clipped +
    assert adaptive_kl_beta(0.1, 0.0, 0.1, 100, 10000) == pytest.approx(0.1 * (1 - 0.2 * 0.01))  # clipped -
    assert adaptive_kl_beta(0.1, 0.11, 0.1, 10000, 10000) == pytest.approx(0.11)
    ctl = AdaptiveKLController(beta=0.1).update(1.0, 100)
    assert ctl.beta == pytest.approx(0.1002) and ctl.target == 0.1
    with pytest.raises(ValueError):
        adaptive_kl_beta(0.1, 0.1, 0.0, 1, 1)


# ---------------------------------------------------------------------------- entropy, value loss


def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 5)
    assert torch.allclose(entropy_from_logits(uniform), torch.full((2, 3), math.log(5)))
    logits = torch.tensor([[[0.0, 0.0, -math.inf], [3.0, -math.inf, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert torch.allclose(h, torch.tensor([[math.log(2), 0.0]]))
    h.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # tok0: unclipped (1-0)^2 = 1, clipped V=0.5 -> .25, max 1; tok1: 1, clipped V=0 -> 1; masked tok2
    assert value_loss(values, old, returns, mask, clip=0.5).item() == pytest.approx(0.5 * (1 + 1) / 2)
    # clipping can only increase the loss: V=1.0 clipped to .5, target 2 -> (1.5)^2 > 1^2
    far = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    assert far.item() == pytest.approx(0.5 * 2.25)
    none = value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), clip=None
    )
    assert none.item() == pytest.approx(0.5)
    assert value_loss(values, old, returns, mask, num_tokens=4).item() == pytest.approx(0.5 * 2 / 4)
    with pytest.raises(ValueError):
        value_loss(values, old, returns, mask, clip=0.0)


# ---------------------------------------------------------------------------- aggregation

WORKED_L = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, math.inf, NAN, -math.inf]])
WORKED_M = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),
        ("seq-mean-token-sum", 5.0),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum-norm", 2.5),
    ],
)
def test_aggregation_worked_vector(mode, expected):
    # masked slots hold NaN/inf: they must not leak into any mode
    assert aggregate(WORKED_L, WORKED_M, mode, scale_factor=4).item() == pytest.approx(expected, abs=1e-7)


def test_aggregation_modes_exported():
    assert AGGREGATION_MODES == (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregation_empty_mask_is_zero(mode):
    out = aggregate(torch.full((2, 3), NAN), torch.zeros(2, 3), mode, scale_factor=3)
    assert out.item() == 0.0


def test_fully_masked_rows_do_not_count_as_sequences():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.cat([WORKED_M, torch.zeros(1, 4)])
    assert num_valid_seqs(mask) == 2
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == 5.0
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == 3.0


def test_aggregation_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(WORKED_L, WORKED_M, "sum")
    with pytest.raises(ValueError, match="algorithm.loss_scale_factor"):
        aggregate(WORKED_L, WORKED_M, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate(WORKED_L, WORKED_M, "seq-mean-token-sum-norm", scale_factor=0.0)
    with pytest.raises(ValueError):
        aggregate(WORKED_L, WORKED_M, "token-mean", num_tokens=-1)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batch_invariance_of_value_and_gradient(mode):
    torch.manual_seed(3)
    x = torch.randn(8, 6)
    mask = (torch.rand(8, 6) > 0.4).float()
    mask[5] = 0.0  # a fully masked row
    mask[2] = 1.0
    num_tokens, num_seqs = float(mask.sum()), num_valid_seqs(mask)

    def run(splits):
        w = torch.linspace(-1.0, 1.0, 6).requires_grad_()
        total = torch.zeros(())
        for rows in splits:
            loss = torch.sin(x[rows] * w) + (x[rows] * w) ** 2  # any differentiable per-token loss
            total = total + aggregate(
                loss, mask[rows], mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=6.0
            )
        total.backward()
        assert w.grad is not None
        return total.detach(), w.grad

    def whole():
        w = torch.linspace(-1.0, 1.0, 6).requires_grad_()
        loss = aggregate(torch.sin(x * w) + (x * w) ** 2, mask, mode, scale_factor=6.0)
        loss.backward()
        assert w.grad is not None
        return loss.detach(), w.grad

    ref_loss, ref_grad = whole()
    for splits in ([list(range(8))], [[i] for i in range(8)], [[0, 1, 2], [3, 4, 5, 6], [7]]):
        loss, grad = run(splits)
        assert torch.allclose(loss, ref_loss, atol=1e-6)
        assert torch.allclose(grad, ref_grad, atol=1e-6)
