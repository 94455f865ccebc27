"""The config's sections for the run, the model and the env(s) (`steprl.config` assembles them
into `Config`, with the rollout, algorithm, trainer, runtime and logging sections)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: numpy's and torch's seeds are unsigned 32-bit: a larger or negative one is their traceback
MAX_SEED = 2**32 - 1
#: a run directory's name: most file systems take 255 bytes; the rest is room for a suffix
MAX_RUN_NAME = 200


class Section(BaseModel):
    """The base of every config section."""

    # allow_inf_nan: `trainer.lr=.inf` is a config error, not a run whose weights all become NaN;
    # strict: `group_size: '8'` or `total_steps: true` is refused, not coerced (an int is a float)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class CrossPolicySection(Section):
    """Cross-policy sampling (engines/snapshots.py): the engine holds `snapshots` weight
    versions (the current one and the ones before it) and samples each turn from one of them,
    drawn from the turn's seed: `probs[j]` for the version j behind the current one, or
    `current_prob` for the current one and the rest split evenly. K model copies in memory."""

    snapshots: int = Field(3, ge=1)
    probs: list[float] | None = None
    current_prob: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _probs(self) -> CrossPolicySection:
        if self.probs is not None and self.current_prob is not None:
            raise ValueError("give probs or current_prob, not both")
        if self.probs is not None:
            if len(self.probs) != self.snapshots:
                raise ValueError(
                    f"probs has {len(self.probs)} entries; give one per snapshot ({self.snapshots})"
                )
            if any(p < 0 for p in self.probs) or abs(sum(self.probs) - 1.0) > 1e-6:
                raise ValueError(f"probs must be >= 0 and sum to 1 (got {self.probs})")
        return self

    def resolved(self) -> tuple[float, ...]:
        """The chance of each lag 0..K-1 (default: uniform)."""
        k = self.snapshots
        if self.probs is not None:
            return tuple(self.probs)
        if self.current_prob is not None:
            rest = (1.0 - self.current_prob) / (k - 1) if k > 1 else 0.0
            return (self.current_prob if k > 1 else 1.0, *([rest] * (k - 1)))
        return tuple([1.0 / k] * k)


class RunSection(Section):
    name: str = "calculator_tiny"  # run directory is <output_dir>/<name>
    seed: int = Field(0, ge=0, le=MAX_SEED)  # seeds tasks, sampling, init and shuffling
    output_dir: str = "runs"
    # An existing run directory is resumed (`resume`), cleared whole (`overwrite: true`) or
    # refused: a run never mixes its files with another run's.
    overwrite: bool = False
    # never: start fresh; auto: continue from the latest complete checkpoint in the run
    # directory if there is one; must: as auto, but refuse when there is none (`--resume`)
    resume: Literal["never", "auto", "must"] = "never"
    allow_config_change: bool = False  # resume although the config differs (CKPT-06)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # overwrite clears <output_dir>/<name>: a name with a path in it would point elsewhere
        if v.strip() in ("", ".", "..") or any(c in v for c in "/\\\0"):
            raise ValueError(
                f"{v!r} is not a plain name (no '/', '\\', '..', not empty): the run directory is "
                "run.output_dir/run.name; put a path in run.output_dir"
            )
        if len(v) > MAX_RUN_NAME:  # the file system's limit is a traceback when the directory is made
            raise ValueError(f"{len(v)} characters, over the {MAX_RUN_NAME} a run name may have; shorten it")
        return v


class TinySection(Section):
    # bounds far above a tiny model's sizes: past them a typo allocates until the machine runs
    # out of memory (`config.checks.check_tiny_size` holds the whole model to this machine's RAM)
    hidden_size: int = Field(96, gt=0, le=8192)
    num_layers: int = Field(3, gt=0, le=256)
    num_heads: int = Field(4, gt=0, le=256)
    intermediate_size: int = Field(256, gt=0, le=32768)
    # whole words that are one token each (a word-level tiny model; models/tiny.py), e.g. the
    # words of an env's requests and its tool names; empty: every character is a token
    words: list[str] = []

    @field_validator("words")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        if v:  # transformers is imported only for a word-level model
            from steprl.models.tiny import check_words

            check_words(v)
        return v

    @model_validator(mode="after")
    def _heads_divide_the_width(self) -> TinySection:
        # caught here, not as transformers' traceback when the model is built
        if self.hidden_size % self.num_heads:
            fits = max(d for d in range(1, self.num_heads) if self.hidden_size % d == 0)
            raise ValueError(
                f"model.tiny.hidden_size, model.tiny.num_heads: hidden_size={self.hidden_size} is not a "
                f"multiple of num_heads={self.num_heads} (each head takes an equal share); "
                f"e.g. num_heads={fits}"
            )
        return self

    def spec_fields(self) -> dict[str, int]:
        """The model's size (`TinyModelSpec`'s fields): everything here but the tokenizer's words."""
        return self.model_dump(exclude={"words"})


