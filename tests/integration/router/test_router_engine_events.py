"""Policy ``kv`` in front of vLLM and SGLang replicas: their ZMQ KV events, decoded, mapped to the router's chunk keys,
kept in sync through the replay socket, and never fatal when wrong. No engine is needed: the fixtures are what the
engines' own publisher classes sent (tests/data/kv_events/, checked against each engine by
tests/engines/test_kv_event_fixtures.py), and the publisher here speaks their wire (tests/enginewire.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from enginewire import WirePublisher, load_frames, payloads
from preheat.core.errors import EngineEventError, RouterError
from preheat.http.metrics import Counter
from preheat.kv.keys import chunk_keys
from preheat.router.app import RouterService
from preheat.router.cluster import ServerProcess
from preheat.router.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    decode_batch,
    decode_message,
)
from preheat.router.engine_index import EngineBlockMap, engine_fingerprint
from preheat.router.index import KVIndex
from preheat.router.policies import Candidate, RouteRequest, make_policy
from preheat.router.settings import RouterSettings
from preheat.router.upstream import Replica, parse_replica_spec
from preheat.router.zmq_events import EngineEventSubscriber, engine_events_counter
from routing import NAME, replica_of, running_router, start_replicas, wait_until
from serving import Client
from strategies import FUZZ

BLOCK = 32
PROMPT = [1000 + i for i in range(3 * BLOCK)]
OTHER = [5000 + i for i in range(BLOCK)]
ENGINES = ["vllm-0.33.0", "vllm-0.32.0", "vllm-legacy-array", "sglang-0.5.23"]
URL = "http://127.0.0.1:9"
IDENTITY = "test-model"


def available(name: str) -> bool:
    return (Path(__file__).parents[2] / "data" / "kv_events" / f"{name}.frames").exists()


FIXTURES = [pytest.param(n, marks=pytest.mark.skipif(not available(n), reason=f"no fixture {n}")) for n in ENGINES]


def keys(tokens: list[int]) -> list[str]:
    return chunk_keys(engine_fingerprint(IDENTITY, BLOCK), tokens, BLOCK)


def batch(*events: dict[str, Any], ts: float = 1.0) -> bytes:  # Any: msgpack values
    """A batch in vLLM 0.33's shape: ``[ts, [tagged maps], dp_rank]``."""
    return msgspec.msgpack.encode([ts, list(events), 0])


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU", **more: Any
) -> dict[str, Any]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": len(tokens) // len(hashes), "lora_id": None, "medium": medium, "lora_name": None, **more,
    }  # fmt: skip


# --- decoding the engines' own frames --------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", FIXTURES)
def test_engine_fixtures_decode_to_the_story_they_tell(engine: str) -> None:
    decoded = [decode_message(frames) for frames in load_frames(engine)]
    assert [seq for seq, _ in decoded] == list(range(7))
    events = [b.events for _, b in decoded if b is not None]
    assert [type(e[0]) for e in events] == [
        BlockStored, BlockStored, BlockStored, BlockStored, BlockRemoved, AllBlocksCleared, BlockStored,
    ]  # fmt: skip
    first, child, foreign = events[0][0], events[1][0], events[2][0]
    assert isinstance(first, BlockStored)
    assert isinstance(child, BlockStored)
    assert isinstance(foreign, BlockStored)
    assert (first.parent, first.token_ids, first.block_size) == (None, tuple(PROMPT[:64]), BLOCK)
    assert child.parent == first.block_hashes[1]
    assert (foreign.extra, first.extra) == (True, False)


@pytest.mark.parametrize("engine", FIXTURES)
def test_engine_blocks_map_to_the_keys_of_the_prompt_they_hold(engine: str) -> None:
    blocks = EngineBlockMap(IDENTITY)
    steps = [decode_batch(p) for p in payloads(engine)]
    blocks.apply(steps[0])
    blocks.apply(steps[1])
    cache = blocks.cache
    assert cache is not None
    assert all(k in cache.gpu for k in keys(PROMPT))  # the router computes these from the prompt alone
    assert blocks.apply(steps[2]).foreign == 1  # multimodal / salted / LoRA: no token list gives its key
    assert keys(OTHER)[0] not in cache.gpu
    blocks.apply(steps[3])  # the first two blocks offloaded to CPU
    assert all(k in cache.l1 for k in keys(PROMPT)[:2])
    assert blocks.apply(steps[4]).removed == 1
    assert [k in cache.gpu for k in keys(PROMPT)] == [True, True, False]
    blocks.apply(steps[5])
    assert len(cache.gpu) == len(cache.l1) == len(cache.l2) == 0
    blocks.apply(steps[6])
    assert list(cache.gpu) == keys(OTHER)


