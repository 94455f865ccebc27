"""The Ray processes a trainer started go within a second of its death (`start`, from `ensure_ray`).

`ensure_ray` starts a local Ray whose head processes (GCS, raylet, monitors) are the trainer's
children, and Ray makes them die with it (PR_SET_PDEATHSIG). The raylet's own children do not:
the dashboard and runtime-env agents notice the raylet's death at once, then report it to the
GCS, which is gone too, under a fixed 60 s timeout (`ray._private.utils.publish_error_to_driver`).
Measured after a SIGKILL of the trainer: the env workers went within 1.5-3 s (they see the
raylet's socket close), the two agents after 61 s. A death signal cannot be set on them from
here (the raylet starts them), and no `ray.init` option shortens that timeout.

So `start()` runs this module as a small watcher process (no Ray import, no torch). While the
trainer lives it notes, once a second, the children of the trainer's raylets (the agents, the
workers) with their start times; once the trainer is gone (its parent pid changes) it SIGKILLs
those still alive (same pid *and* start time, so a reused pid is never hit) and exits. They are
found by parentage, not by name or environment: Ray renames them (`ray::DashboardAgent`) with
setproctitle, which also blanks their /proc environ. After a clean `ray.shutdown` nothing noted
is left to kill. Linux only (it reads /proc); elsewhere it is not started.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

#: How often the watcher checks that the trainer is alive (the delay before it reaps).
POLL_S = 0.2
#: How often it notes the raylet's children (reading a few small /proc files).
NOTE_S = 1.0

_started: list[subprocess.Popen[bytes]] = []  # one watcher per process, kept referenced


def start() -> subprocess.Popen[bytes] | None:
    """Start the watcher of this process's Ray processes, once (None off Linux).

    In a session of its own, so a Ctrl-C to the terminal's process group, which the trainer
    handles, does not stop the watcher before the trainer has exited."""
    if not sys.platform.startswith("linux"):
        return None
    if not _started:
        _started.append(
            subprocess.Popen(
                [sys.executable, "-m", "steprl.hosting.ray_reaper", str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    return _started[0]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[1]), int(fields[19])) if fields[0] != b"Z" else None


def children(pid: int) -> list[int]:
    """The child pids of `pid` (/proc/PID/task/*/children, else a scan of /proc)."""
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if files:
        out = []
        for name in files:
            try:
                with open(name, "rb") as f:
                    out += [int(p) for p in f.read().split()]
            except OSError:  # that thread ended meanwhile
                pass
        return out
    if os.path.isdir(f"/proc/{pid}/task"):  # a kernel without CONFIG_PROC_CHILDREN
        return [int(e) for e in os.listdir("/proc") if e.isdigit() and (_stat(int(e)) or (0,))[0] == pid]
    return []


def _is_raylet(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].endswith(b"/raylet")
    except OSError:
        return False


def note(parent: int) -> dict[int, int]:
    """The children of `parent`'s raylets: pid -> start time."""
    noted = {}
    for raylet in filter(_is_raylet, children(parent)):
        for pid in children(raylet):
            stat = _stat(pid)
            if stat is not None:
                noted[pid] = stat[1]
    return noted


def still_alive(noted: dict[int, int]) -> list[int]:
    """The noted processes still alive as themselves (same pid and start time)."""
    return [pid for pid, started in noted.items() if (_stat(pid) or (0, None))[1] == started]


def reap(noted: dict[int, int]) -> list[int]:
    """SIGKILL the noted processes still alive; the pids killed. An orphaned agent has nothing
    to save, and its SIGTERM path would wait for the dead GCS."""
    killed = []
    for pid in still_alive(noted):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed


def main(argv: Sequence[str]) -> None:
    parent = int(argv[0])
    noted: dict[int, int] = {}
    last = 0.0
    while os.getppid() == parent:
        if time.monotonic() - last >= NOTE_S:
            noted = note(parent)  # what lives now: gone workers drop out
            last = time.monotonic()
        time.sleep(POLL_S)
    reap(noted)


if __name__ == "__main__":
    main(sys.argv[1:])
