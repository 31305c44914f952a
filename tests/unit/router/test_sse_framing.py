"""The router's server-sent-event framing (router/sse.py): however a stream is cut into pieces, the events come out
whole, unchanged and in order, and no more is held than the event still arriving."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from preheat.router.sse import EventFramer
from strategies import FUZZ

# Event bodies full of the bytes that matter: newlines (single ones are lines of one event), carriage returns, data.
event_bodies = st.lists(st.sampled_from([b"data: ", b"x", b"\n", b"\r", b"{", b"}", b"\xe2\x82\xac"]), max_size=30).map(
    lambda parts: b"".join(parts).replace(b"\n\n", b"\n").strip(b"\n") or b"data: x"
)


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@FUZZ
@given(st.lists(event_bodies, min_size=1, max_size=10), st.lists(st.integers(min_value=0), max_size=40), st.booleans())
def test_any_cut_of_a_stream_gives_back_its_events_whole(events: list[bytes], cuts: list[int], cut_last: bool) -> None:
    stream = b"".join(e + b"\n\n" for e in events)
    if cut_last:
        stream = stream[:-1]  # the stream ends mid-event: what is held comes out at the end, as it was
    framer = EventFramer()
    out: list[bytes] = []
    longest = max(len(e) + 2 for e in events)
    for piece in pieces_of(stream, cuts):
        ready = framer.push(piece)
        assert ready == b"" or ready.endswith(b"\n\n")  # whole events only
        assert framer.held <= longest  # only the event still arriving is held
        out.append(ready)
    out.append(framer.end())
    assert b"".join(out) == stream
    assert framer.held == 0


def test_an_event_in_one_piece_is_passed_on_as_it_came() -> None:
    piece = b'data: {"x": 1}\n\n'
    assert EventFramer().push(piece) is piece  # no copy on the usual path


def test_a_blank_line_split_over_two_pieces_ends_the_event() -> None:
    framer = EventFramer()
    assert framer.push(b"data: a\n") == b""
    assert framer.push(b"\ndata: b") == b"data: a\n\n"
    assert framer.held == len(b"data: b")
