"""Tables and curves of the health benchmark (`benchmarks/health.py`), read from its run
directories: `metrics.jsonl` (eval/success, health/<signal>), `health.jsonl` (one record per
firing) and the `<run>.wall` file the driver writes (wall seconds, return code).

Definitions (printed with the tables):
* noise margin: 2 binomial stds of the warm start's held-out success p0 over n tasks,
  2 * sqrt(p0 (1 - p0) / n), at least 2/n;
* collapse step: the first evaluation whose success is below (pre-collapse - margin), where
  pre-collapse is the best evaluation before it, the warm start's (step 0) included;
* alarm: the first health.jsonl record (any rule); lead = collapse step - alarm step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
#: the signals each curve shows, per run family (the ones its failure should move)
CURVE_SIGNALS = {
    "lr20": ("approx_kl", "grad_norm_z", "entropy_z"),
    "phrase": ("proxy_gap", "outcome_slope", "mi_retrieval_gap", "entropy_z"),
    "flat": ("zero_var_share", "group_std", "tool_call_rate"),
    "guess": ("tool_call_rate", "tool_call_fall", "zero_var_share"),
}
CALIBRATION_SIGNALS = (
    "approx_kl",
    "grad_norm_z",
    "entropy_z",
    "entropy_drop",
    "zero_var_share",
    "group_std",
    "tool_call_rate",
    "tool_call_fall",
    "clip_frac",
    "reward_slope",
    "outcome_slope",
    "proxy_gap",
    "tiny_std_share",
    "mi_retrieval_gap",
)


@dataclass(frozen=True)
class Run:
    name: str
    rows: list[dict[str, Any]]
    firings: list[dict[str, Any]]
    wall_s: float | None
    rc: int | None
    started: str  # UTC time its config.yaml was written: which code (and default rules) it ran

    @property
    def evals(self) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r["eval/success"])) for r in self.rows if "eval/success" in r]

    def signal(self, name: str) -> list[tuple[int, float]]:
        key = f"health/{name}"
        out = []
        for r in self.rows:
            v = r.get(key)
            if isinstance(v, int | float) and math.isfinite(v) and "step" in r:
                out.append((int(r["step"]), float(v)))
        return out


def load(run_dir: Path) -> Run | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    health = run_dir / "health.jsonl"
    firings = [json.loads(x) for x in health.read_text().splitlines() if x.strip()] if health.exists() else []
    wall_file = run_dir.parent / f"{run_dir.name}.wall"
    wall, rc = (None, None)
    if wall_file.exists():
        w, c = wall_file.read_text().split()
        wall, rc = float(w), int(c)
    config = run_dir / "config.yaml"
    started = time.strftime("%H:%M:%S", time.gmtime(config.stat().st_mtime)) if config.exists() else "?"
    return Run(run_dir.name, rows, firings, wall, rc, started)


def margin(p0: float, n: int) -> float:
    return max(2.0 * math.sqrt(p0 * (1.0 - p0) / n), 2.0 / n)


def collapse(evals: Sequence[tuple[int, float]], n: int) -> tuple[int | None, float, float]:
    """(collapse step or None, pre-collapse level, margin) as the module docstring defines them."""
    if not evals:
        return None, math.nan, math.nan
    m = margin(evals[0][1], n)
    best = evals[0][1]
    for step, s in evals[1:]:
        if s < best - m:
            return step, best, m
        best = max(best, s)
    return None, best, m


def replay(run: Run, rules: Any = None) -> list[dict[str, Any]]:
    """The firings the health rules (`rules`, a `health.rules` YAML list; None: today's
    DEFAULT_RULES) make over the run's logged metrics, observing: the same records the monitor
    writes online, as long as no rule acted in the run (observe runs, runs without firings).
    So a run made under older rules is read with today's."""
    return _replayed(run, rules)[0]


def replayed_signal(run: Run, name: str) -> list[tuple[int, float]]:
    """Today's signal `name` over the run's logged metrics, per step (as `Run.signal`, but with
    the signal's current definition, whatever code the run was made with)."""
    key = f"health/{name}"
    return [(step, row[key]) for step, row in _replayed(run, None)[1] if key in row]


