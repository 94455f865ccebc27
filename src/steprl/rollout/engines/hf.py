"""A Hugging Face `transformers` engine: batched, KV-cached sampling with per-token log-probs.

Concurrent `generate` calls (one per live trajectory) are queued; a single batcher task drains
the queue, left-pads the prompts, prefills them in one forward pass and decodes with the KV
cache until every row has stopped. CPU by default; the device is configurable.

Sampling is seeded per request. The agent loop gives every turn of every episode its own seed;
the engine turns (engine seed, request seed, token index) into one uniform number with a
counter-based hash and samples by inverse CDF. So which tokens a trajectory gets does not depend
on which other requests shared its batch, or in which order envs answered: an env behind an HTTP
server or in a Ray actor (answering at its own pace) gives the same rollouts as an in-process
one, up to float rounding in the batched forward pass (~1e-7 in the logits on CPU). Requests
without a seed draw from the engine's generator, in batch order.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from steprl.rollout.engines.base import Generation, SamplingParams
from steprl.rollout.engines.kv_cache import GrowingLayer, engine_cache, preloadable
from steprl.rollout.engines.lora_merge import AdapterUpdate, LoraMerger
from steprl.rollout.engines.prefix_cache import PrefixCache


@dataclass
class _Request:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    future: asyncio.Future[Generation]
    seed: int | None = None


_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al., 2014) on uint64 arrays: a counter-based hash."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def request_uniforms(engine_seed: int, request_seeds: Sequence[int], index: int) -> torch.Tensor:
    """One uniform in [0, 1) per request for its `index`-th sampled token: a pure function of
    (engine_seed, request seed, index), so independent of batch composition and order.

    Shape: (len(request_seeds),) float64. 53 random bits per number, as in `random.random`.
    """
    seeds = np.array([s & _MASK64 for s in request_seeds], dtype=np.uint64)
    key = _splitmix64(_splitmix64(seeds ^ np.uint64(engine_seed & _MASK64)) + np.uint64(index))
    return torch.from_numpy((key >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs under the temperature-scaled softmax).

    logits: (B, V) float32; uniforms: (B,) in [0, 1), one per row (inverse-CDF sampling, so a
    row's token depends only on its logits and its uniform). Returns tokens (B,) int64 and
    logprobs (B,) float32. Temperature 0 is greedy (log-prob of the argmax under the unscaled
    softmax) and ignores `uniforms`.
    """
    if temperature <= 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    cdf = probs.double().cumsum(-1)
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    # the first token whose cumulative mass exceeds the target; zero-mass tokens never qualify
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _ends_with_any(tokens: list[int], sequences: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(tokens) >= len(s) and tuple(tokens[-len(s) :]) == s for s in sequences)


