"""The curves section: one chart per question a person asks of a run (is reward rising, is
held-out success, did entropy collapse, is the policy still calling its tool, ...), each from the
metrics.jsonl keys that answer it; a chart whose keys the run never logged is left out. Per env
charts where the run trained on several (`env/<env>/...`, `eval/env/<env>/...`), and with `--vs`
every series once per run, overlaid."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from steprl.report.run_data import RunData

#: (chart title, metric keys; a key ending in "/*" is every key under that prefix)
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train reward", ("reward/mean", "reward/std")),
    ("train success", ("success/rate",)),
    ("held-out success", ("eval/success",)),
    ("entropy", ("actor/entropy",)),
    ("KL", ("actor/approx_kl", "actor/kl_to_ref")),
    ("gradient norm", ("actor/grad_norm", "actor/grad_norm_max")),
    ("clip fraction", ("actor/clip_frac",)),
    ("episode length (tokens)", ("episode/total_tokens_mean", "episode/action_tokens_mean")),
    ("turns", ("episode/turns_mean", "eval/turns_mean")),
    ("tool calls", ("tools/call_rate", "tools/valid_frac", "eval/tool_call_rate")),
    ("end reasons", ("end_frac/*",)),
    ("zero-variance groups", ("reward/zero_variance_group_frac",)),
    ("staleness (policy versions)", ("staleness/traj_mean", "staleness/traj_max", "staleness/token_mean")),
    ("reward components", ("reward_component/*",)),
    ("advantage", ("advantage/abs_mean",)),
    ("turn cap (curriculum)", ("curriculum/max_turns", "curriculum/cut_by_cap_frac")),
    ("env weights (task source)", ("source/weight/*",)),
    ("share of the gradient, per env", ("grad_share/*",)),
)
_PER_ENV = re.compile(r"^(eval/)?env/([^/]+)/(.+)$")


def _points(run: RunData, key: str) -> list[list[float]]:
    out = []
    for row in run.metrics:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            out.append([int(row.get("step", 0)), round(float(value), 6)])
    return downsample(out, run.caps.curve_points)


def downsample(points: list[list[float]], limit: int) -> list[list[float]]:
    """At most `limit` of `points` (in step order): in each of `limit // 2` runs of consecutive
    points, the lowest and the highest, so a spike survives the thinning as a line would show it."""
    if len(points) <= limit:
        return points
    buckets = max(1, limit // 2)
    out = []
    for b in range(buckets):
        chunk = points[b * len(points) // buckets : (b + 1) * len(points) // buckets]
        lo, hi = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        out.extend(sorted({id(lo): lo, id(hi): hi}.values(), key=lambda p: p[0]))
    return out


def _keys(run: RunData) -> list[str]:
    seen: dict[str, None] = {}
    for row in run.metrics:
        seen.update(dict.fromkeys(k for k in row if k != "step"))
    return list(seen)


def _expand(patterns: Sequence[str], keys: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in patterns:
        if p.endswith("/*"):
            out.extend(sorted(k for k in keys if k.startswith(p[:-1])))
        elif p in keys:
            out.append(p)
    return out


def _chart(title: str, runs: Sequence[RunData], keys_of: Sequence[Sequence[str]]) -> dict[str, Any] | None:
    series = []
    for run, keys in zip(runs, keys_of, strict=True):
        for key in keys:
            points = _points(run, key)
            if points:
                label = key if len(runs) == 1 else f"{run.label}: {key}"
                series.append({"run": run.label, "key": key, "label": label, "points": points})
    return {"title": title, "series": series} if series else None


def build(run: RunData) -> dict[str, Any]:
    runs = (run, *run.vs)
    keys = [_keys(r) for r in runs]
    charts = []
    for title, patterns in CHARTS:
        chart = _chart(title, runs, [_expand(patterns, k) for k in keys])
        if chart:
            charts.append(chart)
    # per env: one chart per (train|eval, metric name), a series per env (and run)
    per_env: dict[tuple[str, str], None] = {}
    for k in keys:
        for key in k:
            m = _PER_ENV.match(key)
            if m:
                per_env[("held-out " if m.group(1) else "train ") + m.group(3), (m.group(1) or "")] = None
    for (name, prefix), _ in sorted(per_env.items()):
        metric = name.split(" ", 1)[1]
        pattern = re.compile(rf"^{re.escape(prefix)}env/[^/]+/{re.escape(metric)}$")
        chart = _chart(f"per env: {name}", runs, [[key for key in k if pattern.match(key)] for k in keys])
        if chart:
            charts.append(chart)
    runs_shown = [r.label for r in runs]
    return {"charts": charts, "runs": runs_shown, "empty": "no metrics recorded" if not charts else ""}
