"""Is the warm start strong enough for RL to lift? One line before the first RL step when not.

GRPO learns from the differences inside a group: a tool the warm start rarely uses well gives
groups where a guess wins about as often as a call, and RL then drops the tool (the silent
tool-abandonment failure of a user's own env). In every run we have, the warm start decided it
(docs/your-own-env.md, "Sizing the warm start"; benchmarks/tool_abandonment.py; the trial's
runs from issue 44). Held-out success / tool-call rate at the warm start -> after RL:

    not lifted by RL                                   lifted by RL
    warehouse, demos cut   0.03 / 0.03 -> 0.03  fires  warehouse, expert-tilted 0.25 / 0.58 -> 0.36
    warehouse (trial)      0.07 / 0.35 -> 0.04  fires  warehouse, 600 SFT (trial) 0.17 / 0.37 -> 0.41
    guess, seed 0          0.11 / 0.16 -> 0.16  fires  one-lookup warehouse (trial)  0.29 -> 0.89
    guess, seed 2          0.14 / 0.28 -> 0.06  fires  guess, 150 + 50 SFT    0.39 / 0.36 -> 0.84
    guess, 40 + 40 SFT     0.03 / 0.14 -> 0.13  fires  calculator demo        0.27-0.34 -> 0.50-0.89
    guess, seed 1          0.25 / 0.25 -> 0.09  missed harness calculator     0.175 -> 0.455
    guess (trial)          0.21 / 0.36 -> 0.21  missed

Below `MIN_SUCCESS` (between the 0.14 and the 0.17 above) RL lifted no run; the rule fires on 5 of
the 7 runs RL did not lift and on none of the 6 it did. The tool-call rate did not separate them
(0.35-0.37 on both sides), nor did success with a call against without one (guess: 0.30-0.56 with
a call, 0.07-0.15 without, and RL still dropped the tool), so the line reports them but the rule
reads success alone. The advice scales the expert phase (`model.sft.skill_steps`, where the
policy learns the tool) towards `TARGET_SUCCESS`: 250 -> 600 skill steps took the trial's
warehouse from 0.07 to 0.17, about in proportion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from steprl.config import Config
from steprl.diagnostics.metrics import is_success, tool_calls
from steprl.types import Trajectory

MIN_SUCCESS = 0.15  # held-out success under which no run of ours was lifted by RL
TARGET_SUCCESS = 0.25  # what the advice aims for (a margin over MIN_SUCCESS)
MAX_FACTOR = 4  # never advise more than this many times the current steps at once


@dataclass(frozen=True)
class WarmStartReading:
    """The warm start's held-out episodes, read for the advice."""

    episodes: int
    success: float
    tool_rate: float  # share of episodes with at least one tool call
    success_with_tool: float | None  # success among the episodes that called a tool (None: none did)
    success_without_tool: float | None


def read_warm_start(episodes: Sequence[Trajectory]) -> WarmStartReading:
    done = [t for t in episodes if t.trainable]
    called = [t for t in done if tool_calls(t) > 0]
    plain = [t for t in done if tool_calls(t) == 0]

    def rate(ts: Sequence[Trajectory]) -> float | None:
        return sum(is_success(t) for t in ts) / len(ts) if ts else None

    return WarmStartReading(
        episodes=len(done),
        success=rate(done) or 0.0,
        tool_rate=len(called) / len(done) if done else 0.0,
        success_with_tool=rate(called),
        success_without_tool=rate(plain),
    )


def advice(reading: WarmStartReading, *, init: str, skill_steps: int) -> str | None:
    """One line saying the warm start is too weak and what to do, or None when it is not."""
    if reading.episodes == 0 or reading.success >= MIN_SUCCESS:
        return None
    where = (
        f"warm start too weak for RL to lift: held-out success {reading.success:.2f} (< {MIN_SUCCESS}; "
        f"tool-call rate {reading.tool_rate:.2f}"
    )
    if reading.success_with_tool is not None and reading.success_without_tool is not None:
        where += (
            f", success {reading.success_with_tool:.2f} with a tool call, "
            f"{reading.success_without_tool:.2f} without"
        )
    where += ")"
    if init != "sft":
        return (
            f"{where}; warm-start it longer on the env's expert before RL (model.init=sft, "
            "model.sft.skill_steps; docs/your-own-env.md, sizing the warm start)"
        )
    factor = min(MAX_FACTOR, max(2, math.ceil(TARGET_SUCCESS / max(reading.success, 1e-3))))
    return (
        f"{where}; lengthen model.sft.skill_steps {skill_steps} -> {max(skill_steps, 50) * factor} "
        f"(x{factor}) and rerun (docs/your-own-env.md, sizing the warm start)"
    )


def warn_if_weak(cfg: Config, episodes: Sequence[Trajectory], log: Callable[[str], None]) -> None:
    """The trainer's call, after the warm start's evaluation: one WARNING line when it is too weak."""
    line = advice(read_warm_start(episodes), init=cfg.model.init, skill_steps=cfg.model.sft.skill_steps)
    if line is not None:
        log(f"WARNING: {line}")


__all__ = [
    "MAX_FACTOR",
    "MIN_SUCCESS",
    "TARGET_SUCCESS",
    "WarmStartReading",
    "advice",
    "read_warm_start",
    "warn_if_weak",
]
