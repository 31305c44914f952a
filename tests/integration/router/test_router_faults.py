"""Faults behind the router, with real replicas: a replica killed mid-run, one that dies mid-answer, one that answers
slowly, and one that comes back. The router must eject, retry before the first byte, and say what happened after.

No test depends on how fast a busy machine answers: checks come often, but a health check's timeout is long enough
that a live replica never misses it; the slow replica is held for a minute, far past the timeout, until released."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from netfaults import FaultProxy
from preheat.router.cluster import ServerProcess
from preheat.router.policies import make_policy
from preheat.router.prompts import PromptReader
from preheat.router.proxy import Router
from preheat.router.upstream import Replica
from routing import NAME, SlowProxy, replica_of, router_metric, running_router, start_replicas, wait_until
from serving import Client, Reply

GREEDY = {"model": NAME, "temperature": 0, "max_tokens": 4, "prompt": "Hello"}
# A dead replica refuses connections and is ejected at its first check; a live one answers well within 10 s.
FAST_CHECKS = {"health_interval": 0.1, "health_timeout": 10.0}
# The slow replica is ejected after two timed-out checks; it holds its answers for 60 s, far past 2 s.
SLOW_CHECKS = {"health_interval": 0.1, "health_timeout": 2.0}


@pytest.fixture(scope="module")
def pair(tiny_servable_model: Path) -> Iterator[list[ServerProcess]]:
    started = start_replicas(str(tiny_servable_model), 2)
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture
def replicas(pair: list[ServerProcess], tiny_servable_model: Path) -> list[ServerProcess]:
    """The module's two replicas, both alive: one an earlier test killed is started again on its port first."""
    for i, replica in enumerate(pair):
        if replica.proc.poll() is not None:
            replica.stop()
            port = replica.url.rsplit(":", 1)[1]
            pair[i] = ServerProcess(str(tiny_servable_model), "--served-model-name", NAME, "--port", port)
            pair[i].wait_ready(timeout=120)
    return pair


def healthy(router_url: str) -> dict[str, bool]:
    return {r["url"]: r["healthy"] for r in Client(router_url).get("/health").json()["replicas"]}


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error(replicas: list[ServerProcess]) -> None:
    port = int(replicas[0].url.rsplit(":", 1)[1])
    # Cut the first connection whose answer passes 1500 bytes: the stream's, a few events in.
    with FaultProxy(port, cut_after=1500) as dying, running_router([dying.url], "round-robin") as router:
        body = {**GREEDY, "prompt": "The capital of France is", "max_tokens": 200}
        stream = Client(router.url).stream("/v1/completions", body)
    assert stream.status == 200
    assert stream.done
    assert stream.chunks[-1]["error"]["code"] == "replica_failed"
    assert len(stream.chunks) > 1  # the tokens before the cut were relayed as they came


def test_a_slow_replica_is_ejected_and_readmitted_when_it_recovers(replicas: list[ServerProcess]) -> None:
    slow_port = int(replicas[0].url.rsplit(":", 1)[1])
    with SlowProxy(slow_port) as slow, running_router([slow.url, replicas[1].url], "least-load", **SLOW_CHECKS) as r:
        client = Client(r.url)
        slow.delay = 60.0
        wait_until(lambda: not healthy(r.url)[slow.url], "the slow replica to be ejected")
        replies = [client.post("/v1/completions", GREEDY) for _ in range(3)]
        slow.release()
        wait_until(lambda: healthy(r.url)[slow.url], "the recovered replica to be readmitted")
        after = {replica_of(client.post("/v1/completions", GREEDY)) for _ in range(4)}
    assert [x.status for x in replies] == [200] * 3
    assert {replica_of(x) for x in replies} == {replicas[1].url}
    assert after == {slow.url, replicas[1].url}


def test_least_load_sends_new_requests_away_from_a_replica_still_answering(replicas: list[ServerProcess]) -> None:
    slow_port = int(replicas[0].url.rsplit(":", 1)[1])
    with SlowProxy(slow_port) as slow, running_router([slow.url, replicas[1].url], "least-load") as router:
        client = Client(router.url)
        slow.delay = 60.0  # its health checks may time out and eject it meanwhile: either way, others go elsewhere
        held: list[Reply] = []
        first = threading.Thread(target=lambda: held.append(client.post("/v1/completions", GREEDY)))
        first.start()
        wait_until(lambda: any(r["in_flight"] for r in client.get("/health").json()["replicas"]), "one in flight")
        busy = next(r["url"] for r in client.get("/health").json()["replicas"] if r["in_flight"])
        others = [client.post("/v1/completions", GREEDY) for _ in range(3)]
        slow.release()
        first.join(timeout=60)
    assert held[0].status == 200
    assert all(x.status == 200 for x in others)
    assert busy not in {replica_of(x) for x in others}


def test_a_killed_replica_is_ejected_and_no_request_fails(replicas: list[ServerProcess]) -> None:
    victim, survivor = replicas
    with running_router([victim.url, survivor.url], "round-robin", **FAST_CHECKS) as router:
        client = Client(router.url)
        assert {replica_of(client.post("/v1/completions", GREEDY)) for _ in range(2)} == {victim.url, survivor.url}
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        # The first request may still be sent to the dead replica: refused before any byte, it is retried.
        replies = [client.post("/v1/completions", GREEDY) for _ in range(6)]
        ejected = router_metric(router.url, "preheat_router_ejections_total", replica=victim.url)
        state = healthy(router.url)
    assert [r.status for r in replies] == [200] * 6
    assert {replica_of(r) for r in replies} == {survivor.url}
    assert ejected == 1
    assert state == {victim.url: False, survivor.url: True}


def test_a_replica_found_dead_by_a_request_and_a_check_at_once_is_ejected_once() -> None:
    replica = Replica("http://127.0.0.1:9")
    router = Router([replica], make_policy("round-robin"), PromptReader(None))
    router.set_health(replica, True, "/health answered 200")
    router.set_health(replica, False, "connection refused")  # the request that found it dead...
    router.set_health(replica, False, "connection refused")  # ...and the health checker, a moment later
    assert router.metrics.ejections.value(replica=replica.url) == 1
    assert not replica.healthy


def test_a_restarted_replica_is_readmitted(pair: list[ServerProcess], tiny_servable_model: Path) -> None:
    victim, survivor = pair  # the victim may already be dead (an earlier test killed it): it is stopped either way
    port = victim.url.rsplit(":", 1)[1]
    with running_router([victim.url, survivor.url], "round-robin", **FAST_CHECKS) as router:
        victim.stop()
        wait_until(lambda: not healthy(router.url)[victim.url], "the stopped replica to be ejected")
        with ServerProcess(str(tiny_servable_model), "--served-model-name", NAME, "--port", port) as back:
            back.wait_ready(timeout=120)
            wait_until(lambda: healthy(router.url)[victim.url], "the restarted replica to be readmitted")
            picks = {replica_of(Client(router.url).post("/v1/completions", GREEDY)) for _ in range(2)}
    assert picks == {victim.url, survivor.url}
