"""Output capture: byte-capped streams, the session's cell splitter, and the pump that moves bytes.

Every pipe of a sandbox is read concurrently through `pump` (a selector loop with a deadline),
so neither side can deadlock on a full pipe, and each stream keeps at most its cap in memory.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable, Mapping

from steprl.envs.sandbox.limits import ErrorKind, ExecResult

_CHUNK = 1 << 16
_REQUEST = ord("?")  # after the marker: a host-call request, not a cell status
_MAX_HEADER = 20  # digits of a request's size


class Capture:
    """Keeps the first 3/4 and the last 1/4 of `cap` bytes of a stream; memory stays O(cap)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.head_cap = cap, cap - cap // 4
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        take = max(0, min(len(data), self.head_cap - len(self.head)))
        self.head += data[:take]
        self.tail += data[take:]
        if len(self.tail) > self.cap - self.head_cap:
            del self.tail[: len(self.tail) - (self.cap - self.head_cap)]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def text(self) -> str:
        if not self.truncated:
            return (self.head + self.tail).decode("utf-8", "replace")
        cut = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {cut} bytes truncated (output cap {self.cap} bytes) ...]\n"
        return self.head.decode("utf-8", "replace") + marker + self.tail.decode("utf-8", "replace")


def exec_result(
    out: Capture,
    err: Capture,
    kind: ErrorKind,
    code: int | None,
    sig: int | None,
    t0: float,
    uid: int | None,
    *,
    timed_out: bool = False,
    note: str = "",
) -> ExecResult:
    return ExecResult(
        stdout=out.text(),
        stderr=err.text() + note,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        exit_code=code,
        signal=sig,
        timed_out=timed_out,
        duration_s=time.monotonic() - t0,
        error=kind,
        sandbox_uid=uid,
    )


class CellStream:
    """Splits a session stream into cells at `<marker><status>\\n` (written by the server).

    With `on_request` (the stdout of a session with host calls), a `<marker>?<n>\\n` frame
    and the n bytes after it are a host-call request (see `rpc.py`): taken out of the cell's
    output and handed to `on_request`. A frame that breaks that format (or `max_request`) sets
    `violation`, and the rest of the stream is ignored: the session kills the interpreter.
    """

    def __init__(
        self, marker: bytes, on_request: Callable[[bytes], None] | None = None, max_request: int = 0
    ) -> None:
        self.marker, self.carry = marker, b""
        self.capture = Capture(1)
        self.status: int | None = None
        self.on_request, self.max_request = on_request, max_request
        self.violation: str | None = None

    def start(self, cap: int) -> Capture:
        """Begin a cell: output carried over from after the last marker counts toward it."""
        self.capture, self.status = Capture(cap), None
        pending, self.carry = self.carry, b""
        self.feed(pending)
        return self.capture

    def feed(self, data: bytes) -> None:
        buf = self.carry + data
        while self.violation is None:  # a loop, not recursion: a chunk may hold many frames
            if self.status is not None:  # after this cell's marker: keep (bounded) for the next cell
                self.carry = buf[-self.capture.cap :]
                return
            i = buf.find(self.marker)
            j = i + len(self.marker)
            if i >= 0 and self.on_request is not None and len(buf) > j and buf[j] == _REQUEST:
                rest = self._request(buf, i, j)
                if rest is None:
                    return
                buf = rest
                continue
            if i >= 0 and len(buf) >= j + 2:
                self.capture.feed(buf[:i])
                self.status, self.carry = buf[j] - ord("0"), b""
                buf = buf[j + 2 :]
                continue
            keep = len(buf) - i if i >= 0 else min(len(buf), len(self.marker) + 1)  # maybe a split marker
            self.capture.feed(buf[: len(buf) - keep])
            self.carry = buf[len(buf) - keep :]
            return

    def _request(self, buf: bytes, i: int, j: int) -> bytes | None:
        """Hand over the request frame at `i` (marker) / `j` ("?"); what follows it, or None
        when the frame is incomplete (held back) or malformed (`violation`)."""
        self.capture.feed(buf[:i])  # the output before the frame
        self.carry = buf[i:]
        newline = buf.find(b"\n", j + 1, j + 2 + _MAX_HEADER)
        if newline < 0:
            if len(buf) - j - 1 > _MAX_HEADER:
                self.violation = "malformed host-call header"
            return None
        size = buf[j + 1 : newline]
        if not size.isdigit() or int(size) > self.max_request:
            self.violation = f"host-call request of {size[:_MAX_HEADER]!r} bytes (max {self.max_request})"
            return None
        end = newline + 1 + int(size)
        if len(buf) < end:  # held back until complete: at most max_request bytes
            return None
        self.carry = b""
        assert self.on_request is not None
        self.on_request(buf[newline + 1 : end])
        return buf[end:]

    def flush(self) -> None:
        """The stream ended without a marker: what was held back is output too."""
        if self.status is None:
            self.capture.feed(self.carry)
            self.carry = b""


class Outbox:
    """Bytes for one pipe, written by `pump` without blocking; more may be queued meanwhile.

    `on_drained` runs each time everything queued so far is written, or once the reader is
    gone (later bytes are then dropped).
    """

    def __init__(self, fd: int, data: bytes = b"", on_drained: Callable[[], None] | None = None) -> None:
        self.fd, self.buf, self.broken = fd, bytearray(data), False
        self.on_drained = on_drained or _noop

    @property
    def pending(self) -> int:
        return len(self.buf)

    def push(self, data: bytes) -> None:
        if not self.broken:
            self.buf += data

    def write_some(self) -> bool:
        """One non-blocking write; True when the queue is now empty (or the reader is gone)."""
        try:
            del self.buf[: os.write(self.fd, self.buf[:_CHUNK])]
        except BlockingIOError:
            return False
        except BrokenPipeError:
            self.broken = True
            self.buf.clear()
        return not self.buf


def _noop() -> None:
    pass


def pump(
    reads: Mapping[int, Callable[[bytes], None]],
    deadline: float,
    *,
    write: Outbox | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> str:
    """Move bytes until `stop()`, EOF on every read fd, or the deadline: "stop"|"eof"|"deadline".

    `write` is fed without blocking, so neither side can deadlock on a full pipe; the read
    callbacks may queue more on it (host-call replies). Its `on_drained` runs when all of it is
    written (at once if it starts empty).
    """
    with selectors.DefaultSelector() as sel:
        for fd in reads:
            sel.register(fd, selectors.EVENT_READ)
        writing = False
        if write is not None:
            os.set_blocking(write.fd, False)
            if not write.pending:
                write.on_drained()
        while not stop():
            if write is not None and bool(write.pending) != writing:
                writing = not writing
                if writing:
                    sel.register(write.fd, selectors.EVENT_WRITE)
                else:
                    sel.unregister(write.fd)
            if not any(k.events & selectors.EVENT_READ for k in sel.get_map().values()):
                return "eof"
            left = deadline - time.monotonic()
            if left <= 0:
                return "deadline"
            for key, _ in sel.select(left):
                if key.fd in reads:
                    chunk = os.read(key.fd, _CHUNK)
                    if chunk:
                        reads[key.fd](chunk)
                    else:
                        sel.unregister(key.fd)
                    continue
                assert write is not None
                if write.write_some():
                    sel.unregister(key.fd)
                    writing = False
                    write.on_drained()
        return "stop"
