"""The template checker: are the incremental ids the agent loop builds the ids of a whole render?

For each multi-turn conversation it builds every turn's prompt the way the agent loop does
(first prompt rendered by the format, each assistant turn as "sampled" ids, each env message as
the format's delta, the context rule applied) and compares it with the template's render of the
conversation so far, tokenized in one piece. The first differing token is reported with the
decoded text around it. A format that fails is refused by the trainer unless the user opts into
per-turn rows (`rollout.template_mismatch=per_turn`), where each turn trains on exactly the
prompt it was shown.

Conversations are `{"tools": [...], "messages": [...]}`: an optional system message, a user
task, then assistant turns, each followed by a tool result (role "tool") or a user turn. An
assistant message may say `"ends_turn": false` (a turn stopped at a call's close tag, so the
template's end-of-turn token is the format's to add).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steprl.errors import UserError
from steprl.rollout.context import CONTEXT_RULES


class ConversationFileError(UserError):
    """A --conversations file that cannot be read as conversations."""


@dataclass(frozen=True)
class Break:
    """Where an incremental prompt first differs from the whole render."""

    conversation: int
    turn: int  # 0: the first prompt; t: the prompt after t env messages
    index: int  # first differing token position
    got: tuple[int, ...]  # a few incremental ids from `index`
    expected: tuple[int, ...]  # a few whole-render ids from `index`
    context: str  # decoded text before the break
    got_text: str
    expected_text: str

    def describe(self) -> str:
        return (
            f"conversation {self.conversation}, turn {self.turn}: first bad token at {self.index}: "
            f"after {self.context!r} the loop has {self.got_text!r} {list(self.got)} but a whole "
            f"render has {self.expected_text!r} {list(self.expected)}"
        )


@dataclass(frozen=True)
class TemplateReport:
    context: str  # the context rule checked
    prompts: int  # prompts compared
    breaks: tuple[Break, ...] = field(default_factory=tuple)
    error: str = ""  # the format could not be built from the template at all

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.error

    def summary(self) -> str:
        if self.error:
            return f"{self.context}: FAIL: {self.error}"
        head = f"{self.context}: {self.prompts} prompts compared, "
        if self.ok:
            return head + "PASS (incremental ids == whole render)"
        return head + f"FAIL ({len(self.breaks)} differ); first: {self.breaks[0].describe()}"


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_template(
    fmt: Any, conversations: Sequence[Mapping[str, Any]], *, context: str = "keep_thinking"
) -> TemplateReport:
    """Compare each turn's prompt under `context` with a whole render (see the module docstring).

    `fmt` is a prompt format with `render`/`template_ids` (`ChatFormat`) or a plain format
    (whose "whole render" is its text concatenated and tokenized in one piece).
    """
    rule = CONTEXT_RULES[context](0, fmt)
    breaks: list[Break] = []
    prompts = 0
    for c, conv in enumerate(conversations):
        tools = tuple(conv.get("tools", ()))
        messages = [dict(m) for m in conv["messages"]]
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        body = messages[1:] if system else messages
        if not body or body[0]["role"] != "user":
            raise ConversationFileError(
                f"conversation {c}: the first message (after a system one) must be a user task"
            )
        initial = fmt.initial_ids(system, body[0]["content"], tools)
        history: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
        shown = [initial]
        whole = [_whole(fmt, system, body[:1], tools)]
        turns = body[1:]
        for t in range(0, len(turns) - 1, 2):
            assistant, env_msg = turns[t], turns[t + 1]
            if assistant["role"] != "assistant" or env_msg["role"] not in ("tool", "user"):
                raise ConversationFileError(
                    f"conversation {c}: expected assistant then tool/user messages at {t + 1}, "
                    f"got {assistant['role']} then {env_msg['role']}"
                )
            sampled = fmt.template_ids(assistant["content"])
            if assistant.get("ends_turn", True) and hasattr(fmt, "end_of_turn_id"):
                sampled = (*sampled, fmt.end_of_turn_id)
            tool_result = env_msg["role"] == "tool"
            obs = fmt.observation_ids(env_msg["content"], action_ids=sampled, tool_result=tool_result)
            history.append((sampled, obs, not tool_result))
            shown.append(rule.next_prompt(initial, history))
            whole.append(_whole(fmt, system, body[: t + 3], tools))
        for turn, (got, want) in enumerate(zip(shown, whole, strict=True)):
            prompts += 1
            i = _first_diff(got, want)
            if i is not None:
                breaks.append(
                    Break(
                        c,
                        turn,
                        i,
                        tuple(got[i : i + 4]),
                        tuple(want[i : i + 4]),
                        fmt.decode_all(got[max(0, i - 16) : i])[-60:],
                        fmt.decode_all(got[i : i + 4]),
                        fmt.decode_all(want[i : i + 4]),
                    )
                )
    return TemplateReport(context, prompts, tuple(breaks))


def _whole(
    fmt: Any, system: str, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any]
) -> tuple[int, ...]:
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tuple(fmt.rerender_ids(system, clean, tools))


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    """Conversations from a JSONL file (one `{"tools": [...], "messages": [...]}` per line) or a
    JSON list of them."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConversationFileError(f"--conversations {path}: {exc.strerror or exc}") from None
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = []
            for n, line in enumerate(text.splitlines(), 1):
                try:
                    rows += [json.loads(line)] if line.strip() else []
                except json.JSONDecodeError as exc:  # its lineno counts within the line
                    raise ConversationFileError(
                        f"--conversations {path}: bad JSON at line {n}: {exc.msg}"
                    ) from None
    except json.JSONDecodeError as exc:
        raise ConversationFileError(
            f"--conversations {path}: bad JSON at line {exc.lineno}: {exc.msg}"
        ) from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise ConversationFileError(f'--conversations {path}: entry {i} needs a "messages" list')
    return rows


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


_CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def builtin_conversations(*, thinking: bool = False, later_query: bool = False) -> list[dict[str, Any]]:
    """Multi-turn tool conversations: native calls, tag calls, multi-line and unicode results,
    and a turn stopped at a call's close tag. `thinking` puts reasoning in every assistant turn;
    `later_query` adds a conversation in which a second user query follows answered turns
    (where Qwen3's template drops the earlier reasoning: the strip_thinking case)."""

    def think(text: str, body: str) -> str:
        return f"<think>\n{text}\n</think>\n\n{body}" if thinking else body

    system = {"role": "system", "content": "You are a careful assistant. Use the tools."}
    chain: dict[str, Any] = {
        "tools": [_CALC],
        "messages": [
            system,
            {"role": "user", "content": "What is (12 + 30) * 2?"},
            {"role": "assistant", "content": think("First the sum.", _call("calc", expression="12+30"))},
            {"role": "tool", "content": "42"},
            {
                "role": "assistant",
                "content": think("Now double it.", _call("calc", expression="42*2")),
                "ends_turn": False,
            },
            {"role": "tool", "content": "84\nnote: exact - ok"},
            {"role": "assistant", "content": think("Check it.", "<calc>84/2</calc>")},
            {"role": "tool", "content": "<error>unknown tool 'calc' in tag style</error>"},
        ],
    }
    tags: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "Compute 7*6."},
            {"role": "assistant", "content": "<calc>7*6</calc>"},
            {"role": "tool", "content": "<result>42</result>"},
            {"role": "assistant", "content": "<answer>41</answer>"},
            {"role": "user", "content": "Wrong, try again."},
        ],
    }
    convs: list[dict[str, Any]] = [chain] if thinking else [chain, tags]
    if later_query:
        convs.append(
            {
                "tools": [_CALC],
                "messages": [
                    system,
                    {"role": "user", "content": "What is 2+3?"},
                    {"role": "assistant", "content": think("Easy.", "<answer>5</answer>")},
                    {"role": "user", "content": "And times 4?"},
                    {"role": "assistant", "content": think("Use the tool.", _call("calc", expression="5*4"))},
                    {"role": "tool", "content": "20"},
                    {"role": "assistant", "content": think("Done.", "<answer>20</answer>")},
                    {"role": "user", "content": "Thanks."},
                ],
            }
        )
    return convs


#: (label, context rule, conversations, whether a break is expected): what check-template runs.
def standard_checks() -> list[tuple[str, str, list[dict[str, Any]], bool]]:
    return [
        ("tool conversations, append_only", "append_only", builtin_conversations(), False),
        ("thinking tool chains, keep_thinking", "keep_thinking", builtin_conversations(thinking=True), False),
        (
            "thinking with a later user query, strip_thinking",
            "strip_thinking",
            builtin_conversations(thinking=True, later_query=True),
            False,
        ),
        (
            "thinking with a later user query, append-only (the raw template strips earlier reasoning)",
            "keep_thinking",
            builtin_conversations(thinking=True, later_query=True)[-1:],
            True,
        ),
    ]


def startup_conversations(context: str) -> list[dict[str, Any]]:
    """What the trainer checks its format on before a run, for its context rule."""
    if context == "strip_thinking":
        return builtin_conversations(thinking=True, later_query=True)
    return builtin_conversations(thinking=context == "keep_thinking")
