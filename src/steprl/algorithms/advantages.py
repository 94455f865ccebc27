"""Advantage estimators: pure functions over tensors.

Convention (verl): one scalar per trajectory, broadcast later onto its action tokens by the
learner; observation tokens get nothing because their loss mask is 0.

Shapes used below: N trajectories (or step rows), B rows x T token positions, S_tr trajectories x
S_max steps for step tables. `mask` is 1/True on action tokens (sampled by the policy) and 0 on
prompt, observation and padding tokens; any non-zero entry counts as valid. Formulas, defaults and
worked vectors: `reference/algorithms.md` (section numbers cited per function).

House rules every function here keeps (tested in tests/unit/test_advantages_lib.py):
* never NaN: a group (or batch) whose values are all equal gives exactly 0, not 0/eps noise;
* empty inputs give empty outputs of the right shape, and never raise;
* masked (invalid) positions of every token-level output are exactly 0.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Sequence
from typing import Literal

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


# ---------------------------------------------------------------------------------------------
# Shared helpers (private). Group statistics are computed with scatter ops so that group ids can
# be any integers in any order, and "all equal" is detected exactly (max == min) rather than by
# comparing a float std with a threshold.
# ---------------------------------------------------------------------------------------------


def _float(x: torch.Tensor) -> torch.Tensor:
    """Keep float dtypes (float64 stays float64); promote ints/bools to float32."""
    return x if x.is_floating_point() else x.to(torch.float32)


def _group_stats(
    values: torch.Tensor, inverse: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (counts, mean, unbiased std, flat) of 1-D `values` with group ids `inverse`.

    `flat[g]` is True when every member of g is bitwise equal (singletons included): callers use
    it to return exact zeros, because float rounding can leave R - mean at ~1e-9 in such groups.
    The std of a singleton is 0 (the ddof=1 denominator is clamped to 1), never NaN.
    """
    dev, dt = values.device, values.dtype
    counts = torch.zeros(num_groups, device=dev, dtype=dt).index_add_(0, inverse, torch.ones_like(values))
    sums = torch.zeros(num_groups, device=dev, dtype=dt).index_add_(0, inverse, values)
    means = sums / counts.clamp(min=1)
    sq = torch.zeros(num_groups, device=dev, dtype=dt).index_add_(0, inverse, (values - means[inverse]) ** 2)
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    gmax = torch.full((num_groups,), -torch.inf, device=dev, dtype=dt)
    gmax = gmax.scatter_reduce(0, inverse, values, reduce="amax")
    gmin = torch.full((num_groups,), torch.inf, device=dev, dtype=dt)
    gmin = gmin.scatter_reduce(0, inverse, values, reduce="amin")
    return counts, means, stds, gmax == gmin


def _centred(
    values: torch.Tensor, group_index: torch.Tensor, *, singleton_mean_zero: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R - mean_group R, counts per row, std per row, flat per row) for 1-D rewards.

    singleton_mean_zero: a group of one uses mean 0 (verl GRPO / REINFORCE++-baseline: no
    baseline exists, so the raw reward is kept) instead of its own value (which gives 0).
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts, means, stds, flat = _group_stats(values, inverse, num_groups)
    centred = torch.where(flat[inverse], torch.zeros_like(values), values - means[inverse])
    if singleton_mean_zero:
        centred = torch.where(counts[inverse] == 1, values, centred)
    return centred, counts[inverse], stds[inverse], flat[inverse]


def _sorted_steps(traj: list[int], step: list[int], what: str) -> list[int]:
    """Row order sorted by (trajectory, step); raises on a duplicated (trajectory, step) pair."""
    order = sorted(range(len(traj)), key=lambda i: (traj[i], step[i]))
    for a, b in zip(order, order[1:], strict=False):
        if traj[a] == traj[b] and step[a] == step[b]:
            raise ValueError(
                f"{what}: trajectory {traj[a]} has two rows with step_index {step[a]}; each "
                "(traj_index, step_index) pair must appear once (deduplicate padded/copied rows first)"
            )
    return order


