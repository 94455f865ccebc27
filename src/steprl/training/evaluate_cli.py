"""Evaluate a saved checkpoint on held-out tasks (used by `steprl eval`): the env, tasks, backend,
prompt format and engine settings come from the checkpoint's config, as in training
(`training/build.py`)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from steprl.config import Config
from steprl.rollout import seeds
from steprl.rollout.engines.base import SamplingParams
from steprl.training import env_setup
from steprl.training.build import eval_tasks, rollout_setup
from steprl.training.checkpoint import load_checkpoint_model
from steprl.training.evaluate import evaluate
from steprl.training.rollout_parts import engine_for


def evaluate_checkpoint(checkpoint: Path, cfg: Config, *, tasks: int, temperature: float) -> dict[str, float]:
    transformers.utils.logging.disable_progress_bar()
    model = load_checkpoint_model(checkpoint, dtype=torch.float32)  # LoRA: the base, adapters merged
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = engine_for(cfg, model, tokenizer)  # the run's engine settings, as in training
    fmt = env_setup.prompt_format(cfg, tokenizer)
    with env_setup.env_pool(cfg) as envs:
        setup = rollout_setup(cfg, engine, fmt, envs, SamplingParams(temperature=temperature))
        held_out = eval_tasks(cfg, env_setup.run_envs(cfg), tasks)
        metrics, _ = evaluate(held_out, setup, seed=seeds.eval_stream_seed(cfg.run.seed, 0))
    return metrics
