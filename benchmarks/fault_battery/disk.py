"""A full disk (issue 44 items 10-12): the run directory, a synthesized package and a report
written onto a small tmpfs (mounted for the probe; as root it can be) or, where mounting is not
allowed, under RLIMIT_FSIZE. Each ends in one line, the TensorBoard writer thread included."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .common import STEPRL, Ctx, Probe, Verdict, judge
from .runs import finished_run
from .synth import shop_spec, write_spec


def small_disk(ctx: Ctx, kib: int) -> tuple[Path, list[str]]:
    """A `kib` KiB tmpfs at ctx.tmp/disk (unmounted with the probe's directory), and no extra
    program; else a plain directory and `prlimit --fsize` to put before the command."""
    where = ctx.tmp / "disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True, check=False
    )
    return where, ([] if mounted.returncode == 0 else ["prlimit", f"--fsize={kib * 1024}", "--"])


def _train_on(ctx: Ctx, kib: int, *extra: str) -> Verdict:
    where, limit = small_disk(ctx, kib)
    sets = [f"run.output_dir={where}", *extra]
    program = (*limit, ctx_steprl()) if limit else (ctx_steprl(),)
    return judge(ctx.train(sets, deadline=240, program=program), (1, 2))


def ctx_steprl() -> str:
    return STEPRL


def train_disk_full_at_start(ctx: Ctx) -> Verdict:
    return _train_on(ctx, 16)


def train_disk_full_mid_run(ctx: Ctx) -> Verdict:
    """Room for the start and a step's files, not for the checkpoint; TensorBoard on."""
    return _train_on(ctx, 160, "logging.tensorboard=true")


def synth_disk_full(ctx: Ctx) -> Verdict:
    where, limit = small_disk(ctx, 16)
    spec = write_spec(ctx, shop_spec())
    program = (*limit, ctx_steprl()) if limit else (ctx_steprl(),)
    run = ctx.steprl(
        ["synth", str(spec), "-o", str(where / "pkg"), "--no-check"], deadline=120, program=program
    )
    return judge(run)


def report_disk_full(ctx: Ctx) -> Verdict:
    run_dir = finished_run(ctx)
    where, limit = small_disk(ctx, 16)
    program = (*limit, ctx_steprl()) if limit else (ctx_steprl(),)
    run = ctx.steprl(["report", str(run_dir), "-o", str(where / "r.html")], deadline=120, program=program)
    return judge(run, (1, 2))


PROBES = [
    Probe("disk", "train: disk full at start", "10", train_disk_full_at_start),
    Probe("disk", "train: disk full mid-run (TensorBoard on)", "10", train_disk_full_mid_run),
    Probe("disk", "synth -o onto a full disk", "10", synth_disk_full),
    Probe("disk", "report -o onto a full disk", "10", report_disk_full),
]
