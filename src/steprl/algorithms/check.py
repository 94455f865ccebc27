"""`check_advantage`, `check_policy_loss`, `check_group_filter`: the contract of an entry of
`ADVANTAGES`, `POLICY_LOSSES` and `GROUP_FILTERS`, as `check_env` is an env's. The tests run them
over every entry of the three dicts (tests/algorithms/test_registry_contracts.py); register your
own estimator, loss or filter in its dict, then run the check on its name. Each check takes
milliseconds: it runs the function on small synthetic batches, never a model.

What `check_advantage(name)` proves, on a batch of three task groups x four rollouts of one to
three steps (observation tokens and padding inside the rows, two environments), laid out as
one row per trajectory and as one row per step (the two layouts the context rules produce):
- ``shapes``: advantages and returns are float tensors of the mask's shape;
- ``finite``: no NaN or inf anywhere, in either layout;
- ``masked``: advantages and returns are exactly 0 off the mask (prompt, observation, padding);
- ``pure``: the inputs are not modified and a second call gives the same output;
- ``layouts``: the two layouts of the same rollouts (and the same critic values on the same
  action tokens) give the same advantages and returns at every action token: a recursion over
  a trajectory (a return, GAE) must run over its action tokens in order, whichever rows hold them
  (`AdvantageInputs.trajectory_tokens`); restarted at every step row, a step's last token would
  not see the later steps;
- ``ordered``: of two rollouts of one group with the same shape, the one with the higher
  reward gets the higher mean advantage (a critic, if read, values every state alike);
- ``no_signal`` (estimators without a critic): a batch in which every rollout got the same
  rewards gives exactly 0 everywhere, no rounding noise, in either layout (a return that
  restarted at every step row would leave earlier steps without the outcome, and non-zero);
- ``critic`` (estimators marked in `ADVANTAGE_NEEDS_CRITIC`): without critic values the call
  raises a ValueError that names ``algorithm.critic``; different values on the action tokens
  change the advantages, values off the mask change nothing.
The report also measures ``zero_on_flat_groups``: a group whose rollouts all got the same
reward gets exactly 0 even beside groups with spread. That is the contract of group-relative
estimators (GRPO, RLOO, ...) only: whitening over the whole batch (REINFORCE++) or a critic
moves a flat group's advantages with the rest, so the check reports it and does not require it.

`check_policy_loss(name)`: ``shapes``; ``finite`` (the loss, and its value under every
aggregation mode, with extreme log-probs off the mask); ``masked_grad`` (exactly zero gradient
off the mask); ``no_signal`` (zero advantages give zero loss and gradient); ``on_policy``
(with the behaviour and proximal log-probs equal to the current ones, the gradient descends
toward higher log-probs exactly where the advantage is positive).

`check_group_filter(name)`: ``indices`` (a sorted 1-D int64 tensor of distinct group indices
in range, on groups of different sizes, flat, singleton and spread), ``empty`` (no groups in,
none out), ``pure`` (inputs unchanged, same answer twice).

A broken contract raises `AlgorithmCheckError`, saying which property and what to fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, NoReturn

import torch
from torch import Tensor

from steprl.algorithms import (
    ADVANTAGE_NEEDS_CRITIC,
    ADVANTAGES,
    AGGREGATIONS,
    GROUP_FILTERS,
    POLICY_LOSSES,
    AdvantageInputs,
    AdvantageOutput,
    PolicyLossInputs,
)
from steprl.algorithms.losses import aggregate

PROMPT_LEN, OBS_LEN = 3, 2  # context tokens before the first step / between steps (mask 0)


class AlgorithmCheckError(AssertionError):
    """A registered estimator, loss or filter broke its contract; the message says which and how."""


@dataclass(frozen=True)
class AdvantageCheckReport:
    """What `check_advantage` proved (`ran`) and measured, returned when every check passed."""

    name: str
    needs_critic: bool
    ran: tuple[str, ...]
    zero_on_flat_groups: bool  # measured, not required: see the module docstring


@dataclass(frozen=True)
class Rollout:
    """One synthetic trajectory: its task group, environment and reward per step (the last
    step's reward is the outcome, as envs report it)."""

    group: int
    env: int
    step_rewards: tuple[float, ...]


def _fail(what: str, name: str, detail: str) -> NoReturn:
    raise AlgorithmCheckError(f"{name}: {what}: {detail}")


def _action_len(rollout: Rollout, step: int) -> int:
    # depends on the group and step only, so rollouts of one group can share their shape
    return 2 + (rollout.group + step) % 3


def synthetic_inputs(
    rollouts: list[Rollout], *, step_rows: bool = False, values: str = ""
) -> AdvantageInputs:
    """`AdvantageInputs` laid out as `training/loop/step_batch.py: advantage_inputs` builds them from
    trajectories, without a model.

    Rows are whole trajectories (prompt, then each step's action tokens, an observation between
    steps) or, with `step_rows`, one row per step (its context, then its action). `values`:
    "" (no critic), "const" (every state 0.5), "random" (seeded, on the action tokens; each
    token gets the same value in both layouts), or "random+garbage" (the same, plus large
    values off the mask).
    """
    step_traj: list[int] = []
    step_index: list[int] = []
    step_rewards: list[float] = []
    anchors: list[tuple[str, int, int]] = []
    rows: list[list[tuple[int, float]]] = []  # per row: (global step id or -1, reward on the token)
    row_traj: list[int] = []
    for n, r in enumerate(rollouts):
        row: list[tuple[int, float]] = [(-1, 0.0)] * PROMPT_LEN
        for k, reward in enumerate(r.step_rewards):
            sid = len(step_traj)
            step_traj.append(n)
            step_index.append(k)
            step_rewards.append(reward)
            anchors.append(("state", r.group, k))  # same group and depth: the same state (GiGPO)
            if step_rows and k > 0:
                rows.append(row)
                row_traj.append(n)
                row = [(-1, 0.0)] * (PROMPT_LEN + OBS_LEN)
            elif k > 0:
                row = row + [(-1, 0.0)] * OBS_LEN
            length = _action_len(r, k)
            row = row + [(sid, 0.0)] * (length - 1) + [(sid, reward)]
        rows.append(row)
        row_traj.append(n)
    width = max(len(row) for row in rows) + 1  # at least one padding column
    token_step = torch.full((len(rows), width), -1, dtype=torch.long)
    token_rewards = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        token_step[i, : len(row)] = torch.tensor([s for s, _ in row])
        token_rewards[i, : len(row)] = torch.tensor([w for _, w in row])
    mask = (token_step >= 0).float()
    critic: Tensor | None = None
    if values == "const":
        critic = 0.5 * mask
    elif values.startswith("random"):
        # drawn in the order of the action tokens, which is the same in both layouts (rows go
        # trajectory by trajectory, step by step), so a token's value does not depend on its row
        critic = torch.zeros(mask.shape)
        critic[mask != 0] = torch.rand(int(mask.sum()), generator=torch.Generator().manual_seed(7))
        if values.endswith("+garbage"):
            critic = critic + 1e3 * (1 - mask)
    return AdvantageInputs(
        rewards=torch.tensor([r.step_rewards[-1] for r in rollouts]),
        group_index=torch.tensor([r.group for r in rollouts]),
        env_index=torch.tensor([r.env for r in rollouts]),
        step_traj=torch.tensor(step_traj),
        step_index=torch.tensor(step_index),
        step_rewards=torch.tensor(step_rewards),
        anchor_keys=tuple(anchors),
        mask=mask,
        token_step=token_step,
        row_traj=torch.tensor(row_traj),
        token_rewards=token_rewards,
        values=critic,
    )


def varied_rollouts() -> list[Rollout]:
    """Group 0 flat (four identical rollouts), groups 1 and 2 with spread, in two environments;
    rollouts 4 and 5 share their shape and differ in outcome only (1.0 vs 0.0)."""
    return [
        *[Rollout(0, 0, (-0.1, 1.0))] * 4,
        Rollout(1, 0, (0.0, -0.1, 1.0)),
        Rollout(1, 0, (0.0, -0.1, 0.0)),
        Rollout(1, 0, (0.0, 0.5)),
        Rollout(1, 0, (0.2,)),
        Rollout(2, 1, (0.0,)),
        Rollout(2, 1, (1.0,)),
        Rollout(2, 1, (0.0, 0.0)),
        Rollout(2, 1, (0.3, 0.7, 0.0)),
    ]


def flat_rollouts() -> list[Rollout]:
    """Every rollout of every group the same: one to three steps, the reward on the last."""
    return [Rollout(g, g % 2, (0.0,) * (g % 3) + (0.5,)) for g in range(3) for _ in range(4)]


def _snapshot(x: Any) -> list[Tensor]:
    return [getattr(x, f.name).clone() for f in fields(x) if isinstance(getattr(x, f.name), Tensor)]


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _call_advantage(
    name: str, fn: Callable[..., Any], x: AdvantageInputs, params: Mapping[str, Any]
) -> AdvantageOutput:
    before = _snapshot(x)
    out = fn(x, **params)
    if not isinstance(out, AdvantageOutput):
        _fail("shapes", name, f"returned {type(out).__name__}, not an AdvantageOutput(advantages, returns)")
    for field, t in (("advantages", out.advantages), ("returns", out.returns)):
        if not isinstance(t, Tensor) or tuple(t.shape) != tuple(x.mask.shape) or not t.is_floating_point():
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            _fail(
                "shapes",
                name,
                f"{field} is {shape}, not a float tensor of the mask's shape {tuple(x.mask.shape)}",
            )
        if not bool(torch.isfinite(t).all()):
            _fail("finite", name, f"{field} has NaN or inf: guard divisions by a std or a count")
        if bool((t[x.mask == 0] != 0).any()):
            _fail(
                "masked",
                name,
                f"{field} is not 0 off the mask: multiply by inputs.mask (observations are never trained on)",
            )
    if not _same(before, _snapshot(x)):
        _fail("pure", name, "modified its inputs in place; clone before writing")
    again = fn(x, **params)
    if not (torch.equal(again.advantages, out.advantages) and torch.equal(again.returns, out.returns)):
        _fail("pure", name, "two calls on the same inputs gave different outputs")
    return out


def _mean_on(out: AdvantageOutput, x: AdvantageInputs, traj: int) -> float:
    rows = x.row_traj == traj
    return float(out.advantages[rows].sum() / x.mask[rows].sum())


def _on_trajectories(x: AdvantageInputs, out: AdvantageOutput) -> Tensor:
    """(2, N, width): advantages and returns at each trajectory's action tokens, in order."""
    tokens = x.trajectory_tokens
    return torch.stack([tokens.to_table(out.advantages), tokens.to_table(out.returns)])


def check_advantage(name: str, params: Mapping[str, Any] | None = None) -> AdvantageCheckReport:
    """Raise `AlgorithmCheckError` unless `ADVANTAGES[name]` (called with `params`, default none)
    keeps the contract in the module docstring; return what ran and what was measured."""
    if name not in ADVANTAGES:
        raise KeyError(
            f"no advantage estimator {name!r}; registered: {sorted(ADVANTAGES)} (add yours to ADVANTAGES)"
        )
    fn, kw = ADVANTAGES[name], dict(params or {})
    needs_critic = bool(ADVANTAGE_NEEDS_CRITIC.get(name))
    critic = "random" if needs_critic else ""
    ran = ["shapes", "finite", "masked", "pure"]
    on_layouts = []
    for step_rows in (False, True):
        x = synthetic_inputs(varied_rollouts(), step_rows=step_rows, values=critic)
        on_layouts.append(_on_trajectories(x, _call_advantage(name, fn, x, kw)))
    packed, per_step = on_layouts
    if not torch.allclose(packed, per_step, rtol=1e-4, atol=1e-5):
        worst = float((packed - per_step).abs().max())
        _fail(
            "layouts",
            name,
            f"one row per trajectory and one row per step of the same rollouts differ by up to {worst:.3g}"
            " at the action tokens: run recursions over inputs.trajectory_tokens, not per row",
        )
    ran.append("layouts")
    for step_rows in (False, True):
        x = synthetic_inputs(varied_rollouts(), step_rows=step_rows, values="const" if needs_critic else "")
        out = _call_advantage(name, fn, x, kw)
        hi, lo = _mean_on(out, x, 4), _mean_on(out, x, 5)
        if not hi > lo:
            layout = "step rows" if step_rows else "trajectory rows"
            _fail(
                "ordered",
                name,
                f"outcome 1.0 got mean advantage {hi:.4g}, outcome 0.0 got {lo:.4g} ({layout})",
            )
    ran.append("ordered")
    x = synthetic_inputs(varied_rollouts(), values=critic)
    flat_group = x.group_index[x.row_traj] == 0
    zero_on_flat_groups = bool((fn(x, **kw).advantages[flat_group] == 0).all())
    if needs_critic:
        try:
            fn(replace(x, values=None), **kw)
        except Exception as e:  # noqa: BLE001 - any other exception is the failure reported
            if not isinstance(e, ValueError) or "algorithm.critic" not in str(e):
                _fail(
                    "critic",
                    name,
                    f"without critic values it raised {e!r}, which does not name algorithm.critic",
                )
        else:
            _fail("critic", name, "ran without critic values: raise a ValueError naming algorithm.critic")
        base = fn(x, **kw).advantages
        if torch.equal(fn(synthetic_inputs(varied_rollouts(), values="const"), **kw).advantages, base):
            _fail("critic", name, "different critic values gave the same advantages: is inputs.values read?")
        if not torch.equal(
            fn(synthetic_inputs(varied_rollouts(), values="random+garbage"), **kw).advantages, base
        ):
            _fail(
                "critic",
                name,
                "values off the mask changed the advantages: read values on action tokens only",
            )
        ran.append("critic")
    else:
        for step_rows in (False, True):
            flat = _call_advantage(name, fn, synthetic_inputs(flat_rollouts(), step_rows=step_rows), kw)
            if bool((flat.advantages != 0).any()):
                worst = float(flat.advantages.abs().max())
                layout = "step rows" if step_rows else "trajectory rows"
                _fail(
                    "no_signal",
                    name,
                    f"every rollout got the same rewards, yet |advantage| reaches {worst:.3g} ({layout})",
                )
        ran.append("no_signal")
    return AdvantageCheckReport(name, needs_critic, tuple(ran), zero_on_flat_groups)


# ---- policy losses ---------------------------------------------------------------------------


def _loss_batch(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(mask, advantages, logp) for 3 rows x 7 positions: holes, padding, both signs and zeros."""
    mask = torch.tensor(
        [[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.float32
    )
    adv = torch.tensor(
        [[0, 1.5, 1.5, 0, -0.5, -0.5, 0], [0, 0, -1, -1, 2, 0, 0], [0, 0.7, 0, 0.7, 0.7, -2, -2]]
    )
    logp = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * 3
    return mask, adv * mask, logp


def _loss_and_grad(
    fn: Callable[..., Any], kw: Mapping[str, Any], x: PolicyLossInputs, mask: Tensor
) -> tuple[Any, Tensor]:
    """The loss output and the gradient of its token-mean aggregate with respect to `x.logp`."""
    leaf = x.logp.detach().clone().requires_grad_(True)
    out = fn(replace(x, logp=leaf), **kw)
    aggregate(out.loss_per_token, mask).backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return out, grad


def check_policy_loss(name: str, params: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Raise `AlgorithmCheckError` unless `POLICY_LOSSES[name]` keeps the contract in the module
    docstring; return the properties that ran."""
    if name not in POLICY_LOSSES:
        raise KeyError(
            f"no policy loss {name!r}; registered: {sorted(POLICY_LOSSES)} (add yours to POLICY_LOSSES)"
        )
    fn, kw = POLICY_LOSSES[name].fn, dict(params or {})
    mask, adv, logp = _loss_batch()
    off = mask == 0
    # off-policy on the mask (the behaviour and proximal policies differ a little), extreme off it
    behav = torch.where(
        off, torch.full_like(logp, -1e4), logp + 0.3 * torch.sin(torch.arange(logp.numel())).view_as(logp)
    )
    prox = torch.where(off, torch.full_like(logp, 50.0), logp + 0.1)
    out, grad = _loss_and_grad(fn, kw, PolicyLossInputs(logp, behav, prox, adv), mask)
    per_token = out.loss_per_token
    if tuple(per_token.shape) != tuple(mask.shape):
        _fail(
            "shapes", name, f"loss_per_token is {tuple(per_token.shape)}, not the mask's {tuple(mask.shape)}"
        )
    if not bool(torch.isfinite(per_token[~off]).all()):
        _fail("finite", name, "the per-token loss has NaN or inf on the mask: clamp the log-ratio before exp")
    for mode in AGGREGATIONS:
        total = aggregate(per_token, mask, mode, scale_factor=float(mask.shape[1]))
        if not bool(torch.isfinite(total)):
            _fail("finite", name, f"the {mode} aggregate is {float(total)}")
    if not bool(torch.isfinite(grad).all()) or bool((grad[off] != 0).any()):
        _fail(
            "masked_grad",
            name,
            "the gradient is not exactly 0 (or not finite) off the mask: keep masked tokens out",
        )

    out, grad = _loss_and_grad(fn, kw, PolicyLossInputs(logp, behav, prox, torch.zeros_like(adv)), mask)
    if bool((out.loss_per_token[~off] != 0).any()) or bool((grad != 0).any()):
        _fail("no_signal", name, "zero advantages gave a non-zero loss or gradient")

    out, grad = _loss_and_grad(fn, kw, PolicyLossInputs(logp, logp.clone(), logp.clone(), adv), mask)
    if not torch.equal(torch.sign(-grad), torch.sign(adv)):
        signs = f"-grad has signs {torch.sign(-grad).tolist()}, advantages {torch.sign(adv).tolist()}"
        _fail("on_policy", name, f"on-policy, {signs}")
    return ("shapes", "finite", "masked_grad", "no_signal", "on_policy")


# ---- group filters ---------------------------------------------------------------------------


def check_group_filter(name: str, params: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Raise `AlgorithmCheckError` unless `GROUP_FILTERS[name]` keeps the contract in the module
    docstring; return the properties that ran."""
    if name not in GROUP_FILTERS:
        raise KeyError(
            f"no group filter {name!r}; registered: {sorted(GROUP_FILTERS)} (add yours to GROUP_FILTERS)"
        )
    fn, kw = GROUP_FILTERS[name], dict(params or {})
    groups = [
        torch.tensor([1.0, 0.0, 0.0, 1.0]),
        torch.tensor([0.5, 0.5, 0.5, 0.5]),
        torch.tensor([0.3]),
        torch.tensor([0.0, 0.2, 1.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0]),
        torch.tensor([0.9, 0.1]),
    ]
    before = [g.clone() for g in groups]
    keep = fn(groups, **kw)
    if not isinstance(keep, Tensor) or keep.dtype != torch.long or keep.dim() != 1:
        _fail("indices", name, f"returned {keep!r}: return a 1-D int64 tensor of kept group indices")
    kept = keep.tolist()
    if kept != sorted(set(kept)) or any(not 0 <= i < len(groups) for i in kept):
        _fail("indices", name, f"kept {kept}: indices must be distinct, increasing and below {len(groups)}")
    if not _same(before, groups) or not torch.equal(fn(groups, **kw), keep):
        _fail("pure", name, "modified its inputs or gave a different answer the second time")
    empty = fn([], **kw)
    if not isinstance(empty, Tensor) or empty.dtype != torch.long or empty.numel() != 0:
        _fail("empty", name, f"no groups gave {empty!r}, not an empty int64 tensor")
    return ("indices", "pure", "empty")


__all__ = [
    "AdvantageCheckReport",
    "AlgorithmCheckError",
    "Rollout",
    "check_advantage",
    "check_group_filter",
    "check_policy_loss",
    "flat_rollouts",
    "synthetic_inputs",
    "varied_rollouts",
]
