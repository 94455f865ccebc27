"""`build(cfg)`: wire what a run trains and samples with, once: policy, engine (and Ray rollout
workers), learner, critic, KL reference, the rollout function, the task streams. The trainer
reads `Parts`; `steprl eval` and the SFT warm start share `rollout_setup` and `env_setup`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from steprl.algorithms import ADVANTAGES, GROUP_FILTERS, POLICY_LOSSES
from steprl.config import Config
from steprl.engines.base import Engine, SamplingParams
from steprl.engines.hf import CurrentPolicy, HFEngine
from steprl.envs.base import EnvTimeout
from steprl.envs.deadline import take_tasks
from steprl.errors import UserError
from steprl.hosting.pool import EnvPool
from steprl.rollout import seeds
from steprl.rollout.chat import PromptFormat
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.context import ContextRule
from steprl.rollout.loop import Budgets, RolloutSetup
from steprl.rollout.views import Sample, per_step_view, training_view
from steprl.training import step_rewards
from steprl.training.components import Stateful
from steprl.training.controllers import Controllers
from steprl.training.learn.batching import packing_unsupported
from steprl.training.learn.critic import CRITICS, Critic, CriticArgs, ValueHead
from steprl.training.learn.health_snapshots import ring_for
from steprl.training.learn.learner import LocalLearner, Regularizers
from steprl.training.learn.learner_protocol import Learner
from steprl.training.learn.lora import AdaptersDisabled, apply_lora, is_peft, plain_base
from steprl.training.setup import env_setup
from steprl.training.setup.policy import Policy, load_policy
from steprl.training.setup.rollout_parts import SnapshotState, context_rule, engine_for, engine_settings
from steprl.training.sources import TaskSource, TaskSplits, make_source
from steprl.training.step_rewards import StepCredit
from steprl.types import Task, Trajectory

ToSamples = Callable[[Trajectory, int], list[Sample]]


@dataclass
class Parts:
    """Everything a run holds. Mutable objects (models, optimizers, engines) wired once."""

    policy: Policy
    fmt: PromptFormat
    rule: ContextRule
    to_samples: ToSamples  # trajectory (+ its index in the batch) -> training rows
    engine: HFEngine
    remote: Any  # RayRolloutPool | None: the agent loop on Ray rollout workers
    learner: Learner
    critic: Critic | None
    ref_model: torch.nn.Module | None  # the KL reference (LoRA: the base, adapters off)
    setup: RolloutSetup  # in-process rollouts (training/loop/producers.py runs them on a thread)
    advantage_fn: Callable[..., Any]
    group_filter: Callable[..., torch.Tensor]
    envs: env_setup.RunEnvs  # the run's envs, each spec resolved once
    eval_tasks: list[Task]
    eval_sampling: SamplingParams
    source: TaskSource  # the train tasks (`env.source`)
    controllers: Controllers  # what each step's results change in the next (KL coefficient, stops)
    #: every run component by name, the source among them: what a checkpoint stores of each
    #: (`training/components.py`) and a resume restores
    components: dict[str, Stateful]
    step_credit: StepCredit | None = None  # algorithm.step_reward (also in `components`)

    def push_weights(self, version: int) -> None:
        """The learner's weights to every engine copy, as policy `version`."""
        update = self.learner.weights(version)
        self.engine.update_weights(update, version=version)
        if self.remote is not None:
            self.remote.sync_weights(update, version=version)


def budgets(cfg: Config) -> Budgets:
    return Budgets(cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_total_tokens)


def rollout_setup(
    cfg: Config,
    engine: Engine,
    fmt: PromptFormat,
    envs: EnvPool,
    sampling: SamplingParams,
    run: env_setup.RunEnvs,
) -> RolloutSetup:
    """The agent loop's set-up: shared by training, evaluation and `steprl eval` (a harness
    env's episodes run through the gateway: `run.runner_for`)."""
    rule = context_rule(cfg, fmt)
    return RolloutSetup(envs.make_env, engine, fmt, rule, sampling, budgets(cfg), run.runner_for())


