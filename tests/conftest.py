"""Shared fixtures: the embedded tokenizer and a very small randomly initialised tiny model."""

from __future__ import annotations

import pytest
import torch

from steprl.models import tiny


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def small_model(tokenizer):
    torch.manual_seed(0)
    spec = tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = tiny.build_model(
        len(tokenizer),
        spec,
        seed=0,
        pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
    )
    return model.eval()
