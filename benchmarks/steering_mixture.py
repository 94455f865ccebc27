"""Env mixtures (issue 26, item 3), two experiments on the tiny model, CPU, a few seeds each:

(a) task normalisation: three bandits whose rewards are scaled x1, x10 and x0.1 (`bandit`'s
    `scale` param, its format penalty scaled alike), trained with Dr. GRPO (no per-group std:
    the advantages keep the reward scale), without and with `algorithm.task_normalize` (per-env
    normalisation). Prints each env's mean share of the gradient (`grad_share/<env>`, from the
    learner) and its held-out success.
(b) learning-progress weights: three bandits of rising difficulty (2, 3 and 5 arms), weighted
    equally (`mixture`, fixed) or by learning progress (`learning_progress`). Prints the
    environment steps until the mean over envs of each env's training success (a running mean
    over 3 steps) first reaches a threshold, and the final held-out success per env.

    .venv/bin/python benchmarks/steering_mixture.py [--only norm|lp] [--seeds 0,1,2] [--steps 20]

Curves go to docs/images/steering_mixture_{norm,lp}.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from steprl.config import load_config
from steprl.training.loop.trainer import train

SCALES = {"x1": 1.0, "x10": 10.0, "x0.1": 0.1}
ARMS = {"k2": 2, "k3": 3, "k5": 5}
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


def bandit(key: str, *, scale: float = 1.0, k: int = 2) -> str:
    return (
        f"{{name: bandit, id: {key}, weight: 1, params: {{reward: best, scale: {scale}, "
        f"format_penalty: {-0.1 * scale}}}, task_params: {{k: {k}, pulls: 1, reveal: true}}}}"
    )


def warm_start(envs: list[str], keys: list[str]) -> list[str]:
    """The overrides that start every run of an experiment from one SFT warm start (seed 0's;
    the seeds then differ in RL only): made here once (cached in $STEPRL_CACHE), then loaded
    as a local model directory."""
    run(envs, [], 0, 1, 4)
    root = Path(os.environ.get("STEPRL_CACHE") or Path.home() / ".cache" / "steprl")
    made = max(root.glob(f"tiny-{'_'.join(keys)}-*"), key=lambda p: p.stat().st_mtime)
    return [f"model.name={made}", "model.init=pretrained", "rollout.system_prompt=none"]


def run(envs: list[str], extra: list[str], seed: int, steps: int, eval_tasks: int) -> list[dict[str, float]]:
    """Train one mixture of bandits; returns the per-step metrics, the final eval last."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            "configs/bandit_tiny.yaml",
            [
                "env.name=calculator",  # the single-env keys back to their defaults: a list follows
                "env.params={}",
                "env.task_params={}",
                f"env.mix=[{', '.join(envs)}]",
                *extra,
                f"run.seed={seed}",
                f"trainer.total_steps={steps}",
                "trainer.eval_every=0",
                f"trainer.eval_tasks={eval_tasks}",
                "rollout.tasks_per_step=12",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.save_trajectories=false",
                f"run.output_dir={tmp}",
                "run.name=bench",
            ],
        )
        result = train(cfg, log=lambda s: None)
    return [*result.history, result.final]


def env_steps(history: list[dict[str, float]]) -> list[float]:
    """Cumulative environment steps (turns) after each RL step."""
    out, total = [], 0.0
    for m in history:
        total += m.get("episode/turns_mean", 1.0) * m.get("traj/in", 0.0)
        out.append(total)
    return out


def mean_env_success(history: list[dict[str, float]], keys: list[str]) -> list[float]:
    """Per step: the mean over envs of each env's training success, a running mean over 3 steps."""
    per_env = {k: [m.get(f"env/{k}/success_rate", float("nan")) for m in history] for k in keys}
    out = []
    for i in range(len(history)):
        vals = []
        for k in keys:
            window = [v for v in per_env[k][max(0, i - 2) : i + 1] if v == v]
            vals.append(sum(window) / len(window) if window else 0.0)
        out.append(sum(vals) / len(vals))
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f}"


