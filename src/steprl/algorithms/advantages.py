"""Advantage estimators: pure functions over tensors.

Convention (verl): one scalar per trajectory, broadcast later onto its action tokens by the
learner; observation tokens get nothing because their loss mask is 0.
"""

from __future__ import annotations

import torch


def grpo(
    rewards: torch.Tensor, group_index: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages (Shao et al. 2024, DeepSeekMath; verl `compute_grpo_outcome_advantage`).

    a_b = (R_b - mean_g R) / (std_g R + eps), std unbiased (ddof=1), when `scale_by_std`;
    a_b =  R_b - mean_g R                      otherwise (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).

    rewards: (N,) float, one outcome reward per trajectory.
    group_index: (N,) int64, trajectories of the same task share an index (any integers).
    Returns (N,) float32.

    Edge cases, decided and tested:
    * group of one: mean 0 and std 1, so a = R (verl's behaviour; such a group has no baseline).
    * all-equal group: R - mean = 0 exactly, so a = 0, never NaN (the std is not divided when 0).
    Example: R=[1,0,0,1] -> [+0.8660, -0.8660, -0.8660, +0.8660]; Dr. GRPO -> [+0.5, -0.5, -0.5, +0.5].
    """
    rewards = rewards.to(torch.float32)
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups).index_add_(0, inverse, rewards)
    means = sums / counts
    sq = torch.zeros(num_groups).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    # all-equal groups get exactly 0 even when float rounding leaves R - mean at ~1e-9
    gmax = torch.full((num_groups,), -torch.inf).scatter_reduce(0, inverse, rewards, reduce="amax")
    gmin = torch.full((num_groups,), torch.inf).scatter_reduce(0, inverse, rewards, reduce="amin")
    flat = (gmax == gmin) & ~singleton
    centered = torch.where(flat[inverse], torch.zeros_like(rewards), rewards - means[inverse])
    if not scale_by_std:
        return centered
    return centered / (stds[inverse] + eps)