class NoEvalTasks(UserError):
    """An env's task factory yields no eval task: none at all, or none within the env call
    deadline."""


def eval_tasks(cfg: Config, run: env_setup.RunEnvs, n: int) -> list[Task]:
    """The held-out tasks: the first `n` of each env's eval split (the same for every
    evaluation). Each within `runtime.env_call_timeout_s`: a factory that never yields one stops
    the run in one line instead of hanging it. An empty eval split stops it too: the held-out
    success before and after RL is what a run reports (a task file refuses one the same way)."""
    seed, timeout = seeds.eval_task_seed(cfg.run.seed), cfg.runtime.env_call_timeout_s
    held_out: list[Task] = []
    for key, split in run.splits("eval", seed).items():
        try:
            tasks = take_tasks(split, n, timeout, "the eval split")
        except EnvTimeout as exc:
            raise NoEvalTasks(
                f"env {key!r}: {exc} (runtime.env_call_timeout_s); its task factory must yield eval "
                f"tasks promptly (steprl check-env shows it)"
            ) from None
        if not tasks:
            raise NoEvalTasks(
                f"env {key!r}: its eval split is empty, so there are no held-out tasks to evaluate on; "
                "make its task factory yield tasks for split='eval' (steprl check-env shows it)"
            )
        held_out += tasks
    return held_out


