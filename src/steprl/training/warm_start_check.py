"""Is the warm start strong enough for RL to lift? One line before the first RL step when not.

GRPO learns from the differences inside a group: a tool the warm start rarely uses *well* gives
groups where guessing wins as often as calling, and RL then drops the tool (the tool-abandonment
failure of a user's own env). Whether RL lifts a run was decided by the warm start in every run
we have (docs/your-own-env.md "Sizing the warm start"; benchmarks/tool_abandonment.py):

    warm start held-out success -> after RL         the warm start
    0.07 -> 0.04, 0.03, 0.02 (3 recipes)            warehouse, 250 + 60 SFT steps
    0.17 -> 0.41                                    warehouse, 600 + 60
    0.03 -> 0.13, 0.11 -> 0.16 (tool dropped)       guess_number, 40 + 40 / 30 + 100
    0.39 -> 0.84                                    guess_number, 150 + 50
    0.27 - 0.34 -> 0.50 - 0.89                      the default demo (calculator)

so below `MIN_SUCCESS` held-out success at the warm start RL did not lift a run, and above it
every run rose but one. The advice scales the expert phase (`model.sft.skill_steps`, where the
policy learns the tool) by how far the success is from `TARGET_SUCCESS`: 250 -> 600 skill steps
took the warehouse from 0.07 to 0.17, about proportional.
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
