"""`PlainHttp`: a minimal HTTP/1.1 keep-alive client for the batch route on plain `http://`.

Why not httpx here: with coalescing, a training turn is one `POST /v1/batch`, and httpx's
per-request machinery (~0.7 ms of CPU) was a third of what HTTP added over in-process at
concurrency 16 (measured with `benchmarks/env_throughput.py`: p50 +3.3 ms with httpx, +2.5 ms
with this client). It speaks exactly what our server answers (a Content-Length body, or a
chunked one, read line by line as it arrives: a streamed batch) and raises httpx's exception
types, so callers classify failures the same way. A connection the server has closed while
idle (keep-alive timeout) is detected before reuse and dropped; a request is never re-sent
here (the callers' retry loops decide, with idempotency keys).
`https://` and anything unusual still go through httpx.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from steprl.hosting.protocol import NDJSON

_MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: what callers read of an `httpx.Response` (building one cost ~0.1 ms)."""

    status_code: int
    headers: Mapping[str, str]  # names in lower case
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class PlainHttp:
    """Kept-alive connections to one `http://host:port`, for one event loop."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme != "http" or not parsed.host:
            raise ValueError(f"PlainHttp serves plain http://host:port URLs, got {url!r}")
        self.host, self.port = parsed.host, parsed.port or 80
        self.base_path = parsed.raw_path.decode("ascii").rstrip("/")
        fixed = {"Host": f"{self.host}:{self.port}", **headers}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(
        self,
        path: str,
        content: bytes,
        *,
        content_type: str,
        timeout: float,
        accept: str | None = None,
        on_line: Callable[[bytes], None] | None = None,
    ) -> Reply:
        """POST `content`; the answer. With `on_line`, an NDJSON answer is passed to it line by
        line as it arrives (its `Reply.content` is then empty); without, it is collected."""
        extra = f"Accept: {accept}\r\n" if accept else ""
        request = (
            f"POST {self.base_path}{path} HTTP/1.1\r\n".encode("latin-1")
            + self._head
            + f"{extra}Content-Type: {content_type}\r\nContent-Length: {len(content)}\r\n\r\n".encode(
                "latin-1"
            )
            + content
        )
        reader, writer = await self._connection(timeout)
        try:
            async with asyncio.timeout(timeout):
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status, headers = _parse_head(head)
                streamed = headers.get("content-type", "").startswith(NDJSON)
                per_line = on_line if streamed else None
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = await _read_chunked(reader, per_line)
                else:
                    body = await reader.readexactly(int(headers.get("content-length", "0")))
                    if per_line is not None:  # a stream that came in one piece
                        for line in body.split(b"\n"):
                            if line.strip():
                                per_line(line)
                        body = b""
        except TimeoutError:
            writer.close()
            raise httpx.ReadTimeout(f"no answer from {self.host}:{self.port} within {timeout:.1f}s") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from None
        except BaseException:  # cancelled mid-request (e.g. at loop shutdown): never reuse it
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append((reader, writer))
        return Reply(status, headers, body)

    async def aclose(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()

    async def _connection(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()  # the server closed it while idle
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=_MAX_HEAD_BYTES), timeout
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from None


async def _read_chunked(reader: asyncio.StreamReader, on_line: Callable[[bytes], None] | None) -> bytes:
    """A chunked body (RFC 9112 §7.1): its bytes, or, with `on_line`, each complete line."""
    collected: list[bytes] = []
    partial = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)  # ValueError if bad
        if not 0 <= size <= _MAX_CHUNK_BYTES:
            raise ValueError(f"chunk of {size} bytes (at most {_MAX_CHUNK_BYTES})")
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the end
                pass
            break
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise ValueError("a chunk does not end with CRLF")
        if on_line is None:
            collected.append(data[:-2])
            continue
        *lines, partial = (partial + data[:-2]).split(b"\n")
        for line in lines:
            if line.strip():
                on_line(line)
    if on_line is not None and partial.strip():
        on_line(partial)
    return b"".join(collected)


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers
