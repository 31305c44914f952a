"""``--replicas-from k8s://NS/SERVICE`` against a fake API server speaking the real list/watch protocol
(tests/k8sapi.py), through the official client: the watcher alone first, then a router in front of real
``preheat serve`` replicas that join and leave as their EndpointSlice says."""

from __future__ import annotations

import contextlib
import copy
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8sapi import TOKEN, FakeAPIServer, fixture
from preheat.k8s.discovery import EndpointSliceWatcher
from preheat.k8s.slices import SliceRules, parse_k8s_url
from preheat.router.cluster import ServerProcess
from routing import NAME, replica_of, router_metric, running_router, wait_until
from serving import Client

pytest.importorskip("kubernetes")

SERVICE = "k8s://llm/preheat-replicas?port=http"
SLICE = ("endpointslices", "llm", "preheat-replicas-7xk2q")
GREEDY = {"model": NAME, "temperature": 0, "max_tokens": 2, "prompt": "The capital of France is"}


def endpoints_slice(port: int, ready: dict[str, bool]) -> dict[str, Any]:
    """The recorded slice with its endpoints replaced: address -> ready (False: terminating, as a deleted pod is)."""
    recorded: dict[str, Any] = fixture("endpointslice-two-ready.json")
    template = recorded["endpoints"][0]
    endpoints = []
    for address, is_ready in ready.items():
        endpoint = copy.deepcopy(template)
        endpoint["addresses"] = [address]
        endpoint["conditions"] = {"ready": is_ready, "serving": is_ready, "terminating": not is_ready}
        endpoints.append(endpoint)
    recorded["endpoints"] = endpoints
    recorded["ports"] = [{"name": "http", "protocol": "TCP", "port": port}]
    return recorded


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAPIServer]:
    server = FakeAPIServer()
    monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
    yield server
    server.stop()


@contextlib.contextmanager
def watching(ref: str = SERVICE) -> Iterator[list[frozenset[str]]]:
    seen: list[frozenset[str]] = []
    watcher = EndpointSliceWatcher(parse_k8s_url(ref), seen.append, min_backoff=0.05, max_backoff=0.2)
    watcher.start()
    try:
        assert watcher.wait_synced(10)
        yield seen
    finally:
        watcher.stop()


# -- the watcher against the API server ------------------------------------------------------------------------------
def test_list_then_watch_follows_endpoints_as_they_turn_ready_and_leave(api: FakeAPIServer) -> None:
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
    with watching() as seen:
        assert seen == [{"http://10.0.0.1:8000"}]
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True, "10.0.0.2": True}))
        wait_until(lambda: seen[-1] == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, "10.0.0.2 to join")
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": False, "10.0.0.2": True}))
        wait_until(lambda: seen[-1] == {"http://10.0.0.2:8000"}, "the terminating 10.0.0.1 to leave")
        api.delete(*SLICE)
        wait_until(lambda: seen[-1] == frozenset(), "the deleted slice's replicas to leave")
    assert api.count("LIST endpointslices") == 1  # one list, then one watch carried everything
    assert api.requests[1].startswith("WATCH endpointslices rv=")


def test_a_slice_whose_endpoints_are_all_gone_empties_the_fleet_and_the_watch_goes_on(api: FakeAPIServer) -> None:
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
    with watching() as seen:
        empty = endpoints_slice(8000, {})
        empty["endpoints"] = None  # as the API server sends a slice with no endpoints (scaled to zero)
        api.put("endpointslices", empty)
        wait_until(lambda: seen[-1] == frozenset(), "the fleet to be empty")
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.2": True}))  # scaled up from zero
        wait_until(lambda: seen[-1] == {"http://10.0.0.2:8000"}, "10.0.0.2 to join")
    assert api.count("LIST endpointslices") == 1


def test_a_bookmark_moves_the_version_a_resumed_watch_starts_from(api: FakeAPIServer) -> None:
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
    with watching():
        wait_until(lambda: api.count("WATCH") == 1, "the watch")
        api.bookmark()
        bookmarked = api.version
        api.restart()  # the watch is cut: it resumes from the bookmark's version, without listing again
        wait_until(lambda: api.count("WATCH") == 2, "the resumed watch")
    assert api.requests[-1] == f"WATCH endpointslices rv={bookmarked}"
    assert api.count("LIST endpointslices") == 1


def test_410_gone_relists_and_catches_up_with_what_changed(api: FakeAPIServer) -> None:
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
    with watching() as seen:
        wait_until(lambda: api.count("WATCH") == 1, "the watch")
        api.compact()  # the watch ends; resuming from its version gets the ERROR 410 event
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.3": True}))
        wait_until(lambda: seen[-1] == {"http://10.0.0.3:8000"}, "the change, seen through a relist")
    assert api.count("LIST endpointslices") == 2


