"""A finished tiny run for the probes that damage, kill or restart one: trained once per battery
(in the shared directory) and copied into each probe's temp directory."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .common import Ctx, Proc

NAME = "calculator_tiny"
#: the finished run's own settings (on top of the tiny shape): a checkpoint every step, so that
#: the corruption probes have an older one to fall back to
BASE = ("trainer.checkpoint_every=1",)


def finished_run(ctx: Ctx) -> Path:
    """A copy of the finished run at `ctx.tmp/runs/calculator_tiny` (its own config.yaml names the
    shared directory; `--resume RUN_DIR` and `run.output_dir` say where it is now)."""
    base = ctx.shared["root"] / "base" / "runs" / NAME
    if not (base / "checkpoints" / "latest").exists():
        home = Ctx(ctx.shared["root"] / "base", shared=ctx.shared, src=ctx.src)
        home.tmp.mkdir(parents=True, exist_ok=True)
        run = home.train(BASE, deadline=300)
        ctx.watched.extend(home.procs)
        if run.rc != 0:
            raise RuntimeError(f"the finished run every probe copies failed: {run.last_line()}")
    dest = ctx.tmp / "runs" / NAME
    shutil.copytree(base, dest, symlinks=True)
    return dest


def steps_logged(run_dir: Path) -> list[int]:
    """The RL steps metrics.jsonl records, in order (evaluation-only lines left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "reward/mean" in row:
            steps.append(int(row["step"]))
    return steps


def wait_for_step(proc: Proc, run_dir: Path, step: int, timeout: float) -> bool:
    """Until metrics.jsonl records RL step `step` (True), the process ends or `timeout` passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.popen.poll() is None:
        if step in steps_logged(run_dir):
            return True
        time.sleep(0.1)
    return step in steps_logged(run_dir)
