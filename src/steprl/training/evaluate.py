"""Held-out evaluation: one rollout per held-out task at the eval temperature."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from steprl.diagnostics import rollout_metrics
from steprl.envs.base import Env
from steprl.rollout.chat import PromptFormat
from steprl.rollout.context import ContextRule
from steprl.rollout.engines.base import Engine, SamplingParams
from steprl.rollout.loop import Budgets, rollout_groups
from steprl.types import Task, Trajectory


def evaluate(
    tasks: Sequence[Task],
    *,
    make_env: Callable[[Task], Env],
    engine: Engine,
    fmt: PromptFormat,
    rule: ContextRule,
    sampling: SamplingParams,
    budgets: Budgets,
    seed: int,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Return `eval/*` metrics (success, tool-call rate, calls per success, turns) and the rollouts."""
    groups = asyncio.run(
        rollout_groups(
            tasks,
            1,
            make_env=make_env,
            engine=engine,
            fmt=fmt,
            rule=rule,
            sampling=sampling,
            budgets=budgets,
            seed=seed,
        )
    )
    trajs = [t for g in groups for t in g.trajectories]
    m = rollout_metrics(trajs)
    return {
        "eval/success": m["success/rate"],
        "eval/tool_call_rate": m["tools/call_rate"],
        "eval/calls_per_success": m["tools/calls_per_success"],
        "eval/turns_mean": m["episode/turns_mean"],
        "eval/infra_failed": m["end/infra_failed"],
        "eval/tasks": float(len(trajs)),
    }, trajs
