"""TLS on every preheat listener (docs/security.md, *TLS*): ``preheat serve``'s API, the router (and the router
dialling https replicas), the peer server and the refit server, with certificates made here; mutual TLS on the
listeners that serve weights to other replicas refuses a client without the fleet's certificate before it reads a
request. Real processes and servers on 127.0.0.1; this process speaks to them through preheat's own client, with
the fleet's TLS set as a command would set it (``preheat.http.tls.use_fleet``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers import SeedPeer, write_peer_checkpoint
from preheat.core.errors import ConfigError, HTTPClientError
from preheat.core.procs import Child
from preheat.http.client import Timeouts, request
from preheat.http.tls import TLSFiles, use_fleet
from preheat.peer.pull import PeerOptions, pull_from_peers
from preheat.peer.server import INFO_ROUTE as PEER_INFO
from preheat.refit.protocol import VersionManifest
from preheat.refit.server import INFO_ROUTE as REFIT_INFO
from preheat.refit.server import RefitServer
from preheat.router.cluster import ServerProcess
from preheat.store.cache import ModelCache
from preheat.testing.certs import self_signed_certificate
from routing import wait_until

TIMEOUTS = Timeouts.within(30.0)
ONE_TOKEN = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
JSON = {"Content-Type": "application/json"}


def certificate(directory: Path) -> TLSFiles:
    """A node's certificate for 127.0.0.1, its own CA: the fleet's CA file is the certificate itself."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = self_signed_certificate(str(directory))
    return TLSFiles(cert, key, cert)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return certificate(tmp_path_factory.mktemp("node"))


@pytest.fixture
def fleet(node: TLSFiles) -> Iterator[TLSFiles]:
    """This process as a member of the fleet: https to its listeners, its certificate offered when asked."""
    use_fleet(node)
    yield node
    use_fleet(None)


def flags(files: TLSFiles) -> list[str]:
    assert files.certfile is not None
    assert files.keyfile is not None
    return ["--ssl-certfile", files.certfile, "--ssl-keyfile", files.keyfile]


@pytest.fixture(scope="module")
def tls_replica(tiny_servable_model: Path, node: TLSFiles) -> Iterator[ServerProcess]:
    """``preheat serve`` with a certificate: its API speaks https only."""
    replica = ServerProcess(str(tiny_servable_model), "--served-model-name", "tiny", *flags(node))
    try:
        use_fleet(node)  # wait_ready asks /health over https
        replica.wait_ready(timeout=120)
    finally:
        use_fleet(None)
    with replica:
        yield replica


def test_serve_answers_completions_over_https_only(tls_replica: ServerProcess, fleet: TLSFiles) -> None:
    assert tls_replica.url.startswith("https://127.0.0.1:")  # the listening line says so, and parents dial it
    answer = request(tls_replica.url + "/v1/completions", "POST", body=ONE_TOKEN, headers=JSON, timeouts=TIMEOUTS)
    plain = tls_replica.url.replace("https://", "http://") + "/health"
    with pytest.raises(HTTPClientError):  # a plain-http request is not read as one: the handshake fails
        request(plain, timeouts=TIMEOUTS)
    use_fleet(None)  # the system's CAs only: the self-signed certificate is not trusted
    with pytest.raises(HTTPClientError, match="certificate verify failed"):
        request(tls_replica.url + "/health", timeouts=TIMEOUTS)
    assert answer.status == 200
    assert json.loads(answer.body)["usage"]["completion_tokens"] == 1


def test_the_router_serves_https_and_routes_to_an_https_replica(
    tls_replica: ServerProcess, node: TLSFiles, fleet: TLSFiles
) -> None:
    assert node.ca_certs is not None
    router_flags = ["--replica", tls_replica.url, "--port", "0", *flags(node), "--ssl-ca-certs", node.ca_certs]
    with Child("preheat router", ["router", *router_flags]) as router:
        url = router.wait_address(60)

        def healthy() -> bool:
            answer = request(url + "/health", timeouts=TIMEOUTS, max_body=1 << 20)
            return answer.status == 200 and json.loads(answer.body)["replicas"][0]["healthy"] is True

        wait_until(healthy, "the router to find its https replica healthy")
        answer = request(url + "/v1/completions", "POST", body=ONE_TOKEN, headers=JSON, timeouts=TIMEOUTS)
    assert url.startswith("https://")
    assert answer.status == 200
    assert answer.headers["X-Preheat-Replica"] == tls_replica.url


