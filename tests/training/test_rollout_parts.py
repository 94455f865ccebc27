"""`steprl eval` builds its engine with the run's settings (`training/setup/rollout_parts.py`), as
training and its Ray rollout workers do: it used to ignore `model.engine_dtype` and the
`rollout` engine settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steprl.models import tiny
from steprl.training.commands import evaluate_cli
from steprl.training.setup.rollout_parts import engine_settings
from tiny_runs import save_small_llama, small_config


def test_eval_builds_its_engine_with_the_runs_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = save_small_llama(tmp_path / "checkpoint", tiny.build_tokenizer())
    settings = [
        "model.engine_dtype=bfloat16",
        "rollout.max_batch_size=3",
        "rollout.prefix_cache_mib=0",
        "rollout.continuous_batching=false",
        "run.seed=7",
    ]
    cfg = small_config(tmp_path, "eval", settings)
    seen = {}

    def evaluate(tasks, setup, *, seed):  # the engine it would evaluate with, without the rollouts
        seen["engine"] = setup.engine
        return {}, []

    monkeypatch.setattr(evaluate_cli, "evaluate", evaluate)
    evaluate_cli.evaluate_checkpoint(checkpoint, cfg, tasks=1, temperature=1.0)
    engine = seen["engine"]
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert (engine.max_batch_size, engine.continuous, engine.seed, engine.prefix_cache) == (3, False, 7, None)
    s = engine_settings(cfg)  # what the Ray rollout workers get
    assert (s.max_batch_size, s.continuous, s.seed, s.prefix_cache_bytes) == (3, False, 7, 0)
