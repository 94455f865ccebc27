"""The synchronous trainer. Reads top to bottom:

sample tasks -> group rollouts -> advantages -> mini-batch updates -> push weights (version + 1)
-> evaluate every N steps -> checkpoint.

Synchronous training is the staleness-0 case: rollouts always come from the current weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import torch
import transformers

from steprl.algorithms import ADVANTAGES, GROUP_FILTERS, POLICY_LOSSES, filters
from steprl.algorithms.losses import AdaptiveKLController
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
    template_metrics,
)
from steprl.diagnostics.sinks import MetricsSink
from steprl.hosting.pool import EnvPool
from steprl.models.sources import DTYPES
from steprl.rollout.context import CONTEXT_RULES
from steprl.rollout.engines.base import SamplingParams
from steprl.rollout.engines.hf import HFEngine
from steprl.rollout.loop import Budgets, RolloutSetup
from steprl.rollout.views import packed_view, per_step_view
from steprl.training import env_setup
from steprl.training.advantage_batch import attach, build_advantage_inputs
from steprl.training.checkpoint import save_checkpoint
from steprl.training.critic import SeparateCritic, SharedCritic, ValueHead
from steprl.training.evaluate import evaluate
from steprl.training.learner import Learner, Regularizers
from steprl.training.lora import AdaptersDisabled, apply_lora, is_peft, plain_base
from steprl.training.policy import load_policy
from steprl.training.step_parts import (
    collect_groups,
    local_rollout,
    postprocess,
    remote_rollout,
    shaped_rewards,
    trajectory_abs_advantage,
    with_kl_in_reward,
)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    warm_start: dict[str, float]  # eval/* before any RL step
    final: dict[str, float]  # eval/* after the last step
    history: list[dict[str, float]]  # one metrics dict per step


def train(cfg: Config, log: Callable[[str], None] = print) -> TrainResult:
    """Train per `cfg`. Environments live where `runtime.backend` says (in-process, behind an
    HTTP env server, or in Ray actors); the env pool is closed however the run ends."""
    with contextlib.ExitStack() as cleanup:
        envs = cleanup.enter_context(env_setup.env_pool(cfg))
        return _train(cfg, envs, cleanup, log)


def _train(
    cfg: Config, envs: EnvPool, cleanup: contextlib.ExitStack, log: Callable[[str], None]
) -> TrainResult:
    # ---- set-up: run dir, seeds, policy, env, engine, learner -------------------------------
    transformers.utils.logging.disable_progress_bar()
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=cfg.run.overwrite)
    for stale in ("metrics.jsonl", "trajectories.parquet"):  # appended to while a run goes on
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    torch.manual_seed(cfg.run.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    env_spec = env_setup.env_spec(cfg)
    log(f"environments: {env_spec.name} on the {envs.name} backend, at most {envs.max_concurrent} live")
    env_setup.check_env_starts(envs, env_spec, cfg, log)
    policy = load_policy(cfg, log, envs.make_env)
    log(f"policy: {policy.source}; {sum(p.numel() for p in policy.model.parameters()):,} parameters")
    # ---- LoRA (model.lora): the learner trains adapters on the frozen base; the engines keep a
    # plain copy of the base and merge each adapter update into it (training/lora.py) ----------
    if cfg.model.lora is not None and not is_peft(policy.model):  # (a warm start applies it first)
        policy.model = apply_lora(policy.model, cfg.model.lora, log)
    engine_model = plain_base(policy.model) if is_peft(policy.model) else copy.deepcopy(policy.model)
    if cfg.model.engine_dtype != "auto":  # e.g. bf16 generation (2.2x faster on CPU) for an fp32 learner
        engine_model = engine_model.to(DTYPES[cfg.model.engine_dtype])
    # ---- end LoRA -----------------------------------------------------------------------------
    fmt = env_setup.prompt_format(cfg, policy.tokenizer)
    rule = CONTEXT_RULES[cfg.rollout.context](cfg.rollout.keep_last_k, fmt)
    per_turn = env_setup.check_prompt_format(fmt, cfg, log)  # a chat template that fails: refused
    # append-only context: one packed sequence per trajectory; other rules: one row per step
    to_samples = (lambda t, i: [packed_view(t, i)]) if rule.append_only and not per_turn else per_step_view
    budgets = Budgets(cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_total_tokens)
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
    eval_sampling = SamplingParams(temperature=cfg.trainer.eval_temperature, top_p=1.0)
    # The engine serves its own copy of the weights; the learner pushes new ones after each update.
    engine = HFEngine(
        engine_model,
        eos_token_id=policy.tokenizer.eos_token_id,
        pad_token_id=policy.tokenizer.pad_token_id,
        device=cfg.model.device,
        max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.run.seed,
    )
    algo = cfg.algorithm
    loss_spec = POLICY_LOSSES[algo.policy_loss]
    # a frozen copy of the initial policy, only when a KL term needs it (LoRA: no copy, the base
    # with the adapters switched off)
    ref_model = (
        (AdaptersDisabled(policy.model) if cfg.model.lora else copy.deepcopy(policy.model)).eval()
        if algo.kl_coef > 0
        else None
    )
    # the KL coefficient of the reward: fixed, or adapted after every step (algorithm.kl_ctrl)
    kl_ctl = AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
    value_head = ValueHead(int(policy.model.config.hidden_size)) if algo.critic == "shared" else None
    learner = Learner(
        policy.model,
        policy_loss=functools.partial(loss_spec.fn, **algo.loss_params),
        needs_proximal=loss_spec.needs_proximal,
        aggregation=algo.aggregation,
        loss_scale_factor=algo.loss_scale_factor,
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        betas=cfg.trainer.betas,
        grad_clip=cfg.trainer.grad_clip,
        micro_batch_size=cfg.trainer.micro_batch_size,
        pad_id=policy.tokenizer.pad_token_id,
        # greedy (T=0) log-probs are reported under the unscaled softmax, as the engine does
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        regularizers=Regularizers(
            entropy_coef=algo.entropy_coef,
            kl_coef=algo.kl_coef if algo.kl_in == "loss" else 0.0,
            kl_kind=algo.kl_kind,
            vf_coef=algo.vf_coef,
            value_clip=algo.value_clip,
        ),
        ref_model=ref_model if algo.kl_in == "loss" else None,  # in-reward KL is applied below
        value_head=value_head,
        device=cfg.model.device,
    )
    if is_peft(policy.model):  # the engines hold the plain base: merge the (warm-started) adapters in
        engine.update_weights(learner.state_dict_for_engine(), version=engine.version)
    critic: SeparateCritic | SharedCritic | None = None
    if algo.critic == "separate":
        critic = SeparateCritic(
            policy.model,
            lr=algo.critic_lr,
            value_clip=algo.value_clip,
            grad_clip=cfg.trainer.grad_clip,
            micro_batch_size=cfg.trainer.micro_batch_size,
            pad_id=policy.tokenizer.pad_token_id,
        )
    elif value_head is not None:
        critic = SharedCritic(
            policy.model,
            value_head,
            micro_batch_size=cfg.trainer.micro_batch_size,
            pad_id=policy.tokenizer.pad_token_id,
        )
    advantage_fn = functools.partial(ADVANTAGES[algo.advantage], **algo.advantage_params)
    group_filter = functools.partial(GROUP_FILTERS[algo.group_filter], **algo.filter_params)
    env_ids: dict[str, int] = {}
    setup = RolloutSetup(envs.make_env, engine, fmt, rule, sampling, budgets)
    rollout = local_rollout(setup)
    remote = None  # Ray rollout workers, each with its own engine copy (runtime.rollout_workers > 0)
    if cfg.runtime.backend == "ray" and cfg.runtime.rollout_workers > 0:
        from steprl.rollout.ray_workers import RayRolloutPool, WorkerEnvs

        remote = RayRolloutPool(
            engine_model,  # a plain model (LoRA: the base; adapter updates are merged into it)
            fmt,
            pad_token_id=policy.tokenizer.pad_token_id,
            num_workers=cfg.runtime.rollout_workers,
            envs=WorkerEnvs(
                cfg.env.name,
                cfg.env.params,
                "ray",
                cfg.runtime.env_workers,
                cfg.runtime.env_call_timeout_s,
                tuple(cfg.env.plugins),
            ),
            rule=rule,
            sampling=sampling,
            budgets=budgets,
            seed=cfg.run.seed,
            max_batch_size=cfg.rollout.max_batch_size,
            torch_threads=torch.get_num_threads(),  # CPU matmuls split sums by thread: match ours
        )
        cleanup.callback(remote.close)
        if is_peft(policy.model):
            remote.sync_weights(learner.state_dict_for_engine(), version=engine.version)
        rollout = remote_rollout(remote)
        log(f"rollouts: {cfg.runtime.rollout_workers} Ray rollout workers")
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
            engine.reseed(cfg.run.seed * 100_003 + step)
            if remote is not None:
                remote.reseed(cfg.run.seed * 100_003 + step)
            collected = collect_groups(
                train_tasks,
                tasks_per_step=cfg.rollout.tasks_per_step,
                group_size=cfg.rollout.group_size,
                rollout=rollout,
                group_filter=group_filter,
                regenerations=algo.filter_regenerations,
                seed=cfg.run.seed * 1_000 + step,
                failure_budget=cfg.runtime.failure_budget,
            )
            trajectories = collected.rollouts
            t_rollout = time.perf_counter() - t0
            if collected.metrics["infra/over_budget_rounds"]:
                log(
                    f"ALERT step {step}: {collected.metrics['infra/failed_frac']:.0%} of trajectories "
                    f"failed in the environment (runtime.failure_budget={cfg.runtime.failure_budget}); "
                    "their groups are not trained on. See end/infra_failed, end/env_timeout and the "
                    "trajectories' info['error']."
                )

            # advantages over the kept, trainable trajectories: infra failures are counted, never learned
            trainable = [t for g in collected.kept for t in g.trajectories]
            samples = [s for i, t in enumerate(trainable) for s in to_samples(t, i)]
            old_values = critic.values(samples) if critic else None
            abs_adv = torch.zeros(0)
            kl_metrics: dict[str, float] = {}
            if samples:
                inputs = build_advantage_inputs(
                    trainable,
                    samples,
                    shaped_rewards(trainable, algo),
                    pad_id=policy.tokenizer.pad_token_id,
                    env_ids=env_ids,
                    values=old_values,
                    entropy=learner.entropies_of(samples) if algo.empg is not None else None,
                )
                if ref_model is not None and algo.kl_in == "reward":
                    ref_logp = learner.logprobs_of(samples, ref_model)
                    inputs, reward_kl = with_kl_in_reward(
                        inputs, ref_logp, samples, beta=kl_ctl.beta, kind=algo.kl_kind
                    )
                    kl_metrics = {"actor/reward_kl": reward_kl, "actor/reward_kl_coef": kl_ctl.beta}
                    if algo.kl_ctrl == "adaptive":  # verl: n_steps = the rows of the batch
                        kl_ctl = kl_ctl.update(reward_kl, len(samples))
                out = postprocess(advantage_fn(inputs), inputs, algo)
                samples = attach(samples, out)
                abs_adv = trajectory_abs_advantage(out, inputs.row_traj, len(trainable))
                if algo.min_abs_advantage > 0:  # LOOP: drop trajectories that carry no signal
                    keep = set(filters.loop_abs_adv_keep(abs_adv, algo.min_abs_advantage).tolist())
                    kept_rows = [i for i, s in enumerate(samples) if s.traj_index in keep]
                    samples = [samples[i] for i in kept_rows]
                    old_values = [old_values[i] for i in kept_rows] if old_values is not None else None

            learner_stats = learner.update(
                samples,
                epochs=cfg.trainer.epochs,
                mini_batches=cfg.trainer.mini_batches,
                generator=shuffle_rng,
                old_values=old_values,
            )
            if critic is not None and samples and old_values is not None:
                learner_stats |= critic.update(
                    samples,
                    old_values,
                    epochs=cfg.trainer.epochs,
                    mini_batches=cfg.trainer.mini_batches,
                    generator=shuffle_rng,
                )
            if samples:  # a skipped step (empty batch after filtering) keeps the policy version
                engine.update_weights(learner.state_dict_for_engine(), version=engine.version + 1)
                if remote is not None:
                    remote.sync_weights(learner.state_dict_for_engine(), version=engine.version)
            t_learn = time.perf_counter() - t0 - t_rollout

            metrics = {
                **rollout_metrics(trajectories),
                **reward_component_means(trajectories),
                **template_metrics(trajectories),
                **collected.metrics,
                **learner_stats,
                **kl_metrics,
                "advantage/abs_mean": float(abs_adv.mean()) if abs_adv.numel() else 0.0,
                "train/rows": float(len(samples)),
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
