"""Cold capacity behind the router: standby replicas it activates and sleeping replicas it wakes when it needs a
replica (none in rotation, or every one saturated), and sleeping replicas it ejects at their first refusal. Real
``preheat serve`` subprocesses on 127.0.0.1; the rules themselves (router/capacity.py) are tested as the pure
functions they are. No assertion depends on how fast a busy machine answers."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.router.activation import wake_cost
from preheat.router.capacity import SLEEPING, STANDBY, Cold, rank_cold, refused_code, saturated
from preheat.router.cluster import ServerProcess
from preheat.testing.fileserver import FileServer
from routing import NAME, SlowProxy, replica_of, router_metric, running_router, start_replicas, wait_until
from serving import Client, Reply

PROMPT = {"model": NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
# Health checks far apart: what ejects a sleeping replica in these tests is its answer to a request, not a check.
RARE_CHECKS: dict[str, object] = {"health_interval": 60.0, "health_timeout": 10.0}


def standby(*allow: str) -> ServerProcess:
    """A ``preheat serve --standby`` replica allowed to load ``allow``, waited for until its imports are done (so
    that the router's choice between standbys does not depend on which finished importing first)."""
    args = [arg for pattern in allow for arg in ("--allow-model", pattern)]
    server = ServerProcess("", "--standby", "--served-model-name", NAME, *args)
    try:
        client = Client(server.url)
        wait_until(lambda: client.get("/health").json().get("prepared") is True, "the standby's imports", 120.0)
    except BaseException:
        server.stop()
        raise
    return server


def health(url: str) -> dict[str, object]:
    return dict(Client(url).get("/health").json())


def complete(router_url: str) -> Reply:
    return Client(router_url).post("/v1/completions", PROMPT)


# -- the rules, pure -------------------------------------------------------------------------------------------------
def test_saturated_means_every_replica_in_rotation_at_the_limit() -> None:
    assert saturated([3, 3], 3)
    assert not saturated([3, 2], 3)
    assert not saturated([], 3)  # no replica at all is "none in rotation", not saturation


def test_the_cheapest_cold_replica_comes_first_and_unknown_costs_take_the_measured_mean() -> None:
    cold = [Cold("standby", STANDBY), Cold("asleep", SLEEPING, 0.3), Cold("importing", STANDBY, prepared=False)]
    assert [c.name for c in rank_cold(cold)] == ["asleep", "standby", "importing"]  # priors: wake before activation
    measured = {STANDBY: [0.1, 0.2]}  # activations through this router took 0.15 s on average
    assert [c.name for c in rank_cold(cold, measured)] == ["standby", "asleep", "importing"]
    ties = [Cold("a", STANDBY), Cold("b", STANDBY)]
    assert [c.name for c in rank_cold(ties)] == ["a", "b"]  # the order the replicas were given


def test_only_a_503_that_says_not_serving_is_a_refusal_to_retry_elsewhere() -> None:
    for code in ("sleeping", "standby", "draining", "waking", "model_loading"):
        assert refused_code(503, {"error": {"code": code}}) == code
    assert refused_code(503, {"error": {"code": "queue_full"}}) is None
    assert refused_code(429, {"error": {"code": "sleeping"}}) is None
    assert refused_code(503, None) is None


def test_a_wake_cost_is_the_ready_of_a_wake_timeline_only() -> None:
    woke: dict[str, object] = {
        "origin_source": "wake request",
        "stages": [{"name": "ready", "start": 0.12, "end": 0.12}],
    }
    assert wake_cost(woke) == 0.12
    assert wake_cost({**woke, "origin_source": "process start"}) is None  # a cold start is not a wake
    assert wake_cost({"origin_source": "wake request", "stages": []}) is None


# -- standby replicas ------------------------------------------------------------------------------------------------
def test_a_request_with_no_replica_in_rotation_activates_a_standby_and_succeeds(kv_model: Path) -> None:
    with standby(str(kv_model)) as waiting:
        flags: dict[str, object] = {"standby": [waiting.url], "standby_model": str(kv_model), "served_model_name": NAME}
        with running_router([], "round-robin", **flags) as router:
            state = Client(router.url).get("/health")
            assert state.status == 200, state.body  # no replica in rotation, but one can be activated
            assert state.json()["status"] == "cold"
            reply = complete(router.url)
            assert reply.status == 200, reply.body
            assert replica_of(reply) == waiting.url
            assert health(waiting.url) == {"status": "ok", "model": NAME}
            assert router_metric(router.url, "preheat_router_activations_total", replica=waiting.url, outcome="ok") == 1
            assert router_metric(router.url, "preheat_router_activation_seconds_count") == 1
            assert complete(router.url).status == 200  # served from now on, no second activation
            assert router_metric(router.url, "preheat_router_activations_total", replica=waiting.url, outcome="ok") == 1


def test_saturated_replicas_bring_a_standby_into_rotation(tiny_servable_model: Path) -> None:
    """One serving replica held busy (its answers wait behind a proxy) with ``--saturation 1``: the next request
    activates the standby and, once it is ready, a third one goes there."""
    (busy,) = start_replicas(str(tiny_servable_model), 1)
    with busy, SlowProxy(_port(busy.url)) as slow, standby(str(tiny_servable_model)) as waiting:
        flags: dict[str, object] = {
            "standby": [waiting.url],
            "standby_model": str(tiny_servable_model),
            "served_model_name": NAME,
            "saturation": 1,
            "health_interval": 0.1,
            "health_timeout": 300.0,  # a check held behind the proxy waits; it must not eject the busy replica
        }
        with running_router([slow.url], "least-load", **flags) as router:
            replicas = {r.url: r for r in router.router.replicas}
            slow.delay = 300.0  # from now on the busy replica's answers wait until release()
            held: list[Reply] = []
            threads = [threading.Thread(target=lambda: held.append(complete(router.url))) for _ in range(2)]
            threads[0].start()
            wait_until(lambda: replicas[slow.url].in_flight == 1, "the first request to be in flight")
            threads[1].start()  # finds every replica saturated: activates the standby, and queues meanwhile
            wait_until(lambda: replicas[waiting.url].healthy, "the router to activate the standby", 120.0)
            reply = complete(router.url)
            assert reply.status == 200, reply.body
            assert replica_of(reply) == waiting.url
            slow.release()
            for thread in threads:
                thread.join(timeout=120)
            assert [r.status for r in held] == [200, 200]
            assert router_metric(router.url, "preheat_router_activations_total", replica=waiting.url, outcome="ok") == 1


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_standby_that_may_not_load_the_model_is_skipped_for_the_next(kv_model: Path, tmp_path: Path) -> None:
    with standby(str(tmp_path / "elsewhere" / "*")) as refusing, standby(str(kv_model)) as willing:
        flags: dict[str, object] = {
            "standby": [refusing.url, willing.url],
            "standby_model": str(kv_model),
            "served_model_name": NAME,
        }
        with running_router([], "round-robin", **flags) as router:
            reply = complete(router.url)
            assert reply.status == 200, reply.body
            assert replica_of(reply) == willing.url
            refused = router_metric(
                router.url, "preheat_router_activations_total", replica=refusing.url, outcome="refused"
            )
            assert refused == 1
            assert health(refusing.url)["status"] == "standby"


@pytest.fixture
def corrupt_origin(kv_model: Path, tmp_path: Path) -> Iterator[str]:
    """An HTTP origin serving ``bad``: the tiny model with one flipped byte, so its digest no longer matches."""
    bad = tmp_path / "origin" / "bad"
    shutil.copytree(kv_model, bad)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with FileServer(tmp_path / "origin") as origin:
        yield origin.url


def test_a_failed_activation_answers_a_503_that_says_why_and_leaves_the_standby_waiting(
    corrupt_origin: str, tmp_path: Path
) -> None:
    cache = str(tmp_path / "cache")
    server = ServerProcess("", "--standby", "--allow-model", f"{corrupt_origin}/*", "--cache-dir", cache)
    with server:
        flags: dict[str, object] = {
            "standby": [server.url],
            "standby_model": f"{corrupt_origin}/bad",
            "served_model_name": NAME,
        }
        with running_router([], "round-robin", **flags) as router:
            reply = complete(router.url)
            assert reply.status == 503, reply.body
            error = reply.json()["error"]
            assert error["code"] == "no_replica"
            assert server.url in error["message"]
            assert "digest" in error["message"] or "match" in error["message"], error
            assert router_metric(router.url, "preheat_router_activations_total", replica=server.url, outcome="failed")
            assert health(server.url)["status"] == "standby"  # alive, and able to take another model
            assert server.proc.poll() is None


# -- sleeping replicas -----------------------------------------------------------------------------------------------
def test_a_replica_put_to_sleep_is_ejected_at_its_first_refusal_and_no_request_fails(
    tiny_servable_model: Path,
) -> None:
    first, second = start_replicas(str(tiny_servable_model), 2)
    with first, second, running_router([first.url, second.url], "round-robin", **RARE_CHECKS) as router:
        assert Client(first.url).post("/v1/preheat/sleep", {"level": 1}).status == 200
        replies = [complete(router.url) for _ in range(4)]  # round-robin: one of them is sent to the sleeper first
        assert [r.status for r in replies] == [200] * 4
        assert {replica_of(r) for r in replies} == {second.url}
        assert router_metric(router.url, "preheat_router_ejections_total", replica=first.url) == 1
        assert router_metric(router.url, "preheat_router_retries_total") == 1
        assert health(first.url)["status"] == "sleeping"  # capacity was there: nobody woke it
        assert router_metric(router.url, "preheat_router_wakes_total", replica=first.url, outcome="ok") == 0


def test_the_router_wakes_a_sleeping_replica_when_it_needs_capacity(tiny_servable_model: Path) -> None:
    (only,) = start_replicas(str(tiny_servable_model), 1)
    with only, running_router([only.url], "round-robin", **RARE_CHECKS) as router:
        assert Client(only.url).post("/v1/preheat/sleep", {"level": 2}).status == 200
        reply = complete(router.url)  # refused as sleeping, ejected, woken, and served there
        assert reply.status == 200, reply.body
        assert replica_of(reply) == only.url
        assert health(only.url) == {"status": "ok", "model": NAME}
        assert router_metric(router.url, "preheat_router_wakes_total", replica=only.url, outcome="ok") == 1
        assert router_metric(router.url, "preheat_router_wake_seconds_count") == 1


def test_sleep_idle_puts_an_idle_replica_to_sleep_and_a_request_wakes_it(tiny_servable_model: Path) -> None:
    (only,) = start_replicas(str(tiny_servable_model), 1)
    flags: dict[str, object] = {"sleep_idle": 0.5, "sleep_keep": 0, "health_interval": 0.2}
    with only, running_router([only.url], "round-robin", **flags) as router:
        wait_until(lambda: health(only.url)["status"] == "sleeping", "the idle replica asleep")
        reply = complete(router.url)  # no replica in rotation: woken, then served there
        assert reply.status == 200, reply.body
        assert replica_of(reply) == only.url
        assert router_metric(router.url, "preheat_router_sleeps_total", replica=only.url, outcome="ok") >= 1
        assert router_metric(router.url, "preheat_router_wakes_total", replica=only.url, outcome="ok") == 1


def test_with_no_wake_a_sleeping_replica_stays_asleep_and_its_refusal_reaches_the_client(
    tiny_servable_model: Path,
) -> None:
    (only,) = start_replicas(str(tiny_servable_model), 1)
    with only, running_router([only.url], "round-robin", wake=False, **RARE_CHECKS) as router:
        assert Client(only.url).post("/v1/preheat/sleep", {"level": 1}).status == 200
        reply = complete(router.url)
        assert reply.status == 503
        assert reply.json()["error"]["code"] == "sleeping"  # the replica's own words
        assert health(only.url)["status"] == "sleeping"


def test_standby_replicas_need_a_model_to_load_and_come_from_flags_or_the_environment() -> None:
    from preheat.core.errors import ConfigError
    from preheat.router.settings import RouterSettings

    with pytest.raises(ConfigError, match="--standby-model"):
        RouterSettings.resolve({"standby": ["http://127.0.0.1:8001"]}, {})
    env = {
        "PREHEAT_ROUTER_STANDBY": "http://127.0.0.1:8001,http://127.0.0.1:8002",
        "PREHEAT_ROUTER_STANDBY_MODEL": "s3://models/tiny",
        "PREHEAT_ROUTER_WAKE": "0",
    }
    settings = RouterSettings.resolve({}, env)  # no --replica: standby replicas alone are a fleet
    assert settings.standby == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert settings.activation_model == "s3://models/tiny"
    assert settings.wake is False
    assert RouterSettings.resolve({"standby": ["http://a:1"], "model": "/models/tiny"}, {}).activation_model == (
        "/models/tiny"
    )