def build(
    cfg: Config,
    run: env_setup.RunEnvs,
    envs: EnvPool,
    cleanup: contextlib.ExitStack,
    log: Callable[[str], None],
    *,
    resuming: bool,
) -> Parts:
    controllers = Controllers.for_config(cfg)
    if cfg.algorithm.step_reward is not None:  # an unknown kind or param: one line, before the model
        step_rewards.check_config(cfg.algorithm.step_reward)
    source_name = cfg.env.source_name()
    source = make_source(  # first: an unknown env.source stops the run before the model loads
        source_name,
        TaskSplits(run.splits("train", cfg.run.seed), run.weights()),
        cfg.run.seed,
        cfg.env.source_params,
    )
    held_out = eval_tasks(cfg, run, cfg.trainer.eval_tasks)  # none: refused before the model loads too
    _refuse_combinations(cfg, run)
    if resuming and cfg.model.lora is not None and cfg.model.name != "tiny":
        # the checkpoint holds the adapters; the (uncached) SFT warm start would be thrown away
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init": "pretrained"})})
    policy = load_policy(cfg, log, envs.make_env, run)
    # what comes next (LoRA init, the value head, ...) must not depend on whether the warm start
    # was cached or trained just now, which draws from the global generators
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    log(f"policy: {policy.source}; {sum(p.numel() for p in policy.model.parameters()):,} parameters")
    # LoRA (model.lora): the learner trains adapters on the frozen base; the engines keep a plain
    # copy of the base and merge each adapter update into it (training/learn/lora.py)
    if cfg.model.lora is not None and not is_peft(policy.model):  # (a warm start applies it first)
        policy.model = apply_lora(policy.model, cfg.model.lora, log)
    engine_model = plain_base(policy.model) if is_peft(policy.model) else copy.deepcopy(policy.model)
    fmt = env_setup.prompt_format(cfg, policy.tokenizer)
    if any(e.spec.harness is not None for e in run.envs) and not isinstance(fmt, ChatFormat):
        raise UserError(
            "env harness renders a harness's messages with a chat template: use a chat model, or the "
            "tiny model with model.format=chat and model.chat_template (configs/templates/tiny_chat.jinja)"
        )
    rule = context_rule(cfg, fmt)
    per_turn = env_setup.check_prompt_format(fmt, cfg, log)  # a chat template that fails: refused
    # append-only context: one packed sequence per trajectory (per step where a harness branched);
    # other rules: one row per step
    to_samples: ToSamples = training_view if rule.append_only and not per_turn else per_step_view
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
    # The engine serves its own copy of the weights; the learner pushes new ones after each update.
    engine = engine_for(cfg, engine_model, policy.tokenizer)
    del engine_model  # the engine holds it (separate placement drops the engine after the workers start)
    held = [engine]  # closed at the end (a vLLM engine's worker process); emptied when it is dropped

    def close_held() -> None:
        for e in held:
            e.close()

    cleanup.callback(close_held)
    algo = cfg.algorithm
    ref_model = _reference(cfg, policy.model)
    shares_head = algo.critic != "none" and CRITICS[algo.critic].shares_head
    value_head = ValueHead(int(policy.model.config.hidden_size)) if shares_head else None
    pack = _pack_rows(cfg, policy.model, log)
    learner = _make_learner(cfg, policy, ref_model, value_head, pack, log)
    cleanup.callback(learner.close)  # a learner group's ranks: no process left behind
    if is_peft(policy.model):  # the engines hold the plain base: merge the (warm-started) adapters in
        engine.update_weights(learner.weights(engine.version), version=engine.version)
    critic = _make_critic(cfg, policy, learner)
    step_credit = _make_step_credit(cfg, policy, ref_model)
    setup = rollout_setup(cfg, engine, fmt, envs, sampling, run)
    remote = _rollout_workers(cfg, run, engine, fmt, rule, sampling, policy, learner, cleanup, log)
    if cfg.runtime.placement == "separate":  # the workers hold the engines: drop this one's weights
        from steprl.rollout.pool_engine import PoolEngine  # noqa: PLC0415 - Ray, only when asked

        held.clear()  # an HF engine (rollout workers refuse vLLM): nothing to close, its weights go
        engine = PoolEngine(remote)  # type: ignore[assignment]
        setup = rollout_setup(cfg, engine, fmt, envs, sampling, run)
        log("placement: separate (no engine here: evaluation and each sync's probe run on the workers)")
    return Parts(
        policy=policy,
        fmt=fmt,
        rule=rule,
        to_samples=to_samples,
        engine=engine,
        remote=remote,
        learner=learner,
        critic=critic,
        ref_model=ref_model,
        setup=setup,
        advantage_fn=functools.partial(ADVANTAGES.lookup(algo.advantage), **algo.advantage_params),
        group_filter=functools.partial(GROUP_FILTERS.lookup(algo.group_filter), **algo.filter_params),
        envs=run,
        eval_tasks=held_out,
        eval_sampling=SamplingParams(temperature=cfg.trainer.eval_temperature, top_p=1.0),
        source=source,
        controllers=controllers,
        components={
            f"source:{source_name}": source,
            **controllers.components(),
            **({"engine:snapshots": SnapshotState(engine, remote)} if engine.snapshots is not None else {}),
            # health rollbacks: the last health.snapshots steps' weights and optimizer
            **({"health:snapshots": ring} if (ring := ring_for(cfg, learner)) is not None else {}),
            **({f"step_reward:{step_credit.kind}": step_credit} if step_credit is not None else {}),
        },
        step_credit=step_credit,
    )


