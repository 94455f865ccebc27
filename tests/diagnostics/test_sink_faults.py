"""The writers and readers under faults (issue 23, items 3-5): a full disk is one line that says
what was not written, with no half file; one damaged trajectory file or metrics line does not
take the rest of the run's outputs with it."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest

from steprl.diagnostics import sinks
from steprl.diagnostics.sinks import (
    JsonlSink,
    OutputWriteError,
    TrajectoryWriter,
    read_metrics_jsonl,
    read_trajectories,
    truncate_metrics,
)
from steprl.errors import RunAborted
from steprl.types import EndReason, Trajectory


def _one(task: str) -> list[Trajectory]:
    return [Trajectory(task, "g", "calc", steps=(), outcome_reward=1.0, end=EndReason.ANSWERED)]


def _disk_full(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_writing_trajectories_is_one_line_and_no_half_file(tmp_path, monkeypatch):
    path = tmp_path / "trajectories"
    writer = TrajectoryWriter(path)
    writer.write(1, _one("a"))
    monkeypatch.setattr(sinks.pq, "write_table", _disk_full)
    with pytest.raises(OutputWriteError) as caught:
        writer.write(2, _one("b"))
    message = str(caught.value)
    assert isinstance(caught.value, RunAborted) and "\n" not in message  # the CLI prints it, exit 1
    assert "trajectories of step 2" in message and "No space left on device" in message
    assert "MiB free" in message and "free space" in message
    assert sorted(p.name for p in path.iterdir()) == ["step_000001.parquet"]  # no tmp left, step 1 whole
    monkeypatch.undo()
    assert read_trajectories(path).column("task_id").to_pylist() == ["a"]


def test_a_full_disk_while_writing_metrics_is_one_line(tmp_path, monkeypatch):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(0, {"x": 1.0})
    monkeypatch.setattr(sink._file, "flush", _disk_full)  # noqa: SLF001 (the file object's own flush)
    with pytest.raises(OutputWriteError, match=r"metrics of step 1 .*No space left on device"):
        sink.log(1, {"x": 2.0})
    sink.close()  # the refused write's buffer does not turn the close into a second error
    assert read_metrics_jsonl(tmp_path / "metrics.jsonl")[0] == {"step": 0, "x": 1.0}


def test_read_trajectories_skips_an_unreadable_file_naming_it(tmp_path):
    path = tmp_path / "trajectories"
    with TrajectoryWriter(path) as writer:
        for step, task in ((1, "a"), (2, "b"), (3, "c")):
            writer.write(step, _one(task))
    damaged = path / "step_000002.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-20])  # truncated: no footer
    with pytest.warns(UserWarning, match=r"step_000002\.parquet: cannot be read .*skipped"):
        table = read_trajectories(path)
    assert table.column("task_id").to_pylist() == ["a", "c"]
    assert (
        sinks.readable_parquet(damaged) is not None
        and sinks.readable_parquet(path / "step_000001.parquet") is None
    )


def test_a_non_utf8_byte_in_metrics_names_the_line_or_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": float(s)}).encode() for s in range(4)]
    rows[2] = rows[2].replace(b'"x"', b'"\xff"')
    path.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3 is not a JSON object"):
        read_metrics_jsonl(path)  # strict by default: a ValueError naming the line, not a decode crash
    warnings: list[str] = []
    assert truncate_metrics(path, 2, warn=warnings.append) == 1  # step 3 dropped (redone)
    assert len(warnings) == 1 and "metrics.jsonl:3" in warnings[0] and warnings[0].startswith("WARNING")
    assert read_metrics_jsonl(path) == [{"step": 0, "x": 0.0}, {"step": 1, "x": 1.0}]  # repaired on disk


# A TensorBoard sink whose events file meets a full disk (here: the file size limit, EFBIG, as
# `prlimit --fsize` gives it; ENOSPC takes the same path): the sink's own line, nothing else.
TENSORBOARD_FULL = """
import resource, sys
from steprl.diagnostics.sinks import OutputWriteError, TensorBoardSink

sink = TensorBoardSink(sys.argv[1])
sink.log(0, {"x": 0.0})
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # this process's files stop at 4 KiB
try:
    for step in range(1, 1000):
        sink.log(step, {f"m/{i}": float(i) for i in range(50)})
except OutputWriteError as err:
    print(err)
sink.close()
"""


def test_a_full_disk_under_tensorboard_is_its_one_line_without_the_writer_threads_traceback(tmp_path):
    """Issue 44 item 10: TensorBoard's writer thread died with a traceback (11 lines, 'Exception in
    thread') before the run's one line; its error is the foreground's to report."""
    done = subprocess.run(
        [sys.executable, "-c", TENSORBOARD_FULL, str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "TensorBoard events of step" in done.stdout and "File too large" in done.stdout, done.stdout
    assert done.stderr == "", done.stderr
