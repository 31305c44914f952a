"""OpenAI request bodies as pure code: bytes in, a validated ``GenerationRequest`` (or an ``APIError``) out.

Nothing here touches a socket, the engine or torch, so every rule (types, ranges, defaults, error bodies) is tested as
plain functions, and the router reads a body with the replica's own rules. Unknown fields are ignored, as OpenAI's
own server does for fields a model does not use; fields that would change the answer in ways the server cannot
honour (``n > 1``, ``logprobs``) are refused with a 400 instead. The answers' wire format is
``preheat.server.openai``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field

from preheat.core.errors import APIError, JSONInputError
from preheat.core.jsonsafe import MAX_DEPTH, loads_bounded

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Bounds on what one request may ask for (docs/server.md). The body cap is shared by the server and the router.
MAX_BODY_BYTES = 32 * 1024 * 1024
# OpenAI allows 4 stop sequences; 16 leaves room for chat-template markers. Every sequence is checked against the
# text after every token, so count x length is work per token on the one generation thread: bounded here.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
# Arrays and objects in one body (a chat of 30,000 messages): json.loads spends ~1 s and ~60 MB per million of them.
MAX_CONTAINERS = 100_000


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) request."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None  # None: as many as the context allows (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


def parse_request(raw: bytes, kind: str, served_model: str, aliases: Collection[str] = ()) -> GenerationRequest:
    """Validate a request body for ``kind`` ("completion" or "chat"); raise ``APIError`` (400) naming the field, or
    404 ``model_not_found`` for a ``model`` that is neither ``served_model`` nor one of its ``aliases``.

    The body is at most ``MAX_BODY_BYTES`` of UTF-8 JSON nested at most ``jsonsafe.MAX_DEPTH`` levels deep, with at
    most ``MAX_CONTAINERS`` arrays and objects.
    """
    try:
        body = loads_bounded(raw, max_bytes=MAX_BODY_BYTES, max_depth=MAX_DEPTH, max_containers=MAX_CONTAINERS)
    except JSONInputError as exc:
        raise bad_request(f"request body refused: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return parse_body(body, kind, served_model, aliases)


def parse_body(
    body: dict[str, object], kind: str, served_model: str, aliases: Collection[str] = ()
) -> GenerationRequest:
    """``parse_request`` for a body already decoded within its bounds (the router decodes it once for routing): every
    value is checked here, where the body enters."""
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model", code="invalid_type")
    if model != served_model and model not in aliases:
        # 404 with OpenAI's own body, as OpenAI and vLLM answer: clients tell "no such model" from a bad request.
        raise APIError(
            404,
            f"the model {model!r} does not exist here; this server serves {served_model!r} (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options", code="invalid_type")
    include_usage = _flag(options or {}, "include_usage", where="stream_options.include_usage")
    common = {
        "model": model,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        "stop": _stop(body.get("stop")),
        "seed": _integer(body, "seed", None, None),
        "stream": stream,
        "include_usage": include_usage,
    }
    messages, prompt = prompt_fields(body, kind)
    if kind == "chat":
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return GenerationRequest(
            kind="chat",
            messages=messages,
            max_tokens=_integer(body, limit_name, None, 1),
            **common,  # type: ignore[arg-type]  # each value was checked against its field's type above
        )
    return GenerationRequest(
        kind="completion",
        prompt=prompt,
        max_tokens=_integer(body, "max_tokens", 16, 1),
        **common,  # type: ignore[arg-type]  # same as above
    )


def prompt_fields(body: dict[str, object], kind: str) -> tuple[list[dict[str, str]] | None, str | list[int] | None]:
    """A body's prompt, read as ``parse_body`` reads it (it calls this): ``(messages, None)`` for a chat, ``(None,
    prompt)`` for a completion, ``APIError`` naming the field where the prompt itself is refused. No other field is
    looked at: what a router needs to route a request (the replica checks the rest, and answers its 400 wherever it
    is routed)."""
    if kind == "chat":
        return _messages(body.get("messages")), None
    return None, _prompt(body.get("prompt"))


def _refuse_unsupported(body: dict[str, object]) -> None:
    n = body.get("n", 1)
    if n != 1 and n is not None:
        raise bad_request("only n=1 is supported", param="n", code="unsupported")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad_request("best_of is not supported", param="best_of", code="unsupported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported by this server", param="logprobs", code="unsupported")
    if body.get("echo") not in (None, False):
        raise bad_request("echo is not supported", param="echo", code="unsupported")


def _flag(body: dict[str, object], name: str, *, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{where or name}' must be true or false", param=where or name, code="invalid_type")
    return value


def _integer(body: dict[str, object], name: str, default: int | None, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(value)}", param=name, code="invalid_type")
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}, got {value}", param=name, code="invalid_value")
    return value


def _number(
    body: dict[str, object], name: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {json.dumps(value)}", param=name, code="invalid_type")
    if value > high or value < low or (open_low and value == low):
        bounds = f"{'(' if open_low else '['}{low}, {high}]"
        raise bad_request(f"'{name}' must be in {bounds}, got {value}", param=name, code="invalid_value")
    return float(value)


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(value) > MAX_STOP_SEQUENCES:
        raise bad_request(
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}",
            param="stop",
            code="invalid_value",
        )
    longest = max((len(s) for s in value), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad_request(
            f"each 'stop' sequence may be at most {MAX_STOP_CHARS} characters, got one of {longest}",
            param="stop",
            code="invalid_value",
        )
    return [s for s in value if s]


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # a batch of one prompt, as the OpenAI client sends for prompt=["..."]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    raise bad_request(
        "'prompt' must be a string, a list of one string, or a list of token ids (batches are not supported)",
        param="prompt",
        code="invalid_type",
    )


def _messages(value: object) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", param=where, code="invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
        out.append({"role": str(role), "content": _content(message.get("content"), f"{where}.content")})
    return out


def _content(value: object, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text parts can reach a text-only model
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}' may only hold text parts", param=where, code="unsupported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}' must be a string or a list of text parts", param=where, code="invalid_type")
