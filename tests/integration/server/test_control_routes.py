"""Control routes apart from inference (preheat.http.control): ``POST /v1/preheat/{load,sleep,wake,refit}`` take the
admin key (``--admin-key``), never the API key; without any key they answer only requests addressed to this host by a
loopback name, never because the client's address is loopback; and never a web page's request (a foreign ``Origin``,
or a body that is not ``application/json``). Real ``preheat serve`` subprocesses on 127.0.0.1; the requests are
written by hand, as a browser or a same-host proxy would send them. The rule itself: tests/unit/http."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.router.cluster import ServerProcess
from serving import Client, Reply

NAME = "tiny"
API_KEY, ADMIN_KEY = "inference-key", "admin-key"


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str]) -> Reply:
    """A POST with exactly ``headers`` (a ``Host`` among them replaces the one http.client would send)."""
    conn = Client(url).connect()
    try:
        conn.request("POST", path, body=body, headers=headers)
        answer = conn.getresponse()
        return Reply(answer.status, dict(answer.getheaders()), answer.read())
    finally:
        conn.close()


def page_host(port: str) -> dict[str, str]:
    """The ``Host`` a browser sends once the attacker's name resolves to this machine (DNS rebinding)."""
    return {"Host": f"evil.example:{port}"}


def status(url: str) -> str:
    return str(Client(url).get("/health").json()["status"])


@pytest.fixture(scope="module")
def keyless(tiny_servable_model: Path) -> Iterator[ServerProcess]:
    with ServerProcess(str(tiny_servable_model), "--served-model-name", NAME) as server:
        server.wait_ready(timeout=120)
        yield server


@pytest.fixture(scope="module")
def keyed(tiny_servable_model: Path) -> Iterator[ServerProcess]:
    env = {**os.environ, "PREHEAT_API_KEY": API_KEY, "PREHEAT_ADMIN_KEY": ADMIN_KEY}
    with ServerProcess(str(tiny_servable_model), "--served-model-name", NAME, env=env) as server:
        server.wait_ready(timeout=120)
        yield server


# -- a key-less replica: what a web page on the user's machine can no longer do ------------------------------------
def test_a_cross_site_text_plain_post_cannot_sleep_a_keyless_replica(keyless: ServerProcess) -> None:
    port = keyless.url.rsplit(":", 1)[1]
    # What <form method=post enctype=text/plain> or fetch(..., {mode: "no-cors"}) sends from another site: no
    # preflight, the browser's own Origin, and (after DNS rebinding) the attacker's name as Host.
    page = {"Content-Type": "text/plain", "Origin": "http://evil.example"} | page_host(port)
    reply = raw_post(keyless.url, "/v1/preheat/sleep", b'{"level": 2}', page)
    assert (reply.status, reply.json()["error"]["code"]) == (403, "cross_origin")
    # Rebinding makes the page same-origin with the replica: the Host, not the Origin, gives it away.
    rebound = {"Content-Type": "application/json", "Origin": f"http://evil.example:{port}"} | page_host(port)
    reply = raw_post(keyless.url, "/v1/preheat/sleep", b'{"level": 2}', rebound)
    assert (reply.status, reply.json()["error"]["code"]) == (403, "host_not_allowed")
    # A page's own request to 127.0.0.1 carries its Origin; and no page can send JSON without asking first.
    local = {"Content-Type": "application/json", "Origin": "http://evil.example", "Host": f"127.0.0.1:{port}"}
    assert raw_post(keyless.url, "/v1/preheat/sleep", b"{}", local).status == 403
    plain = {"Content-Type": "text/plain", "Host": f"127.0.0.1:{port}"}
    reply = raw_post(keyless.url, "/v1/preheat/sleep", b"{}", plain)
    assert (reply.status, reply.json()["error"]["code"]) == (415, "unsupported_media_type")
    assert status(keyless.url) == "ok"
    assert Client(keyless.url).post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status == 200


