"""The OpenAI wire format of answers as pure code: response, stream chunk, usage and model-list dicts out.

The requests they answer are parsed by ``preheat.text.request``, which the router shares; these shapes only the
server writes. Nothing here touches a socket or the engine, so every field is tested as plain functions.
"""

from __future__ import annotations

from preheat.text.request import GenerationRequest


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, object]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens`` (prefix tokens not recomputed)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(
    request: GenerationRequest, request_id: str, created: int, *, text: str, finish: str | None, use: dict[str, object]
) -> dict[str, object]:
    """The non-streaming answer: ``text_completion`` or ``chat.completion``."""
    if request.kind == "chat":
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": request.model,
        "choices": [choice],
        "usage": use,
    }


def stream_chunk(
    request: GenerationRequest,
    request_id: str,
    created: int,
    text: str | None,
    finish: str | None,
    *,
    first: bool = False,
) -> dict[str, object]:
    """One streamed chunk. Chat's first chunk carries the role; ``text=None`` with a finish reason ends the choice."""
    if request.kind == "chat":
        delta: dict[str, object] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    chunk: dict[str, object] = {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": request.model,
        "choices": [choice],
    }
    if request.include_usage:
        chunk["usage"] = None  # OpenAI sends null on every chunk but the last when usage is requested
    return chunk


def usage_chunk(request: GenerationRequest, request_id: str, created: int, use: dict[str, object]) -> dict[str, object]:
    """The extra last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": request.model,
        "choices": [],
        "usage": use,
    }


def models_list(name: str, created: int, max_model_len: int | None) -> dict[str, object]:
    """``GET /v1/models``: the one served model (``max_model_len`` is None until the model has loaded)."""
    model = {"id": name, "object": "model", "created": created, "owned_by": "preheat", "max_model_len": max_model_len}
    return {"object": "list", "data": [model]}
