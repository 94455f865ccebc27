"""The worker side of the Ray env backend: `EnvWorker` (hosted as an async Ray actor by
`ray_backend.RayEnvBackend`) and the records it sends back.

Kept free of Ray calls so the worker's logic reads on its own: many env instances keyed by id,
async env methods on the actor's event loop, sync ones in a bounded thread pool, every env
exception returned as data (`EnvFailure`), never raised through Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import os
import pickle
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import Env, EnvTimeout, Observation, ToolInfo, Transition, tool_infos
from steprl.envs.registry import load_plugins
from steprl.types import Task


@dataclass(frozen=True)
class EnvMeta:
    """What the agent loop reads from an env besides reset/step, fetched at create and after
    each reset (an env may learn its tools then, as the MCP adapter does)."""

    stop_strings: tuple[str, ...]
    system_prompt: str
    tools: tuple[ToolInfo, ...] = ()  # records, not the env's tools: those may hold a session

    @classmethod
    def of(cls, env: Env) -> EnvMeta:
        return cls(tuple(env.stop_strings), str(env.system_prompt), tool_infos(env))


@dataclass(frozen=True)
class EnvFailure:
    """An exception the env raised inside a worker, as data (the worker itself is fine)."""

    method: str
    type_name: str
    message: str
    traceback: str
    is_timeout: bool  # the env raised EnvTimeout itself (e.g. its own sandbox deadline)


@dataclass(frozen=True)
class WorkerStats:
    """One env worker's health, for supervision, metrics and tests."""

    pid: int
    host: str
    live: int  # env instances held
    in_flight: int  # calls running now
    stuck_threads: int  # threads still busy in calls whose instance was destroyed


