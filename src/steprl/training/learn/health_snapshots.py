"""The in-memory ring of recent weights a health rollback restores (`health.snapshots`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from steprl.config import Config
from steprl.training.learn.learner_protocol import Learner
from steprl.training.state import task_dict, task_from_dict
from steprl.types import Task


class SnapshotRing:
    """The trainable weights and the optimizer state at the end of each of the last `size`
    steps (step 0: the start), for a rollback. A run component (`health:snapshots`): the
    checkpoint holds it, so a rollback after a resume restores what it would have without one.
    Memory: `size` copies of the trainable weights and the optimizer state (LoRA: adapters)."""

    def __init__(self, learner: Learner, size: int) -> None:
        self.learner = learner
        self.size = size
        self.steps: list[int] = []
        self.snaps: list[dict[str, Any]] = []

    def capture(self, step: int, trained: Sequence[tuple[int, Task]] = ()) -> None:
        """The weights and optimizer at the end of `step`, and the tasks it took (with their
        stream positions: a rollback with replay serves them again)."""
        snap = {**self.learner.snapshot(), "trained": list(trained)}
        self.steps, self.snaps = [*self.steps, step][-self.size :], [*self.snaps, snap][-self.size :]

    def trained_after(self, step: int) -> list[tuple[int, Task]]:
        """The tasks the kept steps after `step` took, in stream order."""
        out = [
            t
            for s, snap in zip(self.steps, self.snaps, strict=True)
            if s > step
            for t in snap.get("trained", [])
        ]
        return sorted(out, key=lambda t: t[0])

    def restore(self, back: int, step: int) -> int | None:
        """Load the snapshot `back` steps before `step` (or the oldest kept, when fewer are):
        the step it was taken at; None when there is none."""
        if not self.steps:
            return None
        want = step - back
        i = max((i for i, s in enumerate(self.steps) if s <= want), default=0)
        snap = self.snaps[i]
        # the kept steps after it are undone: a later rollback must neither restore them nor
        # serve their tasks again
        self.steps, self.snaps = self.steps[: i + 1], self.snaps[: i + 1]
        self.learner.restore(snap)
        return self.steps[i]

    def state_dict(self) -> dict[str, Any]:
        snaps = [{**s, "trained": [(i, task_dict(t)) for i, t in s.get("trained", [])]} for s in self.snaps]
        return {"steps": list(self.steps), "snaps": snaps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = [int(s) for s in state["steps"]]
        self.snaps = [
            {**s, "trained": [(int(i), task_from_dict(t)) for i, t in s.get("trained", [])]}
            for s in state["snaps"]
        ]


def ring_for(cfg: Config, learner: Learner) -> SnapshotRing | None:
    h = cfg.health
    return SnapshotRing(learner, h.snapshots) if h.enabled and h.act and h.snapshots else None


__all__ = ["SnapshotRing", "ring_for"]
