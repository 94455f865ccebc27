"""Process control: the confinement command line, spawning, killing and reaping, the uid pool.

`Runner.argv` builds `setpriv > prlimit > unshare > bwrap > python3 -I` (see the package
docstring); `kill_sandbox` takes down a whole sandbox and reaps it; `run_unconfined` is the dev-only
fallback used when the operator explicitly allows it.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import select
import shlex
import shutil
import signal as _signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from steprl.envs.sandbox.capture import Capture, Outbox, exec_result, pump
from steprl.envs.sandbox.limits import FIX_UTIL, ErrorKind, ExecResult, SandboxLimits, SandboxUnavailable
from steprl.envs.sandbox.seccomp import deny_filter

INNER_ID = 1000  # uid/gid the code sees inside its user namespace (not 65534, the overflow id)
_HELPER_PROCS = 2  # bwrap's outer monitor and the namespace's init count against RLIMIT_NPROC
_SECCOMP = deny_filter()  # None on a machine without a syscall table there (the probe says so)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def kill_sandbox(proc: subprocess.Popen[bytes], depth: int) -> None:
    """Kill the whole sandbox and reap it, leaving no zombie behind, not even with the host's PID 1.

    Process tree: our child `unshare` > bwrap, PID 1 of namespace A (as `sh`, then `setpriv`:
    each execs the next; a kill while `sh` mounts hits `mount`, and `sh` gives up) > bwrap's
    init, PID 1 of namespace B > the code. SIGKILL to B's init makes the kernel kill everything
    in B (setsid and double-fork escapes included); bwrap reaps it and exits (128+9), which ends
    A; unshare reaps bwrap; we reap unshare. A exists for the normal exit: bwrap returns as soon as the code's
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


def kill_depth(uid: int | None) -> int:
    return 1 if uid is None else 2


def await_start(fd: int, timeout: float) -> bool:
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


def classify(rc: int, stderr: str, outcome: str, started: bool) -> tuple[ErrorKind, int | None, int | None]:
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


