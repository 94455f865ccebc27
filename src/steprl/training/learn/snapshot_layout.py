"""A health rollback's snapshot moved between learner layouts: taken by one process or by N
FSDP2 ranks, restored by one process or by M ranks (a run resumed with another
`runtime.learner_ranks` keeps the snapshots its ring checkpointed).

The two forms (`LocalLearner.snapshot`, `RankLearner.snapshot`):

* one process: ``{"params": [tensor per trainable parameter], "optimizer": optimizer.state_dict()}``
  (AdamW's state keyed by the parameter's index);
* N ranks: ``{"ranks": [{"params": [rank r's dim-0 shard per parameter], "optimizer": [{name:
  shard or scalar} per parameter]}, ...]}``.

Both list the parameters in the learner's order (`LocalLearner.params`: the model's trainable
parameters, then a shared value head's), which is the same in one process and on ranks, and
FSDP2 splits every parameter on dim 0 as `torch.chunk` does. So the full form is the ranks'
shards joined in rank order, and a rank's shard of it is its chunk: exact both ways.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: one parameter's full tensor and its optimizer state (tensors full, scalars as they are)
Full = tuple[list[torch.Tensor], list[dict[str, Any]]]


def full(snapshot: Mapping[str, Any]) -> Full:
    """Any snapshot as full tensors and each parameter's optimizer state."""
    if "ranks" not in snapshot:
        params = list(snapshot["params"])
        saved = snapshot["optimizer"].get("state", {})
        return params, [dict(saved.get(i, {})) for i in range(len(params))]
    ranks: Sequence[Mapping[str, Any]] = snapshot["ranks"]
    params, states = [], []
    for i, first in enumerate(ranks[0]["params"]):
        parts = [r["params"][i] for r in ranks]
        params.append(torch.cat(parts, dim=0) if first.dim() else first)
        state: dict[str, Any] = {}
        for key, value in ranks[0]["optimizer"][i].items():
            sharded = torch.is_tensor(value) and value.dim() and value.shape[1:] == first.shape[1:]
            state[key] = torch.cat([r["optimizer"][i][key] for r in ranks], dim=0) if sharded else value
        states.append(state)
    return params, states


def chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """`rank`'s dim-0 chunk of `t` as FSDP2 holds it (`torch.chunk`; empty past the last)."""
    if not t.dim():
        return t.clone()
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else t.new_empty((0, *t.shape[1:]))


def for_ranks(snapshot: Mapping[str, Any], world: int) -> dict[str, Any]:
    """`snapshot` in the form `world` ranks restore."""
    if "ranks" in snapshot and len(snapshot["ranks"]) == world:
        return dict(snapshot)
    params, states = full(snapshot)
    shapes = [p.shape for p in params]

    def shard(value: Any, shape: torch.Size, rank: int) -> Any:
        sharded = torch.is_tensor(value) and value.dim() and value.shape == shape
        return chunk(value, world, rank) if sharded else value

    return {
        "ranks": [
            {
                "params": [chunk(p, world, r) for p in params],
                "optimizer": [
                    {k: shard(v, shape, r) for k, v in s.items()}
                    for s, shape in zip(states, shapes, strict=True)
                ],
            }
            for r in range(world)
        ]
    }


def for_one(snapshot: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`snapshot` in the form one process restores; `param_groups`: its optimizer's own (the
    ranks' form keeps none: the learning rate is the run's, set by its levers)."""
    if "ranks" not in snapshot:
        return dict(snapshot)
    params, states = full(snapshot)
    state = {i: s for i, s in enumerate(states) if s}
    return {"params": params, "optimizer": {"state": state, "param_groups": [dict(g) for g in param_groups]}}


__all__ = ["chunk", "for_one", "for_ranks", "full"]
