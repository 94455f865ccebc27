"""The learner's weights and optimizer state through `torch.distributed.checkpoint` (DCP).

Learner ranks (`runtime.learner_ranks` > 1) write a checkpoint's learner state this way: every
rank writes its own shards in parallel into the checkpoint's `learner/` directory, and nothing
is gathered into one process. DCP records each tensor's global shape and where each shard
lies, so the directory loads on **any** number of ranks (resharded as it is read) and in one
process with no process group (`no_dist`: each tensor read whole). The same two functions
serve both: `fully_shard` models hold DTensors, a plain model plain tensors.

A LoRA policy keeps only its adapters (and their optimizer state) here: the frozen base is the
one the run starts from and rebuilds on resume. Keys are parameter names
(`model.layers.0.self_attn.q_proj.weight`, and the optimizer's state by the same names), so
the layout does not depend on how the parameters were ordered or split.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

#: the checkpoint's subdirectory a sharded learner writes
LEARNER_DIR = "learner"
#: where a shared critic's value head sits among the model's modules: on ranks always (an FSDP2
#: unit with the root's), in one process while a sharded checkpoint is read; so its weights and
#: optimizer state are keyed `steprl_value_head.*` beside the policy's
HEAD = "steprl_value_head"


@contextlib.contextmanager
def with_head(model: nn.Module, head: nn.Module | None) -> Iterator[None]:
    """`model` with `head` as its `HEAD` submodule while the block runs (as it is on ranks)."""
    if head is None or getattr(model, HEAD, None) is head:
        yield
        return
    model.add_module(HEAD, head)
    try:
        yield
    finally:
        del model._modules[HEAD]


def save(model: nn.Module, optimizer: Optimizer, path: Path) -> bool:
    """This process's part of the weights and optimizer state into `path` (every rank calls it:
    a collective; one process writes everything). An optimizer that has not stepped yet has no
    state to save (reading it would make some: torch runs a zero-gradient step to lay it out),
    so only the weights are written; returns whether the optimizer state was."""
    stepped = bool(optimizer.state)
    if stepped:
        weights, optim = get_state_dict(model, optimizer)
        state = {"model": _trained(model, weights), "optimizer": optim}
    else:
        state = {"model": _trained(model, get_model_state_dict(model))}
    with _one_process_is_meant():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    return stepped


def load(
    model: nn.Module, optimizer: Optimizer, path: Path, *, stepped: bool, head: nn.Module | None = None
) -> None:
    """The weights (and, if `stepped`, the optimizer state) in `path`, written on any number of
    ranks, into `model` and `optimizer` as they are laid out here; exact, so a resume continues
    bit for bit. `head`: a shared critic's value head, read from beside the policy's weights."""
    with with_head(model, head):
        _load(model, optimizer, path, stepped=stepped)


def _load(model: nn.Module, optimizer: Optimizer, path: Path, *, stepped: bool) -> None:
    no_dist = not dist.is_initialized()
    partial = StateDictOptions(strict=False)  # LoRA: the frozen base is not in the checkpoint
    if not stepped:
        weights = _trained(model, get_model_state_dict(model))
        with _one_process_is_meant():
            dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=no_dist)
        set_model_state_dict(model, weights, options=partial)
        return
    full, optim = get_state_dict(model, optimizer)  # the layout to fill (optimizer state made)
    state = {"model": _trained(model, full), "optimizer": optim}
    with _one_process_is_meant():
        dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=partial,
    )


def _trained(model: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """The weights a checkpoint keeps: all of them, or with frozen parameters (LoRA's base, as
    it started and as the run rebuilds it) only the trained ones."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if not frozen:
        return weights
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in weights.items() if k in trained}


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


__all__ = ["HEAD", "LEARNER_DIR", "load", "save", "with_head"]
