"""Anthropic's Messages API (`POST /v1/messages`) over the same gateway: the request turned into
the chat messages a template renders, the reply into Anthropic's content blocks.

Request: `system` (a string or text blocks), `messages` whose content is a string or blocks
(`text`; the assistant's `tool_use`; the user's `tool_result`), `tools` ({name, description,
input_schema}), `max_tokens`, `temperature`, `top_p`, `stop_sequences`. A `tool_use` block
becomes an assistant tool call, a `tool_result` block a tool message, so a template renders an
Anthropic conversation exactly as it renders the same OpenAI one (and the gateway appends or
branches it the same way).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from steprl.gateway.openai_format import Reply


class AnthropicRequestError(ValueError):
    """A Messages request the gateway cannot read (the message names the field)."""


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text", "")) for b in content if isinstance(b, Mapping) and b.get("type") == "text"
        )
    raise AnthropicRequestError(
        f"{where}: a string or a list of content blocks, got {type(content).__name__}"
    )


def to_chat(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, tool schemas) of a Messages request."""
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicRequestError("messages: a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise AnthropicRequestError(f"messages[{i}]: role must be user or assistant")
        content = m.get("content", "")
        blocks = (
            content
            if isinstance(content, list)
            else [{"type": "text", "text": _text(content, f"messages[{i}]")}]
        )
        if m["role"] == "assistant":
            calls = [
                {
                    "id": b.get("id", f"toolu_{i}_{j}"),
                    "type": "function",
                    "function": {"name": b.get("name", ""), "arguments": json.dumps(b.get("input", {}))},
                }
                for j, b in enumerate(blocks)
                if isinstance(b, Mapping) and b.get("type") == "tool_use"
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": _text(blocks, f"messages[{i}]")}
            if calls:
                msg["tool_calls"] = calls
            thought = "".join(
                str(b.get("thinking", ""))
                for b in blocks
                if isinstance(b, Mapping) and b.get("type") == "thinking"
            )
            if thought:  # sent back as the template takes reasoning (Qwen3 renders it again)
                msg["reasoning_content"] = thought
            out.append(msg)
            continue
        results = [b for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_result"]
        for b in results:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.get("tool_use_id", ""),
                    "content": _text(b.get("content", ""), "tool_result"),
                }
            )
        text = _text([b for b in blocks if b not in results], f"messages[{i}]")
        if text or not results:
            out.append({"role": "user", "content": text})
    tools = [
        {
            "name": t.get("name", ""),
            "description": t.get("description", ""),
            "parameters": t.get("input_schema", {}),
        }
        for t in body.get("tools") or []
        if isinstance(t, Mapping)
    ]
    return out, tools


_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def message_response(
    reply: Reply, model: str, rid: str, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"].replace("call_", "toolu_", 1),
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": _STOP.get(reply.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }
