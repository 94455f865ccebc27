"""Pure ASGI middleware and a uvicorn protocol that harden the env server on loopback.

Why each piece exists (reference/reliability.md §5):

* `HostAllowlist`: a browser on this machine can reach 127.0.0.1 through a hostile domain
  re-bound to 127.0.0.1 (DNS rebinding); only requests naming a loopback host (and our port)
  are served, and a foreign `Origin` is refused. No CORS headers are ever sent.
* `BearerAuth`: every route but the public ones needs ``Authorization: Bearer <token>``,
  compared in constant time. A token in the query string is refused: URLs end up in logs.
* `BodyLimit`: neither uvicorn nor Starlette bounds a request body by default. This counts the
  bytes actually streamed (chunked bodies have no Content-Length, and a declared length is only
  a claim) and answers 413 as soon as the cap is passed, without buffering the rest.
* `header_deadline_protocol`: uvicorn has no timeout for a request's headers, so a client that
  trickles them (slowloris) holds a connection, and a `limit_concurrency` slot, forever.

Each middleware writes the same error envelope as the app (`protocol.error_body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn
from urllib.parse import parse_qsl, urlsplit

from steprl.hosting.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Any  # () -> Awaitable[Message]; typed loosely: Starlette and uvicorn disagree on names
Send = Any  # (Message) -> Awaitable[None]
ASGIApp = Any

#: Host names a loopback server answers to (DNS-rebinding guard).
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: Query parameters that look like credentials: refused even when the value is wrong.
_CREDENTIAL_PARAMS = frozenset({"token", "access_token", "api_key", "apikey", "key", "auth", "authorization"})


async def send_error(
    send: Send,
    status: int,
    type_: str,
    message: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    close: bool = False,
) -> None:
    """Answer with the error envelope straight on the ASGI `send` (no framework involved)."""
    body = json.dumps(error_body(type_, message), ensure_ascii=False, separators=(",", ":")).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    if close:  # uvicorn then closes the connection instead of reading the rest of the request
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _headers(scope: Scope, name: bytes) -> list[bytes]:
    return [v for k, v in scope.get("headers", ()) if k.lower() == name]


def split_host(value: str) -> tuple[str, int | None]:
    """("127.0.0.1", 8765) from "127.0.0.1:8765"; IPv6 stays bracketed: ("[::1]", 8765).

    Raises ValueError for a malformed value (bad port, unbalanced brackets, empty host)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError("unbalanced '[' in host")
        host, rest = value[: end + 1], value[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("junk after ']' in host")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_raw = value.partition(":")
        port_text = port_text_raw if sep else None
    if not host:
        raise ValueError("empty host")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad port {port_text!r}")
    return host, int(port_text)


class HostAllowlist:
    """Serve only requests whose Host (and Origin, when sent) names an allowed host and our port.

    A missing or malformed Host is a 400; a foreign one a 421 (Misdirected Request); a foreign
    Origin a 400. `port=None` accepts any port (a server bound to an ephemeral port).
    """

    def __init__(self, app: ASGIApp, *, hosts: Iterable[str], port: int | None) -> None:
        self.app = app
        self.hosts = frozenset(h.lower() for h in hosts)
        self.port = port

    def _allowed(self, host: str, port: int | None) -> bool:
        return host in self.hosts and (port is None or self.port is None or port == self.port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values = _headers(scope, b"host")
        if len(values) != 1:
            await send_error(send, 400, "bad_host", "send exactly one Host header", close=True)
            return
        try:
            host, port = split_host(values[0].decode("latin-1"))
        except ValueError as err:
            await send_error(send, 400, "bad_host", f"malformed Host header: {err}", close=True)
            return
        if not self._allowed(host, port):
            await send_error(
                send,
                421,
                "misdirected_request",
                f"this server answers only to Host {sorted(self.hosts)} on its own port; connect to "
                "http://127.0.0.1:<port> directly (foreign Host names are refused: DNS-rebinding guard)",
                close=True,
            )
            return
        for origin in _headers(scope, b"origin"):
            if not self._origin_allowed(origin.decode("latin-1")):
                await send_error(
                    send,
                    400,
                    "foreign_origin",
                    "requests from web pages are refused (the Origin header names another site); "
                    "call the server from a program, which sends no Origin",
                    close=True,
                )
                return
        await self.app(scope, receive, send)

    def _origin_allowed(self, origin: str) -> bool:
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed iframes, file://) and anything odd
        try:
            host, port = split_host(parts.netloc)
        except ValueError:
            return False
        return self._allowed(host, port)


class BearerAuth:
    """Require ``Authorization: Bearer <token>`` on every path except `public_paths`.

    The token is compared with `secrets.compare_digest` and never logged or echoed. Credentials
    in the query string are refused on every path (401), even with a valid header.
    """

    def __init__(self, app: ASGIApp, *, token: str, public_paths: Iterable[str] = ()) -> None:
        if not token:
            raise ValueError("BearerAuth needs a token; generate one with secrets.token_urlsafe(32)")
        self.app = app
        self._token = token.encode()
        self.public_paths = frozenset(public_paths)

    def _token_in_query(self, query: bytes) -> bool:
        for key, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
            if key.lower() in _CREDENTIAL_PARAMS or secrets.compare_digest(value.encode(), self._token):
                return True
        return False

    def _authorized(self, scope: Scope) -> bool:
        values = _headers(scope, b"authorization")
        if len(values) != 1:
            return False
        scheme, _, given = values[0].partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        challenge = [(b"www-authenticate", b"Bearer")]
        if scope.get("query_string") and self._token_in_query(scope["query_string"]):
            await send_error(
                send,
                401,
                "token_in_url",
                "credentials in the URL are refused (URLs are logged); send the header "
                "'Authorization: Bearer <token>' instead",
                challenge,
                close=True,
            )
            return
        if scope["path"] not in self.public_paths and not self._authorized(scope):
            await send_error(
                send,
                401,
                "unauthorized",
                "missing or wrong bearer token; send 'Authorization: Bearer <token>' with the token "
                "the server was started with (env var STEPRL_ENV_TOKEN, or the file serve-env printed)",
                challenge,
                close=True,
            )
            return
        await self.app(scope, receive, send)


class _Refused(Exception):
    """Raised into the app from `receive` once its body was refused (the 413/408 is already sent)."""


class BodyLimit:
    """Answer 413 once a request body passes `max_bytes`, counting the bytes actually received,
    and 408 when the body has not all arrived `timeout_s` after the headers (a trickled body).

    A declared Content-Length over the cap is refused before any body byte is read. Otherwise
    `receive` is wrapped: when the running count passes the cap, or the body's deadline passes,
    the error is sent right away and `_Refused` is raised into the app; whatever the app then
    sends is dropped. (uvicorn's header deadline, `header_deadline_protocol`, covers the headers.)
    Headers over `max_header_bytes` in total are a 431: h11 bounds only a header block that is
    still incomplete in its buffer, and accepts a larger one that arrives in a single read.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        timeout_s: float = 30.0,
        max_header_bytes: int = 16 * 1024,
        advice: str = "env actions and tasks are small: send less (or start the server with a larger "
        "--max-body-bytes)",
    ) -> None:
        if max_bytes < 0 or max_header_bytes < 0 or not timeout_s > 0:
            raise ValueError(
                f"limits must be >= 0 (timeout > 0), got {max_bytes}, {max_header_bytes}, {timeout_s}"
            )
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_header_bytes = max_header_bytes
        self.advice = advice  # how to fix a 413, for the server this guards (env server, gateway)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) for k, v in scope.get("headers", ())) > self.max_header_bytes:
            too_long = f"request headers over {self.max_header_bytes} bytes"
            await send_error(send, 431, "headers_too_large", too_long, close=True)
            return
        too_large = f"request body over {self.max_bytes} bytes; {self.advice}"
        for declared in _headers(scope, b"content-length"):
            if not declared.strip().isdigit():
                await send_error(send, 400, "bad_request", "malformed Content-Length header", close=True)
                return
            if int(declared) > self.max_bytes:
                await send_error(send, 413, "body_too_large", too_large, close=True)
                return
        received = 0
        body_done = False
        rejected = False
        response_started = False
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def refuse(status: int, type_: str, message: str) -> NoReturn:
            nonlocal rejected
            rejected = True
            if not response_started:
                await send_error(send, status, type_, message, close=True)
            raise _Refused

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only http.disconnect can come: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message: Message = await receive()
            except TimeoutError:
                slow = f"the request body did not arrive within {self.timeout_s:g}s of its headers"
                await refuse(408, "body_timeout", slow)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes and not rejected:
                    await refuse(413, "body_too_large", too_large)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if rejected:
                return  # the app's answer to the aborted read (a 400, say) after our 413/408
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        with contextlib.suppress(_Refused):  # the app let it through; the 413/408 is out
            await self.app(scope, limited_receive, guarded_send)


def header_deadline_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol plus a deadline for each request's headers (slowloris guard).

    The deadline is armed when a connection opens and after each response, and disarmed by the
    next request's complete headers; when it passes first, the connection is closed. Between
    requests uvicorn's own keep-alive timeout usually closes an idle connection sooner.
    This subclasses uvicorn internals (`H11Protocol.cycle`, `on_response_complete`); the HTTP-05
    test pins the behaviour.
    """
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(self.cycle)

        def on_response_complete(self) -> None:
            finished = self.cycle  # a pipelined request may start inside super(): it is not late
            super().on_response_complete()
            self._arm(finished)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self, cycle: object) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._deadline, cycle)

        def _deadline(self, cycle: object) -> None:
            # Still the cycle we armed for: no new request's headers arrived in time.
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineH11Protocol
