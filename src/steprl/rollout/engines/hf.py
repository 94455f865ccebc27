"""A Hugging Face `transformers` engine: batched, KV-cached sampling with per-token log-probs.

Concurrent `generate` calls (one per live trajectory) are queued; a single batcher task drains
the queue, left-pads the prompts, prefills them in one forward pass and decodes with the KV
cache until every row has stopped. CPU by default; the device is configurable.

No timers are involved in batching: the batcher yields to the event loop until no new request
arrives, so the batch composition (and hence every sampled token) is a deterministic function
of the seed.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from steprl.rollout.engines.base import Generation, SamplingParams


@dataclass
class _Request:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    future: asyncio.Future[Generation]


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs under the temperature-scaled softmax).

    logits: (B, V) float32. Returns tokens (B,) int64 and logprobs (B,) float32. Temperature 0
    is greedy (log-prob of the argmax under the unscaled softmax).
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
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
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
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = version
        # transformers 5 renamed the KV-cache argument `past_key_values` -> `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._queue: list[_Request] = []
        self._batcher: asyncio.Task[None] | None = None
        self.tokens_generated = 0
        self.forward_passes = 0

    @property
    def version(self) -> int:
        return self._version

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new policy weights (in place; shapes must match) and bump the policy version."""
        self.model.load_state_dict(state_dict)
        self._version = version

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("generate() needs a non-empty prompt (start it with a BOS token).")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(tuple(prompt_ids), sampling, future))
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
                results = self._generate_batch([r.prompt_ids for r in batch], head)
            except Exception as exc:  # surface to every waiter instead of hanging them
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, res in zip(batch, results, strict=True):
                if not r.future.done():
                    r.future.set_result(res)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[tuple[int, ...]], sp: SamplingParams) -> list[Generation]:
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
        for _ in range(sp.max_new_tokens):
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
            tokens, logps = sample_from_logits(logits, sp.temperature, sp.top_p, self.generator)
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