class SFTSection(Section):
    """Warm start on demonstrations from the env's scripted strategies, in two phases.

    1. `skill_steps` on demonstrations of `skill_strategy` alone (the expert): the policy learns
       the protocol and how to use the tool.
    2. `steps` on the mixture `strategies` (name -> weight): the default makes the warm-start
       policy deliberately imperfect: it uses the tool in about 30% of episodes and guesses
       otherwise, so RL has something real to fix.
    """

    skill_strategy: str = "expert"
    skill_steps: int = Field(400, ge=0)
    strategies: dict[str, Annotated[float, Field(ge=0)]] = {"expert": 0.3, "guess": 0.7}
    steps: int = Field(150, ge=0)
    num_episodes: int = Field(6000, gt=0)  # demonstrations generated per phase
    batch_size: int = Field(128, gt=0)
    lr: float = Field(3e-3, gt=0)
    mix_lr: float = Field(1e-3, gt=0)  # phase 2 learning rate
    seed: int = 1234


class LoraSection(Section):
    """LoRA adapters (peft, the `lora` extra): the learner trains only these; the engine
    generates with them merged into its copy of the base weights."""

    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class ModelSection(Section):
    # "tiny" (embedded, built locally), a local Hugging Face model directory, a Hub id (org/name:
    # through the Hub's cache, HF_HOME), a .gguf file, or "gemma-3-270m" (the `gemma` extra's model)
    name: str = "tiny"
    device: str = "cpu"
    init: Literal["sft", "scratch", "pretrained"] = "sft"  # "sft": a warm start on demonstrations (cached)
    # warm starts and converted models; unset: $STEPRL_CACHE, else $XDG_CACHE_HOME/steprl or
    # ~/.cache/steprl (one per user, wherever a command runs; models/sources.py: cache_root)
    cache_dir: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # the learner's weights
    engine_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the engine's copy; auto: = dtype
    # how text becomes tokens: "plain" (the tiny model's BOS + text), "chat" (the tokenizer's chat
    # template, exact multi-turn deltas), "auto" (chat when the tokenizer has a template)
    format: Literal["auto", "plain", "chat"] = "auto"
    chat_template: str | None = (
        None  # a Jinja file replacing the tokenizer's template; relative: as task_file.path
    )
    lora: LoraSection | None = None  # {r, alpha, dropout, target_modules}: train adapters only
    tiny: TinySection = TinySection()
    sft: SFTSection = SFTSection()

    @model_validator(mode="after")
    def _tiny_has_no_template(self) -> ModelSection:
        # caught here, not after the tiny model's minute-long warm start
        if self.name == "tiny" and self.format == "chat" and self.chat_template is None:
            raise ValueError(
                "model.name, model.format: the tiny model's tokenizer has no chat template for "
                "format=chat; use model.format=plain (or auto), or give one with model.chat_template"
            )
        return self


class TaskFileSection(Section):
    """Tasks from a JSONL or Parquet file, one per row (see steprl/envs/task_file.py)."""

    path: str  # relative: to the config file's directory (given with --set: the working directory)
    prompt_field: str = "prompt"  # the text the policy sees first
    id_field: str = "id"  # absent: <file stem>-<row>
    split_field: str = "split"  # a column of train|eval; absent: a stable hash of the id
    eval_fraction: float = Field(0.2, gt=0, lt=1)  # share of rows in eval when split by hash