def test_a_block_whose_parent_was_never_seen_is_not_counted() -> None:
    blocks = EngineBlockMap(IDENTITY)
    applied = blocks.apply(decode_batch(payloads("vllm-0.33.0")[1]))  # the child, without batch 0
    assert applied.unmapped == 1
    assert blocks.cache is None  # nothing mapped: the replica is routed by prefix


def test_an_unknown_event_type_is_kept_aside_and_the_rest_applied() -> None:
    decoded = decode_batch(batch({"type": "BlockPinned", "block_hashes": [1]}, stored([1], None, PROMPT[:BLOCK])))
    assert decoded.events[0] == UnknownEvent("BlockPinned")
    blocks = EngineBlockMap(IDENTITY)
    applied = blocks.apply(decoded)
    assert (applied.unknown, applied.stored) == (1, 1)


def test_byte_hashes_and_fields_from_later_releases_are_accepted() -> None:
    event = stored([1], None, PROMPT[:BLOCK], session_id="s", group_idx=0, kv_cache_spec_kind="full")
    event["block_hashes"] = [b"\x01" * 32]
    decoded = decode_batch(batch(event, {"type": "AllBlocksCleared", "future": 1}))
    assert isinstance(decoded.events[0], BlockStored)
    assert decoded.events[0].block_hashes == (b"\x01" * 32,)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"", b"\x00" * 8], "3 frames"),
        ([b"", b"\x00" * 4, batch()], "8 bytes"),
        ([b"", (-5).to_bytes(8, "big", signed=True), batch()], "negative"),
        ([b"", b"\x00" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode("hello")], "batch"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode([1.0, {"a": 1}])], "events must be an array"),
        ([b"", b"\x00" * 8, batch({**stored([1, 2], None, PROMPT[:BLOCK]), "block_size": BLOCK})], "token ids"),
        ([b"", b"\x00" * 8, batch({**stored([1], None, PROMPT[:BLOCK]), "block_hashes": []})], "block_hashes"),
        ([b"", b"\x00" * 8, batch({**stored([1], None, PROMPT[:BLOCK]), "token_ids": [-1] * BLOCK})], "token_ids"),
        ([b"", b"\x00" * 8, batch({**stored([1], None, PROMPT[:BLOCK]), "medium": 3})], "medium"),
        ([b"", b"\x00" * 8, batch(7)], "tagged map or array"),  # type: ignore[arg-type]  # deliberately wrong
    ],
)
def test_malformed_messages_raise_a_router_error_naming_the_problem(frames: list[bytes], why: str) -> None:
    with pytest.raises(EngineEventError, match=why):
        decode_message(frames)


def msgpack_values() -> st.SearchStrategy[Any]:  # Any: any msgpack value
    leaves: st.SearchStrategy[Any] = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
        st.binary(max_size=8), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU"]),
    )  # fmt: skip
    return st.recursive(
        leaves, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    )


@FUZZ
@given(value=msgpack_values())
def test_any_msgpack_value_is_a_batch_or_an_engine_event_error(value: Any) -> None:  # Any: msgpack values
    for payload in (msgspec.msgpack.encode(value), msgspec.msgpack.encode([1.0, [value], 0])):
        try:
            decoded = decode_batch(payload)
        except EngineEventError:
            continue
        assert isinstance(decoded, EventBatch)
        EngineBlockMap(IDENTITY).apply(decoded)  # whatever decodes also applies


@FUZZ
@given(data=st.binary(max_size=200), cut=st.integers(0, 1600))
def test_any_bytes_and_any_cut_fixture_are_a_batch_or_an_engine_event_error(data: bytes, cut: int) -> None:
    for payload in (data, payloads("vllm-0.33.0")[0][:cut]):
        with contextlib.suppress(EngineEventError):
            decode_batch(payload)


# --- policy kv over engine state -------------------------------------------------------------------------------------


def test_kv_prefers_the_engine_holding_the_prompt_in_gpu_over_cpu_and_nothing() -> None:
    index = KVIndex()
    fallback = ("0" * 32, 64)
    policy = make_policy("kv", kv_index=index, engines=["a", "b", "c"], fingerprint=fallback[0], chunk_tokens=64)
    for name, medium in (("a", "CPU"), ("b", "GPU")):
        blocks = EngineBlockMap(IDENTITY)
        blocks.apply(decode_batch(batch(stored([1, 2, 3], None, PROMPT, medium=medium))))
        index.edit(name, lambda b=blocks: b.cache)  # type: ignore[misc]  # a default binds the loop's value
    request = RouteRequest(token_ids=[*PROMPT, 7])
    decision = policy.choose(request, [Candidate("a"), Candidate("b"), Candidate("c")])
    assert (decision.replica, decision.reason) == ("b", "kv_hit")
    assert decision.estimate is not None
    assert decision.estimate.gpu_tokens == 3 * BLOCK


