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

What a request may cost is bounded before any work: the body by `BodyLimit` (bytes counted as
they arrive, 413 past the cap: `body_bytes`, from the model's context), its JSON nesting and
text by `parse_body` (400), the prompt and `max_tokens` by the context (`Gateway`, 400). A
client that disconnects cancels its call: the engine stops decoding it between two tokens, and
nothing is recorded. A served app (`steprl serve-policy`) answers only to loopback `Host`
names, as `serve-env` does (`hosting/security.py`, the same middlewares).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from steprl.extras import require
from steprl.gateway.anthropic_format import AnthropicRequestError, message_response, to_chat
from steprl.gateway.openai_format import chat_chunks, chat_response, completion_response
from steprl.gateway.policy_gateway import BudgetExceeded, ContextExceeded, Gateway, Sampling, SessionClosed
from steprl.gateway.sessions import ProvenanceError
from steprl.hosting import security

require("fastapi", extra="serve", feature="steprl serve-policy")  # one line when the extra is missing
from fastapi import FastAPI, Request  # noqa: E402  (a module global: FastAPI resolves `request: Request`)
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402


class BadRequest(ValueError):
    """A request body the gateway cannot read (the message says which field)."""


#: JSON nesting a body may have: a tool schema nests a few levels; Python's parser (and a
#: template that renders the schema) recurse, and fail near 1000 levels with a RecursionError
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def body_bytes(context: int | None) -> int:
    """The body cap for a model with `context` positions: room for a whole context of text even
    JSON-escaped (`\\uXXXX` is 6 bytes for one character, and a token is rarely more than a few
    characters), plus 64 KiB of fields and tool schemas; 1 MiB when the context is unknown."""
    return 64 * 1024 + 32 * context if context is not None else 1 << 20


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or a `BadRequest` saying what is wrong with it: not JSON (or not
    UTF-8), nested past `MAX_JSON_DEPTH`, or a string with a lone surrogate (`"\\ud800"`: valid
    JSON escapes, but no text a tokenizer can encode)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the body's JSON nests too deep; at most {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # not UTF-8, not JSON
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    stack: list[tuple[Any, int]] = [(body, 1)]  # iterative: a recursive walk is what fails
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the body's JSON nests more than {MAX_JSON_DEPTH} levels; send it flatter")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            for text in (k, v):
                if isinstance(text, str) and _SURROGATE.search(text):
                    raise BadRequest(
                        f"a string in the body has a lone surrogate ({text[:40]!r}); send valid UTF-16 pairs"
                    )
            if isinstance(v, dict | list):
                stack.append((v, depth + 1))
    return body


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (after the body, `receive` waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or a cancel of it when the client disconnects first (or this request is
    cancelled: a server shutting down). A cancelled engine call stops decoding between tokens."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    return task.result()


class ClientGone(Exception):
    """The client disconnected before its answer: nobody reads what is sent."""


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


def make_app(
    gateway: Gateway,
    token: str,
    *,
    hosts: Collection[str] | None = None,
    port: int | None = None,
    max_body_bytes: int | None = None,
) -> Any:
    """The ASGI app. `hosts` (with `port`): the Host names served (`security.LOOPBACK_HOSTS` for a
    server; None for an in-process app that no browser can reach, as the harness runner's);
    `max_body_bytes`: the body cap, by default `body_bytes(gateway.context)`."""
    app = FastAPI(title="steprl policy gateway", docs_url=None, redoc_url=None, openapi_url=None)

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
            body = parse_body(await request.body())
            return await unless_gone(request, handle(key, body))
        except ClientGone:
            return error(499, "client_closed", "the client disconnected; the call was cancelled")
        except (BadRequest, AnthropicRequestError) as exc:
            return error(400, "invalid_request_error", str(exc))
        except ContextExceeded as exc:
            return error(400, "context_length_exceeded", str(exc))
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

    cap = body_bytes(gateway.context) if max_body_bytes is None else max_body_bytes
    advice = "send less" + (f" (the model's context is {gateway.context} tokens)" if gateway.context else "")
    limited = security.BodyLimit(app, max_bytes=cap, advice=advice)
    if hosts is None:
        return limited
    return security.HostAllowlist(limited, hosts=hosts, port=port)
