"""Context rules: what the policy sees at the next turn, given the steps so far.

The full trajectory is always stored; a rule only decides the next prompt. Only the append-only
rule yields one packed training sequence per trajectory (each prompt extends the previous one);
the others are trained one sample per step (see `rollout.views`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

#: (action_ids, observation_ids) for each finished step, oldest first
History = Sequence[tuple[tuple[int, ...], tuple[int, ...]]]


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
        return _join(initial, [piece for a, o in history for piece in (a, o)])


@dataclass(frozen=True)
class KeepLastK:
    """The task prompt plus only the last k (action, observation) pairs (RAGEN-style window)."""

    k: int = 2
    append_only: bool = False

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]:
        recent = history[-self.k :] if self.k > 0 else []
        return _join(initial, [piece for a, o in recent for piece in (a, o)])


@dataclass(frozen=True)
class DropOldObservations:
    """All actions stay; observations older than the last k steps are dropped (tokens saved
    where observations are long, e.g. retrieved documents)."""

    k: int = 1
    append_only: bool = False

    def next_prompt(self, initial: tuple[int, ...], history: History) -> tuple[int, ...]:
        cut = len(history) - self.k
        return _join(
            initial, [piece for i, (a, o) in enumerate(history) for piece in (a, o if i >= cut else ())]
        )


#: name -> factory taking `k` (ignored by append_only). The config picks one by name.
CONTEXT_RULES: dict[str, Callable[[int], ContextRule]] = {
    "append_only": lambda k: AppendOnly(),
    "keep_last_k": lambda k: KeepLastK(k),
    "drop_old_observations": lambda k: DropOldObservations(k),
}
