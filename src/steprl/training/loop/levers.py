"""Levers: what the controllers return (`Adjustments`, whose every field but `metrics` and
`events` is a lever named here) and the run's own hooks, each applied in one place, in the order
of `LEVERS`. The trainer calls the phases and knows no lever by name; a controller that returns a
lever has it applied, with nothing else to edit.

* `start`: once, before the first step of this process (the snapshot ring's first entry).
* `before`: before each step, from the standing settings (the learner's learning rate and
  loss coefficients, the reward-KL scale, the turn cap and group filter of the next tasks).
* `measure`: after the update, before the controllers observe the step (metrics they read:
  the mutual-information probe).
* `observe`: while the controllers observe the step (`Controllers.observe`: those after a
  health rule see its curriculum hold).
* `observed`: once the controllers have observed the step, before its outputs are written
  (what a firing does once: a rollback, every firing's ALERT line and health.jsonl record).
* `written`: after the step's outputs are written, unless the run stops there (the snapshot
  ring, a snapshot checkpoint: never of a step whose metrics row is not written yet).

A lever of your own is a field of `Adjustments`, a function here and one entry; `check_levers`
(run in the tests) checks that every field has its entry, every entry a phase the trainer calls,
and the order the phases need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Protocol

from steprl.config import Config
from steprl.training.controllers import Adjustments
from steprl.training.learn.health_snapshots import SnapshotRing
from steprl.training.learn.learner_protocol import LearnerLevers
from steprl.training.loop import health_run, resume
from steprl.training.loop.pipeline import Pipeline
from steprl.training.setup.build import Parts
from steprl.training.state import TrainState
from steprl.types import Trajectory

Phase = Literal["start", "before", "measure", "observe", "observed", "written"]
PHASES: tuple[Phase, ...] = ("start", "before", "measure", "observe", "observed", "written")


class LeverRun(Protocol):
    """What a lever may read and change: the trainer's loop state."""

    cfg: Config
    parts: Parts
    pipeline: Pipeline
    run_dir: Path
    state: TrainState
    settings: Adjustments  # the levers the controllers returned for the next step
    saved_step: int
    group_filter: Any  # the next step's: the configured one, or narrowed (a Callable[..., Tensor])
    reward_kl_coef: float  # the next step's KL coefficient in the reward
    rolled_back: str  # what a rollback at this step adds to its firings' outcome
    stopped: tuple[str, Path | None] | None  # a controller's stop: why, the checkpoint before it

    @property
    def log(self) -> Callable[[str], None]: ...


@dataclass(frozen=True)
class Lever:
    phase: Phase
    #: (the run, the step about to run or just run, that step's rollouts) -> metrics (measure)
    apply: Callable[[LeverRun, int, Sequence[Trajectory]], dict[str, float] | None]
    about: str


# ---- the controllers' levers: one per field of `Adjustments` --------------------------------


