"""`difficulty`: tasks re-served from pools by how hard they were last time (prime-rl's
difficulty pools, resume-exact).

Every group the learner trains (`observe`) files its task by its group-mean reward: `easy` at
or above `easy` (default 0.9), `hard` at or below `hard` (0.1), `normal` between. Each position
draws a pool by `weights` (defaults: unseen 1, normal 1, easy 0.2, hard 0.2) from
`random.Random(f"{seed}-pools-{position}")`, a pure function of the run seed and the position
(so not of timing, `tasks_per_step` or a resume), and takes that pool's oldest task; the pool
`unseen` is the train splits themselves (read as `mixture` reads them: each new task's env
drawn by weight), so new tasks are first-class, drawn by weight like the others. A task served
again gets a new position (new episode seeds) and is filed again when trained. A pool of
weight 0 retires its tasks (`weights: {easy: 0}`: mastered tasks never come back).

Why these defaults: a group all of whose episodes succeed, or all fail, has no spread for a
group-relative advantage to learn from (GRPO gives it zero); re-serving the tasks in between
keeps the model meeting tasks it can learn from. The group filters still run on what is
drawn: this changes what is rolled out, they what is trained (docs/components.md).

Its state: the next position, each task's last group-mean reward, the pools (task ids, oldest
first) with the tasks they hold, the re-queued tasks, and the splits' source (`mixture`'s state:
how many tasks each env's split has given).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping
from typing import Any

from steprl.training.sources.mixture import MixtureSource
from steprl.training.sources.splits import TaskSplits
from steprl.training.state import task_dict, task_from_dict
from steprl.types import Group, Task

POOLS = ("unseen", "hard", "normal", "easy")  # the draw's order (the weights decide, not this)
DEFAULT_WEIGHTS = {"unseen": 1.0, "hard": 0.2, "normal": 1.0, "easy": 0.2}


class DifficultySource:
    """Each next task from a pool drawn by weight: unseen (the splits), hard, normal or easy."""

    def __init__(
        self,
        tasks: TaskSplits,
        seed: int = 0,
        easy: float = 0.9,
        hard: float = 0.1,
        weights: dict[str, float] | None = None,
    ) -> None:
        weights = dict(weights or {})
        if unknown := sorted(set(weights) - set(POOLS)):
            raise ValueError(f"weights: unknown pool(s) {', '.join(unknown)}; allowed: {', '.join(POOLS)}")
        self.weights = {**DEFAULT_WEIGHTS, **{k: float(v) for k, v in weights.items()}}
        if any(w < 0 for w in self.weights.values()) or not any(self.weights.values()):
            raise ValueError(f"weights: each must be >= 0 and one > 0, got {self.weights}")
        if not hard < easy:
            raise ValueError(f"hard ({hard}) must be below easy ({easy}): a reward cannot be both")
        self.easy, self.hard, self._seed = easy, hard, seed
        self._new = MixtureSource(tasks, seed)  # the unseen pool: its own positions, unused here
        self.cursor = 0  # the position of the next new hand-out
        self.recent: dict[str, float] = {}  # task id -> its last group-mean reward
        self.pools: dict[str, list[str]] = {k: [] for k in POOLS[1:]}  # task ids, oldest first
        self._tasks: dict[str, Task] = {}  # what the pools' ids are
        self.exhausted = False  # the splits ran out
        self._requeued: list[tuple[int, Task]] = []  # by position: the lowest runs first

    def next(self) -> tuple[int, Task] | None:
        if self._requeued:
            return self._requeued.pop(0)
        rng = random.Random(f"{self._seed}-pools-{self.cursor}")
        while live := [k for k in POOLS if self.weights[k] > 0 and self._has(k)]:
            pool = rng.choices(live, weights=[self.weights[k] for k in live])[0]
            if pool == "unseen":
                item = self._new.next()
                if item is None:
                    self.exhausted = True  # drawn again, from the same generator, among the others
                    continue
                task = item[1]
            else:
                task = self._tasks.pop(self.pools[pool].pop(0))
            self.cursor += 1
            return self.cursor - 1, task
        return None

    def _has(self, pool: str) -> bool:
        return not self.exhausted if pool == "unseen" else bool(self.pools[pool])

    def requeue(self, index: int, task: Task) -> None:
        bisect.insort(self._requeued, (index, task), key=lambda p: p[0])

    def observe(self, group: Group) -> None:
        rewards = [t.outcome_reward for t in group.trajectories if t.trainable]
        task = group.task
        if rewards:  # infra failures only: keep what was known (or `normal`), serve it again
            self.recent[task.id] = sum(rewards) / len(rewards)
        if task.id in self._tasks:  # already in a pool (listed twice in a split): filed once
            for ids in self.pools.values():
                if task.id in ids:
                    ids.remove(task.id)
        self._tasks[task.id] = task
        self.pools[self.pool_of(task.id)].append(task.id)

    def pool_of(self, task_id: str) -> str:
        """The pool a task's last group-mean reward puts it in (`normal` before its first)."""
        reward = self.recent.get(task_id)
        if reward is None:
            return "normal"
        return "easy" if reward >= self.easy else "hard" if reward <= self.hard else "normal"

    def sizes(self) -> dict[str, int]:
        """How many tasks each pool holds now (`unseen`: the splits, not counted)."""
        return {k: len(v) for k, v in self.pools.items()}

    def metrics(self) -> dict[str, float]:
        """Logged with each step (as prime-rl's `pool/{name}`): each pool's size, and the new
        tasks taken from the splits so far."""
        return {f"source/pool/{k}": float(n) for k, n in self.sizes().items()} | {
            "source/unseen_taken": float(self._new.cursor)
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "recent": dict(self.recent),
            "pools": {k: list(v) for k, v in self.pools.items()},
            "tasks": [task_dict(t) for t in self._tasks.values()],
            "exhausted": self.exhausted,
            "requeued": [(i, task_dict(t)) for i, t in self._requeued],
            "splits": self._new.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._new.load_state_dict(state["splits"])
        self.cursor, self.exhausted = int(state["cursor"]), bool(state["exhausted"])
        self.recent = {str(k): float(v) for k, v in state["recent"].items()}
        self.pools = {k: [str(i) for i in state["pools"].get(k, [])] for k in POOLS[1:]}
        self._tasks = {t.id: t for t in map(task_from_dict, state["tasks"])}
        self._requeued = [(int(i), task_from_dict(t)) for i, t in state["requeued"]]


__all__ = ["DEFAULT_WEIGHTS", "POOLS", "DifficultySource"]
