"""Policy ``kv`` against real replicas with KV tiers (an L1 each, one shared ``fs://`` L2): the router reads their
``/v1/kv/events`` and sends a prompt where its prefix is cached, in the cheapest tier.

Nothing here depends on timing: a test that needs the router to know what a replica cached waits (with a deadline)
until the router's index holds every chunk of that prompt, in the tier the test needs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from preheat.kv.keys import cacheable_chunks
from preheat.router.app import RouterService
from preheat.router.cluster import ServerProcess
from routing import NAME, replica_of, running_router, start_replicas, wait_until
from serving import Client, Reply

C = 16
STORY = "Once upon a time, in a kingdom by the sea, there lived a keeper of lighthouses and old maps. " * 3


@pytest.fixture(scope="module")
def kv_replicas(kv_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    l2 = tmp_path_factory.mktemp("shared-l2")
    tiers = ("--kv-l1", "64MiB", "--kv-l2", f"fs://{l2}", "--kv-chunk-tokens", str(C), "--max-model-len", "512")
    started = start_replicas(str(kv_model), 2, *tiers)
    yield started
    for replica in started:
        replica.stop()


def ask(router: RouterService, prompt: str) -> Reply:
    reply = Client(router.url).post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 2})
    assert reply.status == 200, reply.body
    return reply


def cached_tokens(reply: Reply) -> int:
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt_keys(router: RouterService, replica: str, prompt: str) -> list[str]:
    """The chunk keys of ``prompt`` that ``replica`` can cache, computed as the router computes them."""
    request = router.router.prompts.read("/v1/completions", json.dumps({"prompt": prompt}).encode(), None)
    state = router.kv_index.state(replica)
    assert state is not None
    assert request.token_ids is not None
    keys = request.keys(state.fingerprint, state.chunk_tokens)
    return keys[: cacheable_chunks(len(request.token_ids), state.chunk_tokens)]


def wait_indexed(router: RouterService, replica: str, prompt: str, tier: str = "l1") -> None:
    """Until ``replica``'s KV events told the router that its ``tier`` holds every cacheable chunk of ``prompt``."""
    keys = prompt_keys(router, replica, prompt)

    def indexed() -> bool:
        state = router.kv_index.state(replica)
        held = None if state is None else state.l1 if tier == "l1" else state.l2
        return held is not None and all(key in held for key in keys)

    wait_until(indexed, f"{replica}'s {tier} events for {len(keys)} chunks")


def cache_once(urls: list[str], model: Path, prompt: str) -> str:
    """Send ``prompt`` through a router that is then stopped; the replica that cached it, once the router heard that
    every chunk reached its L1 and the shared L2 (L2 writes are in the background: a later snapshot of the other
    replica must list them all)."""
    with running_router(urls, "kv", model=str(model)) as router:
        holder = replica_of(ask(router, prompt))
        wait_indexed(router, holder, prompt, "l1")
        wait_indexed(router, holder, prompt, "l2")
    return holder


def test_kv_sends_a_prompt_where_its_prefix_is_cached(kv_replicas: list[ServerProcess], kv_model: Path) -> None:
    urls = [r.url for r in kv_replicas]
    with running_router(urls, "kv", model=str(kv_model)) as router:
        first = ask(router, STORY + "The keeper")
        holder = replica_of(first)
        wait_indexed(router, holder, STORY + "The keeper")
        # Back to back: the replica's last reported load may date from the previous request (docs/router.md).
        again = [ask(router, STORY + f"Then {n}") for n in range(3)]
    assert first.headers["X-Preheat-Route"] == "kv_no_hit"
    assert {replica_of(r) for r in again} == {holder}
    assert {r.headers["X-Preheat-Route"] for r in again} == {"kv_hit"}
    assert all(cached_tokens(r) > 0 for r in again)


def test_a_restarted_router_knows_the_caches_at_its_first_request(
    kv_replicas: list[ServerProcess], kv_model: Path
) -> None:
    urls = [r.url for r in kv_replicas]
    prompt = "A different tale: the lighthouse keeper counted every ship that passed the harbour wall. " * 3
    holder = cache_once(urls, kv_model, prompt + "One")
    with running_router(urls, "kv", model=str(kv_model)) as restarted:
        first = ask(restarted, prompt + "Two")
    assert first.headers["X-Preheat-Route"] == "kv_hit"
    assert replica_of(first) == holder  # its L1 copy beats the other replica's L2 copy


