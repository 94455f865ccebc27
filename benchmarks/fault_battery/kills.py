"""Kills and restarts (issue 44 items 5 and 7): SIGKILL and SIGTERM at a random point of a tiny
run, then `--resume`; two trains of one config at once; a health rule's stop; and starts that
fail (W&B online without a login, SIGTERM in the warm start's evaluation) next to a finished
run of the same name, which must survive them whole."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from .common import (
    TINY,
    TINY_CONFIG,
    Ctx,
    Outcome,
    Probe,
    Verdict,
    defect,
    holds,
    judge,
    lost_files,
    sets,
    snapshot,
)
from .runs import NAME, finished_run, steps_logged, wait_for_step

#: a run long enough to be killed in the middle: 4 steps, a checkpoint after each
LONG = ("trainer.total_steps=4", "trainer.checkpoint_every=1")
RNG = random.Random(44)  # the random points, the same on every battery run


def _kill_then_resume(ctx: Ctx, sig: int) -> Verdict:
    run_dir = ctx.tmp / "runs" / NAME
    proc = ctx.start(["train", str(TINY_CONFIG), *sets([*TINY, f"run.output_dir={ctx.tmp / 'runs'}", *LONG])])
    # past the first checkpoint (before it, --resume rightly has nothing to continue from)
    if not wait_for_step(proc, run_dir, 2, timeout=240):
        return defect(f"the run never logged step 2: {proc.wait(1).last_line()}")
    time.sleep(RNG.uniform(0.0, 2.0))
    proc.signal(sig)
    killed = proc.wait(30)
    if killed.timed_out:
        return Verdict(Outcome.HUNG, f"still running 30 s after signal {sig}")
    if "Traceback (most recent call last)" in killed.out:
        return Verdict(Outcome.TRACEBACK, f"on signal {sig}: {killed.last_line()}")
    resumed = ctx.steprl(["train", "--resume", str(run_dir)], deadline=240)
    verdict = judge(resumed, (0,), why="--resume: ")
    if verdict.outcome is not Outcome.HOLDS:
        return verdict
    steps = steps_logged(run_dir)
    if sorted(set(steps)) != [1, 2, 3, 4]:
        return defect(f"after the kill and --resume, metrics.jsonl holds steps {steps}")
    return holds(f"killed after step 2, resumed to step 4 (steps logged: {steps})")


def sigkill_then_resume(ctx: Ctx) -> Verdict:
    return _kill_then_resume(ctx, signal.SIGKILL)


def sigterm_then_resume(ctx: Ctx) -> Verdict:
    return _kill_then_resume(ctx, signal.SIGTERM)


def two_trains_at_once(ctx: Ctx) -> Verdict:
    """A second `steprl train` of the same config while the first runs: it refuses in one line
    and the first finishes alone."""
    run_dir = ctx.tmp / "runs" / NAME
    # long enough to outlast the second's start-up (imports, model, env: ~10 s): a first run
    # that had ended before the second began would rightly not refuse it
    longer = ("trainer.total_steps=80", "trainer.checkpoint_every=20")
    args = ["train", str(TINY_CONFIG), *sets([*TINY, f"run.output_dir={ctx.tmp / 'runs'}", *longer])]
    first = ctx.start(args)
    if not wait_for_step(first, run_dir, 1, timeout=240):
        return defect(f"the first run never logged step 1: {first.wait(1).last_line()}")
    second = ctx.start(args).wait(240)
    if first.popen.poll() is not None:
        return defect("the first run had ended before the second finished; the probe missed its moment")
    done = first.wait(240)
    if done.rc != 0:
        return defect(f"the first run ended with exit {done.rc} beside the second: {done.last_line()}")
    if second.rc == 0:
        return defect("both runs wrote one run directory (the second was not refused)")
    return judge(second, (2,), why="the second run: ")


def health_stop_keeps_the_end(ctx: Ctx) -> Verdict:
    """A health rule whose `then: stop` fires at step 2 of 4: the run ends as Ctrl-C ends it,
    with a checkpoint, a report and a final evaluation."""
    rule = (
        "health={rules: [{name: always, when: [{signal: clip_frac, above: -1.0}], actions: [alert], "
        "steps: 1, cooldown: 0, budget: 1, then: stop}]}"
    )
    run = ctx.train([*LONG, "trainer.checkpoint_every=0", rule], deadline=240)
    run_dir = ctx.tmp / "runs" / NAME
    steps = steps_logged(run_dir)
    if run.timed_out or "Traceback" in run.out:
        return judge(run)
    if max(steps, default=0) >= 4:
        return defect(f"the rule never stopped the run (steps {steps}): {run.last_line()}")
    missing = [
        what
        for what, there in (
            ("a checkpoint", (run_dir / "checkpoints" / "latest").exists()),
            ("report.html", (run_dir / "report.html").exists()),
            ("a final evaluation", _final_eval(run_dir, max(steps, default=0))),
        )
        if not there
    ]
    if missing:
        return defect(f"stopped at step {max(steps, default=0)} without {', '.join(missing)}")
    return holds(f"stopped at step {max(steps)} with a checkpoint, a report and a final evaluation")


def _final_eval(run_dir: Path, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and any(
        '"eval/success"' in line and f'"step": {step},' in line for line in path.read_text().splitlines()
    )


def wandb_fails_start(ctx: Ctx) -> Verdict:
    """A rerun (run.overwrite: true) with W&B online and no login, next to a finished run."""
    run_dir = finished_run(ctx)
    before = snapshot(run_dir)
    wandb = "logging.wandb={project: fault, mode: online}"
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": None, "WANDB_MODE": None}
    run = ctx.train([wandb], deadline=180, env=env)
    gone = lost_files(before, run_dir)
    if run.rc != 0 and gone:
        return Verdict(
            Outcome.DELETED, f"{len(gone)} of {len(before)} files gone, e.g. {gone[0]}; {run.last_line()}"
        )
    return judge(run, (0, 1, 2))


def sigterm_in_warm_eval(ctx: Ctx) -> Verdict:
    """A rerun SIGTERMed in its warm start's evaluation (64 held-out tasks), next to a finished run."""
    run_dir = finished_run(ctx)
    before = snapshot(run_dir)
    args = [
        "train",
        str(TINY_CONFIG),
        *sets([*TINY, f"run.output_dir={ctx.tmp / 'runs'}", "trainer.eval_tasks=64"]),
    ]
    proc = ctx.start(args)
    if not proc.wait_for("optimizer_steps_per_rl_step", 240):
        return defect(f"the rerun never reached its warm-start evaluation: {proc.wait(1).last_line()}")
    time.sleep(0.5)
    proc.signal(signal.SIGTERM)
    run = proc.wait(60)
    gone = lost_files(before, run_dir)
    if gone:
        return Verdict(Outcome.DELETED, f"{len(gone)} of {len(before)} files gone, e.g. {gone[0]}")
    if "warm start:" in run.out:
        return defect("the signal came after the warm start's evaluation; the probe missed its moment")
    return judge(run, (0, 1, 2, 130, 143, -15))


PROBES = [
    Probe("kills", "SIGKILL mid-run, then --resume", "", sigkill_then_resume),
    Probe("kills", "SIGTERM mid-run, then --resume", "", sigterm_then_resume),
    Probe("kills", "two trains of one config at once", "5", two_trains_at_once),
    Probe("kills", "a health rule's stop keeps the end", "5", health_stop_keeps_the_end),
    Probe("kills", "W&B online, no login, beside a finished run", "7", wandb_fails_start),
    Probe("kills", "SIGTERM in warm-start eval, beside a finished run", "7", sigterm_in_warm_eval),
]
