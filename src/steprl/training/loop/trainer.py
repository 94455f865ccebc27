"""The trainer. Reads top to bottom:

hold the run directory (one process at a time) -> decide it (fresh, resumed or refused; nothing
touched) -> build the parts -> restore a checkpoint -> start the rollout pipeline -> the
warm-start evaluation -> make the run directory (an earlier run is cleared only now, once every
start-up check has passed and nothing before the first step can stop the start) -> per step:
take groups -> make the batch -> update -> publish weights (version + 1) -> evaluation,
trajectories, metrics -> the controllers' adjustments for the next step (or a stop) ->
checkpoint -> final checkpoint, curve, report.

Rollouts run in a producer (a background thread, or Ray rollout workers) while the learner
trains, up to `rollout.max_staleness` policy versions ahead (`training/loop/pipeline.py`). Synchronous
training is staleness 0 on the same path: each step's rollouts run on the current weights.
A run stops early, keeping what it finished, on SIGINT/SIGTERM (with a checkpoint of the last
finished step: at once while it waits on envs, for rollouts, demonstrations or an evaluation,
whose tasks run again on resume; else after the current step), when a controller stops it
(`training/controllers/`: `trainer.max_nonfinite_skips` steps in a row whose update was skipped
as non-finite, `runtime.max_failed_steps` steps in a row over the failure budget, a health
rule; a stop leaves what a signal leaves, and deletes no earlier checkpoint), and when
the disk refuses a step's outputs (that step is not checkpointed: a resume runs it again). A
step's trajectories are written before its metrics row. Tasks admitted but not trained when a
run ends (an asynchronous run admits ahead) are reported in one line; the checkpoint keeps them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from steprl.config import Config
from steprl.config.checks import check_host, config_warnings
from steprl.diagnostics import (
    TrainingProgress,
    env_metrics,
    gateway_metrics,
    plot_learning_curve,
    reward_component_means,
    rollout_metrics,
    template_metrics,
)
from steprl.diagnostics.sinks import OutputWriteError
from steprl.errors import RunAborted, RunInterrupted
from steprl.hosting.pool import EnvPool
from steprl.report import write_report
from steprl.training.controllers import Adjustments, StepReport
from steprl.training.learn.guards import FirstFailures, failure_metrics
from steprl.training.loop import levers, resume, run_lock, sync_check
from steprl.training.loop.cross_policy import ratio_metrics
from steprl.training.loop.held_out import Evaluator, log_warm_start
from steprl.training.loop.pipeline import Pipeline, describe_pending
from steprl.training.loop.producers import LocalProducer, RayProducer
from steprl.training.loop.run_sinks import RunOutputs, check_loggers, evals_so_far, open_outputs
from steprl.training.loop.saved_advantages import Advantages, saved_advantages, saved_step_credit
from steprl.training.loop.step_batch import CollectedGroups, StepBatch, collect_groups, make_batch
from steprl.training.loop.stop_signal import StopOnSignal, StopRequested
from steprl.training.setup import env_setup
from steprl.training.setup.build import Parts, build
from steprl.training.setup.rollout_parts import cross_policy_lag
from steprl.training.sources import TaskSource
from steprl.training.state import RngState, TrainState
from steprl.types import Trajectory

#: what a step saves beside its rollouts: advantages per turn and token, learned step rewards per turn
Saved = tuple[list[Advantages | None], list[list[float] | None] | None]


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    warm_start: dict[str, float]  # eval/* before any RL step
    final: dict[str, float]  # eval/* after the last step
    history: list[dict[str, float]]  # one metrics dict per step run by this process


def train(cfg: Config, log: Callable[[str], None] = print) -> TrainResult:
    """Train per `cfg`. Environments live where `runtime.backend` says (in-process, behind an
    HTTP env server, or in Ray actors); the env pool and the writers are closed however the run
    ends."""
    check_host(cfg)  # device and output directory: one line, before anything is made
    with contextlib.ExitStack() as cleanup:
        # this process's until it ends, from before anything is cleared: a second is one line
        cleanup.enter_context(run_lock.hold_run_dir(Path(cfg.run.output_dir) / cfg.run.name))
        plan = resume.plan_run_dir(cfg, log)  # fresh, resumed or refused: nothing touched yet
        env_setup.start_ray(cfg, log)  # before the first actor: sized to what the run reserves
        envs = cleanup.enter_context(env_setup.env_pool(cfg))
        try:
            return _train(cfg, envs, plan, cleanup, log)
        except StopRequested as stopped:  # a signal before the first step of this process
            then = (
                f"the run is as its checkpoint left it; resume with: {resume.resume_command(plan.path)}"
                if plan.resume_from is not None
                else "nothing was trained and no checkpoint saved; start the run again"
            )
            raise RunInterrupted(f"interrupted ({stopped}) before the first step; {then}") from None


def _train(
    cfg: Config,
    envs: EnvPool,
    plan: resume.RunDir,
    cleanup: contextlib.ExitStack,
    log: Callable[[str], None],
) -> TrainResult:
    # a signal stops the run: at once in a wait that only an env can end (the first reset, the
    # warm start's demonstrations, rollouts, evaluations), else after the current step
    stop = cleanup.enter_context(StopOnSignal())
    parts, state, shuffle_rng = _set_up(cfg, envs, plan, cleanup, log, stop)
    pipeline = start_pipeline(cfg, parts, parts.source, state, log)
    cleanup.callback(pipeline.close)
    evaluator = Evaluator(cfg, parts, pipeline, stop, FirstFailures(log))
    # the warm start's evaluation comes before the clearing too: a signal in it (a stop before
    # the first step) leaves an earlier run whole
    warm_start = evaluator(0) if state.step == 0 else None
    # every start-up check has passed (config, env, model, extras, loggers): only now is an
    # earlier run's directory cleared, so a start that fails leaves it whole
    run_dir = resume.make_run_dir(plan, cfg, log)
    out = open_outputs(
        cfg, run_dir, state.step, resumed=plan.resume_from is not None, cleanup=cleanup,
        decode=parts.fmt.decode, log=log,
    )  # fmt: skip
    if warm_start is not None:
        log_warm_start(cfg, parts, evaluator, out, warm_start, log)
    warm, last_eval = evals_so_far(run_dir, state.step)
    run = _Run(
        cfg, parts, pipeline, stop, out, run_dir, evaluator, shuffle_rng, log, state,
        settings=parts.controllers.current(),  # what the controllers set for the next step
        group_filter=parts.group_filter,
        reward_kl_coef=cfg.algorithm.kl_coef,
        resumed=plan.resume_from is not None,
        saved_step=state.step if plan.resume_from is not None else -1,
        last_eval=last_eval,
        probe=sync_check.probe_for(cfg, parts.policy.tokenizer),
    )  # fmt: skip
    levers.apply("start", run, state.step)

    # ---- the RL loop ------------------------------------------------------------------------
    with TrainingProgress(cfg.trainer.total_steps, enabled=cfg.logging.progress) as progress:
        while run.state.step < cfg.trainer.total_steps and not stop.signal:
            if not _one_step(run, progress):
                break
    return _wrap_up(run, warm)


def _set_up(
    cfg: Config,
    envs: EnvPool,
    plan: resume.RunDir,
    cleanup: contextlib.ExitStack,
    log: Callable[[str], None],
    stop: StopOnSignal,
) -> tuple[Parts, TrainState, torch.Generator]:
    """Seeds, the parts, the state to continue from (a checkpoint's, or step 0's)."""
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(cfg.run.seed)
    # on CUDA, cuBLAS is deterministic only with a fixed workspace, read when its first handle is
    # made (before any model runs); a user's own setting wins
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    for warning in config_warnings(cfg):
        log(f"WARNING: {warning}")
    run_envs = env_setup.run_envs(cfg)  # each env's spec, resolved once for the whole run
    log(f"environments: {run_envs.describe()} on the {envs.name} backend, at most {envs.max_concurrent} live")
    resume_from = plan.resume_from
    with stop.interruptible():
        env_setup.check_env_starts(envs, run_envs, cfg, log)
        parts = build(cfg, run_envs, envs, cleanup, log, resuming=resume_from is not None)
    check_loggers(cfg)  # W&B's credentials, before anything is cleared
    for key, value in cfg.derived().items():
        log(f"  {key}: {value}")
    shuffle_rng = torch.Generator().manual_seed(cfg.run.seed)
    if resume_from is None:
        return parts, TrainState(0, parts.engine.version, RngState.capture(shuffle_rng)), shuffle_rng
    state = resume.restore(parts, resume_from)
    state.rng.restore(shuffle_rng)
    log(f"resumed from {resume_from} at step {state.step} (policy version {state.policy_version})")
    return parts, state, shuffle_rng


@dataclass
class _Run:
    """What the loop carries from step to step: the run's live parts and where it stands."""

    cfg: Config
    parts: Parts
    pipeline: Pipeline
    stop: StopOnSignal
    out: RunOutputs
    run_dir: Path
    evaluate: Evaluator
    shuffle_rng: torch.Generator
    log: Callable[[str], None]
    state: TrainState
    settings: Adjustments  # the levers the controllers returned for the next step
    group_filter: Any  # the next step's (a Callable[..., Tensor]: levers may narrow the configured one)
    reward_kl_coef: float  # the next step's, set by the levers
    resumed: bool
    saved_step: int  # the step of the newest checkpoint this process wrote or resumed (-1: none)
    last_eval: dict[str, float]
    stopped: tuple[str, Path | None] | None = None  # a controller's stop: why, the checkpoint before it
    rolled_back: str = ""  # what a rollback at this step restored (its firings' outcome says)
    history: list[dict[str, float]] = field(default_factory=list)
    probe: sync_check.SyncProbe | None = None  # each weight sync's check (runtime.weight_probe)


