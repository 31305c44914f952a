"""A rendered chat's token ids from the pieces it is made of, each piece encoded once: the router's tokenizer cache.

A chat template writes every message between added tokens (ChatML's ``<|im_start|>`` ... ``<|im_end|>``, Llama 3's
``<|start_header_id|>`` ...), and ``tokenizers`` splits a text on its added tokens before anything else: each piece
between them is normalized, pre-tokenized and encoded on its own. So a chat's ids are its pieces' ids laid end to
end, and a piece seen before (a system prompt, every earlier turn of a conversation) need not be encoded again: only
a turn's new message is. The router encodes each request's whole conversation to route it (``router/prompts.py``);
with this, a multi-turn chat costs it the tokens of its last message, and a request whose pieces are all known is
read without the tokenizer at all (so on the event loop, without a thread: ``new_chars=0``); one whose new pieces are
short is encoded there too (``new_chars=N``: the tokenizer then costs less than the hop to a thread).

That is exact only for tokenizers whose pieces do not depend on where they stand. ``for_tokenizer`` checks it: every
added token matched as written (not normalized, no ``lstrip``/``rstrip``/``single_word``), and a probe chat, rendered
by the model's template, whose pieces' ids must equal its whole encoding (a pre-tokenizer that treats a text's first
piece apart, as ``Metaspace``'s ``prepend_scheme: first`` does, fails it). Any other tokenizer gets no cache (None):
the router encodes whole texts, as before. An added token's text inside a message splits it here as it splits it in
the tokenizer, so users cannot make the two differ.

Bounded: at most ``MAX_PIECES`` pieces and ``MAX_CHARS`` characters remembered, the oldest first out (not the least
recently used: a lookup then changes nothing, so known chats are read without a lock; a hot piece pushed out is
encoded once more), no piece longer than ``MAX_PIECE_CHARS``; a text longer than ``max_tokens`` could fill is read as
before, only as far as those tokens (``TextTokenizer.encode_head``), not piece by piece.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING

from preheat.core.errors import RequestError

if TYPE_CHECKING:
    from preheat.text.tokenizer import TextTokenizer

MAX_PIECES = 16_384
MAX_CHARS = 8_000_000  # ~8 MB of text (and its ids, a few times that): a fleet's system prompts and live chats
MAX_PIECE_CHARS = 256 * 1024
_CHARS_PER_TOKEN = 6  # TextTokenizer.encode_head's first guess at the text a token takes
_PROBE = [
    {"role": "system", "content": "You are terse.  Answer in one line."},
    {"role": "user", "content": " Hello there,\n how are you? 3.14 == 22/7?"},
    {"role": "assistant", "content": "Fine, thanks!  "},
    {"role": "user", "content": "\tWhat's 2+2?\n\n"},
]


class SegmentEncoder:
    """Encodes texts piece by piece (the pieces between added tokens), remembering each piece's ids; thread-safe."""

    def __init__(self, tokenizer: TextTokenizer, added: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        # Each added token's text and its id, as the piece of ids it stands for (and "" for none, which splitting
        # leaves between two added tokens).
        self._added_ids: dict[str, tuple[int, ...]] = {text: (token_id,) for text, token_id in added.items()}
        self._added_ids[""] = ()
        # Longest first: at one position the longest added token wins, as the tokenizer's own matcher does.
        alternatives = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(token) for token in alternatives) + ")")
        self._lock = threading.Lock()  # held to learn and forget pieces, never to look one up
        # The pieces learnt, oldest first; and every piece's ids, learnt or added, in one map for the lookup.
        self._known: dict[str, tuple[int, ...]] = {}
        self._ids: dict[str, tuple[int, ...]] = dict(self._added_ids)
        self._chars = 0
        self.encoded = 0  # pieces the tokenizer was asked for

    @classmethod
    def for_tokenizer(cls, tokenizer: TextTokenizer) -> SegmentEncoder | None:
        """An encoder for ``tokenizer``, or None when encoding piece by piece would not give its exact ids."""
        added: dict[str, int] = {}
        for token_id, token in tokenizer.tokenizer.get_added_tokens_decoder().items():
            if token.normalized or token.lstrip or token.rstrip or token.single_word or not token.content:
                return None
            added[token.content] = token_id
        if not added or tokenizer.template is None:
            return None
        encoder = cls(tokenizer, added)
        try:
            text = tokenizer.render_chat(_PROBE)
        except RequestError:  # a template that wants other roles (no system prompt): the whole-text way, as before
            return None
        whole = tokenizer.encode(text, add_special_tokens=False)
        if len(encoder._split.split(text)) < 3 or encoder.encode_head(text, len(whole) + 1) != whole:
            return None
        encoder.clear()
        return encoder

    def encode_head(self, text: str, max_tokens: int, *, new_chars: int | None = None) -> list[int] | None:
        """``tokenizer.encode(text, add_special_tokens=False)[:max_tokens]``. ``new_chars``: the most characters of
        pieces not known yet it may encode (0: known pieces only), else None and nothing is encoded; None: any."""
        if len(text) > max_tokens * _CHARS_PER_TOKEN:  # may run past the budget: read only as far as it goes
            if new_chars is not None:
                return None
            return self.tokenizer.encode_head(text, max_tokens, add_special_tokens=False)
        parts: list[tuple[int, ...]] = []
        missing: dict[str, list[int]] = {}  # piece -> where its ids go in ``parts``
        new = 0
        # Every known request is read on the router's event loop: one lookup a piece, no lock, no tuple made.
        known_ids = self._ids.get
        for piece in self._split.split(text):
            known = known_ids(piece)
            if known is None:
                new += len(piece)
                if new_chars is not None and new > new_chars:
                    return None
                missing.setdefault(piece, []).append(len(parts))
                known = ()
            parts.append(known)
        if missing:
            self._encode(missing, parts)
        ids: list[int] = []
        for part in parts:
            ids += part
        return ids if len(ids) <= max_tokens else ids[:max_tokens]

    def _encode(self, missing: dict[str, list[int]], parts: list[tuple[int, ...]]) -> None:
        """Encode the pieces not known yet (one call, the GIL released) into ``parts``, and remember them."""
        pieces = list(missing)
        encoded = self.tokenizer.encode_many(pieces, add_special_tokens=False)
        with self._lock:
            self.encoded += len(pieces)
            for piece, ids in zip(pieces, encoded, strict=True):
                for at in missing[piece]:
                    parts[at] = ids
                if len(piece) <= MAX_PIECE_CHARS and piece not in self._known:
                    self._known[piece] = self._ids[piece] = ids
                    self._chars += len(piece)
            while self._known and (len(self._known) > MAX_PIECES or self._chars > MAX_CHARS):
                oldest = next(iter(self._known))
                del self._known[oldest], self._ids[oldest]
                self._chars -= len(oldest)

    def clear(self) -> None:
        with self._lock:
            self._known.clear()
            self._ids = dict(self._added_ids)
            self._chars = 0
            self.encoded = 0

    def size(self) -> tuple[int, int]:
        """Pieces and characters remembered."""
        with self._lock:
            return len(self._known), self._chars
