"""A synchronous group source for tests: the next tasks of the stream, rolled out in this
process while the caller waits. The plainest `training.loop.step_batch.GroupSource`, and the reference
the pipeline at staleness 0 is checked against (the trainer itself always uses the pipeline)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from steprl.rollout.loop import RolloutSetup, rollout_groups
from steprl.training.sources import TaskSource, take
from steprl.types import Group, Task

#: (tasks, group_size, first_index) -> one Group per task; `first_index` is the stream position
#: of `tasks[0]`, which keys the episode seeds (`rollout/seeds.py`).
RolloutFn = Callable[[Sequence[Task], int, int], list[Group]]


def local_rollout(setup: RolloutSetup, seed: int) -> RolloutFn:
    """Run the agent loop in this process on one asyncio loop per call."""

    def run(tasks: Sequence[Task], group_size: int, first_index: int) -> list[Group]:
        return asyncio.run(rollout_groups(tasks, group_size, setup, seed=seed, first_index=first_index))

    return run


@dataclass
class SyncSource:
    """The next `n` tasks of the stream, rolled out by `rollout` while the caller waits."""

    tasks: TaskSource  # never re-queued to: the positions of `n` tasks are consecutive
    rollout: RolloutFn
    group_size: int

    def take(self, n: int) -> list[Group]:
        items = take(self.tasks, n)
        if not items:
            return []
        groups = self.rollout([t for _, t in items], self.group_size, items[0][0])
        for group in groups:
            self.tasks.observe(group)
        return groups
