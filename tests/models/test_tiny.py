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
