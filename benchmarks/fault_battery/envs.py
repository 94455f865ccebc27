"""Blocking and spinning envs (issue 44 items 6, 8, 10): sync envs loaded with --plugin whose
`close()` blocks or whose `step()` spins, env text with a lone surrogate, and the harness env
(check-env on its config; its evaluations after the first). A run over any of them ends, within
its deadlines, with one line at most."""

from __future__ import annotations

import json

from .common import HERE, ROOT, Ctx, Outcome, Probe, Verdict, defect, holds, judge

PLUGIN = ("--plugin", "hostile_envs")
#: deadlines short enough that a hung call costs seconds: the run must still end
QUICK = ("runtime.env_call_timeout_s=2", "runtime.failure_budget=1.0", "trainer.total_steps=1")


def _train_env(ctx: Ctx, env: str, *extra: str, deadline: float = 150) -> Verdict:
    sets = [f"env.name={env}", *QUICK, *extra]
    run = ctx.train(sets, deadline=deadline, plugin_path=[HERE / "plugins"], extra_args=PLUGIN)
    return judge(run, (0, 1, 2))


def close_blocks(ctx: Ctx) -> Verdict:
    return _train_env(ctx, "close_blocks")


def step_spins(ctx: Ctx) -> Verdict:
    return _train_env(ctx, "step_spins")


def surrogate_text(ctx: Ctx) -> Verdict:
    return _train_env(ctx, "text_env", "env.params={kind: surrogate}")


HARNESS = ROOT / "configs" / "harness_calculator_tiny.yaml"


def harness_check_env(ctx: Ctx) -> Verdict:
    run = ctx.steprl(["check-env", str(HARNESS), "--tasks", "4"], deadline=240, cwd=ROOT)
    return judge(run, (0,))


def harness_evals(ctx: Ctx) -> Verdict:
    """Two steps of the harness env with an evaluation after each: none may fail whole."""
    sets = ["model.init=scratch", "trainer.total_steps=2", "trainer.eval_every=1", "trainer.eval_tasks=2"]
    run = ctx.train(sets, config=HARNESS, deadline=300, cwd=ROOT)
    verdict = judge(run, (0,))
    if verdict.outcome is not Outcome.HOLDS:
        return verdict
    metrics = ctx.tmp / "runs" / "harness_calculator_tiny" / "metrics.jsonl"
    failed = [
        row["step"]
        for row in map(json.loads, metrics.read_text().splitlines())
        if row.get("eval/infra_failed", 0) >= 1 or row.get("eval/tasks") == 0
    ]
    if failed:
        return defect(f"every evaluation episode failed at steps {failed}")
    return holds("every evaluation ran")


PROBES = [
    Probe("envs", "sync close() blocks", "6", close_blocks),
    Probe("envs", "sync step() spins", "6", step_spins),
    Probe("envs", "a lone surrogate in env text", "10", surrogate_text),
    Probe("envs", "check-env on a harness config", "8", harness_check_env),
    Probe("envs", "harness evaluations after the first", "8", harness_evals),
]
