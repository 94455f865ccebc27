"""Cross-policy sampling (issue 26, item 4) against none: pass@8 on held-out calculator tasks.

Both arms train the tiny model from the same SFT warm start with the same loss (decoupled PPO)
and the same seeds; the cross-policy arm samples each turn from one of the 3 latest policy
versions (`rollout.cross_policy: {snapshots: 3, probs: [0.5, 0.3, 0.2]}`). After training, each
held-out task gets 8 episodes at temperature 1 on the final weights: pass@8 is the share of
tasks solved at least once (pass@1: the mean success). Also printed: the mean share of tokens
per lag and the mean behaviour ratio pi_current / pi_snapshot per lag, over training.

    .venv/bin/python benchmarks/steering_cross_policy.py [--seeds 0,1,2] [--steps 10] [--tasks 64]

Sized for a few minutes on a shared 2-core CPU (tiny model, small batches): a small-sample
comparison, not a finding at scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer

from steprl.config import Config, load_config
from steprl.diagnostics.metrics import is_success
from steprl.engines.base import SamplingParams
from steprl.rollout import seeds
from steprl.rollout.loop import rollout_groups
from steprl.training.learn.checkpoint import load_checkpoint_model
from steprl.training.loop.trainer import train
from steprl.training.setup import env_setup
from steprl.training.setup.build import eval_tasks, rollout_setup
from steprl.training.setup.rollout_parts import engine_for

LR = 1e-4  # the demo's (1e-3 collapsed both arms below the warm start in a trial)
ARMS = {
    "none": ["rollout.cross_policy=null"],
    "K=3": ["rollout.cross_policy={snapshots: 3, probs: [0.5, 0.3, 0.2]}"],
}


def config(tmp: str, arm: str, seed: int, steps: int, warm: Sequence[str] = ()) -> Config:
    return load_config(
        "configs/calculator_cross_policy.yaml",
        [
            f"run.output_dir={tmp}",
            f"run.name={arm.replace('=', '')}-{seed}",
            f"run.seed={seed}",
            "rollout.tasks_per_step=8",
            "rollout.group_size=6",
            "rollout.max_turns=4",
            "rollout.max_tokens_per_turn=32",
            f"trainer.total_steps={steps}",
            f"trainer.eval_every={steps}",
            "trainer.eval_tasks=8",
            f"trainer.lr={LR}",
            "trainer.mini_batches=2",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.save_trajectories=false",
            *ARMS.get(arm, ARMS["none"]),
            *warm,
        ],
    )


def warm_start(tmp: str) -> tuple[list[str], Path]:
    """Seed 0's SFT warm start (made once, cached in $STEPRL_CACHE) as overrides that load it,
    so the seeds differ in RL only; and its checkpoint, for the no-RL baseline."""
    result = train(config(tmp, "warm", 0, 0), log=lambda *_: None)
    root = Path(os.environ.get("STEPRL_CACHE") or Path.home() / ".cache" / "steprl")
    made = max(root.glob("tiny-calculator-*"), key=lambda p: p.stat().st_mtime)
    overrides = [f"model.name={made}", "model.init=pretrained", "rollout.system_prompt=none"]
    return overrides, result.run_dir / "checkpoints" / "latest"


def pass_at_8(cfg: Config, checkpoint: Path, n_tasks: int) -> tuple[float, float]:
    """(pass@8, pass@1) of the checkpoint's weights on the first `n_tasks` held-out tasks."""
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"cross_policy": None})})
    model = load_checkpoint_model(checkpoint, dtype=torch.float32)
    engine = engine_for(cfg, model, AutoTokenizer.from_pretrained(checkpoint))
    fmt = env_setup.prompt_format(cfg, AutoTokenizer.from_pretrained(checkpoint))
    with env_setup.env_pool(cfg) as envs:
        setup = rollout_setup(cfg, engine, fmt, envs, SamplingParams(temperature=1.0))
        tasks = eval_tasks(cfg, env_setup.run_envs(cfg), n_tasks)
        groups = asyncio.run(rollout_groups(tasks, 8, setup, seed=seeds.eval_stream_seed(cfg.run.seed)))
    solved = [[is_success(t) for t in g.trajectories] for g in groups]
    return sum(any(s) for s in solved) / len(solved), sum(map(sum, solved)) / (8 * len(solved))


def lag_stats(run_dir: Path) -> dict[str, float]:
    """Mean over training steps of each cross_policy/* metric."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = sorted({k for r in rows for k in r if k.startswith("cross_policy/")})
    return {k: statistics.mean(r[k] for r in rows if k in r) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tasks", type=int, default=64)  # held-out tasks, 8 episodes each
    args = ap.parse_args()
    torch.set_num_threads(2)
    results: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
    lags: dict[str, float] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        overrides, warm_ckpt = warm_start(tmp)
        warm = pass_at_8(config(tmp, "warm", 0, 0), warm_ckpt, args.tasks)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in ARMS:
                t0 = time.perf_counter()
                cfg = config(tmp, arm, seed, args.steps, overrides)
                result = train(cfg, log=lambda *_: None)
                p8, p1 = pass_at_8(cfg, result.run_dir / "checkpoints" / "latest", args.tasks)
                results[arm].append((p8, p1, time.perf_counter() - t0))
                if arm == "K=3":
                    for k, v in lag_stats(result.run_dir).items():
                        lags[k] = lags.get(k, 0.0) + v / len(args.seeds.split(","))
                print(
                    f"seed {seed} {arm:5s} pass@8 {p8:.3f} pass@1 {p1:.3f} ({time.perf_counter() - t0:.0f}s)"
                )
    print(
        f"\nheld-out: {args.tasks} calculator tasks x 8 episodes, T=1; {args.steps} RL steps of 8x6 episodes"
    )
    print(f"warm start (seed 0's SFT, no RL): pass@8 {warm[0]:.3f}  pass@1 {warm[1]:.3f}")
    print(f"{'arm':6s} {'pass@8 mean ± sd':>18s} {'pass@1 mean ± sd':>18s}  per seed (pass@8)")
    for arm, rs in results.items():
        p8 = [r[0] for r in rs]
        p1 = [r[1] for r in rs]
        sd8 = statistics.stdev(p8) if len(p8) > 1 else 0.0
        sd1 = statistics.stdev(p1) if len(p1) > 1 else 0.0
        print(
            f"{arm:6s} {statistics.mean(p8):10.3f} ± {sd8:.3f} {statistics.mean(p1):10.3f} ± {sd1:.3f}  "
            + " ".join(f"{x:.3f}" for x in p8)
        )
    print("\nK=3, mean over steps and seeds:")
    for k, v in lags.items():
        print(f"  {k:32s} {v:.3f}")
    print(f"\nwall: {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
