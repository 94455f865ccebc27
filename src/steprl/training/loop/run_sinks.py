"""What a run writes into its run directory, step by step: metrics (metrics.jsonl always,
TensorBoard with `logging.tensorboard`, Weights & Biases with `logging.wandb`), the training
and held-out episodes (Parquet, `logging.save_trajectories`), in an order that never lets a
metrics row stand for episodes that were lost.

Out of trainer.py so that adding a sink touches this file only. `check_loggers` runs with the
start-up checks, before an earlier run's directory is cleared: a logger that cannot start is
one line, and the earlier run stays whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from steprl.config import Config
from steprl.diagnostics import TrajectoryWriter
from steprl.diagnostics.episode_samples import Decode, log_episodes
from steprl.diagnostics.sinks import (
    JsonlSink,
    MetricsSink,
    MultiSink,
    OutputWriteError,
    TensorBoardSink,
    no_link,
    read_metrics_jsonl,
    truncate_metrics,
)
from steprl.diagnostics.wandb_sink import FEATURE, WandbSink, WandbStartError
from steprl.extras import require
from steprl.training.learn import checkpoint as ckpt
from steprl.training.loop import health_run, resume
from steprl.training.loop.saved_advantages import Advantages
from steprl.types import Trajectory

EVAL_TRAJECTORIES = "eval_trajectories"  # <run_dir>/eval_trajectories/step_NNNNNN.parquet


def check_loggers(cfg: Config) -> None:
    """W&B online needs credentials, checked (and verified with the server) now rather than
    when its run starts, after the run directory is made: `wandb.init` without them used to
    fail once an earlier run had been cleared. A `WandbStartError` (one line) if they are
    missing or refused."""
    w = cfg.logging.wandb
    if w is None or w.mode != "online" or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return  # offline, disabled, or W&B told so by its environment: nothing to log in to
    wandb = require("wandb", extra="wandb", feature=FEATURE)
    try:  # no prompt: a check, not a login; the credentials W&B reads (env, .netrc, settings)
        logged_in = wandb.login(verify=True, prompt=False)
    except Exception as exc:  # wandb's AuthenticationError, CommError, UsageError
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise WandbStartError(
            f"{FEATURE}: W&B refused its credentials ({type(exc).__name__}: {why}); run `wandb login`, "
            f"or set {FEATURE}.mode=offline (or disabled)"
        ) from None
    if not logged_in:
        raise WandbStartError(
            f"{FEATURE}: W&B has no credentials here (no WANDB_API_KEY, no ~/.netrc entry); run "
            f"`wandb login`, or set {FEATURE}.mode=offline (or disabled)"
        )


@contextlib.contextmanager
def open_sinks(
    cfg: Config, run_dir: Path, step: int, log: Callable[[str], None], decode: Decode
) -> Iterator[MultiSink]:
    """Metrics sinks, continuing a resumed run's files after its checkpoint step (lines that
    cannot be read are dropped, with a warning). `decode` (token ids -> text) renders the
    sample episodes; TensorBoard shows them every `trainer.eval_every` steps (0: the
    last step), W&B every `logging.wandb.table_every` steps."""
    if step > 0:
        truncate_metrics(run_dir / "metrics.jsonl", step, warn=log)
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.logging.tensorboard:
        purge = step + 1 if step else None  # a resume: TensorBoard hides the redone steps' old events
        every = cfg.trainer.eval_every or cfg.trainer.total_steps
        logdir = no_link(run_dir / "tensorboard")
        sinks.append(TensorBoardSink(logdir, purge, decode=decode, text_every=every))
    if cfg.logging.wandb is not None:
        no_link(run_dir / "wandb")
        sinks.append(WandbSink.for_run(run_dir, cfg.model_dump(mode="json"), decode))
    with MultiSink(sinks) as sink:
        yield sink


@dataclass(frozen=True)
class RunOutputs:
    """Where each step's outputs go: the metrics sinks, and the training and held-out episodes'
    writers (None: `logging.save_trajectories` is off)."""

    run_dir: Path
    metrics: MultiSink
    trajectories: TrajectoryWriter | None
    evaluations: TrajectoryWriter | None

    def write(
        self,
        step: int,
        metrics: dict[str, float],
        trajectories: list[Trajectory],
        *,
        advantages: list[Advantages | None] | None = None,
        step_credit: list[list[float] | None] | None = None,
        evaluated: list[Trajectory] | None = None,
    ) -> None:
        """The step's held-out episodes (`evaluated`, of its evaluation) and trajectories (with
        `advantages`, parallel to them; none at step 0, the warm start), then its metrics row
        (a row never stands for lost trajectories). A write the disk refuses stops the run
        before this step is checkpointed, so a resume runs it again and writes them all."""
        try:
            if evaluated is not None and self.evaluations is not None:
                self.evaluations.write(step, evaluated)
            if self.trajectories is not None and step > 0:  # step 0: the warm start, no training
                self.trajectories.write(step, trajectories, advantages, step_credit)
            log_episodes(self.metrics, step, trajectories, advantages)  # TensorBoard's, W&B's samples
            self.metrics.log(step, metrics)
        except OutputWriteError as err:
            then = ckpt.then_what(self.run_dir, resume.latest_checkpoint(self.run_dir))
            done = "the outputs of the steps before it are complete"
            raise OutputWriteError(f"{err}, {then}; the run stopped at step {step}, {done}") from err


def open_outputs(
    cfg: Config,
    run_dir: Path,
    step: int,
    *,
    resumed: bool,
    cleanup: contextlib.ExitStack,
    decode: Decode,
    log: Callable[[str], None],
) -> RunOutputs:
    """The run's sinks and writers, closed by `cleanup`; a resume from `step` first drops what
    the steps after it wrote (they run again): held-out episodes and health firings."""
    metrics = cleanup.enter_context(open_sinks(cfg, run_dir, step, log, decode))
    if resumed:
        resume.repair_trajectories(run_dir / EVAL_TRAJECTORIES, step, log)
        health_run.repair_log(run_dir, step)
    save = cfg.logging.save_trajectories
    writers = [
        cleanup.enter_context(TrajectoryWriter(run_dir / name, decode=decode)) if save else None
        for name in (resume.TRAJECTORIES, EVAL_TRAJECTORIES)
    ]
    return RunOutputs(run_dir, metrics, writers[0], writers[1])


def evals_so_far(run_dir: Path, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """The warm-start evaluation and the latest one up to `step`, from metrics.jsonl."""
    rows = [
        r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if "eval/success" in r and r["step"] <= step
    ]
    pick = lambda r: {k: float(v) for k, v in r.items() if k.startswith("eval/") and v is not None}  # noqa: E731
    if not rows:  # their lines were damaged and dropped at the resume
        return {}, {}
    return pick(rows[0]), pick(rows[-1])


__all__ = ["EVAL_TRAJECTORIES", "RunOutputs", "check_loggers", "evals_so_far", "open_outputs", "open_sinks"]
