"""A run's outputs under faults (issue 23, items 3-5 and two of item 18): a full disk stops the
run with one line and loses no step; the line's resume command continues the run as it was
configured (its --set overrides too); a damaged metrics line or trajectory file does not stop a
resume, which writes the lost trajectories again; an asynchronous run says which tasks it
admitted but never trained."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from cli_runs import run_steprl
from steprl.diagnostics import read_trajectories
from steprl.diagnostics.sinks import TrajectoryWriter
from steprl.training.loop.resume import repair_trajectories
from steprl.training.loop.trainer import train
from steprl.types import EndReason, Trajectory
from tiny_runs import QUIET, SMALL, small_config

pytestmark = pytest.mark.e2e

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/calculator_tiny.yaml")
TINY = [
    "model.init=scratch",  # no warm start: these tests are about files, not learning
    "trainer.eval_tasks=2",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "trainer.checkpoint_every=1",
]
# imported by `--plugin diskfull`: the disk is full for step 2's trajectory file while the flag
# file exists (the run's config.yaml names the plugin, so the resume imports it too)
DISKFULL = """
import errno, os
import pyarrow.parquet as pq

_write_table = pq.write_table

def write_table(table, where, *args, **kwargs):
    if "step_000002" in str(where) and os.path.exists("disk_full"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write_table(table, where, *args, **kwargs)

pq.write_table = write_table
"""


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_full_disk_stops_with_one_line_and_its_resume_command_continues_the_run(tmp_path):
    (tmp_path / "diskfull.py").write_text(DISKFULL)
    (tmp_path / "disk_full").touch()
    sets = [*SMALL, *TINY, "trainer.total_steps=2", "rollout.max_staleness=1", "logging.tensorboard=false"]
    args = ["train", CONFIG, "--plugin", "diskfull", "--set", "run.output_dir=runs", "--set", "run.name=full"]
    rc, out = run_steprl([*args, *(a for s in sets for a in ("--set", s))], tmp_path)
    run_dir = tmp_path / "runs" / "full"
    last = out.splitlines()[-1]
    assert rc == 1 and "Traceback" not in out, out
    assert "trajectories of step 2" in last and "No space left on device" in last and "MiB free" in last, out
    assert "the run stopped at step 2" in last and "from step_000001" in last, out
    # what was finished is whole and readable; step 2 left no metrics row for trajectories it lost
    assert sorted(p.name for p in (run_dir / "trajectories").iterdir()) == ["step_000001.parquet"]
    assert read_trajectories(run_dir / "trajectories").num_rows == 4
    assert _steps(run_dir) == [0, 1]
    assert not (run_dir / "checkpoints" / "step_000002").exists()  # step 2 is not kept: it runs again

    (tmp_path / "disk_full").unlink()  # space freed; the printed command, word for word
    command = re.search(r"resume with: (steprl train --resume \S+)", last)
    assert command is not None, last
    assert command.group(1) == "steprl train --resume runs/full"
    rc, out = run_steprl(shlex.split(command.group(1))[1:], tmp_path)
    assert rc == 0, out  # its --set overrides came back: a changed config is refused (CKPT-06)
    assert "resumed from" in out and "step_000001" in out
    assert _steps(run_dir) == [0, 1, 2]
    table = read_trajectories(run_dir / "trajectories")
    assert sorted(set(table.column("step").to_pylist())) == [1, 2] and table.num_rows == 8

    # item 18: the tasks an asynchronous run admitted but never trained, in one line
    state = torch.load(run_dir / "checkpoints" / "latest" / "state.pt", weights_only=False)["train_state"]
    pending = sorted(i for i, _ in state["pending"])
    assert len(pending) == 2, state["pending"]  # (max_staleness + 1) x tasks_per_step admitted, 2 trained
    line = next(x for x in out.splitlines() if "admitted but not trained" in x)
    shown = re.fullmatch(r"2 tasks admitted but not trained \(stream indices ([-\d, ]+)\): .*", line)
    assert shown is not None, line
    spans = [[int(x) for x in span.split("-")] for span in shown.group(1).split(", ")]
    assert [i for span in spans for i in range(span[0], span[-1] + 1)] == pending, line


def test_resume_past_a_bad_metrics_byte_and_a_truncated_trajectory_file(tmp_path):
    """Item 5: a non-UTF-8 byte in metrics.jsonl is a warning, not a crash. Item 4: the last
    trajectory file, truncated, is written again: the resume goes back to the checkpoint
    before it and runs that step again, exactly. The resume is `steprl train --resume RUN_DIR`."""
    cfg = small_config(
        tmp_path, "r", [*QUIET, *TINY, "trainer.total_steps=2", "logging.save_trajectories=true"]
    )
    run_dir = train(cfg, log=lambda _: None).run_dir
    intact = read_trajectories(run_dir / "trajectories")
    metrics = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
    metrics[1] = metrics[1].replace(b'"step": 1', b'"step": 1, "\xff": 0')
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(metrics))
    last = run_dir / "trajectories" / "step_000002.parquet"
    last.write_bytes(last.read_bytes()[:100])

    rc, said = run_steprl(["train", "--resume", str(run_dir)], tmp_path)  # as the defect was seen
    assert rc == 0 and "Traceback" not in said, said
    assert "metrics.jsonl:2 is not a JSON object" in said and "line dropped" in said
    assert "trajectories of step 2 cannot be read; resuming from" in said and "step_000001" in said
    assert _steps(run_dir) == [0, 2]  # step 1's row was damaged; step 2 ran again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every file reads
        again = read_trajectories(run_dir / "trajectories")
    # the same episodes: ids, rewards, ends exactly; log-probs within the engine's 1e-4 (a batch
    # of other company may round differently)
    assert again.drop_columns(["action_logprobs"]).equals(intact.drop_columns(["action_logprobs"]))
    got_lp, want_lp = (
        again.column("action_logprobs").to_pylist(),
        intact.column("action_logprobs").to_pylist(),
    )
    for got, want in zip(got_lp, want_lp, strict=True):
        assert [x for s in got for x in s] == pytest.approx([x for s in want for x in s], abs=1e-4)


def test_a_resume_removes_later_files_and_moves_an_unreadable_one_aside(tmp_path):
    """No earlier checkpoint to redo a damaged step from: its file is moved aside (named in a
    warning), so the directory reads; files after the checkpoint go (those steps run again)."""
    path = tmp_path / "trajectories"
    with TrajectoryWriter(path) as writer:
        for step in (1, 2, 3):
            writer.write(step, [Trajectory("t", "g", "calc", (), 0.0, EndReason.ANSWERED)])
    damaged = path / "step_000001.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-8])
    lines: list[str] = []
    repair_trajectories(path, 2, lines.append)
    assert sorted(p.name for p in path.iterdir()) == ["step_000001.parquet.unreadable", "step_000002.parquet"]
    assert len(lines) == 1 and lines[0].startswith("WARNING") and "step_000001.parquet" in lines[0]
    assert read_trajectories(path).column("step").to_pylist() == [2]
    shutil.rmtree(path)
