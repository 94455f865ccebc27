"""What an env call costs on each in-process path (issue 44, item 6): a step's round trip through
`DeadlineEnv` for a sync env on a thread (steprl's own envs) and in a process of its own (a
user's sync env, `hosting/env_procs.py`), and what a new instance (fork + build + reset) costs.

    python benchmarks/env_call_roundtrip.py [--steps 2000]

The env is the tests' ``hang`` (tests/hosting/hang_envs.py) with nothing hung: its step does no
work, so the numbers are the path's own cost. Run it on a quiet machine: the numbers are times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hosting"))

import hang_envs  # noqa: E402  (registers the test envs)

from steprl.envs.deadline import DeadlineEnv  # noqa: E402
from steprl.envs.registry import make_tasks  # noqa: E402
from steprl.hosting.backend import InProcessBackend  # noqa: E402


async def _time(backend: InProcessBackend, steps: int, isolated: bool) -> tuple[float, float]:
    """(median µs per step, median ms per new instance) on one path."""
    task = next(make_tasks("hang", "train", 0))
    per_step, per_instance = [], []
    for _ in range(20):
        started = time.perf_counter()
        env = _make(backend, isolated)
        await env.reset(task, 0)
        per_instance.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        for _ in range(steps // 20):
            await env.step("x")
        per_step.append((time.perf_counter() - started) / (steps // 20) * 1e6)
        await env.close()
    return statistics.median(per_step), statistics.median(per_instance)


def _make(backend: InProcessBackend, isolated: bool) -> DeadlineEnv:
    if isolated:
        return backend.make_env(next(make_tasks("hang", "train", 0)))  # type: ignore[return-value]
    return DeadlineEnv(hang_envs.HangEnv(), backend.call_timeout_s, backend.calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    backend = InProcessBackend("hang", {}, call_timeout_s=30.0).probe()
    assert backend.processes is not None, "the test env should run in processes of its own"
    try:
        for label, isolated in (("thread (steprl's envs)", False), ("process (a user's sync env)", True)):
            step_us, new_ms = asyncio.run(_time(backend, args.steps, isolated))
            print(f"{label:30s} step round trip {step_us:7.1f} µs   new instance + reset {new_ms:6.2f} ms")
    finally:
        backend.close()


if __name__ == "__main__":
    main()
