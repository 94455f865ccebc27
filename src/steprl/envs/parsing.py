"""Parse one action text (what the policy generated this turn) into a typed action.

Two call styles, one answer tag:

* tag style, ``<calc>3+4</calc>``: the tag is the tool's name and the body is bound to the
  tool's single string argument (Search-R1 / ToRL style; cheap for tiny models to learn);
* JSON style, ``<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>``
  (the Hermes / Qwen2.5 function-calling format);
* ``<answer>...</answer>`` ends the episode.

Text before the first recognised tag (e.g. thinking) is ignored, as are whole
``<think>...</think>`` blocks. An action holds exactly one call or answer; anything else is an
`InvalidAction` whose short `reason` is shown to the model so it can learn the format (verl
drops such calls silently, which teaches nothing; cf. reliability BAD-01/02/05).

`parse_action` never raises on any string: it is on the path of every rollout step, and a
parser crash would turn a model mistake into an infrastructure failure. Every scan is linear
in the length of the text, and texts over `ActionSyntax.max_chars` are rejected up front.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

ActionKind = Literal["tool_call", "answer", "invalid"]
CallStyle = Literal["tag", "json"]

# A tag or tool name: short, starts with a letter or underscore (rules out `<3` and `</`).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_ANY_OPEN = re.compile(r"<([A-Za-z_][A-Za-z0-9_.-]{0,63})>")
_ANY_CLOSE = re.compile(r"</([A-Za-z_][A-Za-z0-9_.-]{0,63})>")


@dataclass(frozen=True)
class ToolCall:
    """A call of tool `name` with keyword `arguments` (read-only), written in `style`."""

    name: str
    arguments: Mapping[str, Any]
    style: CallStyle


@dataclass(frozen=True)
class FinalAnswer:
    """The policy's final answer (the stripped body of the answer tag, never empty)."""

    text: str


@dataclass(frozen=True)
class InvalidAction:
    """An unparseable action; `reason` is short because it becomes the model's observation."""

    reason: str


Action = ToolCall | FinalAnswer | InvalidAction


def action_kind(action: Action) -> ActionKind:
    """The `info["action_kind"]` value for a parsed action."""
    if isinstance(action, ToolCall):
        return "tool_call"
    if isinstance(action, FinalAnswer):
        return "answer"
    return "invalid"