def _one_step(run: _Run, progress: TrainingProgress) -> bool:
    """One RL step, its evaluation, the controllers' say and its outputs; False: the loop ends
    (a signal while rollouts ran, or a controller's stop)."""
    cfg, parts, pipeline = run.cfg, run.parts, run.pipeline
    levers.apply("before", run, run.state.step + 1)
    try:
        run.state, metrics, trajectories, (advantages, step_credit) = run_step(
            cfg, parts, pipeline, run.state, run.shuffle_rng, run.log, reward_kl_coef=run.reward_kl_coef,
            group_filter=run.group_filter, waiting=run.stop.interruptible, probe=run.probe,
        )  # fmt: skip
    except StopRequested:  # while rollouts ran: their tasks run again on resume
        if run.state.step == 0 and not run.resumed:
            raise  # nothing trained yet: no checkpoint to resume from
        return False
    except sync_check.WeightProbeError as exc:  # the engines do not hold what the learner does
        last = resume.latest_checkpoint(run.run_dir)
        raise sync_check.WeightProbeError(
            f"{exc}; the last good checkpoint is {last or 'none yet'}"
        ) from None
    step = run.state.step
    run.evaluate.first_failures(trajectories, f"step {step}")
    every = cfg.trainer.eval_every
    evaluated: list[Trajectory] | None = None
    if step == cfg.trainer.total_steps or (every and step % every == 0):
        with contextlib.suppress(StopRequested):  # the step is kept, its evaluation not
            run.last_eval, took, evaluated = run.evaluate(step)
            metrics.update(run.last_eval | took)
    # the one place a step's results change the next ones: the controllers' adjustments
    metrics |= levers.apply("measure", run, step, trajectories)
    run.settings = parts.controllers.observe(StepReport(step, metrics, trajectories))
    metrics |= run.settings.metrics  # health/* signals
    levers.apply("observed", run, step, trajectories)
    if run.stopped is not None and evaluated is None:  # a controller's stop is the run's end:
        with contextlib.suppress(StopRequested):  # where it stopped, measured as at the end
            run.last_eval, took, evaluated = run.evaluate(step)
            metrics.update(run.last_eval | took)
    run.out.write(
        step, metrics, trajectories, advantages=advantages, step_credit=step_credit, evaluated=evaluated
    )
    run.history.append(metrics)
    progress.update(step, metrics)
    if run.stopped is not None:  # as a signal: saved in _wrap_up, the last good checkpoint kept
        return False
    levers.apply("written", run, step, trajectories)
    if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
        resume.save(parts, run.state, run.run_dir, cfg)
        run.saved_step = step
    return True


