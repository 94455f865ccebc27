"""A completion's text as the OpenAI chat API shows it: content, `tool_calls` parsed from the
chat template's tool-call blocks (Qwen3, Hermes: `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), reasoning from `<think>...</think>` as `reasoning_content` (what vLLM's reasoning
parsers return); the response objects, whole or as server-sent-event chunks.

Only the text changes shape here: the ids the model sampled are recorded as they are
(`sessions.py`), whatever the harness later does with this view of them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# the opening tag is optional: a template whose generation prompt opens <think> itself
# (thinking-only models) leaves only the close in what was sampled
_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class Reply:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # "stop" | "length" | "tool_calls"


def parse_reply(text: str, finish: str, call_prefix: str) -> Reply:
    """The OpenAI view of a completion's text. A block that is not a JSON call stays content
    (the harness sees what the model wrote)."""
    reasoning = None
    think = _THINK.match(text)
    if think:
        reasoning, text = think.group(1).strip(), text[think.end() :]
    calls: list[dict[str, Any]] = []
    kept = []
    last = 0
    for i, m in enumerate(_CALL.finditer(text)):
        try:
            body = json.loads(m.group(1))
            name, args = body["name"], body.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(
            {
                "id": f"{call_prefix}_{i}",
                "type": "function",
                # unescaped, so a harness that sends it back renders what the model wrote
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    kept.append(text[last:])
    # the whitespace around a removed block goes; text with none removed stays exactly as
    # sampled (a harness that sends it back renders the ids the model wrote)
    content = "".join(kept).strip() if calls or think else text
    return Reply(
        content=content or (None if calls else ""),
        reasoning=reasoning,
        tool_calls=calls,
        finish_reason="tool_calls" if calls and finish == "stop" else finish,
    )


def chat_response(
    reply: Reply, model: str, rid: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chat_chunks(reply: Reply, model: str, rid: str) -> Iterator[str]:
    """The same reply as `chat.completion.chunk` events (role, reasoning, content, each tool call,
    the finish), then `[DONE]`: the whole completion is sampled before the first event."""

    def event(delta: dict[str, Any], finish: str | None = None) -> str:
        chunk = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(chunk)}\n\n"

    yield event({"role": "assistant", "content": ""})
    if reply.reasoning is not None:
        yield event({"reasoning_content": reply.reasoning})
    if reply.content:
        yield event({"content": reply.content})
    for i, call in enumerate(reply.tool_calls):
        yield event({"tool_calls": [{"index": i, **call}]})
    yield event({}, reply.finish_reason)
    yield "data: [DONE]\n\n"


def completion_response(
    text: str, finish: str, model: str, rid: str, prompt_tokens: int, n: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n},
    }
