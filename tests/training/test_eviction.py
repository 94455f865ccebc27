"""The eviction rule (training/loop/pipeline.py EVICTION): with `requeue` an evicted long episode's
re-run can be overtaken again; with `age_priority` the learner waits for it, and it is trained
at staleness 0 in the step that evicted it. (benchmarks/eviction_bias.py measures the bias.)"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from steprl.training.loop.pipeline import Pipeline
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Step, Task, Trajectory


class _Producer:
    """Finishes a group when the test says so; its tokens carry the version it started at."""

    def __init__(self) -> None:
        self.version, self.started = 0, list[int]()
        self._running: dict[int, tuple[Task, Any, int]] = {}

    def start(self, items: Any, done: Any, **_: Any) -> None:
        for index, task in items:
            self.started.append(index)
            self._running[index] = (task, done, self.version)

    def finish(self, index: int) -> None:
        task, done, v = self._running.pop(index)
        step = Step((1,), (2,), (0.0,), (), 1.0, v, {}, (v,))
        done(index, Group(task, (Trajectory(task.id, str(index), "calc", (step,), 1.0, EndReason.ANSWERED),)))

    def publish(self, weights: Any, version: int) -> None:
        self.version = version

    def run(self, coro: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _take(pipe: Pipeline, n: int) -> tuple[threading.Thread, list[list[str]]]:
    out: list[list[str]] = []
    t = threading.Thread(target=lambda: out.append([g.task.id for g in pipe.take(n)]), daemon=True)
    t.start()
    time.sleep(0.05)
    return t, out


@pytest.mark.parametrize("eviction", ["requeue", "age_priority"])
def test_age_priority_waits_for_an_evicted_tasks_rerun_and_trains_it_in_that_step(eviction):
    prod = _Producer()
    tasks = StreamSource(lambda: iter([Task(f"t{i}", "q", "calc") for i in range(100)]))
    pipe = Pipeline(tasks, prod, tasks_per_step=2, max_staleness=1, version=0, eviction=eviction)
    for version, finished in enumerate([(1, 2), (3, 4)], start=1):  # t0 runs on, overtaken
        t, _ = _take(pipe, 2)
        for i in finished:
            prod.finish(i)
        t.join(2)
        pipe.publish({}, version)
        prod.publish({}, version)
        pipe.take_metrics(1)
    prod.finish(0)  # started at version 0, back at 2: evicted, and run again at once
    t, out = _take(pipe, 2)
    assert prod.started[-1] == 0
    prod.finish(5)
    prod.finish(6)
    t.join(0.3)
    if eviction == "requeue":  # the step goes on without it: its re-run may be overtaken again
        assert out == [["t5", "t6"]] and pipe.pending()[0][0] == 0
        return
    assert t.is_alive()  # the learner waits for the re-run (one place kept for it)
    prod.finish(0)
    t.join(2)
    assert out == [["t0", "t5"]] and pipe.depth() == (1, 1)  # t6 waits, first next step
    assert pipe.take_metrics(1)["staleness/traj_0"] == 0.5  # t0 at 0 (run again on version 2), t5 at 1
