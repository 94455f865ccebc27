"""The embedded tokenizer: printable ASCII round-trips, protocol tags are one token each."""

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from steprl.models.tiny import TAGS, build_tokenizer


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", ""), max_size=60)
)
def test_tokenizer_roundtrips_printable_ascii(text):
    tokenizer = build_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tags_are_single_tokens(tokenizer):
    for tag in TAGS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1, tag


WORDS = ["delete", "remove", "mode", "file_id", "the"]
PRINTABLE = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
CHARS, BY_WORD = build_tokenizer(), build_tokenizer(WORDS)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(WORDS) | st.text(alphabet=PRINTABLE, max_size=6), max_size=12))
def test_a_word_level_tokenizer_roundtrips_and_keeps_the_char_ids(pieces):
    text = "".join(pieces)
    chars, words = CHARS, BY_WORD
    ids = words.encode(text, add_special_tokens=False)
    assert words.decode(ids) == text
    # a char's id is the same with or without words: words only add ids after the chars'
    same = "x<answer>"
    assert chars.encode(same, add_special_tokens=False) == words.encode(same, add_special_tokens=False)


def test_a_listed_word_is_one_token_only_where_it_stands_whole():
    tok = BY_WORD
    ids = tok.encode('"mode": delete model_x file_ids F92', add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[:5] == ['"', "mode", '"', ":", " "] and "delete" in tokens
    assert "mode" not in tokens[5:] and "file_id" not in tokens and "F92" not in tokens  # inside longer words