def test_a_shared_l2_hit_counts_for_a_replica_that_never_saw_the_prompt(
    kv_replicas: list[ServerProcess], kv_model: Path
) -> None:
    urls = [r.url for r in kv_replicas]
    prompt = "Yet another story, about a cartographer who drew the coastline one bay at a time, slowly. " * 3
    holder = cache_once(urls, kv_model, prompt + "One")
    other = next(u for u in urls if u != holder)
    with running_router([other], "kv", model=str(kv_model)) as alone:
        wait_until(lambda: bool(list(alone.kv_index.l2_view(other))), "the shared L2's keys")
        reply = ask(alone, prompt + "Two")
    assert reply.headers["X-Preheat-Route"] == "kv_hit"
    assert cached_tokens(reply) > 0  # restored from the shared L2 by a replica that never computed it


def test_kv_holds_what_a_replica_cannot_start_yet_and_answers_every_request(
    kv_replicas: list[ServerProcess], kv_model: Path
) -> None:
    """A preheat replica generates one sequence at a time (``load.slots`` 1): in front of it, ``kv`` sends it at
    most two of a burst and holds the rest (docs/router.md, *Held at the router*), and every request is answered."""
    url = kv_replicas[0].url
    body = {"model": NAME, "max_tokens": 200, "stream": True}
    with running_router([url], "kv", model=str(kv_model)) as router:
        wait_until(lambda: getattr(router.kv_index.state(url), "slots", None) == 1, "the replica's slots")
        client, replica = Client(router.url), Client(url)
        seen = {"held": 0.0, "waiting": 0.0}
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(client.stream, "/v1/completions", {**body, "prompt": f"Tale {n}: once upon a time"})
                       for n in range(8)]  # fmt: skip
            while not all(a.done() for a in answers):
                seen["held"] = max(seen["held"], client.metric("preheat_router_held", replica=url))
                seen["waiting"] = max(seen["waiting"], replica.metric("preheat_queue_depth"))
            streams = [a.result() for a in answers]
        left = client.metric("preheat_router_held", replica=url)
    assert all(s.status == 200 and s.done and s.finish_reason in ("stop", "length") for s in streams)
    assert seen["held"] >= 1  # the burst waited at the router...
    assert seen["waiting"] <= 1  # ...not in the replica's queue: one generating, at most one waiting there
    assert left == 0


def test_a_burst_over_two_replicas_with_requests_held_and_moved_leaves_nothing_counted(
    kv_replicas: list[ServerProcess], kv_model: Path
) -> None:
    """A burst about two prompts, each cached on one replica: long answers about the first, short ones about the
    second. ``kv`` routes each where it is cheapest, holds what a replica cannot start yet, and a replica done with
    its own may take held ones (docs/router.md, *Held at the router*; whether it does depends on the replicas'
    timings, so the move itself is tested in tests/unit/router). Every stream is answered, each replica's answers
    add up to the burst, and nothing is left held or counted in flight at either replica."""
    urls = [r.url for r in kv_replicas]
    long = "The harbour master kept a ledger of every tide, every storm and every ship's name and cargo. " * 3
    short = "In the valley below, a miller ground the wheat of seven villages and never once raised the price. " * 3
    body = {"model": NAME, "stream": True}

    def answered() -> dict[str, float]:
        return {url: client.metric("preheat_router_requests_total", replica=url, status="200") for url in urls}

    with running_router(urls, "kv", model=str(kv_model)) as router:
        client = Client(router.url)
        with ThreadPoolExecutor(14) as pool:
            # Two at once, no hit anywhere: least-load sends one to each replica.
            first = list(pool.map(lambda p: ask(router, p + "First"), (long, short)))
            assert replica_of(first[0]) != replica_of(first[1])
            wait_indexed(router, replica_of(first[0]), long + "First")
            wait_indexed(router, replica_of(first[1]), short + "First")
            before = answered()
            burst = [pool.submit(client.stream, "/v1/completions", {**body, "prompt": long + f"Q{n}", "max_tokens":
                     160}) for n in range(10)]  # fmt: skip
            burst += [pool.submit(client.stream, "/v1/completions", {**body, "prompt": short + f"Q{n}", "max_tokens":
                      2}) for n in range(2)]  # fmt: skip
            streams = [s.result() for s in burst]
        after = answered()
        moved = {url: client.metric("preheat_router_moved_total", replica=url) for url in urls}
        left = {url: (client.metric("preheat_router_held", replica=url), client.metric("preheat_router_in_flight",
                replica=url)) for url in urls}  # fmt: skip
    assert all(s.status == 200 and s.done and s.finish_reason in ("stop", "length") for s in streams)
    assert sum(after.values()) - sum(before.values()) == len(burst)
    # Each request moved says so, and counts at the replica that answered it.
    said = [(s.headers["X-Preheat-Replica"]) for s in streams if s.headers["X-Preheat-Route"] == "moved"]
    assert {url: said.count(url) for url in urls} == moved
    assert left == dict.fromkeys(urls, (0, 0))
