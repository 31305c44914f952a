"""KV events from any replica: the router's parser returns a checked update or raises ``RouterError``, and the poller,
asking a real HTTP server that answers garbage, forgets that replica's cache and carries on; never another exception.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostile import ScriptedServer, endless
from preheat.core.errors import JSONInputError, RouterError
from preheat.core.jsonsafe import loads_bounded
from preheat.router.events import MAX_ANSWER_BYTES, KVEventPoller
from preheat.router.index import KVIndex, KVUpdate, parse_update
from preheat.router.upstream import Replica
from strategies import FUZZ, huge_ints, json_values

WHERE = "http://127.0.0.1:1"
KEY = "0123456789abcdef" * 2
SNAPSHOT: dict[str, Any] = {  # Any: JSON values
    "epoch": "e1",
    "fingerprint": "f" * 32,
    "chunk_tokens": 16,
    "seq": 3,
    "reset": True,
    "l2_id": "fs:///kv",
    "l1": [KEY],
    "l2": [KEY[::-1]],
    "costs": {"prefill_s_per_token": 1e-4, "l1_s_per_token": 1e-6, "l2_s_per_token": None},
    "load": {"running": 1, "waiting": 2},
}
EVENTS: dict[str, Any] = {  # Any: JSON values
    **{k: v for k, v in SNAPSHOT.items() if k not in ("l1", "l2")},
    "reset": False,
    "seq": 5,
    "events": [
        {"seq": 4, "op": "store", "tier": "l1", "key": KEY},
        {"seq": 5, "op": "evict", "tier": "l2", "key": KEY},
    ],
}


def parsed(payload: object) -> KVUpdate | RouterError:
    try:
        return parse_update(payload, WHERE)
    except RouterError as exc:
        return exc


def check(payload: object) -> None:
    update = parsed(payload)
    if isinstance(update, RouterError):
        assert WHERE in str(update)
        return
    assert int(update.fingerprint, 16) >= 0
    assert len(update.fingerprint) == 32
    assert update.chunk_tokens >= 1
    assert update.seq >= 0
    assert min(update.load) >= 0
    assert all(isinstance(k, str) for k in (*update.l1, *update.l2, *(e.key for e in update.events)))
    assert all(e.seq >= 0 and e.op in ("store", "evict") and e.tier in ("l1", "l2") for e in update.events)
    assert all(c is None or 0 < c < float("inf") for c in update.costs)


@st.composite
def mutated_answers(draw: st.DrawFn) -> dict[str, Any]:  # Any: JSON values
    """A valid answer (snapshot or events) with one field, or one field of one event, replaced by anything."""
    answer: dict[str, Any] = json.loads(json.dumps(draw(st.sampled_from([SNAPSHOT, EVENTS]))))
    value = draw(json_values(5) | huge_ints() | st.sampled_from([0, -1, "zz" * 16, "F" * 32, 1e999, [1], {}]))
    if "events" in answer and draw(st.booleans()):
        event = draw(st.sampled_from(answer["events"]))
        event[draw(st.sampled_from(["seq", "op", "tier", "key", "other"]))] = value
    elif draw(st.booleans()):
        answer[draw(st.sampled_from(sorted(answer)))] = value
    else:
        answer[draw(st.sampled_from(["costs", "load"]))] = {
            draw(st.sampled_from(["running", "waiting", "l1_s_per_token"])): value
        }
    return answer


@FUZZ
@given(mutated_answers())
def test_an_answer_with_any_field_changed_is_an_update_or_a_router_error(answer: dict[str, Any]) -> None:
    check(answer)  # Any above: JSON values


@FUZZ
@given(json_values(40))
def test_any_json_is_an_update_or_a_router_error(payload: Any) -> None:  # Any: JSON values
    check(payload)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_are_refused_by_the_json_or_the_update_check(raw: bytes) -> None:
    try:
        payload = loads_bounded(raw, max_bytes=MAX_ANSWER_BYTES)
    except JSONInputError:
        return
    check(payload)


def test_the_samples_are_valid() -> None:
    assert parse_update(SNAPSHOT, WHERE).l1 == (KEY,)
    assert [e.seq for e in parse_update(EVENTS, WHERE).events] == [4, 5]


# -- the poller against a real server that answers whatever a test says -------------------------------------------
HOSTILE: dict[str, Iterable[bytes]] = {
    "deep": [b"[" * 100_000],
    "endless": [],  # more than MAX_ANSWER_BYTES, sent for as long as it is read (made in the test)
    "not json": [b"{nope"],
    "list load": [json.dumps({**SNAPSHOT, "load": {"running": [1]}}).encode()],
    "zero chunk": [json.dumps({**SNAPSHOT, "chunk_tokens": 0}).encode()],
    "bad fingerprint": [json.dumps({**SNAPSHOT, "fingerprint": "not hex"}).encode()],
    "5000-digit seq": [json.dumps(SNAPSHOT).replace('"seq": 3', '"seq": ' + "9" * 5_000).encode()],
    "event without key": [json.dumps({**EVENTS, "events": [{"seq": 4, "op": "store", "tier": "l1"}]}).encode()],
    "keys not strings": [json.dumps({**SNAPSHOT, "l1": [1, 2]}).encode()],
}


@pytest.fixture
def replica_says() -> Iterator[tuple[dict[str, Iterable[bytes]], Replica]]:
    """A stand-in replica whose next ``/v1/kv/events`` answer is ``says["next"]``."""
    says: dict[str, Iterable[bytes]] = {}

    def script(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Iterable[bytes]]:
        return 200, {"Content-Type": "application/json"}, says["next"]

    with ScriptedServer(script) as server:
        yield says, Replica(server.url)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_replica_answering_garbage_is_forgotten_not_fatal(
    replica_says: tuple[dict[str, Iterable[bytes]], Replica], case: str
) -> None:
    says, replica = replica_says
    index = KVIndex()
    poller = KVEventPoller([replica], index, timeout=10)
    says["next"] = [json.dumps(SNAPSHOT).encode()]
    assert poller.poll(replica)
    state = index.state(replica.url)
    assert state is not None
    assert KEY in state.l1
    says["next"] = endless(b"[" + b'"aaaa",' * 10_000) if case == "endless" else HOSTILE[case]
    assert poller.poll(replica)  # no exception, and the poller carries on
    assert index.state(replica.url) is None  # what it said before is no longer trusted: the next poll resnapshots
    says["next"] = [json.dumps(SNAPSHOT).encode()]
    assert poller.poll(replica)
    assert index.state(replica.url) is not None
    poller.stop()
