"""Run model-written Python confined by bubblewrap: one-shot runs and stateful sessions.

    box = Sandbox(SandboxLimits(wall_s=3.0))   # the operator's maximums; probes the host once
    res = box.run("print(1 + 1)")              # ExecResult(stdout="2\\n", error=ErrorKind.OK, ...)
    with box.session() as s:                   # one interpreter per trajectory
        s.run("x = 41"); s.run("x + 1")        # .stdout == "42\\n"

Design (reference/reliability.md §1.3; every point is backed by a SBX test):

* As root, the command line is `setpriv --pdeathsig` > `prlimit` (CPU, AS, FSIZE, NOFILE, NPROC,
  CORE=0) > `unshare --pid --setuid` (a per-run outside uid from a pool: never root, since
  RLIMIT_NPROC binds neither root nor a user namespace mapped to outside root) > `bwrap` (new
  user, PID, network, IPC, UTS namespaces; `--die-with-parent`, `--new-session`,
  `--disable-userns`, no capabilities, a cleared environment, read-only `/usr` = the interpreter
  and system libs and nothing else of the host, a size-capped tmpfs `/tmp` as the working dir)
  > `python3 -I`. Each helper execs the next: Popen is a vfork+exec, with no `preexec_fn` in a
  threaded parent.
* A wall-clock deadline (from exec start, not from the admission queue) SIGKILLs the PID
  namespace that holds the whole sandbox: every descendant dies, `setsid`/double-fork escapes
  included, and all are reaped inside the tree, so no zombie reaches the host's PID 1.
* stdout/stderr are read concurrently with a byte cap (head and tail kept, decoded with
  `errors="replace"`); a flood past the cap kills the run (`output_limit`), never deadlocks.

Not enforced here: no seccomp filter (bwrap's `--seccomp` needs a per-Python allow-list: a second
layer, not the first) and no memory/pids cgroup (RLIMIT_AS and the per-uid RLIMIT_NPROC bound
memory and processes instead; `oom` is read from `MemoryError`/ENOMEM in the traceback). Not as
root, there is no per-run uid: no RLIMIT_NPROC (it would count this user's own processes) and
no outer PID namespace, so bwrap's helper may be orphaned to PID 1 after a kill; the probe says
so. Each process's uid pool starts at a random offset of the range; two processes sharing a
range could, rarely, share a uid (and so an NPROC budget).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import select
import selectors
import shutil
import signal as _signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

logger = logging.getLogger(__name__)

_MIB = 1 << 20
_INNER_ID = 1000  # uid/gid the code sees inside its user namespace (not 65534, the overflow id)
_HELPER_PROCS = 2  # bwrap's outer monitor and the namespace's init count against RLIMIT_NPROC
_CHUNK = 1 << 16
_FIX_BWRAP = "install it: `apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"
_FIX_USERNS = (
    "enable unprivileged user namespaces: `sysctl -w user.max_user_namespaces=15000`, "
    "`sysctl -w kernel.unprivileged_userns_clone=1` (older Debian), "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04)"
)
_FIX_UTIL = "install util-linux (`apt-get install util-linux`): it provides setpriv, prlimit and unshare"


class SandboxUnavailable(RuntimeError):
    """This host cannot confine code; the message says which guarantee is missing and the fix."""


class ErrorKind(StrEnum):
    """Why a run ended, from the sandbox's point of view (the code's own result is `exit_code`)."""

    OK = "ok"  # the interpreter exited by itself (exit_code may still be non-zero)
    TIMEOUT = "timeout"  # wall-clock deadline hit; the whole namespace was killed
    KILLED = "killed"  # died by a signal the harness did not send (SIGXCPU from the CPU limit, ...)
    OOM = "oom"  # MemoryError / ENOMEM under the address-space limit
    OUTPUT_LIMIT = "output_limit"  # stdout or stderr passed the cap (one-shot: killed there)
    SANDBOX_ERROR = "sandbox_error"  # bwrap could not start the code: infra failure, not the policy's
    SESSION_DEAD = "session_dead"  # a session cell after the interpreter died: state is lost


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run (or, for a session, per cell where noted)."""

    wall_s: float = 5.0  # wall-clock deadline per run / per session cell
    cpu_s: float = 5.0  # RLIMIT_CPU soft limit (SIGXCPU; hard = soft + 1); a session's total
    address_space_bytes: int = 512 * _MIB  # RLIMIT_AS per process
    file_size_bytes: int = 16 * _MIB  # RLIMIT_FSIZE: largest single file (EFBIG past it)
    open_files: int = 256  # RLIMIT_NOFILE
    max_processes: int = 64  # RLIMIT_NPROC for the run's uid, the interpreter included
    tmpfs_bytes: int = 16 * _MIB  # size of the /tmp working dir (ENOSPC past it)
    output_bytes: int = 64 * 1024  # cap per stream (stdout, stderr), per run / per session cell

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SandboxLimits.{f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be finite and > 0, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise TypeError(f"SandboxLimits.{f.name} must be an int (bytes/count), got {value!r}")

    def clamp(self, requested: SandboxLimits) -> SandboxLimits:
        """`requested` (possibly model-supplied) limited fieldwise to these operator maximums."""
        return replace(
            requested,
            **{f.name: min(getattr(requested, f.name), getattr(self, f.name)) for f in fields(self)},
        )


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one run or session cell. Output is capped and decoded with `replace`."""

    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    exit_code: int | None  # None when the interpreter died by a signal
    signal: int | None  # e.g. 9 (SIGKILL), 24 (SIGXCPU); an exit status 128+n is read as signal n
    timed_out: bool  # the wall-clock deadline fired
    duration_s: float  # from exec start (after admission), not from enqueue
    error: ErrorKind
    sandbox_uid: int | None = None  # the outside uid the run used (None: no per-run uid)

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited 0."""
        return self.error is ErrorKind.OK and self.exit_code == 0


@dataclass(frozen=True)
class SandboxCapabilities:
    """Which guarantees this host enforces. `problems` maps a missing one to why + how to fix.

    Guarantees: bwrap, python, user_namespace, pid_namespace, net_namespace, tmpfs_size,
    rlimits, per_run_uid.
    """

    bwrap: str | None
    python: str
    user_namespace: bool
    pid_namespace: bool
    net_namespace: bool
    tmpfs_size: bool
    rlimits: bool
    per_run_uid: bool
    problems: tuple[tuple[str, str], ...] = ()

    @property
    def usable(self) -> bool:
        """bwrap can confine code here (filesystem, PID and network isolation all hold)."""
        return bool(self.bwrap) and self.user_namespace and self.pid_namespace and self.net_namespace

    def reason(self, guarantee: str) -> str | None:
        """Why `guarantee` cannot be enforced here (with the fix), or None when it holds."""
        return next((why for name, why in self.problems if name == guarantee), None)


# ---------------------------------------------------------------------------------------------
# Capability probe


_PROBE = r"""
import json, os, resource
st = os.statvfs("/tmp")
print(json.dumps({
    "uid": os.getuid(), "pids": sum(p.isdigit() for p in os.listdir("/proc")),
    "ifaces": [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]],
    "tmp": st.f_blocks * st.f_frsize, "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
}))
"""


def probe_capabilities(bwrap: str | None = None, python: str = "/usr/bin/python3") -> SandboxCapabilities:
    """Check which guarantees hold on this host, by running a real sandboxed probe (once; cached).

    Each missing guarantee is logged as a warning naming it and the fix. `bwrap` defaults to the
    one on PATH; `python` is the interpreter used *inside* and must live under /usr.
    """
    return _probe(bwrap or "bwrap", python)


@functools.cache
def _probe(bwrap: str, python: str) -> SandboxCapabilities:
    problems: list[tuple[str, str]] = []
    path = shutil.which(bwrap)
    tools = all(shutil.which(t) for t in ("setpriv", "prlimit", "unshare"))
    blocker = None  # why nothing at all can be confined
    if path is None:
        blocker = f"bubblewrap (`{bwrap}`) not found, nothing is confined; {_FIX_BWRAP}"
        problems.append(("bwrap", blocker))
    elif not (python.startswith("/usr/") and os.access(python, os.X_OK)):
        blocker = (
            f"{python} is not an executable under /usr, the only host tree the sandbox sees; "
            "`apt-get install python3-minimal`"
        )
        problems.append(("python", blocker))
    elif not tools:
        blocker = f"setpriv/prlimit/unshare missing, so no uid drop and no rlimits; {_FIX_UTIL}"
    per_run_uid = os.geteuid() == 0 and tools
    if os.geteuid() != 0:
        problems.append(("per_run_uid", "not root: all runs share this user's uid, so RLIMIT_NPROC cannot "
                                        "bound a fork bomb; run the sandbox host as root"))  # fmt: skip
    found: dict[str, Any] = {}
    if blocker is None:
        limits = SandboxLimits(wall_s=10, tmpfs_bytes=8 * _MIB, file_size_bytes=3 * _MIB)
        runner = _Runner(path, python, per_run_uid)
        res = runner.execute(_PROBE, "", limits, runner.take_uid())
        try:
            found = json.loads(res.stdout)
        except ValueError:
            blocker = f"bwrap failed to start ({res.error}: {res.stderr.strip()[:300]!r}); {_FIX_USERNS}"
    new = "use bubblewrap >= 0.8"
    checks = {
        "user_namespace": (found.get("uid") == _INNER_ID, f"no user namespace, non-root uid; {_FIX_USERNS}"),
        "pid_namespace": (found.get("pids") in (1, 2), f"host processes are visible; {new}"),
        "net_namespace": (found.get("ifaces") == ["lo"], f"host network interfaces are visible; {new}"),
        "tmpfs_size": (found.get("tmp") == 8 * _MIB, f"tmpfs --size ignored: disk fill unbounded; {new}"),
        "rlimits": (found.get("fsize") == 3 * _MIB, f"rlimits were not applied; {_FIX_UTIL}"),
    }  # fmt: skip
    for name, (holds, why) in checks.items():
        if blocker is not None or not holds:
            problems.append((name, blocker or why))
    if blocker is not None and os.geteuid() == 0:
        problems.append(("per_run_uid", blocker))
    for name, why in problems:
        logger.warning("sandbox guarantee %r is NOT enforced on this host: %s", name, why)
    ok = {name: all(name != missing for missing, _ in problems) for name in (*checks, "per_run_uid")}
    return SandboxCapabilities(
        bwrap=path, python=python, user_namespace=ok["user_namespace"], pid_namespace=ok["pid_namespace"],
        net_namespace=ok["net_namespace"], tmpfs_size=ok["tmpfs_size"], rlimits=ok["rlimits"],
        per_run_uid=ok["per_run_uid"], problems=tuple(problems),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Output capture


class _Capture:
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


def _result(out: _Capture, err: _Capture, kind: ErrorKind, code: int | None, sig: int | None, t0: float,
            uid: int | None, *, timed_out: bool = False, note: str = "") -> ExecResult:  # fmt: skip
    return ExecResult(
        stdout=out.text(), stderr=err.text() + note, stdout_truncated=out.truncated,
        stderr_truncated=err.truncated, exit_code=code, signal=sig, timed_out=timed_out,
        duration_s=time.monotonic() - t0, error=kind, sandbox_uid=uid,
    )  # fmt: skip


class _CellStream:
    """Splits a session stream into cells at `<marker><status>\\n` (written by the server)."""

    def __init__(self, marker: bytes) -> None:
        self.marker, self.carry = marker, b""
        self.capture = _Capture(1)
        self.status: int | None = None

    def start(self, cap: int) -> _Capture:
        """Begin a cell: output carried over from after the last marker counts toward it."""
        self.capture, self.status = _Capture(cap), None
        pending, self.carry = self.carry, b""
        self.feed(pending)
        return self.capture

    def feed(self, data: bytes) -> None:
        buf = self.carry + data
        if self.status is not None:  # after this cell's marker: keep (bounded) for the next cell
            self.carry = buf[-self.capture.cap :]
            return
        i = buf.find(self.marker)
        end = i + len(self.marker) + 2
        if i >= 0 and len(buf) >= end:
            self.capture.feed(buf[:i])
            self.status, self.carry = buf[end - 2] - ord("0"), b""
            self.feed(buf[end:])
            return
        keep = len(buf) - i if i >= 0 else min(len(buf), len(self.marker) + 1)  # maybe a split marker
        self.capture.feed(buf[: len(buf) - keep])
        self.carry = buf[len(buf) - keep :]

    def flush(self) -> None:
        """The stream ended without a marker: what was held back is output too."""
        if self.status is None:
            self.capture.feed(self.carry)
            self.carry = b""


def _pump(
    reads: Mapping[int, Callable[[bytes], None]],
    deadline: float,
    *,
    write: tuple[int, bytes, Callable[[], None]] | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> str:
    """Move bytes until `stop()`, EOF on every read fd, or the deadline: "stop"|"eof"|"deadline".

    `write` = (fd, data, on_written): fed without blocking, so neither side can deadlock on a
    full pipe; `on_written` runs once all of it is written (or the reader went away).
    """
    with selectors.DefaultSelector() as sel:
        for fd in reads:
            sel.register(fd, selectors.EVENT_READ)
        pos, view = 0, memoryview(write[1] if write else b"")
        if write and view:
            os.set_blocking(write[0], False)
            sel.register(write[0], selectors.EVENT_WRITE)
        elif write:
            write[2]()
        while not stop():
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
                try:
                    pos += os.write(key.fd, view[pos : pos + _CHUNK])
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    pos = len(view)
                if pos >= len(view):
                    sel.unregister(key.fd)
                    write[2]()
        return "stop"


# ---------------------------------------------------------------------------------------------
# Process control


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _kill(proc: subprocess.Popen[bytes], depth: int) -> None:
    """Kill the whole sandbox and reap it, leaving no zombie behind, not even with the host's PID 1.

    Process tree: our child `unshare` > bwrap, PID 1 of namespace A > bwrap's init, PID 1 of
    namespace B > the code. SIGKILL to B's init makes the kernel kill everything in B (setsid and
    double-fork escapes included); bwrap reaps it and exits (128+9), which ends A; unshare reaps
    bwrap; we reap unshare. A exists for the normal exit: bwrap returns as soon as the code's
    exit status is known, while B's init may still be reaping, and as PID 1 of A its exit reaps
    that init instead of orphaning it to the host's PID 1. `depth`: 2 for that chain; 1 when
    not root (no `unshare`: our child is bwrap itself).
    """
    target: list[int] = []
    for _ in range(40):
        if proc.poll() is not None:
            return
        target = [proc.pid]
        for _level in range(depth):
            target = _children(target[0]) if target else []
        if target:
            break
        time.sleep(0.005)  # not forked yet
    for pid in target or _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, _signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=2)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # last resort: pdeathsig takes the rest
            os.killpg(proc.pid, _signal.SIGKILL)
        proc.wait()


def _depth(uid: int | None) -> int:
    return 1 if uid is None else 2


def _await_start(fd: int, timeout: float) -> bool:
    """Whether bwrap reported (on `--json-status-fd`) that it started the code.

    The code cannot forge this: the status fd is not inherited into the sandbox.
    """
    buf, deadline = b"", time.monotonic() + timeout
    while b"\n" not in buf and (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return b'"child-pid"' in buf


def _classify(rc: int, stderr: str, outcome: str, started: bool) -> tuple[ErrorKind, int | None, int | None]:
    """(kind, exit_code, signal) from bwrap's return code (128+n means "killed by signal n")."""
    code, sig = (None, -rc) if rc < 0 else ((None, rc - 128) if rc > 128 else (rc, None))
    tail = stderr[-2000:]
    if outcome in ("deadline", "overflow"):  # we SIGKILLed it
        kind = ErrorKind.TIMEOUT if outcome == "deadline" else ErrorKind.OUTPUT_LIMIT
        return kind, None, int(_signal.SIGKILL)
    if not started:
        return ErrorKind.SANDBOX_ERROR, code, sig
    if code and ("MemoryError" in tail or "[Errno 12] Cannot allocate memory" in tail):
        return ErrorKind.OOM, code, sig
    return (ErrorKind.KILLED if sig else ErrorKind.OK), code, sig


_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def _popen_from_spawner(argv: list[str], kw: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Popen from one thread that lives as long as the process. `--die-with-parent` is
    PR_SET_PDEATHSIG, which fires when the spawning *thread* exits (an idle pool worker, say):
    a long-lived session must not be tied to the thread that happened to create it."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steprl-sandbox-spawn")
    return _SPAWNER.submit(lambda: subprocess.Popen(argv, **kw)).result()


def _which(tool: str) -> str:
    return shutil.which(tool) or tool


_BWRAP_FLAGS = (
    "--unshare-user --unshare-pid --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try "
    f"--disable-userns --die-with-parent --new-session --cap-drop ALL --uid {_INNER_ID} --gid {_INNER_ID} "
    "--hostname sandbox --clearenv --setenv PATH /usr/bin:/bin --setenv HOME /tmp --setenv LANG C.UTF-8 "
    "--proc /proc --dev /dev"
).split()


class _Runner:
    """Builds the confinement command line, owns the uid pool, runs one process to its end."""

    def __init__(self, bwrap: str | None, python: str, per_run_uid: bool,
                 uid_range: tuple[int, int] = (200_000, 265_535)) -> None:  # fmt: skip
        lo, hi = uid_range
        if lo <= 0 or hi < lo:
            raise ValueError(
                f"uid_range {uid_range} must hold only non-root uids (0 < lo <= hi), e.g. "
                "(200000, 265535): RLIMIT_NPROC does not bind uid 0"
            )
        self.bwrap, self.python, self.per_run_uid, self.uid_range = bwrap, python, per_run_uid, uid_range
        self._in_use: set[int] = set()
        self._next = random.randint(lo, hi)  # random start: fewer clashes between processes
        self._uid_cv = threading.Condition()
        self._binds = ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):  # merged /usr: keep the symlink, bind nothing new
                self._binds += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                self._binds += ["--ro-bind", top, top]

    def take_uid(self) -> int | None:
        """A free outside uid (blocks while all are in use); None when runs cannot drop uid."""
        if not self.per_run_uid:
            return None
        lo, hi = self.uid_range
        with self._uid_cv:
            while len(self._in_use) > hi - lo:
                self._uid_cv.wait()
            while self._next in self._in_use:  # round robin: a freed uid is reused last
                self._next = lo if self._next >= hi else self._next + 1
            uid = self._next
            self._next = lo if uid >= hi else uid + 1
            self._in_use.add(uid)
            return uid

    def give_uid(self, uid: int | None) -> None:
        if uid is not None:
            with self._uid_cv:
                self._in_use.discard(uid)
                self._uid_cv.notify()

    def argv(self, limits: SandboxLimits, uid: int | None, code_fd: int, status_fd: int) -> list[str]:
        """[setpriv --pdeathsig] > prlimit > [unshare --pid --setuid] > bwrap > python3 -I main.py.

        Each helper execs the next. As root, the outer bwrap runs as PID 1 of its own PID
        namespace (see `_kill`) under the run's uid; otherwise bwrap runs as this user.
        """
        assert self.bwrap is not None
        cpu = math.ceil(limits.cpu_s)
        head = [_which("prlimit"), f"--cpu={cpu}:{cpu + 1}", f"--as={limits.address_space_bytes}",
                f"--fsize={limits.file_size_bytes}", f"--nofile={limits.open_files}", "--core=0"]  # fmt: skip
        if uid is not None:  # NPROC only with a per-run uid: a shared uid counts the harness's processes
            head = [_which("setpriv"), "--pdeathsig=KILL", "--", *head,
                    f"--nproc={limits.max_processes + _HELPER_PROCS}", "--", _which("unshare"), "--pid",
                    "--fork", "--kill-child", "--setuid", str(uid), "--setgid", str(uid)]  # fmt: skip
        box = (f"--size {limits.tmpfs_bytes} --tmpfs /tmp --chdir /tmp --ro-bind-data {code_fd} "
               f"/sandbox/main.py --remount-ro / --json-status-fd {status_fd}").split()  # fmt: skip
        return [
            *head,
            "--",
            self.bwrap,
            *_BWRAP_FLAGS,
            *self._binds,
            *box,
            self.python,
            "-I",
            "/sandbox/main.py",
        ]

    def spawn(
        self, code: str, limits: SandboxLimits, uid: int | None, *, stdin: bool, session: bool = False
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Start a sandbox running `code`; returns the process and the read end of its status pipe."""
        if uid is None and os.geteuid() == 0:
            raise SandboxUnavailable(
                "refusing to run sandboxed code as root without a per-run uid drop: "
                f"RLIMIT_NPROC would not bind a fork bomb; {_FIX_UTIL}"
            )
        code_fd = os.memfd_create("steprl-code")  # no argv size limit, nothing on the host disk
        status_r, status_w = os.pipe()
        try:
            os.write(code_fd, code.encode("utf-8", "surrogatepass"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            kw: dict[str, Any] = dict(stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                      pass_fds=(code_fd, status_w), start_new_session=True)  # fmt: skip
            argv = self.argv(limits, uid, code_fd, status_w)
            proc = _popen_from_spawner(argv, kw) if session else subprocess.Popen(argv, **kw)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(code_fd)
            os.close(status_w)
        return proc, status_r

    def execute(self, code: str, stdin: str, limits: SandboxLimits, uid: int | None) -> ExecResult:
        """One confined run, from spawn to reaped end. Releases `uid` when done."""
        out, err, status = _Capture(limits.output_bytes), _Capture(limits.output_bytes), _Capture(4096)
        over = lambda: out.truncated or err.truncated  # noqa: E731
        t0 = time.monotonic()
        proc: subprocess.Popen[bytes] | None = None
        status_fd, outcome = -1, "eof"
        try:
            proc, status_fd = self.spawn(code, limits, uid, stdin=bool(stdin))
            assert proc.stdout is not None and proc.stderr is not None
            streams = {proc.stdout.fileno(): out.feed, proc.stderr.fileno(): err.feed, status_fd: status.feed}
            write = (proc.stdin.fileno(), stdin.encode(), proc.stdin.close) if proc.stdin else None
            outcome = _pump(streams, t0 + limits.wall_s, write=write, stop=over)
            outcome = "overflow" if outcome == "stop" else outcome
            if outcome == "eof":  # all pipes closed, yet the code may still run (it closed them)
                try:
                    proc.wait(timeout=max(0.0, t0 + limits.wall_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    outcome = "deadline"
            if outcome != "eof":
                _kill(proc, _depth(uid))
                _pump(streams, time.monotonic() + 0.5, stop=over)  # what the pipes still hold
            proc.wait()
        except OSError as exc:
            err.feed(f"sandbox failed to start: {exc}".encode())
            outcome = "spawn_error"
            if proc is not None:
                _kill(proc, _depth(uid))
        finally:
            self.give_uid(uid)
            for f in (proc.stdin, proc.stdout, proc.stderr) if proc else ():
                if f is not None and not f.closed:
                    f.close()
            if status_fd >= 0:
                os.close(status_fd)
        rc = proc.returncode if proc is not None else 1
        started = b'"child-pid"' in bytes(status.head)
        kind, exit_code, sig = _classify(rc, err.text(), outcome, started)
        return _result(out, err, kind, exit_code, sig, t0, uid, timed_out=outcome == "deadline")


# ---------------------------------------------------------------------------------------------
# Public API


class Sandbox:
    """Runs untrusted Python under bubblewrap. Thread-safe; `run` blocks the calling thread.

    `max_limits` are the operator's maximums: per-run `limits` (possibly model-supplied) are
    clamped to them. At most `max_concurrency` runs execute at once; the rest queue, and their
    deadline starts when they start. Each live sandbox gets its own outside uid from `uid_range`.
    `allow_unconfined=True` runs code WITHOUT isolation (plain subprocess + rlimits) on a host
    where bwrap is unusable: for development machines only, never for training on model output.
    """

    def __init__(
        self,
        max_limits: SandboxLimits | None = None,
        *,
        max_concurrency: int | None = None,
        uid_range: tuple[int, int] = (200_000, 265_535),
        allow_unconfined: bool = False,
        bwrap: str | None = None,
        python: str = "/usr/bin/python3",
    ) -> None:
        self.max_limits = max_limits or SandboxLimits()
        self.capabilities = probe_capabilities(bwrap, python)
        self.allow_unconfined = allow_unconfined
        self._runner = _Runner(self.capabilities.bwrap, python, self.capabilities.per_run_uid, uid_range)
        self._slots = threading.BoundedSemaphore(max_concurrency or 4 * (os.cpu_count() or 1))
        if allow_unconfined and not self.capabilities.usable:
            logger.warning(
                "Sandbox(allow_unconfined=True) on a host where bubblewrap cannot confine code: "
                "model code runs UNCONFINED (no filesystem, network or PID isolation). Dev only."
            )

    def _confined(self) -> bool:
        """True: confine with bwrap. False: run unconfined (explicitly allowed). Else raise."""
        if self.capabilities.usable:
            return True
        if self.allow_unconfined:
            return False
        why = "; ".join(f"{name}: {text}" for name, text in self.capabilities.problems)
        raise SandboxUnavailable(
            f"cannot confine code on this host ({why}). Fix the host, or pass "
            "Sandbox(allow_unconfined=True) on a dev machine only."
        )

    def run(self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> ExecResult:
        """Execute `code` with `python3 -I` in a fresh sandbox; stdin is /dev/null unless given."""
        confined = self._confined()
        limits = self.max_limits.clamp(limits) if limits else self.max_limits
        with self._slots:
            if not confined:
                return _run_unconfined(self.capabilities.python, code, stdin, limits)
            return self._runner.execute(code, stdin, limits, self._runner.take_uid())

    def session(self, limits: SandboxLimits | None = None, *, auto_restart: bool = False) -> SandboxSession:
        """A stateful interpreter for one trajectory (see `SandboxSession`)."""
        return SandboxSession(self, limits, auto_restart=auto_restart)


def _run_unconfined(python: str, code: str, stdin: str, limits: SandboxLimits) -> ExecResult:
    """Dev-only fallback: rlimits (when prlimit exists), a new session, a temp cwd, the deadline."""
    out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
    prlimit = shutil.which("prlimit")
    cmd = [prlimit, f"--cpu={math.ceil(limits.cpu_s)}", f"--as={limits.address_space_bytes}",
           f"--fsize={limits.file_size_bytes}", "--"] if prlimit else []  # fmt: skip
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="steprl-unconfined-") as cwd:
        proc = subprocess.Popen([*cmd, python, "-I", "-c", code], cwd=cwd, env={"PATH": "/usr/bin:/bin"},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
        assert proc.stdin and proc.stdout and proc.stderr
        streams = {proc.stdout.fileno(): out.feed, proc.stderr.fileno(): err.feed}
        write = (proc.stdin.fileno(), stdin.encode(), proc.stdin.close)
        outcome = _pump(streams, t0 + limits.wall_s, write=write, stop=lambda: out.truncated or err.truncated)
        outcome = "overflow" if outcome == "stop" else outcome
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, t0 + limits.wall_s - time.monotonic()))
        if proc.poll() is None:
            outcome = "overflow" if outcome == "overflow" else "deadline"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, _signal.SIGKILL)  # setsid descendants survive this: unconfined
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
    kind, exit_code, sig = _classify(proc.returncode, err.text(), outcome, True)
    return _result(out, err, kind, exit_code, sig, t0, None, timed_out=outcome == "deadline")


# The session's server, run as /sandbox/main.py inside the sandbox. Protocol: the host writes
# b"<len>\n<utf-8 code>" on stdin; after the cell the server writes <marker><0|1>\n on both
# stdout and stderr. Cells see /dev/null as stdin. A cell that learns the marker can only garble
# its own output.
_SESSION_SERVER = r"""
import ast, builtins, os, sys, traceback
marker = b"\x1e" + b"NONCE" + b"\x1e"
ctl = os.fdopen(os.dup(0), "rb", buffering=0)
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
env = {"__name__": "__main__", "__builtins__": builtins}

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

while True:
    header = ctl.readline()
    if not header:
        break
    src = read_exact(int(header)).decode("utf-8", "replace")
    status = b"0"
    try:
        run_cell(src)
    except BaseException as exc:  # a cell never ends the session, not even SystemExit
        status = b"1"
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
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
    """

    def __init__(
        self, sandbox: Sandbox, limits: SandboxLimits | None = None, *, auto_restart: bool = False
    ) -> None:
        if not sandbox._confined():
            raise SandboxUnavailable("SandboxSession needs bubblewrap; there is no unconfined session mode")
        self._sandbox, self.auto_restart = sandbox, auto_restart
        self.limits = sandbox.max_limits.clamp(limits) if limits else sandbox.max_limits
        self._lock = threading.Lock()
        self._cells = 0
        self._start()

    def _start(self) -> None:
        runner = self._sandbox._runner
        self._uid = uid = runner.take_uid()
        nonce = os.urandom(16).hex()
        try:
            proc, status = runner.spawn(
                _SESSION_SERVER.replace("NONCE", nonce), self.limits, uid, stdin=True, session=True
            )
        except BaseException:
            runner.give_uid(uid)
            raise
        self._proc = proc
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, _close_session, proc, status, runner, uid)
        if not _await_start(status, 10.0):
            _kill(proc, _depth(uid))
            err = _Capture(4096)
            assert proc.stderr is not None
            _pump({proc.stderr.fileno(): err.feed}, time.monotonic() + 0.5)
            self._finalizer()
            raise SandboxUnavailable(f"the session's sandbox did not start: {err.text().strip()!r}")
        marker = b"\x1e" + nonce.encode() + b"\x1e"
        self._out, self._err = _CellStream(marker), _CellStream(marker)

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
                empty = _Capture(1)
                return _result(
                    empty, empty, ErrorKind.SESSION_DEAD, None, None, time.monotonic(), self._uid, note=msg
                )
            with self._sandbox._slots:
                result = self._run_cell(code)
            return replace(result, stderr=note + result.stderr) if note else result

    def _run_cell(self, code: str) -> ExecResult:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self._cells += 1
        out, err = self._out.start(self.limits.output_bytes), self._err.start(self.limits.output_bytes)
        data = code.encode("utf-8", "surrogatepass")
        t0 = time.monotonic()
        request = (proc.stdin.fileno(), b"%d\n" % len(data) + data, _noop)
        outcome = _pump(
            {proc.stdout.fileno(): self._out.feed, proc.stderr.fileno(): self._err.feed},
            t0 + self.limits.wall_s,
            write=request,
            stop=self._cell_done,
        )
        if outcome == "stop":
            status = self._out.status or 0
            kind = ErrorKind.OUTPUT_LIMIT if out.truncated or err.truncated else ErrorKind.OK
            if status and kind is ErrorKind.OK and "MemoryError" in err.text()[-2000:]:
                kind = ErrorKind.OOM
            return _result(out, err, kind, status, None, t0, self._uid)
        # Timed out (we kill the interpreter) or died by itself: either way the session is over.
        _kill(proc, _depth(self._uid))
        self._out.flush()
        self._err.flush()
        kind, exit_code, sig = _classify(proc.returncode, err.text(), outcome, True)
        how = f"signal {sig}" if sig else f"exit code {exit_code}"
        timed_out = outcome == "deadline"
        self._dead = (
            f"cell {self._cells} timed out after {self.limits.wall_s:g}s"
            if timed_out
            else f"interpreter died in cell {self._cells}: {how}"
        )
        self._finalizer()
        note = f"\n[{self._dead}; session state lost]\n"
        return _result(out, err, kind, exit_code, sig, t0, self._uid, timed_out=timed_out, note=note)

    def _cell_done(self) -> bool:
        return self._out.status is not None and self._err.status is not None

    def close(self) -> None:
        """Stop the interpreter and release its uid. Idempotent."""
        if self._dead is None:
            self._dead = "session closed"
        self._finalizer()

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _noop() -> None:
    pass


def _close_session(proc: subprocess.Popen[bytes], status: int, runner: _Runner, uid: int | None) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # EOF on the control channel: the server exits by itself
    try:
        proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        _kill(proc, _depth(uid))
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    os.close(status)
    runner.give_uid(uid)


__all__ = [
    "ErrorKind",
    "ExecResult",
    "Sandbox",
    "SandboxCapabilities",
    "SandboxLimits",
    "SandboxSession",
    "SandboxUnavailable",
    "probe_capabilities",
]
