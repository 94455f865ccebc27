"""Continuous batching: requests join the decoding batch between steps, and leave it when done.

A finished row leaves at once (its caller gets its generation and can step its env while the
others decode); a request that arrives meanwhile is prefilled and joins at the next step instead
of waiting for the longest row. Rows are right-aligned in one KV cache: a row's context sits in
the cache columns `_Row.cols` (the rest of its columns are masked), every decode step appends a
column for every row, and columns no row reads any more are trimmed.

Prefill reuses what the engine already holds (`prefix_cache.py`): a prompt that extends a stored
prefix starts from its keys and values, and identical prompts (a GRPO group's first turn) are
prefilled once. None of this changes which tokens are sampled: each row draws its own uniform
from (engine seed, request seed, its own token index) (`sampling.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from steprl.engines.base import FinishReason, Generation, SamplingParams
from steprl.engines.kv_cache import GrowingLayer, engine_cache, preloadable
from steprl.engines.prefix_cache import PrefixCache
from steprl.engines.sampling import ends_with_any, request_uniforms, sample_from_logits


@dataclass
class Request:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    future: asyncio.Future[Generation] | None  # the scheduler's caller; None outside it
    seed: int | None = None


@dataclass
class _Row:
    request: Request
    cols: list[int]  # cache columns of this row's context (prompt, then fed tokens), in order
    pos: int  # position id of the next token fed
    stops: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    done: bool = False  # finished (its caller has its generation); removed at the next compaction


class RunningBatch:
    """The rows being decoded together, their KV cache and their next-token logits."""

    def __init__(self, engine: Any) -> None:
        self.e = engine  # the HFEngine: model, ids, device, seeds, prefix cache, counters
        self.rows: list[_Row] = []
        self.past: Any = None
        self.attention = torch.zeros((0, 0), dtype=torch.long)
        self.logits = torch.zeros((0, 0))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> int:
        return sum(not r.done for r in self.rows)

    def steps_left(self) -> int:
        """At most this many more decode steps before every live row has hit its budget."""
        return max(
            (r.request.sampling.max_new_tokens - len(r.tokens) for r in self.rows if not r.done), default=0
        )

    def accepts(self, sp: SamplingParams) -> bool:
        """Rows share one temperature and top-p; joining mid-flight needs a preloadable cache."""
        if not self.rows:
            return True
        head = self.rows[0].request.sampling
        same = (sp.temperature, sp.top_p) == (head.temperature, head.top_p)
        return same and preloadable(self.past)

    @torch.no_grad()  # the engine never trains: no graph (a batch that never drains would keep it)
    def admit(self, requests: list[Request]) -> None:
        """Prefill `requests` (one forward pass) and add them to the batch."""
        self._compact()  # the merge below copies the cache anyway: drop finished rows first
        past, attention, logits, cols = self._prefill([r.prompt_ids for r in requests])
        rows = [
            _Row(r, c, len(r.prompt_ids), frozenset({*r.sampling.stop_token_ids, self.e.eos_token_id}))
            for r, c in zip(requests, cols, strict=True)
        ]
        if not self.rows:
            self.rows, self.past, self.attention, self.logits = rows, past, attention, logits
            return
        w_old, w_new = self.attention.shape[1], attention.shape[1]
        width = max(w_old, w_new)
        for layer, joining in zip(self.past.layers, past.layers, strict=True):
            k = torch.cat(
                [F.pad(layer.keys, (0, 0, width - w_old, 0)), F.pad(joining.keys, (0, 0, width - w_new, 0))]
            )
            v = torch.cat(
                [
                    F.pad(layer.values, (0, 0, width - w_old, 0)),
                    F.pad(joining.values, (0, 0, width - w_new, 0)),
                ]
            )
            cast(GrowingLayer, layer).preload(k, v)
        self.attention = torch.cat(
            [F.pad(self.attention, (width - w_old, 0)), F.pad(attention, (width - w_new, 0))]
        )
        for row in self.rows:
            row.cols = [c + width - w_old for c in row.cols]
        for row in rows:
            row.cols = [c + width - w_new for c in row.cols]
        self.rows += rows
        self.logits = torch.cat([self.logits, logits])

    @torch.no_grad()
    def step(self) -> list[tuple[Request, Generation]]:
        """Sample one token for every live row; finished rows are returned (and stop being fed
        their tokens); the others are fed theirs."""
        e, rows = self.e, self.rows
        sp = rows[0].request.sampling
        uniforms = torch.empty(len(rows), dtype=torch.float64)
        seeded = [i for i, r in enumerate(rows) if r.request.seed is not None]
        unseeded = [i for i, r in enumerate(rows) if r.request.seed is None]
        if seeded:
            seeds = [cast(int, rows[i].request.seed) for i in seeded]
            uniforms[seeded] = request_uniforms(e.seed, seeds, [len(rows[i].tokens) for i in seeded])
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), generator=e.generator, dtype=torch.float64)
        tokens, logps = sample_from_logits(self.logits, sp.temperature, sp.top_p, uniforms)
        done: list[tuple[Request, Generation]] = []
        version = e.version  # weights change between decode steps only (`HFEngine.update_weights`)
        for i, (row, tok, lp) in enumerate(zip(rows, tokens.tolist(), logps.tolist(), strict=True)):
            if row.done:
                continue
            if row.request.future is not None and row.request.future.done():
                row.done = True  # its caller gave up (a cancel: a client gone, a shutdown): stop decoding it
                continue
            row.tokens.append(tok)
            row.logps.append(lp)
            row.versions.append(version)
            stop = tok in row.stops or ends_with_any(row.tokens, row.request.sampling.stop_sequences)
            if stop or len(row.tokens) >= row.request.sampling.max_new_tokens:
                reason: FinishReason = "stop" if stop else "length"
                gen = Generation(tuple(row.tokens), tuple(row.logps), reason, tuple(row.versions))
                done.append((row.request, gen))
                self._keep_prefix(i, row)
                row.done = True
        e.tokens_generated += sum(len(g.token_ids) for _, g in done)
        finished = torch.tensor([r.done for r in rows], device=tokens.device)
        fed = torch.where(finished, torch.full_like(tokens, e.pad_token_id), tokens)  # pads are ignored
        if self.e.continuous and self.live * 2 < len(self.rows):  # mostly finished rows: drop them
            fed = fed[~finished]
            self._compact()
        if self.live:
            self._feed(fed)
        else:
            self.rows, self.past = [], None
        return done

    def _compact(self) -> None:
        """Drop finished rows from the cache, and the columns no live row reads any more."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.past = [], None
            return
        self.past.batch_select_indices(torch.tensor(keep, device=self.e.device))
        self.attention, self.logits = self.attention[keep], self.logits[keep]
        self.rows = [self.rows[i] for i in keep]
        start = min(r.cols[0] for r in self.rows)  # columns left of every row's context
        if start >= 32 and start * 2 >= self.attention.shape[1] and preloadable(self.past):
            for layer in self.past.layers:
                cast(GrowingLayer, layer).drop_left(start)
            self.attention = self.attention[:, start:]
            for r in self.rows:
                r.cols = [c - start for c in r.cols]

    def _feed(self, tokens: torch.Tensor) -> None:
        e, n = self.e, len(self.rows)
        column = self.attention.shape[1]
        self.attention = torch.cat([self.attention, torch.ones((n, 1), dtype=torch.long, device=e.device)], 1)
        positions = torch.tensor([[r.pos] for r in self.rows], device=e.device)
        out = e.model(
            input_ids=tokens[:, None].to(e.device),
            attention_mask=self.attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{e.cache_kw: self.past},
        )
        e.forward_passes += 1
        self.logits = out.logits[:, -1, :].float()
        for r in self.rows:
            r.cols.append(column)
            r.pos += 1

    def _prefill(
        self, prompts: list[tuple[int, ...]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, list[list[int]]]:
        """One forward pass over what is new in each prompt: (cache, attention, next-token
        logits (B, V), per row the cache columns that hold its prompt).

        Layout, per unique prompt u: [stored prefix, right-aligned in the first `wc` columns]
        [new tokens, left-padded in the next `ws`]; padding is masked out. Duplicates get a copy
        of their prompt's row.
        """
        e = self.e
        unique = list(dict.fromkeys(prompts))
        past = engine_cache(e.model)
        prefix: PrefixCache | None = e.prefix_cache
        hits = [prefix.take(p) if prefix is not None else None for p in unique]
        cached = [h[0] if h else 0 for h in hits]
        new = [p[c:] for p, c in zip(unique, cached, strict=True)]
        n, wc, ws = len(unique), max(cached), max(len(x) for x in new)
        ids = torch.full((n, ws), e.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, wc + ws), dtype=torch.long)
        positions = torch.zeros((n, ws), dtype=torch.long)
        cols: list[list[int]] = []
        for u, (c, x) in enumerate(zip(cached, new, strict=True)):
            ids[u, ws - len(x) :] = torch.tensor(x)
            attention[u, wc - c : wc] = 1
            attention[u, wc + ws - len(x) :] = 1
            positions[u, ws - len(x) :] = torch.arange(c, c + len(x))
            cols.append([*range(wc - c, wc), *range(wc + ws - len(x), wc + ws)])
        if wc:
            for index, layer in enumerate(past.layers):
                k0, v0 = next(h[1][index] for h in hits if h)
                keys = k0.new_zeros((n, k0.shape[0], wc, k0.shape[-1]))
                values = v0.new_zeros((n, v0.shape[0], wc, v0.shape[-1]))
                for u, h in enumerate(hits):
                    if h:
                        keys[u, :, wc - h[0] :] = h[1][index][0]
                        values[u, :, wc - h[0] :] = h[1][index][1]
                cast(GrowingLayer, layer).preload(keys.to(e.device), values.to(e.device))
        attention = attention.to(e.device)
        out = e.model(
            input_ids=ids.to(e.device),
            attention_mask=attention,
            position_ids=positions.to(e.device),
            use_cache=True,
            logits_to_keep=1,
            **{e.cache_kw: past},
        )
        e.forward_passes += 1
        logits = out.logits[:, -1, :].float()
        if n < len(prompts):  # every duplicate gets its own copy of the one prefilled row
            where = {p: u for u, p in enumerate(unique)}
            rows = [where[p] for p in prompts]
            sel = torch.tensor(rows, device=e.device)
            past.batch_select_indices(sel)
            attention, logits = attention[sel], logits[sel]
            cols = [list(cols[r]) for r in rows]
        return past, attention, logits, cols

    def _keep_prefix(self, i: int, row: _Row) -> None:
        """Store row i's `prompt + output[:-1]` keys and values for its trajectory's next turn."""
        prefix: PrefixCache | None = self.e.prefix_cache
        if prefix is None or not preloadable(self.past):
            return
        cols = torch.tensor(row.cols, device=self.e.device)
        kv = tuple(
            (layer.keys[i].index_select(1, cols), layer.values[i].index_select(1, cols))
            for layer in self.past.layers
        )
        prefix.put((*row.request.prompt_ids, *row.tokens[:-1]), kv)
