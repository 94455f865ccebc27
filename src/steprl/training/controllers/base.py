"""What every controller shares: the step it reads (`StepReport`), what it returns
(`Adjustments`), and the protocol itself. A controller is a `Stateful` run component: its state
is checkpointed under its name and restored on resume."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
class Rollback:
    """Restore the weights and optimizer of `steps` steps back; the task stream goes on (the
    tasks that led there are not trained again), or, with `replay`, they are served again first."""

    steps: int
    replay: bool = False


@dataclass(frozen=True)
class Adjustments:
    """What the next step does differently, as named levers: each field but `metrics` and
    `events` is one entry of `training/loop/levers.py: LEVERS`, applied there and nowhere else. None
    leaves the config's value. The trainer merges every controller's record (the first value set
    wins; `metrics` and `events` are gathered from all) and applies whatever came back."""

    # standing: applied before every step (a resume or a rollback sees the same values)
    lr_scale: float | None = None  # times trainer.lr
    entropy_coef: float | None = None  # replaces algorithm.entropy_coef
    kl_coef: float | None = None  # the reward-KL coefficient (algorithm.kl_coef otherwise)
    kl_scale: float | None = None  # times the KL coefficient, in the loss or in the reward
    max_turns: int | None = None  # the turn cap of the tasks admitted next (rollout.max_turns otherwise)
    min_group_std: float | None = None  # groups whose reward std is below it are not trained on
    hold_until: int | None = None  # the horizon curriculum does not advance through this step
    # once: at the step just observed
    rollback: Rollback | None = None
    snapshot: bool | None = None  # a checkpoint of the step
    stop: str | None = None  # stop the run (non-zero) with this reason, one line
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


__all__ = ["Adjustments", "Controller", "Rollback", "StepReport"]
