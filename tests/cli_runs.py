"""Running the real `steprl` entry point in a subprocess, and the one-line error check that the
bad-input tests share."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import cli_zygote

STEPRL = str(Path(sys.executable).parent / "steprl")


def run_steprl(
    args: Sequence[str],
    cwd: Path,
    program: Sequence[str] = (STEPRL,),
    *,
    pythonpath: Sequence[Path] = (),
    timeout: float = 300,
) -> tuple[int, str]:
    """`steprl *args` in `cwd` (or `program *args`): (exit code, stdout + stderr). `pythonpath`:
    directories the command imports from (test envs loaded with --plugin)."""
    env = {**os.environ, "COLUMNS": "400"}  # rich wraps at the terminal width
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    done = cli_zygote.run(
        [*program, *args], cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def assert_one_line(rc: int, out: str, *needles: str) -> None:
    """Exit 2, no traceback, and the error is the last line, whole (the run may log before it)."""
    assert rc == 2, out
    assert "Traceback" not in out, out
    last = out.splitlines()[-1]
    for needle in needles:
        assert needle in last, out


ROOT = Path(__file__).resolve().parents[1]

#: the smallest run the CLI trains: a one-layer tiny model from scratch, 2 tasks x 2 episodes
#: of at most 2 turns, no evaluation between steps, no TensorBoard
TINY_SCRATCH = (
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "model.init=scratch",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "trainer.eval_tasks=2",
    "trainer.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
)


def train_hang_env(output_dir: Path, *sets: str) -> tuple[int, str]:
    """`steprl train` of `TINY_SCRATCH` on the `hang` test env (tests/hosting/hang_envs.py,
    loaded with --plugin), its run under `output_dir`; `sets` add or override settings."""
    settings = [*TINY_SCRATCH, "env.name=hang", f"run.output_dir={output_dir}", *sets]
    args = ["train", "configs/calculator_tiny.yaml", "--plugin", "hang_envs"]
    return run_steprl(
        [*args, *[x for s in settings for x in ("--set", s)]], ROOT, pythonpath=[ROOT / "tests" / "hosting"]
    )
