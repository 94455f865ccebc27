"""The rules that ship on (`health.rules` unset), as the config would write them, and the pure
test of a rule's conditions.

Why these defaults (measured in docs/health.md; `benchmarks/health.py`):
- `policy_jump`: one step moved the policy more than 1 nat (`approx_kl`; healthy tiny runs stay
  under 0.05, the Gemma run's step 1 was 10.78, lr x20's 83). Undo it (rollback 1) and quarter
  the learning rate (a jump grows about as lr squared), at every step it happens (no cooldown:
  a jump left in place is the collapse); a fourth time and the run stops.
- `grad_blowup`: a gradient norm 6 stds above its recent steps while the policy moved (a
  learning rate too high). Undo 2 steps and halve the learning rate.
- `entropy_collapse`: entropy 3 steps in a row below its own band (not an eruption above it):
  the echo trap's sign. An entropy bonus, then an alert.
- `no_signal`: most groups all-equal (no GRPO gradient) for 3 steps: drop the flat groups so
  the batch is what can teach, and say so.
- `amplified_noise`: most groups' rewards differ only by a hair (std < 0.05, e.g. a 0.01 cost
  per call in a group that otherwise all succeed): GRPO divides by that std and trains on the
  hair as if it were the task. Drop such groups from then on (the `filter` action).
- `tool_abandonment`: the tool-call rate lost a third of its peak (healthy runs: < 0.05): the
  silent failure of a user's own env. An alert naming it: no action we tried changed held-out
  success (guess_number, seeds 0-2, 40 steps: alert -0.062 +- 0.102, an entropy bonus -0.062 +-
  0.083, rollback 2 + lr x0.5 -0.036 +- 0.065; the rollback kept more tool calls, 0.12-0.16
  against 0.00-0.09, but not more successes: `benchmarks/tool_abandonment.py`). What changes
  the outcome is the warm start, named before RL starts (`training/setup/warm_start_check.py`).
- `off_task_reward`: over 8 steps the reward paid for something other than the outcome, its
  penalties and costs grows (`proxy_gap` > 0.02 per step) while the task's own component does
  not rise (`outcome_slope` < 0.005), 2 steps in a row: the policy is being paid for something
  other than the task (a phrase, a bonus). A fading format penalty is not counted (that is
  learning). An alert: the early warning (13, 6, 4 steps before held-out success fell on the
  fixed-phrase recipe's seeds 0, 1, 2; controls 0).
- `reward_hacking`: the same while the task's own component falls (`outcome_slope` < -0.01):
  the shortcut now costs the task. Stop, keeping the last good checkpoint: undoing steps cannot
  help while the reward still pays the shortcut.
- `template_collapse`: the probe's retrieval accuracy within 0.05 of chance: outputs no longer
  depend on the input (RAGEN-2). Stop, keeping the last good checkpoint. Needs health.mi_every.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_RULES: list[dict[str, Any]] = [
    {
        "name": "policy_jump",
        "when": [{"signal": "approx_kl", "above": 1.0}],
        "actions": ["alert", {"rollback": {"k": 1}}, {"lr_scale": {"factor": 0.25}}],
        "cooldown": 0,
        "budget": 3,
    },
    {
        "name": "grad_blowup",
        "when": [{"signal": "grad_norm_z", "above": 6.0}, {"signal": "approx_kl", "above": 0.1}],
        "actions": ["alert", {"rollback": {"k": 2}}, {"lr_scale": {"factor": 0.5}}],
        "cooldown": 3,
        "budget": 3,
    },
    {
        "name": "entropy_collapse",
        "when": [{"signal": "entropy_drop", "above": 2.5}],
        "actions": ["alert", {"entropy_bonus": {"coef": 0.01}}],
        "cooldown": 5,
        "budget": 2,
        "then": "alert",
    },
    {
        "name": "no_signal",
        "when": [{"signal": "zero_var_share", "above": 0.8}],
        "steps": 3,
        "actions": ["alert", {"filter": {"min_group_std": 0.05}}],
        "cooldown": 10,
        "budget": 1,
        "then": "alert",
    },
    {
        "name": "amplified_noise",
        "when": [{"signal": "tiny_std_share", "above": 0.5}],
        "actions": ["alert", {"filter": {"min_group_std": 0.05}}],
        "cooldown": 10,
        "budget": 1,
        "then": "alert",
    },
    {
        "name": "tool_abandonment",
        "when": [{"signal": "tool_call_fall", "above": 0.3}],
        "actions": ["alert"],
        "cooldown": 10,
        "budget": 3,
        "then": "alert",
    },
    {
        "name": "off_task_reward",
        "when": [{"signal": "outcome_slope", "below": 0.005}, {"signal": "proxy_gap", "above": 0.02}],
        "steps": 2,
        "actions": ["alert"],
        "cooldown": 10,
        "budget": 3,
        "then": "alert",
    },
    {
        "name": "reward_hacking",
        "when": [{"signal": "outcome_slope", "below": -0.01}, {"signal": "proxy_gap", "above": 0.02}],
        "steps": 2,
        "actions": ["alert", "stop"],
        "cooldown": 0,
        "budget": 1,
    },
    {
        "name": "template_collapse",
        "when": [{"signal": "mi_retrieval_gap", "below": 0.05}],
        "steps": 2,
        "actions": ["alert", "stop"],
        "cooldown": 0,
        "budget": 1,
    },
]


def holds(conditions: Sequence[Mapping[str, Any]], values: Mapping[str, float | None]) -> bool:
    """Every condition holds: its signal has a value, above its `above` / below its `below`."""
    for c in conditions:
        v = values.get(c["signal"])
        if v is None:
            return False
        if c.get("above") is not None and not v > c["above"]:
            return False
        if c.get("below") is not None and not v < c["below"]:
            return False
    return True


__all__ = ["DEFAULT_RULES", "holds"]
