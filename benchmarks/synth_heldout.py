"""Environment synthesis (issue 29): does the tiny model, trained by RL on synthesized tasks of
the train DAG shapes, get better at shapes it never saw?

Each seed runs `configs/synth_shop_tiny.yaml` (tasks synthesized from `configs/synth/shop.yaml`
as the run starts; an SFT warm start on the expert's plans of train-shape tasks, per seed; then
GRPO on train-shape tasks) with `run.seed` set; held-out success is the eval split (the shapes
`tasks.holdout_shapes` kept out of training), measured every `trainer.eval_every` steps. Prints
the held-out and train success per evaluation, per seed, their mean with a 95% t-interval, and
writes the curves to `docs/images/synth_heldout.png`. Each seed's metrics are kept in `--out`
(one run directory per seed), so `--table` prints the tables again without training.

    .venv/bin/python benchmarks/synth_heldout.py [--seeds 0,1,2] [--steps 40] [--table]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "synth_shop_tiny.yaml"
# 97.5% quantiles of Student's t for 1..9 degrees of freedom
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def interval(xs: list[float]) -> str:
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    h = T975[len(xs) - 2] * statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]"


def yaml_eval_tasks(config: Path, run: Path) -> int:
    """Eval episodes per evaluation: the run's own config (a `--set` may have changed it)."""
    import yaml

    saved = run / "config.yaml"
    return int(yaml.safe_load((saved if saved.exists() else config).read_text())["trainer"]["eval_tasks"])


def run_seed(seed: int, steps: int, out: Path, config: Path, extra: tuple[str, ...] = ()) -> float:
    started = time.perf_counter()
    cmd = [
        sys.executable, "-c", "from steprl.cli import main; main()", "train", str(config),
        "--set", f"run.seed={seed}", "--set", f"run.output_dir={out}", "--set", f"run.name=seed{seed}",
        "--set", f"trainer.total_steps={steps}", "--set", "logging.progress=false",
    ] + [a for kv in extra for a in ("--set", kv)]  # fmt: skip
    with (out / f"seed{seed}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


def curves(out: Path, seed: int) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> held-out success, step -> train success) of one seed's run."""
    held, train = {}, {}
    for line in (out / f"seed{seed}" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/success" in row:
            held[int(row["step"])] = float(row["eval/success"])
        if "success/rate" in row:
            train[int(row["step"])] = float(row["success/rate"])
    return held, train


def by_shape(out: Path, seeds: list[int], first: int, last: int, config: Path) -> None:
    """Held-out success per held-out shape, at the warm start and at the end (all seeds pooled)."""
    import pyarrow.parquet as pq
    import yaml

    from steprl.envs.registry import get_spec

    env = yaml.safe_load(config.read_text())["env"]
    spec = get_spec("synth", env["params"])
    shape = {}
    for task in spec.tasks("eval", 0, **env.get("task_params", {})):
        if task.id in shape:
            break  # the eval split cycles its fixed tasks
        shape[task.id] = task.params["shape"]
    counts: dict[str, list[list[float]]] = {}
    for seed in seeds:
        for i, step in enumerate((first, last)):
            rows = pq.read_table(out / f"seed{seed}" / "eval_trajectories" / f"step_{step:06d}.parquet")
            for task_id, reward in zip(
                rows["task_id"].to_pylist(), rows["outcome_reward"].to_pylist(), strict=True
            ):
                counts.setdefault(shape[task_id], [[], []])[i].append(float(reward >= 1.0))
    print(f"\nper held-out shape (episodes of all seeds): success at step {first} -> step {last}")
    for name, (a, b) in sorted(counts.items(), key=lambda kv: -len(kv[1][0])):
        print(f"  {statistics.fmean(a):.3f} -> {statistics.fmean(b):.3f}  ({len(a)} episodes)  {name}")


def table(out: Path, seeds: list[int], config: Path) -> None:
    runs = {s: curves(out, s) for s in seeds}
    steps = sorted(set.intersection(*(set(h) for h, _ in runs.values())))
    episodes = yaml_eval_tasks(config, out / f"seed{seeds[0]}")
    print(f"\nheld-out success on unseen DAG shapes (seeds {seeds}; {episodes} eval episodes each)")
    print(
        "| step | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean [95% CI] | train success (mean of the 5 steps up to it) |"
    )
    print("|---|" + "---|" * (len(seeds) + 2))
    for step in steps:
        held = [runs[s][0][step] for s in seeds]
        recent = [
            statistics.fmean([v for k, v in runs[s][1].items() if step - 5 < k <= step] or [float("nan")])
            for s in seeds
        ]
        print(
            f"| {step} | " + " | ".join(f"{h:.3f}" for h in held) + f" | {interval(held)} | "
            + (interval(recent) if step else "-") + " |"
        )  # fmt: skip
    first, last = steps[0], steps[-1]
    gains = [runs[s][0][last] - runs[s][0][first] for s in seeds]
    print(f"\nchange from step {first} to {last}: {interval(gains)}; per seed {[round(g, 3) for g in gains]}")
    by_shape(out, seeds, first, last, config)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for s in seeds:
        held, train = runs[s]
        a.plot(sorted(held), [held[k] for k in sorted(held)], marker="o", label=f"seed {s}")
        b.plot(sorted(train), [train[k] for k in sorted(train)], alpha=0.8, label=f"seed {s}")
    a.set(title="held-out success (unseen DAG shapes)", xlabel="RL step", ylabel="success")
    b.set(title="train success (train shapes, T=1)", xlabel="RL step")
    a.legend(), b.legend()
    fig.tight_layout()
    stem = config.stem.removeprefix("synth_shop_tiny_").removeprefix("synth_")
    suffix = "" if config == CONFIG else f"_{stem}"
    path = ROOT / "docs" / "images" / f"synth_heldout{suffix}.png"
    fig.savefig(path, dpi=110)
    print(f"curves: {path.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "synth_heldout")
    ap.add_argument("--table", action="store_true", help="print the tables of finished runs")
    ap.add_argument("--config", type=Path, default=CONFIG, help="a variant of the protocol's config")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="passed on to each seed's `steprl train` (a smoke at a small shape; not for a protocol's runs)",
    )  # fmt: skip
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table:
        for seed in seeds:
            if (args.out / f"seed{seed}" / "metrics.jsonl").exists() and (
                args.out / f"seed{seed}" / "report.html"
            ).exists():
                print(f"seed {seed}: done before, kept")
                continue
            took = run_seed(seed, args.steps, args.out, args.config, tuple(args.set))
            print(f"seed {seed}: {took:.0f} s (SFT warm start included)", flush=True)
    table(args.out, seeds, args.config)


if __name__ == "__main__":
    main()