def split_for_shm(total: int) -> tuple[int, int]:
    """Bytes for /tmp and /dev/shm where each is a tmpfs of its own (not root): page multiples
    summing to at most `total` (a tmpfs rounds its size up to pages, and size 0 is unbounded).
    /dev/shm gets a sixteenth: POSIX semaphores (multiprocessing's locks) take a page each, and
    multiprocessing puts a shared array that does not fit there in /tmp instead."""
    page = os.sysconf("SC_PAGE_SIZE")
    shm = max(page, total // 16 // page * page)
    tmp = (total - shm) // page * page
    return (tmp, shm) if tmp >= page else (total, 0)  # too small to split: /dev/shm read-only


def _memfd(name: str, data: bytes) -> int:
    """A file in memory holding `data`, read from its start (nothing on the host disk)."""
    fd = os.memfd_create(name)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _which(tool: str) -> str:
    return shutil.which(tool) or tool


_BWRAP_FLAGS = (
    "--unshare-user --unshare-pid --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try "
    f"--disable-userns --die-with-parent --new-session --cap-drop ALL --uid {INNER_ID} --gid {INNER_ID} "
    "--hostname sandbox --clearenv --setenv PATH /usr/bin:/bin --setenv HOME /tmp --setenv LANG C.UTF-8 "
    "--proc /proc --dev /dev"
).split()

#: Where, in the sandbox's private mount namespace, the one writable tmpfs is mounted before bwrap
#: binds it (FHS: "mount point for a temporarily mounted filesystem"; the host never sees it).
MOUNT_AT = "/mnt"


def _prepare_script() -> str:
    """What runs as root in the sandbox's new mount namespace (not the host's), before the uid
    drop. Arguments: `$1` bytes, `$2` inodes, `$3` the run's uid, then bwrap's command line.

    One tmpfs, sized in bytes and in inodes, is all the code can write: bwrap binds it at /tmp
    and at /dev/shm, and makes /dev itself read-only (bwrap's --dev is a tmpfs of its own with
    no size: 2.2 GB of host memory were written there). bwrap alone cannot size inodes.
    """
    mount, setpriv = shlex.quote(_which("mount")), shlex.quote(_which("setpriv"))
    return (
        f'{mount} -t tmpfs -o "size=$1,nr_inodes=$2,mode=0755,uid=$3,gid=$3,nosuid,nodev" steprl-sandbox '
        f'{MOUNT_AT} && u=$3 && shift 3 && exec {setpriv} --reuid="$u" --regid="$u" --clear-groups -- "$@"'
    )


class Runner:
    """Builds the confinement command line, owns the uid pool, runs one process to its end."""

    def __init__(
        self,
        bwrap: str | None,
        python: str,
        per_run_uid: bool,
        uid_range: tuple[int, int] = (200_000, 265_535),
    ) -> None:
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
        if per_run_uid and not os.path.isdir(MOUNT_AT):  # FHS has it; a minimal image may not
            os.makedirs(MOUNT_AT, mode=0o755, exist_ok=True)
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

    def argv(
        self, limits: SandboxLimits, uid: int | None, code_fd: int, status_fd: int, seccomp_fd: int | None
    ) -> list[str]:
        """[setpriv --pdeathsig] > prlimit > [unshare --pid --mount > sh: mount, setpriv --reuid]
        > bwrap > python3 -I main.py.

        Each helper execs the next. As root, the outer bwrap runs as PID 1 of its own PID
        namespace (see `kill_sandbox`) under the run's uid; otherwise bwrap runs as this user.
        """
        assert self.bwrap is not None
        cpu = math.ceil(limits.cpu_s)
        head = [
            _which("prlimit"),
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={limits.address_space_bytes}",
            f"--fsize={limits.file_size_bytes}",
            f"--nofile={limits.open_files}",
            "--core=0",
        ]
        if uid is None:  # no root, no mount of our own: bwrap's sized tmpfs (no inode count), two of them
            head += ["--"]
            tmp, shm = split_for_shm(limits.tmpfs_bytes)
            writable = f"--size {tmp} --tmpfs /tmp" + (f" --size {shm} --tmpfs /dev/shm" if shm else "")
        else:  # NPROC only with a per-run uid: a shared uid counts the harness's processes
            head = [
                _which("setpriv"),
                "--pdeathsig=KILL",
                "--",
                *head,
                f"--nproc={limits.max_processes + _HELPER_PROCS}",
                "--",
                _which("unshare"),
                "--pid",
                "--mount",
                "--fork",
                "--kill-child",
                "--",
                "/bin/sh",
                "-c",
                _prepare_script(),
                "steprl-sandbox",
                str(limits.tmpfs_bytes),
                str(limits.tmpfs_inodes),
                str(uid),
            ]
            writable = f"--bind {MOUNT_AT} /tmp --bind {MOUNT_AT} /dev/shm"
        box = (
            f"{writable} --remount-ro /dev --chdir /tmp --ro-bind-data {code_fd} "
            f"/sandbox/main.py --remount-ro / --json-status-fd {status_fd}"
        ).split()
        if seccomp_fd is not None:
            box += ["--seccomp", str(seccomp_fd)]
        return [
            *head,
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
                f"RLIMIT_NPROC would not bind a fork bomb; {FIX_UTIL}"
            )
        code_fd = _memfd("steprl-code", code.encode("utf-8", "surrogatepass"))  # no argv size limit
        seccomp_fd = _memfd("steprl-seccomp", _SECCOMP) if _SECCOMP is not None else None
        fds = (code_fd, seccomp_fd) if seccomp_fd is not None else (code_fd,)
        status_r, status_w = os.pipe()
        try:
            kw: dict[str, Any] = dict(
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                pass_fds=(*fds, status_w),
                start_new_session=True,
            )
            argv = self.argv(limits, uid, code_fd, status_w, seccomp_fd)
            proc = _popen_from_spawner(argv, kw) if session else subprocess.Popen(argv, **kw)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            for fd in (*fds, status_w):
                os.close(fd)
        return proc, status_r

    def execute(self, code: str, stdin: str, limits: SandboxLimits, uid: int | None) -> ExecResult:
        """One confined run, from spawn to reaped end. Releases `uid` when done."""
        out, err, status = Capture(limits.output_bytes), Capture(limits.output_bytes), Capture(4096)
        over = lambda: out.truncated or err.truncated  # noqa: E731
        t0 = time.monotonic()
        proc: subprocess.Popen[bytes] | None = None
        status_fd, outcome = -1, "eof"
        try:
            proc, status_fd = self.spawn(code, limits, uid, stdin=bool(stdin))
            assert proc.stdout is not None and proc.stderr is not None
            streams = {proc.stdout.fileno(): out.feed, proc.stderr.fileno(): err.feed, status_fd: status.feed}
            write = Outbox(proc.stdin.fileno(), stdin.encode(), proc.stdin.close) if proc.stdin else None
            outcome = pump(streams, t0 + limits.wall_s, write=write, stop=over)
            outcome = "overflow" if outcome == "stop" else outcome
            if outcome == "eof":  # all pipes closed, yet the code may still run (it closed them)
                try:
                    proc.wait(timeout=max(0.0, t0 + limits.wall_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    outcome = "deadline"
            if outcome != "eof":
                kill_sandbox(proc, kill_depth(uid))
                pump(streams, time.monotonic() + 0.5, stop=over)  # what the pipes still hold
            proc.wait()
        except OSError as exc:
            err.feed(f"sandbox failed to start: {exc}".encode())
            outcome = "spawn_error"
            if proc is not None:
                kill_sandbox(proc, kill_depth(uid))
        finally:
            self.give_uid(uid)
            for f in (proc.stdin, proc.stdout, proc.stderr) if proc else ():
                if f is not None and not f.closed:
                    f.close()
            if status_fd >= 0:
                os.close(status_fd)
        rc = proc.returncode if proc is not None else 1
        started = b'"child-pid"' in bytes(status.head)
        kind, exit_code, sig = classify(rc, err.text(), outcome, started)
        return exec_result(out, err, kind, exit_code, sig, t0, uid, timed_out=outcome == "deadline")


def run_unconfined(python: str, code: str, stdin: str, limits: SandboxLimits) -> ExecResult:
    """Dev-only fallback: rlimits (when prlimit exists), a new session, a temp cwd, the deadline."""
    out, err = Capture(limits.output_bytes), Capture(limits.output_bytes)
    prlimit = shutil.which("prlimit")
    cmd = (
        [
            prlimit,
            f"--cpu={math.ceil(limits.cpu_s)}",
            f"--as={limits.address_space_bytes}",
            f"--fsize={limits.file_size_bytes}",
            "--",
        ]
        if prlimit
        else []
    )
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="steprl-unconfined-") as cwd:
        proc = subprocess.Popen(
            [*cmd, python, "-I", "-c", code],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdin and proc.stdout and proc.stderr
        streams = {proc.stdout.fileno(): out.feed, proc.stderr.fileno(): err.feed}
        write = Outbox(proc.stdin.fileno(), stdin.encode(), proc.stdin.close)
        outcome = pump(streams, t0 + limits.wall_s, write=write, stop=lambda: out.truncated or err.truncated)
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
    kind, exit_code, sig = classify(proc.returncode, err.text(), outcome, True)
    return exec_result(out, err, kind, exit_code, sig, t0, None, timed_out=outcome == "deadline")
