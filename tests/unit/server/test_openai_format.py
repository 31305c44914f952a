"""The server's pure parts, without sockets: OpenAI request rules, server-sent event framing."""

from __future__ import annotations

import json

import pytest

from preheat.core.errors import APIError
from preheat.server import openai, sse
from preheat.text.request import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    GenerationRequest,
    parse_body,
    parse_request,
    prompt_fields,
)


def parse(body: dict[str, object], kind: str = "completion") -> GenerationRequest:
    return parse_request(json.dumps(body).encode(), kind, "m")


def test_completion_defaults_follow_openai() -> None:
    request = parse({"prompt": "Hi"})
    defaults = (request.max_tokens, request.temperature, request.top_p, request.stop, request.seed)
    assert defaults == (16, 1.0, 1.0, [], None)
    assert not request.stream
    assert not request.include_usage


def test_chat_answers_as_long_as_the_context_allows_unless_limited() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert parse({"messages": messages}, "chat").max_tokens is None
    assert parse({"messages": messages, "max_tokens": 5}, "chat").max_tokens == 5
    assert parse({"messages": messages, "max_tokens": 5, "max_completion_tokens": 7}, "chat").max_tokens == 7


def test_prompt_forms() -> None:
    assert parse({"prompt": ["Hi"]}).prompt == "Hi"
    assert parse({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    with pytest.raises(APIError, match="batches are not supported"):
        parse({"prompt": ["a", "b"]})


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("chat", {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": [
            {"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}]}),
        ("chat", {"messages": [{"role": "user", "content": None}]}),
        ("completion", {"prompt": "Hi"}),
        ("completion", {"prompt": ["Hi"]}),
        ("completion", {"prompt": [1, 2, 3]}),
    ],
)  # fmt: skip
def test_the_routers_reading_of_a_prompt_is_the_servers(kind: str, body: dict[str, object]) -> None:
    # The router reads only the prompt (prompt_fields); the replica parses the whole body: the same prompt.
    parsed = parse_body(body, kind, "m")
    assert prompt_fields(body, kind) == (parsed.messages, parsed.prompt)


def test_the_routers_reading_refuses_a_prompt_as_the_server_does_and_ignores_the_rest() -> None:
    refused: list[tuple[str, dict[str, object]]] = [("chat", {"messages": []}), ("completion", {"prompt": ["a", "b"]})]
    for kind, body in refused:
        with pytest.raises(APIError) as by_server:
            parse_body(body, kind, "m")
        with pytest.raises(APIError) as by_router:
            prompt_fields(body, kind)
        assert by_router.value.param == by_server.value.param
    # A field only the replica checks: it answers the 400, wherever the router sent the request.
    odd = {"prompt": "Hi", "temperature": 7, "n": 3}
    with pytest.raises(APIError):
        parse_body(odd, "completion", "m")
    assert prompt_fields(odd, "completion") == (None, "Hi")


def test_chat_content_parts_are_joined_and_non_text_parts_refused() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    request = parse({"messages": [{"role": "user", "content": parts}]}, "chat")
    assert request.messages == [{"role": "user", "content": "Hello, world"}]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(APIError) as caught:
        parse({"messages": [{"role": "user", "content": image}]}, "chat")
    assert caught.value.param == "messages[0].content"


def test_a_model_is_the_served_name_or_an_alias_else_a_404() -> None:
    body = json.dumps({"model": "xxh3-128-ab12", "prompt": "Hi"}).encode()
    assert parse_request(body, "completion", "llama", aliases=("xxh3-128-ab12",)).model == "xxh3-128-ab12"
    with pytest.raises(APIError) as refused:
        parse_request(body, "completion", "llama")
    assert refused.value.status == 404
    assert refused.value.body() == {
        "error": {
            "message": "the model 'xxh3-128-ab12' does not exist here; this server serves 'llama' (see GET /v1/models)",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_booleans_are_not_numbers() -> None:
    with pytest.raises(APIError) as caught:
        parse({"prompt": "Hi", "max_tokens": True})
    assert caught.value.param == "max_tokens"


def test_stop_is_bounded_in_count_and_length() -> None:
    most = [f"s{i}" for i in range(MAX_STOP_SEQUENCES)]
    assert parse({"prompt": "Hi", "stop": most}).stop == most
    assert parse({"prompt": "Hi", "stop": "x" * MAX_STOP_CHARS}).stop == ["x" * MAX_STOP_CHARS]
    too_many: dict[str, object] = {"prompt": "Hi", "stop": [*most, "one more"]}
    too_long: dict[str, object] = {
        "messages": [{"role": "user", "content": "Hi"}],
        "stop": ["ok", "x" * (MAX_STOP_CHARS + 1)],
    }
    for body, kind, says in [(too_many, "completion", "at most 16 sequences"), (too_long, "chat", "at most 256 char")]:
        with pytest.raises(APIError, match=says) as caught:
            parse(body, kind)
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, "stop", "invalid_value")


def test_a_body_of_a_million_empty_lists_is_a_400() -> None:
    raw = b'{"prompt": "Hi", "user": [' + b"[]," * 1_000_000 + b"[]]}"
    with pytest.raises(APIError, match="more than 100000 arrays and objects") as caught:
        parse_request(raw, "completion", "m")
    assert caught.value.status == 400


def test_a_deeply_nested_body_is_a_400_not_a_recursion_error() -> None:
    for raw in (b"[" * 100_000, b'{"prompt": "Hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        with pytest.raises(APIError, match="nested deeper than 64 levels") as caught:
            parse_request(raw, "completion", "m")
        assert (caught.value.status, caught.value.code) == (400, "invalid_json")


def test_usage_chunk_closes_a_stream_that_asked_for_it() -> None:
    request = parse({"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})
    chunk = openai.stream_chunk(request, "cmpl-1", 0, "a", None)
    assert chunk["usage"] is None
    last = openai.usage_chunk(request, "cmpl-1", 0, openai.usage(3, 2, 1))
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_events_frame_and_parse_back() -> None:
    raw = sse.event({"text": "a\nb"}) + sse.event({"text": "ü"}) + sse.DONE
    assert raw.count(b"\n\n") == 3
    assert sse.parse_events(raw) == ['{"text":"a\\nb"}', '{"text":"ü"}', "[DONE]"]


def test_chunks_are_http_chunked_frames() -> None:
    assert sse.chunk(b"hello") == b"5\r\nhello\r\n"
    assert sse.chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert sse.chunk(b"") == b"", "an empty chunk would end the response"