def _lr_scale(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    run.parts.learner.apply(LearnerLevers(lr=run.cfg.trainer.lr * (run.settings.lr_scale or 1.0)))


def _entropy_coef(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    coef = run.settings.entropy_coef
    run.parts.learner.apply(
        LearnerLevers(entropy_coef=run.cfg.algorithm.entropy_coef if coef is None else coef)
    )


def _kl_coef(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    coef = run.settings.kl_coef
    run.reward_kl_coef = run.cfg.algorithm.kl_coef if coef is None else coef


def _kl_scale(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    algo, scale = run.cfg.algorithm, run.settings.kl_scale or 1.0
    run.parts.learner.apply(LearnerLevers(kl_coef=algo.kl_coef * scale if algo.kl_in == "loss" else 0.0))
    if algo.kl_in == "reward" and scale != 1.0:  # on the configured or the adaptive coefficient
        run.reward_kl_coef = run.reward_kl_coef * scale


def _max_turns(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    run.pipeline.max_turns = run.settings.max_turns  # the cap of the tasks admitted from now on


def _min_group_std(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    run.group_filter = health_run.group_filter(run.parts.group_filter, run.settings.min_group_std)


def _in_observe(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    """Acted in `Controllers.observe` (the controllers after the one that set it read it)."""


def _rollback(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    run.rolled_back = ""
    if run.settings.rollback is not None:
        version, run.rolled_back = health_run.roll_back(
            run.parts, run.settings.rollback, step, run.state.policy_version, run.pipeline
        )
        run.state = dataclasses.replace(run.state, policy_version=version)  # published anew


def _stop(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    if run.settings.stop is not None:  # as a signal: the step is written and saved, the last good kept
        run.stopped = (run.settings.stop, resume.latest_checkpoint(run.run_dir))


def _snapshot(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    if run.settings.snapshot:  # a health rule's snapshot
        run.log(f"health snapshot: {resume.save(run.parts, run.state, run.run_dir, run.cfg)}")
        run.saved_step = step


# ---- the run's own hooks --------------------------------------------------------------------


def _ring(run: LeverRun) -> SnapshotRing | None:
    ring = run.parts.components.get("health:snapshots")
    return ring if isinstance(ring, SnapshotRing) else None


def _ring_start(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    ring = _ring(run)
    if ring is not None and not ring.steps:
        ring.capture(step)


def _mi_probe(run: LeverRun, step: int, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    return health_run.probe(run.cfg, run.parts.learner, step, list(trajectories))


def _alerts(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    firings = health_run.alert(run.settings.events, step, run.rolled_back, run.log)
    health_run.write_log(run.run_dir, firings)


def _ring_capture(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    ring = _ring(run)
    if ring is not None:  # after a rollback: the restored weights, no tasks
        ring.capture(step, () if run.settings.rollback is not None else run.pipeline.step_tasks)


LEVERS: dict[str, Lever] = {
    "snapshot_ring_start": Lever("start", _ring_start, "the ring of recent weights starts with the start's"),
    "lr_scale": Lever("before", _lr_scale, "the learning rate: trainer.lr times it"),
    "entropy_coef": Lever("before", _entropy_coef, "the entropy bonus in the loss"),
    "kl_coef": Lever("before", _kl_coef, "the KL coefficient in the reward (the adaptive controller's)"),
    "kl_scale": Lever("before", _kl_scale, "times the KL coefficient, in the loss or in the reward"),
    "max_turns": Lever("before", _max_turns, "the turn cap of the tasks admitted next"),
    "min_group_std": Lever("before", _min_group_std, "the group filter: groups whose rewards barely differ"),
    "mi_probe": Lever("measure", _mi_probe, "RAGEN-2's mutual-information probe every health.mi_every steps"),
    "hold_until": Lever("observe", _in_observe, "the horizon curriculum holds through this step"),
    "rollback": Lever("observed", _rollback, "earlier weights restored, published as a new version"),
    "alerts": Lever("observed", _alerts, "every firing's ALERT line and health.jsonl record"),
    "stop": Lever("observed", _stop, "the run ends after this step, non-zero, with one line"),
    "snapshot_ring": Lever("written", _ring_capture, "the step's weights and tasks into the rollback ring"),
    "snapshot": Lever("written", _snapshot, "a health rule's snapshot: a checkpoint of the step"),
}


def apply(
    phase: Phase, run: LeverRun, step: int, trajectories: Sequence[Trajectory] = ()
) -> dict[str, float]:
    """Every lever of `phase`, in order; the metrics they measured."""
    out: dict[str, float] = {}
    for lever in LEVERS.values():
        if lever.phase == phase:
            out |= lever.apply(run, step, trajectories) or {}
    return out


def check_levers(levers: dict[str, Lever] = LEVERS) -> None:
    """Every field of `Adjustments` (but `metrics`, `events`) is an entry; each entry has a phase
    the trainer calls and a description; the order the phases need (the rollback before its
    alert lines and before the ring's capture, which must see the restored weights; the KL
    coefficient before its scale)."""
    named = {f.name for f in fields(Adjustments)} - {"metrics", "events"}
    missing = sorted(named - set(levers))
    assert not missing, f"Adjustments fields with no lever applying them: {missing}; add entries to LEVERS"
    for name, lever in levers.items():
        assert lever.phase in PHASES, f"lever {name}: phase {lever.phase!r} is none of {PHASES}"
        assert callable(lever.apply) and lever.about, f"lever {name}: an apply function and a description"
    order = list(levers)
    assert order.index("rollback") < order.index("snapshot_ring"), "the ring captures after a rollback"
    assert order.index("rollback") < order.index("alerts"), "the alerts name what a rollback restored"
    assert order.index("kl_coef") < order.index("kl_scale"), "the KL scale multiplies the coefficient set"


__all__ = ["LEVERS", "PHASES", "Lever", "LeverRun", "apply", "check_levers"]
