"""A small fixed run directory for the report's tests, written with the real writers: two train
steps (one group of two per step, advantages saved), held-out episodes at steps 0 and 2 (task
eval-0 failed at the warm start and solved at the end), metrics.jsonl (with the health signals)
and config.yaml, and health.jsonl: two health rules fired, at steps 1 and 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from steprl import cli
from steprl.diagnostics import JsonlSink, TrajectoryWriter
from steprl.models.tiny import build_tokenizer
from steprl.types import EndReason, Step, Trajectory

TOK = build_tokenizer()


def _ids(text: str) -> tuple[int, ...]:
    return tuple(TOK.encode(text, add_special_tokens=False))


def episode(task: str, group: str, turns: list[tuple[str, str]], reward: float, version: int) -> Trajectory:
    prompt = (TOK.bos_token_id, *_ids(task.split("-")[-1] + "+2\n"))
    steps = []
    for k, (action, obs) in enumerate(turns):
        a = _ids(action)
        last = k == len(turns) - 1
        r = reward if last else 0.0
        info = {"turn": k + 1, "reward_components": {"outcome": r, "cost": 0.0}}
        steps.append(Step(prompt, a, tuple(-0.5 for _ in a), _ids(obs), r, version, info))
    end = EndReason.ANSWERED if turns[-1][0].startswith("<answer>") else EndReason.TRUNCATED
    return Trajectory(task, group, "calculator", tuple(steps), sum(s.reward for s in steps), end)


SOLVED = [("<calc>1+2</calc>", "<result>3</result>"), ("<answer>3</answer>", "")]
GUESSED = [("<answer>7</answer>", "")]
CONFIG = {
    "run": {"name": "fixture", "seed": 0},
    "model": {"name": "tiny", "init": "sft", "format": "auto"},
    "env": {"name": "calculator", "params": {}},
    "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip"},
    "trainer": {"total_steps": 2, "lr": 0.0001, "eval_every": 2},
}


def _advantages(t: Trajectory, a: float) -> list[list[float]]:
    return [[a] * len(s.action_ids) for s in t.steps]


def make_run(root: Path, name: str = "fixture", **config_changes: dict) -> Path:
    """Write the fixture run under `root / name`; `config_changes` replace config sections."""
    run = root / name
    run.mkdir(parents=True)
    config = {**CONFIG, **config_changes, "run": {"name": name, "seed": 0}}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    train = TrajectoryWriter(run / "trajectories")
    for step in (1, 2):
        good = episode(f"train-{step}", f"{step}-0", SOLVED, 1.0, step - 1)
        bad = episode(f"train-{step}", f"{step}-0", GUESSED, 0.0, step - 1)
        train.write(
            step,
            [good, bad],
            advantages=[_advantages(good, 0.7), _advantages(bad, -0.7)],
            step_credit=[[0.25] * len(good.steps), [-0.5] * len(bad.steps)],  # a step-reward model's
        )
    evals = TrajectoryWriter(run / "eval_trajectories")
    evals.write(0, [episode("eval-0", "e0", GUESSED, 0.0, 0), episode("eval-1", "e1", SOLVED, 1.0, 0)])
    evals.write(2, [episode("eval-0", "e0", SOLVED, 1.0, 2), episode("eval-1", "e1", SOLVED, 1.0, 2)])
    with JsonlSink(run / "metrics.jsonl") as sink:
        sink.log(0, {"eval/success": 0.5, "eval/tool_call_rate": 0.5})
        for step in (1, 2):
            metrics = {
                "reward/mean": 0.5,
                "success/rate": 0.5,
                "actor/entropy": 1.0 / step,
                "actor/approx_kl": 0.01 * step,
                "end_frac/answered": 0.5 + 0.25 * step,
                "end_frac/truncated": 0.5 - 0.25 * step,
                "env/calculator/success_rate": 0.5,
                "health/entropy_drop": 3.0 if step == 1 else 0.5,
                "health/grad_norm_z": 7.3 if step == 2 else 0.0,
                "health/firings": 1,
            }
            if step == 2:
                metrics |= {"eval/success": 1.0, "eval/tool_call_rate": 1.0}
            sink.log(step, metrics)
    (run / "health.jsonl").write_text("".join(json.dumps(f) + "\n" for f in FIRINGS))
    return run


#: what the trainer writes to health.jsonl when a rule fires (one line per firing)
FIRINGS = [
    {
        "step": 1,
        "rule": "entropy_collapse",
        "signals": {"entropy_drop": 3.0},
        "actions": ["alert", "entropy_bonus"],
        "outcome": "alert; entropy bonus 0.01",
        "acted": True,
    },
    {
        "step": 2,
        "rule": "grad_blowup",
        "signals": {"grad_norm_z": 7.3, "approx_kl": 0.4},
        "actions": ["alert", "rollback", "lr_scale"],
        "outcome": "alert; rollback 2 step(s): restored step 0; lr scale 1 -> 0.5",
        "acted": True,
    },
]


def page_data(page: Path) -> dict:
    """The JSON a written report embeds (what its script draws), read back from the HTML."""
    text = page.read_text(encoding="utf-8")
    start = text.index('id="report-data">') + len('id="report-data">')
    return json.loads(text[start : text.index("</script>", start)])


def steprl(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str]:
    """`steprl *argv` through `steprl.cli.main`, the entry point, in this process (a subprocess
    would only add seconds of imports): (exit code, everything printed)."""
    monkeypatch.setattr(sys, "argv", ["steprl", *argv])
    with pytest.raises(SystemExit) as done:
        cli.main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), (captured.out + captured.err).strip()