def _replayed(run: Run, rules: Any) -> tuple[list[dict[str, Any]], list[tuple[int, dict[str, float]]]]:
    key = (run.name, run.started, repr(rules))
    if key not in _REPLAYS:
        from steprl.config import load_config  # noqa: PLC0415 - the benchmark's venv has steprl
        from steprl.training.controllers import StepReport  # noqa: PLC0415
        from steprl.training.controllers.health import HealthMonitor  # noqa: PLC0415

        sets = ["health.act=false", *([f"health.rules={rules}"] if rules is not None else [])]
        monitor = HealthMonitor.from_config(load_config(None, sets))
        firings: list[dict[str, Any]] = []
        signals: list[tuple[int, dict[str, float]]] = []
        for row in run.rows:
            if int(row.get("step", 0)) < 1:
                continue  # the warm start's row: the monitor sees trained steps only
            numbers = {
                k: float(v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)
            }
            out = monitor.observe(StepReport(int(row["step"]), numbers))
            firings += out.events
            probe = {k: v for k, v in numbers.items() if k.startswith("health/mi")}  # the probe's own
            signals.append((int(row["step"]), {**out.metrics, **probe}))
        _REPLAYS[key] = (firings, signals)
    return _REPLAYS[key]


_REPLAYS: dict[tuple[str, str, str], tuple[list[dict[str, Any]], list[tuple[int, dict[str, float]]]]] = {}


def first_alarm(run: Run, firings: Sequence[Mapping[str, Any]] | None = None) -> tuple[int | None, str]:
    firings = run.firings if firings is None else firings
    if not firings:
        return None, "-"
    f = firings[0]
    return int(f["step"]), str(f["rule"])


def stop_line(run: Run) -> str:
    for f in run.firings:
        acts = json.dumps(f.get("actions", []))
        if "stop" in acts and f.get("acted", True):
            return f"stopped at step {f['step']} by {f['rule']} ({f.get('outcome', '')})"
    return ""


def _actions(firing: Mapping[str, Any]) -> str:
    return ",".join(a if isinstance(a, str) else str(a.get("name", a)) for a in firing.get("actions", []))


