"""Every entry of `ENGINES` passes `check_engine` (vLLM's under the soak marker: its venv is
built on first use), and the run's engine comes from the registry."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from steprl.engines.base import ServingEngine
from steprl.engines.registry import ENGINES, EngineArgs, check_engine
from steprl.engines.weights import WeightUpdate
from steprl.models import tiny

SHAPE = tiny.TinyModelSpec(
    hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128
)  # vLLM: head_dim 32
PROMPT = (1, *range(20, 29))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.soak) if n == "vllm" else n for n in sorted(ENGINES)]
)
def test_every_engine_passes_check_engine(name: str, tokenizer: Any) -> None:
    t = tokenizer
    model = tiny.build_model(
        len(t), SHAPE, seed=0, pad_id=t.pad_token_id, bos_id=t.bos_token_id, eos_id=t.eos_token_id
    )
    python = ".venv-vllm/bin/python"
    if name == "vllm":
        from vllm_venv import vllm_python

        python = str(vllm_python())

    def make() -> ServingEngine:
        return ENGINES[name].make(EngineArgs(copy.deepcopy(model), t, max_positions=512, vllm_python=python))

    def new_weights(engine: ServingEngine) -> WeightUpdate:
        other = copy.deepcopy(model)
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(1.5)
        return WeightUpdate.of_tensors(other.state_dict(), engine.version + 1)

    check_engine(make, PROMPT, new_weights)