class EnvWorker:
    """Hosts many env instances of one kind, keyed by instance id.

    Async env methods run on the actor's event loop; sync ones in a bounded thread pool, so one
    slow env never stalls the others. Every env exception comes back as an `EnvFailure` and the
    instance is dropped (its state may be half-updated); the worker keeps serving.
    """

    def __init__(
        self,
        factory: Callable[..., Env] | bytes,
        params: Mapping[str, Any],
        max_threads: int,
        plugins: Sequence[str] = (),
        sys_path: Sequence[str] = (),
    ) -> None:
        """`factory` may come pickled (bytes): it is loaded only after the driver's `sys_path`
        entries are added and the `plugins` imported, so a factory from a user's module (a
        plugin next to the config, not installed) loads in the worker as in the trainer."""
        sys.path.extend(p for p in sys_path if p not in sys.path)
        load_plugins(plugins)  # what the run's plugin modules register, as in the trainer
        self._factory: Callable[..., Env] = pickle.loads(factory) if isinstance(factory, bytes) else factory
        self._params = dict(params)
        self._envs: dict[str, Env] = {}
        self._threads = ThreadPoolExecutor(max_threads, thread_name_prefix="steprl-env")
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}  # call id -> instance id, for calls inside a thread
        self._abandoned: set[str] = set()  # destroyed while a thread was still inside them
        self._cancelled: set[str] = set()  # destroyed before `create` stored them
        self._call_ids = itertools.count()
        self._in_flight = 0
        # calls of a batch still running when it answered: call id -> (instance id, task)
        self._late: dict[int, tuple[str, asyncio.Task[Any]]] = {}

    async def run_batch(self, calls: list[tuple[int, str, str, tuple[Any, ...]]], hold_s: float) -> list[Any]:
        """Run `(call id, instance id, method, args)` calls concurrently (method: create, reset,
        step or close); answer `(call id, result)` for those done within `hold_s` of each other's start.

        One actor call for a whole tick of env calls: a Ray actor call costs ~0.7 ms of CPU, 16 in
        one list ~0.08 ms each. A call still running after `hold_s` is answered later, by `result`
        (a slow env holds back no other call's answer by more than `hold_s`).
        """
        tasks = [
            (call_id, instance_id, asyncio.ensure_future(getattr(self, method)(instance_id, *args)))
            for call_id, instance_id, method, args in calls
        ]
        await asyncio.wait([t for _, _, t in tasks], timeout=hold_s)
        answers = []
        for call_id, instance_id, task in tasks:
            if task.done():
                answers.append((call_id, task.result()))  # never raises: failures come as EnvFailure
            else:
                self._late[call_id] = (instance_id, task)
        return answers

    async def result(self, call_id: int) -> Any:
        """The result of a batched call that was still running when its batch answered."""
        entry = self._late.get(call_id)
        if entry is None:
            return EnvFailure("result", "UnknownCall", f"no running call {call_id} (destroyed?)", "", False)
        instance_id, task = entry
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this `result` call itself was cancelled
            return EnvFailure("call", "Destroyed", f"env instance {instance_id} was destroyed", "", True)
        finally:
            if task.done():
                self._late.pop(call_id, None)

    async def create(self, instance_id: str) -> EnvMeta | EnvFailure:
        result = await self._run(instance_id, "create", functools.partial(self._factory, **self._params))
        if isinstance(result, EnvFailure):
            return result
        env: Env = result
        if instance_id in self._cancelled:  # the caller gave up (deadline) before we finished
            self._cancelled.discard(instance_id)
            self._close_quietly(env)
            return EnvFailure("create", "Abandoned", "created after the caller's deadline", "", True)
        self._envs[instance_id] = env
        return EnvMeta.of(env)

    async def reset(
        self, instance_id: str, task: Task, seed: int
    ) -> tuple[Observation, EnvMeta] | EnvFailure:
        """The first observation and the env's meta after it: an env may learn its tools (hence
        its system prompt) only at reset, as the MCP adapter does."""
        result = await self._call(instance_id, "reset", task, seed)
        env = self._envs.get(instance_id)
        if isinstance(result, EnvFailure):
            return result
        if env is None:  # destroyed (deadline) while resetting
            return EnvFailure("reset", "Destroyed", f"env instance {instance_id} was destroyed", "", True)
        return result, EnvMeta.of(env)

    async def step(self, instance_id: str, action: str) -> Transition | EnvFailure:
        return await self._call(instance_id, "step", action)

    async def close(self, instance_id: str) -> EnvFailure | None:
        env = self._envs.pop(instance_id, None)
        if env is None:
            return None  # already closed or destroyed: close is idempotent
        result = await self._run(instance_id, "close", env.close)
        return result if isinstance(result, EnvFailure) else None

    async def destroy(self, instance_id: str) -> WorkerStats:
        """Forget an instance whose call timed out. It is not closed while a thread is still
        inside it (calling into a busy env is unsafe); that thread counts in `stuck_threads`
        until it returns. An instance still being created is closed when its factory returns."""
        env = self._envs.pop(instance_id, None)
        for call_id, (late_instance, task) in list(self._late.items()):
            if late_instance == instance_id:  # a late batched call: stop it (async envs) and forget it
                task.cancel()
                del self._late[call_id]
        with self._lock:
            busy = instance_id in self._running.values()
            if busy:
                self._abandoned.add(instance_id)
        if env is None:
            self._cancelled.add(instance_id)
        elif not busy:
            self._close_quietly(env)
        return self.stats()

    def stats(self) -> WorkerStats:
        with self._lock:
            stuck = sum(1 for i in self._running.values() if i in self._abandoned)
        return WorkerStats(os.getpid(), socket.gethostname(), len(self._envs), self._in_flight, stuck)

    async def _call(self, instance_id: str, method: str, *args: Any) -> Any:
        env = self._envs.get(instance_id)
        if env is None:
            return EnvFailure(
                method,
                "UnknownInstance",
                f"env instance {instance_id!r} is not live on this worker (closed, or destroyed after a "
                "failure or timeout); make a new env with backend.make_env(task).",
                "",
                False,
            )
        result = await self._run(instance_id, method, getattr(env, method), *args)
        if isinstance(result, EnvFailure):
            self._envs.pop(instance_id, None)  # never reuse an env that raised mid-call
        return result

    async def _run(self, instance_id: str, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        self._in_flight += 1
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            call_id = next(self._call_ids)
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._threads, self._tracked, call_id, instance_id, fn, args)
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:
            return EnvFailure(
                method,
                type(exc).__name__,
                str(exc),
                traceback.format_exc(limit=8),
                isinstance(exc, EnvTimeout),
            )
        finally:
            self._in_flight -= 1

    def _tracked(self, call_id: int, instance_id: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        with self._lock:
            self._running[call_id] = instance_id
        try:
            return fn(*args)
        finally:
            with self._lock:
                del self._running[call_id]
                if instance_id not in self._running.values():
                    self._abandoned.discard(instance_id)  # its last stuck thread came back

    def _close_quietly(self, env: Env) -> None:
        """Best-effort close of a forgotten instance, off the caller's path; errors are dropped."""
        if inspect.iscoroutinefunction(env.close):
            task = asyncio.get_running_loop().create_task(env.close())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        else:
            asyncio.get_running_loop().run_in_executor(self._threads, _close_sync, env)


def _close_sync(env: Env) -> None:
    with contextlib.suppress(Exception):
        env.close()
