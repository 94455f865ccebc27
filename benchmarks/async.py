"""Asynchronous training against synchronous, on an env with long-tailed latency.

The default demo (the tiny policy learns the calculator tool) on `calculator_slow`: every env
reply comes after a seeded lognormal delay (an asynchronous sleep, so 2 cores run hundreds of
episodes at once; `envs/library/latency.py`). Each run trains the same number of samples
(steps x tasks_per_step x group_size) from the same SFT warm start and seed.

    python benchmarks/async.py                 # in-process k = 0, 1, 2, 4; decoupled PPO at 4; Ray 0, 4
    python benchmarks/async.py --steps 6 --staleness 0 4 --ray-staleness

The demo's loss is `ppo_clip`: with stale samples that is naive PPO (behaviour log-probs as the
old policy); the `decoupled_ppo` run at the top staleness is AReaL's objective, for the
comparison of the two at staleness 4.

Per run it prints the wall-clock time of the RL steps (`time/step_s` summed: rollouts waited
for, learning, publishing), the speed-up over staleness 0 of the same mode, the learner's and
the producer's idle shares, the trajectory staleness histogram, evictions, and the final
held-out success (200 tasks). Runs go one after another in this process: run it on a quiet
machine. docs/async.md has the measured numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from steprl.config import load_config  # noqa: E402
from steprl.training.loop.trainer import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: every reply's delay: median 0.3 s, mean 0.9 s, p99 ~10 s capped at 8 s (the SFT warm start is
#: cached per env config, so changing this costs one SFT run)
LATENCY = "{median_s: 0.3, sigma: 1.5, max_s: 8.0}"


def overrides(out: Path, name: str, steps: int, k: int, extra: list[str]) -> list[str]:
    return [
        f"run.output_dir={out}",
        f"run.name={name}",
        "run.overwrite=true",
        f"model.cache_dir={ROOT / '.cache' / 'models'}",
        "env.name=calculator_slow",
        f"env.params={LATENCY}",
        f"rollout.max_staleness={k}",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=0",  # the final evaluation only
        "trainer.checkpoint_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.save_trajectories=false",
        *extra,
    ]


def run(out: Path, name: str, steps: int, k: int, extra: list[str]) -> dict[str, object]:
    cfg = load_config(str(ROOT / "configs/calculator_tiny.yaml"), overrides(out, name, steps, k, extra))
    t0 = time.perf_counter()
    result = train(cfg, log=lambda s: None)
    h = result.history
    return {
        "name": name,
        "k": k,
        "rl_s": sum(m["time/step_s"] for m in h),
        "total_s": time.perf_counter() - t0,
        "learner_idle": statistics.mean(m["time/learner_idle_share"] for m in h),
        "producer_idle": statistics.mean(m["time/producer_idle_share"] for m in h),
        "hist": [statistics.mean(m.get(f"staleness/traj_{s}", 0.0) for m in h) for s in range(k + 1)],
        "token_mean": statistics.mean(m["staleness/token_mean"] for m in h),
        "spanned_max": max(m["async/versions_spanned_max"] for m in h),
        "evicted": sum(m["async/evicted_groups"] for m in h),
        "success": result.final["eval/success"],
        "warm": result.warm_start["eval/success"],
        "curve": [m["reward/mean"] for m in h],
    }


def report(rows: list[dict[str, object]]) -> None:
    base = {r["mode"]: r["rl_s"] for r in rows if r["k"] == 0}
    print(
        f"{'run':<28} {'RL s':>7} {'speed-up':>8} {'learner idle':>12} {'producer idle':>13} "
        f"{'evicted':>7} {'success':>7}  staleness histogram (trajectories, 0..k)"
    )
    for r in rows:
        ref = base.get(r["mode"])
        speed = f"{ref / r['rl_s']:.2f}x" if ref else "-"  # type: ignore[operator]
        hist = " ".join(f"{x:.2f}" for x in r["hist"])  # type: ignore[attr-defined]
        print(
            f"{r['name']:<28} {r['rl_s']:7.1f} {speed:>8} {r['learner_idle']:12.2f} "
            f"{r['producer_idle']:13.2f} {r['evicted']:7.0f} {r['success']:7.3f}  [{hist}]"
        )


DECOUPLED = ["algorithm.policy_loss=decoupled_ppo", "algorithm.loss_params={behav_cap: 5.0}"]
RAY = ["runtime.backend=ray", "runtime.rollout_workers=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--ray-staleness", type=int, nargs="*", default=[0, 4])
    args = ap.parse_args()
    # the demo's loss is ppo_clip: at k > 0 that is naive PPO (the behaviour policy as the old one)
    plan = [("in-process", f"ppo_clip k={k}", k, []) for k in args.staleness]
    top = max(args.staleness)
    if top:
        plan.append(("in-process", f"decoupled_ppo k={top}", top, DECOUPLED))
    plan += [("ray", f"ray ppo_clip k={k}", k, RAY) for k in args.ray_staleness]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, name, k, extra in plan:
            r = {**run(Path(tmp), name.replace(" ", "_").replace("=", ""), args.steps, k, extra)}
            rows.append({**r, "mode": mode, "name": name})
            curve = " ".join(f"{x:.2f}" for x in r["curve"])  # type: ignore[attr-defined]
            print(
                f"  {name}: {r['rl_s']:.1f} s, success {r['success']:.3f}; reward per step {curve}",
                flush=True,
            )
    report(rows)


if __name__ == "__main__":
    main()
