"""`stream`: the env's train split in order, position = how many tasks came before it.

Its state is the cursor and the re-queued tasks. A resume rebuilds the split's iterator and
skips `cursor` tasks inside the source (tasks are a pure function of the seed, so this is
exact); the trainer never replays anything.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any

from steprl.training.state import task_dict, task_from_dict
from steprl.types import Group, Task


class StreamSource:
    """The train split as an iterator that counts what it handed out."""

    def __init__(self, tasks: Callable[[], Iterator[Task]], seed: int = 0) -> None:
        del seed  # the split is already seeded; nothing here draws
        self._make = tasks
        self._tasks: Iterator[Task] | None = None  # made on first use: a resume makes it once
        self.cursor = 0  # the stream position of the next new task
        self._requeued: list[tuple[int, Task]] = []  # by position: the lowest runs first

    def next(self) -> tuple[int, Task] | None:
        if self._requeued:
            return self._requeued.pop(0)
        if self._tasks is None:
            self._tasks = self._make()
        task = next(self._tasks, None)
        if task is None:
            return None
        self.cursor += 1
        return self.cursor - 1, task

    def requeue(self, index: int, task: Task) -> None:
        bisect.insort(self._requeued, (index, task), key=lambda p: p[0])

    def observe(self, group: Group) -> None:
        pass  # the order is fixed: success changes nothing

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "requeued": [(i, task_dict(t)) for i, t in self._requeued]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        cursor = int(state["cursor"])
        self._tasks = self._make()
        skipped = sum(1 for _ in islice(self._tasks, cursor))
        if skipped != cursor:
            raise ValueError(f"the task stream ended at {skipped} tasks; the checkpoint is at {cursor}")
        self.cursor = cursor
        self._requeued = [(int(i), task_from_dict(t)) for i, t in state["requeued"]]
