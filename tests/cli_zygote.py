"""`steprl` commands for the suite, forked from a process that has already imported steprl.

Importing torch, transformers and steprl takes about 8 s (transformers alone scans 3,000 files
for its lazy imports), most of a small CLI test's time, and the suite runs `steprl` a few hundred
times. One server per test process imports them once and forks a child per command; the child
runs `steprl.cli:main` as the console script does, in a process of its own: its pid, argv, cwd,
environment, stdin/stdout/stderr, exit code, signals and atexit handlers are the command's.

What a fork cannot give is a fresh import, so a command runs as a real subprocess instead when
its environment differs from the server's in anything read at import time (only PYTHONPATH,
PYTHONUNBUFFERED, COLUMNS/LINES and STEPRL_*/WANDB_*/RAY_*/PYTEST_* may differ), when it is not
`steprl`, or with STEPRL_TEST_FORK=0. Tests of import-time behaviour (extras, `python -m`) call
subprocess themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

STEPRL = str(Path(sys.executable).parent / "steprl")
#: the other spelling of the entry point in the tests
_INLINE = (sys.executable, "-c", "from steprl.cli import main; main()")
_MAY_DIFFER = ("PYTHONPATH", "PYTHONUNBUFFERED", "COLUMNS", "LINES")
_MAY_DIFFER_PREFIX = ("STEPRL_", "WANDB_", "RAY_", "PYTEST_")
#: what every command imports before it does anything (steprl.cli imports lazily)
_PRELOAD = (
    "torch",
    "transformers.models.llama.modeling_llama",
    "steprl.cli",
    "steprl.config",
    "steprl.training.loop.trainer",
    "steprl.training.setup.build",
    "steprl.report.build",
)


# ---- the server (this file run as a script) -----------------------------------------------------
def _serve(path: str, parent: int) -> tuple[dict[str, Any], list[int]]:
    """Import, then fork a child per request; returns only in a child, with its request."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise SystemExit(f"cli_zygote: imports started threads {threading.enumerate()}; cannot fork")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    waiting: dict[int, socket.socket] = {}  # child pid -> its client's connection
    while True:
        ready, _, _ = select.select([server], [], [], 0.05)
        if ready:
            conn, _ = server.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                return json.loads(msg), fds
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # its client may be gone
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                conn.close()
        if os.getppid() != parent:  # the test process died: so do we, and what we forked
            for pid in waiting:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(0)


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the child: take the command's streams, session, cwd, environment and argv."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    # the console script's folder first (not tests/, this file's), then PYTHONPATH
    sys.path[0:1] = [str(Path(STEPRL).parent), *extra]
    sys.argv = [STEPRL, *request["args"]]
    # stdout buffered as the interpreter would for this environment (a pipe or a file)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    raw = open(1, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(raw, encoding=sys.stdout.encoding, write_through=unbuffered)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- the client -----------------------------------------------------------------------------------
class _Server:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="steprl-zygote-")
        self.path = os.path.join(self.dir, "s")
        self.env = {**os.environ, "COLUMNS": "400"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, str(os.getpid())],
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.proc.kill()
            raise RuntimeError(f"cli_zygote did not start: {line!r} (rc {self.proc.wait()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        if not os.path.isdir(self.dir):  # closed already (a reset, then the exit hook)
            return
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


_server: _Server | None = None
_lock = threading.Lock()


def _same(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    """Whether a process started with environment `a` imports as one started with `b` would."""
    for key in set(a) | set(b):
        differs = a.get(key) != b.get(key)
        if differs and key not in _MAY_DIFFER and not key.startswith(_MAY_DIFFER_PREFIX):
            return False
    return True


def _get_server() -> _Server:
    """The server, started again when it died or when this process's environment changed in
    something an import may read (an in-process run sets CUBLAS_WORKSPACE_CONFIG, for one)."""
    global _server
    with _lock:
        if _server is None or not _server.alive() or not _same(os.environ, _server.env):
            if _server is not None:
                _server.close()
            _server = _Server()
            atexit.register(_server.close)
        return _server


def _steprl_args(args: Sequence[str]) -> list[str] | None:
    """The arguments after `steprl` when `args` runs the entry point, else None."""
    words = [str(a) for a in args]
    if words[:1] == [STEPRL]:
        return words[1:]
    if tuple(words[:3]) == _INLINE:
        return words[3:]
    return None


def _forkable(args: Sequence[str], env: Mapping[str, str] | None) -> bool:
    """A `steprl` command whose environment imports as this process's (the server's) would."""
    if os.environ.get("STEPRL_TEST_FORK", "1") == "0" or _steprl_args(args) is None:
        return False
    return env is None or _same(env, os.environ)


class Forked:
    """The part of `subprocess.Popen` the tests use, for a command the server forked."""

    def __init__(
        self, args: Sequence[str], conn: socket.socket, pid: int, out: IO[Any] | None, err: IO[Any] | None
    ):
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = out
        self.stderr = err
        self._conn = conn

    def _take(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        data = self._conn.recv(64)
        self._conn.close()
        # an empty answer: the server died before the child ended (it kills the child then)
        self.returncode = int(data) if data else -signal.SIGKILL
        return True

    def poll(self) -> int | None:
        self._take(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._take(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {s.fileno(): s for s in (self.stdout, self.stderr) if s is not None and not s.closed}
        chunks: dict[int, list[bytes]] = {fd: [] for fd in streams}
        while streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(streams), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    del streams[fd]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = []
        for s in (self.stdout, self.stderr):
            if s is None:
                out.append(None)
                continue
            raw = b"".join(chunks.get(s.fileno(), []))
            out.append(raw.decode() if isinstance(s, io.TextIOBase) else raw)
            s.close()
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def popen(args: Sequence[str], **kw: Any) -> Any:
    """`subprocess.Popen(args, **kw)`, forked from the server when it is a `steprl` command.
    Takes cwd, env, stdout/stderr (None, PIPE, STDOUT, DEVNULL or a file), text and
    start_new_session; anything else runs a real subprocess."""
    known = {"cwd", "env", "stdout", "stderr", "text", "start_new_session"}
    if set(kw) - known or not _forkable(args, kw.get("env")):
        return subprocess.Popen(args, **kw)
    text = bool(kw.get("text"))
    mine: list[int] = []  # our ends of pipes, kept; theirs are closed once sent
    sent: list[int] = [os.open(os.devnull, os.O_RDONLY)]
    to_close = [sent[0]]
    stdout_fd: int | None = None
    for which in ("stdout", "stderr"):
        how = kw.get(which)
        if how is None:
            fd = os.dup(1 if which == "stdout" else 2)
        elif how == subprocess.PIPE:
            r, fd = os.pipe()
            mine.append(r)
        elif how == subprocess.STDOUT:
            assert stdout_fd is not None
            fd = os.dup(stdout_fd)
        elif how == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY)
        else:
            fd = os.dup(how if isinstance(how, int) else how.fileno())
        if how != subprocess.PIPE:
            mine.append(-1)
        if which == "stdout":
            stdout_fd = fd
        sent.append(fd)
        to_close.append(fd)
    env = dict(os.environ if kw.get("env") is None else kw["env"])
    request = {
        "args": _steprl_args(args),
        "cwd": str(kw.get("cwd") or os.getcwd()),
        "env": env,
        "new_session": bool(kw.get("start_new_session")),
    }
    server = _get_server()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(server.path)
    socket.send_fds(conn, [json.dumps(request).encode()], sent)
    for fd in to_close:
        os.close(fd)
    pid = int(conn.recv(64))
    out, err = ((open(fd, "r" if text else "rb") if fd >= 0 else None) for fd in mine)  # noqa: SIM115
    return Forked(args, conn, pid, out, err)


def run(args: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run(args, **kw)`, forked from the server when it is a `steprl` command whose
    output is captured as text (capture_output=True, text=True; cwd, env, timeout, check=False)."""
    known = {"cwd", "env", "timeout", "capture_output", "text", "check"}
    captured = kw.get("capture_output") and kw.get("text") and not kw.get("check")
    if set(kw) - known or not captured or not _forkable(args, kw.get("env")):
        return subprocess.run(args, **kw)
    cwd, env, timeout = kw.get("cwd"), kw.get("env"), kw.get("timeout")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(args, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            args, proc.wait(), out.read().decode(errors="replace"), err.read().decode(errors="replace")
        )


def _run_main() -> None:
    """`sys.exit(main())` with the interpreter's exit, less its module teardown (1.3 s with torch
    loaded, nothing a command can observe): what `SystemExit` prints, an uncaught exception's
    traceback and exit 1, Ctrl-C's death by SIGINT, non-daemon threads joined, atexit handlers
    run, streams flushed."""
    from steprl.cli import main

    code: Any = 0
    interrupted = False
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    _request, _fds = _serve(sys.argv[1], int(sys.argv[2]))
    _become(_request, _fds)
    _run_main()
