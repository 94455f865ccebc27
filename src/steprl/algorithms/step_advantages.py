"""Step-level advantage estimators: StepPO step GAE, GiGPO, EMPG, and spreading a per-step value
onto the step's action tokens. Pure functions over tensors (S = number of steps in the batch)."""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from steprl.algorithms.advantages import as_float, gae, group_stats


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


# Step-level GAE of StepPO (Wang et al., arXiv 2604.18401; AgentR1/StepPO
# `arft/core_algos.py::compute_gae_advantage_return`, algorithms.md §7) is token GAE run over a
# step table instead of a token row, so it is `gae` itself (one recursion, not two to keep equal):
# step_gae(step_rewards, step_values, step_mask, *, gamma=1.0, lam=1.0, whiten=True).
#
# Tables are (S_tr, S_max): row = trajectory, column = step index; r_s is the step's summed
# reward, V_s the critic's value of the state before the step's first action token.
#     delta_s = r_s + gamma * V_{s'} - V_s    (s' = next VALID step of the trajectory; V = 0 after it)
#     A_s     = delta_s + gamma * lam * A_{s'}
#     returns_s = A_s + V_s                       (before whitening)
#     A       = whiten(A) over valid steps only, one entry per step (not per token)
# Broadcast onto tokens with `spread_steps`.
#
# Returns (adv, returns), both (S_tr, S_max) float, exactly 0 where step_mask is 0.
#
# Edge cases, decided:
# * missing steps (step_mask 0: padding, filtered or never reached) are SKIPPED: they do not
#   advance the recursion, so step s bootstraps from the next present step. The reference
#   silently runs them with r = V = 0, which for an interior gap injects a fake V=0 state; at the
#   tail (the usual case: padding after termination) the two agree.
# * whitening is `masked_whiten` (x - mean) * rsqrt(var + 1e-8) over valid steps; the reference
#   divides by (std + 1e-8). The two differ only when std is ~1e-4 or smaller; flat tables
#   give exactly 0 here.
# * fully missing trajectories give zeros; empty tables give empty outputs.
step_gae = gae


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
    out = torch.zeros(token_step.shape, device=step_values.device, dtype=as_float(step_values).dtype)
    if not bool(valid.any()):
        return out
    s_tr, s_max = step_values.shape
    traj = row_traj[:, None].expand(token_step.shape)
    if bool((traj[valid] < 0).any() | (traj[valid] >= s_tr).any()):
        raise ValueError(f"spread_steps: row_traj must index rows 0..{s_tr - 1} of step_values")
    if bool((token_step >= s_max).any()):
        raise ValueError(f"spread_steps: token_step must be -1 or a step index 0..{s_max - 1}")
    out[valid] = as_float(step_values)[traj[valid], token_step[valid]]
    return out


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
    ep = as_float(episode_rewards).reshape(-1)
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
    _, means, stds, flat = group_stats(ep, g_inv, n_groups)  # over rows (cross-steps)
    if not cross_steps:  # one entry per trajectory: the mean of its rows
        t_counts = torch.zeros(n_trajs, device=dev, dtype=dt).index_add_(0, t_inv, torch.ones_like(ep))
        per_traj = torch.zeros(n_trajs, device=dev, dtype=dt).index_add_(0, t_inv, ep) / t_counts
        _, means, stds, _ = group_stats(per_traj, traj_group, n_groups)
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
    rew = as_float(step_rewards).reshape(-1).tolist()
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
    _, c_means, c_stds, c_flat = group_stats(ret, c_inv, max(clusters) + 1)
    adv_step = torch.where(c_flat[c_inv], torch.zeros_like(ret), ret - c_means[c_inv])  # singletons are flat
    if std_norm:
        adv_step = adv_step / (c_stds[c_inv] + eps)
    return adv_episode + omega * adv_step


# ---------------------------------------------------------------------------------------------
# Multi-task / multi-environment normalisation
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
    adv = as_float(step_adv).reshape(-1)
    n = adv.numel()
    if step_entropy.numel() != n or traj_index.numel() != n or step_index.numel() != n:
        raise ValueError("empg: step_adv, step_entropy, traj_index and step_index need one entry per step")
    if n == 0:
        return adv.clone()
    h = as_float(step_entropy).reshape(-1).to(adv.dtype)
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
