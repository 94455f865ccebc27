"""Corrupt and planted files in a finished run (issue 44 items 4, 10): a truncated or garbage
checkpoint, a garbage metrics line, a truncated trajectory file, a garbage config.yaml, and a
report.html or metrics.jsonl that is a link to a file outside the run. Reading commands go on
(falling back, with a warning) or refuse in one line; no writer follows a planted link."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .common import Ctx, Probe, Verdict, defect, judge
from .runs import finished_run

VICTIM = "not steprl's\n"


def _latest(run_dir: Path) -> Path:
    return (run_dir / "checkpoints" / "latest").resolve()


def _damaged(
    damage: Callable[[Path], None], command: Callable[[Path], list[str]], ok: tuple[int, ...]
) -> Callable[[Ctx], Verdict]:
    def probe(ctx: Ctx) -> Verdict:
        run_dir = finished_run(ctx)
        damage(run_dir)
        return judge(ctx.steprl(command(run_dir), deadline=180), ok)

    return probe


def truncate_weights(run_dir: Path) -> None:
    weights = _latest(run_dir) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def garbage_manifest(run_dir: Path) -> None:
    (_latest(run_dir) / "manifest.json").write_bytes(b"\x00\xffnot json")


def garbage_metrics_line(run_dir: Path) -> None:
    with (run_dir / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 3, "reward/me\n\xff\xfe garbage\n')


def truncate_trajectories(run_dir: Path) -> None:
    for part in sorted((run_dir / "trajectories").glob("*.parquet")):
        part.write_bytes(part.read_bytes()[:50])


def garbage_config(run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text("run: [unclosed\n  model: {\n")


def eval_run(run_dir: Path) -> list[str]:
    return ["eval", str(run_dir), "--tasks", "2"]


def resume(run_dir: Path) -> list[str]:
    return ["train", "--resume", str(run_dir)]


def report(run_dir: Path) -> list[str]:
    return ["report", str(run_dir)]


def show(run_dir: Path) -> list[str]:
    return ["show", str(run_dir)]


def _linked(name: str, command: Callable[[Path], list[str]]) -> Callable[[Ctx], Verdict]:
    """`name` in the run replaced by a link to a file outside it, then `command`."""

    def probe(ctx: Ctx) -> Verdict:
        run_dir = finished_run(ctx)
        victim = ctx.tmp / "victim.txt"
        victim.write_text(VICTIM)
        (run_dir / name).unlink()
        (run_dir / name).symlink_to(victim)
        run = ctx.steprl(command(run_dir), deadline=240)
        if victim.read_text() != VICTIM:
            return defect(f"`steprl {command(run_dir)[0]}` wrote through the run's symlinked {name}")
        return judge(run, (0, 1, 2))

    return probe


def resume_one_more_step(run_dir: Path) -> list[str]:
    return [*resume(run_dir), "--set", "trainer.total_steps=3", "--set", "run.allow_config_change=true"]


PROBES = [
    Probe("files", "truncated weights: eval falls back", "", _damaged(truncate_weights, eval_run, (0, 2))),
    Probe("files", "garbage manifest: --resume", "", _damaged(garbage_manifest, resume, (0, 2))),
    Probe("files", "garbage metrics line: report", "", _damaged(garbage_metrics_line, report, (0, 2))),
    Probe("files", "truncated trajectories: report", "", _damaged(truncate_trajectories, report, (0, 2))),
    Probe("files", "truncated trajectories: show", "", _damaged(truncate_trajectories, show, (0, 2))),
    Probe("files", "garbage config.yaml: --resume", "", _damaged(garbage_config, resume, (2,))),
    Probe("files", "symlinked report.html: report", "4", _linked("report.html", report)),
    Probe("files", "symlinked metrics.jsonl: --resume", "4", _linked("metrics.jsonl", resume_one_more_step)),
]
