"""Sinks, the Parquet trajectory file, learning-curve PNGs and the progress display."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from rich.console import Console

from steprl.diagnostics.plots import plot_learning_curve
from steprl.diagnostics.progress import TrainingProgress, print_summary_table
from steprl.diagnostics.sinks import (
    JsonlSink,
    MetricsSink,
    MultiSink,
    TensorBoardSink,
    TrajectoryWriter,
    read_metrics_jsonl,
    read_trajectories,
)
from steprl.types import EndReason, Step, Trajectory

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ------------------------------------------------------------------------------------ JSONL


def test_jsonl_one_object_per_line_with_nonfinite_as_null(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"  # parent created on demand
    with JsonlSink(path) as sink:
        sink.log(1, {"reward/mean": 0.5, "a": float("nan"), "b": float("inf"), "c": -float("inf")})
        assert path.read_text().count("\n") == 1  # flushed per line, before close
        sink.log(2, {"reward/mean": 0.75})
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward/mean": 0.5, "a": None, "b": None, "c": None},
        {"step": 2, "reward/mean": 0.75},
    ]
    with JsonlSink(path) as sink:  # a resumed run appends
        sink.log(3, {"reward/mean": 1.0})
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2, 3]


def test_jsonl_rejects_a_metric_named_step(tmp_path: Path) -> None:
    with JsonlSink(tmp_path / "m.jsonl") as sink, pytest.raises(ValueError, match="rename the metric"):
        sink.log(1, {"step": 3.0})


def test_read_metrics_skips_only_a_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    assert read_metrics_jsonl(path) == [{"step": 1, "x": 1.0}]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:1"):
        read_metrics_jsonl(path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics_jsonl(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------ TensorBoard


def test_tensorboard_writes_an_event_file_with_the_scalars(tmp_path: Path) -> None:
    logdir = tmp_path / "tb"
    sink = TensorBoardSink(logdir)
    assert isinstance(sink, MetricsSink)
    sink.log(1, {"reward/mean": 0.25, "tools/call_rate": 0.5})
    sink.log(2, {"reward/mean": 0.75})
    sink.close()
    events = list(logdir.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert "tools/call_rate" in acc.Tags()["scalars"]


# -------------------------------------------------------------------------------- MultiSink


class _Recorder:
    def __init__(self, fail_on_close: bool = False) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False
        self.fail_on_close = fail_on_close

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.logged.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True
        if self.fail_on_close:
            raise OSError("disk gone")


def test_multisink_fans_out_and_closes_every_sink() -> None:
    a, b, c = _Recorder(fail_on_close=True), _Recorder(), _Recorder()
    multi = MultiSink([a, b, c])
    multi.log(4, {"x": 1.0})
    assert a.logged == b.logged == c.logged == [(4, {"x": 1.0})]
    with pytest.raises(OSError, match="disk gone"):
        multi.close()
    assert a.closed and b.closed and c.closed


# ---------------------------------------------------------------------------------- Parquet


def _step(
    actions: Sequence[int], obs: Sequence[int], version: int, reward: float, prompt: Sequence[int]
) -> Step:
    return Step(
        prompt_ids=tuple(prompt),
        action_ids=tuple(actions),
        action_logprobs=tuple(-0.1 * (i + 1) for i in range(len(actions))),
        observation_ids=tuple(obs),
        reward=reward,
        policy_version=version,
        info={"action_kind": "tool_call", "reward_components": {"format": reward}},
    )


def _trajectories() -> list[Trajectory]:
    big = 151_000  # a real vocab-sized id must survive int32 storage exactly
    t1 = Trajectory(
        task_id="t1",
        group_id="g1",
        env="calc",
        steps=(
            _step([5, 6, big], [7, 8], 3, 0.1, prompt=[1, 2, 3]),
            _step([9], [], 4, 0.9, prompt=[1, 2, 3, 5, 6, big, 7, 8]),
        ),
        outcome_reward=1.0,
        end=EndReason.ANSWERED,
        info={"success": True},
    )
    t2 = Trajectory(
        task_id="t2", group_id="g1", env="calc", steps=(), outcome_reward=0.0, end=EndReason.INFRA_FAILED
    )  # failed at reset: no steps at all
    return [t1, t2]


def _decode(ids: Sequence[int]) -> str:
    return " ".join(f"<{i}>" for i in ids)


def test_parquet_round_trip_ids_exactly(tmp_path: Path) -> None:
    path = tmp_path / "trajectories"
    t1, t2 = _trajectories()
    with TrajectoryWriter(path, decode=_decode) as writer:
        writer.write(7, [t1, t2])
        writer.write(8, [])  # nothing to write is fine: an empty step file
        writer.write(9, [t1])
    assert sorted(p.name for p in path.iterdir()) == [f"step_00000{i}.parquet" for i in (7, 8, 9)]
    assert read_trajectories(path / "step_000009.parquet").num_rows == 1  # one step alone
    table = read_trajectories(path)
    rows = table.to_pylist()
    assert table.num_rows == 3
    assert [r["step"] for r in rows] == [7, 7, 9]
    r = rows[0]
    assert (r["task_id"], r["group_id"], r["env"], r["end"]) == ("t1", "g1", "calc", "answered")
    assert r["outcome_reward"] == 1.0 and r["num_steps"] == 2
    assert r["prompt_ids"] == list(t1.steps[0].prompt_ids)
    assert r["action_ids"] == [list(s.action_ids) for s in t1.steps]
    assert r["observation_ids"] == [list(s.observation_ids) for s in t1.steps]
    assert r["rewards"] == [0.1, 0.9]
    assert r["policy_versions"] == [3, 4]
    for got, want in zip(r["action_logprobs"], (s.action_logprobs for s in t1.steps), strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)  # stored as float32
    assert json.loads(r["info_json"]) == {"success": True}
    assert json.loads(r["step_info_json"][0])["reward_components"] == {"format": 0.1}
    assert r["prompt_text"] == "<1> <2> <3>"
    assert r["action_texts"] == ["<5> <6> <151000>", "<9>"]
    assert r["observation_texts"] == ["<7> <8>", ""]
    empty = rows[1]
    assert empty["end"] == "infra_failed" and empty["num_steps"] == 0
    assert empty["prompt_ids"] == [] and empty["action_ids"] == []


def test_parquet_without_decode_has_no_text_columns(tmp_path: Path) -> None:
    path = tmp_path / "t"
    writer = TrajectoryWriter(path)
    writer.write(0, _trajectories())
    writer.close()
    writer.close()  # idempotent
    names = read_trajectories(path).column_names
    assert "action_ids" in names and "action_texts" not in names and "prompt_text" not in names
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(1, _trajectories())


def test_parquet_dir_is_valid_even_with_no_rows(tmp_path: Path) -> None:
    path = tmp_path / "t"
    TrajectoryWriter(path).close()
    assert read_trajectories(path).num_rows == 0
    with pytest.raises(FileNotFoundError, match="one per step under <run_dir>/trajectories"):
        read_trajectories(tmp_path / "nope.parquet")


def test_a_write_killed_midway_leaves_no_half_file(tmp_path: Path) -> None:
    path = tmp_path / "t"
    with TrajectoryWriter(path) as writer:
        writer.write(1, _trajectories())
    (path / ".step_000002.parquet.tmp").write_bytes(b"PAR1 half a file")  # what a SIGKILL leaves
    assert read_trajectories(path).num_rows == 2  # the finished step reads; the torso is ignored
    TrajectoryWriter(path).close()  # the next writer (a resume) removes it
    assert not list(path.glob(".*.tmp"))


# -------------------------------------------------------------------------------------- PNG


def _write_rows(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_learning_curve_png_with_eval_points(tmp_path: Path) -> None:
    jsonl = tmp_path / "run" / "metrics.jsonl"
    jsonl.parent.mkdir()
    rows: list[dict[str, object]] = [
        {"step": s, "success/rate": s / 10, "tools/call_rate": 0.5, "episode/turns_mean": 2.0 + s}
        for s in range(1, 6)
    ]
    rows.append({"step": 5, "eval/success": 0.6})
    rows.append({"step": 6, "success/rate": None})  # a NaN written as null is skipped
    _write_rows(jsonl, rows)
    out = plot_learning_curve(jsonl, tmp_path / "plots" / "curve.png")
    assert out == tmp_path / "plots" / "curve.png"
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 1000


@pytest.mark.parametrize(
    "rows",
    [
        [{"step": 1, "success/rate": 0.5}],  # one row, two of three keys missing
        [],  # nothing logged yet
    ],
)
def test_learning_curve_png_with_missing_keys_or_few_rows(
    tmp_path: Path, rows: list[dict[str, object]]
) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    _write_rows(jsonl, rows)
    out = plot_learning_curve(jsonl, tmp_path / "curve.png", keys=("success/rate", "not/there"), eval_keys=())
    assert out.read_bytes()[:8] == PNG_MAGIC


# --------------------------------------------------------------------------------- progress


def test_progress_disabled_is_a_silent_noop() -> None:
    buf = io.StringIO()
    with TrainingProgress(3, enabled=False, console=Console(file=buf)) as p:
        p.update(1, {"reward/mean": 0.5})
        p.update(2)
    assert buf.getvalue() == ""


def test_progress_shows_live_fields() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with TrainingProgress(4, console=console) as p:
        p.update(1, {"reward/mean": 0.25})  # fields missing from metrics keep their last value
        p.update(4, {"reward/mean": 0.5, "success/rate": 0.75, "tools/calls_per_traj": 1.5})
        p.update(9)  # clamped to the total
    out = buf.getvalue()
    assert "reward 0.5" in out and "success 0.75" in out and "tools 1.5" in out and "4/4" in out
    with pytest.raises(ValueError, match="total_steps"):
        TrainingProgress(-1)


def test_summary_table() -> None:
    buf = io.StringIO()
    print_summary_table("eval", {"success/rate": 2 / 3, "env": "calc"}, console=Console(file=buf, width=80))
    out = buf.getvalue()
    assert "eval" in out and "success/rate" in out and "0.6667" in out and "calc" in out