def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def report(out: Path, recipes: Mapping[str, Any], seeds: Sequence[int], *, eval_tasks: int) -> str:
    """Print (and return) the markdown tables; draw the curves into docs/images/health_*.png."""
    runs = {p.name: r for p in sorted(out.iterdir()) if p.is_dir() and (r := load(p)) is not None}
    lines = [
        f"Seeds {list(seeds)} (RL only: one warm start per env). Held-out success on {eval_tasks} tasks; "
        "margin = 2 binomial stds of the warm start (>= 2/n); collapse = first eval below "
        "(best eval so far - margin); lead = collapse step - first alarm step.",
        "",
        "### Collapse recipes, rules observing (health.act=false)",
        "",
        "First alarm and rules fired: today's default rules replayed over each run's logged metrics "
        "(`health_analysis.replay`; exact for a run whose rules did not act).",
        "",
        "| recipe | seed | warm start | pre-collapse | margin | collapse step | first alarm (step, rule) "
        "| lead | rules fired | final success |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in recipes.items():
        if not r.collapse:
            continue
        for seed in seeds:
            run = runs.get(f"{name}_observe_s{seed}")
            if run is None or not run.evals:
                continue
            step, pre, m = collapse(run.evals, eval_tasks)
            replayed = replay(run)  # today's default rules over what the run logged
            a_step, a_rule = first_alarm(run, replayed)
            lead = step - a_step if step is not None and a_step is not None else None
            fired = sorted({str(f["rule"]) for f in replayed})
            lines.append(
                f"| {name} | {seed} | {_fmt(run.evals[0][1])} | {_fmt(pre)} | {_fmt(m)} | {step or 'none'} "
                f"| {a_step if a_step is not None else 'none'}, {a_rule} "
                f"| {lead if lead is not None else '-'} "
                f"| {', '.join(fired) or '-'} | {_fmt(run.evals[-1][1])} (step {run.evals[-1][0]}) |"
            )
    lines += [
        "",
        "### Collapse recipes, default rules acting",
        "",
        "| recipe | seed | warm start | final success | final - warm start "
        "| firings (step rule -> actions) | stop |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in recipes.items():
        if not r.collapse:
            continue
        for seed in seeds:
            run = runs.get(f"{name}_act_s{seed}")
            if run is None or not run.evals:
                continue
            fires = "; ".join(f"{f['step']} {f['rule']} -> {_actions(f)}" for f in run.firings[:6])
            lines.append(
                f"| {name} | {seed} | {_fmt(run.evals[0][1])} "
                f"| {_fmt(run.evals[-1][1])} (step {run.evals[-1][0]}) "
                f"| {_fmt(run.evals[-1][1] - run.evals[0][1])} | {fires or '-'} | {stop_line(run) or '-'} |"
            )
    lines += [
        "",
        "### Healthy controls, default rules on",
        "",
        "Firings: today's default rules replayed over the logged metrics (a control on which no "
        "rule acted is the same run with the rules on or observing).",
        "",
        "| control | seed | warm start | final | firings |",
        "|---|---|---|---|---|",
    ]
    for name, r in recipes.items():
        if r.collapse:
            continue
        for seed in seeds:
            run = runs.get(f"{name}_on_s{seed}") or runs.get(f"{name}_observe_s{seed}")
            if run is None or not run.evals:
                continue
            acted = any(f.get("acted") for f in run.firings)  # then the logged firings are the record
            fires = (
                "; ".join(f"{f['step']} {f['rule']}" for f in (run.firings if acted else replay(run))) or "0"
            )
            lines.append(
                f"| {name} | {seed} | {_fmt(run.evals[0][1])} | {_fmt(run.evals[-1][1])} | {fires} |"
            )
    on, off = runs.get("demo_on_s0"), runs.get("demo_off_s0")
    if on and off and on.evals and off.evals:
        lines += [
            "",
            "### Cost on a healthy run (default demo, seed 0; wall times compare when both ran alone)",
            "",
            "| health | wall s | final success |",
            "|---|---|---|",
            f"| default rules on | {_fmt(on.wall_s, 0)} | {_fmt(on.evals[-1][1])} |",
            f"| off | {_fmt(off.wall_s, 0)} | {_fmt(off.evals[-1][1])} |",
        ]
    lines += ["", *template_collapse(runs, seeds), "", *calibration(runs, recipes, seeds, eval_tasks)]
    lines += ["", "### Runs (start time UTC, wall seconds under load, return code)", ""]
    lines += [", ".join(f"{n} {r.started} {_fmt(r.wall_s, 0)}s rc {r.rc}" for n, r in sorted(runs.items()))]
    text = "\n".join(lines)
    print(text)
    curves(runs, recipes, seeds)
    return text


def template_collapse(runs: Mapping[str, Run], seeds: Sequence[int]) -> list[str]:
    """Did the phrase reward drive retrieval to within 0.05 of chance with entropy in its band?"""
    out = [
        "### Template collapse in miniature (phrase recipe, MI probe every 4 steps)",
        "",
        "| run | mi_retrieval_gap (step: value) | min gap | within 0.05 of chance | entropy_z range "
        "| entropy_drop max |",
        "|---|---|---|---|---|---|",
    ]
    for mode in ("observe", "act"):
        for seed in seeds:
            run = runs.get(f"phrase_{mode}_s{seed}")
            if run is None:
                continue
            gap, ez, ed = run.signal("mi_retrieval_gap"), run.signal("entropy_z"), run.signal("entropy_drop")
            series = ", ".join(f"{s}: {v:.2f}" for s, v in gap)
            lo = min((v for _, v in gap), default=math.nan)
            ez_rng = f"{min(v for _, v in ez):.2f} .. {max(v for _, v in ez):.2f}" if ez else "-"
            out.append(
                f"| {run.name} | {series or '-'} | {_fmt(lo, 2)} | {'yes' if lo <= 0.05 else 'no'} "
                f"| {ez_rng} "
                f"| {_fmt(max((v for _, v in ed), default=math.nan), 1)} |"
            )
    return out


def calibration(
    runs: Mapping[str, Run], recipes: Mapping[str, Any], seeds: Sequence[int], eval_tasks: int
) -> list[str]:
    """Each signal's range on the healthy controls vs on the collapse runs in the steps up to
    5 steps before their collapse (the values a rule would have to fire on to lead by 5)."""
    controls = [r for n, r in runs.items() if _is_control(n, recipes)]
    out = [
        "### Signal ranges: healthy controls (all steps) vs collapse runs (steps <= collapse - 5)",
        "",
        "| signal | controls min .. max | " + " | ".join(n for n, r in recipes.items() if r.collapse) + " |",
        "|---|---|" + "---|" * sum(1 for r in recipes.values() if r.collapse),
    ]
    for sig in CALIBRATION_SIGNALS:
        vals = [v for r in controls for _, v in replayed_signal(r, sig)]
        row = f"| {sig} | {_fmt(min(vals), 3) if vals else '-'} .. {_fmt(max(vals), 3) if vals else '-'} |"
        for name, r in recipes.items():
            if not r.collapse:
                continue
            cv = []
            for seed in seeds:
                run = runs.get(f"{name}_observe_s{seed}")
                if run is None:
                    continue
                step, _, _ = collapse(run.evals, eval_tasks)
                limit = (step - 5) if step is not None else 10**9
                cv += [v for s, v in replayed_signal(run, sig) if s <= limit]
            row += f" {_fmt(min(cv), 3)} .. {_fmt(max(cv), 3)} |" if cv else " - |"
        out.append(row)
    return out


def _is_control(name: str, recipes: Mapping[str, Any]) -> bool:
    """A healthy control's run, its rules on or observing (`demo_on_s0`, `demo_lr2_observe_s1`)."""
    for mode in ("_on_s", "_observe_s"):
        base = name.rsplit(mode, 1)[0] if mode in name else None
        if base in recipes and not recipes[base].collapse:
            return True
    return False


def curves(runs: Mapping[str, Run], recipes: Mapping[str, Any], seeds: Sequence[int]) -> None:
    """docs/images/health_<recipe>.png: held-out success (firings marked) and its signals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    DOC_IMAGES.mkdir(parents=True, exist_ok=True)
    for name, r in recipes.items():
        modes = ("observe", "act") if r.collapse else ("on", "observe")
        mine = [(f"{name}_{m}_s{s}", m, s) for m in modes for s in seeds if f"{name}_{m}_s{s}" in runs]
        if not mine:
            continue
        sigs = CURVE_SIGNALS.get(name, ("approx_kl", "zero_var_share", "tool_call_rate"))
        fig, axes = plt.subplots(1 + len(sigs), 1, figsize=(7, 2.2 * (1 + len(sigs))), sharex=True)
        for run_name, mode, seed in mine:
            run = runs[run_name]
            style = "-" if mode != "act" else "--"
            (line,) = axes[0].plot(
                *zip(*run.evals, strict=True), style, marker="o", ms=3, label=f"{mode} s{seed}"
            )
            for f in run.firings if mode == "act" else replay(run):  # acting: what was done
                axes[0].axvline(int(f["step"]), color=line.get_color(), alpha=0.25, lw=1)
            for ax, sig in zip(axes[1:], sigs, strict=True):
                pts = replayed_signal(run, sig) if mode != "act" else run.signal(sig)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=line.get_color(), lw=1)
                ax.set_ylabel(sig, fontsize=8)
        axes[0].set_ylabel("held-out success")
        axes[0].set_title(f"{name}: held-out success (vertical lines: rule firings)", fontsize=9)
        axes[0].legend(fontsize=7)
        axes[-1].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(DOC_IMAGES / f"health_{name}.png", dpi=90)
        plt.close(fig)
