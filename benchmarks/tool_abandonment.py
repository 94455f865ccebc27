"""Issue 44 item 13: does any default action of `tool_abandonment` change the outcome?

    python benchmarks/tool_abandonment.py [--jobs 2] [--only warehouse] [--arms alert entropy]
    python benchmarks/tool_abandonment.py --report-only

Two envs where RL drops the tool after a weak warm start (the new-user trial's):
* `warehouse` (benchmarks/user_envs/warehouse.py, a user's env loaded with --plugin): look up
  two hidden stock quantities, answer their sum; the trial's warm start (250 + 60 SFT steps);
* `guess` (configs/health_guess.yaml): find a secret in 1..8 with a probe tool.

Each runs 40 GRPO steps from one shared warm start per env (the seeds vary RL only), seeds 0,
1, 2, under each arm: the default rules with `tool_abandonment`'s actions replaced by
* `alert`: today's default (an ALERT line, nothing changes);
* `entropy`: alert + an entropy bonus of 0.01 (keep the tool-using branch sampled);
* `rollback`: alert + undo 2 steps (the in-memory ring) + halve the learning rate.
The firing condition (`tool_call_fall` > 0.3) is the same in every arm, so the healthy
controls' 0 firings (docs/health_results.md) hold for each. Printed: warm start and final
held-out success and tool-call rate per run, firings, and per arm the mean change with its
spread over seeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from steprl.health.rules import DEFAULT_RULES  # noqa: E402

OUT = ROOT / "runs" / "tool_abandonment"
STEPRL = str(Path(sys.executable).parent / "steprl")
SEEDS = (0, 1, 2)
PLUGIN_PATH = str(ROOT / "benchmarks" / "user_envs")
ENVS = {"warehouse": "benchmarks/user_envs/warehouse.yaml", "guess": "configs/health_guess.yaml"}
ARMS: dict[str, list[object]] = {
    "alert": ["alert"],
    "entropy": ["alert", {"entropy_bonus": {"coef": 0.01}}],
    "rollback": ["alert", {"rollback": {"k": 2}}, {"lr_scale": {"factor": 0.5}}],
}
STEPS = 40


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (PLUGIN_PATH, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _plugin(env: str) -> list[str]:
    return ["--plugin", "warehouse"] if env == "warehouse" else []


def warm_start(env: str) -> str:
    """The cache directory of the env's SFT warm start (built once by `steprl sft`)."""
    cmd = [STEPRL, "sft", ENVS[env], *_plugin(env)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), check=True).stdout
    for line in out.splitlines():
        if line.startswith("policy: "):
            return line.rsplit("(", 1)[-1].rstrip(")").split()[-1]
    raise RuntimeError(f"steprl sft printed no policy line:\n{out[-2000:]}")


def config_for(env: str, arm: str) -> Path:
    """The env's config with the default rules, `tool_abandonment` doing the arm's actions."""
    cfg = yaml.safe_load((ROOT / ENVS[env]).read_text())
    rules = copy.deepcopy(DEFAULT_RULES)
    for rule in rules:
        if rule["name"] == "tool_abandonment":
            rule["actions"] = ARMS[arm]
    cfg["health"] = {"rules": rules}
    cfg.setdefault("logging", {}).update({"tensorboard": False, "progress": False})
    path = OUT / "configs" / f"{env}_{arm}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(env: str, arm: str, seed: int, warm: str, steps: int = STEPS) -> None:
    name = f"{env}_{arm}_s{seed}"
    sets = [
        f"run.name={name}", f"run.output_dir={OUT}", f"run.seed={seed}", f"trainer.total_steps={steps}",
        f"model.name={warm}", "model.init=pretrained", "rollout.system_prompt=none",
        "trainer.eval_every=8", "trainer.eval_tasks=64",
    ]  # fmt: skip
    cmd = [
        STEPRL,
        "train",
        str(config_for(env, arm)),
        *_plugin(env),
        *(a for s in sets for a in ("--set", s)),
    ]
    t0 = time.perf_counter()
    with open(OUT / f"{name}.log", "w") as log:
        rc = subprocess.run(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout=1800
        ).returncode
    print(f"  {name}: rc {rc}, {time.perf_counter() - t0:.0f}s", flush=True)


def _read(name: str) -> dict[str, object] | None:
    metrics = OUT / name / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("eval/success") is not None]
    calls = [r["tools/call_rate"] for r in rows if r.get("tools/call_rate") is not None]
    health = OUT / name / "health.jsonl"
    fired = [json.loads(x) for x in health.read_text().splitlines() if x.strip()] if health.exists() else []
    if len(evals) < 2:
        return None
    return {
        "warm": evals[0]["eval/success"], "final": evals[-1]["eval/success"],
        "final_step": evals[-1]["step"], "warm_calls": evals[0].get("eval/tool_call_rate"),
        "final_calls": evals[-1].get("eval/tool_call_rate"),
        "train_calls": (calls[0], calls[-1]) if calls else None,
        "firings": [f"{f.get('step')} {f.get('rule')}" for f in fired if f.get("rule") == "tool_abandonment"],
        "curve": [(r["step"], round(r["eval/success"], 3)) for r in evals],
    }  # fmt: skip


def report(envs: list[str], arms: list[str]) -> None:
    for env in envs:
        print(f"\n## {env}")
        print("| arm | seed | warm start (success / tool calls) | final | change | firings |")
        print("|---|---|---|---|---|---|")
        for arm in arms:
            changes = []
            for seed in SEEDS:
                r = _read(f"{env}_{arm}_s{seed}")
                if r is None:
                    print(f"| {arm} | {seed} | (no run) | | | |")
                    continue
                d = float(r["final"]) - float(r["warm"])  # type: ignore[arg-type]
                changes.append(d)
                fired = ", ".join(r["firings"]) or "-"  # type: ignore[arg-type]
                print(
                    f"| {arm} | {seed} | {r['warm']:.3f} / {r['warm_calls']:.2f} | {r['final']:.3f} / "
                    f"{r['final_calls']:.2f} (step {r['final_step']}) | {d:+.3f} | {fired} |"
                )
            if changes:
                sd = statistics.stdev(changes) if len(changes) > 1 else 0.0
                print(f"| **{arm}** | mean | | | **{statistics.mean(changes):+.3f}** (sd {sd:.3f}) | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=list(ENVS))
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        OUT.mkdir(parents=True, exist_ok=True)
        warm = {env: warm_start(env) for env in args.only}
        print("warm starts:", warm, flush=True)
        jobs = [(e, a, s) for s in SEEDS for e in args.only for a in args.arms]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda j: run(*j, warm[j[0]], args.steps), jobs))
    report(args.only, args.arms)


if __name__ == "__main__":
    main()
