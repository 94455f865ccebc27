"""A tiny end-to-end run: parameters change, the run directory is complete, seeds reproduce."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from steprl.config import ConfigError
from steprl.diagnostics import read_trajectories
from steprl.training.loop.trainer import train
from tiny_runs import small_config

pytestmark = pytest.mark.e2e


def _cfg(tmp_path, name, extra=()):
    return small_config(tmp_path, name, ["trainer.total_steps=3", *extra])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    first = train(_cfg(tmp, "a"), log=lambda s: None)
    second = train(_cfg(tmp, "b"), log=lambda s: None)  # same seed, cached SFT
    return tmp, first, second


def test_run_directory_is_complete(two_runs):
    _, result, _ = two_runs
    d = result.run_dir
    for name in ("config.yaml", "metrics.jsonl", "learning_curve.png"):
        assert (d / name).stat().st_size > 0, name
    assert [p.name for p in sorted((d / "trajectories").iterdir())] == [
        f"step_00000{i}.parquet" for i in (1, 2, 3)
    ]
    assert list((d / "tensorboard").glob("events.out.tfevents.*"))
    ckpt = d / "checkpoints" / "latest"
    assert ckpt.is_symlink() and ckpt.resolve().name == "step_000003"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "state.pt",
        "config.yaml",
        "manifest.json",
    ):
        assert (ckpt / name).exists(), name
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert (d / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = read_trajectories(d / "trajectories")
    assert table.num_rows == 3 * 16


def test_every_step_reports_the_required_metrics_and_in_equals_out(two_runs):
    _, result, _ = two_runs
    for m in result.history:
        for key in (
            "reward/mean",
            "reward/std",
            "reward/group_std_mean",
            "reward/zero_variance_group_frac",
            "actor/entropy",
            "actor/grad_norm",
            "actor/clip_frac",
            "actor/approx_kl",
            "episode/action_tokens_mean",
            "episode/turns_mean",
            "tools/valid_frac",
            "end/answered",
            "end/truncated",
            "end/policy_error",
            "end/infra_failed",
        ):
            assert key in m, key
        assert m["traj/in"] == m["traj/out"] == 16
        assert m["actor/engine_logprob_diff_max"] < 1e-4


def test_parameters_change_and_checkpoint_loads(two_runs, tmp_path):
    tmp, result, _ = two_runs
    cached = next((tmp / "cache").iterdir())
    before = AutoModelForCausalLM.from_pretrained(cached)
    after = AutoModelForCausalLM.from_pretrained(result.run_dir / "checkpoints" / "latest")
    changed = [
        n
        for (n, p), (_, q) in zip(before.named_parameters(), after.named_parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert len(changed) == len(list(before.parameters()))


def test_same_seed_gives_identical_metrics_for_first_three_steps(two_runs):
    _, a, b = two_runs
    for ma, mb in zip(a.history[:3], b.history[:3], strict=True):
        keys = [k for k in ma if not k.startswith("time/")]
        assert {k: ma[k] for k in keys} == {k: mb[k] for k in keys}


def test_two_learner_ranks_train_as_one_process_does(two_runs):
    """`runtime.learner_ranks=2` (two FSDP2 ranks on Ray, gloo) against the same run in one
    process: the same sampled tokens every step, every learner metric and the final weights
    within 1e-5 relative (values below 1e-6 compared absolutely: float noise of a sum)."""
    import ray
    from safetensors.torch import load_file

    tmp, _, one = two_runs
    try:
        two = train(_cfg(tmp, "ranks2", ["runtime.learner_ranks=2"]), log=lambda s: None)
    finally:
        ray.shutdown()
    a, b = read_trajectories(one.run_dir / "trajectories"), read_trajectories(two.run_dir / "trajectories")
    for column in ("step", "prompt_ids", "action_ids", "observation_ids", "rewards", "advantages"):
        assert a.column(column).to_pylist() == b.column(column).to_pylist(), column
    for m1, m2 in zip(one.history, two.history, strict=True):
        for key, v in m1.items():
            if (
                key.startswith(("actor/", "train/", "tokens/", "reward/", "policy/"))
                and "logprob_diff" not in key
            ):
                assert m2[key] == pytest.approx(v, rel=1e-5, abs=1e-6), (m1["step"], key)
    w1 = load_file(one.run_dir / "checkpoints" / "latest" / "model.safetensors")
    w2 = load_file(two.run_dir / "checkpoints" / "latest" / "model.safetensors")
    assert set(w1) == set(w2)
    worst = max(float((w2[k] - w1[k]).abs().max() / w1[k].abs().max()) for k in w1)
    assert worst < 1e-5, worst


def test_rerun_into_the_same_directory_is_refused_or_cleared_whole(two_runs):
    tmp, first, _ = two_runs
    (first.run_dir / "notes.txt").write_text("the user's")
    short = ["trainer.total_steps=1", "trainer.eval_every=0"]
    with pytest.raises(ConfigError, match=r"already holds a run; continue it with .*--resume"):
        train(_cfg(tmp, "a", [*short, "run.overwrite=false"]), log=lambda s: None)
    assert (first.run_dir / "notes.txt").exists()  # refused: nothing touched
    again = train(_cfg(tmp, "a", short), log=lambda s: None)  # the shipped config: overwrite: true
    assert again.run_dir == first.run_dir
    assert not (again.run_dir / "notes.txt").exists()  # cleared whole, not two runs' files mixed
    rows = [json.loads(line) for line in (again.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # not appended to the first run's four rows
    assert read_trajectories(again.run_dir / "trajectories").num_rows == 16
    assert [p.name for p in (again.run_dir / "checkpoints").iterdir() if p.name != "latest"] == [
        "step_000001"
    ]
