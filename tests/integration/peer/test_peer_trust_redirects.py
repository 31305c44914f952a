"""Credentials and redirects in the HTTP client: the bearer token goes only to its own origin (scheme, host, port).

Real servers on 127.0.0.1 record the ``Authorization`` header of every request they get. Two ports on one host are
two origins; the first server also speaks TLS and plain HTTP on the *same* port, so a redirect that changes only the
scheme (``https://127.0.0.1:P`` -> ``http://127.0.0.1:P``) can be told apart from one that changes the port.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.core.errors import SourceError
from preheat.http.client import Redirects, Timeouts, origin
from preheat.http.pool import Pool
from preheat.sources.http import HTTPOrigin
from preheat.sources.net import NetSettings
from recording import RecordingServer

TOKEN = "s3cret"


@pytest.fixture
def front() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


@pytest.fixture
def other() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREHEAT_HTTP_TOKEN", raising=False)


def quick() -> NetSettings:
    return NetSettings(connect_timeout=5, read_timeout=5, attempts=1, backoff=0.01)


def test_the_token_is_dropped_when_a_redirect_goes_from_https_to_http_on_the_same_host_and_port(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert: tuple[Path, Path] = request.getfixturevalue("certificate")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*cert)
    with RecordingServer(tls=context) as both:
        both.redirects[("https", "/models/tiny/config.json")] = f"http://127.0.0.1:{both.port}/plain/config.json"
        origin = HTTPOrigin(f"https://127.0.0.1:{both.port}/models/tiny", token=TOKEN, settings=quick())
        assert origin.read_bytes("config.json") == b"the file\n"
    assert [(s.scheme, s.path, s.authorization) for s in both.seen] == [
        ("https", "/models/tiny/config.json", f"Bearer {TOKEN}"),
        ("http", "/plain/config.json", None),  # same host and port, but the token would cross the wire in clear
    ]


def test_the_token_is_dropped_when_a_redirect_goes_to_another_port(
    front: RecordingServer, other: RecordingServer
) -> None:
    front.redirects[("http", "/m/config.json")] = f"http://127.0.0.1:{other.port}/m/config.json"
    origin = HTTPOrigin(f"http://127.0.0.1:{front.port}/m", token=TOKEN, settings=quick())
    assert origin.read_bytes("config.json") == b"the file\n"
    assert [s.authorization for s in front.seen] == [f"Bearer {TOKEN}"]
    assert [s.authorization for s in other.seen] == [None]  # host:port is the origin: another port, another server


def test_a_redirect_that_comes_back_to_the_origin_does_not_get_the_token_back(
    front: RecordingServer, other: RecordingServer
) -> None:
    front.redirects[("http", "/m/config.json")] = f"http://127.0.0.1:{other.port}/bounce"
    other.redirects[("http", "/bounce")] = f"http://127.0.0.1:{front.port}/m/back.json"
    origin = HTTPOrigin(f"http://127.0.0.1:{front.port}/m", token=TOKEN, settings=quick())
    assert origin.read_bytes("config.json") == b"the file\n"
    assert [(s.path, s.authorization) for s in front.seen] == [
        ("/m/config.json", f"Bearer {TOKEN}"),
        ("/m/back.json", None),  # the other server chose this URL: it could be anything the token unlocks
    ]
    assert [s.authorization for s in other.seen] == [None]


def test_a_redirect_within_the_origin_keeps_the_token(front: RecordingServer) -> None:
    front.redirects[("http", "/m/config.json")] = "/moved/config.json"  # relative: the same origin
    origin = HTTPOrigin(f"http://127.0.0.1:{front.port}/m", token=TOKEN, settings=quick())
    assert origin.read_bytes("config.json") == b"the file\n"
    assert [s.authorization for s in front.seen] == [f"Bearer {TOKEN}", f"Bearer {TOKEN}"]


def test_credentials_the_caller_sends_stay_behind_on_another_origin(
    front: RecordingServer, other: RecordingServer
) -> None:
    front.redirects[("http", "/x")] = f"http://127.0.0.1:{other.port}/x"
    sent = {"Authorization": "Basic dXNlcjpwdw==", "Cookie": "session=1"}
    response = Pool(Timeouts.within(5.0)).request(
        "GET", f"http://127.0.0.1:{front.port}/x", headers=sent, redirects=Redirects()
    )
    assert response.body.read() == b"the file\n"
    assert [(s.authorization, s.cookie) for s in front.seen] == [("Basic dXNlcjpwdw==", "session=1")]
    assert [(s.authorization, s.cookie) for s in other.seen] == [(None, None)]


def test_a_redirect_to_an_impossible_port_is_a_source_error(front: RecordingServer) -> None:
    front.redirects[("http", "/m/config.json")] = "http://127.0.0.1:99999/m/config.json"
    origin = HTTPOrigin(f"http://127.0.0.1:{front.port}/m", settings=quick())
    with pytest.raises(SourceError, match="port"):
        origin.read_bytes("config.json")


def test_an_empty_token_sends_no_authorization_header(front: RecordingServer) -> None:
    origin = HTTPOrigin(f"http://127.0.0.1:{front.port}/m", token="", settings=quick())  # a tokenless peer
    assert origin.read_bytes("config.json") == b"the file\n"
    assert [s.authorization for s in front.seen] == [None]


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("https://h/x", "https://h:443/y", True),
        ("http://H:80/", "http://h/", True),
        ("https://h/", "http://h/", False),
        ("http://h:8000/", "http://h:8001/", False),
        ("http://h/", "http://g/", False),
    ],
)
def test_an_origin_is_scheme_host_and_port(a: str, b: str, same: bool) -> None:
    assert (origin(a) == origin(b)) is same


def test_a_peer_that_redirects_is_refused_and_the_target_never_contacted(
    front: RecordingServer, other: RecordingServer
) -> None:
    """A peer serves its own checkpoint's files or nothing: a redirect would let it steer pullers to any URL."""
    from preheat.peer.pull import PeerOptions, peer_origin

    front.redirects[("http", "/peer/v1/files/config.json")] = f"http://127.0.0.1:{other.port}/elsewhere.json"
    origin = peer_origin(f"127.0.0.1:{front.port}", PeerOptions(token=TOKEN))
    with pytest.raises(SourceError, match="follows none"):
        origin.read_bytes("config.json")
    assert [s.path for s in front.seen] == ["/peer/v1/files/config.json"]
    assert other.seen == []
