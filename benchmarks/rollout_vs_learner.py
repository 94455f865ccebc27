"""Throughput of the default run: rollout tokens/s, learner tokens/s, seconds per RL step and
the share of time in rollout vs learning. A script that prints numbers, not a timed test.

    .venv/bin/python benchmarks/rollout_vs_learner.py [--steps 8] [--set key=value ...]

Uses the default demo config (and its cached SFT warm start, built on first use).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from steprl.config import load_config
from steprl.training.loop.trainer import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/calculator_tiny.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            args.config,
            [
                f"trainer.total_steps={args.steps}",
                "trainer.eval_every=0",
                "trainer.eval_tasks=1",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.save_trajectories=false",
                f"run.output_dir={tmp}",
                "run.name=bench",
                *args.overrides,
            ],
        )
        result = train(cfg, log=lambda s: None)
    rows = result.history[1:] or result.history  # the first step pays one-off warm-up costs
    t_roll = [m["time/rollout_s"] for m in rows]
    t_learn = [m["time/learn_s"] for m in rows]
    t_step = [m["time/step_s"] for m in rows]
    gen_tok = [m["tokens/action"] for m in rows]
    learn_tok = [m["tokens/trained_positions"] for m in rows]
    med = statistics.median
    per_step = cfg.derived()["trajectories_per_step"]
    rows_out = [
        ("rollout tokens/s (sampled actions)", med(g / t for g, t in zip(gen_tok, t_roll, strict=True))),
        ("learner tokens/s (fwd+bwd)", med(n / t for n, t in zip(learn_tok, t_learn, strict=True))),
        ("seconds per RL step", med(t_step)),
        ("share of step in rollout", med(r / s for r, s in zip(t_roll, t_step, strict=True))),
        ("share of step in learning", med(v / s for v, s in zip(t_learn, t_step, strict=True))),
    ]
    print(f"default run, {len(rows)} measured steps ({per_step} trajectories each); medians:")
    for label, value in rows_out:
        if label.startswith("share"):
            shown = f"{value:.1%}"
        else:
            shown = f"{value:.3f}" if value < 100 else f"{value:.0f}"
        print(f"  {label:42s} {shown:>10s}")


if __name__ == "__main__":
    main()
