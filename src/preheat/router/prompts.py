"""A request body, read the way the replica reads it: the session id, and the prompt's token ids (``kv``) or its
text (``prefix``: ``prompt_text``, no tokenizer).

The token ids must be exactly the replica's, or no chunk key would match: the prompt is read by the replica's own
pure ``preheat.text.request.prompt_fields`` (``parse_body``'s reading of it; the replica checks the other fields), a
chat is rendered by the model's chat template and encoded without the tokenizer's post-processor, a completions
prompt is encoded with it (BOS), and token-id prompts are taken as they are: the same ``preheat.text`` code and steps
as ``preheat.server.generation._tokenize`` through ``Engine.encode_chat`` / ``encode_prompt``. Nothing here imports
torch, the engine or the server (a test checks it).

A body the router cannot read is not refused here: it is routed by load and the replica answers its 400, so clients
see one server's errors whether or not a router stands in front of it.

Bounded: a prompt is tokenized only as far as routing can use it (``max_tokens``: the model's context window, since
no replica serves a longer prompt, unless ``--max-prompt-tokens`` says otherwise), so a prompt of megabytes costs
the router what its first tokens cost; and with no lock between requests, encoded with the GIL released
(``TextTokenizer.encode_head``), so one long prompt never holds up another request's routing.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final, Literal, overload

from preheat.checkpoint.jsonfile import read_config
from preheat.core.errors import APIError, JSONInputError, PreheatError, RouterError
from preheat.core.jsonsafe import loads_bounded
from preheat.router.policies import TEXT_BYTES_PER_TOKEN, RouteRequest
from preheat.router.upstream import parse_replica_spec
from preheat.text.request import MAX_BODY_BYTES, MAX_CONTAINERS, prompt_fields
from preheat.text.segments import SegmentEncoder
from preheat.text.skeleton import Skeletons

if TYPE_CHECKING:
    from preheat.text.tokenizer import TextTokenizer

SESSION_HEADER = "X-Session-Id"
# What an on_loop read of a prompt the tokenizer must see gives (``PromptReader.read`` then returns None).
NEEDS_TOKENIZER: Final = "needs the tokenizer"
ROUTE_KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
DEFAULT_PROMPT_TOKENS = 131_072  # when the model's config.json names no context window: the largest common one
# New text the event loop encodes itself (``on_loop``): ~75 us of SmolLM2's tokenizer for 256 characters, what handing
# the read to a thread costs on idle cores (~80 us); on cores busy with the replicas' compute the thread waits for a
# time slice (kv's own time per request measured 2.2-3.0 ms in bench/router.py's hot workload, every question new).
INLINE_CHARS = 256


class PromptReader:
    """Turns request bodies into ``RouteRequest``s; ``tokenizer`` is None for policies that need no tokens, ``text``
    True for those that read the prompt as text (at most ``max_tokens`` tokens' worth of its bytes)."""

    def __init__(
        self, tokenizer: TextTokenizer | None, max_tokens: int = DEFAULT_PROMPT_TOKENS, *, text: bool = False
    ) -> None:
        # No lock: the Rust tokenizer encodes from many threads at once (its encode takes it shared, never mutably).
        self.tokenizer, self.max_tokens, self.text = tokenizer, max_tokens, text
        # A chat's pieces encoded once each (text/segments.py), where that gives the tokenizer's exact ids.
        self.pieces = SegmentEncoder.for_tokenizer(tokenizer) if tokenizer is not None else None
        # ... and its text laid out from its shape's skeleton (text/skeleton.py), where the template allows it.
        template = tokenizer.template if tokenizer is not None else None
        self.skeletons = Skeletons.for_template(template) if template is not None and self.pieces else None

    @classmethod
    def from_model(cls, model_dir: str | None, max_tokens: int | None = None, *, text: bool = False) -> PromptReader:
        """A reader with ``model_dir``'s tokenizer (``RouterError`` when there is none), reading at most
        ``max_tokens`` of each prompt (None: the model's context window, else ``DEFAULT_PROMPT_TOKENS``); with
        ``text``, one that reads prompts as text (no model needed)."""
        if model_dir is None:
            return cls(None, max_tokens or DEFAULT_PROMPT_TOKENS, text=text)
        from preheat.text.tokenizer import TextTokenizer  # tokenizers only for policies that need tokens

        try:
            return cls(TextTokenizer.from_dir(model_dir), max_tokens or context_window(model_dir), text=text)
        except PreheatError as exc:
            raise RouterError(f"--model {model_dir}: cannot read its tokenizer: {exc}") from exc

    @overload
    def read(self, path: str, body: bytes, session_header: str | None) -> RouteRequest: ...
    @overload
    def read(self, path: str, body: bytes, session_header: str | None, *, on_loop: bool) -> RouteRequest | None: ...

    def read(
        self, path: str, body: bytes, session_header: str | None, *, on_loop: bool = False
    ) -> RouteRequest | None:
        """The session id (``X-Session-Id``, else the body's ``user``) and, with a tokenizer, the prompt's ids.
        ``on_loop``: a cheap read, for the event loop: None when the prompt's ids would need the tokenizer for more
        than ``INLINE_CHARS`` characters of new text (a chat's pieces not seen before, a plain prompt), or a chat
        read without its pieces; the caller then reads it again on a thread."""
        request = RouteRequest(session=session_header or None)
        kind = ROUTE_KINDS.get(path)
        if kind is None:
            return request
        try:
            # The replica's own bounds: a body refused here is routed by load, and the replica answers its 400.
            raw = loads_bounded(body, max_bytes=MAX_BODY_BYTES, max_containers=MAX_CONTAINERS)
        except JSONInputError:
            return request
        if not isinstance(raw, dict):
            return request
        if request.session is None and isinstance(raw.get("user"), str) and raw["user"]:
            request.session = raw["user"]
        if self.text:
            request.text = prompt_text(kind, raw, self.max_tokens * TEXT_BYTES_PER_TOKEN)
        if self.tokenizer is not None:
            ids = self._token_ids(kind, raw, on_loop)
            if ids == NEEDS_TOKENIZER:
                return None
            request.token_ids = ids
        return request

    def _token_ids(
        self, kind: str, raw: dict[str, object], on_loop: bool = False
    ) -> list[int] | Literal["needs the tokenizer"] | None:
        try:
            # Only the prompt matters here: the replica checks the other fields (and answers its 400).
            messages, prompt = prompt_fields(raw, kind)
        except APIError:
            return None
        try:
            return self._encode(messages, prompt, on_loop)
        except PreheatError:
            return None  # e.g. a chat the template cannot render: the replica will say why

    def _encode(
        self, messages: list[dict[str, str]] | None, prompt: str | list[int] | None, on_loop: bool
    ) -> list[int] | Literal["needs the tokenizer"] | None:
        tokenizer = self.tokenizer
        assert tokenizer is not None
        if messages is not None and self.pieces is not None:
            text = self.skeletons.render(messages) if self.skeletons is not None else tokenizer.render_chat(messages)
            ids = self.pieces.encode_head(text, self.max_tokens, new_chars=INLINE_CHARS if on_loop else None)
            return NEEDS_TOKENIZER if ids is None else ids
        if on_loop and (messages is not None or (isinstance(prompt, str) and len(prompt) > INLINE_CHARS)):
            return NEEDS_TOKENIZER
        if messages is not None:
            return tokenizer.encode_chat_head(messages, self.max_tokens)
        if isinstance(prompt, str):
            return tokenizer.encode_head(prompt, self.max_tokens)
        return list(prompt or [])[: self.max_tokens]


def prompt_text(kind: str, raw: Mapping[str, object], max_bytes: int) -> bytes | None:
    """The prompt as ``prefix`` keys it: a chat's messages, each its role and text between separators (a later turn's
    text starts with an earlier one's), or a completion's prompt (a string, a list of one string, or token ids, each
    id followed by a comma); its first ``max_bytes`` bytes, and no more of the body looked at than those need. None:
    no prompt in the body that routing can read (it goes by load; the replica says what is wrong with it). Lenient
    where the replica is strict: an engine may take fields preheat's own server refuses, and the keys need only be
    the same for the same prompt.

    >>> chat = [{"role": "user", "content": "hi"}]
    >>> prompt_text("chat", {"messages": chat}, 100)
    b'user\\x1fhi\\x1e'
    >>> parts = [{"type": "text", "text": "yo"}]
    >>> prompt_text("chat", {"messages": chat + [{"role": "assistant", "content": parts}]}, 11)
    b'user\\x1fhi\\x1eass'
    >>> prompt_text("completion", {"prompt": [1, 22]}, 100), prompt_text("completion", {"prompt": ["hi"]}, 100)
    (b'1,22,', b'hi')
    """
    if kind == "chat":
        return _chat_text(raw.get("messages"), max_bytes)
    prompt = raw.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt, as the OpenAI client sends for prompt=["..."]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt:
        head = prompt[: max_bytes // 2 + 1]  # an id takes at least 2 bytes ("7,"): no more of them can count
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in head):
            return None
        text = "".join(f"{t}," for t in head)  # the comma ends each id: "3," never starts "34,"
    else:
        return None
    return _bounded(text, max_bytes)


def _chat_text(messages: object, max_bytes: int) -> bytes | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            return None
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):  # content parts: their text, as the replica joins them
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        role_text = role if isinstance(role, str) else ""
        content_text = content if isinstance(content, str) else ""
        parts += (role_text, "\x1f", content_text, "\x1e")
        size += len(role_text) + len(content_text) + 2
        if size >= max_bytes:  # characters: at least as many bytes, so the rest of the chat cannot count
            break
    return _bounded("".join(parts), max_bytes)


