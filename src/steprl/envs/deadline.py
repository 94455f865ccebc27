"""Env calls under a deadline: `DeadlineEnv` runs a sync env off the event loop.

A sync env method that blocks (a tool that sleeps, a socket read without a timeout) would
freeze the one asyncio loop every episode shares, and no deadline on that loop could fire. So a
sync env's calls run in order on a daemon thread of its own (one per instance: the env sees one
call at a time, always from the same thread), and the loop waits for the result under the
deadline; a call past it raises `EnvTimeout` (the trajectory ends `env_timeout`). Async methods
keep running on the loop, under the same deadline (a coroutine that blocks the loop with sync
code cannot be helped from here). The HTTP server (`hosting/threads.py`) and the Ray workers do
the same for their envs.

How the loop waits keeps in-process runs bit-for-bit reproducible. A sync env always ran on
the loop, so the engine saw every episode's next request in the same order, whatever the env's
timing (its batches, hence its log-probs' last bits, depend on that order). So the loop first
waits *blocking*, as before, up to `EnvCalls.inline_s` (1 s); only a call slower than that
turns the calls of the whole backend into awaited ones (`EnvCalls.inline` becomes False, once):
from then on a slow or hung env costs no other episode its time (the rest of the deadline runs
concurrently), and the run is reproducible up to float rounding, as over HTTP or Ray. A hung
env thus ends its episode within the deadline, and the loop stalls at most `inline_s`, once.

A thread blocked in Python cannot be killed. Its env is abandoned: `close()` is sent to it on a
thread of its own (it may wake the hung call) and not waited for. The thread is a daemon, never
joined (an executor's threads are joined at interpreter exit), so a hung call never keeps the
process alive; `EnvCalls` counts such threads and bounds them: past `max_stuck`, new calls fail
at once (`infra_failed`) instead of piling up threads. That is why the in-process backend runs
a user's sync env in a process per instance (`hosting/env_procs.py`): there the thread only
waits on a socket, and a call past its deadline is stopped by killing the process.

`take_tasks` bounds a task generator the same way: each task within the deadline, and
`run_within` one call outside the loop (the backend's start-up probe: the factory, `close()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, TypeVar

from steprl.envs.base import Env, EnvTimeout, EnvWrapper, InfraError, Observation, Transition
from steprl.types import Task

T = TypeVar("T")
_Job = tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None


class EnvCalls:
    """What the env calls of one backend share: whether the loop still waits for them blocking
    (`inline`, until one takes longer than `inline_s`; see the module docstring), and the threads
    blocked in a call that passed its deadline (`stuck`, counted until the call returns), at most
    `max_stuck`: past it a new call fails at once rather than start yet another thread."""

    def __init__(self, max_stuck: int = 64, inline_s: float = 1.0) -> None:
        self.max_stuck = max_stuck
        self.inline_s = inline_s
        self.inline = True
        self._count = 0
        self._lock = threading.Lock()

    @property
    def stuck(self) -> int:
        return self._count

    def check(self) -> None:
        if self._count >= self.max_stuck:
            raise InfraError(
                f"{self._count} env calls are still blocked past their deadline (each holds a "
                "thread that Python cannot kill); not starting more until they return. The env "
                "hangs: fix it, or raise the deadline if it is only slow"
            )

    def abandoned(self, call: concurrent.futures.Future[Any]) -> None:
        """`call` passed its deadline: counted until it returns (if it ever does)."""
        with self._lock:
            self._count += 1
        call.add_done_callback(self._returned)

    def _returned(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._count -= 1


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while (job := jobs.get()) is not None:
        fn, future = job
        if not future.set_running_or_notify_cancel():
            continue  # its caller gave up before it started
        try:
            result = fn()
        except BaseException as exc:  # handed to the caller, as the method itself would raise it
            future.set_exception(exc)
        else:
            future.set_result(result)


class _Thread:
    """One daemon thread that runs one env instance's calls, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self._jobs,), name=name, daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        """The thread exits once the calls submitted before this one have returned."""
        self._jobs.put(None)


