"""`check_task_source`: the contract of a task source, as `check_env` is an env's. The tests run
it over every entry of `TASK_SOURCES`; run it on your own before you register it.

What it proves, on synthetic train splits of two envs weighted 1:2, and groups whose success
varies by task (so a source that learns from `observe` is exercised):
- deterministic: two sources built alike and driven alike hand out the same tasks;
- resumable: after k tasks, a `state_dict` written and read back as a checkpoint does it
  (`torch.save`, `torch.load(weights_only=True)`) gives a fresh source the same next 100 tasks;
- requeue keeps every task exactly once: each task taken back comes again, with its position,
  and no position is handed out twice otherwise.
"""

from __future__ import annotations

import functools
import io
from collections import Counter
from collections.abc import Iterator

import torch

from steprl.training.sources import TaskSource, TaskSplits, make_source, take
from steprl.types import EndReason, Group, Task, Trajectory

ENVS = ("env_a", "env_b")


def synthetic_tasks(seed: int, env: str = ENVS[0]) -> Iterator[Task]:
    """A long seeded train split of `env` (a pure function of the seed)."""
    for i in range(100_000):
        yield Task(f"{env}-{seed}-{i}", f"q{i}", env, seed=seed * 1_000_003 + i, params={"i": i})


def synthetic_splits(seed: int) -> TaskSplits:
    """The train splits of two envs, the second weighted twice the first."""
    return TaskSplits(
        {env: functools.partial(synthetic_tasks, seed, env) for env in ENVS},
        dict(zip(ENVS, (1.0, 2.0), strict=True)),
    )


def _group(task: Task) -> Group:
    """Four episodes whose success depends on the task, as a curriculum would see them."""
    wins = sum(map(ord, task.id)) % 5
    return Group(
        task,
        tuple(
            Trajectory(task.id, task.id, task.env, (), float(k < wins), EndReason.ANSWERED) for k in range(4)
        ),
    )


def _drive(source: TaskSource, n: int) -> list[tuple[int, Task]]:
    """Take `n` tasks as the pipeline does: every third one is evicted (given back, then
    taken again first); the others are trained (observed)."""
    out: list[tuple[int, Task]] = []
    for k, (index, task) in enumerate(take(source, n)):
        out.append((index, task))
        if k % 3 == 2:
            source.requeue(index, task)
            again = source.next()
            assert again == (index, task), f"a requeued task came back as {again}, not {(index, task)}"
            out.append(again)
        source.observe(_group(task))
    return out


def _round_trip(source: TaskSource) -> dict:
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def check_task_source(name: str, seed: int = 3, k: int = 37) -> None:
    """Raise AssertionError (with what differs) unless source `name` (a name in `TASK_SOURCES`
    or an import path, as `env.source` takes) keeps the contract."""

    def build() -> TaskSource:
        return make_source(name, synthetic_splits(seed), seed)

    a, b = build(), build()
    assert isinstance(a, TaskSource), f"{name}: not a TaskSource (next, requeue, observe, state_dict, ...)"
    first = _drive(a, 60)
    assert first == _drive(b, 60), f"{name}: two sources built alike gave different tasks"
    assert all(t.env in ENVS for _, t in first), f"{name}: a task without its env name"
    assert {t.env for _, t in first} == set(ENVS), f"{name}: 60 tasks and not one of each env"

    # resume: after k tasks (one given back and not taken yet), the same next 100
    source = build()
    taken = _drive(source, k)
    source.requeue(*taken[0])
    resumed = build()
    resumed.load_state_dict(_round_trip(source))
    assert take(resumed, 100) == take(source, 100), (
        f"{name}: a state_dict round trip changed the next 100 tasks"
    )

    # exactly once: give back a scattered handful, then everything comes back once
    source = build()
    handed = take(source, 40)
    back = [handed[i] for i in (31, 2, 17, 5)]
    for index, task in back:
        source.requeue(index, task)
    again = take(source, len(back))
    assert sorted(again, key=lambda p: p[0]) == sorted(back, key=lambda p: p[0]), (
        f"{name}: requeued {[i for i, _ in back]} but got {[i for i, _ in again]} back first"
    )
    later = take(source, 100)
    counts = Counter(i for i, _ in [*handed, *later])
    repeated = [i for i, c in counts.items() if c > 1]
    assert not repeated, f"{name}: stream positions handed out twice without a requeue: {repeated}"


__all__ = ["ENVS", "check_task_source", "synthetic_splits", "synthetic_tasks"]