def test_a_router_without_the_fleets_ca_finds_an_https_replica_down(tls_replica: ServerProcess) -> None:
    with Child("preheat router", ["router", "--replica", tls_replica.url, "--port", "0"]) as router:
        url = router.wait_address(60)
        health = json.loads(request(url + "/health", timeouts=TIMEOUTS).body)
    assert url.startswith("http://")
    assert health["replicas"][0]["healthy"] is False  # its certificate was not trusted: never routed to


def test_a_seed_peer_serves_https_with_mutual_tls(
    tmp_path: Path, node: TLSFiles, fleet: TLSFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PREHEAT_PEER_TOKEN", "PREHEAT_REGISTRY", "PREHEAT_ORIGIN", "PREHEAT_PEERS"):
        monkeypatch.delenv(name, raising=False)
    root = write_peer_checkpoint(tmp_path / "ckpt")
    stranger = certificate(tmp_path / "stranger")  # a certificate the fleet's CA did not sign
    assert node.ca_certs is not None
    with SeedPeer(root, *flags(node), "--ssl-ca-certs", node.ca_certs) as peer:
        member = request(f"https://{peer.address}{PEER_INFO}", timeouts=TIMEOUTS)
        cache = ModelCache(str(tmp_path / "cache"))
        identity = json.loads(member.body)["identity"]
        result = pull_from_peers(f"preheat://{identity}", cache, PeerOptions(peers=(peer.address,)))
        # Refused in the handshake: an alert, or the connection closed before it is read (the timing decides).
        use_fleet(TLSFiles(ca_certs=node.ca_certs))  # trusts the peer, offers no certificate
        with pytest.raises(HTTPClientError, match=r"certificate required|EOF"):
            request(f"https://{peer.address}{PEER_INFO}", timeouts=TIMEOUTS)
        use_fleet(TLSFiles(stranger.certfile, stranger.keyfile, node.ca_certs))  # offers one of another CA
        with pytest.raises(HTTPClientError, match=r"unknown ca|EOF"):
            request(f"https://{peer.address}{PEER_INFO}", timeouts=TIMEOUTS)
    assert member.status == 200
    assert set(result.sources) == {f"peer {peer.address}"}  # every byte came over the peer's https


def test_a_seed_peer_refuses_to_start_on_a_certificate_it_cannot_load(tmp_path: Path) -> None:
    root = write_peer_checkpoint(tmp_path / "ckpt")
    missing = str(tmp_path / "missing.pem")
    command = [sys.executable, "-m", "preheat.peer", str(root), "--ssl-certfile", missing]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "missing.pem" in done.stderr
    assert "cannot load the certificate" in done.stderr


class _Empty:
    """A refit holder with no versions: enough to ask its info route."""

    name = "tiny"

    def versions(self) -> list[int]:
        return []

    def manifest(self, version: int) -> VersionManifest | None:
        return None

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        return None


def test_the_refit_server_serves_members_only_with_mutual_tls(node: TLSFiles, fleet: TLSFiles) -> None:
    assert node.ca_certs is not None
    with RefitServer(_Empty(), tls=node.listener(peers=True)) as server:
        member = request(f"https://{server.address}{REFIT_INFO}", timeouts=TIMEOUTS)
        use_fleet(TLSFiles(ca_certs=node.ca_certs))  # no client certificate
        with pytest.raises(HTTPClientError, match=r"certificate required|EOF"):
            request(f"https://{server.address}{REFIT_INFO}", timeouts=TIMEOUTS)
    assert member.status == 200
    assert json.loads(member.body)["name"] == "tiny"


def test_tls_files_that_cannot_work_are_refused_before_anything_listens(tmp_path: Path, node: TLSFiles) -> None:
    with pytest.raises(ConfigError, match=r"nope\.pem"):
        TLSFiles(str(tmp_path / "nope.pem")).check()
    with pytest.raises(ConfigError, match="--ssl-keyfile without --ssl-certfile"):
        TLSFiles(keyfile=node.keyfile).check()
    with pytest.raises(ConfigError, match="offers none itself"):
        TLSFiles(ca_certs=node.ca_certs).check()
    TLSFiles(ca_certs=node.ca_certs).check(ca_alone=True)  # a router that only verifies its replicas
    with pytest.raises(ConfigError, match="cannot load the certificate"):
        TLSFiles(node.certfile, node.ca_certs).check()  # a certificate given as its own key
