"""A run's saved episodes (issue 25): training episodes carry the advantages they were trained
with, every held-out evaluation's episodes are saved with the same tasks and seeds each time
(so two evaluations differ only by the policy), `steprl eval` saves its own, and `steprl show`
prints them; all on one tiny CLI run."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_runs import ROOT, TINY_SCRATCH, assert_one_line, run_steprl
from steprl.diagnostics import read_trajectories

pytestmark = pytest.mark.e2e

GREEN_FULL = "48;2;0;220;0"  # advantage_style: the step's largest positive |A|
RED_HALF = "48;2;145;0;0"  # half of it, negative


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("show")
    # a learning rate below float32 resolution: the policy cannot move, so the evaluations at
    # steps 0 and 2 differ only if their seeds do
    sets = [*TINY_SCRATCH, "trainer.total_steps=2", "trainer.lr=1e-30", f"run.output_dir={out}", "run.name=r"]
    rc, log = run_steprl(
        ["train", "configs/calculator_tiny.yaml", *[x for s in sets for x in ("--set", s)]], ROOT
    )
    assert rc == 0, log
    return out / "r"


def test_episodes_are_saved_with_advantages_and_evaluations_are_paired(run_dir):
    train = read_trajectories(run_dir / "trajectories").to_pylist()
    trained = [r for r in train if r["advantages"] is not None]
    assert trained, "no episode was trained on"
    for r in trained:
        assert [len(a) for a in r["advantages"]] == [len(a) for a in r["action_ids"]]
    evals = {s: pq.read_table(run_dir / "eval_trajectories" / f"step_{s:06d}.parquet") for s in (0, 2)}
    assert sorted(p.name for p in (run_dir / "eval_trajectories").iterdir()) == [
        "step_000000.parquet",
        "step_000002.parquet",
    ]
    assert evals[0].column("advantages").null_count == evals[0].num_rows  # held out: never trained
    keep = ["task_id", "action_ids", "observation_ids", "rewards", "end"]
    assert evals[0].select(keep).equals(evals[2].select(keep))  # same tasks, same seeds

    rc, out = run_steprl(["eval", str(run_dir), "--tasks", "2"], ROOT)
    assert rc == 0, out
    saved = run_dir / "eval_cli" / "step_000002.parquet"
    assert f"episodes: {saved}" in out, out
    assert pq.read_table(saved).select(keep).equals(evals[2].select(keep))  # the run's own seeds


def test_steprl_show(run_dir, monkeypatch):
    rc, out = run_steprl(["show", str(run_dir)], ROOT)
    assert rc == 0, out
    tasks = sorted(
        set(read_trajectories(run_dir / "trajectories" / "step_000002.parquet")["task_id"].to_pylist())
    )
    assert "r: step 2" in out and all(f"task {t}" in out for t in tasks), out
    assert "saved steps: 1-2" in out, out

    # step 1's advantages made visible: +1 on the first turn's tokens, -0.5 on the others'
    path = run_dir / "trajectories" / "step_000001.parquet"
    table = pq.read_table(path)
    advantages = [
        [[1.0 if k == 0 else -0.5] * len(a) for k, a in enumerate(turns)]
        for turns in table["action_ids"].to_pylist()
    ]
    column = table.schema.get_field_index("advantages")
    pq.write_table(
        table.set_column(column, "advantages", pa.array(advantages, table.schema.field(column).type)), path
    )
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLORTERM", "truecolor")
    task = table["task_id"][0].as_py()
    rc, out = run_steprl(["show", str(run_dir), "--step", "1", "--task", task], ROOT)
    assert rc == 0, out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert f"task {task}" in plain and "[prompt: masked]" in plain and "turn 2 · policy v" in plain, plain
    assert GREEN_FULL in out and RED_HALF in out, out

    rc, out = run_steprl(
        ["show", str(run_dir), "--eval", "--step", "0", "--task", "calculator-eval-10000-0"], ROOT
    )
    assert rc == 0, out
    assert "[observation: masked]" in re.sub(r"\x1b\[[0-9;]*m", "", out) and "48;2;0;" not in out, out

    for args, needles in (
        ([str(run_dir.parent / "nope")], ("no run directory", "runs in", ": r")),
        ([str(run_dir), "--step", "7"], ("has no step 7", "saved steps: 1-2")),
        (
            [str(run_dir), "--eval", "--task", "zz"],
            ("no task 'zz' at evaluation 2", "calculator-eval-10000-0"),
        ),
    ):
        rc, out = run_steprl(["show", *args], ROOT)
        assert_one_line(rc, out, *needles)


def test_a_truncated_step_file_is_one_line(run_dir, tmp_path):
    """A step file cut short (a run killed while writing it; found by the fault battery): an
    ArrowInvalid traceback before, one line naming the file and the steps that can be read now."""
    import shutil

    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy)
    last = copy / "trajectories" / "step_000002.parquet"
    last.write_bytes(last.read_bytes()[:100])
    rc, out = run_steprl(["show", str(copy)], ROOT)
    assert_one_line(rc, out, "step_000002.parquet cannot be read", "other saved steps: 1")
