"""Env text to token ids as ordinary text: a special-token string in an observation is never a
control id (reliability BAD-09).

`tokenizer.encode(text)` matches added tokens anywhere in `text`, with `add_special_tokens=False`
too: a program that prints `</s>` would inject an end-of-sequence, an observation quoting
`<|im_end|>` would close the turn, and a web page with `<tool_call>` would look like a call.
transformers' `split_special_tokens=True` covers only the *special* added tokens (Qwen3's
`<tool_call>` and `<think>` are added but not special). So this encoder splits the text at every
occurrence of a control string and breaks each occurrence in two before encoding (``"<"`` then
``"tool_call>"``): the pieces are ordinary tokens that decode back to the same characters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def control_strings(tokenizer: Any, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The strings `tokenizer.encode` would turn into control ids, longest first: the special
    tokens, the added tokens the chat template itself writes (Qwen3's `<tool_call>`,
    `<tool_response>`, `<think>`: added but not special) or spelt `<|...|>`, and `extra` (the
    tiny model's call tags). Other added tokens are vocabulary, not control: Gemma adds newline
    and tab runs and HTML tags (`<td>`, `</s>`) that it reads as ordinary text."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    found = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    for t in getattr(tokenizer, "added_tokens_decoder", {}).values():
        text = str(t.content)
        if t.special or text in template or (text.startswith("<|") and text.endswith("|>")):
            found.add(text)
    found |= set(extra)
    return tuple(sorted((s for s in found if len(s) > 1), key=lambda s: (-len(s), s)))


def control_ids(tokenizer: Any, strings: Sequence[str]) -> dict[int, str]:
    """id -> control string, for the strings that encode to one id when matched whole."""
    out: dict[int, str] = {}
    for s in strings:
        ids = tokenizer.encode(s, add_special_tokens=False)
        if len(ids) == 1:
            out[int(ids[0])] = s
    return out


class TextEncoder:
    """Encodes env text so that it decodes back exactly and contains no control ids.

    Text without control strings costs one tokenizer call and gets the canonical ids. Only when
    that encoding holds a control id is the text split at those control strings and encoded
    piece by piece: BPE merges then never span a split point, so those ids can differ from a
    canonical tokenization, which is fine: they are the ids the policy is shown *and* trained on.
    """

    def __init__(self, tokenizer: Any, *, extra_controls: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.forbidden = control_ids(tokenizer, control_strings(tokenizer, extra_controls))
        # an unknown character legitimately encodes to <unk> (the tiny vocabulary is ASCII):
        # only the *string* "<unk>" must not, and that is split up front
        unk = getattr(tokenizer, "unk_token_id", None)
        self.unk = self.forbidden.pop(unk) if unk in self.forbidden else None

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _pieces(self, text: str, splits: set[str]) -> list[int]:
        controls = sorted(splits, key=lambda c: (-len(c), c))
        return [i for piece in _split_controls(text, controls) for i in self._plain(piece)]

    def controls_in(self, ids: Sequence[int]) -> int:
        """How many control ids `ids` holds."""
        return sum(1 for i in ids if i in self.forbidden)

    def is_plain(self, text: str) -> bool:
        """True when the tokenizer reads no control token into `text` (the usual case)."""
        return self.controls_in(self._plain(text)) == 0

    def encode(self, text: str) -> tuple[int, ...]:
        splits: set[str] = {self.unk} if self.unk and self.unk in text else set()
        ids = self._plain(text) if not splits else self._pieces(text, splits)
        found = {self.forbidden[i] for i in ids if i in self.forbidden}
        if found:  # split at what was matched; if a piece still matches, at every control string
            ids = self._pieces(text, splits | found)
            found = {self.forbidden[i] for i in ids if i in self.forbidden}
            if found:
                ids = self._pieces(text, splits | set(self.forbidden.values()))
                found = {self.forbidden[i] for i in ids if i in self.forbidden}
        if found:
            raise ValueError(
                f"text still encodes to control ids {sorted(found)[:5]} after splitting; this tokenizer "
                "cannot carry the text safely (report it with the text)"
            )
        return tuple(ids)


def _split_controls(text: str, controls: Sequence[str]) -> list[str]:
    """`text` cut so that no piece contains a whole control string: each occurrence is split
    after its first character. Joined, the pieces are `text` again."""
    if not controls or not any(c in text for c in controls):
        return [text]
    pieces: list[str] = []
    start = 0
    pos = 0
    while pos < len(text):
        hit = next((c for c in controls if text.startswith(c, pos)), None)
        if hit is None:
            nxt = min((i for c in controls if (i := text.find(c, pos + 1)) >= 0), default=len(text))
            pos = nxt
            continue
        pieces.append(text[start : pos + 1])  # ... up to and including the control's first char
        start = pos + 1
        pos = pos + 1
    pieces.append(text[start:])
    return [p for p in pieces if p]
