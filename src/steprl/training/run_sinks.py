"""Where a run's metrics and sample episodes go: metrics.jsonl always, TensorBoard
(`logging.tensorboard`) and Weights & Biases (`logging.wandb`) when asked for.

Out of trainer.py so that adding a sink touches this file only. The trainer hands each step's
metrics to the `MultiSink` this opens and its episodes to `episode_samples.log_episodes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from steprl.config import Config
from steprl.diagnostics.episode_samples import Decode
from steprl.diagnostics.sinks import JsonlSink, MetricsSink, MultiSink, TensorBoardSink, truncate_metrics
from steprl.diagnostics.wandb_sink import WandbSink


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
        sinks.append(TensorBoardSink(run_dir / "tensorboard", purge, decode=decode, text_every=every))
    if cfg.logging.wandb is not None:
        sinks.append(WandbSink.for_run(run_dir, cfg.model_dump(mode="json"), decode))
    with MultiSink(sinks) as sink:
        yield sink
