"""The steering sections: the curriculum's turn-cap stages and each env's weight and share of
the gradient, from the metrics the curriculum controllers and the task sources log.

Curriculum: the steps where the turn cap changed (`curriculum/max_turns`), each with the train
success and the share of episodes the cap cut at that step. Env weights: per env, the weight the
source drew it with (`source/weight/<env>`, or the config's fixed weight) and its share of the
gradient (`grad_share/<env>`), first, last and mean over the run.
"""

from __future__ import annotations

import math
from typing import Any

from steprl.report.run_data import RunData

NONE_RECORDED = "none recorded"
CAP_KEY = "curriculum/max_turns"
CUT_KEY = "curriculum/cut_by_cap_frac"


def _value(row: Any, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def curriculum(run: RunData) -> dict[str, Any]:
    """One row per stage: the step the turn cap changed, the cap, success and cut share there."""
    rows: list[list[Any]] = []
    last: float | None = None
    for row in run.metrics:
        cap = _value(row, CAP_KEY)
        if cap is None or cap == last:
            continue
        last = cap
        success, cut = _value(row, "success/rate"), _value(row, CUT_KEY)
        rows.append(
            [
                int(row.get("step", 0)),
                int(cap),
                "" if success is None else round(success, 3),
                "" if cut is None else round(cut, 3),
            ]
        )
    columns = ["from step", "turn cap", "train success", "cut by the cap"]
    return {"columns": columns if rows else [], "rows": rows, "empty": "" if rows else NONE_RECORDED}


def _envs(run: RunData) -> list[str]:
    seen: dict[str, None] = {}
    for row in run.metrics:
        for key in row:
            for prefix in ("source/weight/", "grad_share/", "env/"):
                if key.startswith(prefix):
                    seen[key[len(prefix) :].split("/")[0]] = None
    return list(seen)


def _config_weights(run: RunData) -> dict[str, float]:
    env = run.config.get("env") if isinstance(run.config, dict) else None
    mix = env.get("mix") if isinstance(env, dict) else None
    out: dict[str, float] = {}
    for entry in mix or []:
        if isinstance(entry, dict):
            weight = entry.get("weight", 1.0)  # EnvEntry's default
            out[str(entry.get("id") or entry.get("name"))] = (
                float(weight) if isinstance(weight, int | float) else 1.0
            )
    return out


def _stats(run: RunData, key: str) -> list[Any]:
    values = [v for row in run.metrics if (v := _value(row, key)) is not None]
    if not values:
        return ["", "", ""]
    return [round(values[0], 3), round(values[-1], 3), round(sum(values) / len(values), 3)]


def env_weights(run: RunData) -> dict[str, Any]:
    """Per env: its configured weight, the source's weight (first, last, mean) and its share of
    the gradient (first, last, mean); nothing for a run with one env."""
    envs = _envs(run)
    fixed = _config_weights(run)
    if len(envs) < 2 and len(fixed) < 2:
        return {"columns": [], "rows": [], "empty": NONE_RECORDED + " (one env)"}
    total = sum(fixed.values()) or 1.0
    rows = [
        [
            env,
            round(fixed[env] / total, 3) if env in fixed else "",
            *_stats(run, f"source/weight/{env}"),
            *_stats(run, f"grad_share/{env}"),
        ]
        for env in sorted(set(envs) | set(fixed))
    ]
    columns = [
        "env",
        "configured share",
        "weight first",
        "last",
        "mean",
        "gradient share first",
        "last",
        "mean",
    ]
    return {"columns": columns, "rows": rows, "empty": ""}
