"""Who owns a run directory, and what a start that fails or a stop leaves in it (issue 44),
through the real `steprl train` with the shipped config (which sets `run.overwrite: true`):
one process at a time writes a run directory (a lock outside what overwrite clears); a start
that fails (W&B not logged in) or is stopped before its first step (SIGTERM in the warm-start
evaluation) leaves a finished run of the same name whole; a health rule's stop leaves what
Ctrl-C leaves (a checkpoint of the last finished step, the curve, the report)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import cli_zygote
from cli_runs import ROOT, STEPRL, TINY_SCRATCH, assert_one_line, run_steprl, train_hang_env

pytestmark = pytest.mark.e2e

NAME = "calculator_tiny"  # the shipped config's run.name


def _finished_run(run_dir: Path) -> dict[str, bytes]:
    """A finished run as far as `run.overwrite` is concerned (its marker and what a run writes);
    returns its files, to compare with afterwards."""
    files = {
        ".steprl-run": "a steprl run directory\n",
        "config.yaml": "run: {name: calculator_tiny}\n",
        "metrics.jsonl": '{"step": 0, "eval/success": 0.5}\n{"step": 1}\n',
        "checkpoints/step_000001/manifest.json": '{"step": 1, "files": {}}',
        "checkpoints/step_000001/state.pt": "weeks of training",
        "trajectories/step_000001.parquet": "episodes",
    }
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return _files(run_dir)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _start(output_dir: Path, log: Path, *sets: str) -> subprocess.Popen[bytes]:
    """`train_hang_env`'s command, in the background, its output to `log`."""
    settings = [*TINY_SCRATCH, "env.name=hang", f"run.output_dir={output_dir}", *sets]
    args = ["train", "configs/calculator_tiny.yaml", "--plugin", "hang_envs"]
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(ROOT / "tests" / "hosting")}
    with log.open("wb") as out:
        return cli_zygote.popen(
            [STEPRL, *args, *[x for s in settings for x in ("--set", s)]],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_for(proc: subprocess.Popen[bytes], log: Path, ready: object, timeout: float = 120) -> None:
    """Until `ready()` holds (the run is blocked where the test wants it)."""
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text().strip()


def test_a_second_train_of_the_same_run_is_refused_naming_the_pid_holding_it(tmp_path):
    """Both used to exit 0, leaving one directory with one run's config and metrics and the
    other's checkpoints and trajectories. The first clears a finished run (overwrite) and blocks
    in its first step's rollouts: the lock it took before clearing outlived the clearing."""
    runs = tmp_path / "runs"
    run_dir = runs / NAME
    run_dir.mkdir(parents=True)
    _finished_run(run_dir)
    hang = ["env.params={hang_on: train}", "runtime.env_call_timeout_s=300", "trainer.total_steps=1"]
    first = _start(runs, tmp_path / "first.log", *hang)
    try:
        started = lambda: "time/eval_s" in _text(run_dir / "metrics.jsonl")  # noqa: E731 (its warm start)
        _wait_for(first, tmp_path / "first.log", started)
        before = _files(run_dir)
        assert ".steprl-run" in before and "checkpoints/step_000001/state.pt" not in before  # cleared
        rc, out = train_hang_env(runs, "env.params={hang_on: none}", "trainer.total_steps=1")
        assert_one_line(rc, out, str(run_dir), "in use by another steprl train", f"pid {first.pid}")
        assert _files(run_dir) == before
    finally:
        rc, out = _stop(first, tmp_path / "first.log")
    assert rc == 130 and out.splitlines()[-1].startswith("interrupted (SIGTERM) before the first step"), out


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_sigterm_in_the_warm_start_evaluation_leaves_the_finished_run_whole(tmp_path):
    """The directory used to be cleared before the warm-start evaluation, which a SIGTERM
    ended with "nothing was trained": the finished run's checkpoints were gone."""
    runs = tmp_path / "runs"
    (runs / NAME).mkdir(parents=True)
    before = _finished_run(runs / NAME)
    log = tmp_path / "train.log"
    proc = _start(runs, log, "env.params={hang_on: eval}", "runtime.env_call_timeout_s=300")
    try:  # the sizes are printed just before the warm-start evaluation, whose episodes hang
        _wait_for(proc, log, lambda: "optimizer_steps_per_rl_step" in _text(log))
        time.sleep(1.0)  # inside the blocked call
    finally:
        rc, out = _stop(proc, log)
    assert rc == 130 and "Traceback" not in out, out
    assert out.splitlines()[-1].startswith("interrupted (SIGTERM) before the first step"), out
    assert _files(runs / NAME) == before


def test_wandb_not_logged_in_is_one_line_and_leaves_the_finished_run_whole(tmp_path, monkeypatch):
    """W&B was started after the clearing: rc 2, and the finished run's files were gone."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no W&B settings
    runs = tmp_path / "runs"
    (runs / NAME).mkdir(parents=True)
    before = _finished_run(runs / NAME)
    sets = [*TINY_SCRATCH, f"run.output_dir={runs}", "logging.wandb={mode: online}"]
    rc, out = run_steprl(
        ["train", "configs/calculator_tiny.yaml", *(x for s in sets for x in ("--set", s))], ROOT
    )
    assert_one_line(rc, out, "logging.wandb", "wandb login", "mode=offline")
    assert _files(runs / NAME) == before


def test_a_health_rule_stop_leaves_what_ctrl_c_leaves(tmp_path):
    """With the default `trainer.checkpoint_every: 0` a rule's stop used to leave no checkpoint,
    no curve, no report and no final evaluation: nothing to resume or look at. Now it is Ctrl-C
    with a reason, and the step it stopped at is evaluated as a run's last step is."""
    rule = "[{name: halt, when: [{signal: approx_kl, above: -1}], steps: 1, actions: [stop]}]"
    sets = [*TINY_SCRATCH, f"run.output_dir={tmp_path}", "trainer.total_steps=3", f"health.rules={rule}"]
    rc, out = run_steprl(
        ["train", "configs/calculator_tiny.yaml", *(x for s in sets for x in ("--set", s))], ROOT
    )
    run_dir = tmp_path / NAME
    last = out.splitlines()[-1]
    assert rc == 1 and "Traceback" not in out, out
    assert "health rule 'halt' stopped the run at step 1" in last, out
    assert f"resume with: steprl train --resume {run_dir}" in last, out
    assert "no earlier checkpoint" in last, out
    manifest = json.loads((run_dir / "checkpoints" / "latest" / "manifest.json").read_text())
    assert manifest["step"] == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/success" in r] == [0, 1], rows  # the end, evaluated
    assert (run_dir / "report.html").stat().st_size > 0
    assert (run_dir / "learning_curve.png").stat().st_size > 0


def test_an_output_dir_that_cannot_be_made_is_one_line() -> None:
    """`run.output_dir` under /proc (found by the fault battery): a FileNotFoundError traceback
    from making the lock's folder before; now the one-line refusal naming the key."""
    from steprl.errors import UserError
    from steprl.training.loop.run_lock import hold_run_dir

    with (
        pytest.raises(UserError, match=r"run.output_dir: cannot write /proc/steprl-fault"),
        hold_run_dir(Path("/proc/steprl-fault/run")),
    ):
        pass