def _wrap_up(run: _Run, warm: dict[str, float]) -> TrainResult:
    """Checkpoint, curve, report (an interrupt or a stop: checkpoint, then stop non-zero)."""
    cfg, parts, state, run_dir, log = run.cfg, run.parts, run.state, run.run_dir, run.log
    if state.pending:  # admitted ahead (rollout.max_staleness > 0), never trained: say so
        log(describe_pending(state.pending))
    if run.saved_step != state.step:  # a stop's save removes no older checkpoint (the last good one)
        resume.save(parts, state, run_dir, cfg, keep_all=run.stopped is not None)
    run.out.metrics.close()
    try:
        plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
    except (OSError, OutputWriteError) as exc:  # all else is saved: a missing picture is no reason to fail
        log(f"WARNING: the learning curve was not written ({exc})")
    try:  # a view of what is saved: a report that fails costs the run nothing
        log(f"report: {write_report(run_dir, decode=parts.policy.tokenizer.decode).path}")
    except Exception as exc:
        log(f"WARNING: no report written ({type(exc).__name__}: {exc}); try: steprl report {run_dir}")
    if run.stopped is not None:
        reason, before = run.stopped
        kept = (
            f"the last good checkpoint is {before}"
            if before
            else "no earlier checkpoint (trainer.checkpoint_every)"
        )
        raise RunAborted(
            f"{reason}; its checkpoint and outputs saved in {run_dir} ({kept}); "
            f"resume with: {resume.resume_command(run_dir)}"
        )
    if run.stop.signal:
        raise RunInterrupted(
            f"interrupted ({run.stop.signal}) at step {state.step}; checkpoint and outputs saved in "
            f"{run_dir}; resume with: {resume.resume_command(run_dir)}"
        )
    return TrainResult(run_dir, warm, run.last_eval, run.history)


