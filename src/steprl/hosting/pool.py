"""`EnvPool`: one isolated env instance per trajectory, at most `max_concurrent` alive at once.

The agent loop asks for an env synchronously (`make_env(task)`) and then awaits `reset`; the
pool hands out a thin wrapper that takes a slot *in* `reset` (so waiting for a slot is async and
never blocks the event loop), builds the backend's instance only then, and frees the slot in
`close` (which the loop always calls, also after a failure). A remote backend therefore never
sees more than `max_concurrent` live instances from one trainer, whatever the batch size.
"""

from __future__ import annotations

import asyncio
import weakref

from steprl.envs.base import Env, EnvWrapper, Observation, Transition, maybe_await
from steprl.hosting.backend import EnvBackend
from steprl.types import Task


class EnvPool:
    """Wraps an `EnvBackend`: same `make_env` interface, bounded concurrency."""

    def __init__(self, backend: EnvBackend, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ValueError(f"runtime.max_concurrent_envs must be >= 1, got {max_concurrent}")
        self.backend = backend
        self.max_concurrent = max_concurrent
        self.name = backend.name
        # asyncio primitives bind to one event loop; the trainer runs one loop per rollout phase
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.live = 0  # instances between reset and close, for tests and metrics
        self.peak = 0

    def make_env(self, task: Task) -> Env:
        return _PooledEnv(self, task)

    def close(self) -> None:
        self.backend.close()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._slots.get(loop)
        if sem is None:
            sem = self._slots[loop] = asyncio.Semaphore(self.max_concurrent)
        return sem


class _PooledEnv(EnvWrapper):
    """Takes a pool slot in `reset`, releases it in `close`; delegates everything else."""

    def __init__(self, pool: EnvPool, task: Task) -> None:  # no env yet: `reset` makes it
        self._pool = pool
        self._task = task
        self._inner: Env | None = None
        self._slot: asyncio.Semaphore | None = None

    def wrapped(self) -> Env:
        if self._inner is None:
            raise RuntimeError("EnvPool: call reset() before using the env (the instance is made there)")
        return self._inner

    async def reset(self, task: Task, seed: int) -> Observation:
        if self._slot is None:
            slot = self._pool._semaphore()
            await slot.acquire()
            self._slot = slot
            self._pool.live += 1
            self._pool.peak = max(self._pool.peak, self._pool.live)
        if self._inner is None:
            self._inner = self._pool.backend.make_env(self._task)
        return await maybe_await(self._inner.reset(task, seed))

    async def step(self, action: str) -> Transition:
        return await maybe_await(self.wrapped().step(action))

    async def close(self) -> None:
        try:
            if self._inner is not None:
                await maybe_await(self._inner.close())
        finally:
            if self._slot is not None:
                self._slot.release()
                self._slot = None
                self._pool.live -= 1
