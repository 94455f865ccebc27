"""Does eviction under `rollout.max_staleness` starve long episodes? Measured on the pipeline.

The real `Pipeline` (admission window, eviction, re-queue) with a producer whose groups take a
time fixed by their task: a third short (0.5 units), a third medium (2), a third long (5), each
±20% (seeded); the learner trains for 1 unit per step and publishes. A group's tokens carry
the version it started at, so a long group is overtaken (and evicted) when the learner
publishes twice while it runs. Per length bucket it prints how many tasks were admitted, the
share of them trained (of those admitted in the first half of the run, so every one had time),
the runs each took (1 = never evicted) and the steps from first admission to training; then
the wall time, the learner's idle share and the rollout time spent per task (re-runs included:
an evicted group ran to its end). Both eviction rules (`training/loop/pipeline.py`
EVICTION), over 3 seeds.

    python benchmarks/eviction_bias.py                  # 60 steps, 8 tasks per step, k = 1
    python benchmarks/eviction_bias.py --steps 120 --staleness 2 --unit 0.02

docs/async.md has the measured numbers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections import defaultdict
from typing import Any

from steprl.training.loop.pipeline import EVICTION, Eviction, Pipeline
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Step, Task, Trajectory

BUCKETS = {"short": 0.5, "medium": 2.0, "long": 5.0}  # episode time, in units


def _tasks(seed: int) -> StreamSource:
    """Task i is short, medium or long by i % 3, its time ±20% (seeded)."""

    def split() -> Any:
        rng = random.Random(seed)
        for i in range(100_000):
            bucket = list(BUCKETS)[i % 3]
            yield Task(
                f"t{i}",
                "q",
                "sim",
                params={"bucket": bucket, "time": BUCKETS[bucket] * rng.uniform(0.8, 1.2)},
            )

    return StreamSource(split)


class TimedProducer:
    """Finishes each group after its task's time; its tokens carry the version it started at."""

    def __init__(self, unit: float) -> None:
        self.unit, self.version = unit, 0
        self.runs: dict[int, int] = defaultdict(int)  # position -> times started
        self.first: dict[int, tuple[Task, int]] = {}  # position -> (task, version first admitted)
        self._timers: list[threading.Timer] = []

    def start(self, items: Any, done: Any, **_: Any) -> None:
        for index, task in items:
            self.runs[index] += 1
            self.first.setdefault(index, (task, self.version))
            step = Step((1,), (2,), (0.0,), (), 1.0, self.version, {}, (self.version,))
            group = Group(task, (Trajectory(task.id, str(index), "sim", (step,), 1.0, EndReason.ANSWERED),))
            timer = threading.Timer(task.params["time"] * self.unit, done, (index, group))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)

    def publish(self, weights: Any, version: int) -> None:
        self.version = version

    def run(self, coro: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        for t in self._timers:
            t.cancel()


def measure(
    eviction: Eviction, *, seed: int, steps: int, n: int, staleness: int, unit: float
) -> dict[str, Any]:
    prod = TimedProducer(unit)
    pipe = Pipeline(
        _tasks(seed), prod, tasks_per_step=n, max_staleness=staleness, version=0, eviction=eviction
    )
    trained: dict[int, int] = {}  # position -> the step it was trained in
    waited = 0.0
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        w0 = time.perf_counter()
        for g in pipe.take(n):
            trained[int(g.trajectories[0].group_id)] = step
        waited += time.perf_counter() - w0
        time.sleep(unit)  # the learner's update
        pipe.publish({}, step)
    wall = time.perf_counter() - t0
    pipe.close()
    half = {i: tv for i, tv in prod.first.items() if tv[1] < steps // 2}  # admitted in the first half
    work = sum(prod.runs[i] * task.params["time"] for i, (task, _) in half.items()) / max(len(half), 1)
    out: dict[str, Any] = {"wall_s": wall, "learner_idle": waited / wall, "work": work}
    for bucket in BUCKETS:
        mine = [i for i, (task, _) in half.items() if task.params["bucket"] == bucket]
        done = [i for i in mine if i in trained]
        out[bucket] = {
            "admitted": len(mine),
            "trained": len(done) / max(len(mine), 1),
            "runs": statistics.mean(prod.runs[i] for i in mine) if mine else 0.0,
            "delay": statistics.mean(trained[i] - half[i][1] for i in done) if done else float("nan"),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--unit", type=float, default=0.02, help="seconds per time unit")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--long", type=float, default=BUCKETS["long"], help="a long episode's time, in units")
    args = ap.parse_args()
    BUCKETS["long"] = args.long
    print(
        f"k={args.staleness}, {args.tasks_per_step} tasks/step, {args.steps} steps; episode time "
        f"{BUCKETS} units (±20%), learner 1 unit/step; {args.seeds} seeds (mean)"
    )
    for eviction in EVICTION:
        runs = [
            measure(
                eviction,
                seed=s,
                steps=args.steps,
                n=args.tasks_per_step,
                staleness=args.staleness,
                unit=args.unit,
            )
            for s in range(args.seeds)
        ]
        print(
            f"\n{eviction}: wall {statistics.mean(r['wall_s'] for r in runs):.2f} s, "
            f"learner idle {statistics.mean(r['learner_idle'] for r in runs):.2f}, rollout time "
            f"per task {statistics.mean(r['work'] for r in runs):.2f} units (once each: "
            f"{statistics.mean(BUCKETS.values()):.2f})"
        )
        print(f"  {'bucket':8} {'admitted':>8} {'trained':>8} {'runs/task':>9} {'steps to train':>14}")
        for bucket in BUCKETS:
            row = {
                k: statistics.mean(r[bucket][k] for r in runs)
                for k in ("admitted", "trained", "runs", "delay")
            }
            print(
                f"  {bucket:8} {row['admitted']:8.1f} {row['trained']:8.2f} {row['runs']:9.2f} "
                f"{row['delay']:14.2f}"
            )


if __name__ == "__main__":
    main()
