"""Learned step credit (issue 28): do the step-reward models credit the right steps, and does
training with them beat the critic-free group methods at equal environment steps?

Runs, each on the tiny model from an SFT warm start per env and seed (`run.seed` seeds the
demonstrations and the SFT too; cached, so every condition of a seed starts from the same one):

* **gridwalk** (`configs/gridwalk_tiny.yaml`; every step labelled optimal or not): GRPO, RLOO,
  GiGPO, and GRPO + each step-reward kind (istar, progress, mc_value, policy_gain) entering as
  A = A_episode + alpha * A_step. Each kind's `step_reward/auroc` is logged every step on the
  step's groups *before* it is fitted on them (held out): the value at step 1 is the untrained
  model's ("start"), at step N + 1 the model after N fits.
* **sokoban** (`configs/sokoban_tiny.yaml`, the long-horizon built-in env): GRPO, RLOO, GiGPO,
  GRPO + istar, GRPO + progress.
* **drift**: gridwalk with `istar` whose fits from step `--flip-at` on prefer the loser of each
  pair (a kind of your own by import path, `FlippedIStar` below), `--drift-steps` long: the drift
  guard must cut alpha to 0, and stay silent on the healthy runs above. (Not in the equal-steps
  comparison: its env-step budget is larger, and the budget is the least any run reached.)

Prints, per condition, the mean and a 95% t-interval over seeds of the final held-out success,
of the held-out success at the largest number of env steps every run of that env reached, the
step-label AUROC at start / after N fits, the guard's firings, and the wall time per run (under
the load of `--jobs` runs at once: not a speed claim). Results are cached per run in
`--out` (JSON), so an interrupted benchmark continues and the tables can be printed alone:

    .venv/bin/python benchmarks/step_credit.py [--seeds 0,1,2] [--steps 24] [--jobs 2] [--only gridwalk]
    .venv/bin/python benchmarks/step_credit.py --table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from steprl.training.step_rewards.base import ModelContext, StepData
from steprl.training.step_rewards.istar import IStar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "bench_step_credit"  # per-run JSON (runs/ is git-ignored)
ENVS = {"gridwalk": "configs/gridwalk_tiny.yaml", "sokoban": "configs/sokoban_tiny.yaml"}
KINDS = ("istar", "progress", "mc_value", "policy_gain")


def _credit(kind: str, extra: str = "") -> list[str]:
    return [f"algorithm.step_reward={{kind: {kind}, weight: 0.5{extra}}}"]


def conditions(env: str, flip_at: int) -> dict[str, list[str]]:
    base = {
        "grpo": ["algorithm.step_reward=null"],
        "rloo": ["algorithm.step_reward=null", "algorithm.advantage=rloo", "algorithm.advantage_params={}"],
        "gigpo": ["algorithm.step_reward=null", "algorithm.advantage=gigpo", "algorithm.advantage_params={}"],
    }
    kinds = KINDS if env == "gridwalk" else ("istar", "progress")
    base |= {f"grpo+{k}": _credit(k) for k in kinds}
    if env == "gridwalk":
        flipped = f"kind: 'benchmarks.step_credit:FlippedIStar', params: {{flip_at: {flip_at}}}"
        base["drift: istar flipped"] = [f"algorithm.step_reward={{{flipped}, weight: 0.5}}"]
    return base


class FlippedIStar(IStar):
    """`istar` whose fits from RL step `flip_at` on prefer the loser of each pair (outcome ->
    1 - outcome): a step reward whose labels flipped mid-run, the drift guard's test case."""

    def __init__(self, ctx: ModelContext, *, flip_at: int = 10, **params: Any) -> None:
        super().__init__(ctx, **params)
        self.flip_at, self.fitted = flip_at, 0

    def fit(self, data: StepData) -> dict[str, float]:
        self.fitted += 1
        if self.fitted < self.flip_at:
            return super().fit(data)
        flipped = dataclasses.replace(data.x, rewards=1.0 - data.x.rewards)
        return super().fit(StepData(flipped, data.views, data.trajectories))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fitted": self.fitted}

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.fitted = int(state["fitted"])


def run_one(
    env: str, name: str, seed: int, steps: int, eval_every: int, eval_tasks: int, flip_at: int
) -> dict:
    from steprl.config import load_config
    from steprl.training.loop.trainer import train

    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            str(ROOT / ENVS[env]),
            [
                *conditions(env, flip_at)[name],
                f"run.seed={seed}",
                f"trainer.total_steps={steps}",
                f"trainer.eval_every={eval_every}",
                f"trainer.eval_tasks={eval_tasks}",
                "logging.tensorboard=false",
                "logging.save_trajectories=false",
                "logging.progress=false",
                f"run.output_dir={tmp}",
            ],
        )
        started = time.perf_counter()
        result = train(cfg, log=lines.append)
        wall = time.perf_counter() - started
    rows = [{"step": 0.0, **result.warm_start}, *result.history]
    alerts = [line for line in lines if "drifts from the outcomes" in line]
    return {"env": env, "name": name, "seed": seed, "rows": rows, "wall_s": wall, "alerts": alerts}


def key(env: str, name: str, seed: int) -> str:
    return f"{env}__{name.replace(' ', '_').replace(':', '').replace('+', '_')}__s{seed}"


def interval(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}.get(len(xs), 2.0)
    half = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{m:.3f} [{m - half:.3f}, {m + half:.3f}]"


def env_steps_curve(rows: list[dict]) -> tuple[list[float], list[float]]:
    total, xs, ys = 0.0, [], []
    for r in rows:
        if "episode/turns_mean" in r:
            total += r["episode/turns_mean"] * r.get("traj/trainable", 0.0)
        if r.get("eval/success") is not None:
            xs.append(total)
            ys.append(r["eval/success"])
    return xs, ys


