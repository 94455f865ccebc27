"""What the core requires of an env's answers, checked in one place.

`check-env` (`envs/check.py`) and the agent loop (`rollout/loop.py`: training, evaluation and
the SFT warm start's demonstrations) call the same `transition_problem`, so what the checker
rejects never trains: in the loop an invalid `Transition` ends its trajectory `infra_failed`
(the env broke its contract: not the policy's fault), counted by reason.

The contract of a `Transition`:

* ``observation``: a str of valid Unicode, as the env's ``system_prompt`` and a task's prompt
  (no lone surrogate U+D800-U+DFFF: no tokenizer, Parquet file or terminal can encode one);
* ``reward``: a real, finite number (int, float or a NumPy scalar; never a str, a bool or NaN);
* ``terminated`` and ``truncated``: bools (NumPy bools too);
* ``info``: a mapping. Every key is optional:
  - ``reward_components``: name -> finite number, summing to ``reward``. Absent, the whole
    reward is the outcome: ``{"outcome": reward}`` (`reward_components`).
  - ``action_kind``: "tool_call", "answer" or "invalid". Absent, the action counts as none of
    them in the metrics, and the env's next observation is shown as a tool result.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import InfraError, Observation, Transition

#: the reasons an env's answer is invalid (`Problem.reason`; metrics `infra/invalid/<reason>`)
REASONS = (
    "not_an_observation",
    "not_a_transition",
    "observation_type",
    "reward_type",
    "reward_not_finite",
    "done_type",
    "info_type",
    "reward_components",
    "components_sum",
    "text_not_unicode",
)

# what `bytes.decode(errors="surrogateescape")` leaves of an undecodable byte, or a JSON "\ud800"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Problem:
    """Why an env's answer breaks the contract: a `reason` (one of `REASONS`, counted) and a
    message that says what to fix."""

    reason: str
    message: str


class ContractError(InfraError):
    """An env answered with something the contract forbids; the loop ends the trajectory
    `infra_failed` and records `reason` in its info (`info["invalid"]`)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.reason = problem.reason


def is_number(value: object) -> bool:
    """A real number: int, float or a NumPy scalar, but not a bool (a bool reward is a bug)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    return is_number(value) and math.isfinite(float(value))  # type: ignore[arg-type]


def _is_bool(value: object) -> bool:
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")  # numpy.bool_


def reward_components(t: Transition) -> Mapping[str, float]:
    """The reward's components: `info["reward_components"]`, or ``{"outcome": reward}`` when the
    env reports none. Call on a valid transition (`transition_problem(t) is None`)."""
    components = t.info.get("reward_components")
    if components is None:
        return {"outcome": float(t.reward)}
    return {str(k): float(v) for k, v in components.items()}


def text_problem(field: str, text: str) -> Problem | None:
    """None when `text` (what `field` names, for the message) is valid Unicode; else where its
    first lone surrogate is, shown escaped (the message itself must print)."""
    found = None if text.isascii() else _LONE_SURROGATE.search(text)
    if found is None:
        return None
    return Problem(
        "text_not_unicode",
        f"{field} has a lone surrogate {found.group()!r} at index {found.start()}; env text must be "
        "valid Unicode (decode bytes with errors='replace', not 'surrogateescape').",
    )


def observation_problem(first: object) -> Problem | None:
    """None when `reset` returned a valid `Observation`."""
    if not isinstance(first, Observation) or not isinstance(first.text, str):
        return Problem(
            "not_an_observation",
            f"reset() returned {type(first).__name__}; return steprl.envs.base.Observation(text).",
        )
    return text_problem("reset()'s observation", first.text)


def transition_problem(t: object) -> Problem | None:
    """None when `step` returned a `Transition` the core can train on; else the first problem."""
    if not isinstance(t, Transition):
        return Problem(
            "not_a_transition",
            f"step() returned {type(t).__name__}; return steprl.envs.base.Transition(...).",
        )
    if not isinstance(t.observation, str):
        return Problem(
            "observation_type", f"Transition.observation is {type(t.observation).__name__}; it must be str."
        )
    if (problem := text_problem("step()'s observation", t.observation)) is not None:
        return problem
    if not is_number(t.reward):
        return Problem(
            "reward_type",
            f"reward={t.reward!r} ({type(t.reward).__name__}); it must be a finite float "
            "(convert it: reward=float(...)).",
        )
    if not math.isfinite(float(t.reward)):
        return Problem("reward_not_finite", f"reward={t.reward!r}; it must be a finite float.")
    if not _is_bool(t.terminated) or not _is_bool(t.truncated):
        return Problem(
            "done_type", f"terminated={t.terminated!r}, truncated={t.truncated!r}; both must be bool."
        )
    if not isinstance(t.info, Mapping):
        return Problem("info_type", f"Transition.info is {type(t.info).__name__}; give a dict.")
    return _components_problem(t.info.get("reward_components"), t.reward)


def _components_problem(components: Any, reward: float) -> Problem | None:
    if components is None:
        return None  # optional: the whole reward is the outcome
    if not isinstance(components, Mapping) or not all(is_finite_number(v) for v in components.values()):
        return Problem(
            "reward_components",
            f"info['reward_components']={components!r}; give a dict of finite floats, e.g. "
            "steprl.envs.rewards.RewardBreakdown(...).as_dict(), or leave it out (then the "
            "whole reward is the outcome).",
        )
    total = sum(float(v) for v in components.values())
    if not math.isclose(total, float(reward), rel_tol=1e-9, abs_tol=1e-9):
        return Problem(
            "components_sum",
            f"reward {reward} != sum of reward_components {dict(components)}; set "
            "reward=breakdown.total from the same RewardBreakdown.",
        )
    return None
