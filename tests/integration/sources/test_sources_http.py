"""``preheat.load("http://...")`` against a real server (``FileServer``) on 127.0.0.1, healthy and misbehaving."""

from __future__ import annotations

import http.server
import random
import shutil
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.errors import CheckpointError, SourceAccessError, SourceError, SourceNotFoundError
from preheat.http.ranges import parse_content_range, range_header
from preheat.sources import open_origin
from preheat.sources.http import HTTPOrigin
from preheat.sources.net import NetSettings
from preheat.sources.stats import TOTALS, TransferCounts
from preheat.testing.fileserver import Faults, FileServer

MiB = 1 << 20


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    single_checkpoint: WrittenCheckpoint,
    sharded_checkpoint: WrittenCheckpoint,
    wide_checkpoint: WrittenCheckpoint,
) -> Path:
    """A directory holding copies of the shared checkpoints as ``single/``, ``sharded/`` and ``wide/``. ``single`` and
    ``wide`` carry a ``preheat.json`` (remote loads are checked against it); ``sharded`` is a plain Hugging Face
    directory, found through its index, so its loads pass ``verify=False``."""
    root = tmp_path_factory.mktemp("origin")
    for name, written in (("single", single_checkpoint), ("sharded", sharded_checkpoint), ("wide", wide_checkpoint)):
        shutil.copytree(written.root, root / name)
        if name != "sharded":
            (root / name / MANIFEST_NAME).write_bytes(build_manifest(str(root / name)).to_json())
    return root


@pytest.fixture
def server(served: Path) -> Iterator[FileServer]:
    """A well-behaved server; tests that inject faults set ``server.faults`` fields."""
    with FileServer(served) as running:
        yield running


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PREHEAT_HTTP_TOKEN", "PREHEAT_HTTP_TIMEOUT", "PREHEAT_HTTP_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN_HOSTS", "127.0.0.1")  # the origin token is for this host's origins


def transferred(before: TransferCounts) -> TransferCounts:
    return TOTALS.snapshot() - before


# -- loads equal the local load ---------------------------------------------------------------------------------------


def test_single_file_checkpoint_over_http_equals_written(
    server: FileServer, single_checkpoint: WrittenCheckpoint
) -> None:
    weights = preheat.load(server.url_for("single"))
    assert_same_tensors(weights, single_checkpoint.tensors)
    assert weights.report.mode == "read"


def test_sharded_checkpoint_over_http_equals_written(server: FileServer, sharded_checkpoint: WrittenCheckpoint) -> None:
    assert_same_tensors(preheat.load(server.url_for("sharded") + "/", verify=False), sharded_checkpoint.tensors)


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_tp_rank_over_http_equals_local_rank(server: FileServer, served: Path, name: str) -> None:
    for rank in range(2):
        remote = preheat.load(server.url_for(name), rank=rank, world_size=2, verify=False)  # slices: no digests
        local = preheat.load(served / name, mode="read", rank=rank, world_size=2)
        assert_same_tensors(remote, local)


def test_tp_rank_fetches_fewer_bytes_than_the_whole_file(
    server: FileServer, wide_checkpoint: WrittenCheckpoint
) -> None:
    before = TOTALS.snapshot()
    preheat.load(server.url_for("wide"), rank=1, world_size=2, verify=False)
    assert transferred(before).bytes < 0.75 * wide_checkpoint.single_file.stat().st_size


def test_remote_sources_refuse_mmap(server: FileServer) -> None:
    with pytest.raises(preheat.ConfigError, match="remote"):
        preheat.load(server.url_for("single"), mode="mmap")


# -- not found and access denied --------------------------------------------------------------------------------------


def test_missing_checkpoint_names_the_url(server: FileServer) -> None:
    url = server.url_for("no-such-model")
    with pytest.raises(CheckpointError, match=url):
        preheat.load(url)


def test_missing_shard_named_in_the_index_is_not_found(tmp_path: Path, sharded_checkpoint: WrittenCheckpoint) -> None:
    shutil.copytree(sharded_checkpoint.root, tmp_path / "model")
    shard = sorted((tmp_path / "model").glob("*-of-*.safetensors"))[1]
    shard.unlink()
    with FileServer(tmp_path) as server, pytest.raises(SourceNotFoundError) as caught:
        preheat.load(server.url_for("model"))
    assert server.url_for(f"model/{shard.name}") in str(caught.value)
    assert "404" in str(caught.value)


def test_exists_is_false_for_404_and_read_bytes_names_the_url(server: FileServer) -> None:
    origin = HTTPOrigin(server.url_for("single"))
    assert origin.exists("model.safetensors")
    assert not origin.exists("no-such.json")
    with pytest.raises(SourceNotFoundError, match=r"single/missing\.json.*404"):
        origin.read_bytes("missing.json")
    with pytest.raises(SourceNotFoundError, match=r"nothing\.safetensors"):
        origin.open("nothing.safetensors").size()


def test_token_required_is_access_denied_with_a_hint(served: Path) -> None:
    with FileServer(served, token="s3cret") as server, pytest.raises(SourceAccessError) as caught:
        preheat.load(server.url_for("single"))
    message = str(caught.value)
    assert server.url_for("single") in message
    assert "401" in message
    assert "PREHEAT_HTTP_TOKEN" in message