def test_a_request_from_loopback_is_not_trusted_for_its_address(keyless: ServerProcess) -> None:
    # A proxy on the same host (the router was one) makes every client's request come from 127.0.0.1; it names the
    # replica as its clients did.
    port = keyless.url.rsplit(":", 1)[1]
    forwarded = {"Content-Type": "application/json", "Host": f"replica.internal:{port}"}
    for path in ("/v1/preheat/sleep", "/v1/preheat/wake", "/v1/preheat/load", "/v1/preheat/refit"):
        reply = raw_post(keyless.url, path, b"{}", forwarded)
        assert (reply.status, reply.json()["error"]["code"]) == (403, "host_not_allowed"), path
    assert status(keyless.url) == "ok"


def test_a_keyless_replica_bound_beyond_loopback_takes_no_control(tiny_servable_model: Path) -> None:
    # A program elsewhere can write any Host; the client's address proves nothing: only a key would do.
    with ServerProcess(str(tiny_servable_model), "--host", "0.0.0.0", "--served-model-name", NAME) as server:
        server.wait_ready(timeout=120)
        port = server.url.rsplit(":", 1)[1]
        local = Client(f"http://127.0.0.1:{port}")
        reply = local.post("/v1/preheat/sleep", {"level": 1})
        assert (reply.status, reply.json()["error"]["code"]) == (403, "admin_key_required")
        assert "PREHEAT_ADMIN_KEY" in reply.json()["error"]["message"]
        assert status(local.url) == "ok"


def test_a_program_on_this_host_controls_a_keyless_replica(keyless: ServerProcess) -> None:
    client = Client(keyless.url)  # Host 127.0.0.1:PORT, application/json, no Origin: curl, preheat activate
    assert client.post("/v1/preheat/sleep", {"level": 1}).status == 200
    assert status(keyless.url) == "sleeping"
    assert client.post("/v1/preheat/wake", {"wait": True}).status == 200
    assert status(keyless.url) == "ok"


# -- keys: the admin key controls, the API key never does ---------------------------------------------------------
def test_control_without_the_admin_key_is_refused_and_with_it_works(keyed: ServerProcess) -> None:
    anyone, client, admin = Client(keyed.url), Client(keyed.url, API_KEY), Client(keyed.url, ADMIN_KEY)
    assert anyone.post("/v1/preheat/sleep", {"level": 1}).status == 401
    refused = client.post("/v1/preheat/sleep", {"level": 1})  # the key every client of the replica holds
    assert (refused.status, refused.json()["error"]["code"]) == (403, "invalid_admin_key")
    assert status(keyed.url) == "ok"
    assert client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status == 200
    assert admin.post("/v1/preheat/sleep", {"level": 1}).status == 200
    assert status(keyed.url) == "sleeping"
    assert admin.post("/v1/preheat/wake", {"wait": True}).status == 200
    assert client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status == 200


def test_preheat_activate_sends_the_admin_key(keyed: ServerProcess) -> None:
    def activate(key_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PREHEAT_API_KEY", "PREHEAT_ADMIN_KEY")} | key_env
        return subprocess.run(
            [sys.executable, "-m", "preheat", "activate", keyed.url, *args],
            capture_output=True, text=True, timeout=300, check=False, env=env,
        )  # fmt: skip

    refused = activate({"PREHEAT_API_KEY": API_KEY}, "--sleep", "1")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "admin" in refused.stdout
    done = activate({"PREHEAT_ADMIN_KEY": ADMIN_KEY}, "--sleep", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["status"] == "sleeping"
    assert activate({}, "--wake", "--admin-key", ADMIN_KEY).returncode == 0
    assert status(keyed.url) == "ok"


def test_with_only_an_api_key_no_one_controls_the_replica(tiny_servable_model: Path) -> None:
    env = {**os.environ, "PREHEAT_API_KEY": API_KEY}
    with ServerProcess(str(tiny_servable_model), "--served-model-name", NAME, env=env) as server:
        server.wait_ready(timeout=120)
        reply = Client(server.url, API_KEY).post("/v1/preheat/sleep", {"level": 1})
        assert (reply.status, reply.json()["error"]["code"]) == (403, "admin_key_required")
        assert "PREHEAT_ADMIN_KEY" in reply.json()["error"]["message"]
        assert status(server.url) == "ok"
