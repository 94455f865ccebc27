"""Several envs in one run, from a YAML with the plain CLI, on every env backend: a two-env
mixture (configs/mixture_tiny.yaml: calculator and bandit, weights 2:1) trains, its SFT warm
start plays demonstrations of both envs, and its metrics break down by env (`env/<env>/...`,
`eval/env/<env>/...`). The backends come from `BACKENDS`, so a new one is covered."""

from __future__ import annotations

import json

import pytest

from cli_runs import ROOT, TINY_SCRATCH, run_steprl
from steprl.diagnostics import read_trajectories
from steprl.hosting.backend import BACKENDS

pytestmark = pytest.mark.e2e

SMALL_SFT = (  # the warm start made small; shared by the backends (runtime is not in its key)
    "model.init=sft",
    "model.sft.num_episodes=12",
    "model.sft.skill_steps=2",
    "model.sft.steps=1",
    "model.sft.batch_size=16",
)
PER_BACKEND = {"ray": ("runtime.env_workers=1", "runtime.rollout_workers=1")}


# Ray (a rollout worker and env actor started for one 2-step run, 36 s of the suite): `make soak`;
# each backend's conformance and same-seed metrics run in `make test` (tests/hosting/)
@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.soak) if b == "ray" else b for b in sorted(BACKENDS)]
)
def test_a_two_env_mixture_trains_from_yaml_on_each_backend(tmp_path, backend):
    settings = [
        *TINY_SCRATCH,
        *SMALL_SFT,
        "rollout.tasks_per_step=6",
        "trainer.total_steps=2",
        f"runtime.backend={backend}",
        *PER_BACKEND.get(backend, ()),
        f"run.output_dir={tmp_path}",
    ]
    rc, out = run_steprl(
        ["train", "configs/mixture_tiny.yaml", *[x for s in settings for x in ("--set", s)]], ROOT
    )
    assert rc == 0, out
    assert "calculator (weight 2), bandit (weight 1)" in out
    run_dir = tmp_path / "mixture_tiny"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == 2
    seen = {k for r in trained for k in r}
    assert {"env/calculator/count", "env/bandit/tool_call_rate"} <= seen, sorted(seen)
    assert rows[0]["eval/env/calculator/count"] == rows[0]["eval/env/bandit/count"] == 2.0  # per env
    episodes = read_trajectories(run_dir / "trajectories")
    assert set(episodes.column("env").to_pylist()) == {"calculator", "bandit"}
    assert (run_dir / "checkpoints" / "latest").exists()
