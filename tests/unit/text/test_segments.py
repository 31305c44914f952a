"""``SegmentEncoder`` (text/segments.py): a chat's ids from its pieces, each piece encoded once. The router routes on
them, so they must be exactly the tokenizer's ids of the whole rendered chat, whatever the messages hold (added
tokens' text included), and a tokenizer for which that cannot hold gets no encoder at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.text import segments
from preheat.text.segments import SegmentEncoder
from preheat.text.tokenizer import TextTokenizer
from strategies import FRAGMENTS, FUZZ

contents = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)
chats = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": contents}),
    min_size=1, max_size=6,
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_servable_model: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(str(tiny_servable_model))


@pytest.fixture
def encoder(tokenizer: TextTokenizer) -> SegmentEncoder:
    found = SegmentEncoder.for_tokenizer(tokenizer)
    assert found is not None  # a byte-level BPE with ChatML's added tokens: position-free pieces
    return found


@FUZZ
@given(messages=chats, n=st.integers(1, 400))
def test_a_chat_read_piece_by_piece_is_the_head_of_its_encoding(
    tokenizer: TextTokenizer, messages: list[dict[str, str]], n: int
) -> None:
    encoder = SegmentEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    text = tokenizer.render_chat(messages)
    whole = tokenizer.encode(text, add_special_tokens=False)
    assert encoder.encode_head(text, n) == whole[:n]
    # Read again, every piece is known: the same ids without the tokenizer (or, past the budget, not at all).
    again = encoder.encode_head(text, n, new_chars=0)
    assert again == whole[:n] or (again is None and len(text) > n * 6)


def test_a_conversation_s_next_turn_encodes_only_its_new_message(
    tokenizer: TextTokenizer, encoder: SegmentEncoder
) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The capital of France is"}]
    encoder.encode_head(tokenizer.render_chat(chat), 10_000)
    chat += [{"role": "assistant", "content": " Paris."}, {"role": "user", "content": "And of Germany?"}]
    text = tokenizer.render_chat(chat)
    assert encoder.encode_head(text, 10_000, new_chars=0) is None  # two new pieces: not without the tokenizer
    encoded = encoder.encoded
    assert encoder.encode_head(text, 10_000) == tokenizer.encode(text, add_special_tokens=False)
    assert encoder.encoded - encoded == 2  # the answer and the new question; the system prompt and turn 1 were known
    assert encoder.encode_head(text, 10_000, new_chars=0) == tokenizer.encode(text, add_special_tokens=False)


def test_a_read_on_a_budget_encodes_new_pieces_up_to_new_chars(
    tokenizer: TextTokenizer, encoder: SegmentEncoder
) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The capital of France is"}]
    encoder.encode_head(tokenizer.render_chat(chat), 10_000)
    chat[1]["content"] = "And of Germany?"  # one new piece: the message and its role's header, ~20 characters
    text = tokenizer.render_chat(chat)
    assert encoder.encode_head(text, 10_000, new_chars=10) is None
    encoded = encoder.encoded
    assert encoder.encode_head(text, 10_000, new_chars=64) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert encoder.encoded - encoded == 1  # and remembered, as any piece encoded


def test_what_it_remembers_is_bounded(
    tokenizer: TextTokenizer, encoder: SegmentEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments, "MAX_PIECES", 5)
    monkeypatch.setattr(segments, "MAX_PIECE_CHARS", 40)
    for i in range(20):
        encoder.encode_head(tokenizer.render_chat([{"role": "user", "content": f"question {i}"}]), 10_000)
    pieces, chars = encoder.size()
    assert pieces <= 5
    assert chars == sum(len(piece) for piece in encoder._known)  # the count that bounds MAX_CHARS stays true
    long = "x" * 41
    encoder.encode_head(tokenizer.render_chat([{"role": "user", "content": long}]), 10_000)
    assert all(long not in piece for piece in encoder._known)


def test_a_text_longer_than_the_budget_is_read_only_as_far_as_it(
    tokenizer: TextTokenizer, encoder: SegmentEncoder
) -> None:
    text = tokenizer.render_chat([{"role": "user", "content": "hello world " * 500}])
    assert encoder.encode_head(text, 20) == tokenizer.encode(text, add_special_tokens=False)[:20]
    assert encoder.encode_head(text, 20, new_chars=0) is None  # the long path never runs on the loop
    assert encoder.size() == (0, 0)


def test_a_tokenizer_whose_first_piece_is_read_apart_gets_no_encoder(tmp_path: Path) -> None:
    """SentencePiece's ``Metaspace`` with ``prepend_scheme: first`` puts a space before a text's first piece only:
    piece by piece, every message would gain one. The probe finds it, and the router encodes whole texts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from preheat.testing.synthetic import TINY_CHAT_TEMPLATE

    made = Tokenizer(models.BPE(unk_token="<unk>"))
    made.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False)  # fmt: skip
    made.train_from_iterator(["you are terse answer in one line hello there how are you what is"] * 4, trainer)
    made.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": TINY_CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    spm = TextTokenizer.from_dir(str(tmp_path))
    text = spm.render_chat([{"role": "user", "content": "hello there"}])
    pieces = [p for p in SegmentEncoder(spm, {"<|im_start|>": 1, "<|im_end|>": 2})._split.split(text) if p]
    assert [i for p in pieces for i in spm.encode(p, add_special_tokens=False)] != spm.encode(
        text, add_special_tokens=False
    )  # the premise: piece by piece differs here
    assert SegmentEncoder.for_tokenizer(spm) is None
