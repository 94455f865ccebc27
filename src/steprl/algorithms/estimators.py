"""Estimator adapters: `AdvantageInputs` -> token-level `AdvantageOutput`.

Each adapter calls one pure function of `advantages.py` at the level it works on (trajectory,
step or token) and broadcasts the result onto the action tokens. The trainer calls
`ADVANTAGES[name](inputs, **params)` and never branches on the name. An estimator that needs a
critic says so in `ESTIMATOR_NEEDS_CRITIC`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from steprl.algorithms import advantages as adv
from steprl.algorithms import step_advantages as step_adv
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput, first_token_of_steps


def per_trajectory(x: AdvantageInputs, a: Tensor) -> AdvantageOutput:
    """Broadcast one scalar per trajectory (N,) onto the action tokens of its rows."""
    tok = a.float()[x.row_traj][:, None] * x.mask
    return AdvantageOutput(tok, tok)


def per_step(x: AdvantageInputs, a: Tensor, returns: Tensor | None = None) -> AdvantageOutput:
    """Broadcast one scalar per step (S,) onto that step's action tokens."""
    padded = torch.cat([a.float(), torch.zeros(1)])
    idx = torch.where(x.token_step >= 0, x.token_step, torch.full_like(x.token_step, a.numel()))
    tok = padded[idx] * x.mask
    if returns is None:
        return AdvantageOutput(tok, tok)
    ret = torch.cat([returns.float(), torch.zeros(1)])[idx] * x.mask
    return AdvantageOutput(tok, ret)


def _need_values(x: AdvantageInputs, name: str) -> Tensor:
    if x.values is None:
        raise ValueError(
            f"advantage estimator {name!r} needs a critic: set algorithm.critic to 'separate' or 'shared'"
        )
    return x.values


def grpo(x: AdvantageInputs, *, scale_by_std: bool = True, eps: float = 1e-6) -> AdvantageOutput:
    return per_trajectory(x, adv.grpo(x.rewards, x.group_index, scale_by_std=scale_by_std, eps=eps))


def dr_grpo(x: AdvantageInputs) -> AdvantageOutput:
    return per_trajectory(x, adv.grpo(x.rewards, x.group_index, scale_by_std=False))


def rloo(x: AdvantageInputs) -> AdvantageOutput:
    return per_trajectory(x, adv.rloo(x.rewards, x.group_index))


def loop(
    x: AdvantageInputs,
    *,
    baseline: Literal["leave_one_out", "leave_none_out"] = "leave_one_out",
    scale_by_std: bool = False,
) -> AdvantageOutput:
    return per_trajectory(x, adv.loop(x.rewards, x.group_index, baseline=baseline, scale_by_std=scale_by_std))


def grpo_env_std(x: AdvantageInputs) -> AdvantageOutput:
    return per_trajectory(x, adv.grpo_env_std(x.rewards, x.group_index, x.env_index, user_error=x.user_error))


def reinforce_pp(x: AdvantageInputs, *, gamma: float = 1.0) -> AdvantageOutput:
    """`advantages.reinforce_pp` with one return over each trajectory: on one-row-per-step
    layouts a row's return carries the later steps' rewards (restarting at every row, earlier
    steps would never see the outcome), so a token gets the same advantage in either layout."""
    tokens = x.trajectory_tokens
    table = adv.discounted_returns(tokens.to_table(x.token_rewards), tokens.table_mask(), gamma=gamma)
    ret = tokens.to_rows(table, tuple(x.mask.shape))
    return AdvantageOutput(adv.masked_whiten(ret, x.mask), ret)


def reinforce_pp_baseline(x: AdvantageInputs) -> AdvantageOutput:
    """`advantages.reinforce_pp_baseline` with one entry per trajectory in its group's mean (per
    row, a trajectory of k step rows would count k times), whitened over the action tokens."""
    tokens = x.trajectory_tokens
    table = adv.reinforce_pp_baseline(x.rewards, x.group_index, tokens.table_mask())
    a = tokens.to_rows(table, tuple(x.mask.shape))
    return AdvantageOutput(a, a)


def gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0) -> AdvantageOutput:
    """`advantages.gae` over each trajectory's action tokens in order (`trajectory_tokens`): on
    one-row-per-step layouts a step's last token bootstraps from the next step's value and its
    GAE carries the later steps' (restarting at every row, it would not), so a token gets the
    same advantage in either layout. On one row per trajectory this is the row recursion."""
    values = _need_values(x, "gae")
    tokens = x.trajectory_tokens
    raw, _ = adv.gae(
        tokens.to_table(x.token_rewards),
        tokens.to_table(values),
        tokens.table_mask(),
        gamma=gamma,
        lam=lam,
        whiten=False,
    )
    return _whitened_with_returns(x, tokens.to_rows(raw, tuple(x.mask.shape)), values)


