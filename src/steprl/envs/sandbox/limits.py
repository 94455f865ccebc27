"""The sandbox's records: `SandboxLimits` (what a run may use), `ExecResult` (how it ended), `ErrorKind`.

Also the one error type callers catch (`SandboxUnavailable`) and the fix texts the probe and the
runner put into their messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import StrEnum

MIB = 1 << 20
FIX_BWRAP = "install it: `apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"
FIX_USERNS = (
    "enable unprivileged user namespaces: `sysctl -w user.max_user_namespaces=15000`, "
    "`sysctl -w kernel.unprivileged_userns_clone=1` (older Debian), "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04)"
)
FIX_UTIL = (
    "install util-linux (`apt-get install util-linux mount`): it provides setpriv, prlimit, unshare, mount"
)


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
    PROTOCOL_ERROR = "protocol_error"  # a session cell broke the host-call protocol: interpreter killed


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run (or, for a session, per cell where noted)."""

    wall_s: float = 5.0  # wall-clock deadline per run / per session cell
    cpu_s: float = 5.0  # RLIMIT_CPU soft limit (SIGXCPU; hard = soft + 1); a session's total
    address_space_bytes: int = 512 * MIB  # RLIMIT_AS per process
    file_size_bytes: int = 16 * MIB  # RLIMIT_FSIZE: largest single file (EFBIG past it)
    open_files: int = 256  # RLIMIT_NOFILE
    max_processes: int = 64  # RLIMIT_NPROC for the run's uid, the interpreter included
    tmpfs_bytes: int = 16 * MIB  # all the code can write, summed over every writable place (ENOSPC)
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

    @property
    def tmpfs_inodes(self) -> int:
        """Files and directories the writable tmpfs may hold: one per 16 KiB of `tmpfs_bytes`.

        An empty file takes no block of the tmpfs but about 1.3 KiB of kernel memory (inode and
        dentry); uncounted, 100,000 of them took 1.3 s. At one per 16 KiB, that memory stays
        under a tenth of `tmpfs_bytes`.
        """
        return max(64, self.tmpfs_bytes // (16 * 1024))

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
    rpc_calls: int = 0  # host calls the cell made that reached the session's RPC handler

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited 0."""
        return self.error is ErrorKind.OK and self.exit_code == 0
