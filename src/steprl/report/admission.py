"""The task-admission section: what the `admission` task source (docs/synthesis.md) logged each
step: the live set's size, tasks admitted, retired (mastered), parked (failed every episode of
their last groups), skipped (their shape's pass rate outside the band), admitted anyway (after
`max_skips` refusals in a row: the stream held nothing in the band for this learner), on
probation (active, not admitted yet: their first group decides) and rejected (that group outside
the band), and the admitted pass rate against the configured band, with the share of steps
inside it.

At most `MAX_ROWS` steps are listed (evenly spaced, the last always); the summary counts all.

By shape (`by_shape`): each DAG shape's pass rate (`source/shape_rate/<shape>`), the rate its
candidates are admitted or passed over on, where it was first rated and where it ended, against
the band: a run whose every shape ends below the band is one whose stream holds nothing this
learner can learn from yet.
"""

from __future__ import annotations

import math
from typing import Any

from steprl.report.run_data import RunData

NONE_RECORDED = "none recorded (env.source is not admission)"
MAX_ROWS = 30
KEYS = (
    "source/active",
    "source/admitted",
    "source/retired",
    "source/parked",
    "source/skipped",
    "source/admitted_anyway",
    "source/probation",
    "source/rejected",
    "source/pass_rate",
)


def _num(row: Any, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _band(run: RunData) -> list[float]:
    env = run.config.get("env") if isinstance(run.config, dict) else None
    params = env.get("source_params") if isinstance(env, dict) else None
    band = params.get("band") if isinstance(params, dict) else None
    return [float(b) for b in band] if isinstance(band, list) and len(band) == 2 else [0.2, 0.8]


def build(run: RunData) -> dict[str, Any]:
    steps = [row for row in run.metrics if _num(row, "source/active") is not None]
    if not steps:
        return {"columns": [], "rows": [], "empty": NONE_RECORDED}
    low, high = _band(run)
    stride = max(1, math.ceil(len(steps) / MAX_ROWS))
    shown = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
    rows = []
    for row in shown:
        values = [_num(row, k) for k in KEYS]
        rate = values[-1]
        rows.append(
            [int(row.get("step", 0)), *(int(v) if v is not None else "" for v in values[:-1])]
            + (["", ""] if rate is None else [round(rate, 3), "yes" if low <= rate <= high else "no"])
        )
    rated = [r for r in (_num(row, "source/pass_rate") for row in steps) if r is not None]
    inside = sum(low <= r <= high for r in rated)
    summary = ["all", *[""] * (len(KEYS) - 1), f"in [{low}, {high}]", f"{inside} of {len(rated)} steps"]
    columns = ["step", "active", "admitted", "retired", "parked", "skipped", "admitted anyway"]
    columns += ["on probation", "rejected"]
    columns += ["admitted pass rate", "in band"]
    return {"columns": columns, "rows": [*rows, summary], "empty": ""}


SHAPE_KEY = "source/shape_rate/"


def by_shape(run: RunData) -> dict[str, Any]:
    """One row per shape, highest last rate first: first rated at, first rate, last rate, and
    where the last lies against the band."""
    first: dict[str, tuple[int, float]] = {}
    last: dict[str, float] = {}
    for row in run.metrics:
        for key in row:
            if key.startswith(SHAPE_KEY) and (rate := _num(row, key)) is not None:
                shape = key.removeprefix(SHAPE_KEY)
                first.setdefault(shape, (int(row.get("step", 0)), rate))
                last[shape] = rate
    if not last:
        return {"columns": [], "rows": [], "empty": NONE_RECORDED}
    low, high = _band(run)
    order = sorted(last, key=lambda s: (-last[s], s))
    rows: list[list[Any]] = [
        [s, first[s][0], round(first[s][1], 3), round(last[s], 3)]
        + ["below" if last[s] < low else "above" if last[s] > high else "in"]
        for s in order[:MAX_ROWS]
    ]
    if len(order) > MAX_ROWS:
        rows.append([f"{len(order) - MAX_ROWS} more shapes", "", "", "", ""])
    columns = ["shape", "first rated at step", "first rate", "last rate", f"against [{low}, {high}]"]
    return {"columns": columns, "rows": rows, "empty": ""}
