"""A scripted engine: replays fixed responses. For tests of the loop, budgets and views.

Each call pops the next text from `responses` (cycling), encodes it once and returns it with
log-prob 0.0 per token, truncated to `max_new_tokens` ("length") or cut after the first stop
token ("stop").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.weights import AnyUpdate


class ScriptedEngine:
    def __init__(self, responses: Sequence[str], encode: Callable[[str], Sequence[int]]) -> None:
        if not responses:
            raise ValueError("ScriptedEngine needs at least one response")
        self.responses = list(responses)
        self.encode = encode
        self.calls: list[tuple[int, ...]] = []  # prompts seen, in order
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None:
        self._version = version

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        text = self.responses[len(self.calls) % len(self.responses)]
        self.calls.append(tuple(prompt_ids))
        ids = list(self.encode(text))[: sampling.max_new_tokens]
        for i, tok in enumerate(ids):
            head = tuple(ids[: i + 1])
            if tok in sampling.stop_token_ids or any(head[-len(s) :] == s for s in sampling.stop_sequences):
                return Generation(head, (0.0,) * len(head), "stop")
        return Generation(tuple(ids), (0.0,) * len(ids), "length")
