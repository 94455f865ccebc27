"""`SandboxSession`: one long-lived sandboxed interpreter per trajectory, and its in-sandbox server.

The server (`_SESSION_SERVER`, run as /sandbox/main.py) reads cells from a control channel and
runs them in one set of globals; the host splits its stdout/stderr into cells at a nonce
marker (`capture.CellStream`). With `rpc`, cells can call back into the host (`rpc.py`); a
`prelude` is a hidden first cell, run again whenever the interpreter restarts.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import weakref
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol

from steprl.envs.sandbox.capture import Capture, CellStream, Outbox, exec_result, pump
from steprl.envs.sandbox.limits import ErrorKind, ExecResult, SandboxLimits, SandboxUnavailable
from steprl.envs.sandbox.rpc import Rpc, RpcCell, stub_source
from steprl.envs.sandbox.runner import Runner, await_start, classify, kill_depth, kill_sandbox


class SessionHost(Protocol):
    """What a session needs of the `Sandbox` that opens it (declared here so that only `box.py`
    imports this module, never the reverse): the operator's maximum limits, whether code can be
    confined, the runner (command line, uid pool) and the admission slots a cell holds while it runs."""

    @property
    def max_limits(self) -> SandboxLimits: ...

    @property
    def runner(self) -> Runner: ...

    @property
    def slots(self) -> AbstractContextManager[Any]: ...

    def confined(self) -> bool: ...


# The session's server, run as /sandbox/main.py inside the sandbox. Protocol: the host writes
# b"<len>\n<utf-8 code>" on stdin; after the cell the server writes <marker><0|1>\n on both
# stdout and stderr. Cells see /dev/null as stdin. A cell that learns the marker can only garble
# its own output (and, with host calls, make its own calls or kill its own interpreter).
_SESSION_SERVER = r"""
import ast, builtins, os, sys, traceback
marker = b"\x1e" + b"NONCE" + b"\x1e"
ctl = os.fdopen(os.dup(0), "rb", buffering=0)
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
env = {"__name__": "__main__", "__builtins__": builtins}
begin_cell = end_cell = lambda: None

def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = ctl.read(n - len(buf))
        if not chunk:
            raise SystemExit(0)
        buf += chunk
    return buf

def run_cell(src):
    tree = ast.parse(src, "<cell>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), env)
    if last is not None:  # like a REPL: show the value of a trailing expression
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), env)
        if value is not None:
            print(repr(value))
#RPC
while True:
    header = ctl.readline()
    if not header:
        break
    src = read_exact(int(header)).decode("utf-8", "replace")
    status = b"0"
    begin_cell()
    try:
        run_cell(src)
    except BaseException as exc:  # a cell never ends the session, not even SystemExit
        status = b"1"
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
    end_cell()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:
            pass
    os.write(1, marker + status + b"\n")
    os.write(2, marker + status + b"\n")
