"""The ``kv`` policy's scoring, pure: the caches from KV-event snapshots, the queues from what the policy sent, no
servers. What a user of ``--policy kv`` relies on: where the caches cannot tell the replicas apart it goes by the
load, priced (as least-load where the prices are equal, a slower replica given fewer new prompts), a replica that
holds more of a prompt and has no more work queued is never passed over, and the queue is priced as the work in it,
not as a count of requests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.errors import RouterError
from preheat.kv.keys import chunk_keys
from preheat.router.aioproxy import Attempt
from preheat.router.index import KVIndex, PrefixIndex, parse_update
from preheat.router.metrics import RouterMetrics
from preheat.router.policies import Candidate, KVAware, LeastLoad, LoadGuard, RouteRequest
from preheat.router.score import Estimate
from preheat.router.upstream import Replica

FINGERPRINT, CHUNK = "f" * 32, 4
TOKENS = list(range(41))  # 10 cacheable chunks of 4 tokens (the last token is always computed)
KEYS = chunk_keys(FINGERPRINT, TOKENS, CHUNK)
COSTS = {"prefill_s_per_token": 1e-2, "l1_s_per_token": 1e-4, "l2_s_per_token": 1e-3}


def snapshot(held: int, seq: int = 1, costs: dict[str, float] = COSTS) -> dict[str, object]:
    return {"epoch": "e", "fingerprint": FINGERPRINT, "chunk_tokens": CHUNK, "seq": seq, "reset": True,
            "l2_id": None, "l1": list(reversed(KEYS[:held])), "l2": [], "costs": costs}  # fmt: skip


def kv_policy(held: dict[str, int]) -> KVAware:
    """A ``kv`` policy whose replicas hold the first ``held[name]`` chunks of ``TOKENS`` in L1 (a still clock)."""
    index = KVIndex()
    for name, n in held.items():
        index.apply(name, parse_update(snapshot(n), name))
    return KVAware(index, LoadGuard(), PrefixIndex(ttl=5.0), clock=lambda: 100.0)


def queue_up(policy: KVAware, replica: str, services: list[float]) -> None:
    """Requests sent to ``replica`` and not answered yet, each with ``services[i]`` seconds of work."""
    for service in services:
        request = RouteRequest(estimates={replica: Estimate(service, 0, 0, 0, 0.0)})
        policy.sent(request, replica)


in_flights = st.integers(min_value=0, max_value=5)
services = st.none() | st.floats(min_value=0.01, max_value=10.0)


@given(
    held=st.integers(min_value=0, max_value=10),
    loads=st.lists(st.tuples(in_flights, services), min_size=2, max_size=4),
)
def test_where_every_replica_holds_as_much_and_prices_its_queue_the_same_kv_chooses_as_least_load_does(
    held: int, loads: list[tuple[int, float | None]]
) -> None:
    names = [f"r{i}" for i in range(len(loads))]
    candidates = [Candidate(name, n, service) for name, (n, service) in zip(names, loads, strict=True)]
    kv = kv_policy(dict.fromkeys(names, held))
    decision = kv.choose(RouteRequest(token_ids=TOKENS), candidates)
    assert decision.replica == LeastLoad().choose(RouteRequest(token_ids=TOKENS), candidates).replica
    assert decision.reason == ("kv_no_hit" if held == 0 else "kv_even")


@given(
    more=st.integers(min_value=1, max_value=10),
    fewer=st.integers(min_value=0, max_value=9),
    queued=st.lists(st.floats(min_value=0.0, max_value=5.0), max_size=4),
    shorter=st.integers(min_value=0, max_value=4),
    streaming=st.integers(min_value=0, max_value=2),
    service=services,
)
def test_a_replica_with_more_of_the_prompt_and_no_more_work_queued_is_chosen(  # noqa: PLR0917 - Hypothesis's
    more: int, fewer: int, queued: list[float], shorter: int, streaming: int, service: float | None
) -> None:
    fewer = min(fewer, more - 1)
    mine = queued[: max(len(queued) - shorter, 0)]  # a sub-queue of the other's: never more work
    kv = kv_policy({"holds": more, "other": fewer})
    queue_up(kv, "holds", mine)
    queue_up(kv, "other", queued)
    candidates = [
        Candidate("other", len(queued) + streaming, service),
        Candidate("holds", len(mine) + streaming, service),
    ]
    assert kv.choose(RouteRequest(token_ids=TOKENS), candidates).replica == "holds"


def test_where_no_replica_holds_any_of_a_prompt_the_slower_one_takes_fewer_new_prompts() -> None:
    """Misses go by the priced load: the work queued at each replica at its own measured speed. A replica that
    prefills at half the speed of the other (a straggler) takes fewer of six new prompts, where least-load's count
    in flight would give each three."""
    index = KVIndex()
    index.apply("fast", parse_update(snapshot(0), "fast"))
    index.apply("slow", parse_update(snapshot(0, costs={**COSTS, "prefill_s_per_token": 2e-2}), "slow"))
    kv = KVAware(index, LoadGuard(), PrefixIndex(ttl=5.0), clock=lambda: 100.0)
    counts = {"fast": 0, "slow": 0}
    for i in range(6):
        request = RouteRequest(token_ids=[1000 * (i + 1) + t for t in TOKENS])  # six prompts, none like another
        decision = kv.choose(request, [Candidate(name, n, 1.0) for name, n in counts.items()])
        assert decision.reason == "kv_no_hit"
        kv.sent(request, decision.replica)
        counts[decision.replica] += 1
    assert counts["fast"] > counts["slow"] > 0


def test_the_queue_is_priced_as_its_work_not_as_a_count_of_requests() -> None:
    kv = kv_policy({"a": 10, "b": 0})  # the prompt is cached on a only: 0.41 s to compute it on b
    queue_up(kv, "a", [5.0])  # one long miss ahead of it on a
    candidates = [Candidate("a", 1, 1.0), Candidate("b", 0, 1.0)]
    assert kv.choose(RouteRequest(token_ids=TOKENS), candidates).replica == "b"

    kv = kv_policy({"a": 10, "b": 0})
    queue_up(kv, "a", [0.01] * 6)  # six short hits ahead of it: 0.06 s, less than computing the prompt on b
    candidates = [Candidate("a", 6, 1.0), Candidate("b", 0, 1.0)]
    assert kv.choose(RouteRequest(token_ids=TOKENS), candidates).replica == "a"

    kv = kv_policy({"a": 0, "b": 0})  # a miss everywhere: one long miss queued at a, one short hit at b
    queue_up(kv, "a", [5.0])
    queue_up(kv, "b", [0.01])
    candidates = [Candidate("a", 1, 1.0), Candidate("b", 1, 1.0)]
    assert kv.choose(RouteRequest(token_ids=TOKENS), candidates).replica == "b"


def test_an_answer_stops_counting_as_a_hit_once_the_replicas_events_evict_it() -> None:
    kv = kv_policy({"a": 0, "b": 0})
    candidates = [Candidate("a", 0, 1.0), Candidate("b", 0, 1.0)]
    request = RouteRequest(token_ids=TOKENS)
    kv.sent(request, "a")
    kv.answered(request, "a", ok=True)  # a computed (so cached) the prompt; its events have not said so yet
    assert kv.estimate(RouteRequest(token_ids=TOKENS), candidates[0]).l1_tokens == 40  # type: ignore[union-attr]
    # Its next events store the chunks and then evict them (other prompts took the room): no hit any more.
    events = [{"seq": 2 + i, "op": op, "tier": "l1", "key": key}
              for i, (op, key) in enumerate([("store", k) for k in KEYS] + [("evict", k) for k in KEYS])]  # fmt: skip
    update = {"epoch": "e", "fingerprint": FINGERPRINT, "chunk_tokens": CHUNK, "seq": 1 + len(events),
              "reset": False, "l2_id": None, "events": events, "costs": COSTS}  # fmt: skip
    kv.index.apply("a", parse_update(update, "a"))
    assert kv.estimate(RouteRequest(token_ids=TOKENS), candidates[0]).l1_tokens == 0  # type: ignore[union-attr]


def test_each_queued_request_is_priced_with_the_answer_it_still_generates() -> None:
    kv = kv_policy({"a": 10, "b": 0})
    first = RouteRequest(token_ids=TOKENS)
    kv.sent(first, "a")
    kv.answered(first, "a", ok=True)  # its first byte at once (a still clock): answers take ~1 s after it
    queue_up(kv, "a", [0.01] * 6)  # six short hits ahead, each then generating for ~1 s: ~6 s, not 0.06 s
    candidates = [Candidate("a", 6, 1.0), Candidate("b", 0, 1.0)]
    assert kv.choose(RouteRequest(token_ids=TOKENS), candidates).replica == "b"  # 0.41 s to compute it there


def test_the_load_each_replica_reported_reaches_metrics() -> None:
    index = KVIndex()
    index.apply("a", parse_update({**snapshot(2), "load": {"running": 3, "waiting": 1}}, "a"))
    index.apply("b", parse_update(snapshot(0), "b"))
    policy = KVAware(index, LoadGuard(), PrefixIndex(ttl=5.0), clock=lambda: 100.0)
    assert policy.reported_loads() == {"a": (3, 1), "b": (0, 0)}
    text = RouterMetrics(list, policy.index_sizes, policy.reported_loads).render()
    assert 'preheat_router_replica_requests{replica="a",state="running"} 3' in text
    assert 'preheat_router_replica_requests{replica="a",state="waiting"} 1' in text
    assert 'preheat_router_replica_requests{replica="b",state="running"} 0' in text


def test_requests_are_held_only_for_a_replica_that_says_its_slots_and_priced_without_keys_in_flight() -> None:
    index = KVIndex()
    index.apply("one", parse_update({**snapshot(0), "load": {"running": 1, "waiting": 0, "slots": 1}}, "one"))
    index.apply("batches", parse_update(snapshot(0), "batches"))  # says no slots: sent at once
    kv = KVAware(index, LoadGuard(), PrefixIndex(ttl=5.0), clock=lambda: 100.0)
    one = Candidate("one", 0, 1.0)
    assert kv.hold_slots(RouteRequest(token_ids=TOKENS), "batches") is None
    assert kv.hold_slots(RouteRequest(), "one") is None  # a prompt that could not be read cannot be priced
    assert kv.hold_slots(RouteRequest(token_ids=TOKENS), "one") == 1
    miss = kv.hold_cost(RouteRequest(token_ids=TOKENS), one)
    assert miss == pytest.approx(41 * 1e-2)
    # The same prompt in flight there: a request that would hit only once that one computed it is priced as the
    # miss it is now (it must not pass the one computing its prefix)...
    first = RouteRequest(token_ids=TOKENS)
    kv.sent(first, "one")
    assert kv.hold_cost(RouteRequest(token_ids=TOKENS), one) == pytest.approx(miss)
    # ...and as the hit it is once that one was answered there.
    kv.answered(first, "one", ok=True)
    hit = kv.hold_cost(RouteRequest(token_ids=TOKENS), one)
    # (and with the answer after it: 1 s a request there, its first byte at once on this still clock)
    assert hit == pytest.approx(1 * 1e-2 + 40 * 1e-4 + 1.0)


@pytest.mark.parametrize("slots", [0, -1, True, 1.5, "1", 65_537])
def test_a_replica_saying_slots_out_of_bounds_is_refused(slots: object) -> None:
    with pytest.raises(RouterError, match=r"load\.slots"):
        parse_update({**snapshot(0), "load": {"running": 0, "waiting": 0, "slots": slots}}, "r")


def test_a_request_moved_from_the_hold_is_counted_at_the_replica_that_took_it() -> None:
    """aioproxy's ``Attempt.move`` (router/hold.py: an idle replica took a held request): the first replica's count,
    queue and in-flight keys lose it, the second's gain it, and a later failure there settles it there, once."""
    kv = kv_policy({"http://a:1": 10, "http://b:1": 0})
    a, b = Replica("http://a:1"), Replica("http://b:1")
    request = RouteRequest(token_ids=TOKENS)
    kv.choose(request, [Candidate(a.url, 0, 1.0), Candidate(b.url, 0, 1.0)])
    attempt = Attempt(a, kv, request)
    request.held_seconds = 0.3  # held at "a"'s line before "b" took it
    assert (a.in_flight, kv.in_flight.sizes(), len(kv.queue(Candidate(a.url, 1, 1.0), (0, 0), 0).waiting)) == (
        1, {a.url: len(request.in_flight_keys)}, 1)  # fmt: skip
    assert attempt.move(b) is b
    assert request.held_seconds == 0.0  # sent to "b" after the hold: its first byte there is timed from now
    assert attempt.replica is b
    assert (a.in_flight, b.in_flight) == (0, 1)
    assert set(kv.in_flight.sizes()) == {b.url}
    assert not kv.queue(Candidate(a.url, 0, 1.0), (0, 0), 0).waiting
    assert len(kv.queue(Candidate(b.url, 1, 1.0), (0, 0), 0).waiting) == 1
    attempt.fail()
    attempt.fail()
    assert (a.in_flight, b.in_flight, kv.in_flight.sizes()) == (0, 0, {})