def start_pipeline(
    cfg: Config, parts: Parts, tasks: TaskSource, state: TrainState, log: Callable[[str], None]
) -> Pipeline:
    """Rollouts in a background thread, or on the Ray rollout workers; resumed pending tasks first."""
    group_size, seed, k = cfg.rollout.group_size, cfg.run.seed, cfg.rollout.max_staleness
    producer = (
        RayProducer(parts.remote, parts.engine, group_size=group_size, seed=seed)
        if parts.remote is not None
        else LocalProducer(parts.setup, parts.engine, group_size=group_size, seed=seed)
    )
    if k:
        m = cfg.trainer.epochs * cfg.trainer.mini_batches
        log(
            f"asynchronous: rollouts up to {k} policy versions ahead (rollout.max_staleness); with {m} "
            f"optimizer steps per RL step a sample is at most {(k + 1) * m - 1} optimizer steps old"
        )
    if state.pending:
        log(f"re-issuing {len(state.pending)} groups that were in flight or queued at the checkpoint")
    return Pipeline(
        tasks,
        producer,
        tasks_per_step=cfg.rollout.tasks_per_step,
        max_staleness=k,
        version=state.policy_version,
        pending=state.pending,
        snapshot_lag=cross_policy_lag(cfg),
        eviction=cfg.rollout.eviction,
    )