class EnvEntry(Section):
    """One env of a run. `name` is a registered name (`steprl check-env --list`), a family
    (`gym`, `mcp`: the spec is built from `params`), an import path `package.module:attr` (an
    EnvSpec or a zero-argument function returning one), or a name an installed package declares
    in the `steprl.envs` entry-point group. See docs/your-own-env.md."""

    name: str = "calculator"
    params: dict[str, Any] = {}  # keyword arguments of the env factory (one env per episode)
    task_params: dict[str, Any] = {}  # keyword arguments of the env's task generator
    task_file: TaskFileSection | None = None  # tasks from a file instead of the env's generator
    weight: float = Field(1.0, gt=0)  # in a list of envs: its share of the train tasks
    # in a list: what its tasks and metrics (env/<id>/...) call it (default: `name`)
    id: str | None = None

    @field_validator("id")
    @classmethod
    def _plain_id(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError(f"{v!r} is not a plain id (letters, digits, '_', '.', '-'): it names metrics")
        return v

    @property
    def key(self) -> str:  # what the run's tasks of this env carry in `task.env` (several envs)
        return self.id or self.name


class EnvSection(EnvEntry):
    """Which env (or envs) to train on: one env (`name`, `params`, ... at this level), or a list
    of them, each with a `weight` (`env:` given as a YAML list, or `env.mix`). A list trains on
    a mixture: `source: auto` draws each task's env by weight (the `mixture` source)."""

    mix: list[EnvEntry] = []  # several envs (a YAML list under `env:` lands here)
    # the train tasks' source: a name in steprl.training.sources.TASK_SOURCES (stream, mixture)
    # or the import path of your own; "auto": stream for one env, mixture for a list
    source: str = "auto"
    # keyword arguments of the source's factory after (tasks, seed), checked against its
    # signature when the run starts (e.g. difficulty: {easy: 0.9, hard: 0.1, weights: {...}})
    source_params: dict[str, Any] = {}
    # modules imported first, by the trainer, the env server and the Ray workers (they register
    # envs); `--plugin MODULE` on the command line adds to them
    plugins: list[str] = []

    @model_validator(mode="after")
    def _one_env_or_a_list(self) -> EnvSection:
        if not self.mix:
            return self
        one, fields = EnvEntry(), ("name", "params", "task_params", "task_file", "id")
        given = [k for k in fields if getattr(self, k) != getattr(one, k)]
        if given:
            raise ValueError(f"env.{given[0]} is set next to a list of envs (env.mix): give one or the other")
        keys = [e.key for e in self.mix]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"env.mix has {twice[0]!r} twice: give each of them an `id` of its own")
        return self

    def entries(self) -> list[EnvEntry]:
        """The run's envs: the list, or the one env given at this level."""
        return list(self.mix) or [EnvEntry(**{k: getattr(self, k) for k in EnvEntry.model_fields})]

    def source_name(self) -> str:
        """`source` with "auto" resolved."""
        if self.source == "auto":
            return "mixture" if self.mix else "stream"
        return self.source


class DriftSection(Section):
    """`algorithm.step_reward.drift`: the guard that takes a step reward's weight away when it
    stops agreeing with outcomes (training/step_rewards/credit.py)."""

    min_tau: float = Field(0.1, ge=-1, le=1)  # Kendall tau (summed step reward vs outcome) floor
    patience: int = Field(2, gt=0)  # steps in a row below it before the weight is cut
    decay: float = Field(0.5, ge=0, lt=1)  # the weight's factor at each cut (under 1% of it: 0)
    after_fits: int = Field(2, ge=0)  # a trained kind is watched after this many fits


class StepRewardSection(Section):
    """`algorithm.step_reward`: a step-reward model trained beside the policy. `kind` is a name
    of `training/step_rewards: STEP_REWARDS` (istar, progress, mc_value, policy_gain) or the
    import path of your own; `params` its keyword arguments (checked when the run starts)."""

    kind: str
    weight: float = Field(0.5, ge=0)  # alpha: A = A_episode + alpha * A_step (or alpha * r in rewards)
    fit_every: int = Field(1, gt=0)  # fit the model every this many RL steps
    mode: Literal["advantage", "reward"] = "advantage"
    params: dict[str, Any] = {}
    drift: DriftSection = DriftSection()


