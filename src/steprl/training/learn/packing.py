"""Prefix-tree packing of training rows: rows that share a prefix compute it once.

A row's tokens see exactly their own prefix (causal attention), so any set of rows can be
merged into one sequence per prefix tree (a trie over their token ids): each node is one token
of one or more rows, it attends to its ancestors and itself, and its position id is its depth.
Every node then has the hidden state it has in each row it belongs to, and the log-prob of a
row's token is read off its node, predicted from the node's parent. This is exact for any
causal LM, whatever made the rows:

* the G samples of a GRPO group share their prompt: prefilled once instead of G times;
* per-step rows of a history-editing context (`keep_last_k`, `drop_old_observations`,
  `strip_thinking`) share everything up to where the context was edited: the T rows of a
  trajectory, O(T^2) tokens for `drop_old_observations` and `strip_thinking`, become one tree of
  O(T) nodes.

A node is the loss position of at most one row: a second row whose *sampled* token lands on an
already-trained node gets a branch of its own, so every (row, token) loss term stays separate.
The per-step rows remain the reference (`rollout.views.per_step_view`); tests check the two
against each other to 1e-5 in log-probs and gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from steprl.rollout.views import Sample


class RowFields(Protocol):
    """A row's target-aligned tensors (`batching.RowTensors`), (len-1,) each."""

    @property
    def mask(self) -> torch.Tensor: ...
    @property
    def old(self) -> torch.Tensor: ...
    @property
    def adv(self) -> torch.Tensor: ...
    @property
    def ret(self) -> torch.Tensor: ...


#: Rows merged into one tree share their first this-many prompt tokens (the task's). Rows that
#: share fewer are packed apart: merging them would save little and grow the mask.
BUCKET_PREFIX = 8
#: Cap on one tree's nodes (a tree is one row of the learner's micro-batch).
MAX_TREE_NODES = 4096


@dataclass
class Tree:
    """One packed sequence: its structure. `parent[i] < i` (-1 for a root); `trained[i]`: the
    node is the sampled token of one of its rows, whose target data (`tree_tensors`) it carries."""

    ids: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    children: list[dict[int, list[int]]] = field(default_factory=list)  # token -> nodes
    roots: dict[int, list[int]] = field(default_factory=dict)
    #: for each row packed here: the node of each of its tokens
    nodes: list[list[int]] = field(default_factory=list)

    def _new(self, token: int, parent: int) -> int:
        self.ids.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1 if parent >= 0 else 0)
        self.trained.append(False)
        self.children.append({})
        return len(self.ids) - 1

    def add(self, s: Sample) -> None:
        path: list[int] = []
        here = -1
        for t, token in enumerate(s.input_ids):
            trained = bool(s.loss_mask[t]) if t < len(s.loss_mask) else False
            siblings = self.children[here] if here >= 0 else self.roots
            node = next((c for c in siblings.get(token, []) if not (trained and self.trained[c])), None)
            if node is None:
                node = self._new(token, here)
                siblings.setdefault(token, []).append(node)
            self.trained[node] = self.trained[node] or trained
            path.append(node)
            here = node
        self.nodes.append(path)


def pack(samples: Sequence[Sample]) -> tuple[list[Tree], list[tuple[int, int]]]:
    """Trees for `samples` and, per sample, (tree index, row index within that tree).

    Rows are bucketed by their first BUCKET_PREFIX tokens, cut at their first trained token (in
    order of first appearance), and a
    bucket's tree is closed once it would exceed MAX_TREE_NODES (a row longer than that gets a
    tree of its own).
    """
    trees: list[Tree] = []
    where: list[tuple[int, int]] = []
    open_tree: dict[tuple[int, ...], int] = {}
    for s in samples:
        # the row's prompt, up to BUCKET_PREFIX tokens: a group's rows share it, tasks differ in it
        first_trained = next((t for t, m in enumerate(s.loss_mask) if m), len(s.input_ids))
        key = s.input_ids[: min(BUCKET_PREFIX, first_trained)]
        b = open_tree.get(key)
        if b is None or len(trees[b].ids) + len(s.input_ids) > MAX_TREE_NODES:
            trees.append(Tree())
            b = open_tree[key] = len(trees) - 1
        trees[b].add(s)
        where.append((b, len(trees[b].nodes) - 1))
    return trees, where


def tree_tensors(
    trees: Sequence[Tree], rows: Sequence[Sequence[RowFields]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(input_ids (B, T), node validity (B, T), pred (B, T-1), per-target fields (B, T-1): mask,
    old, adv, ret). Target t is node t+1, predicted from the hidden state of node pred[t].

    `rows[b]`: the target-aligned fields of tree b's rows, in the order they were added: each
    trained token's values go to its node (a node is trained by at most one row)."""
    width = max(len(t.ids) for t in trees)
    bsz = len(trees)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    valid = torch.zeros((bsz, width), dtype=torch.long)
    pred = torch.zeros((bsz, width), dtype=torch.long)
    fields = {k: torch.zeros((bsz, width)) for k in ("mask", "old", "adv", "ret")}
    for b, t in enumerate(trees):
        n = len(t.ids)
        ids[b, :n] = torch.tensor(t.ids)
        valid[b, :n] = 1
        pred[b, :n] = torch.tensor(t.parent).clamp(min=0)
        for path, row in zip(t.nodes, rows[b], strict=True):
            on = row.mask > 0  # target t of the row is its token t+1: node path[t+1], never a root
            nodes = torch.tensor(path[1:], dtype=torch.long)[on]
            for k in fields:
                fields[k][b, nodes] = getattr(row, k)[on]
    return ids, valid, pred[:, 1:], {k: v[:, 1:] for k, v in fields.items()}


__all__ = ["BUCKET_PREFIX", "MAX_TREE_NODES", "RowFields", "Tree", "pack", "tree_tensors"]
