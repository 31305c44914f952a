"""The router and the replicas' control routes: it forwards none of them, however spelt (its key, or its place on the
replicas' host, never grants control); it activates standbys with its own ``--replica-admin-key``; and it refuses to
start beyond loopback without a key. Real ``preheat serve`` and ``preheat router`` processes on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.core.procs import Child
from preheat.router.cluster import ServerProcess
from routing import NAME, replica_of, running_router, wait_until
from serving import Client

CLIENT_KEY, REPLICA_KEY, ADMIN_KEY = "client-key", "replica-key", "admin-key"
PROMPT = {"model": NAME, "prompt": "Hello", "max_tokens": 1}
SPELLINGS = ("/v1/preheat/sleep", "/v1/preheat/%73leep", "//v1/preheat/sleep", "/v1/preheat/timeline/../sleep",
             "/v1/preheat/SLEEP", "/v1/preheat/wake", "/v1/preheat/load", "/v1/preheat/refit")  # fmt: skip


def keys_env(**keys: str) -> dict[str, str]:
    """This process's environment with exactly ``keys`` among the preheat keys."""
    ours = ("PREHEAT_API_KEY", "PREHEAT_ADMIN_KEY", "PREHEAT_ROUTER_API_KEY", "PREHEAT_ROUTER_REPLICA_ADMIN_KEY")
    return {k: v for k, v in os.environ.items() if k not in ours} | keys


@pytest.fixture(scope="module")
def keyed_replica(tiny_servable_model: Path) -> Iterator[ServerProcess]:
    env = keys_env(PREHEAT_API_KEY=REPLICA_KEY, PREHEAT_ADMIN_KEY=ADMIN_KEY)
    with ServerProcess(str(tiny_servable_model), "--served-model-name", NAME, env=env) as server:
        server.wait_ready(timeout=120)
        yield server


def test_a_client_holding_only_the_routers_key_cannot_sleep_a_replica_through_it(keyed_replica: ServerProcess) -> None:
    flags: dict[str, object] = {"api_key": CLIENT_KEY, "replica_api_key": REPLICA_KEY}
    with running_router([keyed_replica.url], "round-robin", **flags) as router:
        client = Client(router.url, CLIENT_KEY)
        for path in SPELLINGS:
            reply = client.post(path, {"level": 1})
            assert (reply.status, reply.json()["error"]["code"]) == (404, "not_forwarded"), path
            assert client.request("GET", path).status == 404, path
        assert Client(keyed_replica.url).get("/health").json()["status"] == "ok"
        served = client.post("/v1/completions", PROMPT)  # inference goes through as before
        assert served.status == 200
        assert replica_of(served) == keyed_replica.url
        # The replica's key, which the router presents for its clients, does not control the replica either.
        refused = Client(keyed_replica.url, REPLICA_KEY).post("/v1/preheat/sleep", {"level": 1})
        assert (refused.status, refused.json()["error"]["code"]) == (403, "invalid_admin_key")


def test_a_keyless_router_does_not_lend_its_loopback_address_to_control(tiny_servable_model: Path) -> None:
    # Once, the replica trusted loopback clients without a key, and the router on its host was one for everybody.
    with ServerProcess(str(tiny_servable_model), "--served-model-name", NAME, env=keys_env()) as replica:
        replica.wait_ready(timeout=120)
        with running_router([replica.url]) as router:
            for path in SPELLINGS:
                assert Client(router.url).post(path, {"level": 2}).status == 404, path
            assert Client(replica.url).get("/health").json()["status"] == "ok"
            assert Client(router.url).post("/v1/completions", PROMPT).status == 200


def test_the_router_activates_a_standby_with_its_replica_admin_key_only(kv_model: Path) -> None:
    env = keys_env(PREHEAT_API_KEY=REPLICA_KEY, PREHEAT_ADMIN_KEY=ADMIN_KEY)
    allowed = ("--allow-model", str(kv_model), "--served-model-name", NAME)
    with ServerProcess("", "--standby", *allowed, env=env) as waiting:
        base: dict[str, object] = {"api_key": CLIENT_KEY, "replica_api_key": REPLICA_KEY, "standby": [waiting.url],
                                   "standby_model": str(kv_model), "served_model_name": NAME}  # fmt: skip
        # Without the admin key: the replica key the router holds does not activate the standby.
        with running_router([], "round-robin", **base) as router:
            refused = Client(router.url, CLIENT_KEY).post("/v1/completions", PROMPT)
            assert refused.status == 503, refused.body
            assert "--replica-admin-key" in refused.json()["error"]["message"]
            assert Client(waiting.url).get("/health").json()["status"] == "standby"
        with running_router([], "round-robin", **base, replica_admin_key=ADMIN_KEY) as router:
            reply = Client(router.url, CLIENT_KEY).post("/v1/completions", PROMPT)
            assert reply.status == 200, reply.body
            assert replica_of(reply) == waiting.url
            wait_until(lambda: Client(waiting.url).get("/health").status == 200, "the activated replica")


def test_a_router_bound_beyond_loopback_without_a_key_refuses_to_start() -> None:
    args = ["router", "--replica", "http://127.0.0.1:9", "--host", "0.0.0.0", "--port", "0"]
    with Child("preheat router", args, env=keys_env(), merge_stderr=True) as refused:
        assert refused.reap(60.0), "the router started on 0.0.0.0 without a key"
        refused.close()
        assert refused.proc.returncode != 0
        assert "PREHEAT_ROUTER_API_KEY" in "\n".join(refused.lines), refused.lines
    with Child("preheat router", args, env=keys_env(PREHEAT_ROUTER_API_KEY=CLIENT_KEY), merge_stderr=True) as keyed:
        url = keyed.wait_address(60.0)
        port = url.rsplit(":", 1)[1]
        assert Client(f"http://127.0.0.1:{port}").get("/v1/models").status == 401  # open to clients with the key only
