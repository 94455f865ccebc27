"""How long after its deadline a hung sync env call ends, in each phase that plays an env
(issue 23, item 8): `steprl check-env`, the SFT warm start's demonstrations, a training step's
rollouts, the evaluations inside training, and `steprl eval`.

    python benchmarks/hang_deadlines.py [--deadlines 1 3]

The env is the tests' ``hang`` (tests/hosting/hang_envs.py, loaded with ``--plugin``): its tool
blocks in `time.sleep` (nothing wakes it) on every second task, so each phase meets hung calls
beside quick ones. Each phase is run twice with the same seed and shape: hung, and clean
(`hang_on: none`). Phase times come from the run itself (`time/rollout_s`, `time/eval_s`, the
warm start's phase line, `steprl eval`'s `time/eval_s`); check-env's is the command's wall time.
`over` = hung - deadline: what a hung call costs beyond its deadline, the generation before the
call included. Run it on a quiet machine: the numbers are times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPRL = str(Path(sys.executable).parent / "steprl")
ENV = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(ROOT / "tests" / "hosting")}
SHAPE = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "env.name=hang",
    "runtime.failure_budget=1.0",
    "trainer.total_steps=1",
    "trainer.eval_tasks=4",
    "model.sft.num_episodes=8",
    "model.sft.skill_steps=2",
    "model.sft.steps=0",
    "model.sft.batch_size=4",
    "model.sft.strategies={expert: 1.0}",
]


def _run(args: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [STEPRL, *args, "--plugin", "hang_envs"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - started
    out = done.stdout + done.stderr
    if done.returncode not in (0, 1):
        raise SystemExit(f"`steprl {' '.join(args)}` exited {done.returncode}:\n{out[-3000:]}")
    return took, out


def phases(deadline: float, hang_on: str, tmp: Path) -> dict[str, float]:
    """Every phase's time for one deadline, hung (`every:2`) or clean (`none`)."""
    sets = [*SHAPE, f"env.params={{hang_on: '{hang_on}'}}", f"runtime.env_call_timeout_s={deadline}"]
    out_dir = tmp / f"{hang_on.replace(':', '')}_{deadline}"
    args = ["train", "configs/calculator_tiny.yaml", *(a for s in sets for a in ("--set", s))]
    _, log = _run([*args, "--set", f"run.output_dir={out_dir}", "--set", f"model.cache_dir={out_dir / 'c'}"])
    warm = re.search(r"phase skills: \d+ demonstrations .* \((\d+\.\d+)s\)", log)
    if warm is None:
        raise SystemExit(f"no warm-start phase line in the run's output:\n{log[-3000:]}")
    rows = [
        json.loads(line) for line in (out_dir / "calculator_tiny" / "metrics.jsonl").read_text().splitlines()
    ]
    _, shown = _run(["eval", str(out_dir / "calculator_tiny"), "--tasks", "4"])
    eval_cli = re.search(r"^\s+time/eval_s: ([\d.]+)$", shown, re.MULTILINE)
    if eval_cli is None:
        raise SystemExit(f"steprl eval printed no time/eval_s:\n{shown[-3000:]}")
    check_hang = "all" if hang_on != "none" else "none"
    check_s, _ = _run(
        [
            "check-env",
            "hang",
            "--tasks",
            "2",
            "--call-timeout-s",
            str(deadline),
            "--set",
            f"env.params={{hang_on: {check_hang}}}",
        ]
    )
    return {
        "check-env (wall)": check_s,
        "warm start demos": float(warm.group(1)),
        "warm-start eval": rows[0]["time/eval_s"],
        "train rollouts": rows[1]["time/rollout_s"],
        "train eval": rows[1]["time/eval_s"],
        "steprl eval": float(eval_cli.group(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadlines", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--repeats", type=int, default=1)
    ns = parser.parse_args()
    print(f"{'phase':<18} {'deadline':>8} {'hung s':>8} {'clean s':>8} {'over s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for deadline in ns.deadlines:
            runs = [
                (
                    phases(deadline, "every:2", Path(tmp) / f"h{r}"),
                    phases(deadline, "none", Path(tmp) / f"c{r}"),
                )
                for r in range(ns.repeats)
            ]
            for phase in runs[0][0]:
                hung = statistics.median(h[phase] for h, _ in runs)
                clean = statistics.median(c[phase] for _, c in runs)
                print(f"{phase:<18} {deadline:>8.1f} {hung:>8.2f} {clean:>8.2f} {hung - deadline:>7.2f}")


if __name__ == "__main__":
    main()
