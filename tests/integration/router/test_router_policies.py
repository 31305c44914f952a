"""The router's pure parts: expected-TTFT scoring, the prefix index, the KV-event index, the routing policies and the
torch-free prompt reader.

No sockets: recorded ``/v1/kv/events`` answers (shaped as docs/kv-events.md says) go in, decisions come out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from preheat.core.errors import ConfigError, RouterError
from preheat.kv.keys import chunk_keys
from preheat.router.index import KVIndex, PrefixIndex, parse_update
from preheat.router.policies import (
    Candidate,
    KVAware,
    LoadGuard,
    Policy,
    RouteRequest,
    make_policy,
    rendezvous,
)
from preheat.router.score import Costs, expected_ttft, resolve_costs
from preheat.router.settings import RouterSettings
from preheat.text.tokenizer import TextTokenizer

FP = "ab" * 16
C = 4
TOKENS = list(range(40))  # ten chunks of four
KEYS = chunk_keys(FP, TOKENS, C)
COSTS = {"prefill_s_per_token": 1e-3, "l1_s_per_token": 1e-5, "l2_s_per_token": 1e-4}


def snapshot(l1: list[str], l2: list[str], *, epoch: str = "e1", seq: int = 10, l2_id: str | None = "fs:///kv",
             running: int = 0, waiting: int = 0) -> dict[str, object]:  # fmt: skip
    return {
        "epoch": epoch, "fingerprint": FP, "chunk_tokens": C, "seq": seq, "reset": True, "l2_id": l2_id,
        "l1": l1, "l2": l2, "costs": COSTS, "load": {"running": running, "waiting": waiting},
    }  # fmt: skip


def events(*items: tuple[int, str, str, str], epoch: str = "e1", seq: int | None = None) -> dict[str, object]:
    return {
        "epoch": epoch, "fingerprint": FP, "chunk_tokens": C, "reset": False, "l2_id": "fs:///kv",
        "seq": seq if seq is not None else max(i[0] for i in items),
        "events": [{"seq": s, "op": op, "tier": tier, "key": key} for s, op, tier, key in items],
        "costs": COSTS, "load": {"running": 0, "waiting": 0},
    }  # fmt: skip


# -- score ----------------------------------------------------------------------------------------------------------
def test_hits_stop_at_the_first_chunk_no_tier_holds() -> None:
    estimate = expected_ttft(40, KEYS, C, l1={KEYS[0], KEYS[2]}, l2=set(), costs=Costs(1.0, 0.0, 0.0))
    assert estimate.l1_tokens == 4  # KEYS[2] cannot be used: KEYS[1] is recomputed, and K/V depend on it
    assert estimate.recompute_tokens == 36


def test_the_last_prompt_token_is_never_restored() -> None:
    estimate = expected_ttft(40, KEYS, C, l1=set(KEYS), l2=set(), costs=Costs(1.0, 0.0, 0.0))
    assert estimate.l1_tokens == 36  # 40 tokens = 10 full chunks, but only 9 may come from a cache
    assert estimate.recompute_tokens == 4


def test_an_l2_hit_costs_more_than_l1_and_less_than_recompute() -> None:
    costs = Costs(1e-3, 1e-5, 1e-4)
    in_l1 = expected_ttft(40, KEYS, C, l1=set(KEYS), l2=set(), costs=costs)
    in_l2 = expected_ttft(40, KEYS, C, l1=set(), l2=set(KEYS), costs=costs)
    cold = expected_ttft(40, KEYS, C, l1=set(), l2=set(), costs=costs)
    assert in_l1.ttft < in_l2.ttft < cold.ttft


def test_queue_wait_can_outweigh_a_cache_hit() -> None:
    costs = Costs(1e-3, 1e-5, 1e-4)
    busy_hit = expected_ttft(40, KEYS, C, l1=set(KEYS), l2=set(), costs=costs, queue_wait=1.0)
    idle_miss = expected_ttft(40, KEYS, C, l1=set(), l2=set(), costs=costs)
    assert idle_miss.ttft < busy_hit.ttft


def test_unmeasured_costs_borrow_from_peers_then_defaults() -> None:
    assert resolve_costs([None, None, None], [[4e-3, None, None]]).prefill == 4e-3
    fallback = resolve_costs([None, None, None], [])
    assert fallback.l1 < fallback.l2 < fallback.prefill


# -- prefix index ---------------------------------------------------------------------------------------------------
def test_prefix_index_matches_only_leading_keys() -> None:
    index = PrefixIndex()
    index.record("r1", KEYS[:3])
    assert index.match("r1", KEYS) == 3
    assert index.match("r1", KEYS[1:]) == 2
    assert index.match("r2", KEYS) == 0


def test_prefix_index_is_bounded_per_replica() -> None:
    index = PrefixIndex(max_keys=5)
    index.record("r1", KEYS)
    assert index.size("r1") == 5
    assert index.match("r1", KEYS) == 0  # the oldest (leading) keys went first
    assert index.match("r1", KEYS[5:]) == 5


def test_prefix_index_ages_keys_out() -> None:
    now = [0.0]
    index = PrefixIndex(ttl=10.0, clock=lambda: now[0])
    index.record("r1", KEYS[:2])
    now[0] = 11.0
    assert index.match("r1", KEYS) == 0
    index.record("r1", KEYS[2:3])  # a new record also drops the expired ones
    assert index.size("r1") == 1


# -- KV-event index -------------------------------------------------------------------------------------------------
def test_snapshot_then_events_rebuild_the_tiers() -> None:
    index = KVIndex()
    index.apply("r1", parse_update(snapshot([KEYS[0]], []), "r1"))
    index.apply("r1", parse_update(events((11, "store", "l1", KEYS[1]), (12, "evict", "l1", KEYS[0])), "r1"))
    state = index.state("r1")
    assert state is not None
    assert set(state.l1) == {KEYS[1]}
    assert index.cursor("r1") == ("e1", 12)


def test_events_already_applied_are_skipped() -> None:
    index = KVIndex()
    index.apply("r1", parse_update(snapshot([], []), "r1"))
    index.apply("r1", parse_update(events((9, "store", "l1", KEYS[0])), "r1"))  # seq 9 < the snapshot's 10
    state = index.state("r1")
    assert state is not None
    assert set(state.l1) == set()


def test_a_new_epoch_forgets_the_old_state() -> None:
    index = KVIndex()
    index.apply("r1", parse_update(snapshot([KEYS[0]], []), "r1"))
    index.apply("r1", parse_update(events((11, "store", "l1", KEYS[1]), epoch="e2"), "r1"))
    assert index.state("r1") is None
    assert index.cursor("r1") is None  # the next poll asks for a snapshot


def test_shared_l2_keys_count_for_every_replica_on_that_store() -> None:
    index = KVIndex()
    index.apply("r1", parse_update(snapshot([], [KEYS[0]]), "r1"))
    index.apply("r2", parse_update(snapshot([], []), "r2"))
    index.apply("r3", parse_update(snapshot([], [], l2_id="fs:///other"), "r3"))
    assert KEYS[0] in index.l2_view("r2")
    assert KEYS[0] not in index.l2_view("r3")


def test_an_l2_eviction_reaches_every_replica_sharing_the_store() -> None:
    index = KVIndex()
    index.apply("r1", parse_update(snapshot([], [KEYS[0]]), "r1"))
    index.apply("r2", parse_update(snapshot([], [KEYS[0]]), "r2"))
    index.apply("r1", parse_update(events((11, "evict", "l2", KEYS[0])), "r1"))
    assert KEYS[0] not in index.l2_view("r2")


def test_a_malformed_answer_is_refused_naming_the_field() -> None:
    with pytest.raises(RouterError, match="epoch"):
        parse_update({"fingerprint": FP, "chunk_tokens": C, "seq": 1}, "http://r1")
    with pytest.raises(RouterError, match="malformed event"):
        parse_update(events((1, "store", "l9", KEYS[0])), "http://r1")


# -- policies -------------------------------------------------------------------------------------------------------
def idle(*names: str) -> list[Candidate]:
    return [Candidate(n) for n in names]


def prompt(tokens: list[int]) -> RouteRequest:
    """A request for ``tokens``: its ids (``kv``) and, for ``prefix``, a text of 4 bytes a token (so that a chunk of
    C tokens is one of prefix's 4C-byte text chunks, and both policies see the same prefixes)."""
    return RouteRequest(token_ids=tokens, text=array("I", tokens).tobytes())


def served(policy: Policy, tokens: list[int], replica: str, *, ok: bool = True) -> None:
    """``tokens`` sent to ``replica``, which answered (``ok``: a 2xx; else a 4xx/5xx or a failure)."""
    request = prompt(tokens)
    policy.sent(request, replica)
    policy.answered(request, replica, ok=ok)


def test_round_robin_takes_turns() -> None:
    policy = make_policy("round-robin")
    picks = [policy.choose(RouteRequest(), idle("a", "b")).replica for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_least_load_picks_the_fewest_in_flight() -> None:
    policy = make_policy("least-load")
    assert policy.choose(RouteRequest(), [Candidate("a", 3), Candidate("b", 1)]).replica == "b"


def test_session_is_sticky_and_only_a_lost_replicas_sessions_move() -> None:
    policy = make_policy("session")
    before = {s: policy.choose(RouteRequest(session=s), idle("a", "b", "c")).replica for s in map(str, range(60))}
    after = {s: policy.choose(RouteRequest(session=s), idle("a", "b")).replica for s in before}
    assert {s for s in before if before[s] != after[s]} == {s for s in before if before[s] == "c"}
    assert rendezvous("x", ["a", "b"]) == rendezvous("x", ["b", "a"])


def test_prefix_routes_to_the_longest_match() -> None:
    policy = make_policy("prefix", fingerprint=FP, chunk_tokens=C)
    served(policy, TOKENS[:8], "a")
    served(policy, TOKENS[:20], "b")
    decision = policy.choose(prompt(TOKENS), idle("a", "b"))
    assert (decision.replica, decision.reason) == ("b", "prefix_match")
    assert policy.choose(prompt([99] * 40), idle("a", "b")).reason == "no_match"


def test_prefix_reads_the_prompt_s_text_not_its_token_ids() -> None:
    policy = make_policy("prefix", fingerprint=FP, chunk_tokens=C)
    text = b"a system prompt of some length, " * 4  # 128 bytes: eight 16-byte chunks
    request = RouteRequest(text=text)
    policy.sent(request, "b")
    policy.answered(request, "b", ok=True)
    assert policy.choose(RouteRequest(text=text + b"and a question"), idle("a", "b")).reason == "prefix_match"
    assert policy.choose(RouteRequest(token_ids=TOKENS), idle("a", "b")).reason == "no_match"  # ids alone: no text


def test_prefix_learns_nothing_from_a_request_that_was_not_answered_2xx() -> None:
    policy = make_policy("prefix", fingerprint=FP, chunk_tokens=C)
    served(policy, TOKENS, "a", ok=False)  # the replica answered 401, 404, 500... or never answered
    assert policy.choose(prompt(TOKENS), idle("a", "b")).reason == "no_match"
    assert policy.index_sizes() == {}


def test_prefix_counts_a_request_still_in_flight_where_it_was_sent() -> None:
    policy = make_policy("prefix", fingerprint=FP, chunk_tokens=C, guard=LoadGuard(gap=100, hot=100))
    first = prompt(TOKENS)
    policy.sent(first, "a")  # a burst sharing a new prefix stays together while the first one is computed
    decision = policy.choose(prompt(TOKENS), [Candidate("a", 1), Candidate("b", 0)])
    assert (decision.replica, decision.reason) == ("a", "prefix_match")
    policy.answered(first, "a", ok=False)
    assert policy.choose(prompt(TOKENS), idle("a", "b")).reason == "no_match"


def test_prefix_falls_back_to_least_load_when_queues_are_imbalanced() -> None:
    policy = make_policy("prefix", fingerprint=FP, chunk_tokens=C, guard=LoadGuard(gap=4, hot=100))
    served(policy, TOKENS, "a")
    decision = policy.choose(prompt(TOKENS), [Candidate("a", 5), Candidate("b", 1)])
    assert (decision.replica, decision.reason) == ("b", "load_guard")


def test_a_hot_prefix_spreads_to_a_second_replica() -> None:
    policy = make_policy("prefix", fingerprint=FP, chunk_tokens=C, guard=LoadGuard(gap=100, hot=3))
    served(policy, TOKENS, "a")
    decision = policy.choose(prompt(TOKENS), [Candidate("a", 3), Candidate("b", 1)])
    assert (decision.replica, decision.reason) == ("b", "hot_spread")
    served(policy, TOKENS, "b")  # now both hold it: load decides between them
    decision = policy.choose(prompt(TOKENS), [Candidate("a", 3), Candidate("b", 2)])
    assert (decision.replica, decision.reason) == ("b", "prefix_match")


def kv_policy(index: KVIndex) -> KVAware:
    policy = make_policy("kv", kv_index=index)
    assert isinstance(policy, KVAware)
    return policy


def test_kv_prefers_the_replica_holding_the_prefix_in_l1() -> None:
    index = KVIndex()
    index.apply("a", parse_update(snapshot([], [], l2_id=None), "a"))
    index.apply("b", parse_update(snapshot(KEYS[:6], [], l2_id=None), "b"))
    decision = kv_policy(index).choose(prompt(TOKENS), idle("a", "b"))
    assert (decision.replica, decision.reason) == ("b", "kv_hit")
    assert decision.estimate is not None
    assert decision.estimate.l1_tokens == 24


def test_kv_prices_the_tier_a_hit_lives_in() -> None:
    index = KVIndex()  # same number of cached chunks on both; a's are in L2 only, b's in L1
    index.apply("a", parse_update(snapshot([], KEYS[:6], l2_id=None), "a"))
    index.apply("b", parse_update(snapshot(KEYS[:6], [], l2_id=None), "b"))
    assert kv_policy(index).choose(prompt(TOKENS), idle("a", "b")).replica == "b"


def test_kv_counts_a_shared_l2_hit_for_every_replica() -> None:
    index = KVIndex()
    index.apply("a", parse_update(snapshot([], KEYS[:6]), "a"))
    index.apply("b", parse_update(snapshot([], []), "b"))
    policy = kv_policy(index)
    decision = policy.choose(prompt(TOKENS), [Candidate("a", 1, 2.0), Candidate("b", 0, 2.0)])
    assert (decision.replica, decision.reason) == ("b", "kv_even")  # the L2 hit is b's too, and b is idle


def test_kv_goes_by_load_when_nobody_holds_anything() -> None:
    index = KVIndex()
    index.apply("a", parse_update(snapshot([], []), "a"))
    index.apply("b", parse_update(snapshot([], []), "b"))
    decision = kv_policy(index).choose(prompt(TOKENS), [Candidate("a", 2), Candidate("b", 0)])
    assert (decision.replica, decision.reason) == ("b", "kv_no_hit")


def test_kv_counts_what_it_just_routed_before_the_events_arrive() -> None:
    index = KVIndex()
    index.apply("a", parse_update(snapshot([], []), "a"))
    index.apply("b", parse_update(snapshot([], []), "b"))
    policy = kv_policy(index)
    served(policy, TOKENS, "b")
    assert policy.choose(prompt(TOKENS), idle("a", "b")).replica == "b"


def test_kv_learns_nothing_from_a_request_that_was_not_answered_2xx() -> None:
    index = KVIndex()
    index.apply("a", parse_update(snapshot([], [], l2_id=None), "a"))
    index.apply("b", parse_update(snapshot([], [], l2_id=None), "b"))
    policy = kv_policy(index)
    served(policy, TOKENS, "b", ok=False)
    assert policy.choose(prompt(TOKENS), idle("a", "b")).reason == "kv_no_hit"
    assert all(n == 0 for (_, kind), n in policy.index_sizes().items() if kind in ("recent", "in_flight"))


def test_kv_does_not_count_load_this_router_saw_finish_since_the_last_poll() -> None:
    # a's last poll was answered while a request of this router was still generating there (running 1); the
    # router has since seen that request finish. b could restore the prefix from the shared L2.
    index = KVIndex()
    index.apply("a", parse_update(snapshot(KEYS[:6], [], running=1), "a"), finished=0)
    index.apply("b", parse_update(snapshot([], KEYS[:6]), "b"), finished=0)
    policy = kv_policy(index)
    after_it_finished = [Candidate("a", 0, 2.0, finished=1), Candidate("b", 0, 2.0)]
    assert policy.choose(prompt(TOKENS), after_it_finished).replica == "a"
    # Work the router did not send (another router's, a direct client's) still counts: a is busy.
    someone_elses = [Candidate("a", 0, 2.0, finished=0), Candidate("b", 0, 2.0)]
    assert policy.choose(prompt(TOKENS), someone_elses).replica == "b"


# -- KV-event index under an L2 that forgets silently (Redis TTL and eviction emit no events) ------------------------
def test_a_replica_with_an_l2_is_asked_for_a_fresh_snapshot_periodically() -> None:
    now = [0.0]
    index = KVIndex(snapshot_interval=60.0, clock=lambda: now[0])
    index.apply("r1", parse_update(snapshot([], KEYS[:2]), "r1"))
    index.apply("r1", parse_update(events((11, "store", "l2", KEYS[2])), "r1"))
    index.apply("r2", parse_update(snapshot([], [], l2_id=None), "r2"))  # L1 only: its events are complete
    assert index.cursor("r1") == ("e1", 11)
    now[0] = 60.0
    assert index.cursor("r1") is None  # the next poll asks for a snapshot
    assert index.cursor("r2") == ("e1", 10)


def test_l2_keys_gone_from_a_fresh_snapshot_are_dropped() -> None:
    now = [0.0]
    index = KVIndex(snapshot_interval=60.0, clock=lambda: now[0])
    index.apply("r1", parse_update(snapshot([], KEYS[:2]), "r1"))
    index.apply("r1", parse_update(events((11, "store", "l2", KEYS[2])), "r1"))
    index.apply("r2", parse_update(snapshot([], []), "r2"))  # shares r1's L2
    now[0] = 61.0
    index.apply("r1", parse_update(snapshot([], [KEYS[1]], seq=11), "r1"))  # Redis expired KEYS[0] and KEYS[2]
    assert set(index.l2_view("r1")) == set(index.l2_view("r2")) == {KEYS[1]}
    assert index.cursor("r1") == ("e1", 11)  # and the next snapshot is another interval away


def test_the_kv_index_holds_at_most_max_keys_per_tier_the_newest() -> None:
    index = KVIndex(max_keys=3)
    index.apply("r1", parse_update(snapshot(KEYS[:5], KEYS[:5]), "r1"))  # snapshots list the newest first
    assert set(index.l2_view("r1")) == set(KEYS[:3])
    stored = [(11 + i, "store", "l2", key) for i, key in enumerate(KEYS[5:])]  # stores never followed by evicts
    index.apply("r1", parse_update(events(*stored), "r1"))
    assert set(index.l2_view("r1")) == set(KEYS[-3:])
    assert index.sizes() == {"r1": (3, 3)}


# -- settings -------------------------------------------------------------------------------------------------------
def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ConfigError, match="--replica"):
        RouterSettings.resolve({}, {})
    with pytest.raises(ConfigError, match="--model"):
        RouterSettings.resolve({"replicas": ["http://127.0.0.1:1"], "policy": "kv"}, {})
    assert RouterSettings.resolve({"replicas": ["http://127.0.0.1:1"], "policy": "prefix"}, {}).model is None
    with pytest.raises(RouterError, match="http://host:port"):
        RouterSettings.resolve({"replicas": ["https://127.0.0.1:1/v1"]}, {})
    with pytest.raises(ConfigError, match="twice"):
        RouterSettings.resolve({"replicas": ["http://127.0.0.1:1", "http://127.0.0.1:1/"]}, {})


def test_the_router_and_replica_api_keys_come_from_flags_or_the_environment() -> None:
    env = {"PREHEAT_ROUTER_REPLICAS": "http://a:1", "PREHEAT_ROUTER_API_KEY": "k1"}
    settings = RouterSettings.resolve({"replica_api_key": "k2"}, env | {"PREHEAT_ROUTER_REPLICA_API_KEY": "k3"})
    assert (settings.api_key, settings.replica_api_key) == ("k1", "k2")
    with pytest.raises(ConfigError, match="--api-key is empty"):
        RouterSettings.resolve({"api_key": " "}, env)


def test_flags_win_over_the_environment() -> None:
    env = {"PREHEAT_ROUTER_REPLICAS": "http://a:1", "PREHEAT_ROUTER_POLICY": "least-load", "PREHEAT_ROUTER_PORT": "9"}
    settings = RouterSettings.resolve({"policy": "session"}, env)
    assert (settings.replicas, settings.policy, settings.port) == (("http://a:1",), "session", 9)


def test_the_router_tokenizes_like_the_replica_without_torch_the_engine_or_the_server(
    tiny_servable_model: Path,
) -> None:
    """Prompts are read with the replica's own torch-free ``preheat.text``: the same ids, and no model code loaded."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    code = (
        "import json, sys\n"
        "from preheat.router.prompts import PromptReader\n"
        f"reader = PromptReader.from_model({str(tiny_servable_model)!r})\n"
        f"body = json.dumps({{'messages': {chat!r}}}).encode()\n"
        "ids = reader.read('/v1/chat/completions', body, None).token_ids\n"
        "again = reader.read('/v1/chat/completions', body, None, on_loop=True).token_ids\n"
        "heavy = ('torch', 'transformers', 'preheat.engine', 'preheat.server')\n"
        "print(json.dumps({'ids': ids, 'again': again, 'laid_out': reader.skeletons.laid_out,\n"
        "                  'loaded': [m for m in heavy if m in sys.modules]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    answer = json.loads(out)
    assert answer["loaded"] == []
    assert answer["ids"] == TextTokenizer.from_dir(str(tiny_servable_model)).encode_chat(chat)
    # Read again: laid out from the chat's skeleton (text/skeleton.py), its pieces known: the same ids.
    assert (answer["again"], answer["laid_out"]) == (answer["ids"], 1)
