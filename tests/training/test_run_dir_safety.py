"""A run never clears what is not its own, and never before every start-up check has passed
(issue 23, items 1 and 2), seen through the real `steprl` command with the shipped config
(which sets `run.overwrite: true`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_runs import assert_one_line, run_steprl
from steprl.config import ConfigError, load_config
from steprl.training.loop.resume import MARKER, is_run_dir
from steprl.training.loop.trainer import train
from tiny_runs import QUIET, small_config

pytestmark = pytest.mark.e2e

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/calculator_tiny.yaml")


def _train(tmp_path: Path, *sets: str) -> tuple[int, str]:
    args = ["train", CONFIG, "--set", f"run.output_dir={tmp_path / 'runs'}"]
    for s in sets:
        args += ["--set", s]
    return run_steprl(args, tmp_path)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["../victim", "../../x", "/abs/x", "a/b", "..", ".", "a\\b", "''"])
def test_run_name_is_a_plain_name(name: str) -> None:
    with pytest.raises(ConfigError, match=r"run\.name: .*not a plain name.*run\.output_dir"):
        load_config(CONFIG, [f"run.name={name}"])
    assert load_config(CONFIG, ["run.name=my-run_2..b"]).run.name == "my-run_2..b"


def test_a_run_name_that_leaves_output_dir_is_one_line_and_touches_nothing(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    rc, out = _train(tmp_path, "run.name=../victim")
    assert_one_line(rc, out, "run.name", "'../victim'", "plain name")
    assert _files(victim) == {"thesis.tex": b"years of work"}


def test_overwrite_refuses_a_directory_steprl_did_not_make(tmp_path: Path) -> None:
    mine = tmp_path / "runs" / "mine"
    mine.mkdir(parents=True)
    (mine / "data.csv").write_text("1,2\n")
    rc, out = _train(tmp_path, "run.name=mine")
    assert_one_line(rc, out, "run.overwrite", "not a steprl run directory", "data.csv")
    assert _files(mine) == {"data.csv": b"1,2\n"}


def test_a_run_made_before_the_marker_is_still_recognised(tmp_path: Path) -> None:
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "config.yaml").write_text("run: {}\n")
    (old / "metrics.jsonl").write_text("")
    assert is_run_dir(old)
    (old / "notes.txt").write_text("the user's")  # not only what a run writes, and no marker
    assert not is_run_dir(old)
    (old / MARKER).write_text("")  # made by steprl: cleared whole, notes and all
    assert is_run_dir(old)


def test_a_failed_start_leaves_the_finished_run_whole(tmp_path: Path) -> None:
    """The env and the model are checked before anything is cleared: a bad model.name, or
    env.params the env's factory refuses, is one line, and the finished run in the directory
    keeps every file (checkpoints, metrics, trajectories, TensorBoard)."""
    extra = [
        "model.init=scratch",
        "trainer.total_steps=1",
        "trainer.eval_tasks=2",
        "logging.tensorboard=true",
    ]
    done = train(
        small_config(tmp_path, "done", [*QUIET, *extra, "logging.save_trajectories=true"]), log=print
    )
    before = _files(done.run_dir)
    assert any(k.startswith("checkpoints/step_000001/") for k in before)
    assert "trajectories/step_000001.parquet" in before and any(k.startswith("tensorboard/") for k in before)
    rc, out = _train(tmp_path, "run.name=done", "model.name=/no/such/model")
    assert_one_line(rc, out, "/no/such/model")
    assert _files(done.run_dir) == before
    # the env's own check of its params (its factory raises at the first env the run builds)
    rc, out = _train(tmp_path, "run.name=done", "env.params={max_ops_per_call: 0}")
    assert_one_line(rc, out, "env 'calculator' refused env.params", "max_ops_per_call")
    assert _files(done.run_dir) == before
