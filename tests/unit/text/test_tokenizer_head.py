"""``TextTokenizer.encode_head``: the first N tokens of a text, reading only as much of it as they need, are exactly
the first N tokens of the whole text's encoding, however the text is cut (mid-word, mid-special-token, in a run of
spaces). The router routes on them (router/prompts.py), so a single token off would change every chunk key after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.text.tokenizer import TextTokenizer
from strategies import FRAGMENTS, FUZZ


@pytest.fixture(scope="module")
def tokenizer(tiny_servable_model: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(str(tiny_servable_model))


@FUZZ
@given(text=st.lists(st.sampled_from(FRAGMENTS), max_size=120).map("".join), n=st.integers(1, 60), bos=st.booleans())
def test_the_head_of_a_text_is_the_head_of_its_encoding(tokenizer: TextTokenizer, text: str, n: int, bos: bool) -> None:
    assert tokenizer.encode_head(text, n, add_special_tokens=bos) == tokenizer.encode(text, add_special_tokens=bos)[:n]


def test_a_chat_head_is_the_head_of_the_chat(tokenizer: TextTokenizer) -> None:
    messages = [{"role": "system", "content": "be brief " * 50}, {"role": "user", "content": "hello  world\n" * 80}]
    assert tokenizer.encode_chat_head(messages, 100) == tokenizer.encode_chat(messages)[:100]


def test_a_text_shorter_than_the_head_is_encoded_whole(tokenizer: TextTokenizer) -> None:
    assert tokenizer.encode_head("hello world", 10_000) == tokenizer.encode("hello world")
