"""The forward pass over prefix trees: every node once, attending only to its own ancestors.

A tree (`training/learn/packing.py`) is cut into segments, maximal runs of nodes where each continues
the one before (a shared prompt, a trajectory's kept context, one action). Segments are run a
level at a time: a segment's ancestors were computed at earlier levels, so their keys and values
are handed to the model as its KV cache (with their gradients), and the segment is an ordinary
short causal sequence after that prefix, at the positions its nodes have in their rows. This
costs what the nodes cost: no (nodes x nodes) attention over a whole tree, most of which would
be masked, and no mask to build.

Works for any transformers causal LM whose cache is a plain per-layer key/value cache (full
attention; `batching.packing_unsupported` says which are not).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from steprl.training.learn.packing import Tree


@dataclass
class _Segment:
    tree: int
    nodes: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # ancestor nodes, root first
    level: int = 0


def segments(trees: Sequence[Tree]) -> list[_Segment]:
    """Cut each tree into runs: a node continues its parent's segment when the parent is that
    segment's last node; any other child starts a segment whose prefix is the parent's path."""
    out: list[_Segment] = []
    for b, t in enumerate(trees):
        seg_of = [0] * len(t.ids)
        for i, p in enumerate(t.parent):
            if p >= 0 and out[seg_of[p]].nodes[-1] == p:
                seg_of[i] = seg_of[p]
                out[seg_of[i]].nodes.append(i)
                continue
            parent_seg = out[seg_of[p]] if p >= 0 else None
            prefix = []
            if parent_seg is not None:
                prefix = [*parent_seg.prefix, *parent_seg.nodes[: parent_seg.nodes.index(p) + 1]]
            level = parent_seg.level + 1 if parent_seg is not None else 0
            out.append(_Segment(b, [i], prefix, level))
            seg_of[i] = len(out) - 1
    return out


def _cache_keyword(model: nn.Module) -> str:
    inner = getattr(model, "get_base_model", lambda: model)()
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def tree_hidden(model: nn.Module, trees: Sequence[Tree], device: torch.device | str) -> torch.Tensor:
    """Final hidden states (len(trees), max nodes, H) of every tree node, differentiable.

    Node j of tree b gets the hidden state it has in each row it belongs to (its ancestors are
    exactly the tokens before it in those rows, at the same positions).
    """
    segs = segments(trees)
    flat: dict[tuple[int, int], int] = {}  # (tree, node) -> row in the stored keys/values
    keys: list[list[torch.Tensor]] = []  # per layer, chunks of (n, kv_heads, head_dim)
    values: list[list[torch.Tensor]] = []
    hidden_parts: list[torch.Tensor] = []
    where: list[tuple[int, int]] = []
    stored = 0
    cache_kw = _cache_keyword(model)
    for level in range(max(s.level for s in segs) + 1):
        batch = [s for s in segs if s.level == level]
        p_max, s_max = max(len(s.prefix) for s in batch), max(len(s.nodes) for s in batch)
        ids = torch.zeros((len(batch), s_max), dtype=torch.long)
        pos = torch.zeros((len(batch), s_max), dtype=torch.long)
        attn = torch.zeros((len(batch), p_max + s_max), dtype=torch.long)
        gather = torch.zeros((len(batch), p_max), dtype=torch.long)
        for r, s in enumerate(batch):
            t, n, p = trees[s.tree], len(s.nodes), len(s.prefix)
            ids[r, :n] = torch.tensor([t.ids[i] for i in s.nodes])
            pos[r, :n] = torch.arange(p, p + n)
            attn[r, p_max - p : p_max + n] = 1  # the prefix right-aligned, then the segment
            if p:
                gather[r, p_max - p :] = torch.tensor([flat[(s.tree, i)] for i in s.prefix])
        cache = DynamicCache()
        if p_max:
            idx = gather.to(device)
            for layer in range(len(keys)):
                k = torch.cat(keys[layer])[idx].transpose(1, 2)  # (B, kv_heads, P, D)
                v = torch.cat(values[layer])[idx].transpose(1, 2)
                cache.update(k, v, layer)
        out = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            position_ids=pos.to(device),
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
        valid = torch.zeros((len(batch), s_max), dtype=torch.bool)
        for r, s in enumerate(batch):
            valid[r, : len(s.nodes)] = True
            for i in s.nodes:
                flat[(s.tree, i)] = stored
                stored += 1
                where.append((s.tree, i))
        valid = valid.to(device)
        hidden_parts.append(out.hidden_states[-1][valid])
        for layer, cached in enumerate(cache.layers):
            if layer == len(keys):
                keys.append([])
                values.append([])
            k_all, v_all = cast(torch.Tensor, cached.keys), cast(torch.Tensor, cached.values)  # type: ignore[union-attr]
            keys[layer].append(k_all[:, :, p_max:].transpose(1, 2)[valid])  # (n, kv_heads, D)
            values[layer].append(v_all[:, :, p_max:].transpose(1, 2)[valid])
    nodes = torch.cat(hidden_parts)
    width = max(len(t.ids) for t in trees)
    b_idx = torch.tensor([b for b, _ in where], device=nodes.device)
    n_idx = torch.tensor([i for _, i in where], device=nodes.device)
    out_shape = (len(trees), width, nodes.shape[-1])
    return torch.zeros(out_shape, dtype=nodes.dtype, device=nodes.device).index_put((b_idx, n_idx), nodes)
