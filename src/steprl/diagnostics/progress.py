"""Terminal progress for training: a rich progress bar with live reward / success / tool fields,
and a summary table. Both are presentation only; turning them off changes nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

#: Live field -> metric key it shows.
LIVE_FIELDS = {"reward": "reward/mean", "success": "success/rate", "tools": "tools/calls_per_traj"}


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.4g}"


class TrainingProgress:
    """A bar over `total_steps` showing the latest reward, success rate and tool calls.

    Use as `with TrainingProgress(total, enabled=...) as p: ... p.update(step, metrics)`, where
    `step` is the number of training steps finished so far. With `enabled=False` every method is
    a no-op that prints nothing, so the training loop never branches on it. `console` lets
    tests (or a log file) capture the output.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        description: str = "train",
        console: Console | None = None,
    ) -> None:
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}; pass the configured step count.")
        self.total_steps = total_steps
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._fields = {name: "-" for name in LIVE_FIELDS}  # last shown value of each live field
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("success {task.fields[success]}"),
                TextColumn("tools {task.fields[tools]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task(
                description, total=total_steps, reward="-", success="-", tools="-"
            )

    def __enter__(self) -> Self:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """Move the bar to `step` finished steps; refresh the fields whose metric is present."""
        if self._progress is None or self._task is None:
            return
        for name, key in LIVE_FIELDS.items():
            if metrics and key in metrics:
                self._fields[name] = _fmt(metrics[key])
        f = self._fields
        self._progress.update(
            self._task,
            completed=min(step, self.total_steps),
            reward=f["reward"],
            success=f["success"],
            tools=f["tools"],
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def print_summary_table(
    title: str, rows: Mapping[str, float | str], *, console: Console | None = None
) -> None:
    """Print `rows` (name -> value) as a two-column table; floats to 4 significant digits."""
    table = Table(title=title)
    table.add_column("metric", style="cyan")
    table.add_column("value", justify="right")
    for name, value in rows.items():
        table.add_row(name, _fmt(value))
    (console or Console()).print(table)
