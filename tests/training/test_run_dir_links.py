"""A run never writes through a link planted in its run directory (issue 44, item 4): every
writer of a run directory (config.yaml and the marker, metrics.jsonl, trajectories, checkpoints,
health.jsonl, the curve, report.html) opens its files with `open_output` and its directories
through `no_link`, which refuse a symlink with one line naming it; the target is never written,
nor deleted. Seen end to end through `steprl train --resume`, and writer by writer."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cli_runs import assert_one_line, run_steprl
from steprl.diagnostics.plots import plot_learning_curve
from steprl.diagnostics.sinks import (
    JsonlSink,
    OutputLinkError,
    TrajectoryWriter,
    open_output,
    truncate_metrics,
)
from steprl.models import tiny
from steprl.report import write_report
from steprl.training.learn import checkpoint as ckpt
from steprl.training.loop import health_run
from steprl.training.loop.trainer import train
from steprl.types import EndReason, Trajectory
from tiny_runs import QUIET, small_config

LINK = "is a symbolic link"
VICTIM = "the user's file, outside the run directory\n"
#: the smallest finished run to resume: no warm start, 2 tasks x 2 episodes of at most 2 turns
TINY = [
    "model.init=scratch",
    "trainer.eval_tasks=2",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8",
]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "notes.txt"
    path.parent.mkdir()
    path.write_text(VICTIM)
    return path


def _planted(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def _refused(call, where: Path) -> None:
    with pytest.raises(OutputLinkError, match=LINK) as err:
        call()
    assert str(where) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.e2e
def test_a_resume_never_writes_or_deletes_through_links_planted_in_the_run_directory(tmp_path: Path):
    """Before: `--resume` rewrote config.yaml through a link into the file it pointed at, and
    removed the "later" step files in a directory `trajectories` pointed at."""
    sets = [*QUIET, *TINY, "trainer.total_steps=1"]
    run_dir = train(
        small_config(tmp_path, "done", [*sets, "logging.save_trajectories=true"]), log=print
    ).run_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    # the victim config reads as the run's own (the resume reads it), with the user's last line
    (outside / "config.yaml").write_text((run_dir / "config.yaml").read_text() + "# mine\n")
    (run_dir / "config.yaml").unlink()
    _planted(run_dir / "config.yaml", outside / "config.yaml")
    shutil.move(run_dir / "trajectories", outside / "trajectories")
    (outside / "trajectories" / "step_000005.parquet").write_text("the user's")
    _planted(run_dir / "trajectories", outside / "trajectories")
    before = {str(p): p.read_bytes() for p in sorted(outside.rglob("*")) if p.is_file()}

    rc, out = run_steprl(["train", "--resume", str(run_dir), "--set", "trainer.total_steps=2"], tmp_path)
    assert_one_line(rc, out, LINK, str(run_dir))
    assert {str(p): p.read_bytes() for p in sorted(outside.rglob("*")) if p.is_file()} == before


def test_metrics_lines_and_their_repair_refuse_a_link(tmp_path: Path, victim: Path) -> None:
    link = _planted(tmp_path / "run" / "metrics.jsonl", victim)
    _refused(lambda: JsonlSink(link), link)
    _refused(lambda: truncate_metrics(link, 0), link)
    tmp = _planted(tmp_path / "run2" / "metrics.jsonl.tmp", victim)  # the repair's own temporary
    (tmp_path / "run2" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    _refused(lambda: truncate_metrics(tmp_path / "run2" / "metrics.jsonl", 1), tmp)
    assert victim.read_text() == VICTIM


def test_trajectory_files_refuse_a_linked_directory_or_file(tmp_path: Path, victim: Path) -> None:
    linked_dir = _planted(tmp_path / "run" / "trajectories", victim.parent)
    _refused(lambda: TrajectoryWriter(linked_dir), linked_dir)
    writer = TrajectoryWriter(tmp_path / "run2" / "trajectories")
    tmp = _planted(writer.path / ".step_000001.parquet.tmp", victim)
    episode = Trajectory("t", "g", "calc", (), 0.0, EndReason.ANSWERED)
    _refused(lambda: writer.write(1, [episode]), tmp)
    assert victim.read_text() == VICTIM


def test_health_log_refuses_a_link(tmp_path: Path, victim: Path) -> None:
    link = _planted(tmp_path / "run" / health_run.HEALTH_LOG, victim)
    _refused(lambda: health_run.write_log(link.parent, [{"step": 1, "rule": "r"}]), link)
    _refused(lambda: health_run.repair_log(link.parent, 0), link)
    assert victim.read_text() == VICTIM


def test_checkpoints_refuse_a_linked_directory_and_replace_their_own_names(tmp_path: Path, victim: Path):
    tok = tiny.build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)

    def save(root: Path, step: int) -> Path:
        state = {"train_state": {"step": step}, "x": torch.zeros(2)}
        return ckpt.save_checkpoint(
            root,
            step,
            write_model=functools.partial(ckpt.write_model, model),
            tokenizer=tok,
            state=state,
            config_yaml="run: {}\n",
            keep_last=2,
        )

    linked = _planted(tmp_path / "run" / "checkpoints", victim.parent)
    _refused(lambda: save(linked, 1), linked)
    # a link at a checkpoint's own temporary or final name is replaced, its target untouched
    root = tmp_path / "run2" / "checkpoints"
    _planted(root / ".tmp-step_000001", victim.parent)
    _planted(root / "step_000001", victim.parent)
    saved = save(root, 1)
    assert not saved.is_symlink() and ckpt.verify(saved) is None
    assert sorted(p.name for p in victim.parent.iterdir()) == ["notes.txt"]
    assert victim.read_text() == VICTIM


@pytest.mark.e2e
def test_the_curve_and_the_report_refuse_a_link(tmp_path: Path, victim: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval/success": 0.5}\n{"step": 1}\n')
    (run_dir / "config.yaml").write_text("run: {name: run}\n")
    curve = _planted(run_dir / "learning_curve.png", victim)
    _refused(lambda: plot_learning_curve(run_dir / "metrics.jsonl", curve), curve)
    tmp = _planted(run_dir / ".report.html.tmp", victim)
    _refused(lambda: write_report(run_dir), tmp)
    assert victim.read_text() == VICTIM


def test_open_output_writes_a_plain_file_and_refuses_a_dangling_link(tmp_path: Path) -> None:
    with open_output(tmp_path / "a.txt", "w") as f:
        f.write("x")
    with open_output(tmp_path / "a.txt", "a") as f:
        f.write("y")
    assert (tmp_path / "a.txt").read_text() == "xy"
    dangling = _planted(tmp_path / "b.txt", tmp_path / "nowhere" / "made.txt")
    _refused(lambda: open_output(dangling, "wb"), dangling)
    assert not (tmp_path / "nowhere").exists()
