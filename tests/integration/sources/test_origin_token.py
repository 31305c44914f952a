"""``PREHEAT_HTTP_TOKEN`` goes only to the origins ``PREHEAT_HTTP_TOKEN_HOSTS`` names, never over plain http beyond
loopback (docs/security.md): two real origins on 127.0.0.1 that both require the token, one named and one not."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.errors import ConfigError, SourceAccessError
from preheat.sources.http import HTTPOrigin
from preheat.testing.fileserver import FileServer

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, single_checkpoint: WrittenCheckpoint) -> Path:
    root = tmp_path_factory.mktemp("origin")
    shutil.copytree(single_checkpoint.root, root / "single")
    (root / "single" / MANIFEST_NAME).write_bytes(build_manifest(str(root / "single")).to_json())
    return root


@pytest.fixture
def origins(served: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FileServer, FileServer]]:
    """Two origins requiring the token; the first is the one ``PREHEAT_HTTP_TOKEN_HOSTS`` names (by port)."""
    with FileServer(served, token=TOKEN) as named, FileServer(served, token=TOKEN) as other:
        monkeypatch.setenv("PREHEAT_HTTP_TOKEN", TOKEN)
        monkeypatch.setenv("PREHEAT_HTTP_TOKEN_HOSTS", f"127.0.0.1:{named.port}")
        yield named, other


def test_the_token_reaches_the_named_origin_only(
    origins: tuple[FileServer, FileServer], single_checkpoint: WrittenCheckpoint
) -> None:
    named, other = origins
    loaded = preheat.load(named.url_for("single"))
    with pytest.raises(SourceAccessError, match=r"not sent to 127\.0\.0\.1") as refused:
        preheat.load(other.url_for("single"))
    assert_same_tensors(loaded, single_checkpoint.tensors)
    assert 401 not in named.stats.snapshot().statuses  # every request there carried the token
    assert set(other.stats.snapshot().statuses) == {401}  # none there did: the origin never saw it
    assert "PREHEAT_HTTP_TOKEN_HOSTS" in str(refused.value)  # and the error says how to name it


def test_a_host_named_without_a_port_gets_the_token_on_every_port(
    origins: tuple[FileServer, FileServer], single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN_HOSTS", "localhost, 127.0.0.1")
    _, other = origins
    assert_same_tensors(preheat.load(other.url_for("single")), single_checkpoint.tensors)


def test_a_token_with_no_host_named_is_a_clear_error(
    origins: tuple[FileServer, FileServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREHEAT_HTTP_TOKEN_HOSTS")
    named, _ = origins
    with pytest.raises(ConfigError, match="PREHEAT_HTTP_TOKEN_HOSTS"):
        preheat.load(named.url_for("single"))
    assert named.stats.snapshot().statuses == {}  # refused before a request left


def test_the_token_is_refused_over_plain_http_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", TOKEN)
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN_HOSTS", "models.internal,10.0.0.7")
    with pytest.raises(ConfigError, match="clear text"):
        HTTPOrigin("http://models.internal/llama")
    with pytest.raises(ConfigError, match="clear text"):
        HTTPOrigin("http://10.0.0.7:8000/llama")
    HTTPOrigin("https://models.internal/llama")  # the same host over https: the token may go
    HTTPOrigin("http://elsewhere.example/llama")  # a host not named: nothing would be sent, nothing refused


def test_an_explicit_token_is_the_callers_choice_of_origin(
    origins: tuple[FileServer, FileServer], single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREHEAT_HTTP_TOKEN")
    _, other = origins
    origin = HTTPOrigin(other.url_for("single"), token=TOKEN)  # named with its origin: no host list applies
    assert origin.read_bytes(MANIFEST_NAME) == (Path(other.root) / "single" / MANIFEST_NAME).read_bytes()
