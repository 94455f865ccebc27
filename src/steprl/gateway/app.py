"""The gateway's HTTP face (the `serve` extra): an OpenAI-compatible API on loopback.

Routes: `GET /v1/models`; `POST /v1/chat/completions` (messages, tools, `stream`, temperature,
top_p, max_tokens / max_completion_tokens, stop, seed); `POST /v1/completions` (a prompt as text
or token ids); `POST /v1/messages` (Anthropic's Messages API, whole messages:
`anthropic_format.py`). Auth: the API key is the gateway's token, or `<token>.<session>` (a harness that
gives each episode its own key gets a session per key); `X-Session-Id` names the session
otherwise (else "default"). Anthropic's SDK sends its key as `x-api-key`, accepted the same way.

Errors are the OpenAI envelope `{"error": {"message", "type"}}`: 401 for a wrong key, 400 for a
request the gateway cannot read, 500 `provenance_error` when the engine's ids and log-probs do not
match (the call fails; nothing is recorded or padded).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from steprl.extras import require
from steprl.gateway.anthropic_format import AnthropicRequestError, message_response, to_chat
from steprl.gateway.openai_format import chat_chunks, chat_response, completion_response
from steprl.gateway.policy_gateway import BudgetExceeded, Gateway, Sampling, SessionClosed
from steprl.gateway.sessions import ProvenanceError

require("fastapi", extra="serve", feature="steprl serve-policy")  # one line when the extra is missing
from fastapi import FastAPI, Request  # noqa: E402  (a module global: FastAPI resolves `request: Request`)
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402


class BadRequest(ValueError):
    """A request body the gateway cannot read (the message says which field)."""


def session_key(token: str, api_key: str | None, header: str | None) -> str | None:
    """The session a call belongs to, or None when the key is wrong."""
    if api_key is None:
        return None
    if secrets.compare_digest(api_key.encode(), token.encode()):
        return header or "default"
    prefix = f"{token}."
    if len(api_key) > len(prefix) and secrets.compare_digest(
        api_key[: len(prefix)].encode(), prefix.encode()
    ):
        return header or api_key[len(prefix) :]
    return None


#: request fields the gateway does not do, and the values that ask for nothing
_UNSUPPORTED = {
    "n": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "response_format": (None,),
}


def sampling_of(body: Mapping[str, Any]) -> Sampling:
    def number(name: str, default: float, low: float, high: float) -> float:
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise BadRequest(f"{name}: a number in [{low}, {high}], got {value!r}")
        return float(value)

    for name, fine in _UNSUPPORTED.items():
        if body.get(name) not in fine:
            raise BadRequest(
                f"{name}: not supported by the steprl gateway (got {body.get(name)!r}); leave it out"
            )
    if body.get("tool_choice") not in (None, "auto"):
        raise BadRequest(f"tool_choice: only auto is supported, got {body.get('tool_choice')!r}")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop: a string or a list of strings, got {body.get('stop')!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63):
        raise BadRequest(f"seed: an integer in [0, 2**63), got {seed!r}")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1 << 20
    ):
        raise BadRequest(f"max_tokens: an integer in [1, {1 << 20}], got {limit!r}")
    return Sampling(
        temperature=number("temperature", 1.0, 0.0, 2.0),
        top_p=number("top_p", 1.0, 1e-6, 1.0),
        max_tokens=limit,
        stop=tuple(stop),
        seed=seed,
    )


def make_app(gateway: Gateway, token: str) -> FastAPI:
    app = FastAPI(title="steprl policy gateway")

    def error(status: int, type_: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": type_}}, status_code=status)

    def key_of(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        api_key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        return session_key(token, api_key, request.headers.get("x-session-id"))

    async def serve(request: Request, handle: Callable[[str, dict[str, Any]], Awaitable[Any]]) -> Any:
        """What every POST route shares: the key, the body, and each failure as its status."""
        key = key_of(request)
        if key is None:
            return error(401, "authentication_error", "wrong or missing API key")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            return await handle(key, body)
        except (BadRequest, AnthropicRequestError) as exc:
            return error(400, "invalid_request_error", str(exc))
        except BudgetExceeded as exc:  # the harness env's turn or token budget: the episode is over
            return error(400, "budget_exceeded", str(exc))
        except SessionClosed as exc:
            return error(400, "session_closed", str(exc))
        except ProvenanceError as exc:  # the engine's ids and log-probs disagree: fail, record nothing
            return error(500, "provenance_error", str(exc))
        except ValueError as exc:  # a body that is not JSON, a template that refuses the messages
            return error(400, "invalid_request_error", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # the engine failed: the harness sees why, the server stays up
            return error(500, "engine_error", f"{type(exc).__name__}: {exc}")

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if key_of(request) is None:
            return error(401, "authentication_error", "wrong or missing API key")
        return {
            "object": "list",
            "data": [{"id": gateway.model_name, "object": "model", "owned_by": "steprl"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        async def handle(key: str, body: dict[str, Any]) -> Any:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise BadRequest("messages: a non-empty list of {role, content} objects")
            tools = body.get("tools") or []
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise BadRequest(
                    "tools: a list of {type: function, function: {name, description, parameters}}"
                )
            tools = [t.get("function", t) for t in tools]
            turn, reply = await gateway.chat(key, messages, tools, sampling_of(body))
            rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
            if body.get("stream"):
                return StreamingResponse(
                    chat_chunks(reply, gateway.model_name, rid), media_type="text/event-stream"
                )
            return chat_response(
                reply, gateway.model_name, rid, len(turn.prompt_ids), len(turn.completion_ids)
            )

        return await serve(request, handle)

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        async def handle(key: str, body: dict[str, Any]) -> Any:
            if body.get("stream"):
                raise BadRequest("stream: /v1/completions answers whole completions only")
            prompt, vocab = body.get("prompt"), len(gateway.fmt.tokenizer)
            if isinstance(prompt, str) and prompt:
                ids = gateway.fmt.template_ids(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in prompt)
            ):
                ids = tuple(prompt)
            else:
                raise BadRequest(f"prompt: a non-empty string or list of token ids in [0, {vocab})")
            turn = await gateway.sample(key, ids, sampling_of(body))
            text = gateway.fmt.decode(turn.completion_ids)
            n, rid = len(turn.completion_ids), f"cmpl-{uuid.uuid4().hex[:16]}"
            return completion_response(
                text, turn.finish_reason, gateway.model_name, rid, len(turn.prompt_ids), n
            )

        return await serve(request, handle)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        async def handle(key: str, body: dict[str, Any]) -> Any:
            if body.get("stream"):
                raise BadRequest(
                    "stream: /v1/messages answers whole messages only (stream on /v1/chat/completions)"
                )
            chat_messages, tools = to_chat(body)
            sampling = sampling_of({**body, "stop": body.get("stop_sequences")})
            turn, reply = await gateway.chat(key, chat_messages, tools, sampling)
            rid = f"msg_{uuid.uuid4().hex[:24]}"
            return message_response(
                reply, gateway.model_name, rid, len(turn.prompt_ids), len(turn.completion_ids)
            )

        return await serve(request, handle)

    return app
