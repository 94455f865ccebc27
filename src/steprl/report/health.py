# ruff: noqa: E501 (the renderer is JavaScript in a string: the line limit is Python's)
"""The "Alarms and interventions" section: every firing of a health rule (health.jsonl, one
line per firing, written by the trainer) as a timeline over the run's steps, and a table of
what each firing saw (its signals) and did (its actions and their outcome).

`build` shapes the data; `SCRIPT` is the section's own renderer (`RENDERERS["health_timeline"]`):
a strip from step 0 to the run's last step with a marker per firing, coloured by rule (hollow
when the run only observed: `health.act: false`), titled with what the firing saw and did;
below it the table. With `--vs`, the main run's firings only (a compared run is read for its
config and curves).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from steprl.report.run_data import RunData

RENDERER = "health_timeline"
NO_FIRING = "no health rule fired"
SIGNAL_PREFIX = "health/"  # the trainer logs every signal each step as health/<signal>
MAX_FIRINGS = 500  # a rule that fires every step of a long run: the first ones say the most


def _number(value: Any) -> float | str:
    """A signal's value as page JSON: rounded, and a non-finite one (NaN has no JSON) as its text."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return round(float(value), 4) if math.isfinite(value) else str(value)


def _action(action: Any) -> str:
    """An action's name; one given with its params ({"lr_scale": {"factor": 0.5}}) as compact JSON."""
    return action if isinstance(action, str) else json.dumps(action, separators=(",", ":"), default=str)


def _firing(row: Mapping[str, Any]) -> dict[str, Any]:
    signals = row.get("signals")
    actions = row.get("actions")
    return {
        "step": int(row["step"]),
        "rule": str(row["rule"]),
        "signals": {str(k): _number(v) for k, v in signals.items()} if isinstance(signals, dict) else {},
        "actions": [_action(a) for a in actions] if isinstance(actions, list) else [],
        "outcome": str(row.get("outcome") or ""),
        "acted": bool(row.get("acted", False)),
    }


def health_was_on(run: RunData) -> bool:
    """Whether the run computed health signals: the trainer logs them every step it does."""
    return any(key.startswith(SIGNAL_PREFIX) for row in run.metrics for key in row)


def build(run: RunData) -> dict[str, Any]:
    """{firings: [{step, rule, signals {name: value}, actions [...], outcome, acted}] (the first
    MAX_FIRINGS), rules: names in order of first firing (the page's colours), counts per rule over
    all firings, last_step (the strip's end: the last metrics row or firing), health_on, empty:
    "" or why there is nothing}."""
    firings = [_firing(row) for row in run.health]
    on = health_was_on(run) or bool(firings)
    steps = [int(s) for row in run.metrics if isinstance(s := row.get("step"), int)]
    last = max([*steps, *(f["step"] for f in firings)], default=0)
    counts = Counter(f["rule"] for f in firings)
    empty = (
        "" if firings else NO_FIRING + ("; health rules were on" if on else "; health was off for this run")
    )
    return {
        "firings": firings[:MAX_FIRINGS],
        "left_out": max(0, len(firings) - MAX_FIRINGS),
        "rules": list(counts),
        "counts": dict(counts),
        "last_step": last,
        "health_on": on,
        "empty": empty,
    }


SCRIPT = r"""
// ---- alarms and interventions: the health rules' firings (report/health.py) ----------------
RENDERERS["health_timeline"] = (root, d) => {
  if (!d.firings.length) return empty(root, d.empty || "no health rule fired");
  const colour = (rule) => PALETTE[Math.max(0, d.rules.indexOf(rule)) % PALETTE.length];
  const signals = (f) => Object.entries(f.signals).map(([k, v]) => `${k}=${fmt(v)}`).join(", ");
  const observed = d.firings.filter((f) => !f.acted).length;
  root.append(el("p", {class: "note"}, `${d.firings.length + d.left_out} firings: ` + d.rules.map((r) => `${r} ${d.counts[r]}`).join(", ")
    + (observed ? `; ${observed} only observed (health.act: false; hollow markers): the rule fired, nothing was done` : "")
    + (d.left_out ? `; the first ${d.firings.length} are shown` : "")));
  // the strip: steps 0..last, a marker per firing; firings at one step stack upwards
  const W = 880, L = 12, R = 12, lane = 10, stacked = {};
  for (const f of d.firings) stacked[f.step] = (stacked[f.step] || 0) + 1;
  const depth = Math.min(6, Math.max(...Object.values(stacked)));
  const H = 30 + depth * lane, base = H - 22;
  const span = Math.max(1, d.last_step);
  const px = (s) => L + s / span * (W - L - R);
  const svg = sv("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "health-strip"});
  svg.append(sv("line", {x1: L, x2: W - R, y1: base, y2: base, stroke: "#d9dde5"}));
  const every = Math.max(1, Math.ceil(span / 8));
  for (let s = 0; s <= span; s += every) {
    svg.append(sv("line", {x1: px(s), x2: px(s), y1: base, y2: base + 4, stroke: "#d9dde5"}));
    const t = sv("text", {x: px(s), y: H - 6, "text-anchor": "middle", "font-size": 10, fill: "#6b7280"}); t.textContent = String(s); svg.append(t);
  }
  const rows = [], seen = {};
  d.firings.forEach((f, i) => {
    const k = seen[f.step] = (seen[f.step] || 0) + 1;
    const c = colour(f.rule);
    const mark = sv("circle", {cx: px(f.step), cy: base - 6 - Math.min(k - 1, depth - 1) * lane, r: 4.5, class: "firing", "data-rule": f.rule, "data-step": f.step,
      fill: f.acted ? c : "#fff", stroke: c, "stroke-width": 2, style: "cursor:pointer"});
    const tip = sv("title");
    tip.textContent = `step ${f.step} \u00b7 ${f.rule}\nsignals: ${signals(f) || "-"}\nactions: ${f.actions.join(", ") || "-"}${f.acted ? "" : " (observed only)"}\noutcome: ${f.outcome || "-"}`;
    mark.append(tip);
    mark.addEventListener("click", () => {
      for (const r of rows) r.style.background = "";
      rows[i].style.background = "#dbeafe";
      rows[i].scrollIntoView({block: "nearest"});
    });
    svg.append(mark);
  });
  const legend = el("div", {class: "legend"}, d.rules.map((r) => el("span", {}, el("i", {style: `background:${colour(r)};height:8px;width:8px;border-radius:4px`}), r)));
  root.append(svg, legend);
  // the table: what each firing saw and did
  d.firings.forEach((f) => rows.push(el("tr", {class: "firing-row", "data-step": f.step},
    el("td", {}, f.step), el("td", {style: "white-space:nowrap"}, el("i", {style: `display:inline-block;background:${colour(f.rule)};height:8px;width:8px;border-radius:4px;margin-right:4px`}), f.rule),
    el("td", {}, signals(f)), el("td", {}, f.actions.join(", ")), el("td", {}, f.outcome), el("td", {}, f.acted ? "yes" : "no (observed)"))));
  const head = el("tr", {}, ["step", "rule", "signals", "actions", "outcome", "acted"].map((h) => el("th", {}, h)));
  root.append(el("div", {class: "health-table", style: "max-height:420px;overflow:auto;margin-top:8px"}, el("table", {}, head, rows)));
};
"""