def test_wrong_token_is_access_denied(served: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", "guess")
    with FileServer(served, token="s3cret") as server, pytest.raises(SourceAccessError, match=r"403.*refused"):
        preheat.load(server.url_for("single"))


def test_right_token_from_the_environment_loads(
    served: Path, single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", "s3cret")
    with FileServer(served, token="s3cret") as server:
        assert_same_tensors(preheat.load(server.url_for("single")), single_checkpoint.tensors)


# -- dropped connections, failing and dead servers --------------------------------------------------------------------


def test_connection_dropped_mid_file_is_resumed(server: FileServer, wide_checkpoint: WrittenCheckpoint) -> None:
    url = server.url_for("wide")
    before = TOTALS.snapshot()
    preheat.load(url, threads=1, chunk_bytes=4 * MiB)
    clean = transferred(before)

    server.faults.drop_after_bytes = 1 * MiB  # only the 4 MiB data reads are longer than that
    before = TOTALS.snapshot()
    weights = preheat.load(url, threads=1, chunk_bytes=4 * MiB)
    dropped = transferred(before)

    assert_same_tensors(weights, wide_checkpoint.tensors)
    assert server.stats.snapshot().drops == 1
    assert dropped.retries == 1
    # Resumed, not restarted: the retry asked only for the bytes that had not arrived.
    assert dropped.bytes == clean.bytes


def test_connection_dropped_on_every_response_still_finishes(
    server: FileServer, wide_checkpoint: WrittenCheckpoint
) -> None:
    server.faults.drop_after_bytes, server.faults.drop_times = 512 * 1024, None
    before = TOTALS.snapshot()
    weights = preheat.load(server.url_for("wide"), chunk_bytes=2 * MiB)
    assert_same_tensors(weights, wide_checkpoint.tensors)
    assert transferred(before).retries >= 10


def test_server_errors_are_retried(server: FileServer, single_checkpoint: WrittenCheckpoint) -> None:
    server.faults.fail_status, server.faults.fail_times = 503, 2
    before = TOTALS.snapshot()
    assert_same_tensors(preheat.load(server.url_for("single")), single_checkpoint.tensors)
    assert transferred(before).retries == 2


def test_server_that_keeps_failing_gives_up_naming_the_url(server: FileServer) -> None:
    server.faults.fail_status, server.faults.fail_times = 500, None
    with pytest.raises(SourceError, match=r"HTTP 500.*gave up after 4 attempts") as caught:
        preheat.load(server.url_for("single"))
    assert server.url_for("single") in str(caught.value)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_dead_server_fails_with_source_error() -> None:
    url = f"http://127.0.0.1:{closed_port()}/model"
    with pytest.raises(SourceError, match="connection refused") as caught:
        preheat.load(url)
    assert url in str(caught.value)


def test_stalled_server_times_out(served: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TIMEOUT", "0.2")
    monkeypatch.setenv("PREHEAT_HTTP_RETRIES", "2")
    with FileServer(served, faults=Faults(stall=True)) as server, pytest.raises(SourceError, match="timed out"):
        preheat.load(server.url_for("single"))


# -- servers that ignore Range, and servers that lie ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "sharded", "wide"])
def test_server_ignoring_range_still_yields_exact_tensors(
    served: Path, name: str, request: pytest.FixtureRequest
) -> None:
    written: WrittenCheckpoint = request.getfixturevalue(f"{name}_checkpoint")
    with FileServer(served, faults=Faults(ignore_range=True)) as server:
        weights = preheat.load(server.url_for(name), chunk_bytes=1 * MiB, verify=name != "sharded")
        assert_same_tensors(weights, written.tensors)
        assert 206 not in server.stats.snapshot().statuses


def test_server_ignoring_range_serves_tp_ranks_exactly(served: Path) -> None:
    with FileServer(served, faults=Faults(ignore_range=True)) as server:
        for rank in range(2):
            remote = preheat.load(server.url_for("wide"), rank=rank, world_size=2, verify=False)
            assert_same_tensors(remote, preheat.load(served / "wide", mode="read", rank=rank, world_size=2))


def test_range_ignoring_is_detected_and_remembered_per_origin(served: Path) -> None:
    with FileServer(served, faults=Faults(ignore_range=True)) as server:
        origin = HTTPOrigin(server.url_for("single"))
        source = origin.open("model.safetensors")
        want = (served / "single" / "model.safetensors").read_bytes()
        buf = bytearray(1000)
        assert source.readv(5000, [memoryview(buf)]) == 1000
        assert bytes(buf) == want[5000:6000]
        assert origin.ignores_range
        source.close()


def test_wrong_content_range_is_refused(server: FileServer) -> None:
    server.faults.shift_range = 1
    with pytest.raises(SourceError, match="Content-Range"):
        preheat.load(server.url_for("single"))


# -- the source itself ------------------------------------------------------------------------------------------------


def test_readv_fills_several_buffers_and_stops_at_end_of_file(server: FileServer, served: Path) -> None:
    want = (served / "single" / "model.safetensors").read_bytes()
    source = HTTPOrigin(server.url_for("single")).open("model.safetensors")
    a, b = bytearray(100), bytearray(300)
    assert source.readv(len(want) - 250, [memoryview(a), memoryview(bytearray()), memoryview(b)]) == 250
    assert bytes(a) + bytes(b[:150]) == want[-250:]
    assert source.readv(len(want), [memoryview(a)]) == 0
    assert source.size() == len(want)
    source.close()


def test_readv_from_many_threads_returns_the_right_bytes(server: FileServer, served: Path) -> None:
    want = (served / "wide" / "model.safetensors").read_bytes()
    origin = HTTPOrigin(server.url_for("wide"))
    source = origin.open("model.safetensors")
    rng = random.Random(7)
    spans = [(rng.randrange(len(want)), rng.randrange(1, 300_000)) for _ in range(64)]
    errors: list[str] = []

    def check(offset: int, length: int) -> None:
        buf = bytearray(length)
        got = source.readv(offset, [memoryview(buf)])
        if bytes(buf[:got]) != want[offset : offset + length]:
            errors.append(f"{offset}+{length}")

    threads = [threading.Thread(target=check, args=span) for span in spans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    source.close()
    origin.close()
    assert errors == []
    assert origin.stats.snapshot().retries == 0


def test_open_origin_dispatches_http_urls(server: FileServer) -> None:
    assert isinstance(open_origin(server.url_for("single")), HTTPOrigin)


class _Redirect(http.server.BaseHTTPRequestHandler):
    target = ""

    def do_HEAD(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.target + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.do_HEAD()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def redirector() -> Iterator[tuple[http.server.HTTPServer, type[_Redirect]]]:
    handler = type("Redirect", (_Redirect,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


def test_redirects_are_followed(
    served: Path, single_checkpoint: WrittenCheckpoint, redirector: tuple[http.server.HTTPServer, type[_Redirect]]
) -> None:
    front, handler = redirector
    with FileServer(served) as server:
        handler.target = server.url
        url = f"http://127.0.0.1:{front.server_address[1]}/single"
        assert_same_tensors(preheat.load(url), single_checkpoint.tensors)


def test_token_is_not_sent_to_another_host_after_a_redirect(
    served: Path, monkeypatch: pytest.MonkeyPatch, redirector: tuple[http.server.HTTPServer, type[_Redirect]]
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", "s3cret")
    front, handler = redirector
    with FileServer(served, token="s3cret") as server:
        handler.target = server.url  # another port: another origin, which must not see our token
        with pytest.raises(SourceAccessError, match="401"):
            preheat.load(f"http://127.0.0.1:{front.server_address[1]}/single")


# -- HTTPS ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def tls_server(served: Path, certificate: tuple[Path, Path]) -> Iterator[FileServer]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    with FileServer(served, tls=context) as running:
        yield running


def test_https_with_a_trusted_certificate_loads(
    tls_server: FileServer,
    certificate: tuple[Path, Path],
    sharded_checkpoint: WrittenCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    assert tls_server.url.startswith("https://")
    assert_same_tensors(preheat.load(tls_server.url_for("sharded"), verify=False), sharded_checkpoint.tensors)


def test_https_with_an_unknown_certificate_is_refused_at_once(
    tls_server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    before = TOTALS.snapshot()
    with pytest.raises(SourceError, match=r"certificate rejected.*SSL_CERT_FILE"):
        preheat.load(tls_server.url_for("single"))
    assert transferred(before).retries == 0


# -- settings and pure parts ------------------------------------------------------------------------------------------


def test_timeout_and_retry_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TIMEOUT", "5,60")
    monkeypatch.setenv("PREHEAT_HTTP_RETRIES", "2")
    assert NetSettings.from_env() == NetSettings(connect_timeout=5, read_timeout=60, attempts=2)
    monkeypatch.setenv("PREHEAT_HTTP_TIMEOUT", "3")
    assert (NetSettings.from_env().connect_timeout, NetSettings.from_env().read_timeout) == (3, 3)
    monkeypatch.setenv("PREHEAT_HTTP_TIMEOUT", "soon")
    with pytest.raises(preheat.ConfigError, match="PREHEAT_HTTP_TIMEOUT"):
        NetSettings.from_env()


def test_origin_urls_are_validated() -> None:
    with pytest.raises(preheat.ConfigError, match="query"):
        HTTPOrigin("http://host/model?x=1")
    with pytest.raises(preheat.ConfigError, match="plain relative"):
        HTTPOrigin("http://host/model").join("../etc/passwd")


@given(st.integers(0, 2**50), st.integers(0, 2**20), st.integers(0, 2**20))
def test_content_range_round_trips(first: int, length: int, extra: int) -> None:
    last = first + length
    parsed = parse_content_range(f"bytes {first}-{last}/{last + 1 + extra}")
    assert parsed is not None
    assert (parsed.first, parsed.last, parsed.total) == (first, last, last + 1 + extra)
    assert range_header(first, last) == f"bytes={first}-{last}"


@pytest.mark.parametrize("value", [None, "", "bytes 5-3/10", "items 0-1/2", "bytes 0-1/x", "bytes=0-1"])
def test_malformed_content_range_is_none(value: str | None) -> None:
    assert parse_content_range(value) is None


def test_unknown_total_content_range() -> None:
    parsed = parse_content_range("bytes */42")
    assert parsed is not None
    assert (parsed.first, parsed.last, parsed.total) == (None, None, 42)