# ---------------------------------------------------------------------------------------------
# Whitening
# ---------------------------------------------------------------------------------------------


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten `x` with the mean and variance of its valid entries over the WHOLE batch.

    out = (x - mean_M x) * rsqrt(var_M x + eps)               (shift_mean=True)
    out = (x - mean_M x) * rsqrt(var_M x + eps) + mean_M x    (shift_mean=False: rescale, keep the mean)
    mean_M / var_M run over every entry with mask != 0 (so long rows weigh more); var is unbiased
    (ddof=1). Source: verl `verl/utils/torch_functional.py::masked_whiten` (algorithms.md §0.4);
    the shift_mean=False form follows the same function (and TRL's `whiten`).

    x, mask: same shape, usually (B, T). Returns x's shape and float dtype.

    Edge cases, decided (verl raises on 0 or 1 valid entries; we never raise, never return NaN):
    * invalid positions are exactly 0 in the output (verl leaves whitened garbage there and relies
      on the caller multiplying by the mask).
    * 0 valid entries (or empty x): all zeros.
    * 1 valid entry: the variance is taken as 0 (nothing to spread), so the entry becomes exactly 0
      (its own mean for shift_mean=False) instead of a 0/0.
    * all valid entries equal: exactly 0 (mean for shift_mean=False), not rounding noise times 1e4.
    """
    x = _float(x)
    out = torch.zeros_like(x)
    valid = mask != 0
    if x.numel() == 0 or not bool(valid.any()):
        return out
    xv = x[valid]
    mean = xv.mean()
    centred = torch.zeros_like(xv) if bool(xv.max() == xv.min()) else xv - mean
    var = (centred**2).sum() / max(xv.numel() - 1, 1)
    whitened = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    out[valid] = whitened
    return out


# ---------------------------------------------------------------------------------------------
# Critic-free outcome estimators, one scalar per trajectory
# ---------------------------------------------------------------------------------------------


def rloo(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, arXiv 2402.14740; verl `rloo`).

    a_i = R_i - (1/(K-1)) sum_{j != i} R_j  =  K/(K-1) * (R_i - mean_g R)     (algorithms.md §1.4)

    rewards: (N,) outcome reward per trajectory. group_index: (N,) int, same task -> same id.
    Returns (N,) float.

    Edge cases, decided (the verl reference is inconsistent: `rloo` keeps a = R for K=1,
    `rloo_vectorized` gives 0):
    * group of one (K=1): a = 0. There is no other sample to form a baseline, and the raw reward
      would push every singleton's likelihood up or down with nothing to compare it with.
    * all-equal group: exactly 0. Empty input: empty output.
    Example: R=[1,0,0,1] (one group) -> [+2/3, -2/3, -2/3, +2/3]. Each group of K>=2 sums to 0.
    """
    rewards = _float(rewards)
    if rewards.numel() == 0:
        return rewards.clone()
    centred, counts, _, _ = _centred(rewards, group_index, singleton_mean_zero=False)
    scale = torch.where(counts > 1, counts / (counts - 1).clamp(min=1), torch.zeros_like(counts))
    return centred * scale


def loop(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    baseline: Literal["leave_one_out", "leave_none_out"] = "leave_one_out",
    scale_by_std: bool = False,
    eps: float = 1e-7,
) -> torch.Tensor:
    """LOOP advantages (Chen et al., arXiv 2502.01600; apple/ml-loop `phi_agents/rl/rl_utils.py`).

    leave_one_out:  A_i = R_i - (1/(K-1)) sum_{j != i} R_j       (the default; same as `rloo`)
    leave_none_out: A_i = R_i - mean_g R
    scale_by_std:   A_i /= max(std_g R, eps)   (LOOP's `adv_normalization`, default off: the paper
                    reports that std normalisation hurts)                    (algorithms.md §2)

    rewards: (N,) one reward per rollout; group_index: (N,) int, rollouts of one task share it.
    Returns (N,) float.

    Edge cases, decided:
    * std_g is the unbiased (ddof=1) std of the task group's rewards, like `grpo` [the ddof of the
      reference is unverified]; the floor max(std, eps) (not std + eps) is LOOP's.
    * group of one: A = 0 in both baselines (LOOP asserts K >= 2; we return "no signal" instead
      of failing a whole batch). All-equal group: exactly 0 (0 / eps is exactly 0).
    * LOOP's |A| < 0.01 rollout filter is a separate filter stage, not part of this function.
    """
    if baseline not in ("leave_one_out", "leave_none_out"):
        raise ValueError(f"unknown LOOP baseline {baseline!r}; allowed: 'leave_one_out', 'leave_none_out'")
    rewards = _float(rewards)
    if rewards.numel() == 0:
        return rewards.clone()
    centred, counts, stds, _ = _centred(rewards, group_index, singleton_mean_zero=False)
    if baseline == "leave_one_out":
        adv = centred * torch.where(counts > 1, counts / (counts - 1).clamp(min=1), torch.zeros_like(counts))
    else:
        adv = centred
    if scale_by_std:
        adv = adv / stds.clamp(min=eps)
    return adv


# ---------------------------------------------------------------------------------------------
# Token-level estimators over (B, T) with a loss mask
# ---------------------------------------------------------------------------------------------


def reinforce_pp(
    token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, arXiv 2501.03262; verl `compute_reinforce_plus_plus_outcome_advantage`).

    G_t   = r_t + gamma * G_{t'}     over valid tokens, t' = the next VALID token of the row (G = 0
                                      after the last one)
    adv   = masked_whiten(G, mask) * mask    (global batch normalisation over all valid tokens)
    returns = G * mask                                                     (algorithms.md §1.5)

    token_rewards, mask: (B, T). Returns (adv, returns), both (B, T) float, 0 where mask is 0.

    Edge cases, decided:
    * observation/tool tokens (mask 0) inside a row are SKIPPED as in GAE: they neither discount
      nor reset the running return. verl instead multiplies the running return by the mask, which
      resets it at every observation token, so earlier turns of a multi-turn row would never see
      the final reward; we keep one return over the generated tokens.
    * rewards placed on masked tokens are ignored (put them on the last action token).
    * fully masked rows, an all-masked batch, or an empty batch give zeros.
    """
    rewards = _float(token_rewards)
    valid = mask != 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], device=rewards.device, dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = torch.where(valid, returns, torch.zeros_like(returns))
    return masked_whiten(returns, valid), returns


def reinforce_pp_baseline(
    rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline (verl `compute_reinforce_plus_plus_baseline_outcome_advantage`).

    a_b = R_b - mean_g R   (group of one: mean 0, so a_b = R_b, as in verl)
    adv[b, t] = masked_whiten(a_b tiled over row b, mask)[b, t] * mask[b, t]   (algorithms.md §1.5)

    rewards: (B,) outcome reward per row; group_index: (B,) int; mask: (B, T).
    Returns adv (B, T) float (returns == adv for this critic-free estimator, so only adv is returned).

    Edge cases, decided: the whitening is token-weighted over the whole batch (long rows weigh
    more, as in verl). All-equal groups give a_b = 0 exactly; if every a_b is equal the output is
    exactly 0; fully masked rows are 0; empty input gives an empty (0, T) tensor.
    """
    rewards = _float(rewards)
    if rewards.numel() == 0:
        return torch.zeros(mask.shape, device=rewards.device, dtype=rewards.dtype)
    centred, _, _, _ = _centred(rewards, group_index, singleton_mean_zero=True)
    tiled = centred[:, None].expand(mask.shape).contiguous()
    return masked_whiten(tiled, mask)


def _gae_core(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Skip-on-mask GAE recursion over the last dim of (B, T); invalid positions hold the carry."""
    adv = torch.zeros_like(rewards)
    zeros_b = torch.zeros(rewards.shape[0], device=rewards.device, dtype=rewards.dtype)
    next_v, last_gae = zeros_b, zeros_b
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # invalid (observation/padding/missing) positions carry nothing forward: the next valid
        # position bootstraps straight from the previous valid one, as if the column were deleted
        next_v = torch.where(valid[:, t], values[:, t], next_v)
        last_gae = torch.where(valid[:, t], gae_t, last_gae)
        adv[:, t] = last_gae
    return adv


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE for PPO (Schulman et al. 2016, arXiv 1506.02438; verl
    `verl/trainer/ppo/core_algos.py::compute_gae_advantage_return`, algorithms.md §1.6).

    for t = T-1 .. 0:                                  (nextV = lastgae = 0 after the row's end)
        delta_t = r_t + gamma * nextV - V_t
        gae_t   = delta_t + gamma * lam * lastgae
        if mask_t: nextV = V_t; lastgae = gae_t        (masked tokens are skipped entirely)
        adv_t   = lastgae
    returns = adv + V          (before whitening: the critic's target)
    adv     = masked_whiten(adv, mask) if whiten

    token_rewards, values, mask: (B, T). Returns (adv, returns), (B, T) float, 0 where mask is 0.

    Edge cases, decided:
    * observation/tool tokens are skipped, so on action tokens the result equals GAE over the row
      with those columns deleted (tested). Rewards and values on masked tokens are ignored.
    * masked positions of adv AND returns are 0 (verl leaves the carried value there).
    * fully masked rows give zeros; whitening with 0/1 valid tokens follows `masked_whiten`.
    """
    rewards = _float(token_rewards)
    values = _float(values).to(rewards.dtype)
    valid = mask != 0
    if rewards.numel() == 0:
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    adv = _gae_core(rewards, values, valid, gamma, lam)
    zero = torch.zeros_like(adv)
    returns = torch.where(valid, adv + values, zero)
    adv = masked_whiten(adv, valid) if whiten else torch.where(valid, adv, zero)
    return adv, returns


# ---------------------------------------------------------------------------------------------
# Step-level estimators (one entry per agent turn) and their broadcast onto tokens
# ---------------------------------------------------------------------------------------------


def step_gae(
    step_rewards: torch.Tensor,
    step_values: torch.Tensor,
    step_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level GAE of StepPO (Wang et al., arXiv 2604.18401; AgentR1/StepPO
    `arft/core_algos.py::compute_gae_advantage_return`, algorithms.md §7).

    Tables are (S_tr, S_max): row = trajectory, column = step index; r_s is the step's summed
    reward, V_s the critic's value of the state before the step's first action token.
        delta_s = r_s + gamma * V_{s'} - V_s    (s' = next VALID step of the trajectory; V = 0 after it)
        A_s     = delta_s + gamma * lam * A_{s'}
        returns_s = A_s + V_s                       (before whitening)
        A       = whiten(A) over valid steps only, one entry per step (not per token)
    Broadcast onto tokens with `spread_steps`.

    Returns (adv, returns), both (S_tr, S_max) float, exactly 0 where step_mask is 0.

    Edge cases, decided:
    * missing steps (step_mask 0: padding, filtered or never reached) are SKIPPED: they do not
      advance the recursion, so step s bootstraps from the next present step. The reference
      silently runs them with r = V = 0, which for an interior gap injects a fake V=0 state; at the
      tail (the usual case: padding after termination) the two agree.
    * whitening is `masked_whiten` (x - mean) * rsqrt(var + 1e-8) over valid steps; the reference
      divides by (std + 1e-8). The two differ only when std is ~1e-4 or smaller; flat tables
      give exactly 0 here.
    * fully missing trajectories give zeros; empty tables give empty outputs.
    """
    return gae(step_rewards, step_values, step_mask, gamma=gamma, lam=lam, whiten=whiten)


def spread_steps(step_values: torch.Tensor, token_step: torch.Tensor, row_traj: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-step quantity onto each step's action tokens.

    out[b, t] = step_values[row_traj[b], token_step[b, t]]   if token_step[b, t] >= 0 else 0

    step_values: (S_tr, S_max) e.g. `step_gae` advantages or returns.
    token_step: (B, T) long, the step index of each action token, -1 on prompt/observation/padding.
    row_traj: (B,) long, the trajectory (row of step_values) each batch row belongs to.
    Works for one-row-per-step batches (all action tokens of a row share a step) and for packed
    rows holding a whole trajectory (several step indices in one row). Used by every step-level
    estimator (StepPO, GiGPO, EMPG) to reach the token-level loss. Returns (B, T).
    Out-of-range indices raise ValueError (a silent wrong broadcast would train the wrong tokens).
    """
    valid = token_step >= 0
    out = torch.zeros(token_step.shape, device=step_values.device, dtype=_float(step_values).dtype)
    if not bool(valid.any()):
        return out
    s_tr, s_max = step_values.shape
    traj = row_traj[:, None].expand(token_step.shape)
    if bool((traj[valid] < 0).any() | (traj[valid] >= s_tr).any()):
        raise ValueError(f"spread_steps: row_traj must index rows 0..{s_tr - 1} of step_values")
    if bool((token_step >= s_max).any()):
        raise ValueError(f"spread_steps: token_step must be -1 or a step index 0..{s_max - 1}")
    out[valid] = _float(step_values)[traj[valid], token_step[valid]]
    return out


def bi_level_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    step_end: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    high_level_gamma: float = 0.95,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-level (turn + token) GAE of RAGEN (RAGEN-AI/RAGEN @5eb79b8
    `ragen/trainer/core_algos.py::compute_bi_level_gae_advantage_return`, algorithms.md §1.6 last
    paragraph; off by default there, `high_level_gamma` 0.95).

    Our reading. Per row, let e_1 < ... < e_K be the turn ends (valid tokens with step_end).
    1. Turn level, over turn ends only, with gamma_hi = high_level_gamma:
         delta_k = r[e_k] + gamma_hi * V[e_{k+1}] - V[e_k]        (V[e_{K+1}] = 0)
         A_k     = delta_k + gamma_hi * lam * A_{k+1};   G_k = A_k + V[e_k]  (turn-level return)
    2. Token level inside each turn: the end token's reward is replaced by G_k with no bootstrap
       and no carried GAE, so adv[e_k] = G_k - V[e_k] = A_k; for the other valid tokens t of turn k
         delta_t = r_t + gamma * V[t'] - V_t,  adv_t = delta_t + gamma * lam * adv[t']
       (t' = the next valid token)
       Observation tokens between turns are skipped (they are never inside a turn).
    returns = adv + V (before whitening); adv = masked_whiten(adv, mask) if whiten.

    token_rewards, values, mask: (B, T); step_end: (B, T) bool, True on each turn's last action
    token. Returns (adv, returns), (B, T) float, 0 where mask is 0.

    Edge cases, decided:
    * turn ends come from `step_end`, not from "reward != 0" as in RAGEN (which loses turns whose
      reward is exactly 0). step_end on a masked token is ignored.
    * the last valid token of a row always ends a turn (a truncated final turn without step_end is
      still a turn; RAGEN would index past the row there).
    * rewards on non-end tokens (e.g. a per-token KL penalty) enter only the token level; put
      turn rewards on the end token. The same `lam` is used at both levels, as in RAGEN.
    * with step_end == mask (every token its own turn), this is `gae` with gamma = high_level_gamma.
    """
    rewards = _float(token_rewards)
    values = _float(values).to(rewards.dtype)
    valid = mask != 0
    zero = torch.zeros_like(rewards)
    if rewards.numel() == 0:
        return zero, zero.clone()
    # last valid token of each row: valid and no valid token after it
    valid_after = valid.flip(1).long().cumsum(1).flip(1)
    is_end = valid & ((step_end != 0) | (valid_after == 1))
    adv = torch.zeros_like(rewards)
    zeros_b = torch.zeros(rewards.shape[0], device=rewards.device, dtype=rewards.dtype)
    hi_next_v, hi_last, next_v, last_gae = zeros_b, zeros_b, zeros_b, zeros_b
    for t in reversed(range(rewards.shape[1])):
        r_t, v_t, end_t, valid_t = rewards[:, t], values[:, t], is_end[:, t], valid[:, t]
        # turn level (only moves at turn ends)
        a_hi = r_t + high_level_gamma * hi_next_v - v_t + high_level_gamma * lam * hi_last
        hi_next_v = torch.where(end_t, v_t, hi_next_v)
        hi_last = torch.where(end_t, a_hi, hi_last)
        # token level: a turn end restarts the recursion from its turn-level advantage
        gae_t = r_t + gamma * next_v - v_t + gamma * lam * last_gae
        gae_t = torch.where(end_t, a_hi, gae_t)
        next_v = torch.where(valid_t, v_t, next_v)
        last_gae = torch.where(valid_t, gae_t, last_gae)
        adv[:, t] = last_gae
    returns = torch.where(valid, adv + values, zero)
    adv = masked_whiten(adv, valid) if whiten else torch.where(valid, adv, zero)
    return adv, returns


# ---------------------------------------------------------------------------------------------
# GiGPO: episode + anchor-state step advantages over step rows
# ---------------------------------------------------------------------------------------------


def _anchor_clusters(
    groups: list[int], keys: Sequence[Hashable], similarity_thresh: float | None
) -> list[int]:
    """Cluster id per row: rows of the same task group with the same (or similar) anchor state."""
    cluster: list[int] = []
    if similarity_thresh is None:
        ids: dict[tuple[int, Hashable], int] = {}
        for g, key in zip(groups, keys, strict=True):
            try:
                cluster.append(ids.setdefault((g, key), len(ids)))
            except TypeError as err:
                raise TypeError(
                    f"gigpo: anchor key {key!r} is not hashable; convert lists/arrays to tuples "
                    "(e.g. tuple(arr.flatten().tolist())) before calling"
                ) from err
        return cluster
    reps: dict[int, list[tuple[str, int]]] = {}  # task group -> [(representative text, cluster id)]
    next_id = 0
    for g, key in zip(groups, keys, strict=True):
        if not isinstance(key, str):
            raise TypeError(f"gigpo: similarity mode compares strings; got {type(key).__name__}")
        for rep, cid in reps.setdefault(g, []):
            if difflib.SequenceMatcher(None, rep, key).ratio() >= similarity_thresh:
                cluster.append(cid)
                break
        else:
            reps[g].append((key, next_id))
            cluster.append(next_id)
            next_id += 1
    return cluster


def gigpo(
    episode_rewards: torch.Tensor,
    step_rewards: torch.Tensor,
    group_index: torch.Tensor,
    traj_index: torch.Tensor,
    step_index: torch.Tensor,
    anchor_keys: Sequence[Hashable],
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    mode: Literal["mean_norm", "mean_std_norm"] = "mean_norm",
    cross_steps: bool = True,
    similarity_thresh: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO advantages over step rows (Feng et al., arXiv 2505.10978; langfengQ/verl-agent
    `gigpo/core_gigpo.py`, algorithms.md §4).

    Episode (Eq. 3):  A^E = (R(tau) - mean_group R) / F
    Step return (Eq. 5): R_t = sum_{k >= t} gamma^(k-t) r_k   (within the trajectory)
    Anchor groups (Eq. 6): rows of the same task group whose anchor state is identical
    Step (Eq. 7):     A^S = (R_t - mean_anchor-group R_t) / F
    Combined (Eq. 8): A = A^E + omega * A^S
    F = unbiased std + eps ("mean_std_norm") or 1 ("mean_norm", the config default).

    One entry per step row (N_steps,): episode_rewards (R(tau) of the row's trajectory),
    step_rewards (r_t), group_index / traj_index / step_index int tensors, anchor_keys a sequence
    of hashable anchor states (the raw current observation: str, tuple, ...). Returns (N_steps,)
    float; broadcast to tokens with `spread_steps` or per row.

    Edge cases, decided:
    * cross_steps=True (verl-agent's default): episode mean/std over step ROWS, a T-step
      trajectory counted T times; False: one entry per trajectory (paper Eq. 3), using the mean of
      the trajectory's row values (equal to R(tau) unless a per-row penalty was applied).
    * episode-group singleton = the task group holds ONE trajectory (however many rows): mean 0,
      F = 1, A^E = raw R (verl convention; verl-agent counts rows in cross-steps mode, which makes
      a one-trajectory, multi-step group give 0 — we keep the singleton rule independent of length).
    * anchor-group singleton: A^S = 0. All-equal group (episode or anchor): exactly 0.
    * anchor groups never cross task groups. Exact mode hashes the keys; similarity mode
      (similarity_thresh set, strings only) joins the FIRST cluster, in row order, whose
      representative (first member) has difflib.SequenceMatcher ratio >= thresh. Order-dependent.
    * step returns follow step_index order; a gap in step_index is discounted by its length, its
      missing rewards count as 0. A duplicated (traj, step) pair raises ValueError; so does a
      trajectory spread over two task groups.
    Worked example (gamma 0.95, mean_norm, cross-steps): A obs [s0,s1] r [0,10], B obs [s0,s2,s3]
    r [0,0,0] -> A0=10.75, A1=6, B0=-8.75, B1=B2=-4.
    """
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"unknown GiGPO mode {mode!r}; allowed: 'mean_norm', 'mean_std_norm'")
    n = episode_rewards.numel()
    if not (step_rewards.numel() == group_index.numel() == traj_index.numel() == step_index.numel() == n):
        raise ValueError("gigpo: all per-row inputs must have the same length N_steps")
    if len(anchor_keys) != n:
        raise ValueError(f"gigpo: {len(anchor_keys)} anchor keys for {n} step rows")
    ep = _float(episode_rewards).reshape(-1)
    if n == 0:
        return ep.clone()
    dev, dt = ep.device, ep.dtype
    std_norm = mode == "mean_std_norm"

    # --- episode level -------------------------------------------------------------------------
    _, g_inv = torch.unique(group_index.reshape(-1), return_inverse=True)
    _, t_inv = torch.unique(traj_index.reshape(-1), return_inverse=True)
    n_groups, n_trajs = int(g_inv.max()) + 1, int(t_inv.max()) + 1
    traj_group = torch.full((n_trajs,), -1, device=dev, dtype=torch.long).scatter_reduce(
        0, t_inv, g_inv, reduce="amax"
    )
    if bool((traj_group[t_inv] != g_inv).any()):
        raise ValueError(
            "gigpo: every row of a trajectory must carry the same group_index; make traj_index unique "
            "across the batch (not just within a task group)"
        )
    trajs_per_group = torch.zeros(n_groups, device=dev, dtype=dt).index_add_(
        0, traj_group, torch.ones(n_trajs, device=dev, dtype=dt)
    )
    _, means, stds, flat = _group_stats(ep, g_inv, n_groups)  # over rows (cross-steps)
    if not cross_steps:  # one entry per trajectory: the mean of its rows
        t_counts = torch.zeros(n_trajs, device=dev, dtype=dt).index_add_(0, t_inv, torch.ones_like(ep))
        per_traj = torch.zeros(n_trajs, device=dev, dtype=dt).index_add_(0, t_inv, ep) / t_counts
        _, means, stds, _ = _group_stats(per_traj, traj_group, n_groups)
    single = trajs_per_group == 1
    means = torch.where(single, torch.zeros_like(means), means)
    centred = ep - means[g_inv]
    # a group whose rows are all equal gives exact zeros, not rounding noise (singletons excepted)
    centred = torch.where(flat[g_inv] & ~single[g_inv], torch.zeros_like(ep), centred)
    if std_norm:
        # F = 1 where there is no spread to divide by (a singleton, or per-trajectory values that
        # are equal while per-row penalties differ): dividing by eps would blow such rows up
        denom = torch.where(single | (stds == 0), torch.ones_like(stds), stds + eps)
        centred = centred / denom[g_inv]
    adv_episode = centred

    # --- step level ----------------------------------------------------------------------------
    traj, step = t_inv.tolist(), step_index.reshape(-1).tolist()
    rew = _float(step_rewards).reshape(-1).tolist()
    order = _sorted_steps(traj, step, "gigpo")
    step_returns = [0.0] * n
    nxt: int | None = None
    for i in reversed(order):  # backward over each trajectory's steps; float64 in Python
        if nxt is not None and traj[nxt] == traj[i]:
            step_returns[i] = rew[i] + gamma ** (step[nxt] - step[i]) * step_returns[nxt]
        else:
            step_returns[i] = rew[i]
        nxt = i
    ret = torch.tensor(step_returns, device=dev, dtype=dt)
    clusters = _anchor_clusters(g_inv.tolist(), anchor_keys, similarity_thresh)
    c_inv = torch.tensor(clusters, device=dev, dtype=torch.long)
    _, c_means, c_stds, c_flat = _group_stats(ret, c_inv, max(clusters) + 1)
    adv_step = torch.where(c_flat[c_inv], torch.zeros_like(ret), ret - c_means[c_inv])  # singletons are flat
    if std_norm:
        adv_step = adv_step / (c_stds[c_inv] + eps)
    return adv_episode + omega * adv_step


# ---------------------------------------------------------------------------------------------
# Multi-task / multi-environment normalisation
# ---------------------------------------------------------------------------------------------


def normalize_by_task(
    adv: torch.Tensor, task_index: torch.Tensor, mask: torch.Tensor | None = None, *, eps: float = 1e-6
) -> torch.Tensor:
    """Per-task advantage normalisation of AgentRL (Zhang et al., THUDM, arXiv 2510.04206;
    no public code, formula inferred: algorithms.md §5).

    A_hat = (A - mean_k A) / (std_k A + eps), mean/std (unbiased) over the valid entries of task k.

    adv: (N,) per sample with task_index (N,), or (B, T) per token with task_index (B,) (one task
    per row); mask: adv's shape, default all valid. Returns adv's shape, 0 where mask is 0.

    Edge cases, decided (the exact granularity is [unverified] in the paper):
    * granularity follows the input: 2-D input is normalised per valid TOKEN (long responses weigh
      more, as in `masked_whiten` and the token-mean loss); pass per-sample (N,) values to get
      per-sample statistics.
    * a task whose valid entries are all equal (including a task with one entry) gives exactly 0.
    * fully masked tasks/rows give 0; empty input gives empty output.
    """
    x = _float(adv)
    out = torch.zeros_like(x)
    valid = torch.ones_like(x, dtype=torch.bool) if mask is None else mask != 0
    if x.numel() == 0 or not bool(valid.any()):
        return out
    task = task_index.reshape(-1, *([1] * (x.dim() - 1))).expand(x.shape)
    xv, tv = x[valid], task[valid]
    _, inv = torch.unique(tv, return_inverse=True)
    _, means, stds, flat = _group_stats(xv, inv, int(inv.max()) + 1)
    normed = (xv - means[inv]) / (stds[inv] + eps)
    out[valid] = torch.where(flat[inv], torch.zeros_like(xv), normed)
    return out


def grpo_env_std(
    rewards: torch.Tensor, group_index: torch.Tensor, env_index: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """ERPO environment-level relative advantages (AutoForge, Cai, Fang et al., arXiv 2512.22857;
    no public code: algorithms.md §6).

    A_i = (R_i - mean_{task group of i} R) / (std_{environment of i} R + eps)

    rewards: (N,); group_index: (N,) task group (rollouts of one task); env_index: (N,) the
    synthesized environment the task belongs to. Returns (N,) float.

    Edge cases, decided ([unverified] in the source: whether the mean is task- or env-level):
    * the mean is the TASK-GROUP mean (each group keeps a zero-sum baseline, as in GRPO); only the
      scale is pooled over the environment (unbiased std over all its rollouts), which is what
      keeps tasks with tiny group std from exploding.
    * task group of one: mean 0, so A = R / F (the `grpo` singleton convention).
    * an environment with one rollout or all-equal rewards uses F = 1 (no spread to divide by;
      std + eps would turn a singleton's raw reward into R / 1e-6).
    * all-equal task group: exactly 0 even if its environment has spread. Empty -> empty.
    """
    rewards = _float(rewards)
    if rewards.numel() == 0:
        return rewards.clone()
    centred, _, _, _ = _centred(rewards, group_index, singleton_mean_zero=True)
    _, env_inv = torch.unique(env_index, return_inverse=True)
    _, _, env_std, env_flat = _group_stats(rewards, env_inv, int(env_inv.max()) + 1)
    denom = torch.where(env_flat, torch.ones_like(env_std), env_std + eps)
    return centred / denom[env_inv]


# ---------------------------------------------------------------------------------------------
# EMPG: entropy-modulated step advantages
# ---------------------------------------------------------------------------------------------


def empg(
    step_adv: torch.Tensor,
    step_entropy: torch.Tensor,
    traj_index: torch.Tensor,
    step_index: torch.Tensor,
    *,
    k: float = 1.0,
    k_f: float = 1.0,
    zeta: float = 0.1,
) -> torch.Tensor:
    """Entropy-Modulated Policy Gradients (ByteDance Seed, arXiv 2509.09265; pseudocode on
    empgseed-seed.github.io, no public code: algorithms.md §12).

    H_norm = (H - min_batch H) / (max_batch H - min_batch H + 1e-8)
    g(H)   = exp(-k * H_norm) / mean_batch exp(-k * H_norm)       (self-calibrated: batch mean 1)
    f(H)   = exp(-k_f * H_norm)                                    (future-clarity bonus)
    A_mod(t) = g(H_t) * A_t + zeta * f(H_{t+1})

    step_adv: (N_steps,) outcome advantage of each step row (e.g. GRPO of its trajectory);
    step_entropy: (N_steps,) mean token entropy of the step's action; traj_index, step_index:
    (N_steps,) int. Returns (N_steps,) float.

    Edge cases, decided:
    * H_{t+1} is the entropy of the NEXT present step of the same trajectory (smallest larger
      step_index); the last step of a trajectory gets no bonus (0).
    * all statistics are over the whole batch of steps (one entry per step). All-equal entropies
      give H_norm = 0, g = 1 and f = 1.
    * no re-normalisation of A_mod afterwards ([unverified] in the source; apply a whitening
      stage separately if wanted). Duplicate (traj, step) pairs raise. Empty -> empty.
    """
    adv = _float(step_adv).reshape(-1)
    n = adv.numel()
    if step_entropy.numel() != n or traj_index.numel() != n or step_index.numel() != n:
        raise ValueError("empg: step_adv, step_entropy, traj_index and step_index need one entry per step")
    if n == 0:
        return adv.clone()
    h = _float(step_entropy).reshape(-1).to(adv.dtype)
    h_norm = (h - h.min()) / (h.max() - h.min() + 1e-8)
    g = torch.exp(-k * h_norm)
    g = g / g.mean()
    f = torch.exp(-k_f * h_norm)
    traj, step = traj_index.reshape(-1).tolist(), step_index.reshape(-1).tolist()
    order = _sorted_steps(traj, step, "empg")
    next_row = torch.full((n,), -1, dtype=torch.long)
    for a, b in zip(order, order[1:], strict=False):
        if traj[a] == traj[b]:
            next_row[a] = b
    next_row = next_row.to(adv.device)
    has_next = next_row >= 0
    bonus = torch.where(has_next, zeta * f[next_row.clamp(min=0)], torch.zeros_like(adv))
    return g * adv + bonus
