"""Raw HTTP on loopback for the server probes: a request is bytes on a socket, so the probes can
send what a well-behaved client never would (a foreign Host, a lying Content-Length, trickled
headers, a 100k-deep JSON body) and time the answer."""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no answer (the connection closed, or the deadline passed)
    body: bytes
    seconds: float
    closed: bool  # the server closed the connection before the deadline

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request_bytes(
    method: str, path: str, port: int, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    head = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json", "Connection": "close"}
    head.update(headers or {})
    if body or method == "POST":
        head.setdefault("Content-Length", str(len(body)))
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items() if v is not None)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def send(port: int, data: bytes, timeout: float = 30.0, *, drip: float = 0.0) -> Reply:
    """`data` to 127.0.0.1:`port` (one byte per `drip` s if set), then the reply until the server
    closes or `timeout` passes."""
    started = time.monotonic()
    chunks: list[bytes] = []
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            if drip:
                for i in range(len(data)):
                    s.sendall(data[i : i + 1])
                    time.sleep(drip)
                    if time.monotonic() - started > timeout:
                        break
            else:
                _send_until_answered(s, data)
            while time.monotonic() - started < timeout:
                s.settimeout(max(0.05, timeout - (time.monotonic() - started)))
                chunk = s.recv(1 << 16)
                if not chunk:
                    closed = True
                    break
                chunks.append(chunk)
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            closed = True
    raw = b"".join(chunks)
    status = None
    if raw.startswith(b"HTTP/"):
        status = int(raw.split(b" ", 2)[1])
    body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""
    return Reply(status, body, time.monotonic() - started, closed)


def _send_until_answered(s: socket.socket, data: bytes) -> None:
    """`data` in 64 KiB pieces, stopping early when the server answers first (a 413 to a body
    past its cap): reading that answer is the point, not sending the rest."""
    for i in range(0, len(data), 1 << 16):
        if select.select([s], [], [], 0.005)[0]:
            return
        s.sendall(data[i : i + (1 << 16)])


def call(
    port: int,
    method: str,
    path: str,
    payload: Any = None,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    raw_body: bytes | None = None,
    timeout: float = 30.0,
) -> Reply:
    """One request with a JSON body (or `raw_body`), the bearer `token` if given."""
    body = raw_body if raw_body is not None else (b"" if payload is None else json.dumps(payload).encode())
    head = dict(headers or {})
    if token is not None:
        head.setdefault("Authorization", f"Bearer {token}")
    return send(port, request_bytes(method, path, port, body, head), timeout)


def wait_ready(port: int, path: str, token: str, alive: Any, timeout: float = 180.0) -> bool:
    """Until GET `path` answers 200 (True), `alive()` turns False or `timeout` passes (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and alive():
        try:
            if call(port, "GET", path, token=token, timeout=5).status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth
