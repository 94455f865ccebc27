"""Per-request seeded sampling: the engine's one source of randomness.

(engine seed, request seed, token index) -> one uniform by a counter-based hash, then inverse-CDF
sampling: a row's token depends on its logits and its own uniform only, never on which other
requests share the batch or when they joined it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al., 2014) on uint64 arrays: a counter-based hash."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def request_uniforms(
    engine_seed: int, request_seeds: Sequence[int], index: int | Sequence[int]
) -> torch.Tensor:
    """One uniform in [0, 1) per request for its `index`-th sampled token (one index for all, or
    one per request): a pure function of (engine_seed, request seed, index), so independent of
    batch composition and order.

    Shape: (len(request_seeds),) float64. 53 random bits per number, as in `random.random`.
    """
    seeds = np.array([s & _MASK64 for s in request_seeds], dtype=np.uint64)
    at = np.asarray(index, dtype=np.uint64)
    key = _splitmix64(_splitmix64(seeds ^ np.uint64(engine_seed & _MASK64)) + at)
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


def ends_with_any(tokens: list[int], sequences: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(tokens) >= len(s) and tuple(tokens[-len(s) :]) == s for s in sequences)
