"""HTTP/1.1 heads as the event-loop router reads and writes them (preheat.http.wire): bounded, strict where request
smuggling lives (header names, lengths), and round-tripping what it writes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from preheat.http.wire import (
    MAX_HEADERS,
    RequestHead,
    ResponseHead,
    WireRefusal,
    chunk,
    parse_chunk_size,
    parse_request_head,
    parse_response_head,
    request_head,
    response_head,
)


def test_a_request_head_is_read_with_its_headers_looked_up_without_case() -> None:
    head = parse_request_head(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: r\r\nX-Session-Id: abc\r\n\r\n")
    assert isinstance(head, RequestHead)
    assert (head.method, head.path, head.headers.get("x-session-id")) == ("POST", "/v1/chat/completions", "abc")
    assert head.keep_alive


def test_http_1_0_closes_unless_it_asks_to_keep_alive() -> None:
    plain = parse_request_head(b"GET / HTTP/1.0\r\n\r\n")
    kept = parse_request_head(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert isinstance(plain, RequestHead)
    assert isinstance(kept, RequestHead)
    assert (plain.keep_alive, kept.keep_alive) == (False, True)


def test_too_many_headers_are_a_431() -> None:
    lines = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    refusal = parse_request_head(b"GET / HTTP/1.1\r\n" + lines + b"\r\n")
    assert isinstance(refusal, WireRefusal)
    assert refusal.status == 431


def test_a_header_name_with_a_space_is_refused() -> None:
    # "Content-Length : 5" is read differently by different servers: the root of request smuggling.
    refusal = parse_request_head(b"POST / HTTP/1.1\r\nContent-Length : 5\r\n\r\n")
    assert isinstance(refusal, WireRefusal)
    assert refusal.status == 400


def test_an_unknown_version_is_a_505_and_a_bad_line_a_400() -> None:
    assert parse_request_head(b"GET / HTTP/2.0\r\n\r\n") == WireRefusal(505, "HTTP version 'HTTP/2.0' is not supported")
    bad = parse_request_head(b"GET /\r\n\r\n")
    assert isinstance(bad, WireRefusal)
    assert bad.status == 400


def test_a_response_head_says_how_its_body_is_framed() -> None:
    sized = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n")
    chunked = parse_response_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n")
    closing = parse_response_head(b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\n")
    assert isinstance(sized, ResponseHead)
    assert (sized.length, sized.chunked) == (12, False)
    assert isinstance(chunked, ResponseHead)
    assert (chunked.length, chunked.chunked) == (None, True)
    assert isinstance(closing, ResponseHead)
    assert not closing.keep_alive
    assert isinstance(parse_response_head(b"HTTP/1.1 2000 OK\r\n\r\n"), str)


@given(st.binary(max_size=300))
def test_a_chunk_frames_any_bytes_and_its_size_line_reads_back(data: bytes) -> None:
    framed = chunk(data)
    size_line, _, rest = framed.partition(b"\r\n")
    assert parse_chunk_size(size_line) == len(data)
    assert rest == (data + b"\r\n" if data else b"\r\n")


def test_a_chunk_size_line_that_is_not_hex_is_refused() -> None:
    assert parse_chunk_size(b"1a;ext=1") == 26
    assert parse_chunk_size(b"zz") is None
    assert parse_chunk_size(b"") is None
    assert parse_chunk_size(b"1" * 17) is None


def test_what_is_written_parses_back() -> None:
    sent = parse_request_head(request_head("POST", "/v1/completions", "r:1", [("A", "b")], 7))
    answer = parse_response_head(response_head(201, [("Content-Length", "0")], "preheat-router"))
    assert isinstance(sent, RequestHead)
    assert sent.headers.get("content-length") == "7"
    assert sent.headers.get("host") == "r:1"
    assert isinstance(answer, ResponseHead)
    assert answer.status == 201
    assert answer.headers.get("server") == "preheat-router"


def test_a_bare_cr_or_lf_inside_a_header_line_is_refused() -> None:
    for line in (b"X-A: one\ntwo", b"X-A: one\rtwo", b"X-A\n: v"):
        refusal = parse_request_head(b"GET / HTTP/1.1\r\n" + line + b"\r\n\r\n")
        assert isinstance(refusal, WireRefusal), line
        assert refusal.status == 400