def test_an_engine_without_mapped_events_is_routed_by_what_it_answered() -> None:
    policy = make_policy("kv", kv_index=KVIndex(), engines=["a", "b"], fingerprint="0" * 32, chunk_tokens=BLOCK)
    request = RouteRequest(token_ids=[*PROMPT, 7])
    first = policy.choose(request, [Candidate("a"), Candidate("b")])
    assert first.reason == "kv_no_hit"
    policy.sent(request, first.replica)
    policy.answered(request, first.replica, ok=True)
    again = policy.choose(RouteRequest(token_ids=[*PROMPT, 8]), [Candidate("a"), Candidate("b")])
    assert (again.replica, again.reason) == (first.replica, "kv_hit")


# --- the ZMQ subscriber against the engines' wire ---------------------------------------------------------------------


class Subscribed:
    """An ``EngineEventSubscriber`` on one replica, fed by a ``WirePublisher``."""

    def __init__(self, publisher: WirePublisher, *, healthy: bool = True) -> None:
        self.publisher = publisher
        spec = parse_replica_spec(publisher.spec(URL))
        assert spec.events is not None
        self.replica = Replica(spec.url)
        self.replica.set_healthy(healthy)
        self.index = KVIndex()
        self.counter: Counter = engine_events_counter()
        self.subscriber = EngineEventSubscriber(
            [(self.replica, spec.events)], self.index, self.counter, identity=IDENTITY, replay_timeout=2.0
        )

    def count(self, outcome: str) -> float:
        return self.counter.value(replica=self.replica.url, outcome=outcome)

    def holds(self, tier: str, wanted: list[str]) -> bool:
        state = self.index.state(self.replica.url)
        held = None if state is None else {"gpu": state.gpu, "cpu": state.l1, "storage": state.l2}[tier]
        return held is not None and all(k in held for k in wanted)

    def wait_applied(self, count: int) -> None:
        wait_until(lambda: self.count("batches") >= count, f"{count} batches applied")


@pytest.fixture
def wire() -> Iterator[WirePublisher]:
    publisher = WirePublisher()
    yield publisher
    publisher.close()


@pytest.fixture
def subscribed(wire: WirePublisher) -> Iterator[Subscribed]:
    sub = Subscribed(wire)
    sub.subscriber.start()
    wire.wait_subscribed()
    yield sub
    sub.subscriber.stop()


def test_a_router_joining_late_replays_what_was_published_before(wire: WirePublisher) -> None:
    story = payloads("vllm-0.33.0")
    wire.publish(story[0])
    wire.publish(story[1])
    sub = Subscribed(wire)
    sub.subscriber.start()
    try:
        wait_until(lambda: sub.holds("gpu", keys(PROMPT)), "the replayed blocks")
        assert sub.count("resync") == 1
    finally:
        sub.subscriber.stop()


def test_a_gap_in_sequence_numbers_is_filled_from_the_replay_socket(
    wire: WirePublisher, subscribed: Subscribed
) -> None:
    story = payloads("vllm-0.33.0")
    wire.publish(story[0])
    subscribed.wait_applied(1)
    wire.publish(story[1], drop=True)  # lost on the way: only the replay buffer has it
    wire.publish(story[2])
    wait_until(lambda: subscribed.holds("gpu", keys(PROMPT)), "the lost batch, replayed")
    assert subscribed.count("gap") == 1
    assert subscribed.count("unmapped") == 0


def test_events_over_a_unix_socket_reach_the_router(tmp_path: Path) -> None:
    # docs/security.md: an engine on the router's host publishes on ipc://, not on every interface.
    wire = WirePublisher(ipc=str(tmp_path / "kv-events"))
    sub = Subscribed(wire)
    sub.subscriber.start()
    try:
        wire.wait_subscribed()
        for payload in payloads("vllm-0.33.0")[:2]:
            wire.publish(payload)
        wait_until(lambda: sub.holds("gpu", keys(PROMPT)), "the blocks published over ipc://")
        assert sub.count("gap") == 0
    finally:
        sub.subscriber.stop()
        wire.close()


