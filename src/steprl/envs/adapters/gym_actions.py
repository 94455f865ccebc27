"""Action codecs for `GymnasiumEnv`: the body of the action tag <-> a Gymnasium action.

A codec is a parser (body text -> env action, raising `ValueError` with a short reason the
policy sees) and a formatter (env action -> body text, for scripted policies), plus a short
description of the expected form for the system prompt. `action_codec` picks the default for
a space (`DiscreteActions` for ``Discrete``, the text itself for ``Text``) or takes the hooks
a user passes for any other space. ``MultiDiscrete`` actions are integers separated by spaces
or commas (``1 2`` or ``1,2``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from steprl.extras import require

if TYPE_CHECKING:
    from gymnasium import spaces
else:
    spaces = require("gymnasium.spaces", extra="gym", feature="the Gymnasium adapter")

#: Body of the action tag -> env action; raise `ValueError` with a short reason if invalid.
ActionParser = Callable[[str], Any]
#: Env action -> body of the action tag (the inverse of the parser, for scripted policies).
ActionFormatter = Callable[[Any], str]

MAX_ERROR_CHARS = 160  # error texts are observations: keep them short for small models
_INTEGER = re.compile(r"-?[0-9]{1,18}")
_SEPARATORS = re.compile(r"[\s,]+")


def shorten(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters (ending in "...")."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class DiscreteActions:
    """The default action protocol of a ``Discrete(n, start)`` space: an integer or a name."""

    def __init__(self, space: spaces.Discrete, names: Sequence[str] | None = None) -> None:
        self.start, self.n = int(space.start), int(space.n)
        self.names = tuple(names) if names is not None else None
        if self.names is not None:
            if len(self.names) != self.n:
                raise ValueError(
                    f"action_names has {len(self.names)} names for a Discrete({self.n}) space; give "
                    "exactly one name per action, in action order."
                )
            lowered = [name.strip().lower() for name in self.names]
            if len(set(lowered)) != self.n or not all(lowered):
                raise ValueError(f"action_names {list(self.names)} must be non-empty and distinct.")
            self._by_name = {name: self.start + i for i, name in enumerate(lowered)}

    def parse(self, text: str) -> int:
        body = text.strip()
        if self.names is not None and body.lower() in self._by_name:
            return self._by_name[body.lower()]
        value = int(body) if _INTEGER.fullmatch(body) else None
        if value is not None and self.start <= value < self.start + self.n:
            return value
        raise ValueError(f"unknown action {shorten(body, 24)!r}; use {self.describe()}")

    def format(self, action: Any) -> str:
        index = int(action)
        return self.names[index - self.start] if self.names is not None else str(index)

    def describe(self) -> str:
        if self.names is not None:
            return "one of " + ", ".join(self.names)
        return f"an integer from {self.start} to {self.start + self.n - 1}"


class MultiDiscreteActions:
    """The default action protocol of a one-dimensional ``MultiDiscrete(nvec, start)`` space."""

    def __init__(self, space: spaces.MultiDiscrete) -> None:
        if len(space.shape) != 1:
            raise ValueError(
                f"no default action parser for {space} (more than one dimension); pass action_parser."
            )
        self.space = space
        self.lows = [int(v) for v in space.start]
        self.highs = [int(lo) + int(n) - 1 for lo, n in zip(space.start, space.nvec, strict=True)]

    def parse(self, text: str) -> Any:
        body = text.strip().strip("[]()").strip()
        parts = [p for p in _SEPARATORS.split(body) if p]
        if len(parts) != len(self.lows) or not all(_INTEGER.fullmatch(p) for p in parts):
            raise ValueError(f"action {shorten(body, 24)!r} is not {self.describe()}")
        values = [int(p) for p in parts]
        for i, (v, lo, hi) in enumerate(zip(values, self.lows, self.highs, strict=True)):
            if not lo <= v <= hi:
                raise ValueError(f"value {i + 1} is {v}, outside {lo}..{hi}")
        return np.array(values, dtype=self.space.dtype)

    def format(self, action: Any) -> str:
        return " ".join(str(int(v)) for v in action)

    def describe(self) -> str:
        ranges = ", ".join(f"{lo}..{hi}" for lo, hi in zip(self.lows, self.highs, strict=True))
        return f"{len(self.lows)} integers separated by spaces (ranges {ranges})"


def _text_parser(space: spaces.Text) -> ActionParser:
    def parse(text: str) -> str:
        body = text.strip()
        if not space.contains(body):
            raise ValueError(f"action must be {space.min_length}-{space.max_length} allowed characters")
        return body

    return parse


def action_codec(
    space: spaces.Space[Any],
    names: Sequence[str] | None,
    parser: ActionParser | None,
    formatter: ActionFormatter | None,
) -> tuple[ActionParser, ActionFormatter, str]:
    """(parser, formatter, description) for `space`: the defaults, or the hooks given."""
    if isinstance(space, spaces.Discrete):
        default = DiscreteActions(space, names)
        return parser or default.parse, formatter or default.format, default.describe()
    if names is not None:
        raise ValueError(f"action_names needs a Discrete action space, got {space}; pass action_parser.")
    if isinstance(space, spaces.Text):
        return parser or _text_parser(space), formatter or str, "a text action"
    if isinstance(space, spaces.MultiDiscrete) and parser is None:
        multi = MultiDiscreteActions(space)
        return multi.parse, formatter or multi.format, multi.describe()
    if parser is None:
        raise ValueError(
            f"no default action parser for a {type(space).__name__} action space ({space}); pass "
            "action_parser=(text -> action, raising ValueError for bad text) and "
            "action_formatter=(action -> text)."
        )
    return parser, formatter or str, f"an action of {space}"