class DeadlineEnv(EnvWrapper):
    """Wraps one env instance: every reset/step/close answers within `timeout_s` or raises
    `EnvTimeout`. The members the core reads are forwarded (`EnvWrapper`); other attributes are
    the env's own."""

    def __init__(
        self,
        env: Env,
        timeout_s: float,
        calls: EnvCalls | None = None,
        *,
        setting: str = "runtime.env_call_timeout_s",  # where the user sets the deadline
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the env call deadline must be > 0 seconds, got {timeout_s}")
        super().__init__(env)
        self.timeout_s = timeout_s
        self.setting = setting
        self._calls = calls if calls is not None else EnvCalls()
        self._thread: _Thread | None = None
        self._hung: str | None = None  # the call that passed its deadline, if one did

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "env":  # ours, not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.env, name)

    def __del__(self) -> None:  # an env dropped without close(): its idle thread goes too
        if getattr(self, "_thread", None) is not None and self._hung is None:
            self._thread.stop()  # type: ignore[union-attr]

    async def reset(self, task: Task, seed: int) -> Observation:
        return await self._call("reset", task, seed)

    async def step(self, action: str) -> Transition:
        return await self._call("step", action)

    async def close(self) -> None:
        if self._hung is not None:
            # its thread is still blocked: close on a thread of its own (it may wake the hung
            # call, as a sandbox kill or a closed socket does), never waited for; the blocked
            # thread exits if the call ever returns
            if self._thread is not None:
                self._thread.stop()
                self._thread = None
            closer = threading.Thread(
                target=_quietly, args=(self.env.close,), name="steprl-env-close", daemon=True
            )
            closer.start()
            return
        try:
            await self._call("close")
        finally:
            if self._thread is not None and self._hung is None:
                self._thread.stop()  # a later call (check-env closes twice) starts a new one
                self._thread = None

    async def _call(self, name: str, *args: Any) -> Any:
        if self._hung is not None:
            raise EnvTimeout(f"{name}(): the env's {self._hung}() call is still running past its deadline")
        method = getattr(self.env, name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        if inspect.iscoroutinefunction(getattr(method, "__func__", method)):
            result = method(*args)  # async: on the loop, as before
        else:
            self._calls.check()
            if self._thread is None:
                self._thread = _Thread(f"steprl-env-{type(self.env).__name__}")
            call = self._thread.submit(functools.partial(method, *args))
            try:
                result = await self._wait(call, started)
            except BaseException as exc:  # past the deadline, or the episode was cancelled
                if not call.done():
                    self._hung = name
                    self._calls.abandoned(call)
                inner = call.exception() if call.done() and not call.cancelled() else None
                if isinstance(exc, TimeoutError) and isinstance(inner, EnvTimeout):
                    raise inner from None  # the env's process was killed at the same deadline
                if isinstance(exc, TimeoutError) and inner is None:  # not a TimeoutError the env raised
                    raise self._timeout(name) from None
                raise
        if inspect.isawaitable(result):  # an async method, or a sync one that returned an awaitable
            left = self.timeout_s - (loop.time() - started)
            try:
                return await asyncio.wait_for(result, max(left, 0.0))
            except TimeoutError:
                raise self._timeout(name) from None
        return result

    async def _wait(self, call: concurrent.futures.Future[Any], started: float) -> Any:
        if self._calls.inline:  # blocking the loop, as a sync env always did (reproducible runs)
            try:
                return call.result(timeout=min(self._calls.inline_s, self.timeout_s))
            except TimeoutError:
                if call.done():
                    raise  # the env's own TimeoutError
                self._calls.inline = False  # a slow env: from now on the loop goes on meanwhile
        left = self.timeout_s - (asyncio.get_running_loop().time() - started)
        return await asyncio.wait_for(asyncio.wrap_future(call), max(left, 0.0))

    def _class_name(self) -> str:
        # an env run elsewhere (`hosting/env_procs.py`) names the class it runs
        return str(getattr(self.env, "class_name", type(self.env).__name__))

    def _timeout(self, name: str) -> EnvTimeout:
        return EnvTimeout(
            f"{self._class_name()}.{name}() gave no answer within {self.timeout_s:g}s; a sync "
            f"env call that blocks is abandoned there (raise {self.setting} if the env is only slow)"
        )


def _quietly(fn: Callable[[], object]) -> None:
    try:
        result = fn()
        if inspect.isawaitable(result):
            asyncio.run(_wait(result))
    except Exception:  # the episode has already failed; a failing close adds nothing
        pass


async def _wait(result: Any) -> None:
    await result


def run_within(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()` on a daemon thread, its result (or its exception) within `timeout_s`; else
    `EnvTimeout` naming `what`, and the thread is left behind (Python cannot stop it)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=run, name="steprl-env-call", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        if done.done():
            raise  # fn's own TimeoutError
        raise EnvTimeout(f"{what} gave no answer within {timeout_s:g}s") from None


def take_tasks(make: Callable[[], Iterator[T]], count: int, timeout_s: float, what: str) -> list[T]:
    """The first `count` items of the iterator `make()` returns, each (the first one including
    `make` itself) within `timeout_s` of the one before; fewer if it ends. A generator that
    never yields (e.g. a filter for a split it never produces) raises `EnvTimeout` instead of
    hanging; its thread (a daemon) is left behind."""
    items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def produce() -> None:
        try:
            for item in islice(make(), count):
                items.put(("item", item))
        except BaseException as exc:
            items.put(("error", exc))
        items.put(("end", None))

    threading.Thread(target=produce, name="steprl-tasks", daemon=True).start()
    got: list[T] = []
    while True:
        try:
            kind, value = items.get(timeout=timeout_s)
        except queue.Empty:
            raise EnvTimeout(
                f"{what} yielded {len(got)} of {count} tasks, then none within {timeout_s:g}s"
            ) from None
        if kind == "end":
            return got
        if kind == "error":
            raise value
        got.append(value)
