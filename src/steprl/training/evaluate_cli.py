"""Evaluate a saved checkpoint on held-out tasks (used by `steprl eval`): the env, tasks, backend
and prompt format come from the checkpoint's config, as in training (`env_setup`)."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from steprl.config import Config
from steprl.rollout.context import CONTEXT_RULES
from steprl.rollout.engines.base import SamplingParams
from steprl.rollout.engines.hf import HFEngine
from steprl.rollout.loop import Budgets, RolloutSetup
from steprl.training import env_setup
from steprl.training.checkpoint import load_checkpoint_model
from steprl.training.evaluate import evaluate


def evaluate_checkpoint(checkpoint: Path, cfg: Config, *, tasks: int, temperature: float) -> dict[str, float]:
    transformers.utils.logging.disable_progress_bar()
    model = load_checkpoint_model(checkpoint, dtype=torch.float32)  # LoRA: the base, adapters merged
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    spec = env_setup.env_spec(cfg)
    engine = HFEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        device=cfg.model.device,
        seed=cfg.run.seed,
    )
    eval_tasks = list(islice(spec.tasks("eval", 10_000 + cfg.run.seed, **cfg.env.task_params), tasks))
    fmt = env_setup.prompt_format(cfg, tokenizer)
    with env_setup.env_pool(cfg) as envs:
        setup = RolloutSetup(
            make_env=envs.make_env,
            engine=engine,
            fmt=fmt,
            rule=CONTEXT_RULES[cfg.rollout.context](cfg.rollout.keep_last_k, fmt),
            sampling=SamplingParams(temperature=temperature),
            budgets=Budgets(
                cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_total_tokens
            ),
        )
        metrics, _ = evaluate(eval_tasks, setup, seed=777)
    return metrics