class HFEngine:
    """Serves a `transformers` causal LM to many concurrent trajectories."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        version: int = 0,
        prefix_cache_bytes: int = 1 << 30,
    ) -> None:
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)  # requests without a seed
        self.seed = seed
        self._version = version
        # transformers 5 renamed the KV-cache argument `past_key_values` -> `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._queue: list[_Request] = []
        self._batcher: asyncio.Task[None] | None = None
        self.tokens_generated = 0
        self.forward_passes = 0
        self._lora: LoraMerger | None = None  # holds W0 once adapter updates arrive (LoRA)
        # keys/values of each row's context, for its trajectory's next turn (full-attention models)
        self._prefix = (
            PrefixCache(prefix_cache_bytes)
            if prefix_cache_bytes > 0 and preloadable(engine_cache(self.model))
            else None
        )

    @property
    def version(self) -> int:
        return self._version

    def reseed(self, seed: int) -> None:
        """New sampling streams: for seeded requests and for the generator of unseeded ones."""
        self.seed = seed
        self.generator.manual_seed(seed)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | AdapterUpdate, version: int) -> None:
        """Load new policy weights in place and bump the policy version.

        A full state dict replaces the weights (shapes must match). An `AdapterUpdate` (LoRA)
        merges the adapters into this plain copy: W = W0 + scaling * B @ A, from the base
        weights W0 kept at the first adapter update, so updates never accumulate.
        """
        if isinstance(state_dict, AdapterUpdate):
            if self._lora is None:
                self._lora = LoraMerger(self.model)
            self._lora.apply(state_dict)
        else:
            self.model.load_state_dict(state_dict)
            self._lora = None  # new base weights: a later adapter update merges into these
        self._version = version
        if self._prefix is not None:  # keys and values of the old weights
            self._prefix.clear()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        if not prompt_ids:
            raise ValueError("generate() needs a non-empty prompt (start it with a BOS token).")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(tuple(prompt_ids), sampling, future, seed))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return await future

    async def _run_batches(self) -> None:
        while self._queue:
            # Let every runnable trajectory submit its request before we cut a batch.
            pending = -1
            while pending != len(self._queue):
                pending = len(self._queue)
                for _ in range(3):
                    await asyncio.sleep(0)
            # Requests with different sampling params go in different batches.
            head = self._queue[0].sampling
            batch = [r for r in self._queue if r.sampling == head][: self.max_batch_size]
            taken = {id(r) for r in batch}
            self._queue = [r for r in self._queue if id(r) not in taken]
            try:
                results = self._generate_batch([r.prompt_ids for r in batch], head, [r.seed for r in batch])
            except Exception as exc:  # surface to every waiter instead of hanging them
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, res in zip(batch, results, strict=True):
                if not r.future.done():
                    r.future.set_result(res)

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[tuple[int, ...]], sp: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Generation]:
        bsz = len(prompts)
        past, attention, positions, logits, layout = self._prefill(prompts)
        width = attention.shape[1]  # decode step k writes cache column width + k
        stop_ids = torch.tensor(sorted({*sp.stop_token_ids, self.eos_token_id}), device=self.device)

        out_tokens: list[list[int]] = [[] for _ in range(bsz)]
        out_logps: list[list[float]] = [[] for _ in range(bsz)]
        finish: list[str] = ["length"] * bsz
        alive = torch.ones(bsz, dtype=torch.bool, device=self.device)
        step_pos = positions
        seeds = list(seeds) if seeds is not None else [None] * bsz
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        unseeded = [i for i, s in enumerate(seeds) if s is None]
        tokens = torch.zeros(bsz, dtype=torch.long, device=self.device)
        for index in range(sp.max_new_tokens):
            if index:  # feed the last token: finished rows a pad (ignored), so the batch stays rectangular
                step_ids = torch.where(alive, tokens, torch.full_like(tokens, self.pad_token_id))[:, None]
                step_pos = step_pos[:, -1:] + 1
                attention = torch.cat(
                    [attention, torch.ones((bsz, 1), dtype=attention.dtype, device=self.device)], 1
                )
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=attention,
                    position_ids=step_pos,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self._cache_kw: past},
                )
                self.forward_passes += 1
                logits = out.logits[:, -1, :].float()
            uniforms = torch.empty(bsz, dtype=torch.float64)
            if seeded:
                uniforms[seeded] = request_uniforms(self.seed, [seeds[i] or 0 for i in seeded], index)
            if unseeded:
                uniforms[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
            tokens, logps = sample_from_logits(logits, sp.temperature, sp.top_p, uniforms)
            tok_list, logp_list, alive_list = tokens.tolist(), logps.tolist(), alive.tolist()
            for i in range(bsz):
                if alive_list[i]:
                    out_tokens[i].append(tok_list[i])
                    out_logps[i].append(logp_list[i])
            stopped = torch.isin(tokens, stop_ids) & alive
            if sp.stop_sequences:  # multi-token stop strings: check each live row's suffix
                for i in range(bsz):
                    if alive_list[i] and _ends_with_any(out_tokens[i], sp.stop_sequences):
                        stopped[i] = True
            for i in stopped.nonzero().flatten().tolist():
                finish[i] = "stop"
            alive = alive & ~stopped
            if not bool(alive.any()):
                break
        self.tokens_generated += sum(len(t) for t in out_tokens)
        if self._prefix is not None:
            self._keep_prefixes(prompts, out_tokens, past, layout, width)
        return [
            Generation(tuple(t), tuple(lp), "stop" if f == "stop" else "length")
            for t, lp, f in zip(out_tokens, out_logps, finish, strict=True)
        ]

    def _prefill(
        self, prompts: list[tuple[int, ...]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
        """One forward pass over what is new in each prompt: (cache, attention, positions, the
        next-token logits (B, V), per row the cache columns that hold its prompt; the decode
        steps then write columns from `attention.shape[1]` on).

        Identical prompts (a GRPO group's G samples at the first turn) are prefilled once. A
        prompt that extends a stored prefix (the trajectory's previous turn) starts from its
        keys and values. Layout, per unique row u: [stored prefix, right-aligned in the first
        `wc` columns][new tokens, left-padded in the next `ws`]; padding is masked out.
        """
        unique = list(dict.fromkeys(prompts))
        past = engine_cache(self.model)
        hits = [self._prefix.take(p) if self._prefix is not None else None for p in unique]
        cached = [h[0] if h else 0 for h in hits]
        new = [p[c:] for p, c in zip(unique, cached, strict=True)]
        n, wc, ws = len(unique), max(cached), max(len(x) for x in new)
        ids = torch.full((n, ws), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, wc + ws), dtype=torch.long)
        positions = torch.zeros((n, ws), dtype=torch.long)
        layout: list[list[int]] = []
        for u, (c, x) in enumerate(zip(cached, new, strict=True)):
            ids[u, ws - len(x) :] = torch.tensor(x)
            attention[u, wc - c : wc] = 1
            attention[u, wc + ws - len(x) :] = 1
            positions[u, ws - len(x) :] = torch.arange(c, c + len(x))
            layout.append([*range(wc - c, wc), *range(wc + ws - len(x), wc + ws)])
        if wc:
            for layer_index, layer in enumerate(past.layers):
                k0, v0 = next(h[1][layer_index] for h in hits if h)
                keys = k0.new_zeros((n, k0.shape[0], wc, k0.shape[-1]))
                values = v0.new_zeros((n, v0.shape[0], wc, v0.shape[-1]))
                for u, h in enumerate(hits):
                    if h:
                        keys[u, :, wc - h[0] :] = h[1][layer_index][0]
                        values[u, :, wc - h[0] :] = h[1][layer_index][1]
                cast(GrowingLayer, layer).preload(keys.to(self.device), values.to(self.device))
        attention, positions = attention.to(self.device), positions.to(self.device)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: past},
        )
        self.forward_passes += 1
        logits = out.logits[:, -1, :].float()
        if n < len(prompts):  # every duplicate gets its own copy of the one prefilled row
            where = {p: u for u, p in enumerate(unique)}
            rows = [where[p] for p in prompts]
            sel = torch.tensor(rows, device=self.device)
            past.batch_select_indices(sel)
            attention, positions, logits = attention[sel], positions[sel], logits[sel]
            layout = [layout[r] for r in rows]
        return past, attention, positions, logits, layout

    def _keep_prefixes(
        self,
        prompts: list[tuple[int, ...]],
        outputs: list[list[int]],
        past: Any,
        layout: list[list[int]],
        width: int,
    ) -> None:
        """Store each row's `prompt + output[:-1]` keys and values for its trajectory's next turn."""
        assert self._prefix is not None
        start = width
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            cols = torch.tensor([*layout[i], *range(start, start + len(out) - 1)], device=self.device)
            kv = tuple(
                (layer.keys[i].index_select(1, cols), layer.values[i].index_select(1, cols))
                for layer in past.layers
            )
            self._prefix.put((*prompt, *out[:-1]), kv)
