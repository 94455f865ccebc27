"""Group filters and reward shaping: pure functions over per-group reward tensors.

Filters return the indices of the groups (or trajectories) to keep, as an int64 tensor sorted in
increasing order, so that the batch keeps its original order. They run before advantage
whitening, compose by indexing, and each one handles the empty batch explicitly: empty in, empty
out, never NaN (algorithms.md section 13.5). What to do with an empty selection (skip the step,
regenerate) is the trainer's decision. Non-finite rewards raise: a NaN reward is a bug in the
reward function, and silently dropping or keeping its group would hide it.

`group_rewards` is a sequence of G 1-D tensors (groups may differ in size) or a (G, K) tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

GroupRewards = Sequence[torch.Tensor] | torch.Tensor


def _groups(group_rewards: GroupRewards) -> list[torch.Tensor]:
    """Flatten each group to a 1-D float64 tensor and reject non-finite rewards."""
    if isinstance(group_rewards, torch.Tensor) and group_rewards.dim() != 2:
        raise ValueError(
            f"a tensor of group rewards must be (G, K), got shape {tuple(group_rewards.shape)}; "
            "pass a list of per-group tensors for groups of different sizes"
        )
    groups = [torch.as_tensor(g).detach().reshape(-1).to(torch.float64) for g in group_rewards]
    for i, g in enumerate(groups):
        if not bool(torch.isfinite(g).all()):
            raise ValueError(f"group {i} has a non-finite reward ({g.tolist()}); fix the reward function")
    return groups


def _indices(keep: list[int] | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    out = torch.as_tensor(keep, dtype=torch.long, device=device).reshape(-1)
    return torch.sort(out).values


def _is_flat(g: torch.Tensor) -> bool:
    """All rewards equal (or no rewards). Exact, unlike std() > 0, which float rounding can break:
    numpy's population std of [0.1, 0.1, 0.1] is 1.4e-17, not 0."""
    return g.numel() == 0 or bool(g.max() == g.min())


def group_reward_std(group_rewards: GroupRewards, unbiased: bool = True) -> torch.Tensor:
    """Per-group reward standard deviation: G groups -> (G,) float32.

    unbiased=True divides by n-1 (torch.std; StarPO-S and RAGEN-2 use it), False by n (numpy,
    DAPO). Never NaN: a group whose rewards are all equal gets exactly 0, and so does a group of
    one (unbiased std is undefined there) or an empty group. No groups -> shape (0,).
    """
    out = []
    for g in _groups(group_rewards):
        if _is_flat(g) or (unbiased and g.numel() < 2):
            out.append(0.0)
        else:
            out.append(float(g.std(correction=1 if unbiased else 0)))
    return torch.tensor(out, dtype=torch.float32)