def test_an_api_server_restart_keeps_the_replicas_and_reconnects(api: FakeAPIServer) -> None:
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
    with watching() as seen:
        wait_until(lambda: api.count("WATCH") == 1, "the watch")
        api.stop()
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True, "10.0.0.4": True}))  # while it is down
        assert seen[-1] == {"http://10.0.0.1:8000"}  # nothing known changed: the replicas stay
        api.start(api.port)
        wait_until(lambda: len(seen[-1]) == 2, "the change made while the API server was down")


def test_a_forbidden_watch_keeps_trying_and_says_which_rbac_rule_is_missing(
    api: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    api.forbid.add("endpointslices")
    seen: list[frozenset[str]] = []
    watcher = EndpointSliceWatcher(parse_k8s_url(SERVICE), seen.append, min_backoff=0.05, max_backoff=0.1)
    watcher.start()
    try:
        assert not watcher.wait_synced(0.3)
        assert watcher.last_error is not None
        assert "endpointslices.discovery.k8s.io" in watcher.last_error
        api.forbid.clear()
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
        assert watcher.wait_synced(10)
        assert seen == [{"http://10.0.0.1:8000"}]
    finally:
        watcher.stop()


def test_slices_the_cluster_does_not_vouch_for_add_no_replica(
    api: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each finding of issue 29: an FQDN slice, the metadata address and 20,000 endpoints in one slice became
    replicas (each would receive prompts and the replica key); a hand-made slice without the controller's label
    too. None of them does now, the honest slice's replica stays, and each refusal is said in the log."""
    honest = {"http://10.0.0.1:8000"}
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
    with watching() as seen:
        assert seen[-1] == honest
        fqdn = named(endpoints_slice(8000, {"replica.attacker.example": True}), "preheat-replicas-fqdn")
        fqdn["addressType"] = "FQDN"
        metadata = named(endpoints_slice(8000, {"169.254.169.254": True, "10.0.0.2": True}), "preheat-replicas-meta")
        flood = named(endpoints_slice(8000, {}), "preheat-replicas-flood")
        one = endpoints_slice(8000, {"10.1.0.0": True})["endpoints"][0]
        flood["endpoints"] = [{**one, "addresses": [f"10.{1 + i // 65536}.{i // 256 % 256}.{i % 256}"]}
                              for i in range(20_000)]  # fmt: skip
        by_hand = named(endpoints_slice(8000, {"10.0.0.3": True}), "preheat-replicas-byhand")
        del by_hand["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
        for hostile in (fqdn, metadata, flood, by_hand):
            api.put("endpointslices", hostile)
        # 10.0.0.2 sits beside the metadata address in a controller's slice: it is a replica, the other is not.
        wait_until(lambda: seen[-1] == honest | {"http://10.0.0.2:8000"}, "the metadata slice's one real replica")
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True, "10.0.0.4": True}))  # later changes
        wait_until(lambda: seen[-1] == honest | {"http://10.0.0.2:8000", "http://10.0.0.4:8000"}, "10.0.0.4")
    assert all(len(replicas) <= 3 for replicas in seen)  # no moment had a hostile replica in the set
    said = caplog.text
    assert "EndpointSlice 'preheat-replicas-fqdn' has addressType 'FQDN'" in said
    assert "169.254.169.254 (a link-local address)" in said
    assert "holds 20000 endpoints, more than the 1000" in said


def named(slice_: dict[str, Any], name: str) -> dict[str, Any]:
    slice_["metadata"]["name"] = name
    return slice_


def test_the_router_follows_at_most_its_cap_of_replicas_and_keeps_the_ones_it_has(api: FakeAPIServer) -> None:
    api.put("endpointslices", endpoints_slice(8000, {"10.0.0.5": True, "10.0.0.6": True}))
    seen: list[frozenset[str]] = []
    rules = SliceRules.of(max_replicas=2)
    watcher = EndpointSliceWatcher(parse_k8s_url(SERVICE), seen.append, rules=rules, min_backoff=0.05)
    watcher.start()
    try:
        assert watcher.wait_synced(10)
        first = {"http://10.0.0.5:8000", "http://10.0.0.6:8000"}
        assert seen[-1] == first
        # A flood of addresses that sort first cannot push the known replicas out.
        api.put("endpointslices", named(endpoints_slice(8000, {"10.0.0.1": True, "10.0.0.2": True}), "other"))
        wait_until(lambda: "*" in watcher.slices.problems, "the cap to be reached")
        assert seen[-1] == first
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.5": True}))  # 10.0.0.6 leaves: room for one
        wait_until(lambda: seen[-1] == {"http://10.0.0.5:8000", "http://10.0.0.1:8000"}, "one to take its place")
    finally:
        watcher.stop()