def bi_level_gae(
    x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, high_level_gamma: float = 0.95
) -> AdvantageOutput:
    """`advantages.bi_level_gae` over each trajectory's action tokens in order, as `gae`: the
    turn-level recursion runs over the turn ends (each step's last action token, `step_end`) of
    the whole trajectory, and the trajectory's last action token ends a turn, not each row's."""
    values = _need_values(x, "bi_level_gae")
    tokens = x.trajectory_tokens
    raw, _ = adv.bi_level_gae(
        tokens.to_table(x.token_rewards),
        tokens.to_table(values),
        tokens.table_mask(),
        tokens.to_table(x.step_end),
        gamma=gamma,
        lam=lam,
        high_level_gamma=high_level_gamma,
        whiten=False,
    )
    return _whitened_with_returns(x, tokens.to_rows(raw, tuple(x.mask.shape)), values)


def _whitened_with_returns(x: AdvantageInputs, raw: Tensor, values: Tensor) -> AdvantageOutput:
    """(B, T) raw GAE on the action tokens -> whitened advantages and returns = raw + V, as
    `advantages.gae` finishes them (whitened over the rows, so the order of the sum is the
    rows', and one row per trajectory gives the same bits as the row recursion)."""
    valid = x.mask != 0
    returns = torch.where(valid, raw + adv.as_float(values).to(raw.dtype), torch.zeros_like(raw))
    return AdvantageOutput(adv.masked_whiten(raw, valid), returns)


def step_gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0) -> AdvantageOutput:
    """StepPO: one value per step (at its first action token), GAE over steps, whitened per step."""
    _need_values(x, "step_gae")
    step_values = x.step_values
    assert step_values is not None
    n_traj = int(x.rewards.numel())
    max_steps = int(x.step_index.max().item()) + 1 if x.step_index.numel() else 1
    table_r = torch.zeros(n_traj, max_steps)
    table_v = torch.zeros(n_traj, max_steps)
    table_m = torch.zeros(n_traj, max_steps)
    table_r[x.step_traj, x.step_index] = x.step_rewards.float()
    table_v[x.step_traj, x.step_index] = step_values
    table_m[x.step_traj, x.step_index] = 1.0
    a, ret = step_adv.step_gae(table_r, table_v, table_m, gamma=gamma, lam=lam)
    return per_step(x, a[x.step_traj, x.step_index], ret[x.step_traj, x.step_index])


def gigpo(
    x: AdvantageInputs,
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    mode: Literal["mean_norm", "mean_std_norm"] = "mean_norm",
    cross_steps: bool = True,
    similarity_thresh: float | None = None,
) -> AdvantageOutput:
    a = step_adv.gigpo(
        x.rewards[x.step_traj],
        x.step_rewards,
        x.group_index[x.step_traj],
        x.step_traj,
        x.step_index,
        x.anchor_keys,
        gamma=gamma,
        omega=omega,
        mode=mode,
        cross_steps=cross_steps,
        similarity_thresh=similarity_thresh,
    )
    return per_step(x, a)


# ---- modifiers: applied after any estimator, switched on by config flags --------------------


def task_normalized(x: AdvantageInputs, out: AdvantageOutput) -> AdvantageOutput:
    """AgentRL task-level normalisation: per environment, over its action tokens."""
    a = adv.normalize_by_task(out.advantages, x.env_index[x.row_traj], x.mask)
    return AdvantageOutput(a * x.mask, out.returns)


def entropy_modulated(
    x: AdvantageInputs, out: AdvantageOutput, *, k: float = 1.0, k_f: float = 1.0, zeta: float = 0.1
) -> AdvantageOutput:
    """EMPG: rescale each step's advantage by its (batch-normalised) confidence."""
    if x.entropy is None:
        raise ValueError("EMPG needs token entropies; the trainer records them when algorithm.empg is set")
    step_entropy = x.step_entropy
    assert step_entropy is not None
    # each step's current advantage = its value on its first action token
    per_step_adv = first_token_of_steps(out.advantages, x.token_step, x.step_traj.numel())
    modulated = step_adv.empg(per_step_adv, step_entropy, x.step_traj, x.step_index, k=k, k_f=k_f, zeta=zeta)
    return AdvantageOutput(per_step(x, modulated).advantages, out.returns)
