"""What routers tell each other through ``--shared-state`` (router/shared.py): the entry format, read as the outside
input it is, and how a router folds the others' load and learnt keys into its own decisions. Pure: no Redis here
(tests/integration/router/test_router_shared.py runs real routers on a real one)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from preheat.router.index import PrefixIndex
from preheat.router.policies import Candidate, LeastLoad, LoadGuard, Prefix, RouteRequest
from preheat.router.shared import MAX_ENTRY_KEYS, MAX_PEERS, SharedPolicy, SharedView, Update, decode, hit_ratio
from strategies import json_values

A, B = "http://a:1", "http://b:2"
KEY = "0123456789abcdef" * 2


def entry(body: object, router: bytes = b"r1") -> dict[bytes, bytes]:
    return {b"v": b"1", b"r": router, b"d": json.dumps(body).encode()}


def test_an_update_reads_back_as_it_was_written() -> None:
    update = Update("r1", "f" * 32, learn=((A, (KEY,)),), load={A: 3}, down=(B,), decisions={"prefix_match": 2.0})
    got, skipped = decode(update.encode(), {A, B})
    assert got == update
    assert skipped == []


def test_replicas_this_router_does_not_have_are_ignored_and_said() -> None:
    got, skipped = decode(entry({"learn": [["http://evil:1", [KEY]]], "load": {"http://evil:1": 5}}), {A})
    assert got is not None
    assert got.learn == ()
    assert dict(got.load) == {}
    assert skipped == ["unknown_replica"]


def test_a_replica_named_by_anything_but_a_string_is_unknown() -> None:
    got, skipped = decode(entry({"learn": [[[A], [KEY]], [{"a": 1}, []]]}), {A})
    assert got is not None
    assert got.learn == ()
    assert skipped == ["unknown_replica"]


def test_malformed_keys_loads_and_reasons_are_left_out() -> None:
    body = {"learn": [[A, [KEY, "../../etc", 7]]], "load": {A: -1, B: 10**12}, "decisions": {"Bad Reason": 1}}
    got, skipped = decode(entry(body), {A, B})
    assert got is not None
    assert got.learn == ((A, (KEY,)),)
    assert dict(got.load) == {}
    assert skipped == ["bad_decision", "bad_key", "bad_load"]


def test_an_entry_over_the_key_bound_is_cut_at_it() -> None:
    keys = [KEY] * (MAX_ENTRY_KEYS + 1)
    got, skipped = decode(entry({"learn": [[A, keys[:5]], [B, keys]]}), {A, B})
    assert got is not None
    assert got.learn == ((A, tuple(keys[:5])),)
    assert "too_many_keys" in skipped


def test_entries_that_are_no_update_are_ignored_whole() -> None:
    assert decode({b"v": b"2", b"r": b"r1", b"d": b"{}"}, {A}) == (None, ["format"])
    assert decode(entry({}, router=b"r1\nX-Injected: 1"), {A}) == (None, ["router_id"])
    assert decode({b"v": b"1", b"r": b"r1", b"d": b"[" * 10_000}, {A}) == (None, ["not_json"])
    assert decode(entry({"fp": "not hex"}), {A}) == (None, ["fingerprint"])


@given(st.dictionaries(st.binary(max_size=4), st.binary(max_size=200)))
def test_any_fields_decode_or_are_ignored(fields: dict[bytes, bytes]) -> None:
    got, skipped = decode(fields, {A})
    assert got is not None or skipped


@given(st.fixed_dictionaries({}, optional={
    "fp": json_values(3), "learn": json_values(), "load": json_values(), "down": json_values(),
    "decisions": json_values(),
}))  # fmt: skip
def test_any_json_body_gives_an_update_of_bounded_well_formed_parts(body: dict[str, object]) -> None:
    got, _ = decode(entry(body), {A, B})
    if got is None:
        return
    assert all(replica in {A, B} and all(len(k) == 32 for k in keys) for replica, keys in got.learn)
    assert set(got.load) <= {A, B}
    assert all(isinstance(n, int) and n >= 0 for n in got.load.values())
    assert set(got.down) <= {A, B}
    assert all(isinstance(n, float) for n in got.decisions.values())


def test_the_others_load_counts_until_they_go_quiet() -> None:
    now = [0.0]
    view = SharedView("me", peer_ttl=10.0, clock=lambda: now[0])
    view.heard(Update("r1", load={A: 2}), age=0.0, now_shared=0.0)
    view.heard(Update("r2", load={A: 1, B: 4}), age=8.0, now_shared=0.0)  # published 8 s ago: 2 s left
    assert view.remote_in_flight() == {A: 3, B: 4}
    now[0] = 5.0
    assert view.remote_in_flight() == {A: 2}


def test_routers_past_the_bound_are_not_heard() -> None:
    view = SharedView("me")
    assert all(view.heard(Update(f"r{i}"), age=0.0, now_shared=0.0) for i in range(MAX_PEERS))
    assert not view.heard(Update("one-more"), age=0.0, now_shared=0.0)


def test_staleness_is_the_time_since_the_view_last_held_everything() -> None:
    now = [100.0]
    view = SharedView("me", clock=lambda: now[0])
    assert view.staleness() is None
    view.synced()
    now[0] = 103.5
    assert view.staleness() == 3.5


def test_least_load_counts_the_requests_in_flight_through_other_routers() -> None:
    policy = SharedPolicy(LeastLoad(), lambda: {A: 3}, lambda replica, keys: None)
    decision = policy.choose(RouteRequest(), [Candidate(A, in_flight=0), Candidate(B, in_flight=1)])
    assert decision.replica == B  # A has 3 through the others


def test_keys_answered_here_are_published_and_keys_from_elsewhere_are_not() -> None:
    published: list[tuple[str, list[str]]] = []
    index = PrefixIndex()
    policy = SharedPolicy(Prefix("ab" * 16, 4, index, LoadGuard()), dict, lambda r, k: published.append((r, k)))
    request = RouteRequest(text=b"0123456789ab")
    policy.sent(request, A)
    policy.answered(request, A, ok=True)
    assert [replica for replica, _ in published] == [A]
    assert len(published[0][1]) == 3
    policy.learn_remote(B, published[0][1])
    assert len(published) == 1
    assert index.match(B, published[0][1]) == 3  # learnt as if routed here
    request = RouteRequest(text=b"0123456789ab")
    decision = policy.choose(request, [Candidate(A), Candidate(B)])
    assert decision.reason == "prefix_match"


def test_a_failed_answer_publishes_nothing() -> None:
    published: list[tuple[str, list[str]]] = []
    policy = SharedPolicy(Prefix("ab" * 16, 4, PrefixIndex(), LoadGuard()), dict, lambda r, k: published.append((r, k)))
    request = RouteRequest(text=b"0123456789ab")
    policy.sent(request, A)
    policy.answered(request, A, ok=False)
    assert published == []


def test_the_hit_ratio_counts_decisions_that_followed_a_cache() -> None:
    assert hit_ratio({"kv_hit": 1, "kv_no_hit": 1, "load_guard": 2}) == 0.25
    assert hit_ratio({}) is None
