"""Prompt formats: how a task's text and each observation become token ids, exactly once.

The agent loop never re-tokenizes what the model generated: action tokens are carried as the
engine sampled them, and each observation is tokenized once, here, and appended as ids. This is
what keeps the learner's view identical to the engine's (no "retokenization drift").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from steprl.rollout.text_tokens import TextEncoder


class PromptFormat(Protocol):
    """Turns text into the token ids the policy conditions on.

    `observation_ids` gets the ids the model just sampled (a chat format closes the turn the
    model did not close itself) and whether the text is a tool result or a user turn.
    """

    eos_token_id: int

    def initial_ids(
        self, system_prompt: str, observation: str, tools: Sequence[Mapping[str, Any]] = ()
    ) -> tuple[int, ...]: ...

    def observation_ids(
        self, text: str, *, action_ids: Sequence[int] = (), tool_result: bool = True
    ) -> tuple[int, ...]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def template_ids(self, text: str) -> tuple[int, ...]:
        """Format text as the tokenizer reads it, control tokens included: for the format's own
        text and scripted demonstration actions, never for env text."""
        ...

    def think_close_ids(self) -> tuple[int, ...]:
        """`</think>` as ids (what `rollout.context=strip_thinking` cuts at)."""
        ...

    def rerender_ids(
        self,
        system_prompt: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[int, ...]:
        """The whole conversation rendered and tokenized in one piece (diagnostics only)."""
        ...

    def newline_ids(self) -> frozenset[int]:
        """Ids that decode to newlines only."""
        ...

    def stop_tokens(self, stop_strings: Sequence[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """(single stop token ids, multi-token stop sequences) for the engine."""
        ...


#: `rollout.system_prompt` values with a meaning; any other string is the system prompt itself.
SYSTEM_PROMPT_MODES = ("none", "env")

#: Strings that stay text inside env text for every tokenizer (reliability BAD-09), on top of
#: each tokenizer's own control tokens: an env that quotes a call or a reasoning tag must not
#: hand the model one, and `<s>`/`</s>` (sequence markers in many vocabularies, HTML tags in
#: Gemma's) are split too.
TEXT_ONLY_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<s>", "</s>")


def tool_schemas(tools: Mapping[str, Any] | Sequence[Any] | None) -> tuple[dict[str, Any], ...]:
    """An env's tools (name -> Tool, or a list) as the function schemas chat templates take."""
    if not tools:
        return ()
    values = tools.values() if isinstance(tools, Mapping) else tools
    return tuple(
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
        }
        for t in values
    )


def newline_ids(encode: Any) -> frozenset[int]:
    """Ids of runs of 1-8 newlines that are one token each, under `encode` (text -> ids)."""
    out = set()
    for n in range(1, 9):
        ids = encode("\n" * n)
        if len(ids) == 1:
            out.add(int(ids[0]))
    return frozenset(out)


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
        self.bos_token_id: int | None = tokenizer.bos_token_id
        # env text (task, instructions, observations) is text: never a control or call token
        self.text = TextEncoder(tokenizer, extra_controls=TEXT_ONLY_TAGS)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def initial_ids(
        self, system_prompt: str, observation: str, tools: Sequence[Mapping[str, Any]] = ()
    ) -> tuple[int, ...]:
        """`tools` are ignored: the env's system prompt lists them in the plain format."""
        instructions = {"none": "", "env": system_prompt}.get(self.system_prompt, self.system_prompt)
        text = f"{instructions}\n{observation}\n" if instructions else f"{observation}\n"
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        return (*bos, *self.text.encode(text))

    def observation_ids(
        self, text: str, *, action_ids: Sequence[int] = (), tool_result: bool = True
    ) -> tuple[int, ...]:
        return self.text.encode(text)

    def think_close_ids(self) -> tuple[int, ...]:
        return self._encode("</think>")

    def template_ids(self, text: str) -> tuple[int, ...]:
        """Format text, tokenized as the tokenizer reads it (tags and specials included)."""
        return self._encode(text)

    def decode_all(self, ids: Sequence[int]) -> str:
        """Every token's text, special ones included (for diagnostics)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def rerender_ids(
        self,
        system_prompt: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[int, ...]:
        """The whole conversation's text tokenized in one piece (what a re-tokenizing harness
        would show): the template check's and `rollout/template_mismatch_rate`'s reference."""
        instructions = {"none": "", "env": system_prompt}.get(self.system_prompt, self.system_prompt)
        first, rest = messages[0]["content"], "".join(m["content"] for m in messages[1:])
        text = f"{instructions}\n{first}\n" if instructions else f"{first}\n"
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        return (*bos, *self._encode(text + rest))

    def newline_ids(self) -> frozenset[int]:
        return newline_ids(self._encode)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def stop_tokens(self, stop_strings: Sequence[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Single-token stop strings (tags are tokens in the tiny vocabulary) become stop ids;
        longer ones token sequences matched on the output's suffix (`split_stop_strings`)."""
        return split_stop_strings(self._encode, stop_strings)


def split_stop_strings(
    encode: Any, stop_strings: Sequence[str], always: Sequence[int] = ()
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(stop ids, multi-token stop sequences) for the engine: `always` plus each stop string that
    `encode` makes one token, and the others as token sequences. The encoding is of the string
    alone: exact for added and char-level tokens (for BPE a stop string can merge with its
    neighbours; prefer strings that are tokens of their own there)."""
    single, multi = list(always), []
    for s in stop_strings:
        enc = tuple(encode(s))
        if not enc:
            raise ValueError(f"stop string {s!r} encodes to no tokens; remove it from the env's stop_strings")
        if len(enc) == 1:
            single.append(enc[0])
        else:
            multi.append(enc)
    return tuple(dict.fromkeys(single)), tuple(multi)
