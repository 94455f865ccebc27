"""Learning-curve PNGs from a run's `metrics.jsonl`.

Drawn with `matplotlib.figure.Figure` directly, never `pyplot`: pyplot keeps global figure
state and picks a GUI backend, while a bare `Figure` renders with Agg on its own. So plotting
works headless (CI, a server, a training process) and importing steprl never changes the
caller's matplotlib backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from steprl.diagnostics.sinks import open_output, read_metrics_jsonl

DEFAULT_KEYS = ("success/rate", "tools/call_rate", "episode/turns_mean")
DEFAULT_EVAL_KEYS = ("eval/success",)


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that hold a finite value for `key`, sorted by step."""
    points = sorted(
        (float(r["step"]), float(r[key]))
        for r in rows
        if isinstance(r.get(key), int | float) and "step" in r and math.isfinite(float(r[key]))
    )
    return [p[0] for p in points], [p[1] for p in points]


def _eval_target(eval_key: str, keys: Sequence[str]) -> int:
    """Subplot an eval key is drawn on: `eval/X` goes to key `X` or to the key in namespace `X`
    (so `eval/success` lands on `success/rate`); with no match, on the first subplot."""
    name = eval_key.removeprefix("eval/")
    for i, key in enumerate(keys):
        if name == key or name == key.split("/")[0]:
            return i
    return 0


def plot_learning_curve(
    metrics_jsonl: Path,
    out_png: Path,
    keys: Sequence[str] = DEFAULT_KEYS,
    eval_keys: Sequence[str] = DEFAULT_EVAL_KEYS,
) -> Path:
    """One subplot per key (x = training step), eval points overlaid as markers; saves a PNG.

    Keys missing from the file get an empty subplot saying so, rather than an error, because
    early in a run (or for runs without tools) some metrics simply do not exist yet. A single
    row still shows up: every series is drawn with point markers. Returns `out_png`.
    """
    from matplotlib.figure import Figure

    if not keys:
        raise ValueError("plot_learning_curve needs at least one metric key to plot; pass keys=(...).")
    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    rows = read_metrics_jsonl(metrics_jsonl)

    fig = Figure(figsize=(5.0 * len(keys), 3.8), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, marker=".", linewidth=1.5, label="train")
        else:
            ax.text(0.5, 0.5, f"no data for\n{key}", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)

    for eval_key in eval_keys:
        xs, ys = _series(rows, eval_key)
        if xs:
            ax = axes[_eval_target(eval_key, keys)]
            ax.plot(xs, ys, linestyle="none", marker="o", markersize=6, color="tab:red", label=eval_key)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")

    last_step = max((r["step"] for r in rows if isinstance(r.get("step"), int | float)), default=None)
    suffix = f" (step {last_step:g})" if last_step is not None else " (no rows yet)"
    fig.suptitle(f"Learning curve: {metrics_jsonl.parent.name or metrics_jsonl.name}{suffix}")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    with open_output(out_png, "wb") as f:  # never through a link planted in the run directory
        fig.savefig(f, dpi=100, format="png")
    return out_png
