"""The `Engine` protocol: token ids in, sampled token ids and their log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from steprl.engines.weights import AnyUpdate


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn. Log-probs are always of the temperature-scaled, untruncated
    distribution (top-p only restricts what is *sampled*), which is what the learner recomputes."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting one of these (kept)
    #: multi-token stop strings as token sequences; generation stops once the output ends with one
    stop_sequences: tuple[tuple[int, ...], ...] = ()


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per token in token_ids
    finish_reason: FinishReason  # "stop": stop token or EOS; "length": max_new_tokens reached
    #: the policy version that sampled each token (weights may change between decode steps);
    #: () from engines whose weights never change mid-generation
    versions: tuple[int, ...] = ()


class Engine(Protocol):
    """Generates continuations for many concurrent callers; batches them internally."""

    @property
    def version(self) -> int: ...

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        """Continue `prompt_ids`. With a `seed`, the sampled tokens are a function of (engine
        seed, seed, prompt, weights) alone, whatever else is batched with the request."""
        ...

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None: ...


class ServingEngine(Engine, Protocol):
    """An engine a run serves its policy with (`registry.py: ENGINES`): the agent loop's
    `Engine`, plus what the trainer, `steprl eval` and `serve-policy` ask of it."""

    @property
    def snapshots(self) -> object | None:
        """Past versions' weights held for cross-policy sampling (`snapshots.py`), or None."""
        ...

    @property
    def max_positions(self) -> int | None:
        """The most positions (prompt + completion) it can hold, when fewer than the model's."""
        ...

    def reset_scheduler(self) -> None:
        """Forget queued requests (the event loop that made them is closing)."""
        ...

    def close(self) -> None:
        """Release what it holds (a worker process, files); idempotent."""
        ...
