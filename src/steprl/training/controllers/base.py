"""What every controller shares: the step it reads (`StepReport`), what it returns
(`Adjustments`), and the protocol itself. A controller is a `Stateful` run component: its state
is checkpointed under its name and restored on resume."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from steprl.health.actions import Levers, Once
from steprl.training.components import Stateful
from steprl.types import Trajectory


@dataclass(frozen=True)
class StepReport:
    """One finished step, as the controllers see it."""

    step: int
    metrics: Mapping[str, float]  # the step's metrics row (evaluation included, when it ran)
    trajectories: Sequence[Trajectory] = field(default=())  # every rollout of the step
    hold_curriculum: bool = False  # a health rule holds the horizon curriculum this step


@dataclass(frozen=True)
class Adjustments:
    """What the next step does differently; None leaves the config's value. The trainer merges
    every controller's record (the first value set wins; `metrics` and `events` are gathered
    from all) and passes it to `make_batch`."""

    kl_coef: float | None = None  # the reward-KL coefficient (algorithm.kl_coef otherwise)
    max_turns: int | None = None  # the turn cap of the tasks admitted next (rollout.max_turns otherwise)
    stop: str | None = None  # stop the run (non-zero) with this reason, one line
    levers: Levers | None = None  # the health rules' standing changes (lr, KL, entropy, filter)
    once: Once | None = None  # what a health rule does at this step only (snapshot, rollback)
    metrics: Mapping[str, float] = field(default_factory=dict)  # added to the step's metrics row
    events: tuple[Mapping[str, Any], ...] = ()  # health firings, one health.jsonl record each


class Controller(Stateful, Protocol):
    """Reads each finished step and says what the next one changes."""

    #: the metrics it reads: the checker feeds exactly these
    reads: tuple[str, ...]

    def current(self) -> Adjustments:
        """What it sets for the next step, from its state alone (the start, or a resume)."""
        ...

    def observe(self, report: StepReport) -> Adjustments:
        """Take one finished step into its state; what the next step changes, or a stop."""
        ...


__all__ = ["Adjustments", "Controller", "StepReport"]
