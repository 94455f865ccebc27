"""Evaluate a saved checkpoint on held-out tasks (used by `steprl eval`): the env, tasks, backend,
prompt format and engine settings come from the checkpoint's config, as in training
(`training/setup/build.py`), and so does the seed: the held-out tasks get the per-task seeds of the
run's own evaluations. The episodes are saved (`logging.save_trajectories`) to
`<run_dir>/eval_cli/step_NNNNNN.parquet` (NNNNNN: the checkpoint's step; an evaluation of the same
checkpoint again replaces it), apart from the run's `eval_trajectories/`, whose task count and
temperature are the config's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from steprl.config import Config
from steprl.diagnostics import TrajectoryWriter
from steprl.diagnostics.sinks import write_failed
from steprl.engines.base import SamplingParams
from steprl.rollout import seeds
from steprl.training.learn.checkpoint import load_checkpoint_model
from steprl.training.loop.evaluate import evaluate
from steprl.training.setup import env_setup
from steprl.training.setup.build import eval_tasks, rollout_setup
from steprl.training.setup.rollout_parts import engine_for


def evaluate_checkpoint(
    checkpoint: Path,
    cfg: Config,
    *,
    tasks: int | None,
    temperature: float,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """`tasks` held-out tasks (None: the run's own `trainer.eval_tasks`, so the numbers compare
    with the run's evaluations) at `temperature`."""
    transformers.utils.logging.disable_progress_bar()
    model = load_checkpoint_model(checkpoint, dtype=torch.float32)  # LoRA: the base, adapters merged
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = engine_for(cfg, model, tokenizer)  # the run's engine settings, as in training
    fmt = env_setup.prompt_format(cfg, tokenizer)
    with contextlib.ExitStack() as stack, env_setup.env_pool(cfg) as envs:
        stack.callback(engine.close)  # a vLLM engine's worker process
        run = env_setup.run_envs(cfg)
        setup = rollout_setup(cfg, engine, fmt, envs, SamplingParams(temperature=temperature), run)
        held_out = eval_tasks(cfg, run, cfg.trainer.eval_tasks if tasks is None else tasks)
        started = time.perf_counter()
        metrics, episodes = evaluate(held_out, setup, seed=seeds.eval_stream_seed(cfg.run.seed))
        metrics = {**metrics, "time/eval_s": time.perf_counter() - started}  # as training logs it
    if cfg.logging.save_trajectories:
        directory = episodes_dir(checkpoint)
        number = checkpoint.name.removeprefix("step_")
        step = int(number) if number.isdigit() else 0  # a checkpoint the user renamed
        try:
            writer = TrajectoryWriter(directory, decode=fmt.decode)
        except OSError as exc:  # not writable: one line, as for a training run's outputs
            raise write_failed(f"the episodes of {checkpoint.name}", directory, exc) from exc
        with writer:
            writer.write(step, episodes)
        log(f"episodes: {directory / f'step_{step:06d}.parquet'}")
    return metrics


def episodes_dir(checkpoint: Path) -> Path:
    """Where `steprl eval` saves a checkpoint's episodes: `eval_cli/` of its run directory (a
    checkpoint outside one: beside it; never inside it, which its manifest covers)."""
    parent = checkpoint.parent
    return (parent.parent if parent.name == "checkpoints" else parent) / "eval_cli"