# -- a router in front of real replicas -------------------------------------------------------------------------------
def _shared_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of ``hosts`` (loopback addresses: the replicas of one slice share its port)."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.create_server((hosts[0], 0)))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    stack.enter_context(socket.create_server((host, port)))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on every loopback address")


HOSTS = ("127.0.0.2", "127.0.0.3")
LOOPBACK = ["127.0.0.0/8"]  # the "pods" here are loopback addresses, which discovery refuses unless told


@pytest.fixture(scope="module")
def pods(tiny_servable_model: Path) -> Iterator[tuple[int, list[ServerProcess]]]:
    """Two replicas as two pods would be: their own address each, the same port."""
    port = _shared_port(HOSTS)
    started: list[ServerProcess] = []
    try:
        for host in HOSTS:
            flags = ("--served-model-name", NAME, "--host", host, "--port", str(port), "--max-model-len", "256")
            started.append(ServerProcess(str(tiny_servable_model), *flags))
        for replica in started:
            replica.wait_ready(timeout=120)
        yield port, started
    finally:
        for replica in started:
            replica.stop()


def test_replicas_join_and_leave_the_router_without_a_failed_request(
    api: FakeAPIServer, pods: tuple[int, list[ServerProcess]]
) -> None:
    port, (first, second) = pods
    a, b = (f"http://{host}:{port}" for host in HOSTS)
    api.put("endpointslices", endpoints_slice(port, {HOSTS[0]: True, HOSTS[1]: False}))
    with running_router([], "round-robin", replicas_from=SERVICE, pod_cidr=LOOPBACK) as router:
        client = Client(router.url)
        assert {replica_of(client.post("/v1/completions", GREEDY)) for _ in range(4)} == {a}

        api.put("endpointslices", endpoints_slice(port, {HOSTS[0]: True, HOSTS[1]: True}))  # b is ready: it joins
        wait_until(lambda: replica_of(client.post("/v1/completions", GREEDY)) == b, "requests to reach b")

        # While requests keep coming, b turns terminating (its pod was deleted) and leaves; no request fails.
        answers: list[int] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                answers.append(Client(router.url).post("/v1/completions", GREEDY).status)

        clients = [threading.Thread(target=load) for _ in range(2)]
        for thread in clients:
            thread.start()
        api.put("endpointslices", endpoints_slice(port, {HOSTS[0]: True, HOSTS[1]: False}))
        wait_until(lambda: [r.url for r in router.router.replicas] == [a], "b to leave the router")
        after = len(answers)
        wait_until(lambda: len(answers) > after + 4, "requests after b left")
        stop.set()
        for thread in clients:
            thread.join(timeout=30)
        assert answers
        assert set(answers) == {200}
        assert {replica_of(client.post("/v1/completions", GREEDY)) for _ in range(4)} == {a}
        assert router_metric(router.url, "preheat_router_membership_changes_total", change="joined") == 2
        assert router_metric(router.url, "preheat_router_membership_changes_total", change="left") == 1
        health = client.get("/health").json()
        assert [r["url"] for r in health["replicas"]] == [a]
    assert first.proc.poll() is None
    assert second.proc.poll() is None


def test_the_router_follows_the_service_through_a_relist_and_an_api_server_restart(
    api: FakeAPIServer, pods: tuple[int, list[ServerProcess]]
) -> None:
    port, _ = pods
    a, b = (f"http://{host}:{port}" for host in HOSTS)
    api.put("endpointslices", endpoints_slice(port, {HOSTS[0]: True}))
    with running_router([], "least-load", replicas_from=SERVICE, pod_cidr=LOOPBACK) as router:
        client = Client(router.url)
        assert replica_of(client.post("/v1/completions", GREEDY)) == a

        api.compact()  # 410 Gone on the resumed watch: the router lists again and finds b
        api.put("endpointslices", endpoints_slice(port, {HOSTS[0]: True, HOSTS[1]: True}))
        wait_until(lambda: {r.url for r in router.router.replicas if r.healthy} == {a, b}, "b, after the relist")

        api.stop()  # while the API server is away the router keeps serving with what it knows
        assert {replica_of(client.post("/v1/completions", GREEDY)) for _ in range(4)} <= {a, b}
        api.put("endpointslices", endpoints_slice(port, {HOSTS[0]: False, HOSTS[1]: True}))
        api.start(api.port)
        wait_until(lambda: [r.url for r in router.router.replicas] == [b], "a to leave, after the restart")
        assert replica_of(client.post("/v1/completions", GREEDY)) == b
    assert api.count("LIST endpointslices") == 2  # the first list and the relist after 410 (a restart resumes)


