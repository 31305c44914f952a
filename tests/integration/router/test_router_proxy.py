"""``preheat router`` in front of two real ``preheat serve`` replicas of the tiny model, spoken to as an OpenAI
client would: answers pass through unchanged, policies pick as documented, the router's own routes answer."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.router.cluster import ServerProcess
from routing import NAME, replica_of, router_metric, running_router, start_replicas
from serving import Client

LONG = "The capital of France is"
GREEDY = {"model": NAME, "temperature": 0, "max_tokens": 8}
# A prompt long enough for several of prefix's 64-byte text chunks (--kv-chunk-tokens 16: 4 bytes a token).
STORY = "Once upon a time, in a kingdom by the sea, there lived a keeper of lighthouses and old maps. " * 3


@pytest.fixture(scope="module")
def replicas(tiny_servable_model: Path) -> Iterator[list[ServerProcess]]:
    started = start_replicas(str(tiny_servable_model), 2, "--max-model-len", "512")
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def urls(replicas: list[ServerProcess]) -> list[str]:
    return [r.url for r in replicas]


def without_ids(body: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


# -- pass-through ---------------------------------------------------------------------------------------------------
def test_an_answer_through_the_router_is_the_replicas_answer(urls: list[str]) -> None:
    with running_router(urls, "round-robin") as router:
        via = Client(router.url).post("/v1/completions", {**GREEDY, "prompt": LONG})
    assert via.status == 200, via.body
    direct = Client(replica_of(via)).post("/v1/completions", {**GREEDY, "prompt": LONG})
    assert without_ids(via.json()) == without_ids(direct.json())
    assert via.headers["Content-Type"] == direct.headers["Content-Type"]


def test_a_stream_passes_through_event_by_event(urls: list[str]) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": True}}
    with running_router(urls, "round-robin") as router:
        via = Client(router.url).stream("/v1/chat/completions", body)
    assert via.status == 200
    assert via.headers["Transfer-Encoding"] == "chunked"
    assert via.headers["Content-Type"].startswith("text/event-stream")
    assert via.done
    direct = Client(replica_of(via)).stream("/v1/chat/completions", body)
    assert via.text == direct.text
    assert len(via.chunks) == len(direct.chunks) > 2
    assert via.usage == direct.usage


def test_malformed_requests_get_the_replicas_400(urls: list[str], tiny_servable_model: Path) -> None:
    with running_router(urls, "prefix", model=str(tiny_servable_model), kv_chunk_tokens=16) as router:
        conn = http.client.HTTPConnection("127.0.0.1", int(router.url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        replica = response.getheader("X-Preheat-Replica")
        conn.close()
        unknown = Client(router.url).post("/v1/completions", {"prompt": "x", "n": 3})
    assert response.status == 400
    assert reply["error"]["code"] == "invalid_json"
    assert replica in urls  # the replica's own answer, not the router's
    assert unknown.status == 400
    assert unknown.json()["error"]["param"] == "n"


def test_models_come_from_a_replica_and_health_from_the_router(urls: list[str]) -> None:
    with running_router(urls, "least-load") as router:
        client = Client(router.url)
        models = client.get("/v1/models")
        health = client.get("/health")
    assert models.status == 200
    assert models.json()["data"][0]["id"] == NAME
    assert health.status == 200
    assert [r["url"] for r in health.json()["replicas"]] == urls
    assert all(r["healthy"] for r in health.json()["replicas"])


def test_metrics_count_routes_decisions_and_overhead(urls: list[str]) -> None:
    with running_router(urls, "round-robin") as router:
        client = Client(router.url)
        for _ in range(4):
            assert client.post("/v1/completions", {**GREEDY, "prompt": "Hi", "max_tokens": 1}).status == 200
        for url in urls:
            assert router_metric(router.url, "preheat_router_requests_total", replica=url, status="200") == 2
        assert (
            router_metric(router.url, "preheat_router_decisions_total", policy="round-robin", reason="round_robin") == 4
        )
        assert router_metric(router.url, "preheat_router_overhead_seconds_count") == 4
        assert router_metric(router.url, "preheat_router_replica_up", replica=urls[0]) == 1


def test_a_streamed_answer_is_counted_before_its_client_has_the_last_chunk(urls: list[str]) -> None:
    # The router counts an answer before the client's last byte: a client that scrapes /metrics as soon as it has
    # the answer finds it counted, with no waiting in the test.
    body = {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with running_router(urls, "round-robin") as router:
        client = Client(router.url)
        for _ in range(4):
            assert client.stream("/v1/chat/completions", body).done
        routed = sum(router_metric(router.url, "preheat_router_requests_total", replica=u, status="200") for u in urls)
        assert routed == 4
        assert router_metric(router.url, "preheat_router_overhead_seconds_count") == 4


def test_a_request_is_out_of_flight_before_its_client_has_the_answer(urls: list[str]) -> None:
    # A client that sends its next request as soon as it has an answer (on a new connection) must find the router's
    # count already down: the policies would otherwise see a phantom request queued on the replica that just
    # answered. The count is read in this process, right after each answer; without the ordering, some of these
    # many answers would arrive before their handler thread had counted them out.
    with running_router(urls, "least-load") as router:
        client = Client(router.url)
        left_in_flight = []
        for _ in range(200):
            assert client.get("/v1/models").status == 200
            left_in_flight.append(sum(r.in_flight for r in router.router.replicas))
        finished = sum(r.finished for r in router.router.replicas)
    assert left_in_flight == [0] * 200
    assert finished == 200


def test_no_healthy_replica_is_a_503_naming_the_cause() -> None:
    with running_router(["http://127.0.0.1:9"], "round-robin") as router:
        client = Client(router.url)
        health = client.get("/health")
        reply = client.post("/v1/completions", {**GREEDY, "prompt": "Hi"})
    assert health.status == 503
    assert reply.status == 503
    assert reply.json()["error"]["code"] == "no_replica"


# -- policies -------------------------------------------------------------------------------------------------------
def test_round_robin_alternates_between_replicas(urls: list[str]) -> None:
    with running_router(urls, "round-robin") as router:
        picks = [replica_of(Client(router.url).post("/v1/completions", {**GREEDY, "prompt": "Hi"})) for _ in range(4)]
    assert picks[0] != picks[1]
    assert picks[:2] == picks[2:]


def test_session_requests_stick_to_one_replica(urls: list[str]) -> None:
    with running_router(urls, "session") as router:
        client = Client(router.url)
        by_header = {
            replica_of(client.post("/v1/completions", {**GREEDY, "prompt": "Hi"}, {"X-Session-Id": "alice"}))
            for _ in range(3)
        }
        by_user = {
            replica_of(client.post("/v1/completions", {**GREEDY, "prompt": "Hi", "user": "bob"})) for _ in range(3)
        }
    assert len(by_header) == 1
    assert len(by_user) == 1


def test_prefix_sends_a_shared_prefix_where_it_went_before(urls: list[str]) -> None:
    with running_router(urls, "prefix", kv_chunk_tokens=16) as router:  # no --model: prefix reads text
        client = Client(router.url)
        first = client.post("/v1/completions", {**GREEDY, "prompt": STORY + "The keeper"})
        followers = [client.post("/v1/completions", {**GREEDY, "prompt": STORY + f"Then {n}"}) for n in range(3)]
        other = client.post("/v1/completions", {**GREEDY, "prompt": "Something else entirely, " * 8})
    assert first.headers["X-Preheat-Route"] == "no_match"
    assert {replica_of(f) for f in followers} == {replica_of(first)}
    assert {f.headers["X-Preheat-Route"] for f in followers} == {"prefix_match"}
    assert other.headers["X-Preheat-Route"] == "no_match"


def test_prefix_matches_chat_requests_by_their_messages_text(urls: list[str]) -> None:
    system = {"role": "system", "content": STORY}
    parts = {"role": "system", "content": [{"type": "text", "text": STORY[:50]}, {"type": "text", "text": STORY[50:]}]}
    with running_router(urls, "prefix", kv_chunk_tokens=16) as router:
        client = Client(router.url)
        first = client.post("/v1/chat/completions", {**GREEDY, "messages": [system, {"role": "user", "content": "A"}]})
        second = client.post("/v1/chat/completions", {**GREEDY, "messages": [system, {"role": "user", "content": "B"}]})
        split = client.post("/v1/chat/completions", {**GREEDY, "messages": [parts, {"role": "user", "content": "C"}]})
        turn = [system, {"role": "user", "content": "A"}, {"role": "assistant", "content": "ok"}]
        later = client.post("/v1/chat/completions", {**GREEDY, "messages": [*turn, {"role": "user", "content": "D"}]})
        other = client.post("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": STORY}]})
    assert first.status == 200, first.body
    assert [r.headers["X-Preheat-Route"] for r in (second, split, later)] == ["prefix_match"] * 3
    assert {replica_of(r) for r in (second, split, later)} == {replica_of(first)}
    assert other.headers["X-Preheat-Route"] == "no_match"  # the same words as another role: another prompt