def test_a_gap_without_replay_is_counted_and_later_blocks_still_map(caplog: pytest.LogCaptureFixture) -> None:
    publisher = WirePublisher(replay=False)
    sub = Subscribed(publisher)
    sub.subscriber.start()
    publisher.wait_subscribed()
    story = payloads("vllm-0.33.0")
    try:
        with caplog.at_level(logging.WARNING, logger="preheat.router"):
            publisher.publish(story[0])
            sub.wait_applied(1)
            publisher.publish(story[1], drop=True)  # lost: block b3 is never heard of
            publisher.publish(batch(stored([77], 0xF000000000000003, OTHER)))  # a child of b3
            publisher.publish(story[6])
            wait_until(lambda: sub.holds("gpu", keys(OTHER)), "the batch after the gap")
        assert (sub.count("gap"), sub.count("unmapped")) == (1, 1)
        assert "no replay endpoint" in caplog.text
    finally:
        sub.subscriber.stop()
        publisher.close()


def test_an_engine_restart_clears_its_blocks_and_resynchronises(wire: WirePublisher, subscribed: Subscribed) -> None:
    story = payloads("vllm-0.33.0")
    for payload in story[:2]:
        wire.publish(payload)
    wait_until(lambda: subscribed.holds("gpu", keys(PROMPT)), "the prompt's blocks")
    wire.restart()
    wire.publish(story[6], drop=True)  # the new process's seq 0, missed: seq 1 shows the restart
    wire.publish(batch(stored([9], None, PROMPT[:BLOCK], medium="CPU")))
    wait_until(lambda: subscribed.holds("cpu", keys(PROMPT)[:1]), "the new process's blocks")
    assert subscribed.holds("gpu", keys(OTHER))  # replayed: seq 0 of the new process
    assert not subscribed.holds("gpu", keys(PROMPT)[1:2])  # the old process's blocks are gone
    assert subscribed.count("restart") == 1


def test_a_replica_leaving_rotation_loses_its_blocks_and_resyncs_when_back(
    wire: WirePublisher, subscribed: Subscribed
) -> None:
    for payload in payloads("vllm-0.33.0")[:2]:
        wire.publish(payload)
    wait_until(lambda: subscribed.holds("gpu", keys(PROMPT)), "the prompt's blocks")
    subscribed.replica.set_healthy(False)
    wait_until(lambda: subscribed.index.state(URL) is None, "the ejected replica's state dropped")
    subscribed.replica.set_healthy(True)
    wait_until(lambda: subscribed.holds("gpu", keys(PROMPT)), "the blocks, replayed")


def test_malformed_frames_and_unknown_events_are_counted_not_fatal(wire: WirePublisher, subscribed: Subscribed) -> None:
    wire.send_raw([b"", b"\x00\x00"])
    wire.send_raw([b"", (0).to_bytes(8, "big"), b"\xc1\xc1"])
    wire.publish(batch({"type": "BlockPinned"}, stored([1], None, PROMPT[:BLOCK])))
    wait_until(lambda: subscribed.holds("gpu", keys(PROMPT)[:1]), "the good event beside the unknown one")
    assert subscribed.count("malformed") == 2
    assert subscribed.count("unknown_event") == 1


def test_an_unreachable_events_endpoint_is_a_warning_and_a_count(caplog: pytest.LogCaptureFixture) -> None:
    publisher = WirePublisher(replay=False)
    endpoint = publisher.endpoint
    publisher.close()  # nothing listens there any more
    replica = Replica(URL)
    replica.set_healthy(True)
    counter = engine_events_counter()
    source = parse_replica_spec(f"{URL},events={endpoint}").events
    assert source is not None
    subscriber = EngineEventSubscriber([(replica, source)], KVIndex(), counter, identity=IDENTITY)
    with caplog.at_level(logging.WARNING, logger="preheat.router"):
        subscriber.start()
        try:
            wait_until(lambda: counter.value(replica=replica.url, outcome="unreachable") >= 1, "the warning")
        finally:
            subscriber.stop()
    assert "cannot connect" in caplog.text
    assert "routed by prefix" in caplog.text


# --- flags ---------------------------------------------------------------------------------------------------------


def test_replica_specs_pair_events_with_their_replica() -> None:
    env = {"PREHEAT_ROUTER_REPLICAS": "http://a:1,events=tcp://a:5557,replay=tcp://a:5558,http://b:2"}
    settings = RouterSettings.resolve({"replicas": None, "policy": "kv", "model": "m"}, env)
    assert [parse_replica_spec(s).events for s in settings.replicas][1] is None
    assert parse_replica_spec(settings.replicas[0]).events is not None
    for bad in ("http://a:1,events=tcp://*:5557", "http://a:1,replay=tcp://a:1", "http://a:1,topic=x"):
        with pytest.raises(RouterError):
            RouterSettings.resolve({"replicas": [bad], "policy": "kv", "model": "m"}, {})


