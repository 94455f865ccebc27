"""`MCPPool`: warm sessions of one stateless MCP server, reused across episodes and event loops.

Starting an MCP server costs about a second (a Python interpreter and the SDK's imports), which
dwarfs a tool call. A server without per-episode state (a clock, a calculator, a read-only
search) can serve many episodes: the pool keeps at most `max_servers` sessions alive and lends
one to each episode (`acquire`); episodes beyond that wait for one to come back (`release`).

Why a thread of its own: a session is owned by a task in the event loop that started it (see
`mcp_session`), but the trainer runs each rollout step in a new loop (``asyncio.run`` per
step), which would strand every warm session when that loop closes. The pool's sessions live in
one background loop on a daemon thread, and callers in any loop reach them through
``asyncio.run_coroutine_threadsafe`` + ``asyncio.wrap_future`` (`mcp_session.run_in`).

Health: a session whose server died is discarded, never lent again: a lent-back session whose
episode saw a transport failure is closed, and an idle one is pinged before it is lent.

Cleanup: `close` (idempotent) shuts every server down; pools still open at interpreter exit
are closed by an ``atexit`` hook. If this process is killed outright, the servers see their
stdin close and exit (what stdio servers do; tests/envs/test_mcp_pool.py checks it). A forked
child never uses its parent's pools (`shared_pool` keys them by process id).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from steprl.envs.adapters.mcp_session import MCPSession, MCPTransportError

if TYPE_CHECKING:
    from mcp import StdioServerParameters

logger = logging.getLogger(__name__)

_PING_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 15.0  # the SDK gives a server 2 s to exit on EOF, then 2 s after SIGTERM


class MCPPool:
    """At most `max_servers` live sessions of `server`, lent to one episode at a time.

    `acquire` and `release` may be awaited from any event loop in any thread (not from the
    pool's own); the session they hand out belongs to the pool's loop (`session.loop`), so
    call its tools with `mcp_session.run_in` (`MCPTool.acall` does). `started` counts the
    servers started so far.
    """

    def __init__(
        self,
        server: StdioServerParameters,
        *,
        max_servers: int = 4,
        call_timeout_s: float = 30.0,
        startup_timeout_s: float = 30.0,
    ) -> None:
        if max_servers < 1:
            raise ValueError(f"max_servers must be >= 1, got {max_servers}.")
        self.server, self.max_servers = server, max_servers
        self.call_timeout_s, self.startup_timeout_s = call_timeout_s, startup_timeout_s
        self.started = 0
        self.closed = False
        self._pid = os.getpid()  # a forked child must not touch the parent's thread or servers
        self._idle: list[MCPSession] = []  # the pool loop's state: touched only in that loop
        self._lent: set[MCPSession] = set()
        self._starting: set[MCPSession] = set()
        self._live = 0  # idle + lent + starting
        self._loop = asyncio.new_event_loop()
        self._cond = asyncio.Condition()  # binds to the pool loop at first use
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"mcp-pool:{os.path.basename(server.command)}", daemon=True
        )
        self._thread.start()
        _OPEN.add(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def live(self) -> int:
        """Sessions alive now (idle, lent or starting)."""
        return self._live

    async def acquire(self) -> MCPSession:
        """A started session for one episode: a warm idle one, a new one, or (with `max_servers`
        lent) the next one released. `MCPStartError` if a new server does not start."""
        handoff: concurrent.futures.Future[MCPSession] = concurrent.futures.Future()
        self._submit(self._acquire_into(handoff))
        try:
            return await asyncio.wrap_future(handoff)
        except asyncio.CancelledError:
            # The session may be handed over after we stopped waiting: give it back then.
            handoff.add_done_callback(self._give_back_abandoned)
            raise

    async def release(self, session: MCPSession, *, broken: bool = False) -> None:
        """Take `session` back: reused unless `broken` (its episode saw a transport failure) or dead.

        Releasing a session twice, or after `close`, is a no-op.
        """
        if self.closed:
            return
        await asyncio.wrap_future(self._submit(self._release(session, broken)))

    def release_soon(self, session: MCPSession, *, broken: bool = False) -> None:
        """`release` without waiting, from any thread or none (e.g. a finalizer)."""
        if not self.closed:
            with contextlib.suppress(MCPTransportError):  # closed meanwhile: `close` shut it down
                self._submit(self._release(session, broken))

    def close(self) -> None:
        """Shut every server down and stop the pool's thread; idempotent, and called at exit.

        Blocks (a few seconds at most); do not call it from the pool's own thread. Episodes
        still holding a session get `MCPTransportError` at their next call.
        """
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            if os.getpid() != self._pid:
                return  # a forked child: the thread and the servers are the parent's
            if threading.current_thread() is self._thread:
                raise RuntimeError("MCPPool.close() called from the pool's own thread; call it from another.")
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(_CLOSE_TIMEOUT_S)
            except Exception as exc:  # a server that will not die: the SDK has already tried SIGKILL
                logger.warning("closing the MCP pool for %r: %r", self.server.command, exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_CLOSE_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()
            _OPEN.discard(self)

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError as exc:  # the loop is closed
            coro.close()
            raise MCPTransportError(f"the MCP pool for {self.server.command!r} is closed") from exc

    def _give_back_abandoned(self, handoff: concurrent.futures.Future[MCPSession]) -> None:
        if not handoff.cancelled() and handoff.exception() is None:
            self.release_soon(handoff.result())

    # --- in the pool's loop -----------------------------------------------------------------------

    async def _acquire_into(self, handoff: concurrent.futures.Future[MCPSession]) -> None:
        try:
            session = await self._acquire()
        except BaseException as exc:
            if handoff.set_running_or_notify_cancel():
                handoff.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if handoff.set_running_or_notify_cancel():
            handoff.set_result(session)
        else:  # the caller stopped waiting before we got here
            await self._release(session, broken=False)

    async def _acquire(self) -> MCPSession:
        while True:
            async with self._cond:
                await self._cond.wait_for(
                    lambda: self.closed or bool(self._idle) or self._live < self.max_servers
                )
                if self.closed:
                    raise MCPTransportError(f"the MCP pool for {self.server.command!r} is closed")
                warm = self._idle.pop() if self._idle else None  # LIFO: the most recently used
                if warm is None:
                    self._live += 1  # a slot for the server we start below
            if warm is None:
                session = MCPSession(self.server, None, self.call_timeout_s)
                self._starting.add(session)  # `close` stops a server that is still starting too
                try:
                    await session.start(self.startup_timeout_s)
                except BaseException:
                    await self._forget()
                    raise
                finally:
                    self._starting.discard(session)
                self.started += 1
                if self.closed:  # closed while it started: never lend it out
                    await self._discard(session)
                    raise MCPTransportError(f"the MCP pool for {self.server.command!r} is closed")
                self._lent.add(session)
                return session
            if await warm.ping(min(_PING_TIMEOUT_S, self.call_timeout_s)):
                self._lent.add(warm)
                return warm
            logger.info("a warm MCP server %r stopped answering; starting another", self.server.command)
            await self._discard(warm)

    async def _release(self, session: MCPSession, broken: bool) -> None:
        if session not in self._lent:
            return  # released twice, or never ours
        self._lent.discard(session)
        if broken or self.closed or not session.alive:
            await self._discard(session)
            return
        session.trim_stderr()
        async with self._cond:
            self._idle.append(session)
            self._cond.notify()

    async def _discard(self, session: MCPSession) -> None:
        try:
            await session.aclose()
        finally:
            await self._forget()

    async def _forget(self) -> None:
        async with self._cond:
            self._live -= 1
            self._cond.notify()

    async def _shutdown(self) -> None:
        async with self._cond:
            self._cond.notify_all()  # waiters see `closed` and fail
        sessions, self._idle = [*self._idle, *self._lent], []
        self._lent.clear()
        starting = list(self._starting)  # their `_acquire` forgets their slots when start fails
        await asyncio.gather(
            *(s.aclose() for s in sessions),
            *(s.aclose(cancel=True) for s in starting),
            return_exceptions=True,
        )
        self._live -= len(sessions)


#: Pools not yet closed (closed at interpreter exit).
_OPEN: weakref.WeakSet[MCPPool] = weakref.WeakSet()
_SHARED: dict[str, MCPPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(
    server: StdioServerParameters, *, max_servers: int, call_timeout_s: float, startup_timeout_s: float
) -> MCPPool:
    """The process's one open pool for these settings (made on first use), so every env instance
    of a spec (and the `check_env` replay instance) draws from the same warm servers."""
    key = json.dumps(
        [os.getpid(), server.model_dump(mode="json"), max_servers, call_timeout_s, startup_timeout_s],
        sort_keys=True,
    )
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None or pool.closed:
            pool = MCPPool(
                server,
                max_servers=max_servers,
                call_timeout_s=call_timeout_s,
                startup_timeout_s=startup_timeout_s,
            )
            _SHARED[key] = pool
        return pool


def close_pools() -> None:
    """Close every open pool of this process (idempotent; also run at interpreter exit)."""
    with _SHARED_LOCK:
        # strong references first: a pool only `_SHARED` held would leave the weak set (and
        # never be closed) the moment `_SHARED` lets go of it
        pools = {*_SHARED.values(), *_OPEN}
        _SHARED.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)