def _refuse_combinations(cfg: Config, run: env_setup.RunEnvs) -> None:
    """What the parts cannot do together: one line each, before the model loads."""
    rt = cfg.runtime
    if (rt.learner_gpus_per_rank > 0 or rt.learner_cpu_offload) and rt.learner_ranks == 1:
        what = "learner_gpus_per_rank" if rt.learner_gpus_per_rank > 0 else "learner_cpu_offload"
        raise UserError(
            f"runtime.{what} is a setting of learner ranks (runtime.learner_ranks > 1); the "
            "one-process learner computes on model.device (e.g. model.device=cuda)"
        )
    if rt.placement == "separate" and not (rt.backend == "ray" and rt.rollout_workers > 0):
        raise UserError(
            "runtime.placement=separate puts the engines on Ray rollout workers: set "
            "runtime.backend=ray and runtime.rollout_workers >= 1"
        )
    if rt.weight_sync == "broadcast" and not (rt.backend == "ray" and rt.rollout_workers > 0):
        raise UserError(
            "runtime.weight_sync=broadcast sends the weights to Ray rollout workers: set "
            "runtime.backend=ray and runtime.rollout_workers >= 1"
        )
    if rt.weight_sync == "broadcast" and cfg.rollout.cross_policy is not None:
        raise UserError(
            "rollout.cross_policy with runtime.weight_sync=broadcast: a replaced worker replays its "
            "snapshots from the object store; use runtime.weight_sync=ray"
        )
    if rt.weight_delta and (rt.weight_sync != "ray" or rt.rollout_workers == 0 or cfg.rollout.cross_policy):
        raise UserError(
            "runtime.weight_delta sends deltas to Ray rollout workers through the object store: set "
            "runtime.backend=ray, runtime.rollout_workers >= 1, runtime.weight_sync=ray and no "
            "rollout.cross_policy"
        )
    if rt.placement == "separate" and cfg.rollout.cross_policy is not None:
        raise UserError(
            "rollout.cross_policy with runtime.placement=separate: a resume's snapshots are the "
            "trainer engine's; use runtime.placement=colocated"
        )
    if cfg.runtime.rollout_workers > 0 and cfg.rollout.engine != "hf":
        raise UserError(
            "rollout.engine=vllm: set runtime.rollout_workers=0; Ray rollout workers hold HF engine copies "
            "(rollout.max_staleness > 0 trains asynchronously on the vLLM engine)"
        )
    if cfg.runtime.rollout_workers > 0 and any(e.spec.harness is not None for e in run.envs):
        raise UserError(
            "env harness: set runtime.rollout_workers=0; a harness runs against the trainer's engine "
            "(rollout.max_staleness > 0 trains it asynchronously)"
        )


def _reference(cfg: Config, model: torch.nn.Module) -> torch.nn.Module | None:
    """A frozen copy of the initial policy, only when a KL term needs it (LoRA: no copy, the
    base with the adapters switched off), on the run's device."""
    if cfg.algorithm.kl_coef <= 0:
        return None
    ref = AdaptersDisabled(model) if cfg.model.lora else copy.deepcopy(model)
    return ref.eval().to(cfg.model.device)


def _make_learner(
    cfg: Config,
    policy: Policy,
    ref_model: torch.nn.Module | None,
    value_head: ValueHead | None,
    pack: bool,
    log: Callable[[str], None],
) -> Learner:
    algo = cfg.algorithm
    loss_spec = POLICY_LOSSES.lookup(algo.policy_loss)
    settings: dict[str, Any] = dict(
        policy_loss=functools.partial(loss_spec.fn, **algo.loss_params),
        needs_proximal=loss_spec.needs_proximal,
        aggregation=algo.aggregation,
        loss_scale_factor=algo.loss_scale_factor,
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        betas=cfg.trainer.betas,
        grad_clip=cfg.trainer.grad_clip,
        micro_batch_size=cfg.trainer.micro_batch_size,
        max_tokens=cfg.trainer.max_tokens_per_micro_batch,
        activation_checkpointing=cfg.trainer.activation_checkpointing,
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
        ref_model=ref_model,  # the KL in the loss, or in the reward (training/loop/step_batch.py asks)
        value_head=value_head,
        device=cfg.model.device,
        grad_spike_norm=cfg.trainer.grad_spike_factor * cfg.trainer.grad_clip,
        pack=pack,
    )
    rt = cfg.runtime
    if rt.learner_ranks == 1:
        return LocalLearner(policy.model, **settings)
    from steprl.training.learn.learner_group import LearnerGroup  # noqa: PLC0415 - Ray, only when asked

    group = LearnerGroup(
        policy.model,
        settings,
        ranks=rt.learner_ranks,
        placement=rt.learner_placement,
        timeout_s=rt.learner_timeout_s,
        gpus_per_rank=rt.learner_gpus_per_rank,
        mixed_precision=rt.learner_mixed_precision,
        cpu_offload=rt.learner_cpu_offload,
    )
    log(group.describe())
    return group


