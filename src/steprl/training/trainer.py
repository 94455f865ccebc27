"""The synchronous trainer. Reads top to bottom:

sample tasks -> group rollouts -> advantages -> mini-batch updates -> push weights (version + 1)
-> evaluate every N steps -> checkpoint.

Synchronous training is the staleness-0 case: rollouts always come from the current weights.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import torch
import transformers

from steprl.algorithms import ADVANTAGES, POLICY_LOSSES
from steprl.config import Config, dump_config
from steprl.diagnostics import (
    JsonlSink,
    MultiSink,
    TensorBoardSink,
    TrainingProgress,
    TrajectoryWriter,
    plot_learning_curve,
    reward_component_means,
    rollout_metrics,
)
from steprl.diagnostics.sinks import MetricsSink
from steprl.envs.registry import get_spec
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import CONTEXT_RULES
from steprl.rollout.engines.base import SamplingParams
from steprl.rollout.engines.hf import HFEngine
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.rollout.views import packed_view, per_step_view
from steprl.training.checkpoint import save_checkpoint
from steprl.training.evaluate import evaluate
from steprl.training.learner import Learner
from steprl.training.policy import load_policy


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    warm_start: dict[str, float]  # eval/* before any RL step
    final: dict[str, float]  # eval/* after the last step
    history: list[dict[str, float]]  # one metrics dict per step


def train(cfg: Config, log: Callable[[str], None] = print) -> TrainResult:
    # ---- set-up: run dir, seeds, policy, env, engine, learner -------------------------------
    transformers.utils.logging.disable_progress_bar()
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=cfg.run.overwrite)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    torch.manual_seed(cfg.run.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    policy = load_policy(cfg, log)
    log(f"policy: {policy.source}; {sum(p.numel() for p in policy.model.parameters()):,} parameters")
    env_spec = get_spec(cfg.env.name)

    def make_env(task):
        return env_spec.factory(**cfg.env.params)

    fmt = PlainFormat(policy.tokenizer)
    rule = CONTEXT_RULES[cfg.rollout.context](cfg.rollout.keep_last_k)
    # append-only context: one packed sequence per trajectory; other rules: one row per step
    to_samples = (lambda t, i: [packed_view(t, i)]) if rule.append_only else per_step_view
    budgets = Budgets(cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_total_tokens)
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
    eval_sampling = SamplingParams(temperature=cfg.trainer.eval_temperature, top_p=1.0)
    # The engine serves its own copy of the weights; the learner pushes new ones after each update.
    engine = HFEngine(
        copy.deepcopy(policy.model),
        eos_token_id=policy.tokenizer.eos_token_id,
        pad_token_id=policy.tokenizer.pad_token_id,
        device=cfg.model.device,
        max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.run.seed,
    )
    learner = Learner(
        policy.model,
        policy_loss=functools.partial(
            POLICY_LOSSES[cfg.algorithm.policy_loss], **cfg.algorithm.loss_kwargs()
        ),
        aggregation=cfg.algorithm.aggregation,
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        betas=cfg.trainer.betas,
        grad_clip=cfg.trainer.grad_clip,
        micro_batch_size=cfg.trainer.micro_batch_size,
        pad_id=policy.tokenizer.pad_token_id,
        temperature=max(cfg.rollout.temperature, 1e-6),
        device=cfg.model.device,
    )
    advantage_fn = functools.partial(ADVANTAGES[cfg.algorithm.advantage], **cfg.algorithm.advantage_kwargs())
    setup = RolloutSetup(make_env, engine, fmt, rule, sampling, budgets)
    shuffle_rng = torch.Generator().manual_seed(cfg.run.seed)
    train_tasks = env_spec.tasks("train", cfg.run.seed, **cfg.env.task_params)
    eval_tasks = list(
        islice(env_spec.tasks("eval", 10_000 + cfg.run.seed, **cfg.env.task_params), cfg.trainer.eval_tasks)
    )

    def run_eval(seed: int) -> dict[str, float]:
        return evaluate(eval_tasks, replace(setup, sampling=eval_sampling), seed=seed)[0]

    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    metrics_sink = MultiSink(sinks)
    traj_writer = (
        TrajectoryWriter(run_dir / "trajectories.parquet", decode=fmt.decode)
        if cfg.logging.save_trajectories
        else None
    )
    for key, value in cfg.derived().items():
        log(f"  {key}: {value}")

    warm = run_eval(seed=777)
    log(
        f"warm start: held-out success {warm['eval/success']:.3f}, tool-call rate "
        f"{warm['eval/tool_call_rate']:.3f} ({len(eval_tasks)} tasks, T={cfg.trainer.eval_temperature})"
    )
    metrics_sink.log(0, warm)
    history: list[dict[str, float]] = []
    last_eval = warm

    # ---- the RL loop ------------------------------------------------------------------------
    with TrainingProgress(cfg.trainer.total_steps, enabled=cfg.logging.progress) as progress:
        for step in range(1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            tasks = list(islice(train_tasks, cfg.rollout.tasks_per_step))
            engine.reseed(cfg.run.seed * 100_003 + step)
            groups = asyncio.run(
                rollout_groups(tasks, cfg.rollout.group_size, setup, seed=cfg.run.seed * 1_000 + step)
            )
            trajectories = [t for g in groups for t in g.trajectories]
            t_rollout = time.perf_counter() - t0

            # advantages over trainable trajectories only: infra failures are counted, never learned
            trainable = [t for t in trajectories if t.trainable and t.steps]
            group_ids = {gid: i for i, gid in enumerate(dict.fromkeys(t.group_id for t in trainable))}
            rewards = torch.tensor([t.outcome_reward for t in trainable], dtype=torch.float32)
            group_index = torch.tensor([group_ids[t.group_id] for t in trainable], dtype=torch.long)
            advantages = advantage_fn(rewards, group_index) if trainable else torch.zeros(0)
            samples = [s for i, t in enumerate(trainable) for s in to_samples(t, i)]

            learner_stats = learner.update(
                samples,
                advantages,
                epochs=cfg.trainer.epochs,
                mini_batches=cfg.trainer.mini_batches,
                generator=shuffle_rng,
            )
            engine.update_weights(learner.state_dict_for_engine(), version=engine.version + 1)
            t_learn = time.perf_counter() - t0 - t_rollout

            metrics = {
                **rollout_metrics(trajectories),
                **reward_component_means(trajectories),
                **learner_stats,
                "advantage/abs_mean": float(advantages.abs().mean()) if len(advantages) else 0.0,
                "policy/version": float(engine.version),
                "time/rollout_s": t_rollout,
                "time/learn_s": t_learn,
                "time/step_s": time.perf_counter() - t0,
                "tokens/action": float(sum(t.num_action_tokens for t in trajectories)),
                "tokens/trained_positions": float(sum(len(s.input_ids) for s in samples)),
            }
            every = cfg.trainer.eval_every
            if step == cfg.trainer.total_steps or (every and step % every == 0):
                last_eval = run_eval(seed=777 + step)
                metrics.update(last_eval)
            metrics_sink.log(step, metrics)
            if traj_writer is not None:
                traj_writer.write(step, trajectories)
            history.append(metrics)
            progress.update(step, metrics)
            if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                _checkpoint(run_dir, cfg, learner, policy.tokenizer, step, engine.version, shuffle_rng)

    # ---- wrap up: final checkpoint, curve ---------------------------------------------------
    metrics_sink.close()
    if traj_writer is not None:
        traj_writer.close()
    _checkpoint(run_dir, cfg, learner, policy.tokenizer, cfg.trainer.total_steps, engine.version, shuffle_rng)
    plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
    return TrainResult(run_dir, warm, last_eval, history)


def _checkpoint(
    run_dir: Path, cfg: Config, learner: Learner, tokenizer, step: int, version: int, rng: torch.Generator
) -> None:
    save_checkpoint(
        run_dir / "checkpoint",
        model=learner.model,
        tokenizer=tokenizer,
        optimizer=learner.optimizer,
        step=step,
        version=version,
        config_yaml=dump_config(cfg),
        generator=rng,
    )
