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

import numpy as np
import torch

from steprl.rollout.engines.base import Generation, SamplingParams
from steprl.rollout.engines.lora_merge import AdapterUpdate, LoraMerger


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
        bsz, longest = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((bsz, longest), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((bsz, longest), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's next token is at column -1
            input_ids[i, longest - len(p) :] = torch.tensor(p)
            attention[i, longest - len(p) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(sorted({*sp.stop_token_ids, self.eos_token_id}), device=self.device)

        out_tokens: list[list[int]] = [[] for _ in range(bsz)]
        out_logps: list[list[float]] = [[] for _ in range(bsz)]
        finish: list[str] = ["length"] * bsz
        alive = torch.ones(bsz, dtype=torch.bool, device=self.device)
        past = None
        step_ids, step_pos = input_ids, positions
        seeds = list(seeds) if seeds is not None else [None] * bsz
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        unseeded = [i for i, s in enumerate(seeds) if s is None]
        for index in range(sp.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: past},
            )
            self.forward_passes += 1
            past = getattr(out, self._cache_kw)
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
            # finished rows keep decoding a pad token (ignored) so the batch stays rectangular
            step_ids = torch.where(alive, tokens, torch.full_like(tokens, self.pad_token_id))[:, None]
            step_pos = step_pos[:, -1:] + 1
            attention = torch.cat(
                [attention, torch.ones((bsz, 1), dtype=attention.dtype, device=self.device)], 1
            )
        self.tokens_generated += sum(len(t) for t in out_tokens)
        return [
            Generation(tuple(t), tuple(lp), "stop" if f == "stop" else "length")
            for t, lp, f in zip(out_tokens, out_logps, finish, strict=True)
        ]
