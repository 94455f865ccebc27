"""Train the default environment with each advantage estimator at one fixed small budget on CPU
and print a table: held-out success at the end, steps until the training success rate first
reaches 0.8, and wall time. A script that prints numbers, not a timed test.

    .venv/bin/python benchmarks/algorithms.py [--steps 30] [--only grpo,rloo] [--markdown]

All runs share the default config's cached SFT warm start and seed; only the algorithm differs.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from steprl.config import load_config
from steprl.training.loop.trainer import train

#: row name -> overrides on top of configs/calculator_tiny.yaml
RUNS: dict[str, list[str]] = {
    "grpo": ["algorithm.advantage=grpo", "algorithm.advantage_params={scale_by_std: true}"],
    "dr_grpo": ["algorithm.advantage=dr_grpo"],
    "rloo": ["algorithm.advantage=rloo"],
    "loop": [
        "algorithm.advantage=loop",
        "algorithm.policy_loss=loop_clip",
        "algorithm.loss_params={eps: 0.1}",
        "algorithm.min_abs_advantage=0.01",
    ],
    "reinforce_pp": ["algorithm.advantage=reinforce_pp"],
    "reinforce_pp_baseline": ["algorithm.advantage=reinforce_pp_baseline"],
    "grpo_env_std": ["algorithm.advantage=grpo_env_std"],
    "gae (separate critic)": ["algorithm.advantage=gae", "algorithm.critic=separate"],
    "step_gae (separate critic)": ["algorithm.advantage=step_gae", "algorithm.critic=separate"],
    "bi_level_gae (shared critic)": ["algorithm.advantage=bi_level_gae", "algorithm.critic=shared"],
    "gigpo": ["algorithm.advantage=gigpo", "algorithm.advantage_params={gamma: 0.95, omega: 1.0}"],
    "grpo + task_normalize": ["algorithm.advantage=grpo", "algorithm.task_normalize=true"],
    "grpo + empg": ["algorithm.advantage=grpo", "algorithm.empg={k: 1.0, k_f: 1.0, zeta: 0.1}"],
    "dapo (grpo + dynamic sampling, clip-higher, overlong)": [
        "algorithm.advantage=grpo",
        "algorithm.group_filter=dapo",
        "algorithm.filter_regenerations=2",
        "algorithm.loss_params={clip_low: 0.2, clip_high: 0.28}",
        "algorithm.overlong={max_len: 120, cache_len: 30, penalty: 1.0}",
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--only", default="", help="comma-separated row names (prefix match)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    rows = []
    for name, overrides in RUNS.items():
        if args.only and not any(name.startswith(o) for o in args.only.split(",")):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(
                "configs/calculator_tiny.yaml",
                [
                    "algorithm.advantage_params={}",  # each row names its own estimator's params
                    *overrides,
                    f"trainer.total_steps={args.steps}",
                    "trainer.eval_every=0",
                    f"trainer.eval_tasks={args.eval_tasks}",
                    "logging.progress=false",
                    "logging.tensorboard=false",
                    "logging.save_trajectories=false",
                    f"run.output_dir={tmp}",
                    "run.name=bench",
                ],
            )
            t0 = time.perf_counter()
            result = train(cfg, log=lambda s: None)
            wall = time.perf_counter() - t0
        reach = next((i + 1 for i, m in enumerate(result.history) if m["success/rate"] >= 0.8), None)
        rows.append((name, result.warm_start["eval/success"], result.final["eval/success"], reach, wall))
        print(
            f"{name:55s} final {rows[-1][2]:.3f}  steps to 0.8: {reach or '-':>3}  {wall:6.1f}s", flush=True
        )
    print(f"\n{args.steps} RL steps, {args.eval_tasks} held-out tasks at T=1, warm start {rows[0][1]:.3f}:")
    if args.markdown:
        print("| estimator | held-out success | steps to 0.8 (train) | wall time |\n|---|---|---|---|")
        for name, _, final, reach, wall in rows:
            print(f"| {name} | {final:.3f} | {reach if reach else '> ' + str(args.steps)} | {wall:.0f} s |")


if __name__ == "__main__":
    main()
