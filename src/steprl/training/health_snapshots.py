"""The in-memory ring of recent weights a health rollback restores (`health.snapshots`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from steprl.config import Config
from steprl.training.learner import Learner


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

    def capture(self, step: int) -> None:
        snap = {
            "params": [p.detach().clone() for p in self.learner.params],
            "optimizer": copy.deepcopy(self.learner.optimizer.state_dict()),
        }
        self.steps, self.snaps = [*self.steps, step][-self.size :], [*self.snaps, snap][-self.size :]

    def restore(self, back: int, step: int) -> int | None:
        """Load the snapshot `back` steps before `step` (or the oldest kept, when fewer are):
        the step it was taken at; None when there is none."""
        if not self.steps:
            return None
        want = step - back
        i = max((i for i, s in enumerate(self.steps) if s <= want), default=0)
        snap = self.snaps[i]
        with torch.no_grad():
            for p, saved in zip(self.learner.params, snap["params"], strict=True):
                p.copy_(saved)
        self.learner.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        return self.steps[i]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "snaps": list(self.snaps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = [int(s) for s in state["steps"]]
        self.snaps = list(state["snaps"])


def ring_for(cfg: Config, learner: Learner) -> SnapshotRing | None:
    h = cfg.health
    return SnapshotRing(learner, h.snapshots) if h.enabled and h.act and h.snapshots else None


__all__ = ["SnapshotRing", "ring_for"]
