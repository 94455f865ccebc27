"""The embedded tiny policy: a char-level tokenizer built with HF `tokenizers` and a small Llama.

Weights and tokenizers cannot be downloaded here, so steprl builds its own: every printable
ASCII character is one token, and the protocol tags (`<calc>`, `</calc>`, `<answer>`, ...) are
single added tokens, so a tool call's close tag is one token the engine can stop on. The model is
a real `transformers.LlamaForCausalLM`; the same code path serves any Hugging Face causal LM.

`model.tiny.words` makes whole words single tokens too (a word-level tiny model): a request's
"delete" and a call's "remove" are then one token each, not a run of characters the model must
learn to read. Words come after every char id, so the char tokens' ids do not depend on them.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
#: Protocol tags that must each be ONE token (stop tags and observation wrappers).
TAGS: tuple[str, ...] = (
    "<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>",
    "<error>", "</error>", "<tool_call>", "</tool_call>", "<think>", "</think>",
    "<search>", "</search>", "<information>", "</information>",
)  # fmt: skip


#: What `model.tiny.words` may hold: identifier-like words of two characters or more.
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]+")


def check_words(words: Sequence[str]) -> None:
    """Refuse what cannot be a word token (the config names the key: `model.tiny.words`)."""
    for i, word in enumerate(words):
        if not WORD.fullmatch(word):
            raise ValueError(
                f"{word!r} is not a word: letters, digits and '_', two or more, not starting with a digit"
            )
        if word in words[:i]:
            raise ValueError(f"{word!r} is listed twice")


def build_tokenizer(words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A char-level WordLevel tokenizer over printable ASCII plus the protocol tags, plus `words`
    as whole tokens where they stand as whole words (`\\b` on both sides: "mode" in "model" stays
    characters).

    The pre-tokenizer isolates each tag first, then each listed word, then every remaining
    character, so `decode(encode(s)) == s` for any printable-ASCII string (tested).
    """
    check_words(words)
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab_list = [PAD, BOS, EOS, UNK, *TAGS, *chars, *words]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tag_alternatives = "|".join(t.replace("/", "\\/") for t in TAGS)
    longest_first = sorted(words, key=len, reverse=True)
    word_alternative = f"\\b(?:{'|'.join(longest_first)})\\b|" if words else ""
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(f"{tag_alternatives}|{word_alternative}[\\s\\S]"), behavior="isolated"
    )
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    return fast


@dataclass(frozen=True)
class TinyModelSpec:
    """Size of the embedded policy; the defaults train in about a minute on 2 CPU cores."""

    hidden_size: int = 96
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 512


def build_model(vocab_size: int, spec: TinyModelSpec, *, seed: int, pad_id: int, bos_id: int, eos_id: int):
    """A freshly initialised `LlamaForCausalLM` of the given size (deterministic in `seed`)."""
    import torch

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
