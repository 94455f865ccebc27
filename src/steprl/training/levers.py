"""Levers: what the controllers' adjustments (`Adjustments`) change in the run, each applied in
one place, in the order of `LEVERS`; the trainer calls the phases and knows no lever by name.

* `start`: once, before the first step of this process (the snapshot ring's first entry).
* `before`: before each step, from the standing settings (the learner's learning rate and
  loss coefficients, the reward-KL scale, the turn cap and group filter of the next tasks).
* `measure`: after the update, before the controllers observe the step (metrics they read:
  the mutual-information probe).
* `observed`: once the controllers have observed the step, before its outputs are written
  (what a firing does once: a rollback, every firing's ALERT line and health.jsonl record).
* `written`: after the step's outputs are written, unless the run stops there (the snapshot
  ring, a snapshot checkpoint: never of a step whose metrics row is not written yet).

A lever of your own is a function here plus one entry; `check_levers` (run in the tests)
checks every entry's phase and that the trainer's phases reach it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from steprl.config import Config
from steprl.training import health_run, resume
from steprl.training.build import Parts
from steprl.training.controllers import Adjustments
from steprl.training.health_snapshots import SnapshotRing
from steprl.training.pipeline import Pipeline
from steprl.training.state import TrainState
from steprl.types import Trajectory

Phase = Literal["start", "before", "measure", "observed", "written"]


class LeverRun(Protocol):
    """What a lever may read and change: the trainer's loop state."""

    cfg: Config
    parts: Parts
    pipeline: Pipeline
    run_dir: Path
    state: TrainState
    settings: Adjustments
    saved_step: int
    group_filter: Any  # the next step's: the configured one, or narrowed (a Callable[..., Tensor])

    @property
    def log(self) -> Callable[[str], None]: ...


@dataclass(frozen=True)
class Lever:
    phase: Phase
    #: (the run, the step about to run or just run, that step's rollouts) -> metrics (measure)
    apply: Callable[[LeverRun, int, Sequence[Trajectory]], dict[str, float] | None]
    about: str


def _learner(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    run.settings = health_run.apply_levers(run.cfg, run.parts.learner, run.settings)


def _admission(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    run.pipeline.max_turns = run.settings.max_turns  # the cap of the tasks admitted from now on
    run.group_filter = health_run.group_filter(run.parts.group_filter, run.settings)


def _mi_probe(run: LeverRun, step: int, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    return health_run.probe(run.cfg, run.parts.learner, step, list(trajectories))


def _ring(run: LeverRun) -> SnapshotRing | None:
    ring = run.parts.components.get("health:snapshots")
    return ring if isinstance(ring, SnapshotRing) else None


def _ring_start(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    ring = _ring(run)
    if ring is not None and not ring.steps:
        ring.capture(step)


def _rollback_and_alerts(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    version, firings = health_run.carry_out(
        run.parts, run.settings, step, run.state.policy_version, run.pipeline, run.log
    )
    run.state = dataclasses.replace(run.state, policy_version=version)  # a rollback publishes anew
    health_run.write_log(run.run_dir, firings)


def _ring_capture(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    ring, once = _ring(run), run.settings.once
    if ring is not None:  # after a rollback: the restored weights, no tasks
        ring.capture(step, () if once is not None and once.rollback else run.pipeline.step_tasks)


def _snapshot(run: LeverRun, step: int, _: Sequence[Trajectory]) -> None:
    once = run.settings.once
    if once is not None and once.snapshot:  # a health rule's snapshot
        run.log(f"health snapshot: {resume.save(run.parts, run.state, run.run_dir, run.cfg)}")
        run.saved_step = step


LEVERS: dict[str, Lever] = {
    "snapshot_ring_start": Lever("start", _ring_start, "the ring of recent weights starts with the start's"),
    "learner": Lever(
        "before", _learner, "learning rate, entropy bonus, KL in the loss; the reward KL's scale"
    ),
    "admission": Lever("before", _admission, "turn cap and group filter of the tasks taken next"),
    "mi_probe": Lever("measure", _mi_probe, "RAGEN-2's mutual-information probe every health.mi_every steps"),
    "rollback": Lever(
        "observed", _rollback_and_alerts, "rollback (published as a new version), ALERT lines, health.jsonl"
    ),
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
    """Each entry has a phase the trainer calls and a description; the phases keep their order
    constraints (the rollback before the ring's capture, which must see the restored weights)."""
    phases: tuple[Any, ...] = ("start", "before", "measure", "observed", "written")
    for name, lever in levers.items():
        assert lever.phase in phases, f"lever {name}: phase {lever.phase!r} is none of {phases}"
        assert callable(lever.apply) and lever.about, f"lever {name}: an apply function and a description"
    order = list(levers)
    assert order.index("rollback") < order.index("snapshot_ring"), "the ring captures after a rollback"


__all__ = ["LEVERS", "Lever", "LeverRun", "apply", "check_levers"]
