"""The router's API key and what its index learns, against real replicas that require their own key: a request the
router cannot authenticate is answered 401 before it is tokenized, indexed or forwarded, and a request a replica
refused teaches the index nothing. The index is observed through the router's ``preheat_router_index_keys``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.router.cluster import ServerProcess
from routing import NAME, replica_of, router_metric, running_router, start_replicas
from serving import Client, Reply

ROUTER_KEY = "router-key-for-clients"
REPLICA_KEY = "replica-key-for-the-router"
C = 16
# Several 16-token chunks on the tiny model's byte-level tokenizer.
STORY = "Once upon a time, in a kingdom by the sea, there lived a keeper of lighthouses and old maps. " * 3
ASK = {"model": NAME, "temperature": 0, "max_tokens": 2}


@pytest.fixture(scope="module")
def locked(kv_model: Path) -> Iterator[list[ServerProcess]]:
    """Two replicas with an L1 and ``--api-key REPLICA_KEY``."""
    tiers = ("--kv-l1", "16MiB", "--kv-chunk-tokens", str(C), "--max-model-len", "512")
    started = start_replicas(str(kv_model), 2, "--api-key", REPLICA_KEY, *tiers)
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def urls(locked: list[ServerProcess]) -> list[str]:
    return [r.url for r in locked]


def index_keys(router_url: str, replicas: list[str], index: str) -> float:
    return sum(router_metric(router_url, "preheat_router_index_keys", replica=u, index=index) for u in replicas)


def labelled(router_url: str, name: str) -> list[str]:
    """Every series of ``name`` with labels: none until something was counted."""
    lines = Client(router_url).get("/metrics").body.decode().splitlines()
    return [line for line in lines if line.startswith(name + "{")]


def complete(url: str, prompt: str, key: str | None, **body: object) -> Reply:
    return Client(url, api_key=key).post("/v1/completions", {**ASK, "prompt": prompt, **body})


def test_a_request_without_the_routers_key_is_401_and_reaches_no_replica_and_no_index(
    urls: list[str], kv_model: Path
) -> None:
    flags = {"model": str(kv_model), "kv_chunk_tokens": C, "api_key": ROUTER_KEY, "replica_api_key": REPLICA_KEY}
    with running_router(urls, "prefix", **flags) as router:
        refused = [
            complete(router.url, STORY, None),
            complete(router.url, STORY, "wrong"),
            complete(router.url, STORY, REPLICA_KEY),  # the replicas' key is not the router's
            Client(router.url).get("/v1/models"),
        ]
        routed_before = index_keys(router.url, urls, "routed") + index_keys(router.url, urls, "in_flight")
        forwarded = labelled(router.url, "preheat_router_requests_total")
        decisions = labelled(router.url, "preheat_router_decisions_total")
        open_routes = [Client(router.url).get("/health").status, Client(router.url).get("/metrics").status]
        first = complete(router.url, STORY + "One", ROUTER_KEY)  # the router presents the replicas' key for it
        second = complete(router.url, STORY + "Two", ROUTER_KEY)
        routed_after = index_keys(router.url, urls, "routed")
        denied = router_metric(router.url, "preheat_router_errors_total", code="invalid_api_key")
    assert [r.status for r in refused] == [401] * 4
    assert {r.json()["error"]["code"] for r in refused} == {"invalid_api_key"}
    assert all(r.headers.get("WWW-Authenticate") == "Bearer" for r in refused)
    assert not any("X-Preheat-Replica" in r.headers for r in refused)
    assert (routed_before, forwarded, decisions, denied) == (0, [], [], 4)
    assert open_routes == [200, 200]
    assert (first.status, second.status) == (200, 200), (first.body, second.body)
    assert routed_after > 0
    assert second.headers["X-Preheat-Route"] == "prefix_match"
    assert replica_of(second) == replica_of(first)


def test_a_request_a_replica_did_not_answer_2xx_is_not_indexed(urls: list[str], kv_model: Path) -> None:
    # No router key and no replica key: the client's Authorization passes through, and the replicas judge it.
    with running_router(urls, "prefix", model=str(kv_model), kv_chunk_tokens=C) as router:
        unauthenticated = complete(router.url, STORY + "One", None)  # the replica answers 401
        wrong_model = complete(router.url, STORY + "One", REPLICA_KEY, model="not-served")  # the replica: 404
        unlearnt = index_keys(router.url, urls, "routed") + index_keys(router.url, urls, "in_flight")
        first = complete(router.url, STORY + "Two", REPLICA_KEY)
        second = complete(router.url, STORY + "Three", REPLICA_KEY)
    assert (unauthenticated.status, wrong_model.status) == (401, 404)
    assert {replica_of(unauthenticated), replica_of(wrong_model)} <= set(urls)  # the replicas' own answers
    assert unlearnt == 0
    assert first.status == 200, first.body
    assert first.headers["X-Preheat-Route"] == "no_match"  # the refused requests left nothing to match
    assert second.headers["X-Preheat-Route"] == "prefix_match"


def test_kv_polls_the_replicas_with_the_replica_key(urls: list[str], kv_model: Path) -> None:
    flags = {"model": str(kv_model), "api_key": ROUTER_KEY}
    with running_router(urls, "kv", **flags, replica_api_key=REPLICA_KEY) as keyed:
        known = [keyed.kv_index.state(u) is not None for u in urls]  # start() polls once before it returns
    with running_router(urls, "kv", **flags) as unkeyed:  # polls carry the router's key, which the replicas refuse
        unknown = [unkeyed.kv_index.state(u) is not None for u in urls]
    assert known == [True, True]
    assert unknown == [False, False]


def test_a_replicas_early_refusal_does_not_spoil_the_next_request_on_its_connection(urls: list[str]) -> None:
    # The replica answers 401 without reading the body; the router must not send the next request after it.
    with running_router(urls[:1], "round-robin") as router:
        refused = complete(router.url, STORY, None)
        accepted = complete(router.url, STORY, REPLICA_KEY)
    assert refused.status == 401
    assert accepted.status == 200, accepted.body
