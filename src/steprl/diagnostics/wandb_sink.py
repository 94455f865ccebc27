"""Weights & Biases as a metrics sink (`logging.wandb`, the `wandb` extra).

The same flat scalars as metrics.jsonl, one `run.log` per training step at that step, and every
`table_every` steps a `wandb.Table` ("episodes") of `table_episodes` sample episodes: step, env,
task, reward, end reason, turns, the prompt and the turn-by-turn transcript (`episode_samples`).
JSONL stays the source of truth; this is for users whose dashboards already live in W&B.

`mode: offline` writes the run under `<run_dir>/wandb/` only (no network, no account; `wandb sync`
uploads it later), or under `$WANDB_DIR` when that is set. A resumed steprl run starts a new
W&B run with the same name (its steps go on from the checkpoint's).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from steprl.diagnostics import episode_samples
from steprl.diagnostics.episode_samples import Decode, StepAdvantages
from steprl.errors import UserError
from steprl.extras import require
from steprl.types import Trajectory

FEATURE = "logging.wandb"
TABLE_KEY = "episodes"
TABLE_COLUMNS = ["step", "env", "task", "reward", "end", "turns", "prompt", "transcript"]


class WandbStartError(UserError):
    """W&B would not start a run (not logged in, no network, a bad project or entity)."""


class WandbSink:
    """A `MetricsSink` (and `episode_samples.EpisodeSink`) writing to one W&B run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        name: str,
        config: Mapping[str, Any],
        decode: Decode | None = None,
        project: str = "steprl",
        entity: str | None = None,
        mode: str = "online",
        table_every: int = 10,
        table_episodes: int = 4,
    ) -> None:
        """The keyword settings are `logging.wandb`'s (`config.values.WandbSection`); `config`
        is the whole run's, shown in W&B's config panel."""
        wandb = require("wandb", extra="wandb", feature=FEATURE)
        self.decode, self.table_every, self.table_episodes = decode, table_every, table_episodes
        self._wandb = wandb
        try:
            self.run = wandb.init(
                project=project,
                entity=entity,
                mode=mode,
                # beside the run's other outputs, unless the user points W&B elsewhere
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                name=name,
                config=dict(config),
                # "off": W&B does not wrap stdout, where the progress bar and the log lines go
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:  # wandb raises its own (UsageError, CommError) or OSError
            why = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise WandbStartError(
                f"{FEATURE}: W&B did not start a run ({type(exc).__name__}: {why}); run `wandb login`, "
                f"or set {FEATURE}.mode=offline (or disabled)"
            ) from None

    @classmethod
    def for_run(cls, run_dir: Path, config: Mapping[str, Any], decode: Decode | None) -> WandbSink:
        """The sink a run's config asks for (`config`: the whole config as JSON values; its
        `logging.wandb` section set), the W&B run named after `run.name`."""
        return cls(
            run_dir, name=config["run"]["name"], config=config, decode=decode, **config["logging"]["wandb"]
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({key: float(value) for key, value in metrics.items()}, step=int(step))

    def log_episodes(
        self, step: int, trajectories: Sequence[Trajectory], advantages: StepAdvantages | None = None
    ) -> None:
        """The sample table, when due. Logged at `step` before `log` sends the step's scalars:
        W&B keeps both in the step's one history row."""
        every, n = self.table_every, self.table_episodes
        if self.decode is None or not episode_samples.due(step, every) or not trajectories:
            return
        decode = self.decode
        rows = [
            [
                int(step),
                t.env,
                t.task_id,
                float(t.outcome_reward),
                str(t.end),
                len(t.steps),
                episode_samples.prompt_text(t, decode),
                episode_samples.transcript(t, decode),
            ]
            for t in episode_samples.pick(trajectories, n)
        ]
        table = self._wandb.Table(columns=TABLE_COLUMNS, data=rows)
        self.run.log({TABLE_KEY: table}, step=int(step))

    def close(self) -> None:
        self.run.finish()