def run_step(
    cfg: Config,
    parts: Parts,
    pipeline: Pipeline,
    state: TrainState,
    shuffle_rng: torch.Generator,
    log: Callable[[str], None],
    *,
    reward_kl_coef: float | None = None,
    group_filter: Callable[..., torch.Tensor] | None = None,
    waiting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    probe: sync_check.SyncProbe | None = None,
) -> tuple[TrainState, dict[str, float], list[Trajectory], Saved]:
    """One RL step: take and filter groups, make the batch, update, publish the weights.
    Returns the new state, the step's metrics, its rollouts and, parallel to them, the
    advantages each was trained with (None: not trained on) and its learned step rewards (None:
    not scored; None for all without `algorithm.step_reward`). `reward_kl_coef` and
    `group_filter`: the step's, as the levers set them (default: the configured ones).
    `waiting` wraps the wait for the step's groups (the trainer's: a signal ends it at once).
    `probe`: each sync's check that the engines compute what the learner does (`sync_check.py`)."""
    t0 = time.perf_counter()
    step = state.step + 1
    algo = cfg.algorithm
    with waiting():
        collected = collect_groups(
            pipeline,
            tasks_per_step=cfg.rollout.tasks_per_step,
            group_filter=group_filter or parts.group_filter,
            regenerations=algo.filter_regenerations,
            failure_budget=cfg.runtime.failure_budget,
        )
    t_rollout = time.perf_counter() - t0
    if collected.metrics["infra/over_budget_rounds"]:
        log(
            f"ALERT step {step}: {collected.metrics['infra/failed_frac']:.0%} of trajectories "
            f"failed in the environment (runtime.failure_budget={cfg.runtime.failure_budget}); "
            "their groups are not trained on. See end/infra_failed, end/env_timeout, "
            "infra/invalid/* and the trajectories' info['error']."
        )
    env_ids = dict(state.env_ids)
    mask_cut = cfg.rollout.cap_truncation == "mask"
    batch = make_batch(
        collected.kept, parts, algo, env_ids=env_ids, kl_coef=reward_kl_coef, mask_cut=mask_cut, step=step
    )
    if batch.credit is not None:
        for alert in batch.credit[1].alerts:
            log(alert)
    # cross-policy sampling: ratio statistics by lag, under the weights before the update
    mixed = ratio_metrics(parts.learner, batch, state.policy_version, cross_policy_lag(cfg))
    stats = parts.learner.update(
        batch.samples,
        epochs=cfg.trainer.epochs,
        mini_batches=cfg.trainer.mini_batches,
        generator=shuffle_rng,
        old_values=batch.old_values,
        envs=batch.envs if parts.envs.several else None,  # grad_share/<env>
    )
    if parts.critic is not None and batch.rows and batch.old_values is not None:
        stats |= parts.critic.update(
            batch.samples,
            batch.old_values,
            epochs=cfg.trainer.epochs,
            mini_batches=cfg.trainer.mini_batches,
            generator=shuffle_rng,
        )
    if parts.step_credit is not None and batch.credit is not None:  # fitted on the groups it just scored
        stats |= parts.step_credit.fit(batch.credit[0], step)
    version = state.policy_version + 1 if batch.rows else state.policy_version  # a skipped step keeps it
    if batch.rows:  # the new weights to every engine, each checked against the learner
        bucket = cfg.runtime.weight_bucket_mib * 2**20
        stats |= sync_check.publish(pipeline, parts.learner, probe, version, bucket)
    state = TrainState(
        step=step,
        policy_version=version,
        rng=RngState.capture(shuffle_rng),
        env_ids=env_ids,
        pending=tuple(pipeline.pending()),
    )
    t_learn = time.perf_counter() - t0 - t_rollout
    t_step = time.perf_counter() - t0
    times = {"time/rollout_s": t_rollout, "time/learn_s": t_learn, "time/step_s": t_step}
    # the learner waits only while it takes groups
    flow = pipeline.take_metrics(cfg.trainer.epochs * cfg.trainer.mini_batches)
    flow["time/learner_idle_share"] = t_rollout / max(t_step, 1e-9)
    metrics = step_metrics(collected, batch, stats, version, per_env=parts.envs.several)
    metrics |= mixed
    saved = (saved_advantages(collected.rollouts, batch), saved_step_credit(collected.rollouts, batch))
    metrics |= getattr(parts.source, "metrics", dict)()  # a source's own (learning_progress: weights)
    return state, metrics | times | flow, collected.rollouts, saved


def step_metrics(
    collected: CollectedGroups, batch: StepBatch, stats: dict[str, float], version: int, *, per_env: bool
) -> dict[str, float]:
    """The step's metrics; `per_env` (a run with several envs): also `env/<env>/...`."""
    trajectories = collected.rollouts
    abs_adv = batch.abs_advantage
    return {
        **rollout_metrics(trajectories),
        **(env_metrics(trajectories) if per_env else {}),
        **reward_component_means(trajectories),
        **template_metrics(trajectories),
        **gateway_metrics(trajectories),
        **collected.metrics,
        **failure_metrics(trajectories),
        **stats,
        **batch.metrics,
        "advantage/abs_mean": float(abs_adv.mean()) if abs_adv.numel() else 0.0,
        "train/rows": float(len(batch.rows)),
        "policy/version": float(version),
        "tokens/action": float(sum(t.num_action_tokens for t in trajectories)),
        "tokens/trained_positions": float(sum(len(r.sample.input_ids) for r in batch.rows)),
    }


__all__ = ["TrainResult", "run_step", "start_pipeline", "train"]
