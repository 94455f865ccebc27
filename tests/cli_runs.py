"""Running the real `steprl` entry point in a subprocess, and the one-line error check that the
bad-input tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

STEPRL = str(Path(sys.executable).parent / "steprl")


def run_steprl(
    args: Sequence[str],
    cwd: Path,
    program: Sequence[str] = (STEPRL,),
    *,
    pythonpath: Sequence[Path] = (),
    timeout: float = 300,
) -> tuple[int, str]:
    """`steprl *args` in `cwd` (or `program *args`): (exit code, stdout + stderr). `pythonpath`:
    directories the command imports from (test envs loaded with --plugin)."""
    env = {**os.environ, "COLUMNS": "400"}  # rich wraps at the terminal width
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    done = subprocess.run(
        [*program, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def assert_one_line(rc: int, out: str, *needles: str) -> None:
    """Exit 2, no traceback, and the error is the last line, whole (the run may log before it)."""
    assert rc == 2, out
    assert "Traceback" not in out, out
    last = out.splitlines()[-1]
    for needle in needles:
        assert needle in last, out
