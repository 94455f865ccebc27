"""Policy losses and loss aggregation: pure functions over (B, T) tensors.

Shapes: B rows (packed trajectories or steps), T token positions. `mask` is 1 on action tokens
(sampled by the policy) and 0 on prompt, observation and padding tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLossOutput:
    loss_per_token: torch.Tensor  # (B, T), to be aggregated with the mask
    clipped: torch.Tensor  # (B, T) bool, where the clipped branch was taken
    log_ratio: torch.Tensor  # (B, T) logp - old_logp (clamped)


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017; verl `compute_policy_loss_vanilla`).

    ratio = exp(clamp(logp - old_logp, -20, 20));
    L = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)).
    clip_high > clip_low is DAPO's clip-higher. All inputs (B, T); returns per-token losses.
    """
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyLossOutput(torch.maximum(pg1, pg2), pg2 > pg1, log_ratio)


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *, num_tokens: float | None = None
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar (verl `agg_loss`).

    token-mean: sum(L*M) / sum(M), the DAPO "token-level loss". `num_tokens` overrides the
    denominator with the token count of the whole mini-batch, so that summing the losses of its
    micro-batches gives exactly the mini-batch loss (micro-batch 1x8 == 8x1). A batch with no
    action tokens gives 0 (not NaN).
    Worked example: L=[[1,2,3,x],[4,x,x,x]], M=[[1,1,1,0],[1,0,0,0]] -> 2.5.
    """
    if mode != "token-mean":
        raise ValueError(f"unknown loss aggregation {mode!r}; allowed: ['token-mean']")
    masked = (loss * mask).sum()
    denom = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
    return masked / max(denom, 1.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1; 0 when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def approx_kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token (Schulman, http://joschu.net/blog/kl-approx.html).

    d = clamp(ref - logp, -20, 20); k3 = exp(d) - d - 1 >= 0.
    """
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.exp(d) - d - 1.0
