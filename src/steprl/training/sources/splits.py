"""`TaskSplits`: what a task source is built from, the run's train split of each env and the
env weights. Called, it is one iterator over all of them, interleaved by weight in a fixed
order (each task goes to the env furthest behind its share), so a source that takes one
stream runs unchanged on a list of envs; with one env it is that env's split as it is.

The splits are pure functions of the run seed: each call starts them again from the start,
which is what lets a source resume by skipping (`stream`) instead of storing tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from steprl.types import Task

Split = Callable[[], Iterator[Task]]


@dataclass(frozen=True)
class TaskSplits:
    """Each env's train split (a fresh iterator per call), by env key, and its weight (> 0)."""

    by_env: Mapping[str, Split]
    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        if not self.by_env or set(self.by_env) != set(self.weights):
            raise ValueError(
                f"TaskSplits: splits {sorted(self.by_env)} and weights {sorted(self.weights)} differ"
            )
        if any(w <= 0 for w in self.weights.values()):
            raise ValueError(f"TaskSplits: every weight must be > 0, got {dict(self.weights)}")

    @classmethod
    def one(cls, split: Split, key: str = "env") -> TaskSplits:
        return cls({key: split}, {key: 1.0})

    def __call__(self) -> Iterator[Task]:
        return interleave({k: f() for k, f in self.by_env.items()}, self.weights)


def interleave(iterators: Mapping[str, Iterator[Task]], weights: Mapping[str, float]) -> Iterator[Task]:
    """Tasks from `iterators` in proportion to `weights`, deterministically: each next task comes
    from the env furthest behind its share of the tasks so far (ties: the first listed). An env
    that runs out leaves; the others share what follows by their weights."""
    live = dict(iterators)
    taken = dict.fromkeys(live, 0)
    n = 0
    while live:
        total = sum(weights[k] for k in live)
        key = max(live, key=lambda k: (n + 1) * weights[k] / total - taken[k])
        task = next(live[key], None)
        if task is None:
            del live[key]
            continue
        taken[key] += 1
        n += 1
        yield task


__all__ = ["Split", "TaskSplits", "interleave"]
