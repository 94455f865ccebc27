"""One process writes a run directory. Two `steprl train` of one config at once (with
`run.overwrite: true`, as every shipped config sets) used to both run, each clearing and
writing the same directory: one run's config and metrics beside the other's checkpoints.

`steprl train` holds an exclusive `flock` on `<output_dir>/.<name>.lock` from before it plans
the run directory (so before anything is cleared) until it ends; a second is refused in one
line naming the pid that holds it. The lock file lives beside the run directory, not in it:
`run.overwrite` clears the directory whole, and a lock inside would go with it (the next
process would lock a new file). The kernel releases a flock when its process ends, SIGKILL
included. The file is left in place: removing it would let a process that opened the old file
and one that made a new one both hold "the" lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from steprl.diagnostics.sinks import no_link
from steprl.errors import UserError


class RunDirInUse(UserError):
    """Another process holds the run directory."""


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[Path]:
    """Hold `run_dir` for this process while the block runs (its lock file is yielded), or
    raise `RunDirInUse` (one line) if another process holds it."""
    lock = lock_path(run_dir)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            no_link(lock)  # refused, one line: never through a link
        raise UserError(
            f"run.output_dir: cannot write {lock.parent} ({exc.strerror or exc}); "
            "point run.output_dir at a folder you can write"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # the holder writes its pid just after it locks: empty only in that instant
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise RunDirInUse(
                f"run.output_dir/run.name: {run_dir} is in use by another steprl train (pid {holder}); "
                "wait for it to end or stop it, or choose another run.name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield lock
    finally:
        os.close(fd)  # releases the lock


__all__ = ["RunDirInUse", "hold_run_dir", "lock_path"]
