"""Issue 27's alarm-quality benchmark: induced collapses and healthy controls, with the health
rules observing or acting; prints the table `docs/health_results.md` records.

    python benchmarks/health.py                 # everything (hours on 2 cores; --jobs runs in parallel)
    python benchmarks/health.py --only phrase   # one recipe or control
    python benchmarks/health.py --report-only   # re-read runs/health_bench/* and print / plot

Runs (each `steprl train` in its own process, in the small shape below):

* the collapse recipes (configs/health_{lr20,phrase,flat,guess}.yaml), seeds 0, 1, 2, with the
  default rules observing (`health.act=false`: they fire and are recorded, nothing is done), the
  phrase recipe with RAGEN-2's MI probe every 4 steps (`health.mi_every=4`);
* the same recipes once more with the default rules acting (seeds 0, 1, 2);
* three healthy controls, seeds 0, 1, 2, rules on: the default demo, the demo at twice its
  learning rate, and the demo with Dr. GRPO's advantage (no std division). (The bandit and
  FrozenLake were planned; their SFT warm starts took too long on a shared 2-core machine.)
* the default demo with `health: off` (seed 0): the rules' cost on a healthy run.

One warm start per env, shared by every seed (`model.name=<its cache dir>`,
`model.init=pretrained`): the seeds vary RL only. The calculator recipes (lr x20, phrase,
flat) all start from the default demo's warm start: the same policy, another reward.

What is measured (`benchmarks/health_analysis.py`): held-out success every `EVAL_EVERY` steps
on `EVAL_TASKS` tasks; the noise margin is 2 binomial stds at the warm start's success; the
collapse step is the first evaluation below (pre-collapse level - margin), the pre-collapse
level being the best evaluation before it (the warm start's included); the alarm is the first
health.jsonl record; the lead is collapse step - alarm step (the issue asks >= 5).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import health_analysis  # noqa: E402  (the sibling module: tables and curves)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "health_bench"
SEEDS = (0, 1, 2)
STEPRL = str(Path(sys.executable).parent / "steprl")  # the venv's command
EVAL_EVERY, EVAL_TASKS = 4, 64
RUN_TIMEOUT_S = 900  # a run still going after this is killed and reported (rc -1)
#: the small shape every run gets (a tiny-model step takes ~1-3 s on a quiet core)
SHAPE = (
    "rollout.tasks_per_step=8",
    "rollout.group_size=8",
    f"trainer.eval_every={EVAL_EVERY}",
    f"trainer.eval_tasks={EVAL_TASKS}",
    "trainer.checkpoint_every=4",  # a stop names the last good checkpoint
)


@dataclass(frozen=True)
class Recipe:
    """One run family: its config, the config whose warm start it shares, its steps."""

    config: str
    warm_config: str
    steps: int
    collapse: bool  # a collapse recipe (else a healthy control)
    extra: tuple[str, ...] = field(default=())  # more --set overrides


RECIPES: dict[str, Recipe] = {
    "lr20": Recipe("configs/health_lr20.yaml", "configs/calculator_tiny.yaml", 16, True),
    "phrase": Recipe("configs/health_phrase.yaml", "configs/calculator_tiny.yaml", 40, True),
    "flat": Recipe("configs/health_flat.yaml", "configs/calculator_tiny.yaml", 24, True),
    "guess": Recipe("configs/health_guess.yaml", "configs/health_guess.yaml", 40, True),
    "demo": Recipe("configs/calculator_tiny.yaml", "configs/calculator_tiny.yaml", 32, False),
    # the demo at twice its learning rate: healthy, faster-moving (a harder test of false alarms)
    "demo_lr2": Recipe(
        "configs/calculator_tiny.yaml", "configs/calculator_tiny.yaml", 32, False, ("trainer.lr=2e-4",)
    ),
    # the demo with Dr. GRPO's advantage (no division by the group's std)
    "demo_drgrpo": Recipe(
        "configs/calculator_tiny.yaml",
        "configs/calculator_tiny.yaml",
        32,
        False,
        ("algorithm.advantage_params={scale_by_std: false}",),
    ),
}


@dataclass(frozen=True)
class Job:
    recipe: str
    seed: int
    mode: str  # observe | act | on (controls: rules acting) | off (health: off)

    @property
    def name(self) -> str:
        return f"{self.recipe}_{self.mode}_s{self.seed}"


def plan(only: set[str] | None, *, observe_controls: bool = False) -> list[Job]:
    """Every run of the benchmark (see the module docstring): seed 0 of everything first (the
    observing collapse runs, the controls, the acting runs, the cost run), then seeds 1 and 2
    (observing, controls, acting).
    `observe_controls`: the controls observe too (a control on which no rule fires is the same
    run either way, and its logged metrics can be replayed under other rules)."""
    control = "observe" if observe_controls else "on"
    names = [n for n in RECIPES if not only or n in only]
    jobs = [Job(n, 0, "observe" if RECIPES[n].collapse else control) for n in names]
    jobs += [Job(n, 0, "act") for n in names if RECIPES[n].collapse]
    jobs += [Job("demo", 0, "off")] if "demo" in names else []
    for seed in SEEDS[1:]:
        jobs += [Job(n, seed, "observe" if RECIPES[n].collapse else control) for n in names]
        jobs += [Job(n, seed, "act") for n in names if RECIPES[n].collapse]
    return jobs


_POLICY = re.compile(r"^policy: .*?(/\S+?)\)?$", re.MULTILINE)


def warm_start(config: str) -> str:
    """The cache directory of `config`'s SFT warm start (built once: `steprl sft`)."""
    out = subprocess.run([STEPRL, "sft", config], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    m = _POLICY.search(out)
    if m is None:
        raise RuntimeError(f"steprl sft {config} printed no 'policy: <dir>' line:\n{out[-2000:]}")
    return m.group(1)  # "cached SFT (<dir>)" or "fresh SFT (cached to <dir>)"


def command(job: Job, warm_dir: str) -> list[str]:
    r = RECIPES[job.recipe]
    health = {
        "observe": ["health.act=false"] + (["health.mi_every=4"] if job.recipe == "phrase" else []),
        "act": ["health.mi_every=4"] if job.recipe == "phrase" else [],
        "on": [],
        "off": ["health=off"],
    }[job.mode]
    sets = [
        *SHAPE,
        f"trainer.total_steps={r.steps}",
        f"run.seed={job.seed}",
        f"run.name={job.name}",
        f"run.output_dir={OUT}",
        f"model.name={warm_dir}",
        "model.init=pretrained",
        "rollout.system_prompt=none",  # as the tiny model was warm-started (auto: none for "tiny" only)
        *r.extra,
        *health,
    ]
    return [STEPRL, "train", r.config, *(a for s in sets for a in ("--set", s))]


def run_job(job: Job, warm_dir: str) -> float:
    """Train one run (its log beside it); returns its wall time in seconds."""
    OUT.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # parallel jobs share the cores
    t0 = time.perf_counter()
    with open(OUT / f"{job.name}.log", "w") as log:
        try:
            rc = subprocess.run(
                command(job, warm_dir),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=RUN_TIMEOUT_S,
            ).returncode
        except subprocess.TimeoutExpired:  # killed: a run that hangs is a result too (its log says where)
            rc = -1
    wall = time.perf_counter() - t0
    (OUT / f"{job.name}.wall").write_text(f"{wall:.1f} {rc}\n")
    print(f"  {job.name}: rc {rc}, {wall:.0f}s", flush=True)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help=f"recipes / controls to run, of {sorted(RECIPES)}")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each on one thread)")
    ap.add_argument("--report-only", action="store_true", help="only read the runs already made")
    ap.add_argument("--skip-done", action="store_true", help="skip runs whose .wall file exists")
    ap.add_argument("--runs", nargs="*", help="only these runs, by name (e.g. phrase_observe_s0)")
    ap.add_argument("--observe-controls", action="store_true", help="the controls observe (health.act=false)")
    args = ap.parse_args()
    jobs = plan(set(args.only) if args.only else None, observe_controls=args.observe_controls)
    jobs = [j for j in jobs if not args.runs or j.name in args.runs]
    if not args.report_only:
        warm = {c: warm_start(c) for c in sorted({RECIPES[j.recipe].warm_config for j in jobs})}
        for c, d in warm.items():
            print(f"warm start of {c}: {d}")
        todo = [j for j in jobs if not (args.skip_done and (OUT / f"{j.name}.wall").exists())]
        print(f"{len(todo)} runs, {args.jobs} at a time, seeds {SEEDS} (RL only: one warm start per env)")
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda j: run_job(j, warm[RECIPES[j.recipe].warm_config]), todo))
    health_analysis.report(OUT, RECIPES, SEEDS, eval_tasks=EVAL_TASKS)


if __name__ == "__main__":
    main()
