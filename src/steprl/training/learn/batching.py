"""Collating training rows into right-padded, target-aligned tensors; chunked token log-probs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steprl.errors import UserError
from steprl.rollout.views import Sample, targets
from steprl.training.learn.packing import Tree, pack, tree_tensors
from steprl.training.learn.tree_forward import tree_hidden


@dataclass(frozen=True)
class Layout:
    """Where each row's targets sit in a batch's (B, T-1) tensors: row `rows[i]`, columns
    `cols[i]` for target t of sample i (t = 0 .. len-2); `trained[i]` its loss mask there."""

    rows: tuple[torch.Tensor, ...]
    cols: tuple[torch.Tensor, ...]
    trained: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for one micro-batch. Targets are input_ids[:, 1:].

    input_ids, attention: (B, T). Every other per-token field is (B, T-1), aligned with the
    targets: position t is about the prediction of input_ids[:, t+1], made from the hidden state
    at `pred[:, t]` (None: t itself; for packed `trees` (training/learn/packing.py), one per row, the
    node's parent). `layout` maps each sample's targets to batch positions.
    """

    input_ids: torch.Tensor
    attention: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    pred: torch.Tensor | None = None
    layout: Layout | None = None
    trees: tuple[Tree, ...] | None = None  # packed: the forward runs over these (tree_forward.py)

    def to(self, device: str | torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(
            self.input_ids.to(device),
            self.attention.to(device),
            self.loss_mask.to(device),
            self.old_logp.to(device),
            self.advantages.to(device),
            self.returns.to(device),
            move(self.pred),
            self.layout,
            self.trees,
        )

    def per_sample(self, x: torch.Tensor) -> list[torch.Tensor]:
        """(B, T-1) batch layout -> one (len-1,) tensor per sample, in the samples' order."""
        if self.layout is None:
            raise ValueError("this batch has no layout (collate(..., with_layout=True))")
        return [
            x[r.to(x.device), c.to(x.device)] for r, c in zip(self.layout.rows, self.layout.cols, strict=True)
        ]

    def from_per_sample(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """One (len-1,) tensor per sample -> (B, T-1), written where each sample is trained."""
        if self.layout is None:
            raise ValueError("this batch has no layout (collate(..., with_layout=True))")
        out = torch.zeros(self.loss_mask.shape)
        for v, r, c, m in zip(values, self.layout.rows, self.layout.cols, self.layout.trained, strict=True):
            keep = m > 0
            out[r[keep], c[keep]] = v[: len(m)].float().cpu()[keep]
        return out


@dataclass(frozen=True)
class RowTensors:
    """One row's tensors: input ids (L,) and its target-aligned fields (L-1,), float32."""

    ids: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    ret: torch.Tensor


def row_tensors(s: Sample) -> RowTensors:
    """A row's token lists as tensors: the one conversion a row goes through (`Collator`)."""
    width = len(s.input_ids) - 1

    def field(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(targets(values), dtype=torch.float32) if values else torch.zeros(width)

    return RowTensors(
        torch.tensor(s.input_ids, dtype=torch.long),
        field(s.loss_mask),
        field(s.old_logprobs),
        field(s.advantages),
        field(s.returns),
    )


class Collator:
    """A set of rows, each turned into tensors once (`row_tensors`, on the first micro-batch that
    holds it); every micro-batch is then padded (or packed) from those tensors. A learner keeps
    one per set of rows, so all its passes over a step's rows (policy, reference and values; the
    proximal pass and every epoch's backward) collate each row once (`converted` counts them)."""

    def __init__(self, samples: Sequence[Sample], pad_id: int) -> None:
        self.samples = tuple(samples)
        self.pad_id = pad_id
        self.converted = 0
        self._rows: dict[int, RowTensors] = {}

    def holds(self, samples: Sequence[Sample]) -> bool:
        """Whether `samples` are this collator's rows: the same objects in the same order (the
        rows are frozen, so their tensors stay valid)."""
        return len(samples) == len(self.samples) and all(
            a is b for a, b in zip(samples, self.samples, strict=True)
        )

    def row(self, i: int) -> RowTensors:
        if i not in self._rows:
            self._rows[i] = row_tensors(self.samples[i])
            self.converted += 1
        return self._rows[i]

    def __call__(self, idx: Sequence[int], *, pack: bool = False) -> Batch:
        rows = [self.row(i) for i in idx]
        packed = _packed([self.samples[i] for i in idx], rows, self.pad_id) if pack else None
        return packed or _padded(rows, self.pad_id)


def collate(samples: Sequence[Sample], pad_id: int, *, pack: bool = False) -> Batch:
    """Pad rows on the right (causal attention makes right padding invisible to real tokens).

    `pack`: merge rows that share a prefix into prefix trees (`training/learn/packing.py`), each a row
    of the batch with a (T, T) ancestor mask; the targets are the same, computed once per node.
    """
    return Collator(samples, pad_id)(range(len(samples)), pack=pack)


def _padded(rows: Sequence[RowTensors], pad_id: int) -> Batch:
    width = max(r.ids.numel() for r in rows)
    bsz = len(rows)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    # the batch's per-token tensors are target-aligned (column t: the prediction of token t+1)
    per_token = {k: torch.zeros((bsz, width - 1)) for k in ("mask", "old", "adv", "ret")}
    for i, r in enumerate(rows):
        n = r.ids.numel()
        ids[i, :n] = r.ids
        attn[i, :n] = 1
        for k, t in per_token.items():
            t[i, : n - 1] = getattr(r, k)
    mask = per_token["mask"]
    layout = Layout(
        tuple(torch.full((r.ids.numel() - 1,), i) for i, r in enumerate(rows)),
        tuple(torch.arange(r.ids.numel() - 1) for r in rows),
        tuple(r.mask for r in rows),
    )
    return Batch(ids, attn, mask, per_token["old"], per_token["adv"] * mask, per_token["ret"], layout=layout)


#: Pack only when the trees hold at most this share of the rows' tokens: a tree runs as several
#: short forward passes (one per level), worth it only when prefixes are shared.
PACK_WHEN_NODES_BELOW = 0.8


def _packed(samples: Sequence[Sample], rows: Sequence[RowTensors], pad_id: int) -> Batch | None:
    """The rows as prefix trees, or None when packing would save too little (then: padded)."""
    trees, where = pack(samples)
    if sum(len(t.ids) for t in trees) > PACK_WHEN_NODES_BELOW * sum(r.ids.numel() for r in rows):
        return None
    in_tree: list[list[RowTensors]] = [[] for _ in trees]
    for (b, _), r in zip(where, rows, strict=True):
        in_tree[b].append(r)  # `pack` adds each tree's rows in the samples' order
    ids, valid, pred, f = tree_tensors(trees, in_tree, pad_id)
    cols = [torch.tensor(trees[b].nodes[r][1:]) - 1 for b, r in where]  # target t: node t+1's column
    layout = Layout(
        tuple(torch.full(c.shape, b) for (b, _), c in zip(where, cols, strict=True)),
        tuple(cols),
        tuple(r.mask for r in rows),
    )
    mask = f["mask"]
    return Batch(ids, valid, mask, f["old"], f["adv"] * mask, f["ret"], pred, layout, tuple(trees))


#: Size of one fp32 (chunk, V) logits block. The head's live memory is a small multiple of it
#: (logits, log-probs, probabilities; their grads during a chunk's backward recompute).
CHUNK_BYTES = 64 * 2**20


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a learner rank's part), or a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def device_of(model: nn.Module) -> torch.device:
    """Where `model` computes: its first parameter's device, or its head's for a module that
    registers none (`AdaptersDisabled`, a LoRA run's KL reference)."""
    first = next(model.parameters(), None)
    if first is not None:
        return first.device
    hf: Any = model
    return hf.get_output_embeddings().weight.device


def last_hidden(model: nn.Module, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Final hidden states (B, T, H) of a causal LM, after its final norm, without (B, T, V) logits.

    `logits_to_keep=1` makes the model apply its head to the last position only, and transformers
    ties `hidden_states[-1]` to the normed `last_hidden_state`. The one logits row that comes back
    checks that `head_logits` reproduces the model's own logits: a model that post-processes them
    in another way (a logit scale, a missing norm) fails loudly instead of training on wrong
    log-probs.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    hidden = out.hidden_states[-1]
    with torch.no_grad():
        _check_head(model, hidden[:, -1], out.logits[:, -1])
    return hidden


def batch_hidden(model: nn.Module, b: Batch) -> torch.Tensor:
    """Final hidden states (B, T, H) of a batch: of its rows, or of each packed tree's nodes."""
    if b.trees is not None:
        return tree_hidden(model, b.trees, b.input_ids.device)
    return last_hidden(model, b.input_ids, b.attention)


def packing_unsupported(model: nn.Module) -> str | None:
    """Why prefix-tree rows (segments run after their ancestors' keys and values, handed in as
    the KV cache) would be wrong for `model`, or None when they are exact: full attention in
    every layer, so a cached prefix is all a segment needs."""
    cfg = _text_config(model)
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(cfg, "sliding_window", None):
        return f"layer types {sorted(kinds)} (a sliding window ignores a custom mask)"
    return None


def head_logits(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden (N, H) -> fp32 logits (N, V), as the model's forward makes them (soft-cap included).

    fp32 weights even for a bf16 model, so log-probs are fp32 like the engine's `.float()` logits.
    """
    hf: Any = model  # a transformers model, a peft wrapper or anything exposing the same two
    head = hf.get_output_embeddings()
    cap = getattr(_text_config(model), "final_logit_softcapping", None)  # Gemma 2/3: cap * tanh(z / cap)
    if isinstance(head, nn.Linear):

        def linear(h: torch.Tensor) -> torch.Tensor:
            # .float() is the parameter itself for fp32 models; a bf16 head is cast per call so
            # each recompute in the backward builds its own graph to the parameter
            bias = _whole(head.bias).float() if head.bias is not None else None
            return F.linear(h.float(), _whole(head.weight).float(), bias)
    else:  # e.g. a peft LoRA layer on lm_head: only its own forward knows the adapter

        def linear(h: torch.Tensor) -> torch.Tensor:
            return head(h).float()

    def logits(h: torch.Tensor) -> torch.Tensor:
        z = linear(h)
        return torch.tanh(z / cap) * cap if cap else z

    return logits


def _whole(t: torch.Tensor) -> torch.Tensor:
    """`t`, or on learner ranks a head FSDP2 left sharded after the forward (seen after a first
    forward through LoRA's reference, adapters disabled): gathered, as every rank does at the
    same point of the same pass."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _text_config(model: nn.Module) -> Any:
    """The language model's config (a multimodal config keeps it under `text_config`)."""
    cfg: Any = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _check_head(model: nn.Module, hidden: torch.Tensor, model_logits: torch.Tensor) -> None:
    """hidden (B, H), model_logits (B, V): raise unless head_logits(hidden) == the model's logits."""
    hf: Any = model
    head = hf.get_output_embeddings()
    if not isinstance(head, nn.Linear) and head.training:
        return  # a head with its own forward may draw dropout: two calls need not agree
    ours = head_logits(model)(hidden)
    theirs = model_logits.float()
    fp32 = hidden.dtype == torch.float32 and model_logits.dtype == torch.float32
    tol = (1e-4 if fp32 else 2e-2) * (1.0 + float(theirs.abs().max()))  # bf16 logits: ~3 digits
    err = float((ours - theirs).abs().max())
    if err > tol:
        raise UserError(
            f"{type(model).__name__}: get_output_embeddings() on hidden_states[-1] does not give the "
            f"model's own logits (max difference {err:.3g}); its forward post-processes logits in a "
            "way steprl's chunked log-probs (training/learn/batching.py) do not know"
        )


def _chunk_stats(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    h: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (c, H), targets (c,) -> log-prob of each target and entropy, (c,) each, fp32."""
    logits = logits_of(h)
    if temperature > 0:  # same order as the engine: the model's (capped) logits, then / T
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class _ChunkStats(torch.autograd.Function):
    """`_chunk_stats` that keeps only its (c,) outputs and h for the backward pass.

    The backward recomputes the chunk's logits and writes the softmax gradients in closed form:
    d logp_t / dz = onehot(t) - p and d H / dz = -p * (log p + H), z = logits / T. Generic
    activation checkpointing would recompute every tensor the forward saved, and keep those of
    an unused output (the entropy, when only log-probs are trained) alive until the whole
    backward ends: about two (c, V) tensors per chunk, i.e. the (N, V) memory this avoids.
    """

    @staticmethod
    def forward(
        ctx: Any, logits_of: Any, temperature: float, h: torch.Tensor, targets: torch.Tensor, *params: Any
    ) -> Any:
        ctx.set_materialize_grads(False)
        ctx.logits_of, ctx.temperature = logits_of, temperature
        ctx.rng = _rng_state(h.device)  # a head with dropout draws the same mask in backward
        logp, entropy = _chunk_stats(logits_of, temperature, h, targets)
        ctx.save_for_backward(h, targets, entropy, *params)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> Any:
        h, targets, entropy, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        with torch.enable_grad(), _rng_restored(h.device, ctx.rng):
            h_in = h.detach().requires_grad_(ctx.needs_input_grad[2])
            logits = ctx.logits_of(h_in)  # a fresh graph from h and the head's parameters
        t = ctx.temperature if ctx.temperature > 0 else 1.0
        with torch.no_grad():
            logp_all = torch.log_softmax(logits.detach() / t, dim=-1)
            p = logp_all.exp()
            grad = torch.zeros_like(p)
            if g_logp is not None:
                grad -= p * g_logp[:, None]
                grad.scatter_add_(1, targets[:, None], g_logp[:, None])
            if g_ent is not None:
                grad -= (logp_all + entropy[:, None]) * p * g_ent[:, None]
            grad /= t
        del logp_all, p
        wanted = [h_in] if ctx.needs_input_grad[2] else []
        wanted += [x for x, need in zip(params, needs, strict=True) if need]
        grads = iter(torch.autograd.grad(logits, wanted, grad, allow_unused=True) if wanted else ())
        grad_h = next(grads) if ctx.needs_input_grad[2] else None
        return None, None, grad_h, None, *(next(grads) if need else None for need in needs)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng_restored(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def logprobs_at(
    model: nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    pred: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and predictive entropy, only where `mask` is set.

    hidden: (B, T, H) from `last_hidden`; input_ids: (B, T); mask: (B, T-1), target-aligned.
    Returns logp, entropy: (B, T-1) fp32, 0 off the mask. The N selected positions go through the
    head `chunk_size` rows at a time (default: a (chunk, V) fp32 block of CHUNK_BYTES) and the
    backward recomputes each chunk (`_ChunkStats`), so neither pass holds more than one chunk's
    (chunk, V) tensors; gradients reach the model through `hidden` and the head's parameters.
    """
    sel = mask > 0
    if pred is None:  # plain rows: target t+1 is predicted at t
        h = hidden[:, :-1][sel]  # (N, H)
    else:  # packed trees: at the node's parent
        h = hidden.gather(1, pred[..., None].expand(-1, -1, hidden.shape[-1]))[sel]
    targets = input_ids[:, 1:][sel]  # (N,)
    logits_of = head_logits(model)
    hf: Any = model
    head = hf.get_output_embeddings()
    vocab = int(_text_config(model).vocab_size)
    size = chunk_size or max(1, CHUNK_BYTES // (4 * vocab))
    params = [p for p in head.parameters() if p.requires_grad]
    parts = []
    # an empty selection still runs one (0, H) chunk so the result stays in the autograd graph
    for i in range(0, h.shape[0], size) if h.shape[0] else [0]:
        args = (logits_of, temperature, h[i : i + size], targets[i : i + size])
        if torch.is_grad_enabled():
            parts.append(_ChunkStats.apply(*args, *params))
        else:
            parts.append(_chunk_stats(*args))
    zeros = torch.zeros(sel.shape, dtype=torch.float32, device=hidden.device)
    logp = zeros.masked_scatter(sel, torch.cat([p[0] for p in parts]))
    entropy = zeros.masked_scatter(sel, torch.cat([p[1] for p in parts]))
    return logp, entropy


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    temperature: float = 1.0,
    *,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each predictive distribution.

    Same numerics as the engine: fp32 logits divided by the sampling temperature. input_ids,
    attention: (B, T); mask: (B, T-1) positions wanted (default: every real target). Returns
    logp, entropy: (B, T-1), 0 off the mask. No (B, T, V) tensor is made (`logprobs_at`).
    """
    hidden = last_hidden(model, input_ids, attention)
    wanted = attention[:, 1:] > 0 if mask is None else mask
    return logprobs_at(model, hidden, input_ids, wanted, temperature, chunk_size)


def token_budget_batches(
    lengths: Sequence[int], idx: Sequence[int], rows: int, tokens: int
) -> list[list[int]]:
    """`idx` in order, cut into micro-batches of at most `rows` rows whose padded size (rows x the
    longest) stays within `tokens`; a row longer than `tokens` alone."""
    out: list[list[int]] = [[]]
    longest = 0
    for i, n in zip(idx, lengths, strict=True):
        if out[-1] and (len(out[-1]) >= rows or (len(out[-1]) + 1) * max(longest, n) > tokens):
            out.append([])
            longest = 0
        out[-1].append(i)
        longest = max(longest, n)
    return out


def minibatches(n: int, num: int, generator: torch.Generator) -> list[list[int]]:
    """Shuffle n row indices and split them into `num` near-equal mini-batches."""
    order = torch.randperm(n, generator=generator).tolist()
    size = max(1, -(-n // num))
    return [order[i : i + size] for i in range(0, n, size)]
