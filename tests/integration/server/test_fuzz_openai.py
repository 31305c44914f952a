"""OpenAI request bodies from anyone: every body is a validated request, a 404 for a model not served, or a 400 naming
the problem, in the pure parser (fuzzed) and over the wire, from ``preheat serve`` and from the router in front of it,
which reads bodies too.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.errors import APIError
from preheat.router.cluster import ServerProcess
from preheat.text.request import CHAT_ROLES, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, GenerationRequest, parse_request
from routing import NAME, running_router, start_replicas
from serving import Client
from strategies import FUZZ, huge_ints, json_values, tricky_text

FIELDS = {
    "model": st.just(NAME) | tricky_text,
    "prompt": tricky_text | st.lists(huge_ints(), max_size=4) | st.lists(tricky_text, max_size=2),
    "messages": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from([*CHAT_ROLES, "robot"]),
                "content": tricky_text
                | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": tricky_text})),
            },
        )
        | json_values(5),
        max_size=3,
    ),
    "max_tokens": huge_ints() | st.booleans(),
    "max_completion_tokens": huge_ints(),
    "temperature": st.floats() | huge_ints(),
    "top_p": st.floats() | huge_ints(),
    "stop": tricky_text | st.lists(st.text(max_size=300), max_size=20) | json_values(5),
    "seed": huge_ints(),
    "stream": st.booleans() | json_values(3),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values(2)}),
    "n": huge_ints(),
    "logprobs": json_values(2),
    "user": json_values(10),
}
bodies = st.fixed_dictionaries({}, optional={name: value | json_values(5) for name, value in FIELDS.items()})


def parsed(raw: bytes, kind: str) -> GenerationRequest | APIError:
    try:
        return parse_request(raw, kind, NAME)
    except APIError as exc:
        return exc


def check(raw: bytes, kind: str) -> None:
    """``raw`` is a valid request of ``kind`` within every bound, an APIError 404 for a model this server does not
    serve (as OpenAI answers), or an APIError 400."""
    request = parsed(raw, kind)
    if isinstance(request, APIError):
        assert request.status in (400, 404)
        assert (request.status == 404) == (request.code == "model_not_found")
        assert request.message
        return
    assert request.kind == kind
    assert len(request.stop) <= MAX_STOP_SEQUENCES
    assert all(0 < len(s) <= MAX_STOP_CHARS for s in request.stop)
    assert 0.0 <= request.temperature <= 2.0
    assert 0.0 < request.top_p <= 1.0
    assert request.max_tokens is None or request.max_tokens >= 1
    assert (request.messages is not None) == (kind == "chat")


@FUZZ
@given(bodies, st.sampled_from(["completion", "chat"]))
def test_any_body_is_a_request_or_a_400(body: dict[str, Any], kind: str) -> None:  # Any: JSON values
    check(json.dumps(body).encode(), kind)


@FUZZ
@given(st.binary(max_size=300) | json_values().map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_request_or_a_400(raw: bytes) -> None:
    check(raw, "chat")
    check(raw, "completion")


# -- over the wire: one replica, and the router (which tokenizes bodies for policy prefix) in front of it -------------
@pytest.fixture(scope="module")
def replica(tiny_servable_model: Path) -> Iterator[ServerProcess]:
    (started,) = start_replicas(str(tiny_servable_model), 1, "--max-model-len", "256")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def urls(replica: ServerProcess, tiny_servable_model: Path) -> Iterator[dict[str, str]]:
    with running_router([replica.url], "prefix", model=str(tiny_servable_model), kv_chunk_tokens=16) as router:
        yield {"replica": replica.url, "router": router.url}


def raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, Any]]:  # Any: the JSON answer
    """Send bytes as they are (headers no client library would send) and read the status and JSON answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + b"\r\n" + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize("via", ["replica", "router"])
def test_a_deeply_nested_body_gets_a_400_over_the_wire(urls: dict[str, str], via: str) -> None:
    deep = b'{"prompt": "Hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = Client(urls[via]).post("/v1/completions", deep)
    assert reply.status == 400, reply.body[:200]
    assert reply.json()["error"]["code"] == "invalid_json"
    assert "nested deeper than 64 levels" in reply.json()["error"]["message"]
    assert Client(urls[via]).post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status == 200


@pytest.mark.parametrize("via", ["replica", "router"])
def test_too_many_stop_sequences_get_a_400_over_the_wire(urls: dict[str, str], via: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": ["x"] * 10_000, "max_tokens": 2}
    reply = Client(urls[via]).post("/v1/chat/completions", body)
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("via", ["replica", "router"])
@pytest.mark.parametrize(
    "length", ["\u00b2", "9" * 5_000, "-1", "1_0"], ids=["superscript", "5000-digits", "-1", "1_0"]
)
def test_a_content_length_that_is_not_a_byte_count_is_refused(urls: dict[str, str], via: str, length: str) -> None:
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\nConnection: close\r\n".encode(
        "latin-1"
    )
    status, answer = raw_request(urls[via], head, b'{"prompt": "Hi"}')
    assert status == 411
    assert answer["error"]["code"] == "length_required"


@pytest.mark.parametrize("via", ["replica", "router"])
def test_a_post_without_content_length_has_an_empty_body_not_a_411(urls: dict[str, str], via: str) -> None:
    # RFC 9112 6.3: neither Content-Length nor Transfer-Encoding means no body. A route that needs one says so (400).
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    status, answer = raw_request(urls[via], head)
    assert status == 400, answer
    assert answer["error"]["code"] != "length_required"


def test_a_bodiless_post_to_a_control_route_is_taken_as_an_empty_one(urls: dict[str, str]) -> None:
    # `curl -X POST .../v1/preheat/wake` sends no Content-Length: answered as with an empty body (here: 409, the
    # replica is awake), not 411.
    head = b"POST /v1/preheat/wake HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    bodiless = raw_request(urls["replica"], head)
    empty = raw_request(urls["replica"], head + b"Content-Length: 0\r\n")
    assert bodiless == empty
    assert bodiless[0] != 411


@pytest.mark.parametrize("via", ["replica", "router"])
def test_a_chunked_body_without_content_length_is_still_a_411(urls: dict[str, str], via: str) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
    status, answer = raw_request(urls[via], head, b"5\r\nhello\r\n0\r\n\r\n")
    assert status == 411
    assert answer["error"]["code"] == "length_required"
