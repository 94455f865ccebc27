"""From the config's `model` and `rollout` sections to the engine and the context rule, built one
way for every command: training (`build.py`, its Ray rollout workers included), `steprl eval`,
and the SFT demonstrations (`policy.py`, `pretrained_sft.py`). A setting added here reaches all
of them; one wired at a single call site would silently not reach the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from steprl.config import Config
from steprl.engines.hf import EngineSettings, HFEngine
from steprl.engines.registry import ENGINES, EngineArgs
from steprl.engines.snapshots import CrossPolicy
from steprl.models.sources import DTYPES
from steprl.rollout.chat import PromptFormat
from steprl.rollout.context import CONTEXT_RULES, ContextRule


def engine_settings(cfg: Config) -> EngineSettings:
    """How the run's engines batch, cache and sample. The seed is the run's for the whole run:
    every request carries its own too (rollout/seeds.py)."""
    r = cfg.rollout
    return EngineSettings(
        max_batch_size=r.max_batch_size,
        seed=cfg.run.seed,
        prefix_cache_bytes=r.prefix_cache_mib << 20,
        continuous=r.continuous_batching,
        cross_policy=CrossPolicy(r.cross_policy.resolved()) if r.cross_policy is not None else None,
    )


def cross_policy_lag(cfg: Config) -> int:
    """How many versions behind the current one cross-policy sampling may sample (K - 1)."""
    return cfg.rollout.cross_policy.snapshots - 1 if cfg.rollout.cross_policy is not None else 0


def engine_for(cfg: Config, model: torch.nn.Module, tokenizer: Any) -> HFEngine:
    """An engine serving `model` with the run's settings, on `model.device`, in `model.engine_dtype`
    (e.g. bf16 generation, 2.2x faster on CPU, for an fp32 learner; "auto" keeps `model`'s
    dtype). The engine takes `model` itself (moved and cast in place), not a copy.
    `rollout.engine` picks the entry of `ENGINES` (a `VLLMEngine` is typed as the HF engine's
    interface the run uses: the `ServingEngine` protocol)."""
    if cfg.model.engine_dtype != "auto":
        model = model.to(DTYPES[cfg.model.engine_dtype])
    args = EngineArgs(
        model,
        tokenizer,
        engine_settings(cfg),
        device=cfg.model.device,
        max_positions=cfg.rollout.max_total_tokens,
        vllm_python=cfg.rollout.vllm_python,
        lora_rank=cfg.model.lora.r
        if cfg.model.lora is not None and cfg.rollout.vllm_lora == "adapter"
        else 0,
        weight_sync=cfg.rollout.vllm_weight_sync,
        sync_timeout_s=cfg.runtime.weight_sync_timeout_s,
    )
    engine: Any = ENGINES[cfg.rollout.engine].make(args)
    return engine


class SnapshotState:
    """Cross-policy snapshots as a run component: a checkpoint holds them (past weights, which
    no resume could rebuild) and a resume gives them to every engine copy (Ray workers too)."""

    def __init__(self, engine: HFEngine, remote: Any) -> None:
        self.engine, self.remote = engine, remote

    def state_dict(self) -> dict[str, Any]:
        return self.engine.snapshot_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.engine.load_snapshots(state)
        if self.remote is not None:
            self.remote.load_snapshots(state)


def context_rule(cfg: Config, fmt: PromptFormat) -> ContextRule:
    """`rollout.context` (with `rollout.keep_last_k`): how each turn's prompt is built."""
    return CONTEXT_RULES[cfg.rollout.context](cfg.rollout.keep_last_k, fmt)