def _make_critic(cfg: Config, policy: Policy, learner: Learner) -> Critic | None:
    algo = cfg.algorithm
    if algo.critic == "none":
        return None
    args = CriticArgs(
        policy.model,
        learner,
        lr=algo.critic_lr,
        value_clip=algo.value_clip,
        grad_clip=cfg.trainer.grad_clip,
        micro_batch_size=cfg.trainer.micro_batch_size,
        pad_id=policy.tokenizer.pad_token_id,
    )
    return CRITICS[algo.critic].make(args)


def _make_step_credit(cfg: Config, policy: Policy, ref_model: torch.nn.Module | None) -> StepCredit | None:
    if cfg.algorithm.step_reward is None:
        return None
    return step_rewards.make_step_credit(
        cfg.algorithm.step_reward,
        step_rewards.ModelContext(
            policy.model,
            ref_model,
            pad_id=policy.tokenizer.pad_token_id,
            micro_batch_size=cfg.trainer.micro_batch_size,
            temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
            grad_clip=cfg.trainer.grad_clip,
        ),
    )


def _rollout_workers(
    cfg: Config,
    run: env_setup.RunEnvs,
    engine: Any,
    fmt: PromptFormat,
    rule: ContextRule,
    sampling: SamplingParams,
    policy: Policy,
    learner: Learner,
    cleanup: contextlib.ExitStack,
    log: Callable[[str], None],
) -> Any:
    """Ray rollout workers, each with its own engine copy (runtime.rollout_workers > 0), or None."""
    if not (cfg.runtime.backend == "ray" and cfg.runtime.rollout_workers > 0):
        return None
    from steprl.rollout.ray_workers import RayRolloutPool, WorkerEnvs

    remote = RayRolloutPool(
        engine.model,  # a plain model (LoRA: the base; adapter updates are merged into it)
        fmt,
        pad_token_id=policy.tokenizer.pad_token_id,
        num_workers=cfg.runtime.rollout_workers,
        envs=WorkerEnvs(
            run.routes(),
            "ray",
            cfg.runtime.env_workers,
            cfg.runtime.env_call_timeout_s,
            tuple(cfg.env.plugins),
        ),
        rule=rule,
        sampling=sampling,
        budgets=budgets(cfg),
        engine_settings=engine_settings(cfg),
        torch_threads=torch.get_num_threads(),  # CPU matmuls split sums by thread: match ours
        sync_timeout_s=cfg.runtime.weight_sync_timeout_s,
        weight_sync=cfg.runtime.weight_sync,
        weight_delta=cfg.runtime.weight_delta,
    )
    cleanup.callback(remote.close)
    if is_peft(policy.model):
        remote.sync_weights(learner.weights(engine.version), version=engine.version)
    how = "a gloo broadcast" if cfg.runtime.weight_sync == "broadcast" else "the object store"
    how += ", as deltas" if cfg.runtime.weight_delta else ""
    log(f"rollouts: {cfg.runtime.rollout_workers} Ray rollout workers, weights by {how}")
    return remote


def _pack_rows(cfg: Config, model: torch.nn.Module, log: Callable[[str], None]) -> bool:
    """trainer.pack_rows: prefix-tree rows unless the model or the loss rules them out."""
    if not cfg.trainer.pack_rows:
        return False
    why = packing_unsupported(model)
    if cfg.algorithm.critic == "shared":
        why = "a shared value head reads every row's own positions"
    elif cfg.trainer.activation_checkpointing:
        why = "activation checkpointing runs the model without the KV cache a tree's segments need"
    elif cfg.algorithm.aggregation == "seq-mean-token-mean":
        why = "seq-mean-token-mean divides by each row's own token count"
    if why is not None:
        log(f"rows: not packed into prefix trees ({why})")
    return why is None


def eval_setup(parts: Parts) -> RolloutSetup:
    # held-out episodes measure the current policy, never the cross-policy mixture
    engine = CurrentPolicy(parts.engine) if parts.engine.snapshots is not None else parts.engine
    return replace(parts.setup, engine=engine, sampling=parts.eval_sampling)
