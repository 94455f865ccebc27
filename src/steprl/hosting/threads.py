"""`WorkerThreads`: the env server runs blocking env methods here, off its event loop.

A hung env call must never stall the server, so sync env methods run on worker threads and the
loop awaits a future. Handing each call to a thread and back costs ~20 µs of CPU and a GIL
hand-off; for a `/v1/batch` of quick steps that was a quarter of the server's time. So calls
submitted together (`run_many`) go to the threads as one `_Group`: one thread drains them in
order while they are quick, and once the group has run for `spread_s` with calls still waiting
(one is slow or hung) every waiting call gets a thread of its own. A slow call therefore holds
up the calls queued behind it by at most `spread_s`, and a group of quick calls costs one
hand-off each way instead of one per call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_Job = Callable[[], None]


class Overloaded(Exception):
    """Every worker thread is busy (possibly with hung env calls): the server answers 503."""


class WorkerThreads:
    """Runs blocking env calls on daemon threads, at most `limit` calls in flight at once.

    Daemon threads rather than a ThreadPoolExecutor: a hung env call cannot be cancelled, and an
    executor's threads are joined at interpreter exit (as is asyncio's default executor when its
    loop closes), so a single hung call would block shutdown forever. Threads are reused: a
    finished thread waits `idle_s` for the next job before it exits, because starting a thread
    per call cost more than the rest of a trivial env's request (measured: ~1/3 of the server's
    CPU per step). A call whose caller gave up keeps its thread until the env returns and keeps
    counting against `limit`; `orphan` then receives its result (e.g. an env built too late).
    """

    def __init__(self, limit: int, *, idle_s: float = 1.0, spread_s: float = 0.002) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.idle_s = idle_s
        self.spread_s = spread_s
        self._alive = 0  # calls in flight (running or waiting for a thread)
        self._idle = 0  # threads waiting for a job and not yet promised one
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._pending: dict[asyncio.AbstractEventLoop, list[_Call]] = {}  # this tick's calls

    @property
    def alive(self) -> int:
        return self._alive

    async def run(self, fn: Callable[..., T], *args: Any, orphan: Callable[[T], None] | None = None) -> T:
        """`fn(*args)` on a worker thread; raises `Overloaded` when `limit` calls are in flight.

        Calls made in the same event-loop tick (the calls of one `/v1/batch`) start as one group.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        pending = self._pending.setdefault(loop, [])
        if not pending:
            loop.call_soon(self._start_pending, loop)
        pending.append((functools.partial(fn, *args) if args else fn, future, orphan))
        return await future

    def _start_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        calls = self._pending.pop(loop, [])
        live = [c for c in calls if not c[1].cancelled()]
        if live:
            self._start(loop, live)

    def run_many(
        self,
        calls: Sequence[Callable[[], Any]],
        *,
        orphans: Sequence[Callable[[Any], None] | None] | None = None,
    ) -> list[asyncio.Future[Any]]:
        """Start `calls` as one group now; a future per call, in order (`Overloaded` past `limit`)."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in calls]
        late = list(orphans) if orphans is not None else [None] * len(calls)
        self._start(loop, list(zip(calls, futures, late, strict=True)))
        return futures

    def _start(self, loop: asyncio.AbstractEventLoop, calls: list[_Call]) -> None:
        with self._lock:
            taken = max(0, min(len(calls), self.limit - self._alive))
            self._alive += taken
        for _, future, _ in calls[taken:]:
            future.set_exception(Overloaded(f"all {self.limit} env worker threads are busy"))
        if taken:
            group = _Group(self, loop, calls[:taken])
            self._submit(group.drain)
            if taken > 1:  # a lone call has nobody queued behind it
                loop.call_later(self.spread_s, group.spread)

    def _finished_one(self) -> None:
        with self._lock:
            self._alive -= 1

    def _submit(self, job: _Job) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1  # that thread is promised this job
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._serve, name="steprl-env-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no job was promised to an idle thread: this one may go
                        self._idle -= 1
                        return
                continue  # a job was promised to "an idle thread": stay for it
            job()
            with self._lock:
                self._idle += 1


_Call = tuple[Callable[[], Any], asyncio.Future[Any], Callable[[Any], None] | None]
_Done = tuple[asyncio.Future[Any], Any, BaseException | None, Callable[[Any], None] | None]


class _Group:
    """Calls submitted together; drained by one thread, spread over more if one is slow.

    Results reach the loop in as few wake-ups as possible: a drainer hands them over when the
    queue is empty, and, once the group is older than `spread_s`, before each further call (so
    a result never waits behind a slow call for longer than that). `spread` (on the loop, at
    `spread_s`) hands over what is finished and gives every still-waiting call its own thread.
    """

    def __init__(self, threads: WorkerThreads, loop: asyncio.AbstractEventLoop, calls: list[_Call]) -> None:
        self.threads = threads
        self.loop = loop
        self.todo: collections.deque[_Call] = collections.deque(calls)
        self.done: list[_Done] = []
        self.lock = threading.Lock()
        self.started = time.monotonic()

    def drain(self) -> None:
        """A worker thread's job: run waiting calls until none is left."""
        while True:
            with self.lock:
                if not self.todo:
                    break
                fn, future, orphan = self.todo.popleft()
                if future.cancelled():  # its caller gave up before it started: do not start it
                    self.threads._finished_one()
                    continue
                hand_over = bool(self.done) and time.monotonic() - self.started > self.threads.spread_s
            if hand_over:
                self._deliver_soon()
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:
                error = exc
            finally:
                self.threads._finished_one()
            with self.lock:
                self.done.append((future, result, error, orphan))
        self._deliver_soon()

    def spread(self) -> None:
        """On the loop after `spread_s`: deliver what is done, a thread for each waiting call."""
        self._deliver()
        with self.lock:
            waiting = len(self.todo)
        for _ in range(waiting):
            self.threads._submit(self.drain)

    def _deliver_soon(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed (shut down): nobody waits
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            done, self.done = self.done, []
        for future, result, error, orphan in done:
            if future.cancelled():  # the caller gave up (deadline): hand a late result over
                if error is None and orphan is not None:
                    orphan(result)
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


def is_async(method: Callable[..., Any]) -> bool:
    """Whether an env method (bound or not) is a coroutine function."""
    return _is_coroutine_function(getattr(method, "__func__", method))


@functools.lru_cache(maxsize=1024)
def _is_coroutine_function(fn: Callable[..., Any]) -> bool:
    # cached per function, never per bound method (that would keep envs alive); inspect per
    # call was ~10% of a trivial step's server time
    return inspect.iscoroutinefunction(fn)


async def call_env(threads: WorkerThreads, method: Callable[..., Any], *args: Any) -> Any:
    """Call an env method: awaited on the loop if async, else on a worker thread (then awaited
    if it returned an awaitable, as the `Env` protocol allows)."""
    if is_async(method):
        return await method(*args)
    result = await threads.run(method, *args)
    if inspect.isawaitable(result):
        return await result
    return result
