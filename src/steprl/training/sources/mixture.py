"""`mixture`: several envs' train splits, each position's env drawn by weight.

The draw for position p is a pure function of (run seed, p) (`random.Random(f"{seed}-{p}")`),
so a run's mixture does not depend on timing, on how many tasks a step takes, or on a resume.
Each env's split is read in order; an env that runs out leaves the draw (the others share what
follows by weight). With one env it is the `stream` source, position for position.

Its state: the next position, how many tasks each env's split has given (a resume skips that
many, as `stream` does), the envs that ran out, and the re-queued tasks.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

from steprl.training.sources.splits import TaskSplits
from steprl.training.state import task_dict, task_from_dict
from steprl.types import Group, Task


class MixtureSource:
    """Each next task from an env drawn by weight; every env's tasks in their split's order."""

    def __init__(self, tasks: TaskSplits, seed: int = 0) -> None:
        self._splits, self._seed = tasks, seed
        self._keys = list(tasks.by_env)
        self._its: dict[str, Iterator[Task]] | None = None  # made on first use
        self.cursor = 0  # the position of the next new task
        self.taken = dict.fromkeys(self._keys, 0)  # tasks each env's split has given
        self.ended: set[str] = set()  # envs whose split ran out
        self._requeued: list[tuple[int, Task]] = []  # by position: the lowest runs first

    def next(self) -> tuple[int, Task] | None:
        if self._requeued:
            return self._requeued.pop(0)
        if self._its is None:
            self._its = {k: f() for k, f in self._splits.by_env.items()}
        rng = random.Random(f"{self._seed}-{self.cursor}")
        while live := [k for k in self._keys if k not in self.ended]:
            key = rng.choices(live, weights=[self._splits.weights[k] for k in live])[0]
            task = next(self._its[key], None)
            if task is not None:
                self.taken[key] += 1
                self.cursor += 1
                return self.cursor - 1, task
            self.ended.add(key)  # drawn again, from the same generator, among the others
        return None

    def requeue(self, index: int, task: Task) -> None:
        bisect.insort(self._requeued, (index, task), key=lambda p: p[0])

    def observe(self, group: Group) -> None:
        pass  # fixed weights: success changes nothing (learning-progress weights would read it)

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "taken": dict(self.taken),
            "ended": sorted(self.ended),
            "requeued": [(i, task_dict(t)) for i, t in self._requeued],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        taken = {str(k): int(v) for k, v in state["taken"].items()}
        if set(taken) != set(self._keys):
            raise ValueError(
                f"the checkpoint's mixture is over envs {sorted(taken)}; this run's: {self._keys}"
            )
        self._its = {k: f() for k, f in self._splits.by_env.items()}
        for key, n in taken.items():
            skipped = sum(1 for _ in islice(self._its[key], n))
            if skipped != n:
                raise ValueError(
                    f"env {key!r}: its task stream ended at {skipped} tasks; the checkpoint is at {n}"
                )
        self.cursor, self.taken, self.ended = int(state["cursor"]), taken, set(state["ended"])
        self._requeued = [(int(i), task_from_dict(t)) for i, t in state["requeued"]]
