"""`MCPToolEnv`: the tools of any MCP server (over stdio) as an async steprl tool environment.

Each episode starts the server as a subprocess (``mcp.stdio_client``), opens a
``mcp.ClientSession``, lists the server's tools and exposes them as `MCPTool` objects; the
system prompt lists them with their JSON schemas. The policy calls them in the JSON style,
``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``, and finishes with
``<answer>...</answer>``, which the verifier scores. The error channels of `base.py`:

* model errors become ``<error>...</error>`` observations with the usual format penalty or
  call cost: an unparseable action or unknown tool, arguments that break the tool's schema,
  arguments that are not valid UTF-8, a result with ``isError: true`` and a JSON-RPC
  ``Invalid params`` error from the server;
* a transport failure (the server died, a call timed out, any other JSON-RPC error) raises
  `MCPTransportError`, so the agent loop marks the trajectory `infra_failed`.

The session lives for one episode: `reset` closes the previous one and starts a fresh server,
so no state leaks between episodes; `close` shuts the subprocess down (the SDK closes its
stdin, then terminates the process group) and is idempotent.

Why a task per session: anyio's cancel scopes (inside ``stdio_client`` and ``ClientSession``)
must be entered and exited by the same task, but `reset` and `close` may run in different
tasks and interleave with other envs' sessions; the session's task owns both context managers
and the env talks to the session from whichever task calls `step`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TextIO, cast

import mcp.types as mcp_types
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client

from steprl.envs.base import Observation, ToolError, Transition, maybe_await
from steprl.envs.parsing import ActionSyntax, FinalAnswer, InvalidAction, ToolCall
from steprl.envs.parsing import stop_strings as make_stop_strings
from steprl.envs.rewards import RewardConfig, step_rewards
from steprl.envs.tool_env import ToolEpisode, check_arguments
from steprl.types import Task

logger = logging.getLogger(__name__)

#: (answer text, task) -> outcome in [0, 1]; may be async.
AsyncVerifier = Callable[[str, Task], float | Awaitable[float]]

_MAX_ERROR_CHARS = 160


class MCPTransportError(RuntimeError):
    """The MCP server or its connection failed (not the model's fault): an infrastructure error."""


@dataclass
class MCPTool:
    """One tool of an MCP server, with the `Tool` protocol's name, description and schema.

    Call it with ``await tool.acall(**arguments)`` in the event loop that runs the session;
    the sync ``tool(**arguments)`` works from any *other* thread (it blocks on that loop).
    Both return the result text, raise `ToolError` for an ``isError`` result or an
    ``Invalid params`` reply, and `MCPTransportError` for a transport failure.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    session: _Session = field(repr=False)

    async def acall(self, **kwargs: Any) -> str:
        return await self.session.call(self.name, kwargs)

    def __call__(self, **kwargs: Any) -> str:
        loop = self.session.loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the normal case for the sync bridge
            running = None
        if running is loop:
            raise RuntimeError(
                f"MCPTool {self.name!r} called synchronously inside its event loop (it would deadlock); "
                "use `await tool.acall(...)` there, or call it from another thread."
            )
        return asyncio.run_coroutine_threadsafe(self.acall(**kwargs), loop).result()


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


class _Session:
    """One MCP client session, owned by its own task (see the module docstring)."""

    def __init__(self, server: StdioServerParameters, errlog: TextIO | None, call_timeout_s: float) -> None:
        self.server, self.errlog, self.call_timeout_s = server, errlog, call_timeout_s
        self.loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[tuple[ClientSession, mcp_types.InitializeResult, list[mcp_types.Tool]]]
        self._ready = self.loop.create_future()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.session: ClientSession | None = None
        self.init: mcp_types.InitializeResult | None = None
        self.tools: list[mcp_types.Tool] = []

    async def start(self, timeout_s: float) -> None:
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
                    stdio_client(self.server, errlog=errlog) as (read, write),
                    ClientSession(read, write) as session,
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
        if self.session is None:
            raise RuntimeError("the MCP session is not open; call reset(task, seed) first.")
        try:
            result = await self.session.call_tool(
                name, dict(arguments), read_timeout_seconds=self.call_timeout_s
            )
        except MCPError as exc:
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


async def _list_all_tools(session: ClientSession) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


def compact_schema(schema: Any) -> Any:
    """A JSON schema without pydantic's ``title`` noise (property names are kept)."""
    if isinstance(schema, list):
        return [compact_schema(v) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "properties" and isinstance(value, Mapping):
            out[key] = {name: compact_schema(sub) for name, sub in value.items()}
        else:
            out[key] = compact_schema(value)
    return out


def render_mcp_system_prompt(
    tools: Sequence[MCPTool],
    *,
    instructions: str = "",
    answer_tag: str = "answer",
    call_tag: str = "tool_call",
) -> str:
    """The tools with their argument schemas, how to call them, and how to answer."""
    lines = [instructions.strip()] if instructions.strip() else []
    lines.append("You can call tools. Tools (arguments as JSON schema):")
    for tool in tools:
        lines.append(f"- {tool.name}: {tool.description}".rstrip(": "))
        lines.append(f"  arguments: {json.dumps(compact_schema(tool.parameters), ensure_ascii=False)}")
    lines.append(f'Call one tool per turn: <{call_tag}>{{"name": ..., "arguments": {{...}}}}</{call_tag}>')
    lines.append("A result comes back as <result>...</result>, a mistake as <error>...</error>.")
    lines.append(f"Finish with <{answer_tag}>your answer</{answer_tag}>.")
    return "\n".join(lines)


def _shorten(text: str, limit: int) -> str:
    """Head and tail of `text` with an explicit marker, if it is longer than `limit`."""
    if len(text) <= limit:
        return text
    marker = f"...[{len(text) - limit} chars cut]..."
    head = max(0, (limit - len(marker)) // 2)
    return text[:head] + marker + text[len(text) - head :] if head else text[:limit]


def _usable(name: str) -> bool:
    """Whether the parser can take `name` as a JSON-style tool name."""
    try:
        ActionSyntax(json_tools=frozenset([name]))
    except ValueError:
        return False
    return True


def _utf8(arguments: Mapping[str, Any]) -> bool:
    """Whether `arguments` can be sent as UTF-8 JSON (a lone surrogate cannot, and would kill the pipe)."""
    try:
        json.dumps(dict(arguments), ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        return False
    return True


class MCPToolEnv(ToolEpisode):
    """Implements `Env` (async) for the tools of an MCP server (see the module docstring).

    Args:
        server: how to start the server (``StdioServerParameters(command=..., args=[...])``).
        verifier: (answer text, task) -> outcome in [0, 1]; may be async.
        instructions: opens the default system prompt (the task domain, the answer format).
        system_prompt: replaces the default prompt (which lists the tools after `reset`).
        include_tools: only these tools (default: all whose names the parser accepts).
        rewards: shaping terms (see `RewardConfig`).
        max_invalid_actions: invalid actions tolerated; one more ends the episode as a policy error.
        format_hint: appended to parse errors.
        max_observation_chars: tool results longer than this are cut (head + tail + marker).
        call_timeout_s / startup_timeout_s: a call or server start slower than this is a
            transport failure.
        errlog: where the server's stderr goes (default: ours if it is a file, else /dev/null).
    """

    def __init__(
        self,
        server: StdioServerParameters,
        verifier: AsyncVerifier,
        *,
        instructions: str = "",
        system_prompt: str | None = None,
        include_tools: Collection[str] | None = None,
        rewards: RewardConfig | None = None,
        max_invalid_actions: int = 3,
        format_hint: str | None = None,
        max_observation_chars: int = 2048,
        call_timeout_s: float = 30.0,
        startup_timeout_s: float = 30.0,
        errlog: TextIO | IO[str] | None = None,
    ) -> None:
        if max_invalid_actions < 0:
            raise ValueError(f"max_invalid_actions must be >= 0, got {max_invalid_actions}.")
        if max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be >= 1, got {max_observation_chars}.")
        if call_timeout_s <= 0 or startup_timeout_s <= 0:
            raise ValueError("call_timeout_s and startup_timeout_s must be > 0.")
        self.server = server
        self.verifier = verifier
        self.instructions = instructions
        self._fixed_prompt = system_prompt
        self.include_tools = frozenset(include_tools) if include_tools is not None else None
        self.rewards = rewards if rewards is not None else RewardConfig()
        self.max_invalid_actions = max_invalid_actions
        self.format_hint = format_hint
        self.max_observation_chars = max_observation_chars
        self.call_timeout_s, self.startup_timeout_s = call_timeout_s, startup_timeout_s
        self.errlog = cast(TextIO | None, errlog)
        # Known before the server runs: JSON-style calls and the answer (what `check_env` reads).
        self.stop_strings: Sequence[str] = make_stop_strings((), json_calls=True)
        self.system_prompt: str = system_prompt or ""
        self.tools: Mapping[str, MCPTool] = {}
        self.skipped_tools: tuple[str, ...] = ()  # listed by the server but not exposed
        self.server_instructions: str | None = None
        self.syntax = ActionSyntax(json_tools=frozenset())
        self._session: _Session | None = None
        self._task: Task | None = None
        self._done = True
        self._broken = False
        self._invalid = 0
        self._turn = 0

    async def reset(self, task: Task, seed: int) -> Observation:
        """Start a fresh server and session for `task`; the first observation is its prompt.

        The previous episode's server shuts down while the new one starts (both take a while).
        """
        old, self._session = self._session, None
        self._task, self._done, self.tools = None, True, {}
        session = _Session(self.server, self.errlog, self.call_timeout_s)
        started, closed = await asyncio.gather(
            session.start(self.startup_timeout_s),
            old.aclose() if old is not None else asyncio.sleep(0),
            return_exceptions=True,
        )
        for outcome in (started, closed):
            if isinstance(outcome, BaseException):
                await session.aclose()
                raise outcome
        self._session = session
        tools, skipped = [], []
        for listed in session.tools:
            wanted = self.include_tools is None or listed.name in self.include_tools
            if wanted and _usable(listed.name):
                tools.append(
                    MCPTool(listed.name, listed.description or "", dict(listed.input_schema), session)
                )
            else:
                skipped.append(listed.name)
                if wanted:
                    logger.warning("MCP tool %r skipped: its name is not a valid tool name", listed.name)
        self.tools = {t.name: t for t in tools}
        self.skipped_tools = tuple(skipped)
        self.server_instructions = session.init.instructions if session.init is not None else None
        self.syntax = ActionSyntax(json_tools=frozenset(self.tools))
        self.system_prompt = (
            self._fixed_prompt
            if self._fixed_prompt is not None
            else render_mcp_system_prompt(tools, instructions=self.instructions)
        )
        self._task, self._done, self._broken, self._invalid, self._turn = task, False, False, 0, 0
        return Observation(text=task.prompt, info={"task_id": task.id, "seed": seed})

    async def step(self, action: str) -> Transition:
        """Answer one action; raises `MCPTransportError` when the server or connection fails."""
        if self._task is None or self._done or self._broken:
            raise RuntimeError(
                "MCPToolEnv.step() called before reset(), after the episode ended, or after a transport "
                "failure; call reset(task, seed)."
            )
        self._turn += 1
        parsed = self.syntax.parse(action)
        if isinstance(parsed, InvalidAction):
            return self._invalid_action(parsed.reason)
        if isinstance(parsed, FinalAnswer):
            score = await maybe_await(self.verifier(parsed.text, self._task))
            self._done = True
            rewards = step_rewards("answer", self.rewards, outcome=score)
            return self._transition("", rewards, terminated=True, kind="answer")
        return await self._call(parsed)

    async def close(self) -> None:
        """Shut the server down (if running); safe to call any number of times."""
        session, self._session = self._session, None
        self._task, self._done, self.tools = None, True, {}
        if session is not None:
            await session.aclose()

    async def _call(self, call: ToolCall) -> Transition:
        tool = self.tools[call.name]
        rewards = step_rewards("tool_call", self.rewards)
        error = check_arguments(call.arguments, tool.parameters)
        if error is None and not _utf8(call.arguments):
            error = "arguments must be valid UTF-8 text"
        if error is None:
            try:
                out = await tool.acall(**call.arguments)
            except ToolError as exc:
                error = str(exc) or "tool error"
            except BaseException:
                self._broken = True
                raise
            else:
                observation = f"<result>{_shorten(out, self.max_observation_chars)}</result>"
                return self._transition(observation, rewards, kind="tool_call", tool=call.name, valid=True)
        error = _shorten(error, _MAX_ERROR_CHARS)
        return self._transition(
            f"<error>{error}</error>", rewards, kind="tool_call", tool=call.name, valid=False, error=error
        )