def _bounded(text: str, max_bytes: int) -> bytes:
    # surrogatepass: a lone surrogate (JSON allows "\ud800") is still a key, not an error
    return text[:max_bytes].encode("utf-8", "surrogatepass")[:max_bytes]


def context_window(model_dir: str) -> int:
    """The longest prompt the model at ``model_dir`` takes: its ``config.json``'s ``max_position_embeddings`` (a
    multimodal model's ``text_config``'s), else ``DEFAULT_PROMPT_TOKENS`` (a ``--model @replicas`` directory holds
    only the tokenizer's files)."""
    config = read_config(model_dir)
    text = config.get("text_config")
    for where in (config, text if isinstance(text, dict) else {}):
        window = where.get("max_position_embeddings")
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            return window
    return DEFAULT_PROMPT_TOKENS


# The files GET /v1/preheat/tokenizer serves (preheat.server.app.TOKENIZER_FILES: the router may not import the
# server, tests/integration/router/test_router_engine_events.py checks the two agree).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


def tokenizer_from_replicas(urls: Sequence[str], headers: Mapping[str, str], timeout: float = 10.0) -> str:
    """A local directory with the replicas' tokenizer, for ``--model @replicas``: the first replica that answers
    ``GET /v1/preheat/tokenizer`` (a preheat replica: its files, written to a temporary directory), else whose
    ``GET /v1/models`` names a ``root`` directory that exists on this machine (vLLM: the model's local path).
    ``RouterError`` when none does.

    An engine given a hub id (not a local path) names no directory here: pass ``--model DIR`` then.
    """
    from preheat.core.errors import HTTPClientError
    from preheat.http.client import Timeouts, get

    tried: list[str] = []
    for url in urls:
        base = parse_replica_spec(url).url
        try:
            answer = get(base + "/v1/preheat/tokenizer", timeouts=Timeouts.within(timeout), headers=headers,
                         max_body=MAX_TOKENIZER_BYTES)  # fmt: skip
            if answer.status == 200:
                return _write_tokenizer(loads_bounded(answer.body, max_bytes=MAX_TOKENIZER_BYTES, max_containers=16))
            models = get(base + "/v1/models", timeouts=Timeouts.within(timeout), headers=headers, max_body=1 << 20)
            if models.status == 200:
                data = loads_bounded(models.body, max_bytes=1 << 20, max_containers=10_000)
                root = data["data"][0].get("root") if isinstance(data, dict) and data.get("data") else None
                if isinstance(root, str) and os.path.isfile(os.path.join(root, "tokenizer.json")):
                    return root
                tried.append(f"{base}: its model {root!r} is not a directory with a tokenizer.json here")
                continue
            tried.append(f"{base}: answered {answer.status} and {models.status}")
        except (HTTPClientError, JSONInputError, RouterError, KeyError, IndexError, AttributeError) as exc:
            tried.append(f"{base}: {exc}")
    raise RouterError(
        "no tokenizer: pass --model DIR (the replicas' model), or start a replica first: " + "; ".join(tried)
    )


def _write_tokenizer(payload: object) -> str:
    files = payload.get("files") if isinstance(payload, dict) else None
    if not isinstance(files, dict) or not isinstance(files.get("tokenizer.json"), str):
        raise RouterError("GET /v1/preheat/tokenizer: no tokenizer.json in the answer")
    root = tempfile.mkdtemp(prefix="preheat-router-tokenizer-")
    for name in TOKENIZER_FILES:  # only these names: the answer never chooses a path
        text = files.get(name)
        if isinstance(text, str):
            with open(os.path.join(root, name), "w", encoding="utf-8") as handle:
                handle.write(text)
    return root