def dapo_keep(group_rewards: GroupRewards) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476; verl `recipe/dapo`): keep a group
    if its population reward std is > 0 or it has exactly one rollout.

    std > 0 is tested exactly as max != min (see `_is_flat`). An empty group (no rollouts) is
    dropped. Returns (k,) int64 group indices, empty when no group qualifies; the trainer then
    generates more (up to its max_num_gen_batches) or skips.
    Example: [[1, 0, 1], [1, 1, 1], [0.5], [0, 0]] -> [0, 2].
    """
    groups = _groups(group_rewards)
    return _indices([i for i, g in enumerate(groups) if g.numel() == 1 or not _is_flat(g)])


_STARPO_MODES = ("std", "std_rev")


def starpo_s_keep(group_rewards: GroupRewards, ratio: float = 0.25, *, mode: str = "std") -> torch.Tensor:
    """StarPO-S uncertainty filtering (RAGEN v1, Wang et al. 2025; RAGEN-AI/RAGEN `_filter_rollout`):
    keep the int(ratio * G) groups with the highest unbiased reward std ("std_rev": the lowest).

    Decisions: the count is floor(ratio * G) (1e-9 tolerance for float rounding) but at least 1
    when G > 0: a ratio that rounds to 0 groups means "keep the most uncertain one", never an
    empty batch (RAGEN-2's top_k does the same). ratio=1.0 keeps all. Ties are broken by the lower
    group index (stable sort), not arbitrarily as in topk. Zero-std groups are NOT removed
    (StarPO-S keeps a critic, so they can still carry signal): an all-zero-std batch keeps the
    first k groups. Returns (k,) int64 sorted indices; no groups -> empty.
    """
    if mode not in _STARPO_MODES:
        raise ValueError(f"unknown StarPO-S mode {mode!r}; allowed: {list(_STARPO_MODES)}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(
            f"ratio must be in (0, 1] (got {ratio}); StarPO-S uses 0.25, 1.0 disables the filter"
        )
    std = group_reward_std(group_rewards, unbiased=True)
    num_groups = std.numel()
    if num_groups == 0:
        return _indices([])
    k = max(1, math.floor(ratio * num_groups + 1e-9))
    order = torch.sort(std, descending=(mode == "std"), stable=True).indices
    return _indices(order[:k])


def ragen2_top_p_keep(
    scores: torch.Tensor, p: float = 0.9, *, eps: float = 0.01, include_zero: bool = False
) -> torch.Tensor:
    """RAGEN-2 SNR-aware filtering, linear top-p (arXiv 2604.06268; mll-lab-nu/RAGEN
    `RolloutFilter._select_top_groups`; algorithms.md section 3.3).

    scores: (G,) per-group score, usually `group_reward_std(..., unbiased=True)`.
    1. Unless include_zero, drop groups with |score| <= 1e-10.
    2. p >= 1: keep every remaining group (the filter is off).
    3. Otherwise sort descending (ties: lower index first); threshold = p * sum(scores) - eps;
       take groups while the running sum is below the threshold, stopping at the first
       non-positive score. Reached -> those groups; not reached -> EMPTY (skip the step).
    So an all-zero batch gives an empty selection (with p < 1, even with include_zero: the
    threshold is -eps and nothing is taken), and so do all-negative scores.
    Returns (k,) int64 sorted indices on scores' device.
    Example: scores [0.5, 0, 0.3, 0.2], p=0.9 -> threshold 0.89 -> [0, 2, 3]; p=0.5 -> [0].
    """
    if not p > 0.0:
        raise ValueError(f"p must be in (0, 1] (got {p}); RAGEN-2 recommends 0.9, 1.0 disables the filter")
    flat = scores.detach().reshape(-1).to(torch.float64)
    device = scores.device
    if not bool(torch.isfinite(flat).all()):
        raise ValueError(f"non-finite group score in {flat.tolist()}; fix the reward or score function")
    candidates = torch.arange(flat.numel(), device=device)
    if not include_zero:
        nonzero = flat.abs() > 1e-10
        flat, candidates = flat[nonzero], candidates[nonzero]
    if candidates.numel() == 0:
        return _indices([], device)
    if p >= 1.0:
        return _indices(candidates, device)
    sorted_scores, order = torch.sort(flat, descending=True, stable=True)
    threshold = p * float(flat.sum()) - eps
    cumulative, taken = 0.0, 0
    for s in sorted_scores.tolist():
        if cumulative >= threshold or s <= 0.0:
            break
        cumulative += s
        taken += 1
    if cumulative < threshold:
        return _indices([], device)
    return _indices(candidates[order[:taken]], device)


def loop_abs_adv_keep(advantages: torch.Tensor, threshold: float = 0.01) -> torch.Tensor:
    """LOOP's advantage filter (Chen et al. 2025, arXiv 2502.01600; apple/ml-loop
    `abs_adv_threshold=0.01`): keep trajectories with |A| >= threshold (inclusive).

    advantages: (N,) one scalar per trajectory. Drops zero-variance groups (A = 0) as a side effect.
    Returns (k,) int64 sorted indices on the input's device; empty input -> empty.
    """
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be (N,) per trajectory, got shape {tuple(advantages.shape)}")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("non-finite advantage; check the rewards and the advantage estimator")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 (got {threshold}); LOOP uses 0.01")
    keep = torch.nonzero(advantages.detach().abs() >= threshold).reshape(-1)
    return _indices(keep, advantages.device)


def overlong_shaping(
    lengths: torch.Tensor, *, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO overlong reward shaping, paper form (Yu et al. 2025, arXiv 2503.14476, eq. 13):

    R_len(y) = 0                                    if |y| <= L_max - L_cache
               penalty * ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
               -penalty                             if |y| > L_max
    Add it to the outcome reward. lengths: (N,) response lengths in tokens; returns (N,) float32.
    cache_len=0 is a hard cut-off (0 up to max_len, -penalty beyond).
    Example (L_max=20480, L_cache=4096): 16000 -> 0, 16384 -> 0, 18432 -> -0.5, 20480 -> -1.0.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(
            f"need 0 <= cache_len <= max_len (got cache_len={cache_len}, max_len={max_len}); "
            "DAPO uses max_len=20480, cache_len=4096"
        )
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (got {penalty}); it is the size of the maximal penalty")
    n = lengths.detach().to(torch.float64)
    soft_start = float(max_len - cache_len)
    ramp = (soft_start - n) / cache_len if cache_len > 0 else torch.zeros_like(n)
    shaped = torch.where(n <= soft_start, torch.zeros_like(n), penalty * ramp)
    shaped = torch.where(n > max_len, torch.full_like(n, -penalty), shaped)
    return shaped.to(torch.float32)
