"""Advantage estimators: pure functions over tensors.

Convention (verl): one scalar per trajectory, broadcast later onto its action tokens by the
learner; observation tokens get nothing because their loss mask is 0.

Shapes used below: N trajectories (or step rows), B rows x T token positions, S_tr trajectories x
S_max steps for step tables. `mask` is 1/True on action tokens (sampled by the policy) and 0 on
prompt, observation and padding tokens; any non-zero entry counts as valid. Formulas, defaults and
worked vectors: `reference/algorithms.md` (section numbers cited per function).

Step-level estimators (step GAE, GiGPO, EMPG) live in `step_advantages.py`.

House rules every function here keeps (tested in tests/algorithms/test_advantages_lib.py):
* never NaN: a group (or batch) whose values are all equal gives exactly 0, not 0/eps noise;
* empty inputs give empty outputs of the right shape, and never raise;
* masked (invalid) positions of every token-level output are exactly 0.
"""

from __future__ import annotations

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
# Shared helpers (`as_float`, `group_stats` are also used by `step_advantages.py`). Group
# statistics are computed with scatter ops so that group ids can be any integers in any order, and
# "all equal" is detected exactly (max == min) rather than by comparing a float std with a threshold.
# ---------------------------------------------------------------------------------------------


def as_float(x: torch.Tensor) -> torch.Tensor:
    """Keep float dtypes (float64 stays float64); promote ints/bools to float32."""
    return x if x.is_floating_point() else x.to(torch.float32)


def group_stats(
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
    counts, means, stds, flat = group_stats(values, inverse, num_groups)
    centred = torch.where(flat[inverse], torch.zeros_like(values), values - means[inverse])
    if singleton_mean_zero:
        centred = torch.where(counts[inverse] == 1, values, centred)
    return centred, counts[inverse], stds[inverse], flat[inverse]


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
    x = as_float(x)
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
    rewards = as_float(rewards)
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
    rewards = as_float(rewards)
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
    * the return runs per ROW: on one-row-per-step layouts the adapter `estimators.reinforce_pp`
      joins each trajectory's rows first (`AdvantageInputs.trajectory_tokens`).
    """
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask != 0), returns


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} per row of (B, T), t' the next valid token (the return of
    `reinforce_pp`): masked tokens are skipped and hold 0. Returns (B, T) float."""
    rewards = as_float(token_rewards)
    valid = mask != 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], device=rewards.device, dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(valid, returns, torch.zeros_like(returns))


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
    rewards = as_float(rewards)
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
    * the recursion runs per ROW: on one-row-per-step layouts the adapter `estimators.gae`
      joins each trajectory's rows first (`AdvantageInputs.trajectory_tokens`).
    """
    rewards = as_float(token_rewards)
    values = as_float(values).to(rewards.dtype)
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
    * both levels run per ROW (a row's last valid token ends a turn): on one-row-per-step
      layouts the adapter `estimators.bi_level_gae` joins each trajectory's rows first
      (`AdvantageInputs.trajectory_tokens`), so turn ends carry across rows.
    """
    rewards = as_float(token_rewards)
    values = as_float(values).to(rewards.dtype)
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
    x = as_float(adv)
    out = torch.zeros_like(x)
    valid = torch.ones_like(x, dtype=torch.bool) if mask is None else mask != 0
    if x.numel() == 0 or not bool(valid.any()):
        return out
    task = task_index.reshape(-1, *([1] * (x.dim() - 1))).expand(x.shape)
    xv, tv = x[valid], task[valid]
    _, inv = torch.unique(tv, return_inverse=True)
    _, means, stds, flat = group_stats(xv, inv, int(inv.max()) + 1)
    normed = (xv - means[inv]) / (stds[inv] + eps)
    out[valid] = torch.where(flat[inv], torch.zeros_like(xv), normed)
    return out


def grpo_env_std(
    rewards: torch.Tensor, group_index: torch.Tensor, env_index: torch.Tensor, *, eps: float = 1e-6,
    user_error: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
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
    * `user_error` (N,) bool, ERPO's mask of errors the simulated user caused: those get 0 and are
      left out of every mean and std (neither blamed nor credited for the user's mistake).
    """
    rewards = as_float(rewards)
    if user_error is not None and bool(user_error.any()):
        out, keep = torch.zeros_like(rewards), ~user_error.bool()
        out[keep] = grpo_env_std(rewards[keep], group_index[keep], env_index[keep], eps=eps)
        return out
    if rewards.numel() == 0:
        return rewards.clone()
    centred, _, _, _ = _centred(rewards, group_index, singleton_mean_zero=True)
    _, env_inv = torch.unique(env_index, return_inverse=True)
    _, _, env_std, env_flat = group_stats(rewards, env_inv, int(env_inv.max()) + 1)
    denom = torch.where(env_flat, torch.ones_like(env_std), env_std + eps)
    return centred / denom[env_inv]


# ---------------------------------------------------------------------------------------------
# EMPG: entropy-modulated step advantages
# ---------------------------------------------------------------------------------------------
