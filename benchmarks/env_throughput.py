"""Env transport throughput: steps/s and p50/p99 step latency, in-process vs HTTP vs Ray.

Runs the trivial `echo` env (negligible work per step), so the numbers are the cost of
getting one `step` to the environment and back. For each backend and each concurrency C,
C episodes run at once on one asyncio loop (as the agent loop runs them); each episode is
reset, stepped `--steps` times and closed, and every `step` call is timed.

    .venv/bin/python benchmarks/env_throughput.py [--backends inprocess,http,ray]
        [--concurrency 1,16,64] [--episodes 256] [--steps 8]

Target (issue 5): HTTP adds at most 2 ms at p50 and 10 ms at p99 over in-process at
concurrency 16 on loopback. The HTTP client coalesces the calls made in one event-loop tick
into one `POST /v1/batch` (see docs/scaling.md). Numbers on a shared 2-core machine are noisy: compare ratios
measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from itertools import islice

from steprl.config import RuntimeSection
from steprl.envs.base import maybe_await
from steprl.envs.registry import make_tasks
from steprl.hosting.backend import EnvBackend, make_backend
from steprl.types import Task


@dataclass(frozen=True)
class Result:
    backend: str
    concurrency: int
    steps: int
    wall_s: float
    p50_ms: float
    p99_ms: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _episode(backend: EnvBackend, task: Task, steps: int, latencies: list[float]) -> None:
    env = backend.make_env(task)
    try:
        await maybe_await(env.reset(task, task.seed))
        for _ in range(steps):
            t0 = time.perf_counter()
            await maybe_await(env.step(f"<say>{task.answer}</say>"))
            latencies.append(time.perf_counter() - t0)
    finally:
        await maybe_await(env.close())


async def _run(backend: EnvBackend, tasks: list[Task], concurrency: int, steps: int) -> list[float]:
    latencies: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> None:
        async with slots:
            await _episode(backend, task, steps, latencies)

    await asyncio.gather(*(one(t) for t in tasks))
    return latencies


def measure(name: str, concurrency: list[int], episodes: int, steps: int) -> list[Result]:
    # turns > steps: every measured step is a mid-episode echo, none the final answer
    tasks = list(islice(make_tasks("echo", "train", 0, turns=steps + 1), episodes))
    backend = make_backend("echo", {}, RuntimeSection(backend=name))  # type: ignore[arg-type]
    results = []
    try:
        asyncio.run(_run(backend, tasks[: min(16, episodes)], 4, steps))  # warm-up: connections, actors
        for c in concurrency:
            t0 = time.perf_counter()
            latencies = asyncio.run(_run(backend, tasks, c, steps))
            wall = time.perf_counter() - t0
            results.append(
                Result(
                    name,
                    c,
                    len(latencies),
                    wall,
                    1e3 * statistics.median(latencies),
                    1e3 * _percentile(latencies, 0.99),
                )
            )
    finally:
        backend.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="inprocess,http,ray")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results: list[Result] = []
    for name in args.backends.split(","):
        results += measure(name, concurrency, args.episodes, args.steps)

    print(f"\necho env, {args.episodes} episodes x {args.steps} steps per cell")
    print(f"{'backend':<10} {'conc':>5} {'steps/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
    for r in results:
        print(f"{r.backend:<10} {r.concurrency:>5} {r.steps_per_s:>10,.0f} {r.p50_ms:>9.3f} {r.p99_ms:>9.3f}")
    by = {(r.backend, r.concurrency): r for r in results}
    for name in ("http", "ray"):
        base, other = by.get(("inprocess", 16)), by.get((name, 16))
        if base and other:
            print(
                f"{name} overhead at concurrency 16: p50 +{other.p50_ms - base.p50_ms:.3f} ms, "
                f"p99 +{other.p99_ms - base.p99_ms:.3f} ms"
                + ("  (target: +2 ms p50, +10 ms p99)" if name == "http" else "")
            )


if __name__ == "__main__":
    main()