class RuntimeSection(Section):
    """Where environments run. The training code is the same for all three backends.

    * `inprocess`: env instances live in the trainer process (the default).
    * `http`: behind `steprl serve-env` (FastAPI); `env_server_url` names a running server, or
      when it is unset the trainer starts one on loopback for the run and stops it at the end.
    * `ray`: env instances live in `env_workers` Ray actors; `rollout_workers` Ray actors run
      the agent loop with their own engine copy (0 = the agent loop stays in the trainer).
    """

    backend: Literal["inprocess", "http", "ray"] = "inprocess"
    env_server_url: str | None = None  # http: e.g. http://127.0.0.1:8765 (token from env_token_var)
    env_token_var: str = "STEPRL_ENV_TOKEN"  # environment variable that holds the server's token
    env_workers: int = Field(2, gt=0)  # ray: env worker actors
    rollout_workers: int = Field(0, ge=0)  # ray: rollout worker actors (0 = in the trainer)
    max_concurrent_envs: int = Field(256, gt=0)  # EnvPool: live env instances at once
    env_call_timeout_s: float = Field(30.0, gt=0)  # deadline of one reset/step/close
    failure_budget: float = Field(0.25, ge=0, le=1)  # max share of infra-failed trajectories per step
    max_failed_steps: int = Field(3, gt=0)  # consecutive steps over failure_budget stop the run
    # where the engines live: "colocated" (the trainer holds an engine beside the learner: it
    # rolls out, or with rollout workers it evaluates) or "separate" (only the Ray rollout
    # workers hold engines; evaluation and the weight-sync probe go to them)
    placement: Literal["colocated", "separate"] = "colocated"
    # the learner: 1 = in this process; N > 1 = N FSDP2 ranks on Ray (docs/scaling.md)
    learner_ranks: int = Field(1, gt=0)
    learner_placement: Literal["pack", "spread"] = "pack"  # the ranks' Ray placement group
    learner_timeout_s: float = Field(300.0, gt=0)  # deadline of one call into the ranks
    # GPUs per rank: 0 = the ranks compute on CPUs (gloo); 1 = one GPU each (NCCL)
    learner_gpus_per_rank: float = Field(0.0, ge=0)
    # on GPUs: bf16 compute with fp32 weights, gradient reduction and optimizer (FSDP2's policy)
    learner_mixed_precision: bool = True
    # the ranks' weight shards, gradients and AdamW state in host memory, AdamW stepping on the CPU
    # (FSDP2's CPUOffloadPolicy): a model whose optimizer state does not fit the GPUs
    learner_cpu_offload: bool = False
    # after every weight sync each engine answers a fixed probe and its log-probs are checked
    # against the learner's (weights/probe_gap); beyond the bound the run stops in one line
    weight_probe: bool = True
    weight_probe_bound: float | None = Field(None, gt=0)  # None: 1e-4 in fp32, 5e-2 in bf16
    weight_sync_timeout_s: float = Field(300.0, gt=0)  # deadline of one sync on each engine
    # how full weights reach Ray rollout workers: "ray" (each bucket put in the object store
    # once, every worker reads it) or "broadcast" (a gloo group of the learner's rank 0 and the
    # workers, each bucket broadcast once: nothing gathered in the trainer, nothing stored)
    weight_sync: Literal["ray", "broadcast"] = "ray"
    # with weight_sync: ray, each sync sends per tensor the compressed XOR against the version the
    # workers hold (engines/delta.py): about 7% of the bytes for a bf16 engine at lr 1e-6, no gain
    # for an fp32 engine (every weight moves); the trainer keeps the workers' version (a copy)
    weight_delta: bool = False
    # the most tensor bytes in one bucket of a sync (a larger tensor travels alone): what a
    # transport holds at once beyond the model
    weight_bucket_mib: int = Field(256, gt=0)
