"""Prefix sharing, routing and LRU tiers: hand-checked cases and the properties a capacity plan relies on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.kv.keys import chunk_keys
from preheat.plan.analyze import AnalyzeSettings, analyze, key_requests
from preheat.plan.prefix import (
    UNBOUNDED,
    KeyedRequest,
    KeyTable,
    capacity_sweep,
    reusable_chunks,
    route_prefix_aware,
    route_round_robin,
    simulate_lru,
)
from preheat.plan.traces import Request

C = 4
FP = "0" * 32


def _req(*keys: int) -> KeyedRequest:
    return KeyedRequest(tuple(keys), (len(keys) + 1) * C)


def test_reusable_prefix_stops_at_the_first_unseen_chunk() -> None:
    trace = [_req(1, 2, 3), _req(1, 2, 9), _req(1, 5, 3), _req(7)]
    assert reusable_chunks(trace) == [0, 2, 1, 0]


def test_shared_prefix_ratio_counts_leading_tokens_seen_before() -> None:
    system = list(range(100, 108))  # two full chunks every request shares
    requests = [Request(i, None, 0, 0, token_ids=[*system, 1000 + i, 1, 2, 3, 4]) for i in range(4)]
    table = KeyTable()
    settings = AnalyzeSettings(fingerprint=FP, chunk_tokens=C, replicas=2)
    keyed = key_requests(requests, settings, table)
    assert [len(k.keys) for k in keyed] == [3, 3, 3, 3]  # 13 tokens: 3 cacheable chunks, the last token never
    report = analyze(keyed, settings, len(table))
    assert report.reusable_tokens == [0, 8, 8, 8]
    assert report.shared_prefix_ratio == 24 / 52
    assert report.infinite_shared.hit_tokens == 24
    assert report.to_dict()["shared_prefix_ratio"] == 24 / 52


def test_keys_match_the_caches_own_key_function() -> None:
    ids = list(range(10))
    table = KeyTable()
    keyed = key_requests(
        [Request(1, None, 0, 0, token_ids=ids)], AnalyzeSettings(fingerprint=FP, chunk_tokens=C), table
    )
    assert table.intern(chunk_keys(FP, ids, C)) == keyed[0].keys  # same strings, same interned ids


def test_round_robin_spreads_a_shared_prefix_and_prefix_aware_keeps_it_together() -> None:
    trace = [_req(1, 2), _req(1, 3), _req(1, 4), _req(1, 5)]
    assert route_round_robin(trace, 2) == [0, 1, 0, 1]
    assert route_prefix_aware(trace, 2) == [0, 0, 0, 0]
    rr = simulate_lru(trace, route_round_robin(trace, 2), 2, l1_chunks=UNBOUNDED, chunk_tokens=C)
    pa = simulate_lru(trace, route_prefix_aware(trace, 2), 2, l1_chunks=UNBOUNDED, chunk_tokens=C)
    assert (rr.l1_chunks, pa.l1_chunks) == (2, 3)


def test_prefix_aware_routing_stops_piling_onto_one_replica() -> None:
    trace = [_req(1, i) for i in range(2, 200)]
    routes = route_prefix_aware(trace, 4, window=16)
    assert len(set(routes)) > 1  # everyone shares chunk 1, yet the load limit spreads them
    for end in range(16, len(routes)):  # no replica takes more than twice its share of any 16 requests
        assert max(routes[end - 16 : end].count(r) for r in range(4)) <= 8


def test_lru_evicts_the_least_recently_used_prefix() -> None:
    trace = [_req(1), _req(2), _req(1), _req(3), _req(2), _req(1)]
    result = simulate_lru(trace, [0] * 6, 1, l1_chunks=2, chunk_tokens=C)
    # hits: 1 (3rd) ; 3 evicts 2 ; 2 misses (evicts 1) ; 1 misses
    assert result.l1_chunks == 1
    assert result.cacheable_chunks == 6


def test_a_lookup_needs_a_contiguous_prefix_across_tiers() -> None:
    trace = [_req(1, 2, 3), _req(1, 2, 3)]
    both = simulate_lru(trace, [0, 1], 2, l1_chunks=UNBOUNDED, l2_chunks=UNBOUNDED, chunk_tokens=C)
    assert (both.l1_chunks, both.l2_chunks) == (0, 3)  # replica 1 finds all three in the shared L2
    same = simulate_lru(trace, [0, 0], 2, l1_chunks=UNBOUNDED, l2_chunks=UNBOUNDED, chunk_tokens=C)
    assert (same.l1_chunks, same.l2_chunks) == (3, 0)


def test_a_tail_is_evicted_before_its_head() -> None:
    trace = [_req(1, 2, 3), _req(9), _req(1, 2, 3)]
    result = simulate_lru(trace, [0, 0, 0], 1, l1_chunks=3, chunk_tokens=C)
    assert result.l1_chunks == 2  # chunk 9 pushed out chunk 3 (the tail), the prefix 1, 2 still hits


def test_capacity_sweep_ends_at_the_working_set() -> None:
    assert capacity_sweep(1) == [1]
    points = capacity_sweep(5000, 8)
    assert points[0] == 1
    assert points[-1] == 5000
    assert points == sorted(set(points))


# Traces with heavy sharing: a few "documents" (chains) extended by random suffixes.
_chains = st.lists(st.integers(0, 6), min_size=1, max_size=6)
_traces = st.lists(st.tuples(st.integers(0, 3), _chains), min_size=1, max_size=60)


def _keyed(trace: list[tuple[int, list[int]]]) -> list[KeyedRequest]:
    table = KeyTable()
    out = []
    for head, tail in trace:
        tokens = [head, *tail]
        keys = [f"{tokens[: i + 1]}" for i in range(len(tokens))]  # chained: a key names its whole prefix
        out.append(KeyedRequest(table.intern(keys), (len(tokens) + 1) * C))
    return out


@settings(max_examples=60, deadline=None)
@given(_traces, st.integers(1, 4), st.integers(0, 30), st.integers(0, 30), st.booleans())
def test_hit_rate_never_falls_as_capacity_grows(
    trace: list[tuple[int, list[int]]], replicas: int, l1: int, l2: int, prefix_aware: bool
) -> None:
    keyed = _keyed(trace)
    route = route_prefix_aware(keyed, replicas) if prefix_aware else route_round_robin(keyed, replicas)

    def hits(a: int, b: int) -> int:
        return simulate_lru(keyed, route, replicas, l1_chunks=a, l2_chunks=b, chunk_tokens=C).hit_tokens

    base = hits(l1, l2)
    assert hits(l1 + 1, l2) >= base
    assert hits(l1, l2 + 1) >= base
    assert hits(UNBOUNDED, UNBOUNDED) >= base


@settings(max_examples=40, deadline=None)
@given(_traces, st.integers(1, 4))
def test_no_cache_beats_one_unbounded_cache_shared_by_all(trace: list[tuple[int, list[int]]], replicas: int) -> None:
    keyed = _keyed(trace)
    shared = sum(reusable_chunks(keyed))
    for route in (route_round_robin(keyed, replicas), route_prefix_aware(keyed, replicas)):
        result = simulate_lru(keyed, route, replicas, l1_chunks=UNBOUNDED, chunk_tokens=C)
        assert result.l1_chunks <= shared
    one = simulate_lru(keyed, [0] * len(keyed), 1, l1_chunks=UNBOUNDED, chunk_tokens=C)
    assert one.l1_chunks == shared
