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
    from tokenizers import Tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# Tokens of the prompt's tail decoded together with new ones, so a first generated token keeps the leading space a
# SentencePiece (Metaspace) decoder only shows after other text; the same trick vLLM and TGI use.
_CONTEXT_TOKENS = 5


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
