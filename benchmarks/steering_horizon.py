"""ScalingInter-RL in miniature (issue 26, item 1): a horizon curriculum on the corridor env.

The corridor (`envs/library/horizon.py`) needs exactly k turns, k uniform in 1..6 per task; a
wrong door costs a turn and an episode the turn cap cuts off fails. Four ways to set the training
turn cap, 3 seeds each, the tiny model from one SFT warm start (`configs/corridor_curriculum.yaml`):

- stepwise [2, 4, 6]: AgentGym-RL's rule, a stage every `steps / 4` steps (the last round runs
  half the run, as AgentGym-RL's schedules keep their last round longest);
- gated [2, 4, 6]: the next round once success at the cap and the share the cap cut off cross the
  config's thresholds for 2 steps in a row;
- fixed 6 (the cap the held-out evaluation uses) and fixed 2.

Every run is evaluated on the same held-out tasks at cap 6. The x axis is environment steps (the
sum of the turns of every training episode so far), so a short cap that spends fewer turns per
step is compared at equal interaction cost. Prints, per condition, the mean and spread over seeds
of the final held-out success, of the success at the largest env-step budget every run reached,
and the env steps to a held-out success threshold. Curves: docs/images/curriculum_horizon.png.

    .venv/bin/python benchmarks/steering_horizon.py [--seeds 0,1,2] [--steps 80] [--threshold 0.6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from steprl.config import load_config
from steprl.training.loop.trainer import train

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
CONFIG = "configs/corridor_curriculum.yaml"


def conditions(steps: int) -> dict[str, list[str]]:
    stage = max(1, steps // 4)
    return {
        "stepwise [2,4,6]": [f"trainer.curriculum.stage_steps={stage}"],
        "gated [2,4,6]": ["trainer.curriculum.horizon=gated"],
        "fixed 6": ["trainer.curriculum=null"],
        "fixed 2": ["trainer.curriculum.rounds=[2]"],
    }


def run(extra: list[str], seed: int, steps: int, eval_every: int, eval_tasks: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            CONFIG,
            [
                *extra,
                f"run.seed={seed}",
                f"trainer.total_steps={steps}",
                f"trainer.eval_every={eval_every}",
                f"trainer.eval_tasks={eval_tasks}",
                "logging.tensorboard=false",
                "logging.save_trajectories=false",
                f"run.output_dir={tmp}",
            ],
        )
        result = train(cfg, log=lambda _: None)
    return [{"step": 0.0, **result.warm_start}, *result.history]


def curve(rows: list[dict[str, float]]) -> tuple[list[float], list[float], list[float]]:
    """(env steps, held-out success) at each evaluation, and the training cap per step."""
    env_steps, xs, ys, caps = 0.0, [], [], []
    for r in rows:
        if "episode/turns_mean" in r:
            env_steps += r["episode/turns_mean"] * r.get("traj/trainable", 0.0)
            caps.append(r.get("curriculum/max_turns", 0.0))
        if "eval/success" in r:
            xs.append(env_steps)
            ys.append(r["eval/success"])
    return xs, ys, caps


def at(xs: list[float], ys: list[float], x: float) -> float:
    """Held-out success at `x` env steps: the latest evaluation at or before it."""
    return [y for xi, y in zip(xs, ys, strict=True) if xi <= x][-1]


def first_reaching(xs: list[float], ys: list[float], threshold: float) -> float | None:
    return next((x for x, y in zip(xs, ys, strict=True) if y >= threshold), None)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {sd:.3f} (median {statistics.median(values):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-tasks", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=0.6)
    ap.add_argument("--plot", default=str(IMAGES / "curriculum_horizon.png"))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list[tuple[list[float], list[float], list[float]]]] = {}
    for name, extra in conditions(args.steps).items():
        runs[name] = []
        for seed in seeds:
            started = time.perf_counter()
            rows = run(extra, seed, args.steps, args.eval_every, args.eval_tasks)
            runs[name].append(curve(rows))
            xs, ys, _ = runs[name][-1]
            print(
                f"{name:18s} seed {seed}: held-out {ys[0]:.3f} -> {ys[-1]:.3f} after {xs[-1]:.0f} env steps "
                f"({time.perf_counter() - started:.0f}s)",
                flush=True,
            )
    # the budget every curriculum and the long fixed cap reached (fixed 2 spends far fewer turns
    # per step: it is read at its own end, where it has plateaued)
    budget = min(xs[-1] for name, rs in runs.items() if name != "fixed 2" for xs, _, _ in rs)
    print(
        f"\nheld-out success at cap 6 ({args.eval_tasks} tasks, {len(seeds)} seeds, {args.steps} RL steps); "
        f"'at equal env steps' = the latest evaluation at or before {budget:.0f} env steps"
    )
    header = (
        f"{'condition':18s} | {'final':30s} | {'at equal env steps':30s} | env steps (total) | "
        f"to {args.threshold}"
    )
    print(header)
    print("-" * len(header))
    for name, rs in runs.items():
        finals = [ys[-1] for _, ys, _ in rs]
        equal = [at(xs, ys, budget) for xs, ys, _ in rs]
        totals = [xs[-1] for xs, _, _ in rs]
        reach = [first_reaching(xs, ys, args.threshold) for xs, ys, _ in rs]
        got = [r for r in reach if r is not None]
        to = (
            f"{statistics.median(got):.0f} median, {len(got)}/{len(rs)} reached"
            if got
            else f"0/{len(rs)} reached"
        )
        mean_total = statistics.fmean(totals)
        print(f"{name:18s} | {spread(finals):30s} | {spread(equal):30s} | {mean_total:17.0f} | {to}")
    plot(runs, Path(args.plot), args.threshold)
    print(f"\ncurves: {args.plot}")


def plot(
    runs: dict[str, list[tuple[list[float], list[float], list[float]]]], path: Path, threshold: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, rs) in enumerate(runs.items()):
        color = f"C{i}"
        for j, (xs, ys, caps) in enumerate(rs):
            left.plot(xs, ys, color=color, alpha=0.35, lw=1)
            right.plot(
                range(1, len(caps) + 1), caps, color=color, alpha=0.6, lw=1.5, label=name if j == 0 else None
            )
        n = min(len(ys) for _, ys, _ in rs)
        mean_x = [statistics.fmean(xs[k] for xs, _, _ in rs) for k in range(n)]
        mean_y = [statistics.fmean(ys[k] for _, ys, _ in rs) for k in range(n)]
        left.plot(mean_x, mean_y, color=color, lw=2.5, label=f"{name} (mean of {len(rs)})")
    left.axhline(threshold, color="grey", ls=":", lw=1)
    left.set(xlabel="environment steps (sum of training turns)", ylabel="held-out success at cap 6")
    left.set_title("corridor k in 1..6: horizon curriculum vs fixed caps")
    left.legend(fontsize=8)
    right.set(xlabel="RL step", ylabel="training turn cap", title="the cap each run trained under")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
