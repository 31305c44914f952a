"""The vLLM standby's own listener (``preheat.integrations.vllm.standby``), served for real on 127.0.0.1 without vLLM:
who may ask for a load, which loads start anything, what every other route answers, and the hand-over that stops it
while its socket keeps listening for vLLM's server. The standby as a whole, with vLLM: tests/engines/."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from preheat.core.errors import ConfigError
from preheat.integrations.vllm.standby import StandbyServer, hand_over, told_to_load
from preheat.integrations.vllm.standby_control import StandbyState
from preheat.integrations.vllm.standby_settings import VllmStandbySettings
from preheat.router.activation import ColdSettings, ColdStarter
from preheat.router.metrics import RouterMetrics
from preheat.router.upstream import Replica
from routing import wait_until
from serving import Client


@pytest.fixture
def models(tmp_path: Path) -> Path:
    (tmp_path / "smol").mkdir()
    return tmp_path


class Healthy(BaseHTTPRequestHandler):
    """vLLM's server once it serves, as far as the router's activation asks: ``/health`` is 200."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def start(models: Path, admin_key: str | None = None) -> StandbyServer:
    settings = VllmStandbySettings("127.0.0.1", 0, (str(models / "*"),), admin_key)
    server = StandbyServer(settings, StandbyState())
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


@pytest.fixture
def standby(models: Path) -> Iterator[StandbyServer]:
    server = start(models)
    yield server
    server.shutdown()
    server.server_close()


