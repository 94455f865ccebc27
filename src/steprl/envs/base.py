"""The environment interface: `Env` (reset/step/close, sync or async), `Tool`, and their records.

An env answers one action (the text the policy generated this turn) with a `Transition`.
Authors may write `reset`/`step`/`close` as plain or `async` methods; the agent loop awaits
either. Two error channels, kept apart on purpose:

* a *model* error (malformed call, bad tool arguments) is an observation the model sees:
  tools raise `ToolError`, `ToolEnv` turns it into text;
* any other exception is an *infrastructure* failure: the loop marks the trajectory
  `infra_failed`, which is counted and never trained on.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from steprl.errors import UserError
from steprl.types import Task

_EMPTY: Mapping[str, Any] = MappingProxyType({})
#: An env's `tools` when it has none (the default of `Env.tools`).
NO_TOOLS: Mapping[str, ToolSpec] = _EMPTY
T = TypeVar("T")


@dataclass(frozen=True)
class Observation:
    """What the policy sees at the start of an episode (the rendered task)."""

    text: str
    info: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class Transition:
    """The env's answer to one action.

    `observation` is appended to the context (empty when the episode is over). `info` carries
    `reward_components` (name -> value, summing to `reward`), `action_kind`
    ("tool_call" | "answer" | "invalid"), `tool_call_valid` and, for invalid actions, `error`.
    """

    observation: str
    reward: float
    terminated: bool
    truncated: bool = False
    info: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


class ToolSpec(Protocol):
    """What a prompt shows of a tool: its name, description and JSON schema of arguments. Every
    `Tool` is one; a remote env's tools are `ToolInfo` records (the call stays with the env)."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class ToolInfo:
    """A `ToolSpec` as data: how the HTTP and Ray backends carry an env's tools to the loop."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


@runtime_checkable
class Env(Protocol):
    """One episode at a time. Methods may be sync or async (the loop awaits either).

    The core reads these members. `system_prompt` is the policy's instructions (the tools, the
    action syntax); whether it enters the first prompt is the prompt format's choice
    (`rollout/chat.py`). `stop_strings` are where the engine stops generating (e.g. a tool call's
    close tag), so the env sees one action per turn; none means EOS or the token budget.
    `tools` (name -> `ToolSpec`, read after `reset`: an MCP env lists them then) reach a chat
    template's native tool block (e.g. Qwen3's `<tools>`); the plain format ignores them.

    Subclass `Env` (``class MyEnv(Env):``) and all three default to none (`""`, `()`, `{}`):
    set them as class or instance attributes. A class that does not subclass it must define
    `system_prompt` and `stop_strings`; without `tools` it has none (`env_tools`). A read-only
    property satisfies them too (remote envs learn them when the instance is made or reset), and
    every wrapper of an env (pool, HTTP, Ray, demos) must forward all three (`EnvWrapper` does).
    """

    if TYPE_CHECKING:  # the core only reads them: a property is as good as an attribute

        @property
        def system_prompt(self) -> str: ...

        @property
        def stop_strings(self) -> Sequence[str]: ...

        @property
        def tools(self) -> Mapping[str, ToolSpec]:  # a body: not abstract in a subclass
            return NO_TOOLS

    else:  # plain class attributes, so a subclass may assign them in __init__
        system_prompt: str = ""
        stop_strings: Sequence[str] = ()
        tools: Mapping[str, ToolSpec] = NO_TOOLS

    def reset(self, task: Task, seed: int) -> Observation | Awaitable[Observation]: ...

    def step(self, action: str) -> Transition | Awaitable[Transition]: ...

    def close(self) -> None | Awaitable[None]: ...


class IncompleteEnv(UserError, TypeError):
    """An env factory built an object that lacks a member of `Env` (found before any episode)."""


#: What every env must have (the members of `Env` without a default for every class: `tools` has one).
ENV_MEMBERS = ("system_prompt", "stop_strings", "reset", "step", "close")


def env_tools(env: Env) -> Mapping[str, ToolSpec]:
    """`env.tools`, or none for a class that does not subclass `Env` and defines no `tools` (the
    protocol's default reaches subclasses only). Wrappers forward `tools` themselves: the type
    checker holds them to the protocol, so a wrapper that drops them fails `mypy`."""
    tools: Mapping[str, ToolSpec] | Sequence[ToolSpec] | None = getattr(env, "tools", None)
    if not tools:
        return _EMPTY
    if isinstance(tools, Mapping):
        return tools
    return {t.name: t for t in tools}  # a list of tools is read as the mapping it names


class EnvWrapper:
    """Wraps one env (`self.env`) and forwards the members the core reads, as it reads them:
    `system_prompt` and `stop_strings` as they are (a missing one stays missing), `tools` through
    `env_tools` (none where the env has none). A wrapper subclasses this and adds its calls
    (`reset`/`step`/`close`); one that makes its env later (the pool, in `reset`) overrides
    `wrapped`. Read on every access, never copied: a remote or MCP env learns them in `reset`."""

    def __init__(self, env: Env) -> None:
        self.env = env

    def wrapped(self) -> Env:
        """The env whose members this one forwards."""
        return self.env

    @property
    def system_prompt(self) -> str:
        return self.wrapped().system_prompt

    @property
    def stop_strings(self) -> Sequence[str]:
        return self.wrapped().stop_strings

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return env_tools(self.wrapped())


def tool_infos(env: Env) -> tuple[ToolInfo, ...]:
    """The env's tools as records (what a remote backend sends): no call, no session."""
    return tuple(ToolInfo(t.name, t.description, dict(t.parameters)) for t in env_tools(env).values())


def missing_members(env: object) -> str | None:
    """None when `env` has every member the core reads; else what to fix, in one sentence."""
    missing = [m for m in ENV_MEMBERS if not hasattr(env, m)]
    if not missing:
        return None
    return (
        f"{type(env).__name__} lacks {', '.join(missing)}; subclass steprl.envs.base.Env (it gives "
        "system_prompt and stop_strings their defaults) or define them"
    )


class ToolError(Exception):
    """Raised by a tool for a *model* error (bad arguments); shown to the model, never fatal."""


class InfraError(Exception):
    """An environment's infrastructure failed (server gone, worker died, protocol violated).

    Any exception from an env ends the trajectory `infra_failed`; raise this one (or a subclass)
    to say so explicitly. Its text goes to the trajectory's `info`, never into the model's context.
    """


class EnvTimeout(InfraError):
    """An env call passed its deadline. The loop ends the trajectory `env_timeout` (not trained on)."""


@runtime_checkable
class Tool(Protocol):
    """An atomic action: a name, a description, a JSON-schema of arguments, and a call."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the keyword arguments

    def __call__(self, **kwargs: Any) -> str: ...


async def maybe_await(value: T | Awaitable[T]) -> T:
    """Await `value` if the env method was async; return it as is otherwise."""
    if inspect.isawaitable(value):
        return await value
    return value
