"""Held-out evaluation: one rollout per held-out task at the eval temperature."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from steprl.diagnostics import env_metrics, rollout_metrics
from steprl.rollout.loop import RolloutSetup, rollout_groups
from steprl.types import Group, Task, Trajectory


def evaluate(
    tasks: Sequence[Task],
    setup: RolloutSetup,
    *,
    seed: int,
    run: Callable[[Coroutine[Any, Any, list[Group]]], list[Group]] = asyncio.run,
    per_env: bool = False,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Return `eval/*` metrics (success, tool-call rate, calls per success, turns) and the rollouts;
    with `per_env` (a run with several envs) also `eval/env/<env>/...` (success_rate,
    tool_call_rate, ...). `run` runs the rollouts where the engine lives (the trainer's rollout
    thread, when training)."""
    groups = run(rollout_groups(tasks, 1, setup, seed=seed))
    trajs = [t for g in groups for t in g.trajectories]
    by_env = {f"eval/{k}": v for k, v in env_metrics(trajs).items()} if per_env else {}
    m = rollout_metrics(trajs)
    return {
        "eval/success": m["success/rate"],
        "eval/tool_call_rate": m["tools/call_rate"],
        "eval/calls_per_success": m["tools/calls_per_success"],
        "eval/turns_mean": m["episode/turns_mean"],
        "eval/infra_failed": m["end/infra_failed"],
        "eval/env_timeout": m["end/env_timeout"],
        "eval/tasks": float(len(trajs)),
        **by_env,
    }, trajs