def test_kv_events_flag_applies_to_the_replica_before_it() -> None:
    import argparse

    from preheat.cli import router as cli_router

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        cli_router.register(parser.add_subparsers())
        return parser.parse_args(["router", *argv])

    args = parse(
        "--replica", "http://a:1", "--kv-events", "tcp://a:5557", "--kv-replay", "tcp://a:5558", "--replica", "http://b:2"
    )  # fmt: skip
    assert args.replicas == ["http://a:1,events=tcp://a:5557,replay=tcp://a:5558", "http://b:2"]
    with pytest.raises(SystemExit):
        parse("--kv-events", "tcp://a:5557")


# --- end to end: the router with replicas whose KV events come over the engine wire ---------------------------------


@pytest.fixture(scope="module")
def plain_replicas(kv_model: Path) -> Iterator[list[ServerProcess]]:
    started = start_replicas(str(kv_model), 2, "--max-model-len", "512")
    yield started
    for replica in started:
        replica.stop()


def test_router_sends_a_prompt_to_the_engine_whose_events_hold_it(
    plain_replicas: list[ServerProcess], kv_model: Path
) -> None:
    """Two replicas publish KV events over the engine wire; the one whose events hold the prompt gets it."""
    prompt = "A lighthouse keeper counted the ships that passed the cape every night. " * 6
    publishers = [WirePublisher(), WirePublisher()]
    specs = [p.spec(r.url) for p, r in zip(publishers, plain_replicas, strict=True)]
    try:
        with running_router(specs, "kv", model=str(kv_model)) as router:
            body = json.dumps({"prompt": prompt}).encode()
            tokens = router.router.prompts.read("/v1/completions", body, None).token_ids
            assert tokens is not None
            holder = plain_replicas[1].url
            publishers[1].wait_subscribed()
            usable = (len(tokens) - 1) // 16 * 16
            publishers[1].publish(batch(stored(list(range(1, usable // 16 + 1)), None, tokens[:usable])))
            wait_until(lambda: router.kv_index.state(holder) is not None, "the holder's events")
            for _ in range(3):
                reply = Client(router.url).post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1})
                assert reply.status == 200
                assert (replica_of(reply), reply.headers.get("X-Preheat-Route")) == (holder, "kv_hit")
            scrape = Client(router.url).get("/metrics").body.decode()
            assert 'preheat_router_engine_events_total{outcome="stored"' in scrape
    finally:
        for publisher in publishers:
            publisher.close()


def test_router_routes_engines_without_events_by_prefix(plain_replicas: list[ServerProcess], kv_model: Path) -> None:
    """Events endpoints that nobody serves: a clear warning, and the replicas are routed as ``prefix`` would."""
    dead = WirePublisher(replay=False)
    endpoint = dead.endpoint
    dead.close()
    specs = [f"{r.url},events={endpoint}" for r in plain_replicas]
    prompt = "Maps of the coast were redrawn each spring after the storms had moved the sand. " * 6
    with running_router(specs, "kv", model=str(kv_model)) as router:
        client = Client(router.url)
        first = client.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1})
        assert first.status == 200
        for _ in range(3):
            again = client.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1})
            assert (replica_of(again), again.headers.get("X-Preheat-Route")) == (replica_of(first), "kv_hit")


def test_model_at_replicas_reads_prompts_with_the_replicas_tokenizer(
    plain_replicas: list[ServerProcess], kv_model: Path
) -> None:
    from preheat.router.prompts import TOKENIZER_FILES, PromptReader
    from preheat.server.app import TOKENIZER_FILES as SERVED

    assert TOKENIZER_FILES == SERVED
    body = json.dumps({"messages": [{"role": "user", "content": "Which lighthouse is oldest?"}]}).encode()
    expected = PromptReader.from_model(str(kv_model)).read("/v1/chat/completions", body, None).token_ids
    with running_router([r.url for r in plain_replicas], "kv", model="@replicas") as router:
        assert router.router.prompts.read("/v1/chat/completions", body, None).token_ids == expected
        reply = Client(router.url).post("/v1/chat/completions", {"model": NAME, "messages": [], "max_tokens": 1})
        assert reply.status == 400  # the replica's own answer, relayed


def test_model_at_replicas_with_no_replica_up_says_to_pass_a_directory() -> None:
    settings = RouterSettings.resolve(
        {"replicas": ["http://127.0.0.1:9"], "policy": "kv", "port": 0, "model": "@replicas"}, {}
    )
    with pytest.raises(RouterError, match="--model"):
        RouterService(settings)
