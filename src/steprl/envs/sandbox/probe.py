"""The capability probe: which sandbox guarantees this host enforces, found by a real sandboxed run."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import platform
import shutil
from dataclasses import dataclass
from typing import Any

from steprl.envs.sandbox.limits import FIX_BWRAP, FIX_USERNS, FIX_UTIL, MIB, SandboxLimits
from steprl.envs.sandbox.runner import INNER_ID, Runner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxCapabilities:
    """Which guarantees this host enforces. `problems` maps a missing one to why + how to fix.

    Guarantees: bwrap, python, user_namespace, pid_namespace, net_namespace, tmpfs_size,
    rlimits, per_run_uid, seccomp. `tmpfs_size`: all the code can write (every writable mount
    together; as root, inodes too) is `SandboxLimits.tmpfs_bytes`. `seccomp`: memory outside
    any file system (memfd, System V IPC, message queues) cannot be made.
    """

    bwrap: str | None
    python: str
    user_namespace: bool
    pid_namespace: bool
    net_namespace: bool
    tmpfs_size: bool
    rlimits: bool
    per_run_uid: bool
    seccomp: bool = False
    problems: tuple[tuple[str, str], ...] = ()

    @property
    def usable(self) -> bool:
        """bwrap can confine code here (filesystem, PID and network isolation all hold)."""
        return bool(self.bwrap) and self.user_namespace and self.pid_namespace and self.net_namespace

    def reason(self, guarantee: str) -> str | None:
        """Why `guarantee` cannot be enforced here (with the fix), or None when it holds."""
        return next((why for name, why in self.problems if name == guarantee), None)


_PROBE = r"""
import json, os, resource
def size(path):
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize
shm = size("/dev/shm") if os.stat("/dev/shm").st_dev != os.stat("/tmp").st_dev else 0
try:
    memfd = os.close(os.memfd_create("probe")) or "made"
except OSError as e:
    memfd = e.errno
print(json.dumps({
    "uid": os.getuid(), "pids": sum(p.isdigit() for p in os.listdir("/proc")),
    "ifaces": [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]],
    "tmp": size("/tmp") + shm, "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
    "dev": os.access("/dev", os.W_OK), "memfd": memfd,
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
    tools = all(shutil.which(t) for t in ("setpriv", "prlimit", "unshare", "mount"))
    blocker = None  # why nothing at all can be confined
    if path is None:
        blocker = f"bubblewrap (`{bwrap}`) not found, nothing is confined; {FIX_BWRAP}"
        problems.append(("bwrap", blocker))
    elif not (python.startswith("/usr/") and os.access(python, os.X_OK)):
        blocker = (
            f"{python} is not an executable under /usr, the only host tree the sandbox sees; "
            "`apt-get install python3-minimal`"
        )
        problems.append(("python", blocker))
    elif not tools:
        blocker = f"setpriv/prlimit/unshare/mount missing, so no uid drop and no rlimits; {FIX_UTIL}"
    per_run_uid = os.geteuid() == 0 and tools
    if os.geteuid() != 0:
        problems.append(
            (
                "per_run_uid",
                "not root: all runs share this user's uid, so RLIMIT_NPROC cannot "
                "bound a fork bomb, and the working dir's file count (kernel memory) has no "
                "bound (only its bytes have); run the sandbox host as root",
            )
        )
    found: dict[str, Any] = {}
    if blocker is None:
        limits = SandboxLimits(wall_s=10, tmpfs_bytes=8 * MIB, file_size_bytes=3 * MIB)
        runner = Runner(path, python, per_run_uid)
        res = runner.execute(_PROBE, "", limits, runner.take_uid())
        try:
            found = json.loads(res.stdout)
        except ValueError:
            blocker = f"bwrap failed to start ({res.error}: {res.stderr.strip()[:300]!r}); {FIX_USERNS}"
    new = "use bubblewrap >= 0.8"
    checks = {
        "user_namespace": (found.get("uid") == INNER_ID, f"no user namespace, non-root uid; {FIX_USERNS}"),
        "pid_namespace": (found.get("pids") in (1, 2), f"host processes are visible; {new}"),
        "net_namespace": (found.get("ifaces") == ["lo"], f"host network interfaces are visible; {new}"),
        "tmpfs_size": (
            found.get("tmp") == 8 * MIB and found.get("dev") is False,
            f"tmpfs --size ignored or /dev writable: disk fill unbounded; {new}",
        ),
        "rlimits": (found.get("fsize") == 3 * MIB, f"rlimits were not applied; {FIX_UTIL}"),
        "seccomp": (
            found.get("memfd") == errno.EPERM,
            f"memfd_create and System V IPC are not refused on {platform.machine()} (no syscall "
            "table in envs/sandbox/seccomp.py): memory outside the tmpfs is bounded only by "
            "RLIMIT_FSIZE x RLIMIT_NOFILE x RLIMIT_NPROC",
        ),
    }
    for name, (holds, why) in checks.items():
        if blocker is not None or not holds:
            problems.append((name, blocker or why))
    if blocker is not None and os.geteuid() == 0:
        problems.append(("per_run_uid", blocker))
    for name, why in problems:
        logger.warning("sandbox guarantee %r is NOT enforced on this host: %s", name, why)
    ok = {name: all(name != missing for missing, _ in problems) for name in (*checks, "per_run_uid")}
    return SandboxCapabilities(
        bwrap=path,
        python=python,
        user_namespace=ok["user_namespace"],
        pid_namespace=ok["pid_namespace"],
        net_namespace=ok["net_namespace"],
        tmpfs_size=ok["tmpfs_size"],
        rlimits=ok["rlimits"],
        per_run_uid=ok["per_run_uid"],
        seccomp=ok["seccomp"],
        problems=tuple(problems),
    )
