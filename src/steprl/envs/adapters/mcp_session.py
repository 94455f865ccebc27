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
`ToolError` (the model's fault); a transport failure (the server died, a call or the start timed
out, any other JSON-RPC error) raises `MCPTransportError` (infrastructure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO, cast

from steprl.envs.base import ToolError
from steprl.extras import require

if TYPE_CHECKING:
    import mcp
    import mcp.types as mcp_types
else:
    mcp = require("mcp", extra="mcp", feature="the MCP adapter")
    mcp_types = require("mcp.types", extra="mcp", feature="the MCP adapter")

logger = logging.getLogger(__name__)


class MCPTransportError(RuntimeError):
    """The MCP server or its connection failed (not the model's fault): an infrastructure error."""


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

    async def start(self, timeout_s: float) -> None:
        """Start the server and the session; `MCPTransportError` if that fails or takes too long."""
        self._task = asyncio.create_task(self._own(), name=f"mcp-session:{self.server.command}")
        try:
            self.session, self.init, self.tools = await asyncio.wait_for(
                asyncio.shield(self._ready), timeout_s
            )
        except BaseException as exc:
            await self.aclose(cancel=True)
            if isinstance(exc, TimeoutError):
                raise MCPTransportError(
                    f"MCP server {self.server.command!r} did not start within {timeout_s}s; check the "
                    "command, or raise startup_timeout_s."
                ) from exc
            if isinstance(exc, Exception) and not isinstance(exc, MCPTransportError):
                raise MCPTransportError(
                    f"could not start MCP server {self.server.command!r} {self.server.args}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            raise

    async def _own(self) -> None:
        try:
            with contextlib.ExitStack() as files:
                errlog = self.errlog if self.errlog is not None else _default_errlog(files)
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
                "died, hung past call_timeout_s, or broke the protocol."
            ) from exc
        text = result_text(result)
        if result.is_error:
            raise ToolError(text or "tool error")
        return text

    async def aclose(self, *, cancel: bool = False) -> None:
        """Stop the session's task (which shuts the server down); idempotent.

        `cancel` interrupts a session still starting up (the SDK still stops the process).
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


def _default_errlog(files: contextlib.ExitStack) -> TextIO:
    """The server's stderr: ours when it is a real file, else /dev/null (e.g. under capture)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return cast(TextIO, files.enter_context(open(os.devnull, "w")))
    return sys.stderr


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
