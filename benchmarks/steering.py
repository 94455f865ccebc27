"""Issue 26's experiments, one command: every table that shows whether steering what a run trains
on matters, 3 seeds each, tiny model, CPU. Each part is its own script (run one alone with its
flags); this runs them in turn and prints their tables. About 40 minutes on 2 free cores, plus a
warm start per part the first time (cached after).

1. `steering_horizon.py`: ScalingInter in miniature: the corridor env, stepwise and gated turn-cap
   curricula [2, 4, 6] against fixed caps 6 and 2, held-out success at cap 6 vs environment steps.
2. `steering_mixture.py`: (a) three bandits with rewards x1, x10, x0.1, each env's share of the
   gradient and held-out score without and with per-env task normalisation; (b) learning-progress
   weights against fixed equal weights, environment steps to a mean success threshold.
3. `steering_cross_policy.py`: cross-policy sampling with K = 3 against none: pass@8 and pass@1
   on held-out tasks, and the ratio statistics per policy lag.
4. `eviction_bias.py`: asynchronous eviction's bias against long episodes, `requeue` against
   `age_priority` (a simulation: no model).

The results, with the curves, are in docs/curriculum.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = {
    "horizon": ["steering_horizon.py"],
    "normalisation": ["steering_mixture.py", "--only", "norm", "--steps", "30"],
    "learning_progress": ["steering_mixture.py", "--only", "lp", "--steps", "80", "--threshold", "0.7"],
    "cross_policy": ["steering_cross_policy.py"],
    "eviction": ["eviction_bias.py"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(PARTS), action="append", help="run these parts (default: all)")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    for name in args.only or PARTS:
        script, *flags = PARTS[name]
        if name != "eviction":
            flags += ["--seeds", args.seeds]
        print(f"\n===== {name}: {script} {' '.join(flags)}", flush=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, str(HERE / script), *flags], check=False)
        print(f"===== {name}: exit {done.returncode}, {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