def success_at(rows: list[dict], budget: float) -> float:
    xs, ys = env_steps_curve(rows)
    return [y for x, y in zip(xs, ys, strict=True) if x <= budget][-1]


def table(results: list[dict], fits: int) -> str:
    out = []
    for env in ENVS:
        runs = [r for r in results if r["env"] == env]
        if not runs:
            continue
        budget = min(env_steps_curve(r["rows"])[0][-1] for r in runs)
        seeds = sorted({r["seed"] for r in runs})
        out.append(f"\n## {env} (seeds {seeds}; env-step budget {budget:.0f})\n")
        out.append(
            "| condition | held-out warm start | final held-out | held-out at the budget | AUROC start "
            f"| AUROC after {fits} fits | tau after {fits} fits | alpha at end | alerts | wall s |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for name in dict.fromkeys(r["name"] for r in runs):
            rs = [r for r in runs if r["name"] == name]
            pick = lambda r, k, i: r["rows"][i].get(k, math.nan) if len(r["rows"]) > i else math.nan  # noqa: E731
            last_eval = [[x for x in r["rows"] if x.get("eval/success") is not None][-1] for r in rs]
            out.append(
                f"| {name} | {interval([r['rows'][0]['eval/success'] for r in rs])} "
                f"| {interval([x['eval/success'] for x in last_eval])} "
                f"| {interval([success_at(r['rows'], budget) for r in rs])} "
                f"| {interval([pick(r, 'step_reward/auroc', 1) for r in rs])} "
                f"| {interval([pick(r, 'step_reward/auroc', fits + 1) for r in rs])} "
                f"| {interval([pick(r, 'step_reward/kendall_tau', fits + 1) for r in rs])} "
                f"| {interval([r['rows'][-1].get('step_reward/alpha', math.nan) for r in rs])} "
                f"| {sum(len(r['alerts']) for r in rs)} "
                f"| {statistics.fmean(r['wall_s'] for r in rs):.0f} |"
            )
    return "\n".join(out)


def curves(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in results if r["env"] == "gridwalk"]
    names = list(dict.fromkeys(r["name"] for r in grid))
    credit = [n for n in names if "+" in n or n.startswith("drift")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    panels = ((0, "step_reward/auroc"), (1, "step_reward/kendall_tau"), (2, "step_reward/alpha"))
    for name in credit:
        for i, r in enumerate(x for x in grid if x["name"] == name):
            kw = {"label": name} if i == 0 else {}
            for ax, k in panels:
                pts = [(j, x[k]) for j, x in enumerate(r["rows"]) if k in x]
                color = f"C{names.index(name)}"
                axes[ax].plot(*zip(*pts, strict=True), color=color, alpha=0.7, **kw) if pts else None
    for name in names:
        for i, r in enumerate(x for x in grid if x["name"] == name):
            xs, ys = env_steps_curve(r["rows"])
            kw = {"label": name} if i == 0 else {}
            axes[3].plot(xs, ys, color=f"C{names.index(name)}", alpha=0.6, marker=".", **kw)
    axes[0].set(title="step-label AUROC (held-out groups)", xlabel="RL step", ylabel="AUROC")
    axes[0].axhline(0.8, color="grey", ls=":")
    axes[1].set(title="Kendall tau: summed step reward vs outcome", xlabel="RL step")
    axes[2].set(title="alpha (the drift guard's weight)", xlabel="RL step")
    axes[3].set(title="held-out success", xlabel="env steps")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("gridwalk, tiny model: each line one seed")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--flip-at", type=int, default=12)
    p.add_argument("--drift-steps", type=int, default=56, help="the drift runs: the guard needs time")
    p.add_argument("--fits", type=int, default=10, help="the AUROC column 'after N fits'")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated envs or condition names")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--table", action="store_true", help="print the tables of the cached runs only")
    p.add_argument("--one", nargs=3, metavar=("ENV", "NAME", "SEED"), help=argparse.SUPPRESS)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.one:
        env, name, seed = a.one
        steps = a.drift_steps if name.startswith("drift") else a.steps
        res = run_one(env, name, int(seed), steps, a.eval_every, a.eval_tasks, a.flip_at)
        (a.out / f"{key(env, name, int(seed))}.json").write_text(json.dumps(res))
        return
    if not a.table:
        only = {x for x in a.only.split(",") if x}
        todo = [
            (env, name, seed)
            for env in ENVS
            for name in conditions(env, a.flip_at)
            for seed in map(int, a.seeds.split(","))
            if (not only or env in only or name in only)
            and not (a.out / f"{key(env, name, seed)}.json").exists()
        ]
        running: list[subprocess.Popen] = []
        common = [
            "--steps",
            str(a.steps),
            "--eval-every",
            str(a.eval_every),
            "--eval-tasks",
            str(a.eval_tasks),
            "--flip-at",
            str(a.flip_at),
            "--drift-steps",
            str(a.drift_steps),
            "--out",
            str(a.out),
        ]
        for env, name, seed in todo:
            while len(running) >= a.jobs:
                running = [r for r in running if r.poll() is None]
                time.sleep(1) if len(running) >= a.jobs else None
            print(f"run {env} {name} seed {seed}", flush=True)
            running.append(
                subprocess.Popen([sys.executable, __file__, *common, "--one", env, name, str(seed)], cwd=ROOT)
            )
        for r in running:
            r.wait()
    results = [json.loads(f.read_text()) for f in sorted(a.out.glob("*.json"))]
    print(table(results, a.fits))
    curves(results, ROOT / "docs" / "images" / "step_credit.png")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `benchmarks.step_credit:FlippedIStar` resolves in each run
    torch.set_num_threads(1)
    main()
