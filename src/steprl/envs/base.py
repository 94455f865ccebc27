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


@runtime_checkable
class Env(Protocol):
    """One episode at a time. Methods may be sync or async (the loop awaits either).

    The core reads exactly these five members. `system_prompt` is the policy's instructions (the
    tools, the action syntax); whether it enters the first prompt is the prompt format's choice
    (`rollout/chat.py`). `stop_strings` are where the engine stops generating (e.g. a tool call's
    close tag), so the env sees one action per turn; none means EOS or the token budget.

    Subclass `Env` (``class MyEnv(Env):``) and both default to none (`""`, `()`): set them as
    class or instance attributes. A class that does not subclass it must define them. A
    read-only property satisfies them too (remote envs learn them when the instance is made).
    """

    if TYPE_CHECKING:  # the core only reads them: a property is as good as an attribute

        @property
        def system_prompt(self) -> str: ...

        @property
        def stop_strings(self) -> Sequence[str]: ...

    else:  # plain class attributes, so a subclass may assign them in __init__
        system_prompt: str = ""
        stop_strings: Sequence[str] = ()

    def reset(self, task: Task, seed: int) -> Observation | Awaitable[Observation]: ...

    def step(self, action: str) -> Transition | Awaitable[Transition]: ...

    def close(self) -> None | Awaitable[None]: ...


class IncompleteEnv(UserError, TypeError):
    """An env factory built an object that lacks a member of `Env` (found before any episode)."""


#: What the core reads of every env (the members of `Env`).
ENV_MEMBERS = ("system_prompt", "stop_strings", "reset", "step", "close")


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
