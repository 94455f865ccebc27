"""`ENGINES`: the engines a run, `steprl eval`, `serve-policy` and a synthesized env's LLM
user or writer can serve a model with (`rollout.engine`), one entry each; `check_engine` is
what every entry must do (run over `hf` in `make test`, over `vllm` by its soak suite).

An entry makes an engine from `EngineArgs` (the model, its tokenizer and the run's settings);
the engine then lives behind the `Engine` protocol (`base.py`): generate, update_weights,
version, reset_scheduler, snapshots, max_positions, close. Adding an engine is one file plus
one entry here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from steprl.engines.base import SamplingParams, ServingEngine
from steprl.engines.weights import WeightUpdate
from steprl.registry import Registry, instance_of

if TYPE_CHECKING:  # the engines import transformers: only the one picked is imported
    from steprl.engines.hf import EngineSettings


@dataclass(frozen=True)
class EngineArgs:
    """What any engine is made from."""

    model: torch.nn.Module  # served as it is (an engine may move or cast it in place)
    tokenizer: Any
    settings: EngineSettings | None = None  # None: the defaults
    device: str = "cpu"
    max_positions: int = 2048  # prompt + completion, at most (an engine may hold fewer)
    vllm_python: str = ".venv-vllm/bin/python"  # rollout.vllm_python
    lora_rank: int = 0  # a LoRA run's rank, for an engine that takes adapters alone (0: merged)
    weight_sync: str = "socket"  # rollout.vllm_weight_sync
    sync_timeout_s: float = 300.0  # runtime.weight_sync_timeout_s: one sync's deadline


def _hf(args: EngineArgs) -> ServingEngine:
    from steprl.engines.hf import EngineSettings, HFEngine

    return HFEngine.with_settings(
        args.model,
        args.settings or EngineSettings(),
        eos_token_id=args.tokenizer.eos_token_id,
        pad_token_id=args.tokenizer.pad_token_id,
        device=args.device,
    )


def _vllm(args: EngineArgs) -> ServingEngine:
    from steprl.engines.vllm_engine import VLLMEngine  # its worker runs in the vLLM venv

    engine: ServingEngine = VLLMEngine(
        args.model,
        args.tokenizer,
        python=args.vllm_python,
        max_model_len=args.max_positions,
        seed=args.settings.seed if args.settings is not None else 0,
        lora_rank=args.lora_rank,
        weight_sync=args.weight_sync,
        sync_timeout_s=args.sync_timeout_s,
    )
    return engine


@dataclass(frozen=True)
class EngineSpec:
    make: Callable[[EngineArgs], ServingEngine]
    about: str
    cross_policy: bool  # holds past versions' weights (rollout.cross_policy)


ENGINES: Registry[EngineSpec] = Registry(
    {
        "hf": EngineSpec(
            _hf, "transformers in this process: continuous batching, KV and prefix caches", True
        ),
        "vllm": EngineSpec(_vllm, "vLLM in a worker process of the .venv-vllm venv (make vllm-venv)", False),
    },
    key="rollout.engine",
    what="engine",
    accept=instance_of(EngineSpec),
    expected="an EngineSpec",
    checker=None,
    checked_by="check_engine, serving a small model (tests/rollout/test_engines.py; vllm: its soak suite)",
)


def check_engine(
    make: Callable[[], ServingEngine],
    prompt: tuple[int, ...],
    new_weights: Callable[[ServingEngine], WeightUpdate],
) -> None:
    """What every engine must do: a seeded request gives the same tokens again and alone or
    batched; one log-prob and one version per token; `update_weights` bumps the version and
    changes what is sampled; `close` may be called twice. `new_weights(engine)`: an update whose
    weights differ from the engine's (version = the engine's + 1)."""
    engine = make()
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6)

        async def run(seeds: list[int]) -> list[Any]:
            return list(await asyncio.gather(*(engine.generate(prompt, sampling, seed=s) for s in seeds)))

        alone = asyncio.run(run([3]))[0]
        batched = asyncio.run(run([1, 3, 5]))
        assert alone.token_ids and batched[1].token_ids == alone.token_ids, (
            "a seeded request depends on its batch"
        )
        assert len(alone.logprobs) == len(alone.token_ids), "one log-prob per sampled token"
        assert not alone.versions or set(alone.versions) == {engine.version}, "versions per token"
        assert all(lp <= 0.0 for lp in alone.logprobs), "log-probs above 0"
        before = engine.version
        update = new_weights(engine)
        engine.update_weights(update, update.version)
        assert engine.version == update.version == before + 1, "update_weights did not set the version"
        after = asyncio.run(run([1, 3, 5]))
        assert [g.logprobs for g in after] != [g.logprobs for g in batched], "new weights changed nothing"
        assert engine.max_positions is None or engine.max_positions > len(prompt)
    finally:
        engine.close()
        engine.close()


__all__ = ["ENGINES", "EngineArgs", "EngineSpec", "check_engine"]