def normalisation(seeds: list[int], steps: int, eval_tasks: int) -> None:
    envs = [bandit(k, scale=s) for k, s in SCALES.items()]
    base = ["algorithm.advantage=dr_grpo", "algorithm.advantage_params={}", *warm_start(envs, list(SCALES))]
    curves: dict[str, list[list[dict[str, float]]]] = {}
    print(f"\n(a) task normalisation: bandits x1, x10, x0.1, Dr. GRPO, {steps} steps, seeds {seeds}")
    print(
        f"{'run':22s} "
        + " ".join(f"share {k:>5s}" for k in SCALES)
        + "   "
        + " ".join(f"eval {k:>5s}" for k in SCALES)
    )
    # success as the metrics count it is reward >= 1, which a x0.1 env never reaches: the
    # held-out column is each env's mean reward over its scale (a best pull scores 1; an invalid
    # action's format penalty, -0.1 x scale, counts against it)
    for name, extra in (("without", base), ("task_normalize", [*base, "algorithm.task_normalize=true"])):
        curves[name] = []
        for seed in seeds:
            t0 = time.perf_counter()
            hist = run(envs, extra, seed, steps, eval_tasks)
            curves[name].append(hist)
            train_steps, final = hist[:-1], hist[-1]
            shares = [statistics.mean(m.get(f"grad_share/{k}", 0.0) for m in train_steps) for k in SCALES]
            evals = [final.get(f"eval/env/{k}/reward_mean", float("nan")) / s for k, s in SCALES.items()]
            print(
                f"{name + f' seed {seed}':22s} "
                + " ".join(f"{s:11.3f}" for s in shares)
                + "   "
                + " ".join(f"{e:10.3f}" for e in evals)
                + f"   ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        for k in SCALES:
            share = [statistics.mean(m.get(f"grad_share/{k}", 0.0) for m in h[:-1]) for h in curves[name]]
            ev = [h[-1].get(f"eval/env/{k}/reward_mean", float("nan")) / SCALES[k] for h in curves[name]]
            print(f"  {name:16s} {k:5s} grad share {spread(share)}   held-out reward/scale {spread(ev)}")
    plot(
        curves,
        lambda h, k: [m.get(f"grad_share/{k}", 0.0) for m in h[:-1]],
        list(SCALES),
        "gradient share",
        IMAGES / "steering_mixture_norm.png",
    )


def learning_progress(seeds: list[int], steps: int, eval_tasks: int, threshold: float) -> None:
    envs = [bandit(k, k=n) for k, n in ARMS.items()]
    runs = {
        "uniform (mixture)": ["env.source=mixture"],
        "learning_progress": ["env.source=learning_progress"],
    }
    warm = warm_start(envs, list(ARMS))
    runs = {name: [*warm, *extra] for name, extra in runs.items()}
    curves: dict[str, list[list[dict[str, float]]]] = {}
    print(f"\n(b) learning progress vs uniform: bandits with 2, 3, 5 arms, {steps} steps, seeds {seeds}")
    print(f"    env steps until the mean per-env training success (3-step running mean) >= {threshold}")
    for name, extra in runs.items():
        curves[name], reach, finals = [], [], []
        for seed in seeds:
            t0 = time.perf_counter()
            hist = run(envs, extra, seed, steps, eval_tasks)
            curves[name].append(hist)
            train_steps = hist[:-1]
            success, total = mean_env_success(train_steps, list(ARMS)), env_steps(train_steps)
            hit = next((total[i] for i, s in enumerate(success) if s >= threshold), None)
            reach.append(hit)
            finals.append(statistics.mean(hist[-1].get(f"eval/env/{k}/success_rate", 0.0) for k in ARMS))
            weights = " ".join(f"{k}={train_steps[-1].get(f'source/weight/{k}', 1 / 3):.2f}" for k in ARMS)
            reached = f"{hit:.0f}" if hit is not None else f">{total[-1]:.0f}"
            lower = [round(threshold - d, 2) for d in (0.2, 0.1)]  # where the main one is not reached
            below = [next((f"{total[i]:.0f}" for i, s in enumerate(success) if s >= t), "-") for t in lower]
            print(
                f"  {name:18s} seed {seed}: env steps to {threshold}: {reached}"
                f" (to {lower[0]}: {below[0]}, to {lower[1]}: {below[1]})   first-step {success[0]:.3f}"
                f"   final mean success {success[-1]:.3f}   held-out mean {finals[-1]:.3f}"
                f"   last weights {weights}   ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        got = [r for r in reach if r is not None]
        print(
            f"  {name:18s} reached in {len(got)}/{len(reach)} seeds; env steps (reached): "
            f"{spread(got) if got else '-'}; held-out mean success {spread(finals)}"
        )
    plot(
        curves,
        lambda h, k: (
            mean_env_success(h[:-1], list(ARMS))
            if k == "mean"
            else [m.get(f"source/weight/{k}", 1 / 3) for m in h[:-1]]
        ),
        ["mean", *ARMS],
        "mean per-env success / weight",
        IMAGES / "steering_mixture_lp.png",
    )


def plot(curves, series, keys, ylabel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3), sharey=True)
    for ax, key in zip(axes, keys, strict=True):
        for (name, hists), color in zip(curves.items(), ("tab:red", "tab:blue"), strict=False):
            for i, h in enumerate(hists):
                ax.plot(series(h, key), color=color, alpha=0.7, label=name if i == 0 else None)
        ax.set_title(key)
        ax.set_xlabel("RL step")
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"  curves: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("norm", "lp"), default=None)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-tasks", type=int, default=60, help="per env")
    ap.add_argument("--threshold", type=float, default=0.8)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.only in (None, "norm"):
        normalisation(seeds, args.steps, args.eval_tasks)
    if args.only in (None, "lp"):
        learning_progress(seeds, args.steps, args.eval_tasks, args.threshold)


if __name__ == "__main__":
    main()
