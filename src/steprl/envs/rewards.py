"""Step rewards as named components (outcome, format, cost), each a pure function.

Components are logged separately so a run can tell *why* returns moved (a model that learns
the format but not the task shows `format` rising while `outcome` stays flat). The contract
checked by `check_env`: ``Transition.info["reward_components"]`` sums to ``Transition.reward``,
which holds by construction when both come from one `RewardBreakdown`.

Sign convention: every config value is *added* to the reward, so penalties and costs are
given as values <= 0 (``format_penalty=-0.1``), and a positive value is refused rather than
silently rewarding invalid actions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from steprl.envs.parsing import ActionKind

COMPONENTS = ("outcome", "format", "cost")


@dataclass(frozen=True)
class RewardConfig:
    """Shaping terms, each added to the step reward (so each must be <= 0).

    `format_penalty` defaults to -0.1 per invalid action: small next to the outcome's 1.0 (an
    episode with one slip that still answers right scores 0.9, far above a wrong answer), but
    non-zero so that in a GRPO group where every answer is wrong, well-formed rollouts still
    get a positive advantage over malformed ones. With ``max_invalid_actions=3`` an episode
    ends after the 4th invalid action, so the format term is bounded below by -0.4.
    `tool_call_cost` (per call, valid or not) and `turn_cost` (per step, answers included)
    default to 0: on the calculator, calls are needed, and a cost would teach guessing.
    """

    format_penalty: float = -0.1
    tool_call_cost: float = 0.0
    turn_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("format_penalty", "tool_call_cost", "turn_cost"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}.")
            if value > 0:
                raise ValueError(
                    f"RewardConfig.{name}={value} would reward what it should penalise; the value is "
                    f"added to the reward, so pass a value <= 0 (e.g. {name}={-value})."
                )


@dataclass(frozen=True)
class RewardBreakdown:
    """Named reward components of one step (read-only); `total` is the step reward."""

    components: Mapping[str, float]

    def __post_init__(self) -> None:
        values = {str(k): float(v) for k, v in self.components.items()}
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if bad:
            raise ValueError(f"reward components must be finite, got {bad}; check the verifier.")
        object.__setattr__(self, "components", MappingProxyType(values))

    @property
    def total(self) -> float:
        """The step reward: the plain sum of the components, in insertion order."""
        return float(sum(self.components.values()))

    def as_dict(self) -> dict[str, float]:
        """A plain dict for `Transition.info["reward_components"]` (JSON-serialisable)."""
        return dict(self.components)


def outcome_component(score: float) -> float:
    """Validate a verifier's score: a finite number in [0, 1] (a bug in the verifier otherwise)."""
    value = float(score)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"verifier returned {score!r}; a verifier must return a score in [0, 1] "
            "(1 = solved). Scale or clamp it in the verifier."
        )
    return value


def format_component(kind: ActionKind, config: RewardConfig) -> float:
    """`config.format_penalty` for an invalid action, 0 otherwise."""
    return config.format_penalty if kind == "invalid" else 0.0


def cost_component(kind: ActionKind, config: RewardConfig) -> float:
    """`turn_cost` for every step, plus `tool_call_cost` for a tool call."""
    return config.turn_cost + (config.tool_call_cost if kind == "tool_call" else 0.0)


def step_rewards(kind: ActionKind, config: RewardConfig, *, outcome: float = 0.0) -> RewardBreakdown:
    """All components of one step; `outcome` is the verifier's score (answers only)."""
    if kind != "answer" and outcome != 0.0:
        raise ValueError(f"only an answer earns an outcome reward, got outcome={outcome} for {kind!r}.")
    return RewardBreakdown(
        {
            "outcome": outcome_component(outcome),
            "format": format_component(kind, config),
            "cost": cost_component(kind, config),
        }
    )
