"""Checkpoints: model + tokenizer (HF format), optimizer, step, policy version and RNG state."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


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
