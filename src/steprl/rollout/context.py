"""Context rules: what the policy sees at the next turn, given the steps so far.

The full trajectory is always stored; a rule only decides the next prompt. Only the append-only
rule yields one packed training sequence per trajectory (each prompt extends the previous one);
the others are trained one sample per step (see `rollout.views`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from steprl.registry import Registry

#: (action_ids, observation_ids[, query]) for each finished step, oldest first; `query` is True
#: when the observation was a user turn rather than a tool result (what Qwen3's template keys
#: its reasoning stripping on); absent means a tool result.
History = Sequence[tuple[Any, ...]]


class ContextRule(Protocol):
    @property
    def append_only(self) -> bool:
        """True when every prompt extends the previous context (one packed sequence per trajectory)."""
        ...

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]: ...


def _join(initial: tuple[int, ...], pieces: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    out = list(initial)
    for p in pieces:
        out.extend(p)
    return tuple(out)


@dataclass(frozen=True)
class AppendOnly:
    """Everything stays: prompt_t = prompt_0 + a_0 + o_0 + ... + a_{t-1} + o_{t-1}."""

    append_only: bool = True

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]:
        return _join(initial, [piece for a, o, *_ in history for piece in (a, o)])


@dataclass(frozen=True)
class StripThinking:
    """Earlier reasoning removed, as Qwen3's template renders history: every action before the
    last user turn loses everything up to its last `</think>` and the newlines after it.

    Exact to the token: the rule cuts the sampled ids themselves (never re-tokenizes), so the
    prompt is what the engine is shown, and training follows it one row per turn (a later
    prompt no longer extends an earlier one). `close` is `</think>` as ids; `blank` the ids
    that decode to newlines only.
    """

    close: tuple[int, ...]
    blank: frozenset[int]
    append_only: bool = False

    def _stripped(self, action: tuple[int, ...]) -> tuple[int, ...]:
        n = len(self.close)
        ends = [i + n for i in range(len(action) - n + 1) if action[i : i + n] == self.close]
        if not ends:
            return action
        rest = action[ends[-1] :]
        cut = 0
        while cut < len(rest) and rest[cut] in self.blank:
            cut += 1
        return rest[cut:]

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]:
        queries = [i for i, item in enumerate(history) if len(item) > 2 and item[2]]
        last_query = queries[-1] if queries else -1
        pieces: list[tuple[int, ...]] = []
        for i, (a, o, *_) in enumerate(history):
            pieces += [self._stripped(a) if i <= last_query else a, o]
        return _join(initial, pieces)


@dataclass(frozen=True)
class KeepLastK:
    """The task prompt plus only the last k (action, observation) pairs (RAGEN-style window)."""

    k: int = 2
    append_only: bool = False

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]:
        recent = history[-self.k :] if self.k > 0 else []
        return _join(initial, [piece for a, o, *_ in recent for piece in (a, o)])


@dataclass(frozen=True)
class DropOldObservations:
    """All actions stay; observations older than the last k steps are dropped (tokens saved
    where observations are long, e.g. retrieved documents)."""

    k: int = 1
    append_only: bool = False

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]:
        cut = len(history) - self.k
        return _join(
            initial, [piece for i, (a, o, *_) in enumerate(history) for piece in (a, o if i >= cut else ())]
        )


class ThinkTokens(Protocol):
    """What `strip_thinking` needs of a prompt format: `</think>` and newline tokens as ids."""

    def think_close_ids(self) -> tuple[int, ...]: ...

    def newline_ids(self) -> frozenset[int]: ...


def _strip_thinking(k: int, fmt: ThinkTokens) -> ContextRule:
    return StripThinking(fmt.think_close_ids(), fmt.newline_ids())


#: name -> factory taking `k` (ignored where it means nothing) and the prompt format (whose ids
#: `strip_thinking` cuts at). The config picks one by name.
CONTEXT_RULES: Registry[Callable[[int, ThinkTokens], ContextRule]] = Registry(
    {
        "append_only": lambda k, fmt: AppendOnly(),
        "keep_thinking": lambda k, fmt: AppendOnly(),  # append-only: earlier <think> stays in context
        "strip_thinking": _strip_thinking,
        "keep_last_k": lambda k, fmt: KeepLastK(k),
        "drop_old_observations": lambda k, fmt: DropOldObservations(k),
    },
    key="rollout.context",
    what="context rule",
    accept=lambda obj: inspect.isfunction(obj) or isinstance(obj, type),
    expected="a context rule factory; name a function or class (k, fmt) -> ContextRule",
    checker=None,
    checked_by="check_context_rule, on rollouts of a random policy (tests/rollout/test_context_rules.py)",
)
