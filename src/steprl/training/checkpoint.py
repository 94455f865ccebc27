"""Checkpoints: model + tokenizer (HF format), optimizer, step, policy version and RNG state.

With LoRA the model part is the adapters (`adapter_model.safetensors` + `adapter_config.json`,
which names the base; `training/lora.py: save_adapters`) and the optimizer state is the adapters'.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from steprl.training.lora import is_adapter_checkpoint, is_peft, load_adapter_checkpoint, save_adapters


def save_checkpoint(
    path: Path,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    step: int,
    version: int,
    config_yaml: str,
    generator: torch.Generator,
) -> Path:
    """Write to a temp dir, then rename: a crash mid-save never leaves a half checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if is_peft(model):
        save_adapters(model, tmp, path)
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "step": step,
            "policy_version": version,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "shuffle_rng": generator.get_state(),
        },
        tmp / "trainer_state.pt",
    )
    (tmp / "config.yaml").write_text(config_yaml)
    if path.exists():
        old = path.with_name(path.name + ".old")
        path.rename(old)
        tmp.rename(path)
        for f in sorted(old.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        old.rmdir()
    else:
        tmp.rename(path)
    return path


def load_checkpoint_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The policy of a checkpoint as a plain `transformers` model, ready to generate: a full
    checkpoint as saved; a LoRA one as its named base with the adapters merged in."""
    if is_adapter_checkpoint(path):
        return load_adapter_checkpoint(path, merged=True, dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
