"""Overrides that make the default recipe (`configs/calculator_tiny.yaml`) run in seconds.

A 1-layer, 32-wide model, a few SFT steps and a handful of tasks: the e2e tests check that runs
are complete, reproducible and the same across backends, not that the policy learns.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from steprl.config import load_config

SMALL = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "model.sft.skill_steps=20",
    "model.sft.steps=10",
    "model.sft.num_episodes=200",
    "model.sft.batch_size=32",
    "rollout.tasks_per_step=4",
    "rollout.group_size=4",
    "rollout.max_turns=4",
    "rollout.max_tokens_per_turn=24",
    "trainer.total_steps=2",
    "trainer.eval_tasks=8",
    "trainer.eval_every=2",
    "trainer.lr=3e-3",
    "logging.progress=false",
]
QUIET = ["logging.tensorboard=false", "logging.save_trajectories=false"]  # fewer files, faster


def small_config(
    tmp_path: Path, name: str, extra: Sequence[str] = (), *, cache_dir: Path | None = None
) -> Any:
    """The default recipe made small, writing under `tmp_path` (and `extra` applied last)."""
    return load_config(
        "configs/calculator_tiny.yaml",
        [
            *SMALL,
            f"run.output_dir={tmp_path / 'runs'}",
            f"run.name={name}",
            f"model.cache_dir={cache_dir or tmp_path / 'cache'}",
            *extra,
        ],
    )


def save_small_llama(path: Path, tokenizer: Any) -> Path:
    """A small random-init Llama (seed 0) saved with `tokenizer` (the embedded one has a pad
    token) as a Hugging Face directory at `path`: a real model class for loading tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_learner(model: Any, **overrides: Any) -> Any:
    """A `Learner` over `model` itself (copy it first to keep it) for unit tests: no policy loss
    (one that a test calls is given), token-mean, Adam at 1e-3, clip 1, micro-batches of 4;
    `overrides` are any of `Learner`'s keywords."""
    from steprl.training.learn.learner import LocalLearner

    settings: dict[str, Any] = {
        "policy_loss": lambda inputs: None,  # never called unless a test gives one
        "needs_proximal": False,
        "aggregation": "token-mean",
        "loss_scale_factor": None,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "betas": (0.9, 0.999),
        "grad_clip": 1.0,
        "micro_batch_size": 4,
        "pad_id": 0,
        "temperature": 1.0,
    }
    return LocalLearner(model, **(settings | overrides))