def url(server: StandbyServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_health_is_503_standby_until_prepared(standby: StandbyServer) -> None:
    client = Client(url(standby))
    assert (client.get("/health").status, client.get("/health").json()) == (
        503,
        {"status": "standby", "prepared": False},
    )
    standby.state.prepared = True
    assert client.get("/health").json()["prepared"] is True


def test_a_model_outside_the_allow_list_is_403_and_nothing_is_started(standby: StandbyServer) -> None:
    reply = Client(url(standby)).post("/v1/preheat/load", {"model": "/etc"})
    assert reply.status == 403
    assert reply.json()["error"]["code"] == "model_not_allowed"
    assert standby.requests == []
    assert standby.state.phase == "standby"


def test_a_dot_dot_escape_from_the_allowed_directory_is_refused(standby: StandbyServer, models: Path) -> None:
    reply = Client(url(standby)).post("/v1/preheat/load", {"model": f"{models}/../etc"})
    assert reply.json()["error"]["code"] == "model_not_allowed"
    assert standby.requests == []


def test_an_allowed_load_is_202_and_the_main_thread_gets_its_normal_form(standby: StandbyServer, models: Path) -> None:
    client = Client(url(standby))
    reply = client.post("/v1/preheat/load", {"model": f"{models}/./smol", "served_model_name": "smol"})
    assert reply.status == 202
    assert reply.json() == {"status": "loading", "model": str(models / "smol")}
    assert [(r.model, r.served_model_name) for r in standby.requests] == [(str(models / "smol"), "smol")]
    assert client.get("/health").json() == {"status": "loading", "model": str(models / "smol")}


def test_a_load_while_loading_is_409_is_loading(standby: StandbyServer, models: Path) -> None:
    client = Client(url(standby))
    assert client.post("/v1/preheat/load", {"model": str(models / "smol")}).status == 202
    again = client.post("/v1/preheat/load", {"model": str(models / "smol")})
    assert again.status == 409
    assert again.json()["error"]["code"] == "is_loading"
    assert len(standby.requests) == 1


def test_every_other_route_is_503_standby(standby: StandbyServer) -> None:
    client = Client(url(standby))
    for reply in (client.get("/v1/models"), client.post("/v1/completions", {"model": "x", "prompt": "hi"})):
        assert reply.status == 503
        assert reply.json()["error"]["code"] == "standby"


def test_a_request_naming_another_host_cannot_load_without_an_admin_key(standby: StandbyServer, models: Path) -> None:
    reply = Client(url(standby)).post("/v1/preheat/load", {"model": str(models / "smol")}, {"Host": "evil.example"})
    assert reply.status == 403
    assert reply.json()["error"]["code"] == "host_not_allowed"
    assert standby.requests == []


def test_with_an_admin_key_a_load_needs_it(models: Path) -> None:
    server = start(models, admin_key="k3y")
    try:
        client = Client(url(server))
        body = {"model": str(models / "smol")}
        assert client.post("/v1/preheat/load", body).status == 401
        assert client.post("/v1/preheat/load", body, {"Authorization": "Bearer nope"}).status == 403
        assert server.requests == []
        assert client.post("/v1/preheat/load", body, {"Authorization": "Bearer k3y"}).status == 202
    finally:
        server.shutdown()
        server.server_close()


def test_a_waiting_load_answers_the_failure_and_the_standby_takes_the_next(
    standby: StandbyServer, models: Path
) -> None:
    client = Client(url(standby))
    answers: list[int] = []
    waiting = threading.Thread(
        target=lambda: answers.append(
            client.post("/v1/preheat/load", {"model": str(models / "smol"), "wait": True}).status
        )
    )
    waiting.start()
    while not standby.requests:
        standby.state.done.wait(0.01)
    standby.state.failed("ActivationFailed: no config.json")
    waiting.join(30)
    assert answers == [500]
    health = client.get("/health").json()
    assert (health["status"], health["last_error"]) == ("standby", "ActivationFailed: no config.json")
    assert client.post("/v1/preheat/load", {"model": str(models / "smol")}).status == 202


def test_the_hand_over_stops_answering_but_keeps_the_socket_listening(models: Path) -> None:
    server = start(models)
    try:
        Client(url(server)).post("/v1/preheat/load", {"model": str(models / "smol")})
        hand_over(server)()
        assert server.state.phase == "serving"
        # Accepted by the kernel into the backlog (not refused), and answered by no one until vLLM serves it.
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            conn.settimeout(0.5)
            with pytest.raises(TimeoutError):
                conn.recv(1)
    finally:
        server.server_close()


def test_a_router_activation_waits_through_the_hand_over_until_vllms_server_answers(models: Path) -> None:
    # Between the hand-over and vLLM's server taking the socket, the standby's /health is 503 "serving": the
    # router's activation waits on through it (it once failed there, "/health says serving", now and then).
    server = start(models)
    vllm: ThreadingHTTPServer | None = None
    try:
        replica = Replica(url(server), standby=True)
        replica.phase = "standby"
        admitted: list[str] = []
        settings = ColdSettings(model=str(models / "smol"))
        starter = ColdStarter([replica], lambda r, why: admitted.append(r.url), RouterMetrics(list), settings)
        assert starter.need("no replica in rotation")
        wait_until(lambda: bool(server.requests), "the router's load request", 10.0)
        server.state.handed_over()
        time.sleep(0.5)  # ten of the router's /health polls see "serving"
        assert starter.errors == {}
        assert Client(url(server)).get("/health").json() == {"status": "serving", "prepared": False}
        hand_over(server)()
        vllm = ThreadingHTTPServer(server.server_address, Healthy, bind_and_activate=False)
        vllm.socket = server.socket  # what vLLM's server does: serve the socket the standby kept listening
        threading.Thread(target=vllm.serve_forever, args=(0.05,), daemon=True).start()
        wait_until(lambda: bool(admitted), "the activation to end", 10.0)
        assert (admitted, starter.errors) == ([url(server)], {})
    finally:
        if vllm is not None:
            vllm.shutdown()
        server.server_close()


def test_a_standby_told_to_load_on_its_command_line_loads_that_and_takes_no_load_request(models: Path) -> None:
    # What a Kubernetes vLLM replica is (docs/kubernetes.md): --load, bound beyond loopback, no admin key.
    settings = VllmStandbySettings.resolve({"host": "0.0.0.0", "port": 0, "load": f"{models}/./smol"}, {})
    request = told_to_load(settings)
    assert request is not None
    assert request.model == str(models / "smol")  # the normal form, as a load request's
    server = StandbyServer(settings, StandbyState())
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}")
        reply = client.post("/v1/preheat/load", {"model": request.model})
        assert reply.status == 403
        assert reply.json()["error"]["code"] == "admin_key_required"
        assert server.requests == []
    finally:
        server.shutdown()
        server.server_close()


def test_a_load_on_the_command_line_outside_the_allow_list_stops_the_start(models: Path) -> None:
    settings = VllmStandbySettings.resolve({"allow_model": [str(models / "*")], "load": "/etc"}, {})
    with pytest.raises(ConfigError, match="--load /etc"):
        told_to_load(settings)
