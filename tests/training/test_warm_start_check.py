"""A warm start too weak for RL to lift is named before the first RL step (issue 44 item 14):
one WARNING line with the held-out success, the tool-call rate, and how far to lengthen
`model.sft` (the rule and its data: `training/setup/warm_start_check.py`)."""

from __future__ import annotations

from pathlib import Path

from cli_runs import run_steprl
from steprl.training.setup.warm_start_check import MIN_SUCCESS, advice, read_warm_start
from steprl.types import EndReason, Step, Trajectory
from tiny_runs import SMALL

ROOT = Path(__file__).resolve().parents[2]


def _episode(success: bool, tool: bool) -> Trajectory:
    kind = "tool_call" if tool else "answer"
    step = Step((1,), (2,), (-0.1,), (), float(success), 0, {"action_kind": kind})
    return Trajectory("t", "g", "calc", (step,), float(success), EndReason.ANSWERED)


def _episodes(with_tool: tuple[int, int], without: tuple[int, int]) -> list[Trajectory]:
    """(successes, episodes) among the episodes that called a tool and those that did not."""
    (ws, wn), (os_, on) = with_tool, without
    return [_episode(i < ws, True) for i in range(wn)] + [_episode(i < os_, False) for i in range(on)]


def test_the_rule_reads_success_and_tool_use_and_scales_the_advice() -> None:
    weak = read_warm_start(_episodes((3, 20), (2, 80)))  # 0.05 success, a fifth call the tool
    assert (weak.success, weak.tool_rate, weak.success_with_tool, weak.success_without_tool) == (
        0.05,
        0.2,
        0.15,
        0.025,
    )
    line = advice(weak, init="sft", skill_steps=250)
    assert line is not None and "held-out success 0.05" in line and "tool-call rate 0.20" in line, line
    assert "lengthen model.sft.skill_steps 250 -> 1000 (x4)" in line, line  # 0.25 / 0.05, at most x4
    assert "skill_steps 250 -> 750 (x3)" in str(
        advice(read_warm_start(_episodes((10, 100), (0, 0))), init="sft", skill_steps=250)
    )
    strong = read_warm_start(_episodes((30, 100), (0, 0)))
    assert strong.success >= MIN_SUCCESS and advice(strong, init="sft", skill_steps=250) is None
    no_sft = advice(weak, init="pretrained", skill_steps=250)
    assert no_sft is not None and "warm-start it longer" in no_sft, no_sft
    assert advice(read_warm_start([]), init="sft", skill_steps=250) is None  # nothing measured: nothing said


def test_train_says_so_before_rl_starts(tmp_path: Path) -> None:
    """Through `steprl train`: a 2-step warm start (held-out success 0 on the calculator) gets the
    line right after the warm start's evaluation, before step 1."""
    sets = [
        *SMALL, "model.sft.skill_steps=2", "model.sft.steps=0", "model.sft.num_episodes=8",
        "model.sft.batch_size=4", "trainer.total_steps=1", "trainer.eval_every=0",
        f"run.output_dir={tmp_path / 'runs'}", f"model.cache_dir={tmp_path / 'cache'}",
        "logging.tensorboard=false",
    ]  # fmt: skip
    rc, out = run_steprl(
        ["train", str(ROOT / "configs" / "calculator_tiny.yaml"), *(a for s in sets for a in ("--set", s))],
        tmp_path,
    )
    assert rc == 0, out
    lines = out.splitlines()
    warn = [i for i, line in enumerate(lines) if "warm start too weak for RL to lift" in line]
    assert len(warn) == 1, out
    assert "lengthen model.sft.skill_steps 2 -> 200 (x4)" in lines[warn[0]], lines[warn[0]]
    assert lines[warn[0] - 1].startswith("warm start: held-out success"), out