@dataclass(frozen=True)
class ActionSyntax:
    """Which tags an action may use, and so where generation must stop.

    `tag_tools` maps a tag-style tool's name to the argument its body binds to;
    `json_tools` are the names callable through `<call_tag>{json}</call_tag>` (empty: the
    JSON style is off). Tags in `ignored_tags` delimit blocks that are skipped entirely.
    """

    tag_tools: Mapping[str, str] = field(default_factory=dict)
    json_tools: frozenset[str] = frozenset()
    answer_tag: str = "answer"
    call_tag: str = "tool_call"
    ignored_tags: tuple[str, ...] = ("think",)
    max_chars: int = 32_768
    _open: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tag_tools = MappingProxyType(dict(self.tag_tools))
        object.__setattr__(self, "tag_tools", tag_tools)
        object.__setattr__(self, "json_tools", frozenset(self.json_tools))
        object.__setattr__(self, "ignored_tags", tuple(self.ignored_tags))
        reserved = {self.answer_tag, self.call_tag, *self.ignored_tags}
        for name in [*reserved, *tag_tools, *self.json_tools]:
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r} cannot be used as a tag or tool name: use 1-64 letters, digits, '_', "
                    "'.' or '-', starting with a letter or '_'."
                )
        clash = reserved & set(tag_tools)
        if clash:
            raise ValueError(
                f"tool name(s) {sorted(clash)} clash with the answer/call/ignored tags; rename the "
                "tool or pass different answer_tag/call_tag/ignored_tags."
            )
        if self.max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {self.max_chars}.")
        tags = [*tag_tools, self.answer_tag] + ([self.call_tag] if self.json_tools else [])
        alternation = "|".join(re.escape(t) for t in sorted(tags, key=len, reverse=True))
        object.__setattr__(self, "_open", re.compile(f"<({alternation})>"))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Close tags at which the engine must stop: one per tag tool, the call tag, the answer."""
        tags = [*self.tag_tools] + ([self.call_tag] if self.json_tools else []) + [self.answer_tag]
        return tuple(f"</{t}>" for t in tags)

    def parse(self, text: str) -> Action:
        return parse_action(text, self)


def stop_strings(
    tag_tools: Iterable[str],
    *,
    json_calls: bool = True,
    answer_tag: str = "answer",
    call_tag: str = "tool_call",
) -> tuple[str, ...]:
    """Stop strings for a set of tag-style tools: `</name>` each, `</tool_call>`, `</answer>`."""
    tags = [*tag_tools] + ([call_tag] if json_calls else []) + [answer_tag]
    return tuple(f"</{t}>" for t in tags)


def parse_action(text: str, syntax: ActionSyntax) -> Action:
    """Parse one action text; returns `InvalidAction` (never raises) when it is malformed."""
    if not isinstance(text, str):
        return InvalidAction("action is not text")
    if len(text) > syntax.max_chars:
        return InvalidAction(f"action too long (max {syntax.max_chars} chars)")
    visible = text
    for tag in syntax.ignored_tags:
        visible = _drop_blocks(visible, tag)
    if not visible.strip():
        return InvalidAction("empty action")

    opening = syntax._open.search(visible)
    if opening is None:
        unknown = _unknown_tool_tag(visible, syntax)
        if unknown is not None:
            return InvalidAction(f"unknown tool '{unknown}'")
        return InvalidAction("no call or answer")
    tag = opening.group(1)
    close = f"</{tag}>"
    end = visible.find(close, opening.end())
    if end < 0:
        return InvalidAction(f"unclosed <{tag}>")
    body = visible[opening.end() : end]
    if syntax._open.search(body) is not None:
        return InvalidAction(f"nested tag inside <{tag}>")
    if syntax._open.search(visible, end + len(close)) is not None:
        return InvalidAction("one call or answer per turn")

    if tag == syntax.answer_tag:
        answer = body.strip()
        return FinalAnswer(answer) if answer else InvalidAction("empty answer")
    if tag in syntax.tag_tools:
        return ToolCall(tag, MappingProxyType({syntax.tag_tools[tag]: body}), "tag")
    return _parse_json_call(body, syntax)


def _drop_blocks(text: str, tag: str) -> str:
    """Remove every closed `<tag>...</tag>` block (linear; no backtracking regex).

    A close tag before any open tag drops everything up to it: chat templates such as Qwen3's put
    the opening `<think>` in the prompt. An unclosed block is kept as plain text: generation may
    have stopped at a call's close tag inside it, and the call is then the model's intent.
    """
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    first_close, first_open = text.find(close_tag), text.find(open_tag)
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        text = text[first_close + len(close_tag) :]
    parts: list[str] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        stop = text.find(close_tag, start + len(open_tag))
        if stop < 0:
            break
        parts.append(text[pos:start])
        pos = stop + len(close_tag)
    parts.append(text[pos:])
    return "".join(parts)


def _unknown_tool_tag(text: str, syntax: ActionSyntax) -> str | None:
    """The first `<x>...</x>` pair naming no known tag, if any (so the model learns the name)."""
    first_open: dict[str, int] = {}
    for match in _ANY_OPEN.finditer(text):
        first_open.setdefault(match.group(1), match.start())
    for match in _ANY_CLOSE.finditer(text):
        name = match.group(1)
        if name not in syntax.ignored_tags and first_open.get(name, match.start()) < match.start():
            return name[:32]
    return None


class _BadJSON(ValueError):
    """A JSON value we refuse (NaN/Infinity, duplicate keys): rejected deterministically."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _BadJSON(f"duplicate key {key[:32]!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise _BadJSON(f"{name} is not valid JSON")


def _parse_json_call(body: str, syntax: ActionSyntax) -> Action:
    """`{"name": str, "arguments": {...}}` -> ToolCall; a missing "arguments" means no arguments."""
    try:
        obj = json.loads(body, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return InvalidAction(f"bad JSON at char {exc.pos}: {exc.msg}")
    except _BadJSON as exc:
        return InvalidAction(f"bad JSON: {exc}")
    except (ValueError, RecursionError):  # e.g. a 5000-digit int, 100k-deep nesting
        return InvalidAction("bad JSON")
    if not isinstance(obj, dict):
        return InvalidAction('tool_call must be {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str):
        return InvalidAction('tool_call needs a "name" string')
    if name not in syntax.json_tools:
        shown = name[:32] if _NAME.fullmatch(name) else "?"
        return InvalidAction(f"unknown tool '{shown}'")
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return InvalidAction('"arguments" must be an object')
    return ToolCall(name, MappingProxyType(arguments), "json")
