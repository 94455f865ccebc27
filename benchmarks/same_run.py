"""Same seed, two source trees: does a refactor change any number? (issue 45's check)

Trains the default demo made small (4 steps, evaluations at 0, 2 and 4 on 32 tasks) and
variants that switch on every stateful part, once with each tree's `src/`, then compares every
metric of metrics.jsonl (timings aside) and the final checkpoint's safetensors bytes.

    git worktree add /tmp/before HEAD~3        # the tree to compare against
    python benchmarks/same_run.py --before /tmp/before/src --after src [--only default]

Prints one line per variant: values compared, how many differ (the first few shown), and
whether the safetensors are identical. Exit 1 if anything differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "trainer.total_steps=4",
    "trainer.eval_every=2",
    "trainer.eval_tasks=32",
    "trainer.checkpoint_every=4",
]
ROLLBACK = (
    "health.rules=[{name: rb, when: [{signal: approx_kl, above: -1}], steps: 1, cooldown: 2,"
    " actions: [rollback]}]"
)
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "reward_kl_empg_mi": [
        "algorithm.kl_coef=0.05",
        "algorithm.kl_in=reward",
        "algorithm.empg={k: 1.0, k_f: 1.0, zeta: 0.1}",
        "health.mi_every=1",
    ],
    "loss_kl_shared_critic_rollback": [
        "algorithm.kl_coef=0.05",
        "algorithm.critic=shared",
        "algorithm.advantage=gae",
        "algorithm.advantage_params={gamma: 1.0, lam: 1.0}",
        ROLLBACK,
    ],
    "lora": ["model.lora={r: 4, alpha: 8}", "algorithm.kl_coef=0.05"],
    "decoupled_ppo_mi": [
        "health.mi_every=1",
        "algorithm.policy_loss=decoupled_ppo",
        "trainer.mini_batches=4",
    ],
    "separate_critic": [
        "algorithm.critic=separate",
        "algorithm.advantage=gae",
        "algorithm.advantage_params={gamma: 1.0, lam: 1.0}",
        "algorithm.kl_coef=0.05",
        "trainer.mini_batches=2",
    ],
    # every pass the learner makes over one step's rows: cross-policy ratios, the proximal and
    # reference passes, two epochs of two mini-batches, packed rows
    "epochs_cross_policy_loss_kl": [
        "rollout.cross_policy={snapshots: 3, probs: [0.4, 0.3, 0.3]}",
        "algorithm.policy_loss=decoupled_ppo",
        "algorithm.kl_coef=0.05",
        "trainer.epochs=2",
        "trainer.mini_batches=2",
    ],
}


def train(src: Path, out: Path, name: str, sets: list[str]) -> None:
    args = [
        sys.executable,
        "-c",
        "from steprl.cli import main; main()",
        "train",
        "configs/calculator_tiny.yaml",
    ]
    for s in [*SMALL, f"run.output_dir={out}", f"run.name={name}", *sets]:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"{name} with {src}: exit {done.returncode}: {done.stdout[-400:]}{done.stderr[-400:]}"
        )


def compare(before: Path, after: Path) -> tuple[int, list[tuple[int, str, object, object]], bool]:
    rows_b = [json.loads(x) for x in (before / "metrics.jsonl").read_text().splitlines()]
    rows_a = [json.loads(x) for x in (after / "metrics.jsonl").read_text().splitlines()]
    n, diffs = 0, []
    for rb, ra in zip(rows_b, rows_a, strict=True):
        for k in sorted(set(rb) | set(ra)):
            if k.startswith("time/") or k.endswith("_s"):
                continue
            n += 1
            if rb.get(k) != ra.get(k):
                diffs.append((rb["step"], k, rb.get(k), ra.get(k)))

    def digest(run: Path) -> list[str]:
        files = sorted((run / "checkpoints" / "latest").glob("*.safetensors"))
        return [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]

    same = bool(digest(before)) and digest(before) == digest(after)
    return n, diffs, same


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="a src/ directory (the old tree's)")
    parser.add_argument(
        "--after", type=Path, default=ROOT / "src", help="a src/ directory (default: this one)"
    )
    parser.add_argument(
        "--only", action="append", choices=sorted(VARIANTS), help="only this variant (repeatable)"
    )
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory(prefix="steprl-same-run-") as tmp:
        for name in args.only or list(VARIANTS):
            for side, src in (("before", args.before), ("after", args.after)):
                train(src, Path(tmp) / side, name, VARIANTS[name])
            n, diffs, same = compare(Path(tmp) / "before" / name, Path(tmp) / "after" / name)
            failed |= bool(diffs) or not same
            verdict = "identical" if same else "DIFFER"
            print(f"{name}: {n} values compared, {len(diffs)} differ; safetensors {verdict}")
            for d in diffs[:5]:
                print(f"    step {d[0]} {d[1]}: {d[2]} -> {d[3]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
