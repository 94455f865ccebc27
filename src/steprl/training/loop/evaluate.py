"""Held-out evaluation: one rollout per held-out task at the eval temperature, and what the
first one (step 0) must show before any RL step (`check_first_evaluation`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from steprl.config import Config
from steprl.diagnostics import env_metrics, rollout_metrics
from steprl.envs.base import maybe_await
from steprl.errors import RunAborted
from steprl.rollout.loop import RolloutSetup, rollout_groups
from steprl.training.setup.env_setup import system_prompt_mode
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


def check_first_evaluation(
    cfg: Config,
    setup: RolloutSetup,
    tasks: Sequence[Task],
    metrics: Mapping[str, float],
    episodes: Sequence[Trajectory],
    log: Callable[[str], None],
) -> None:
    """What the evaluation at step 0 shows before any RL step: a harness whose system prompt the
    warm start's demonstrations lack (one WARNING line), and an evaluation that mostly failed,
    which stops the run now (`RunAborted`): every later one runs the same tasks the same way, and
    a run that cannot evaluate would only fail at its end, its whole budget spent."""
    note = system_prompt_note(cfg, setup, tasks, episodes)
    if note:
        log(f"WARNING evaluation at step 0: {note}")
    failed, n = int(metrics["eval/infra_failed"] + metrics["eval/env_timeout"]), int(metrics["eval/tasks"])
    if n and failed * 2 > n:
        errors = (str(t.info.get("error", "")) for t in episodes if not t.trainable)
        first = next((e for e in errors if e), "none recorded")
        raise RunAborted(
            f"stopped before training: the evaluation at step 0 failed: {failed}/{n} held-out episodes "
            f"infra_failed or env_timeout (backend {cfg.runtime.backend}); first error: {first[:300]}; "
            "fix it and train again (a run that cannot evaluate stops before training)"
        )


def system_prompt_note(
    cfg: Config, setup: RolloutSetup, tasks: Sequence[Task], episodes: Sequence[Trajectory]
) -> str | None:
    """Why a harness's episodes start from a context the warm start's demonstrations never
    showed: the system prompt it sent first (`info["system_prompt"]`, recorded by the harness
    runner) is not the one `rollout.system_prompt` gave them. None when they match, or when
    there are no demonstrations (`model.init` other than sft) or no harness episode."""
    first = next((t for t in episodes if "system_prompt" in t.info), None)
    if first is None or cfg.model.init != "sft":
        return None
    sent, mode = str(first.info["system_prompt"]).strip(), system_prompt_mode(cfg)
    env_text = ""
    if mode == "env" or (sent and mode == "none"):  # the env's own, read after a reset
        task = next((t for t in tasks if t.id == first.task_id), None)
        env_text = _env_system_prompt(setup, task) if task is not None else ""
    shown = {"none": "", "env": env_text}.get(mode, mode).strip()
    if sent == shown:
        return None
    setting = f"rollout.system_prompt={mode}" if mode in ("none", "env") else "rollout.system_prompt"
    if not sent:
        what, fix = f"no system prompt, but the demonstrations start with one ({setting})", "none"
    else:
        what = f"a system prompt ({sent[:40]!r}, {len(sent)} chars) the demonstrations "
        what += f"do not show ({setting})" if not shown else f"do not start with ({setting})"
        fix = "env (it is the env's own)" if sent == env_text.strip() else "the text the harness sends"
    return (
        f"the harness sends {what}: its episodes start from a context the warm start never saw; "
        f"set rollout.system_prompt to {fix}"
    )


def _env_system_prompt(setup: RolloutSetup, task: Task) -> str:
    """The played env's system prompt for `task` (read after a reset, as the agent loop reads it)."""

    async def read() -> str:
        env = setup.make_env(task)
        try:
            await maybe_await(env.reset(task, task.seed))
            return str(getattr(env, "system_prompt", "") or "")
        finally:
            await maybe_await(env.close())

    try:
        return asyncio.run(read())
    except Exception:  # a note is no reason to fail: the env's own failures are counted elsewhere
        return ""
