"""Prompt formats: how a task's text and each observation become token ids, exactly once.

The agent loop never re-tokenizes what the model generated: action tokens are carried as the
engine sampled them, and each observation is tokenized once, here, and appended as ids. This is
what keeps the learner's view identical to the engine's (no "retokenization drift").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class PromptFormat(Protocol):
    """Turns text into the token ids the policy conditions on."""

    eos_token_id: int

    def initial_ids(self, system_prompt: str, observation: str) -> tuple[int, ...]: ...

    def observation_ids(self, text: str) -> tuple[int, ...]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stop_tokens(self, stop_strings: Sequence[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """(single stop token ids, multi-token stop sequences) for the engine."""
        ...


#: `rollout.system_prompt` values with a meaning; any other string is the system prompt itself.
SYSTEM_PROMPT_MODES = ("none", "env")


class PlainFormat:
    """`BOS + [system prompt + newline] + task text + newline`, then raw actions and
    observations: the tiny model's format.

    `system_prompt` says what opens the first prompt: ``"none"`` (the tiny model's default: a
    char-level model learns the protocol from demonstrations, and the instructions would only
    lengthen every sequence), ``"env"`` (the env's own `system_prompt`, read after `reset`, so
    it lists the tools an MCP server announced), or any other text (used as is).
    """

    def __init__(self, tokenizer: Any, *, system_prompt: str = "none") -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.eos_token_id: int = tokenizer.eos_token_id
        self.bos_token_id: int = tokenizer.bos_token_id

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def initial_ids(self, system_prompt: str, observation: str) -> tuple[int, ...]:
        instructions = {"none": "", "env": system_prompt}.get(self.system_prompt, self.system_prompt)
        text = f"{instructions}\n{observation}\n" if instructions else f"{observation}\n"
        return (self.bos_token_id, *self._encode(text))

    def observation_ids(self, text: str) -> tuple[int, ...]:
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def stop_tokens(self, stop_strings: Sequence[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Single-token stop strings (tags are added tokens in steprl's tokenizers) become stop
        ids; longer ones become token sequences matched on the output's suffix. The encoding is
        of the string alone: exact for char-level and tag tokens (for BPE tokenizers a stop
        string can merge with its neighbours; prefer added tokens there)."""
        single, multi = [], []
        for s in stop_strings:
            enc = self._encode(s)
            if not enc:
                raise ValueError(
                    f"stop string {s!r} encodes to no tokens; remove it from the env's stop_strings"
                )
            if len(enc) == 1:
                single.append(enc[0])
            else:
                multi.append(enc)
        return tuple(single), tuple(multi)
