"""CKPT-02 resume equivalence, CKPT-06 config change, and a run killed for real (SIGKILL, SIGINT).

2N steps straight against N steps + resume + N more: identical non-timing metrics, and
bit-identical weights, optimizer states (policy, critic), value head, adapters and TrainState.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import cli_zygote
from steprl.config import ConfigError, dump_config
from steprl.diagnostics import read_trajectories
from steprl.training.loop.resume import check_config_change
from steprl.training.loop.trainer import train
from tiny_runs import small_config

pytestmark = pytest.mark.e2e

N = 2


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _quiet(*_: object) -> None:
    pass


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _no_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_s")} for r in rows]


def _equal(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}/{i}")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


def assert_same_run(a: Path, b: Path) -> None:
    assert _no_time(_rows(a)) == _no_time(_rows(b))
    ca, cb = a / "checkpoints" / "latest", b / "checkpoints" / "latest"
    assert ca.resolve().name == cb.resolve().name
    tensors = sorted(p.name for p in ca.glob("*.safetensors"))
    assert tensors and tensors == sorted(p.name for p in cb.glob("*.safetensors"))
    for name in tensors:
        _equal(load_file(ca / name), load_file(cb / name), name)
    _equal(
        torch.load(ca / "state.pt", weights_only=False),
        torch.load(cb / "state.pt", weights_only=False),
        "state",
    )
    assert read_trajectories(a / "trajectories").equals(read_trajectories(b / "trajectories"))


MIXTURE = (
    "[{name: calculator, weight: 2}, {name: bandit, params: {reward: best}, "
    "task_params: {k: 2, pulls: 1, reveal: true}}]"
)
HEALTH_RULES = (
    "[{name: slow, when: [{signal: approx_kl, above: -1}], actions: [{lr_scale: {factor: 0.5}}],"
    " cooldown: 0, budget: 9}, {name: undo, when: [{signal: approx_kl, above: -1}], actions: [rollback],"
    " cooldown: 1, budget: 9}]"
)
#: every part of a run with state, in two runs besides the default (one run each took 11 s)
VARIANTS = {
    "default demo (grpo)": [],
    "critic, mixture, adaptive kl, curriculum": [
        # a separate critic: its weights and optimizer
        "algorithm.advantage=gae",
        "algorithm.advantage_params={}",
        "algorithm.critic=separate",
        # two run components with state: the mixture source (cursor, per-env cursors) and the
        # adaptive KL controller (its coefficient)
        f"env.mix={MIXTURE}",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_in=reward",
        "algorithm.kl_ctrl=adaptive",
        "algorithm.kl_target=0.01",
        # a horizon curriculum killed mid-stage (caps 2, 3, 4, 4), cap-cut episodes masked
        "trainer.curriculum.rounds=[2,3,4]",
        "trainer.curriculum.stage_steps=1",
        "rollout.cap_truncation=mask",
    ],
    "lora, cross-policy, difficulty pools, step reward, health": [
        "model.lora={r: 4, target_modules: [q_proj, v_proj]}",
        # the engine's older weight versions are in the checkpoint (no resume could rebuild them)
        "algorithm.policy_loss=decoupled_ppo",
        "algorithm.loss_params={}",
        "rollout.cross_policy={snapshots: 3, probs: [0.4, 0.3, 0.3]}",
        # the difficulty source's pools (tasks filed by reward, re-served after the checkpoint)
        "env.source=difficulty",
        "env.source_params={hard: 0.2, weights: {easy: 0.5}}",
        # a step-reward model with its own weights and optimizer, its weight alpha and guard streak
        "algorithm.step_reward={kind: istar, weight: 0.5}",
        # health rules that fire and act at every step: the metrics window, streaks, cooldowns,
        # budgets and levers (the lr scale), the rollback ring and the MI probe all cross the kill
        f"health.rules={HEALTH_RULES}",
        "health.mi_every=1",
        "health.mi_prompts=2",
        "health.mi_samples=2",
    ],
}


@pytest.mark.parametrize("extra", VARIANTS.values(), ids=VARIANTS.keys())
def test_ckpt02_resume_is_bit_identical(tmp_path, cache_dir, extra):
    base = [f"trainer.total_steps={2 * N}", f"trainer.eval_every={N}", *extra]
    straight = train(small_config(tmp_path, "straight", base, cache_dir=cache_dir), log=_quiet)
    first = small_config(tmp_path, "resumed", [*base, f"trainer.total_steps={N}"], cache_dir=cache_dir)
    train(first, log=_quiet)
    lines: list[str] = []
    again = small_config(tmp_path, "resumed", [*base, "run.resume=must"], cache_dir=cache_dir)
    resumed = train(again, log=lines.append)
    assert any("resumed from" in line and f"at step {N}" in line for line in lines)
    assert len(resumed.history) == N  # only the steps after the checkpoint ran again
    assert resumed.warm_start == straight.warm_start and resumed.final == straight.final
    assert_same_run(straight.run_dir, resumed.run_dir)
    if "algorithm.kl_ctrl=adaptive" in extra:  # the controller moved, and its state came back
        betas = [r["actor/reward_kl_coef"] for r in _rows(resumed.run_dir) if "actor/reward_kl_coef" in r]
        assert len(set(betas)) == 2 * N
    if "env.source=difficulty" in extra:  # tasks were served again, after the kill too
        ids = read_trajectories(resumed.run_dir / "trajectories").column("task_id").to_pylist()
        assert len(set(ids)) < len(ids) // 4, "no task was re-served from a pool"  # group_size 4
    if "trainer.curriculum.stage_steps=1" in extra:  # each step's tasks ran under its own cap
        info = read_trajectories(resumed.run_dir / "trajectories").column("info_json").to_pylist()
        assert sorted({json.loads(i)["turn_cap"] for i in info}) == [2, 3, 4]
    if "health.mi_every=1" in extra:  # both rules fired as configured, before and after the kill
        fired = [json.loads(line) for line in (resumed.run_dir / "health.jsonl").read_text().splitlines()]
        assert [(f["step"], f["rule"]) for f in fired] == [
            (1, "slow"),
            (1, "undo"),
            (2, "slow"),
            (3, "slow"),
            (3, "undo"),
            (4, "slow"),
        ]
        assert (straight.run_dir / "health.jsonl").read_text() == (
            resumed.run_dir / "health.jsonl"
        ).read_text()
        assert [r["health/lr_scale"] for r in _rows(resumed.run_dir) if r["step"]] == [
            0.5,
            0.25,
            0.125,
            0.0625,
        ]
        assert all("health/mi" in r for r in _rows(resumed.run_dir) if r["step"])
    if any("algorithm.step_reward" in e for e in extra):  # fitted each step, saved per step
        assert [r["step_reward/fits"] for r in _rows(resumed.run_dir) if r["step"]] == [0.0, 1.0, 2.0, 3.0]
        saved = read_trajectories(resumed.run_dir / "trajectories").to_pylist()
        assert saved and all(len(t["step_credit"]) == t["num_steps"] for t in saved)
        assert any(x != 0 for t in saved for x in t["step_credit"])
    if f"env.mix={MIXTURE}" in extra:  # both envs trained, and counted apart, before and after the kill
        trained = [r for r in _rows(resumed.run_dir) if "reward/mean" in r]
        assert all(any(k.startswith("env/") for k in r) for r in trained)
        assert {"env/calculator/count", "env/bandit/count"} <= {k for r in trained for k in r}


def _with_words(model):
    return model.model_copy(update={"tiny": model.tiny.model_copy(update={"words": ["tmp"]})})


def test_ckpt06_a_changed_config_is_refused_unless_allowed(tmp_path, cache_dir):
    base = ["trainer.total_steps=1", "trainer.eval_every=0"]
    train(small_config(tmp_path, "r", base, cache_dir=cache_dir), log=_quiet)
    changed = [*base, "run.resume=auto", "trainer.lr=1e-3", "trainer.total_steps=2"]
    with pytest.raises(ConfigError, match=r"trainer\.lr \(0\.003 -> 0\.001\).*run\.allow_config_change"):
        train(small_config(tmp_path, "r", changed, cache_dir=cache_dir), log=_quiet)
    lines: list[str] = []
    allowed = small_config(tmp_path, "r", [*changed, "run.allow_config_change=true"], cache_dir=cache_dir)
    result = train(allowed, log=lines.append)
    assert len(result.history) == 1 and any("resumed from" in line for line in lines)
    # a checkpoint from before a setting existed resumes, where the setting holds its default
    saved = sorted((tmp_path / "runs" / "r").glob("checkpoints/step_*/config.yaml"))[-1]
    saved.write_text(saved.read_text().replace("    words: []\n", ""))
    assert "words" not in saved.read_text()
    same = small_config(tmp_path, "r", changed, cache_dir=cache_dir)
    check_config_change(same, saved.parent)
    with pytest.raises(ConfigError, match=r"model\.tiny\.words \(None -> \['tmp'\]\)"):
        check_config_change(same.model_copy(update={"model": _with_words(same.model)}), saved.parent)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        train(
            small_config(tmp_path, "nothing-here", [*base, "run.resume=must"], cache_dir=cache_dir),
            log=_quiet,
        )


# ---- real processes: SIGKILL at a random moment, SIGINT -------------------------------------


def _launch(cfg_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", "from steprl.cli import main; main()", "train", str(cfg_path), *args]
    return cli_zygote.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.soak
def test_sigkill_at_a_random_moment_loses_no_finished_step_and_resume_is_exact(tmp_path, cache_dir):
    steps = 6
    extra = [f"trainer.total_steps={steps}", "trainer.eval_every=3", "trainer.checkpoint_every=1"]
    cfg = small_config(tmp_path, "killed", extra, cache_dir=cache_dir)
    train(
        small_config(tmp_path, "warm", ["trainer.total_steps=0"], cache_dir=cache_dir), log=_quiet
    )  # SFT cache
    cfg_path = tmp_path / "killed.yaml"
    cfg_path.write_text(dump_config(cfg))
    run_dir = tmp_path / "runs" / "killed"
    proc = _launch(cfg_path)
    _wait_for(run_dir / "checkpoints" / "step_000002" / "manifest.json", proc)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 1.5))  # anywhere: mid-step, mid-save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = sorted((run_dir / "trajectories").glob("step_*.parquet"))
    table = read_trajectories(run_dir / "trajectories")  # every finished step reads back
    assert len(finished) >= 2 and table.num_rows == 16 * len(finished)
    assert sorted(set(table.column("step").to_pylist())) == list(range(1, len(finished) + 1))

    resumed = _launch(cfg_path, "--resume", str(run_dir))
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resumed from" in out
    straight = train(small_config(tmp_path, "straight", extra, cache_dir=cache_dir), log=_quiet)
    assert_same_run(straight.run_dir, run_dir)


@pytest.mark.slow
def test_sigint_finishes_the_step_saves_and_says_how_to_resume(tmp_path, cache_dir):
    extra = ["trainer.total_steps=5", "trainer.eval_every=0"]  # checkpoint_every=0: only at the end
    cfg = small_config(tmp_path, "stopped", extra, cache_dir=cache_dir)
    train(small_config(tmp_path, "warm", ["trainer.total_steps=0"], cache_dir=cache_dir), log=_quiet)
    cfg_path = tmp_path / "stopped.yaml"
    cfg_path.write_text(dump_config(cfg))
    run_dir = tmp_path / "runs" / "stopped"
    proc = _launch(cfg_path, "--set", "trainer.lr=0.002")  # an override the config file lacks
    _wait_for(run_dir / "trajectories" / "step_000001.parquet", proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    last = out.strip().splitlines()[-1]
    step = int(last.split("at step ")[1].split(";")[0])
    assert last.startswith("interrupted (SIGINT) at step") and f"--resume {run_dir}" in last, last
    assert 1 <= step < 5 and "Traceback" not in out
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").exists()
    assert [r["step"] for r in _rows(run_dir)] == list(range(step + 1))
    # the printed command, word for word, continues the run as configured (trainer.lr=0.002 too:
    # a changed config would be refused, CKPT-06)
    command = shlex.split(last.split("resume with: ")[1])
    assert command[:2] == ["steprl", "train"], last
    resumed = cli_zygote.popen(
        [sys.executable, "-c", "from steprl.cli import main; main()", *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert [r["step"] for r in _rows(run_dir)] == list(range(6))
