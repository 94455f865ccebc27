"""`MCPSession`: the lifecycle of one MCP client session over stdio (start, call, stop).

Starting a session spawns the server as a subprocess (``mcp.stdio_client``), opens a
``mcp.ClientSession``, initializes it and lists the server's tools (all pages); stopping it
shuts the subprocess down (the SDK closes its stdin, then terminates the process group). The
env side (`mcp_env.py`) uses one session per episode.

Why a task per session: anyio's cancel scopes (inside ``stdio_client`` and ``ClientSession``)
must be entered and exited by the same task, but the env's `reset` and `close` may run in
different tasks and interleave with other envs' sessions; the session's own task owns both
context managers, and callers talk to the session from whichever task they run in.

Errors: a call the server refuses as ``Invalid params`` or answers with ``isError: true`` raises
`ToolError` (the model's fault); a transport failure (the server died, a call timed out, any
other JSON-RPC error) raises `MCPTransportError` (infrastructure). A server that does not come
up raises `MCPStartError`, which is both an `MCPTransportError` and a `UserError` (usually a bad
command, flag or install: the CLI prints it as one line). Its message names the command and
ends with the tail of the server's stderr: the server's stderr goes to a temporary file (one per
session, unless the caller passes `errlog`), because the SDK's own error for a server that exits
during the handshake is an exception group around "Connection closed", which says nothing.

`run_in(loop, coro)` awaits a coroutine on another thread's event loop: how a session that lives
in `mcp_pool.MCPPool`'s loop is called from the trainer's (a new one each `asyncio.run`).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shlex
import tempfile
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TextIO, TypeVar, cast

from steprl.envs.base import ToolError
from steprl.errors import UserError
from steprl.extras import require

if TYPE_CHECKING:
    import mcp
    import mcp.types as mcp_types
else:
    mcp = require("mcp", extra="mcp", feature="the MCP adapter")
    mcp_types = require("mcp.types", extra="mcp", feature="the MCP adapter")

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STDERR_TAIL_LINES = 10
_STDERR_KEEP_BYTES = 1 << 20  # a kept-warm server's stderr file is emptied past this (`trim_stderr`)


class MCPTransportError(RuntimeError):
    """The MCP server or its connection failed (not the model's fault): an infrastructure error."""


class MCPStartError(MCPTransportError, UserError):
    """The MCP server did not start; the message has its command line and the tail of its stderr."""


def result_text(result: mcp_types.CallToolResult) -> str:
    """The text of a tool result: its text blocks, placeholders for binary ones, or the structured content."""
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource):
            resource = block.resource
            text = resource.text if isinstance(resource, mcp_types.TextResourceContents) else None
            parts.append(text if text is not None else f"[binary resource {resource.uri}]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{block.type} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return "\n".join(parts)


class MCPSession:
    """One MCP client session, owned by its own task (see the module docstring).

    Create it inside the event loop that will run it (`loop` is that loop), then `await start`;
    after that `init` and `tools` hold what the server announced. `aclose` is idempotent.
    """

    def __init__(
        self, server: mcp.StdioServerParameters, errlog: TextIO | None, call_timeout_s: float
    ) -> None:
        self.server, self.errlog, self.call_timeout_s = server, errlog, call_timeout_s
        self.loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[
            tuple[mcp.ClientSession, mcp_types.InitializeResult, list[mcp_types.Tool]]
        ]
        self._ready = self.loop.create_future()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.session: mcp.ClientSession | None = None
        self.init: mcp_types.InitializeResult | None = None
        self.tools: list[mcp_types.Tool] = []
        self._stderr: TextIO | None = _capture_file() if errlog is None else None

    @property
    def command_line(self) -> str:
        """The server's command line, as a shell would show it (for messages)."""
        return shlex.join([self.server.command, *self.server.args])

    @property
    def alive(self) -> bool:
        """Whether the session is open and its task still runs (a dead server's task ends, or
        its next request fails: `ping` finds out)."""
        return self.session is not None and self._task is not None and not self._task.done()

    def stderr_tail(self, lines: int = _STDERR_TAIL_LINES) -> str:
        """The last `lines` lines the server wrote to stderr ("" if none, or if `errlog` was given)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        data = os.pread(fd, 16384, max(0, size - 16384))  # pread: the server's offset stays put
        return "\n".join(data.decode("utf-8", "replace").strip().splitlines()[-lines:])

    def trim_stderr(self) -> None:
        """Empty the stderr file once it passes 1 MiB (for servers kept warm for many episodes).

        Safe while the server writes: the file is in append mode, so its next write lands at
        the new end rather than leaving a hole.
        """
        if self._stderr is not None and not self._stderr.closed:
            fd = self._stderr.fileno()
            if os.fstat(fd).st_size > _STDERR_KEEP_BYTES:
                os.ftruncate(fd, 0)

    async def ping(self, timeout_s: float) -> bool:
        """Whether the server answers a ping within `timeout_s` (a kept-warm server may have died)."""
        if not self.alive or self.session is None:
            return False
        try:
            await asyncio.wait_for(self.session.send_ping(), timeout_s)
        except Exception:  # a closed connection, a timeout or an error reply: not usable
            return False
        return True

    async def start(self, timeout_s: float) -> None:
        """Start the server and the session; `MCPTransportError` if that fails or takes too long."""
        self._task = asyncio.create_task(self._own(), name=f"mcp-session:{self.server.command}")
        try:
            self.session, self.init, self.tools = await asyncio.wait_for(
                asyncio.shield(self._ready), timeout_s
            )
        except BaseException as exc:
            await self.aclose(cancel=True, keep_stderr=True)
            try:
                if isinstance(exc, TimeoutError):
                    raise MCPStartError(
                        f"MCP server `{self.command_line}` did not start within {timeout_s}s; check the "
                        f"command, or raise startup_timeout_s. {self._stderr_sentence()}"
                    ) from exc
                if isinstance(exc, Exception) and not isinstance(exc, MCPTransportError):
                    raise MCPStartError(
                        f"could not start MCP server `{self.command_line}`: {_describe(exc)}. "
                        f"{self._stderr_sentence()} Run the command in a shell to see why; a server built "
                        "for another mcp version can run from its own venv (give the absolute path of "
                        "its executable as the command)."
                    ) from exc
                raise
            finally:
                self._close_stderr()

    def _stderr_sentence(self) -> str:
        if self._stderr is None:  # the caller's errlog: the output went there
            return ""
        tail = " | ".join(self.stderr_tail().splitlines())
        return f"Its stderr ended with: {tail.rstrip('.')}." if tail else "It wrote nothing to stderr."

    def _close_stderr(self) -> None:
        if self._stderr is not None:
            self._stderr.close()

    async def _own(self) -> None:
        errlog = self.errlog if self.errlog is not None else cast(TextIO, self._stderr)
        try:
            async with (
                mcp.stdio_client(self.server, errlog=errlog) as (read, write),
                mcp.ClientSession(read, write) as session,
            ):
                init = await session.initialize()
                tools = await _list_all_tools(session)
                self._ready.set_result((session, init, tools))
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc if isinstance(exc, Exception) else MCPTransportError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
            logger.debug("MCP session for %r ended with %r", self.server.command, exc)

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The result text of tool `name`; `ToolError` or `MCPTransportError` (module docstring)."""
        if self.session is None:
            raise RuntimeError("the MCP session is not open; call reset(task, seed) first.")
        try:
            result = await self.session.call_tool(
                name, dict(arguments), read_timeout_seconds=self.call_timeout_s
            )
        except mcp.MCPError as exc:
            if exc.code == mcp_types.INVALID_PARAMS:  # the server refused the model's arguments
                raise ToolError(exc.message or "invalid arguments") from exc
            raise MCPTransportError(
                f"MCP call {name!r} failed: {exc.message} (JSON-RPC code {exc.code}); the server "
                f"died, hung past call_timeout_s, or broke the protocol. {self._stderr_sentence()}"
            ) from exc
        text = result_text(result)
        if result.is_error:
            raise ToolError(text or "tool error")
        return text

    async def aclose(self, *, cancel: bool = False, keep_stderr: bool = False) -> None:
        """Stop the session's task (which shuts the server down); idempotent.

        `cancel` interrupts a session still starting up (the SDK still stops the process);
        `keep_stderr` keeps the stderr file open (for the message of a failed start).
        """
        self._stop.set()
        task, self._task, self.session = self._task, None, None
        if task is not None and not task.done():
            if cancel:
                task.cancel()
            try:
                await asyncio.shield(task)  # a cancelled caller must not cancel the shutdown
            except asyncio.CancelledError:
                if not (task.done() and task.cancelled()):
                    raise  # our caller was cancelled, not (only) the session's task
        if not self._ready.done():
            self._ready.cancel()
        elif not self._ready.cancelled():
            self._ready.exception()  # mark a startup failure as retrieved (no GC warning)
        if not keep_stderr:
            self._close_stderr()


def _capture_file() -> TextIO:
    """An anonymous temporary file in append mode, for a server's stderr (see `trim_stderr`)."""
    f = tempfile.TemporaryFile(  # noqa: SIM115 (the session closes it, in aclose)
        "w+", encoding="utf-8", errors="replace", prefix="steprl-mcp-stderr-"
    )
    flags = fcntl.fcntl(f.fileno(), fcntl.F_GETFL)
    fcntl.fcntl(f.fileno(), fcntl.F_SETFL, flags | os.O_APPEND)
    return cast(TextIO, f)


def _describe(exc: BaseException) -> str:
    """`exc` as one line, through the exception groups of anyio's task groups to the first real error."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or list(exc.exceptions))[0]
    if isinstance(exc, mcp.MCPError) and exc.message == "Connection closed":
        return "the server closed the connection before the MCP handshake finished (it exited?)"
    text = str(exc).strip().replace("\n", " | ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def run_in(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` on `loop`, which runs in another thread (or is the running loop).

    Cancelling the caller cancels `coro` there. A closed loop (e.g. a closed `MCPPool`) is an
    `MCPTransportError`.
    """
    if asyncio.get_running_loop() is loop:
        return await coro
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError as exc:  # the loop is closed
        coro.close()
        raise MCPTransportError(
            f"the MCP session's event loop is closed ({exc}); was its pool closed?"
        ) from exc
    return await asyncio.wrap_future(future)


async def _list_all_tools(session: mcp.ClientSession) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
