"""Numeric guards of an optimizer step (reliability.md NUM-01, NUM-02), shared by the learner
and the separate critic."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def guarded_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grad_clip: float) -> float:
    """Clip and step, unless the loss or a gradient is NaN or Inf (NUM-01): then the step is
    skipped (parameters and optimizer state stay as they were). Returns the pre-clip norm (a
    spike above the clip is clipped as any norm is: NUM-02)."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def grad_metrics(prefix: str, norms: Sequence[float], spike_norm: float) -> dict[str, float]:
    """Pre-clip gradient norms of one update: mean and max of the finite ones, the skipped
    (non-finite) steps, and the spikes (a norm above `spike_norm`, flagged)."""
    finite = [n for n in norms if math.isfinite(n)]
    return {
        f"{prefix}/grad_norm": sum(finite) / len(finite) if finite else 0.0,
        f"{prefix}/grad_norm_max": max(finite, default=0.0),
        f"{prefix}/optimizer_steps": float(len(finite)),
        f"{prefix}/nonfinite_skips": float(len(norms) - len(finite)),
        f"{prefix}/grad_spikes": float(sum(n > spike_norm for n in finite)),
    }