def test_a_replica_that_leaves_takes_its_kv_index_entries_with_it(
    api: FakeAPIServer, tiny_servable_model: Path
) -> None:
    from preheat.router.index import parse_update

    port = _shared_port(("127.0.0.1",))  # nothing listens there: the replica is known, never in rotation
    url = f"http://127.0.0.1:{port}"
    api.put("endpointslices", endpoints_slice(port, {"127.0.0.1": True}))
    with running_router([], "kv", replicas_from=SERVICE, model=str(tiny_servable_model), pod_cidr=LOOPBACK) as router:
        wait_until(lambda: [r.url for r in router.router.replicas] == [url], "the replica to join")
        snapshot = {"epoch": "e1", "fingerprint": "f" * 32, "chunk_tokens": 16, "seq": 1, "reset": True,
                    "l2_id": None, "l1": ["a" * 32, "b" * 32], "l2": []}  # fmt: skip
        router.kv_index.apply(url, parse_update(snapshot, url))  # what its KV events said while it served
        assert router_metric(router.url, "preheat_router_index_keys", replica=url, index="l1") == 2
        router.router.metrics.routed.inc(replica=url, status="200")  # what its answers counted while it served
        api.delete(*SLICE)
        wait_until(lambda: router.router.replicas == [], "the replica to leave")
        assert router.kv_index.state(url) is None
        assert f'replica="{url}"' not in Client(router.url).get("/metrics").body.decode()  # counters too


def test_in_a_pod_the_service_accounts_token_and_ca_reach_the_api_server(tmp_path: Path) -> None:
    import kubernetes

    from preheat.k8s.client import api_client

    api = FakeAPIServer(tls=True)
    try:
        api.put("endpointslices", endpoints_slice(8000, {"10.0.0.1": True}))
        account = tmp_path / "serviceaccount"
        account.mkdir()
        (account / "token").write_text(TOKEN)
        assert api.ca_pem is not None
        (account / "ca.crt").write_bytes(api.ca_pem)
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
        client = api_client(env, service_account=str(account))
        slices = kubernetes.client.DiscoveryV1Api(client).list_namespaced_endpoint_slice("llm")
        assert [s.metadata.name for s in slices.items if s.metadata] == ["preheat-replicas-7xk2q"]
        assert client.preheat_source == "the pod's service account"
    finally:
        api.stop()


# -- a replica leaving while its health check or KV poll is under way ------------------------------------------------
class _EventsReplica(http.server.ThreadingHTTPServer):
    """A replica's ``/v1/kv/events``: always a snapshot of two L1 keys; counts the polls it answers."""

    def __init__(self) -> None:
        self.polls = 0
        snapshot = {"epoch": "e1", "fingerprint": "f" * 32, "chunk_tokens": 16, "seq": 1, "reset": True,
                    "l2_id": None, "l1": ["a" * 32, "b" * 32], "l2": []}  # fmt: skip
        body = json.dumps(snapshot).encode()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                owner.polls += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_a_replica_that_left_is_not_put_back_by_a_health_check_finishing_late() -> None:
    from preheat.router.upstream import Replica

    replica = Replica("http://127.0.0.1:9", timeout=1.0)
    assert replica.set_healthy(True)
    replica.retire()  # the router's remove_replica, while a health check of it is under way
    assert not replica.set_healthy(True)  # that check passing now changes nothing
    assert not replica.healthy


def test_a_kv_poll_of_a_replica_that_left_adds_no_keys_and_opens_no_connection() -> None:
    from preheat.router.events import KVEventPoller
    from preheat.router.index import KVIndex
    from preheat.router.upstream import Replica

    server = _EventsReplica()
    try:
        replica = Replica(server.url, timeout=2.0)
        index = KVIndex()
        poller = KVEventPoller([replica], index)
        assert poller.poll(replica)
        assert index.state(server.url) is not None  # while it is in the fleet its keys are indexed
        replica.retire()
        poller.remove(replica)
        polls = server.polls
        poller.tick(replica)  # a poll that was about to start when it left
        assert index.state(server.url) is None
        assert server.polls == polls

        class LeavesDuringApply(KVIndex):
            """The removal lands between the poll's answer and its apply (the router's order: retire, forget)."""

            def apply(self, url: str, update: Any, *, finished: int = 0) -> None:  # Any: the index's KVUpdate
                if url == late.url and not late.retired:
                    late.retire()
                    self.forget(url)
                super().apply(url, update, finished=finished)

        late = Replica(server.url, timeout=2.0)
        racy = LeavesDuringApply()
        KVEventPoller([late], racy).poll(late)
        assert racy.state(server.url) is None  # its keys do not outlive its leaving
        poller.stop()
    finally:
        server.shutdown()
        server.server_close()
