"""Text in and out: the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library, its special tokens, its
chat template, and incremental detokenization for streaming.

End-of-sequence ids are the union of what ``config.json`` and ``generation_config.json`` say (``eos_token_id``, an
int or a list) and the id of ``tokenizer_config.json``'s ``eos_token``: instruct models often end turns with a token
only one of those files names (Llama 3's ``<|eot_id|>``, Qwen2's ``<|im_end|>``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from preheat.checkpoint.jsonfile import read_json_object
from preheat.core.errors import CheckpointError, RequestError
from preheat.text.chat import ChatTemplate, find_template

if TYPE_CHECKING:  # imported by from_dir: a server whose tokenizer is built in another process never needs it early
    from tokenizers import Encoding, Tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# Tokens of the prompt's tail decoded together with new ones, so a first generated token keeps the leading space a
# SentencePiece (Metaspace) decoder only shows after other text; the same trick vLLM and TGI use.
_CONTEXT_TOKENS = 5
_HEAD_CHARS_PER_TOKEN = 6  # encode_head's first guess at the text N tokens take (English: ~4); short: read 2x more


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken objects {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_ids(value: object) -> set[int]:
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return {value} if isinstance(value, int) and not isinstance(value, bool) else set()


class TextTokenizer:
    """A checkpoint's tokenizer: ``encode``/``decode``, ``eos_ids``, ``render_chat``, ``detokenizer``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_ids: Iterable[int],
        special_tokens: dict[str, str],
        template: ChatTemplate | None,
        where: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.special_tokens = special_tokens
        self.template = template
        self.where = where
        # The longest added token (``<|im_start|>``...): a cut within this many characters of one may split it.
        added = tokenizer.get_added_tokens_decoder().values()
        self._added_span = max((len(token.content) for token in added), default=1)

    @classmethod
    def from_dir(cls, root: str, *, config_eos_ids: Iterable[int] = ()) -> TextTokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json`` (and a
        ``chat_template.jinja``) from ``root``. ``CheckpointError`` when there is no usable tokenizer."""
        path = os.path.join(root, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{root}: no tokenizer.json; the engine needs the model's fast tokenizer file beside the weights",
                path=root,
            )
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as exc:
            # The Rust parser raises its own exception type for any malformed file; to a user it is a bad checkpoint.
            raise CheckpointError(f"{path}: cannot read this tokenizer: {exc}", path=path) from None
        config = read_json_object(os.path.join(root, "tokenizer_config.json"))
        generation = read_json_object(os.path.join(root, "generation_config.json"))
        special = {name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None}
        eos = set(config_eos_ids) | _int_ids(generation.get("eos_token_id"))
        eos_text = special.get("eos_token")
        if eos_text is not None and (eos_id := tokenizer.token_to_id(eos_text)) is not None:
            eos.add(eos_id)
        source = find_template(root, config)
        template = ChatTemplate(source, special, where=root) if source is not None else None
        return cls(tokenizer, eos_ids=eos, special_tokens=special, template=template, where=root)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor (e.g. BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_head(self, text: str, max_tokens: int, *, add_special_tokens: bool = True) -> list[int]:
        """``encode(text)[:max_tokens]``, reading only as much of ``text`` as those tokens need, and encoded with the
        GIL released, so other threads run meanwhile (``tokenizers`` encodes from many threads at once): the
        router's reading of prompts, where a prompt of megabytes must cost no more than the tokens routing uses.

        A text cut short encodes differently near the cut (a word split in two, an added token cut in half, a run
        of spaces whose split depends on what follows it), so the tokens of the words near the cut are dropped;
        when fewer than ``max_tokens`` are left, a piece twice as long is read, up to the whole text.
        """
        cut = max_tokens * _HEAD_CHARS_PER_TOKEN
        while True:
            if cut >= len(text):
                return list(self._encode_released(text, add_special_tokens).ids[:max_tokens])
            settled = _settled(self._encode_released(text[:cut], add_special_tokens), cut - self._added_span)
            if len(settled) >= max_tokens:
                return settled[:max_tokens]
            cut *= 2

    def encode_chat_head(self, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
        """``encode_chat(messages)[:max_tokens]``, as ``encode_head`` reads a text."""
        return self.encode_head(self.render_chat(messages), max_tokens, add_special_tokens=False)

    def encode_many(self, texts: list[str], *, add_special_tokens: bool = True) -> list[tuple[int, ...]]:
        """Each text's token ids, all encoded in one call with the GIL released (``encode_batch_fast``: no offsets
        computed, where this ``tokenizers`` has it)."""
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [tuple(encoding.ids) for encoding in batch(texts, add_special_tokens=add_special_tokens)]

    def _encode_released(self, text: str, add_special_tokens: bool) -> Encoding:
        # encode_batch releases the GIL while it works (encode does not): a long prompt does not stop other threads.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens left out."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``; ``RequestError`` when the model has no chat template."""
        if self.template is None:
            raise RequestError(
                f"model at {self.where} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja): use the completions API with a plain prompt"
            )
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat; the template writes BOS itself, so the post-processor is not applied
        (as ``apply_chat_template(tokenize=True)`` does)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        """A streaming decoder for tokens generated after ``prompt_ids``."""
        return IncrementalDetokenizer(self, prompt_ids[-_CONTEXT_TOKENS:])


def _settled(encoding: Encoding, safe: int) -> list[int]:
    """The ids of a cut text's encoding that the rest of the text cannot change: those before the word just before
    the first token ending past character ``safe`` (any token there may differ in the whole text, and so may the
    word before it: the split of a run of spaces depends on what follows). Words are the pre-tokenizer's pieces;
    with none (one word), nothing is settled and the caller reads the whole text."""
    words = encoding.word_ids
    near = next((w for w, (_, end) in zip(words, encoding.offsets, strict=True) if w is not None and end > safe), None)
    if near is None:
        return []
    keep = next((i for i, w in enumerate(words) if w is not None and w >= near - 1), len(words))
    return list(encoding.ids[:keep])


class IncrementalDetokenizer:
    """Turns generated tokens into text deltas that never split a UTF-8 character.

    Each push decodes a short window (a few tokens already shown, plus the unshown ones) and emits what the window
    adds beyond the shown part, unless it ends in U+FFFD: a multi-byte character whose bytes have not all arrived
    (byte-level BPE splits emoji and CJK over tokens). ``flush`` emits whatever is left at the end.
    """

    def __init__(self, tokenizer: TextTokenizer, context: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context)
        self._prefix = 0  # window start: tokens before it are settled
        self._read = len(self._ids)  # tokens before it have been emitted as text

    def push(self, token: int) -> str:
        """Add one generated token; return the new text it completes (possibly "")."""
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end is emitted as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        shown = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full = self._tokenizer.decode(self._ids[self._prefix :])
        if len(full) <= len(shown) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(shown) :]
