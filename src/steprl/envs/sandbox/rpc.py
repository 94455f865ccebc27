"""Host calls from a session cell: the sandboxed code asks, the host answers, the cell goes on.

A session opened with `rpc=Rpc(handler)` gives its cells a module `sandbox_host`:

    import sandbox_host
    reply = sandbox_host.call({"name": "contacts_search", "arguments": {"query": "Al"}})

`call` sends one JSON value and blocks until the host's `handler` returns one JSON value, or
raises `sandbox_host.RpcError(message)` when the handler refused (raised `RpcError`) or a limit
was hit. Nothing but these JSON values crosses: the handler's resources (an episode database,
say) stay on the host. The wire uses the session's existing channels, no extra descriptor:

* request, sandbox -> host, on stdout: ``<marker>?<n>\\n`` + n bytes of UTF-8 JSON, taken out of
  the cell's captured output by the host (`capture.CellStream`);
* reply, host -> sandbox, on the control channel (stdin): ``<n>\\n`` + n bytes of JSON,
  ``{"ok": value}`` or ``{"error": message}``.

Bounds, per cell: at most `max_calls` requests reach the handler (later ones are answered with
an error); the stub refuses requests over `max_request_bytes` in the sandbox; replies over
`max_response_bytes` are replaced by an error. The stub makes one call at a time (a lock) and
only while a cell runs, so a reply is always read before the next request. A frame that breaks
this (a forged header, a request over the size limit, a request sent before the last reply was
read) kills the interpreter: `ErrorKind.PROTOCOL_ERROR`. The handler runs in the thread that
called `SandboxSession.run`, within the cell's wall-clock deadline; an exception other than
`RpcError` kills the interpreter and propagates from `run` (an infrastructure failure).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

_MAX_ERROR_CHARS = 1000


class RpcError(Exception):
    """Raised by an RPC handler to refuse a request: the sandboxed caller gets the message as
    `sandbox_host.RpcError` (a model error, not an infrastructure failure)."""


@dataclass(frozen=True)
class Rpc:
    """What a session's cells may ask the host: `handler(request) -> reply` (JSON values)."""

    handler: Callable[[Any], Any]
    max_calls: int = 64  # per cell; later calls are answered with an error
    max_request_bytes: int = 64 * 1024  # one request's JSON; the stub refuses bigger ones
    max_response_bytes: int = 256 * 1024  # one reply's JSON; bigger replies become an error

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "handler" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Rpc.{f.name} must be an int >= 1, got {value!r}")


# Appended to the session's server (before its main loop) when the session has `rpc`. Uses the
# server's `marker`, `ctl` and `read_exact`; overrides its `begin_cell` / `end_cell` hooks.
_STUB = r"""
import json, threading, types
rpc_lock = threading.Lock()
rpc_open = False

class RpcError(Exception):
    "The host refused a call, or a limit was hit; the message says which."

RpcError.__module__ = "sandbox_host"

def host_call(request):
    "Send one JSON value to the host; returns its JSON reply, or raises RpcError."
    data = json.dumps(request, separators=(",", ":")).encode()
    if len(data) > MAX_REQUEST:
        raise RpcError(f"request too large ({len(data)} bytes, max MAX_REQUEST)")
    with rpc_lock:
        if not rpc_open:
            raise RpcError("the host answers calls only while a cell runs")
        view = memoryview(marker + b"?%d\n" % len(data) + data)
        while view:
            view = view[os.write(1, view):]
        reply = json.loads(read_exact(int(ctl.readline())))
    if "error" in reply:
        raise RpcError(reply["error"])
    return reply["ok"]

host = types.ModuleType("sandbox_host", "Calls into the host: call(request) -> reply (JSON values).")
host.call, host.RpcError = host_call, RpcError
sys.modules["sandbox_host"] = host

def begin_cell():
    global rpc_open
    with rpc_lock:
        rpc_open = True

def end_cell():  # waits for a call in flight in another thread: its reply precedes the marker
    global rpc_open
    with rpc_lock:
        rpc_open = False
"""


def stub_source(rpc: Rpc) -> str:
    return _STUB.replace("MAX_REQUEST", str(rpc.max_request_bytes))


class RpcCell:
    """The host side of one cell's calls: decode, count, ask the handler, encode the reply."""

    def __init__(self, rpc: Rpc) -> None:
        self.rpc, self.requests, self.handled = rpc, 0, 0

    def answer(self, payload: bytes) -> bytes:
        """The reply frame for one request (the handler's own exceptions propagate)."""
        body = json.dumps(self._reply(payload), separators=(",", ":"), allow_nan=False).encode()
        if len(body) > self.rpc.max_response_bytes:
            error = f"reply too large ({len(body)} bytes, max {self.rpc.max_response_bytes}); ask for less"
            body = json.dumps({"error": error}).encode()
        return b"%d\n" % len(body) + body

    def _reply(self, payload: bytes) -> dict[str, Any]:
        self.requests += 1
        if self.requests > self.rpc.max_calls:
            return {"error": f"too many calls in one cell (max {self.rpc.max_calls})"}
        try:
            request = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return {"error": "malformed request (not JSON)"}
        self.handled += 1
        try:
            return {"ok": self.rpc.handler(request)}
        except RpcError as exc:
            return {"error": (str(exc) or "refused")[:_MAX_ERROR_CHARS]}