"""


class SandboxSession:
    """A stateful sandboxed interpreter for ONE trajectory (ToRL / Jupyter style).

    Each `run(code)` executes in the same globals of one long-lived sandboxed process; a new
    session is a new sandbox, so no state crosses trajectories. A trailing expression's repr is
    printed; an exception is printed and the session goes on. The wall deadline and the output
    cap apply per cell (past the cap the cell's output is truncated and the cell continues). A
    cell timeout kills the interpreter: later cells return `session_dead`, or with
    `auto_restart=True` run in a fresh interpreter behind an "[interpreter restarted; state
    lost ...]" line on stderr. `cpu_s` bounds the CPU time of the whole session. Use as a
    context manager or call `close()`.

    `rpc`: cells may call the host's `rpc.handler` through `import sandbox_host` (see `rpc.py`
    for the protocol and its bounds). `prelude`: code run as a hidden cell whenever an
    interpreter starts (e.g. to define helpers over `sandbox_host`); if it fails, the session
    raises RuntimeError.
    """

    def __init__(
        self,
        sandbox: SessionHost,
        limits: SandboxLimits | None = None,
        *,
        auto_restart: bool = False,
        rpc: Rpc | None = None,
        prelude: str = "",
    ) -> None:
        if not sandbox.confined():
            raise SandboxUnavailable("SandboxSession needs bubblewrap; there is no unconfined session mode")
        self._sandbox, self.auto_restart = sandbox, auto_restart
        self.limits = sandbox.max_limits.clamp(limits) if limits else sandbox.max_limits
        self.rpc, self.prelude = rpc, prelude
        self._lock = threading.Lock()
        self._cells = 0
        self._start()

    def _start(self) -> None:
        runner = self._sandbox.runner
        self._uid = uid = runner.take_uid()
        nonce = os.urandom(16).hex()
        server = _SESSION_SERVER.replace("#RPC", stub_source(self.rpc) if self.rpc else "")
        try:
            proc, status = runner.spawn(
                server.replace("NONCE", nonce), self.limits, uid, stdin=True, session=True
            )
        except BaseException:
            runner.give_uid(uid)
            raise
        self._proc = proc
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, _close_session, proc, status, runner, uid)
        if not await_start(status, 10.0):
            kill_sandbox(proc, kill_depth(uid))
            err = Capture(4096)
            assert proc.stderr is not None
            pump({proc.stderr.fileno(): err.feed}, time.monotonic() + 0.5)
            self._finalizer()
            raise SandboxUnavailable(f"the session's sandbox did not start: {err.text().strip()!r}")
        marker = b"\x1e" + nonce.encode() + b"\x1e"
        max_request = self.rpc.max_request_bytes if self.rpc else 0
        self._out, self._err = CellStream(marker, max_request=max_request), CellStream(marker)
        if self.prelude:
            with self._sandbox.slots:
                ready = self._run_cell(self.prelude, hidden=True)
            if not ready.ok:
                self.close()
                raise RuntimeError(
                    f"the session prelude failed ({ready.error.value}): {ready.stderr.strip()[-500:]!r}"
                )

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    def restart(self) -> None:
        """Replace the interpreter with a fresh one (all state is lost)."""
        self.close()
        self._start()

    def run(self, code: str) -> ExecResult:
        """Execute one cell in the session's globals."""
        with self._lock:
            note = ""
            if self._dead is not None and self.auto_restart:
                note = f"[interpreter restarted; state lost ({self._dead})]\n"
                self.restart()
            if self._dead is not None:
                msg = (
                    f"the sandboxed interpreter is gone ({self._dead}); its state is lost. "
                    "Call restart() or start a new SandboxSession."
                )
                empty = Capture(1)
                return exec_result(
                    empty, empty, ErrorKind.SESSION_DEAD, None, None, time.monotonic(), self._uid, note=msg
                )
            with self._sandbox.slots:
                result = self._run_cell(code)
            return replace(result, stderr=note + result.stderr) if note else result

    def _run_cell(self, code: str, *, hidden: bool = False) -> ExecResult:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self._cells += not hidden
        data = code.encode("utf-8", "surrogatepass")
        inbox = Outbox(proc.stdin.fileno(), b"%d\n" % len(data) + data)
        calls = RpcCell(self.rpc) if self.rpc else None
        if calls is not None:
            self._out.on_request = lambda payload: self._answer(calls, inbox, payload)
        t0 = time.monotonic()
        try:
            out, err = self._out.start(self.limits.output_bytes), self._err.start(self.limits.output_bytes)
            outcome = pump(
                {proc.stdout.fileno(): self._out.feed, proc.stderr.fileno(): self._err.feed},
                t0 + self.limits.wall_s,
                write=inbox,
                stop=self._cell_done,
            )
        except BaseException as exc:  # the host side failed (the RPC handler, say): the cell cannot go on
            self._end(f"the host failed in cell {self._cells}: {type(exc).__name__}")
            raise
        finally:
            self._out.on_request = None  # no reference cycle through the session's finalizer
        handled = calls.handled if calls is not None else 0
        if outcome == "stop" and self._out.violation is None:
            status = self._out.status or 0
            kind = ErrorKind.OUTPUT_LIMIT if out.truncated or err.truncated else ErrorKind.OK
            if status and kind is ErrorKind.OK and "MemoryError" in err.text()[-2000:]:
                kind = ErrorKind.OOM
            return replace(exec_result(out, err, kind, status, None, t0, self._uid), rpc_calls=handled)
        if outcome == "stop":  # broke the host-call protocol: the interpreter cannot be trusted on
            self._end(f"cell {self._cells} broke the host-call protocol: {self._out.violation}")
            note = f"\n[{self._dead}; session state lost]\n"
            result = exec_result(out, err, ErrorKind.PROTOCOL_ERROR, None, None, t0, self._uid, note=note)
            return replace(result, rpc_calls=handled)
        # Timed out (we kill the interpreter) or died by itself: either way the session is over.
        kill_sandbox(proc, kill_depth(self._uid))
        self._out.flush()
        self._err.flush()
        kind, exit_code, sig = classify(proc.returncode, err.text(), outcome, True)
        how = f"signal {sig}" if sig else f"exit code {exit_code}"
        timed_out = outcome == "deadline"
        self._end(
            f"cell {self._cells} timed out after {self.limits.wall_s:g}s"
            if timed_out
            else f"interpreter died in cell {self._cells}: {how}"
        )
        note = f"\n[{self._dead}; session state lost]\n"
        result = exec_result(out, err, kind, exit_code, sig, t0, self._uid, timed_out=timed_out, note=note)
        return replace(result, rpc_calls=handled)

    def _answer(self, calls: RpcCell, inbox: Outbox, payload: bytes) -> None:
        if inbox.pending:  # the code or the last reply is not read yet: not our stub's doing
            self._out.violation = "a request was sent before the previous reply was read"
            return
        inbox.push(calls.answer(payload))

    def _end(self, why: str) -> None:
        """Kill the interpreter (state lost) and say why in later results."""
        kill_sandbox(self._proc, kill_depth(self._uid))
        self._dead = why
        self._finalizer()

    def _cell_done(self) -> bool:
        return (self._out.status is not None and self._err.status is not None) or bool(self._out.violation)

    def close(self) -> None:
        """Stop the interpreter and release its uid. Idempotent."""
        if self._dead is None:
            self._dead = "session closed"
        self._finalizer()

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_session(proc: subprocess.Popen[bytes], status: int, runner: Runner, uid: int | None) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # EOF on the control channel: the server exits by itself
    try:
        proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        kill_sandbox(proc, kill_depth(uid))
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    os.close(status)
    runner.give_uid(uid)
