"""`MCPToolEnv`: the tools of any MCP server (over stdio) as an async steprl tool environment.

Each episode starts a fresh server and session (`mcp_session.MCPSession`), lists the server's
tools and exposes them as `MCPTool` objects; the system prompt lists them with their JSON
schemas (`tool_env.render_system_prompt`). The policy calls them in the JSON style,
``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``, and finishes with
``<answer>...</answer>``, which the verifier scores. The error channels of `base.py`:

* model errors become ``<error>...</error>`` observations with the usual format penalty or
  call cost: an unparseable action or unknown tool, arguments that break the tool's schema,
  arguments that are not valid UTF-8, a result with ``isError: true`` and a JSON-RPC
  ``Invalid params`` error from the server;
* a transport failure (the server died, a call timed out, any other JSON-RPC error) raises
  `MCPTransportError`, so the agent loop marks the trajectory `infra_failed`.

The session lives for one episode: `reset` closes the previous one and starts a fresh server,
so no state leaks between episodes; `close` shuts the subprocess down and is idempotent. Two
variants:

* a stateless server can be kept warm: with ``pool=`` (`mcp_pool.MCPPool`) `reset` borrows a
  live session and `close` (or the next `reset`) gives it back, so a server starts once per
  pool slot rather than once per episode;
* a stateful server gets fresh state through its arguments: ``{episode_dir}`` in the args, env
  values or cwd is replaced by a new temporary directory at `reset` (e.g. ``--db-path
  {episode_dir}/db.sqlite``), removed when the episode's server has shut down. It needs a fresh
  server per episode, so it cannot be combined with a pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import weakref
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, TextIO, cast

from steprl.envs.adapters.mcp_pool import MCPPool
from steprl.envs.adapters.mcp_session import MCPSession, run_in
from steprl.envs.base import Observation, ToolError, Transition, maybe_await
from steprl.envs.parsing import ActionSyntax, FinalAnswer, InvalidAction, ToolCall
from steprl.envs.parsing import stop_strings as make_stop_strings
from steprl.envs.rewards import RewardConfig, step_rewards
from steprl.envs.tool_env import ToolEpisode, check_arguments, clip_middle, render_system_prompt
from steprl.types import Task

if TYPE_CHECKING:
    from mcp import StdioServerParameters

logger = logging.getLogger(__name__)

#: (answer text, task) -> outcome in [0, 1]; may be async.
AsyncVerifier = Callable[[str, Task], float | Awaitable[float]]

_MAX_ERROR_CHARS = 160

#: Replaced, in a server's args, env values and cwd, by a fresh directory per episode.
EPISODE_DIR = "{episode_dir}"


@dataclass
class MCPTool:
    """One tool of an MCP server, with the `Tool` protocol's name, description and schema.

    Call it with ``await tool.acall(**arguments)`` from any event loop (a pooled session runs in
    its pool's loop: the call is relayed there); the sync ``tool(**arguments)`` works from any
    thread but the one running the session's loop (it blocks on that loop).
    Both return the result text, raise `ToolError` for an ``isError`` result or an
    ``Invalid params`` reply, and `MCPTransportError` for a transport failure.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    session: MCPSession = field(repr=False)

    async def acall(self, **kwargs: Any) -> str:
        return await run_in(self.session.loop, self.session.call(self.name, kwargs))

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
        errlog: where the server's stderr goes (default: a temporary file per session, whose
            tail goes into the message of a failed start).
        pool: borrow warm sessions from this pool (of the same `server`) instead of starting a
            server per episode; only for servers without per-episode state.
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
        pool: MCPPool | None = None,
    ) -> None:
        self._templated = _templated(server)
        if pool is not None and self._templated:
            raise ValueError(
                f"the MCP server's arguments use {EPISODE_DIR} (fresh state per episode), which needs a "
                "fresh server per episode; drop the pool (reuse: false) or the placeholder."
            )
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
        self.pool = pool
        self.episode_dir: str | None = None  # this episode's {episode_dir}, if the server uses one
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # Known before the server runs: JSON-style calls and the answer (what `check_env` reads).
        self.stop_strings: Sequence[str] = make_stop_strings((), json_calls=True)
        self.system_prompt: str = system_prompt or ""
        self.tools: Mapping[str, MCPTool] = {}
        self.skipped_tools: tuple[str, ...] = ()  # listed by the server but not exposed
        self.server_instructions: str | None = None
        self.syntax = ActionSyntax(json_tools=frozenset())
        self._session: MCPSession | None = None
        self._task: Task | None = None
        self._done = True
        self._broken = False
        self._invalid = 0
        self._turn = 0

    async def reset(self, task: Task, seed: int) -> Observation:
        """Start a fresh server and session for `task` (or borrow a warm one from the pool); the
        first observation is its prompt. `MCPStartError` if the server does not start.

        The previous episode's server shuts down while the new one starts (both take a while).
        """
        old, old_dir, old_broken = self._session, self.episode_dir, self._broken
        self._detach()
        if self.pool is not None:
            await self._drop(old, old_dir, old_broken)
            session = await self.pool.acquire()
            new_dir = None
        else:
            server, new_dir = self._episode_server()
            session = MCPSession(server, self.errlog, self.call_timeout_s)
            try:
                started, closed = await asyncio.gather(
                    session.start(self.startup_timeout_s),
                    self._drop(old, old_dir, old_broken),
                    return_exceptions=True,
                )
                for outcome in (started, closed):
                    if isinstance(outcome, BaseException):
                        raise outcome
            except BaseException:
                await session.aclose()
                _remove(new_dir)
                raise
        self._session, self.episode_dir = session, new_dir
        self._finalizer = weakref.finalize(self, _orphaned, self.pool, session, new_dir)
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
            else render_system_prompt(tools, self.syntax, instructions=self.instructions, schemas=True)
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
        """Shut the server down or give it back to the pool; safe to call any number of times."""
        session, episode_dir, broken = self._session, self.episode_dir, self._broken
        self._detach()
        await self._drop(session, episode_dir, broken)

    def _detach(self) -> None:
        """Forget the episode's session (the caller drops it) and its finalizer."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._session, self.episode_dir, self._finalizer = None, None, None
        self._task, self._done, self.tools = None, True, {}

    async def _drop(self, session: MCPSession | None, episode_dir: str | None, broken: bool) -> None:
        """Give `session` back to the pool (closed if `broken`) or shut it down; then remove its dir."""
        try:
            if session is not None and self.pool is not None:
                await self.pool.release(session, broken=broken)
            elif session is not None:
                await session.aclose()
        finally:
            _remove(episode_dir)

    def _episode_server(self) -> tuple[StdioServerParameters, str | None]:
        """The server to start for one episode, with {episode_dir} filled in (and that dir)."""
        if not self._templated:
            return self.server, None
        path = tempfile.mkdtemp(prefix="steprl-mcp-episode-")

        def fill(text: str) -> str:
            return text.replace(EPISODE_DIR, path)

        env, cwd = self.server.env, self.server.cwd
        server = self.server.model_copy(
            update={
                "args": [fill(a) for a in self.server.args],
                "env": {k: fill(v) for k, v in env.items()} if env is not None else None,
                "cwd": fill(str(cwd)) if cwd is not None else None,
            }
        )
        return server, path

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
                observation = f"<result>{clip_middle(out, self.max_observation_chars)}</result>"
                return self._transition(observation, rewards, kind="tool_call", tool=call.name, valid=True)
        error = clip_middle(error, _MAX_ERROR_CHARS)
        return self._transition(
            f"<error>{error}</error>", rewards, kind="tool_call", tool=call.name, valid=False, error=error
        )


def _templated(server: StdioServerParameters) -> bool:
    """Whether {episode_dir} appears in the server's args, env values or cwd."""
    texts = [*server.args, *(server.env or {}).values(), str(server.cwd or "")]
    return any(EPISODE_DIR in text for text in texts)


def _remove(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _orphaned(pool: MCPPool | None, session: MCPSession, episode_dir: str | None) -> None:
    """An env collected mid-episode (never closed): hand its pooled session back, remove its dir.

    (A session of its own ends with its event loop: ``asyncio.run`` cancels the session's task,
    and the SDK stops the server.)
    """
    if pool is not None:
        pool.release_soon(session, broken=True)  # state unknown: do not lend it again
    _remove(episode_dir)
