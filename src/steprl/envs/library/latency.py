"""Long-tailed env latency: `calculator_slow`, the calculator whose every reply takes a lognormal
time (an asynchronous sleep, so 2 cores suffice for hundreds of slow episodes at once).

Multi-turn agent rollouts have heavy-tailed latencies (tool calls, sandboxes, web requests): a
synchronous step waits for its slowest episode. This env makes that measurable on a laptop
(`benchmarks/async.py`). The delay before each reply (reset included) is
`min(max_s, median_s * exp(sigma * z))`, z ~ N(0, 1), drawn from the episode's own seed, so an
episode's latencies are the same whatever else runs, and the rollouts stay reproducible.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from steprl.envs.base import Env, EnvWrapper, Observation, Transition, maybe_await
from steprl.envs.library.calculator import CalculatorEnv
from steprl.envs.library.calculator.tasks import renamed_tasks
from steprl.types import Task


class SlowEnv(EnvWrapper):
    """Wraps an env; sleeps a seeded lognormal time before every reply."""

    def __init__(self, inner: Env, *, median_s: float, sigma: float, max_s: float) -> None:
        if median_s < 0 or sigma < 0 or max_s < 0:
            raise ValueError(
                f"latency params must be >= 0 (median_s={median_s}, sigma={sigma}, max_s={max_s})"
            )
        super().__init__(inner)
        self.median_s, self.sigma, self.max_s = median_s, sigma, max_s
        self._rng = random.Random(0)

    def delay(self) -> float:
        return min(self.max_s, self.median_s * math.exp(self.sigma * self._rng.gauss(0.0, 1.0)))

    async def reset(self, task: Task, seed: int) -> Observation:
        self._rng = random.Random(f"latency:{seed}")
        await asyncio.sleep(self.delay())
        return await maybe_await(self.env.reset(task, seed))

    async def step(self, action: str) -> Transition:
        await asyncio.sleep(self.delay())
        return await maybe_await(self.env.step(action))

    async def close(self) -> None:
        await maybe_await(self.env.close())


def slow_calculator(
    *, median_s: float = 0.01, sigma: float = 1.0, max_s: float = 1.0, **params: Any
) -> SlowEnv:
    """The calculator (its `params`) behind a lognormal delay per reply."""
    return SlowEnv(CalculatorEnv(**params), median_s=median_s, sigma=sigma, max_s=max_s)


#: the calculator's tasks, named for this env (`Task.env` is the registered name)
make_tasks = renamed_tasks("calculator_slow")
