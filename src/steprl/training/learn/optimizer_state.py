"""An optimizer's state keyed two ways: by parameter index (`torch.optim.Optimizer.state_dict`,
what one learner process checkpoints) and by parameter name (what the ranks' full state dict
gives, `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`). Converting between
them is what lets a checkpoint written by N learner processes resume on M: the names are those
of the model's trainable parameters, in `named_parameters()` order, which is the optimizer's
index order (the learner builds its optimizer from them in that order)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Index-keyed -> name-keyed (a one-process checkpoint resumed on ranks)."""
    return {
        "state": {names[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def by_index(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Name-keyed -> index-keyed (a ranks' checkpoint resumed in one process)."""
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state for parameters this model lacks: {unknown[:3]}")
    return {
        "state": {index[n]: s for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


__all__ = ["by_index", "by_name"]
