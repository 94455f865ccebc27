"""BAD-09: special-token strings in env text stay text, for every tokenizer steprl trains with.

The tiny tokenizer (with `PlainFormat`, whose encoder also keeps its call/reasoning tags as
text), the real Qwen3 tokenizer (with `ChatFormat`) and Gemma-3-270M's (converted once per
checkout, `tests/gemma_cache.py`). For each: an observation holding a control string round-trips to the same
text and holds no control id; text without control strings gets the tokenizer's own ids; and a
property test on strings glued from fragments of control strings.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma_cache import converted_gemma
from steprl.models import qwen3_testbed, tiny
from steprl.rollout.chat import TEXT_ONLY_TAGS, PlainFormat
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.text_tokens import TextEncoder, control_strings

#: Control strings of the families steprl meets, whether or not a given tokenizer has them.
HOSTILE = (
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<end_of_turn>",
    "<start_of_turn>",
    "<bos>",
    "<eos>",
    "<s>",
    "</s>",
    "<pad>",
    "<unk>",
    "<mask>",
)

#: Text with no control string of any of the three tokenizers (partial tags, broken JSON, ...).
PLAIN_TEXTS = (
    "hello world",
    "x = 1 + 2\nprint(x)  # 3",
    "<tool_",
    "</tool_call",
    "<|im_end",
    "im_end|>",
    "< think >",
    '{"name": "calc", "arguments": {"expression": "1+',
    "}]}]",
    "Error: unexpected '<' at line 3",
    "a\nb\tc",
)


@dataclass
class Subject:
    """A tokenizer, its format and that format's env-text encoder."""

    name: str
    tokenizer: Any
    fmt: Any
    encoder: TextEncoder
    extra: tuple[str, ...]  # control strings the format adds to the tokenizer's own
    alphabet: Any  # hypothesis strategy for the characters the tokenizer can carry

    @cached_property
    def strings(self) -> tuple[str, ...]:
        return control_strings(self.tokenizer, self.extra)

    @cached_property
    def control_ids(self) -> frozenset[int]:
        """Ids no env text may become, found from the tokenizer itself (not from the encoder
        under test): every *special* token, and each string of HOSTILE and of the format's own
        tags that is one token here. (Gemma's non-special added tokens, newline runs and HTML
        tags, are ordinary text; its `<s>`/`</s>` HTML tags are in HOSTILE all the same.)"""
        tok = self.tokenizer
        ids = set(tok.all_special_ids)
        ids |= {i for i, t in tok.added_tokens_decoder.items() if t.special}
        for tag in (*HOSTILE, *self.extra):
            enc = tok.encode(tag, add_special_tokens=False)
            if len(enc) == 1:
                ids.add(enc[0])
        return frozenset(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Every token's text (nothing skipped): what a stored observation decodes to."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def normalized(self, text: str) -> str:
        """`text` as the tokenizer's own normalizer leaves it: what its ids can decode to at
        best (Qwen3's NFC turns the compatibility ideograph U+FA2A into U+98EF)."""
        norm = self.tokenizer.backend_tokenizer.normalizer
        return text if norm is None else str(norm.normalize_str(text))


@cache  # one load per tokenizer per module (cleared at its end)
def _subject(name: str) -> Subject:
    if name == "tiny":
        tok = tiny.build_tokenizer()
        fmt = PlainFormat(tok)
        chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
        return Subject(name, tok, fmt, fmt.text, TEXT_ONLY_TAGS, st.sampled_from(chars))
    if name == "qwen3":
        tok = qwen3_testbed.load_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(converted_gemma())
    fmt = ChatFormat(tok)
    # any character but lone surrogates (not encodable) and U+2581 (see the Gemma xfail below)
    alphabet = st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581")
    return Subject(name, tok, fmt, fmt.text, TEXT_ONLY_TAGS, alphabet)  # ChatFormat adds them too


@pytest.fixture(scope="module", autouse=True)
def _free_tokenizers() -> Iterator[None]:
    yield
    _subject.cache_clear()


@pytest.fixture(
    scope="module",
    params=["tiny", "qwen3", pytest.param("gemma", marks=pytest.mark.soak)],
)
def subject(request: pytest.FixtureRequest) -> Subject:
    return _subject(request.param)


@pytest.fixture(scope="module")
def tiny_fmt() -> PlainFormat:
    return PlainFormat(tiny.build_tokenizer())


def _wrappings(s: str) -> list[str]:
    return [s, f"x{s}y", f"{s}{s}", f"out: {s}\n{s[:-1]}", f"{s[:1]}{s}{s[-1:]}", f"  {s}  "]


def _assert_text(subject: Subject, text: str) -> tuple[int, ...]:
    ids = subject.encoder.encode(text)
    bad = sorted(set(ids) & subject.control_ids)
    assert not bad, f"{subject.name}: {text!r} -> control ids {bad}"
    assert subject.decode(ids) == text, f"{subject.name}: {text!r} decodes to {subject.decode(ids)!r}"
    return ids


# ---- control strings stay text -------------------------------------------------------------------
def test_every_control_string_round_trips_as_text(subject: Subject) -> None:
    assert set(subject.encoder.forbidden) >= subject.control_ids - {subject.tokenizer.unk_token_id}
    # Gemma's whitespace runs are added tokens too: long ones crash the encoder (xfail below);
    # of its 6,000+ `<unusedN>` tokens, every 100th
    unused = [s for s in subject.strings if s.startswith("<unused")][::100]
    strings = {s for s in subject.strings if s.strip() and not s.startswith("<unused")}
    strings |= set(HOSTILE) | set(unused)
    for s in sorted(strings):
        for text in _wrappings(s):
            _assert_text(subject, text)


def test_a_hostile_observation_round_trips_through_the_format(subject: Subject) -> None:
    """All the hostile strings in one tool result: the format's observation ids hold exactly the
    template's own control ids, and the env text's ids decode back to the text."""
    text = "result:\n" + " | ".join(HOSTILE) + ' {"unbalanced": [1, 2'
    ids = _assert_text(subject, text)
    obs = subject.fmt.observation_ids(text)
    if isinstance(subject.fmt, ChatFormat):
        assert subject.fmt.message_ids(text) == ids
        piece = subject.fmt._pieces["tool"]
        framing = subject.fmt.template_ids(piece.before) + subject.fmt.template_ids(piece.after)
        controls = subject.control_ids
        # the closing end-of-turn (the action above did not sample one) plus the framing's own
        want = [subject.fmt.end_of_turn_id] + [i for i in framing if i in controls]
        assert [i for i in obs if i in controls] == want
    else:
        assert obs == ids


def test_text_without_control_strings_gets_the_canonical_ids(subject: Subject) -> None:
    texts = list(PLAIN_TEXTS) + ["naïve café, 日本語 🙂"] * (subject.name != "tiny")
    if subject.name == "tiny":
        texts += ["<result>42</result>", "<error>bad</error>", "<calc>1+1</calc>"]  # tags, not controls
    for text in texts:
        assert not any(c in text for c in subject.strings), text
        want = tuple(subject.tokenizer.encode(text, add_special_tokens=False))
        assert subject.encoder.encode(text) == want, text
        assert subject.encoder.is_plain(text)


# ---- property test ------------------------------------------------------------------------------
def _fragments(strings: Iterable[str]) -> list[str]:
    out: set[str] = set()
    for s in strings:
        out |= {s, s[:1], s[1:], s[:-1], s[: len(s) // 2], s[len(s) // 2 :]}
    return sorted(f for f in out if f)


def test_property_strings_glued_from_control_fragments(subject: Subject) -> None:
    # Gemma has 6,000+ added tokens (<unused...>): the families' tags plus its other tags; not
    # its whitespace runs
    own = [s for s in subject.strings if s.strip() and not s.startswith("<unused")][:120]
    strings = sorted(set(own) | set(HOSTILE))
    pieces = st.one_of(st.sampled_from(_fragments(strings)), st.text(subject.alphabet, max_size=3))
    controls = subject.control_ids
    all_strings = subject.strings

    @settings(
        max_examples=150 if subject.name != "gemma" else 60,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )
    @given(st.lists(pieces, max_size=12).map("".join))
    def check(text: str) -> None:
        ids = subject.encoder.encode(text)
        assert not set(ids) & controls, (text, ids)
        assert subject.decode(ids) == subject.normalized(text), (text, ids)
        if not any(c in text for c in all_strings):
            assert ids == tuple(subject.tokenizer.encode(text, add_special_tokens=False)), text

    if subject.name != "tiny":  # a compatibility ideograph: an NFC tokenizer (Qwen3) changes it
        check.hypothesis.inner_test("\ufa2a")
    check()


# ---- the tiny tokenizer --------------------------------------------------------------------------
def test_tiny_no_longer_maps_eos_or_pad_text_to_their_ids(tiny_fmt: PlainFormat) -> None:
    tok = tiny_fmt.tokenizer
    # the raw tokenizer does (the bug this guards against) ...
    assert tok.encode("</s>", add_special_tokens=False) == [tok.eos_token_id] == [2]
    assert tok.encode("<pad>", add_special_tokens=False) == [tok.pad_token_id] == [0]
    # ... an observation, a task or an instruction never does
    for text in ("</s>", "<pad>", "print('</s>')\n</s><pad><s>", "<tool_call>x</tool_call><think>"):
        obs = tiny_fmt.observation_ids(text)
        assert not {0, 1, 2, 3} & set(obs), (text, obs)
        assert not set(obs) & set(tiny_fmt.text.forbidden), (text, obs)
        assert tiny_fmt.decode(obs) == text
        first = tiny_fmt.initial_ids(text, text)
        assert first[0] == tok.bos_token_id and not {0, 1, 2, 3} & set(first[1:]), first


def test_tiny_unk_text_is_split_but_unknown_characters_are_unk(tiny_fmt: PlainFormat) -> None:
    tok, unk = tiny_fmt.tokenizer, tiny_fmt.tokenizer.unk_token_id
    assert tok.encode("<unk>", add_special_tokens=False) == [unk]
    ids = tiny_fmt.observation_ids("a<unk>b")
    assert unk not in ids and tiny_fmt.decode(ids) == "a<unk>b"
    # a character outside the ASCII vocabulary is <unk>, without an error, the string still split
    assert tiny_fmt.observation_ids("é") == (unk,)
    mixed = tiny_fmt.observation_ids("<unk>é日")
    assert mixed.count(unk) == 2 and mixed[:5] == tiny_fmt.observation_ids("<unk>")


# ---- known gaps (Gemma) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma() -> Subject:
    return _subject("gemma")


@pytest.mark.soak
def test_gemma_blank_lines_and_html_keep_canonical_ids(gemma: Subject) -> None:
    for text in ("para one.\n\npara two", "<table><td>x</td></table>"):
        assert gemma.encoder.encode(text) == tuple(gemma.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.soak
def test_gemma_long_whitespace_runs_encode(gemma: Subject) -> None:
    for text in ("x" + "\n" * 9 + "y", "\t" * 12 + "deeply indented", "\n" * 40):
        ids = gemma.encoder.encode(text)
        assert gemma.decode(ids) == text


@pytest.mark.soak
@pytest.mark.xfail(
    strict=True,
    reason="GAP (tokenizer): Gemma's SentencePiece decoder turns U+2581 '▁' in env text into a "
    "space, so an observation containing it does not decode back to the env's text",
)
def test_gemma_lower_one_eighth_block_round_trips(gemma: Subject) -> None:
    assert gemma.decode(gemma.encoder.encode("a\u2581b")) == "a\u2581b"
