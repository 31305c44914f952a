"""Fixtures shared by the integration tests of several packages (store/, peer/, sources/, ...); those of one package
live in its folder's conftest.py, those of the whole suite in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifactkit import KeyPair, make_keypair
from preheat.store.cache import ModelCache
from preheat.testing.certs import self_signed_certificate


@pytest.fixture
def cache(tmp_path: Path) -> ModelCache:
    """An empty node cache of this test's own."""
    return ModelCache(tmp_path / "cache")


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files): a TLS server loads both, and a client
    trusts the certificate by naming it (``SSL_CERT_FILE``)."""
    cert, key = self_signed_certificate(str(tmp_path_factory.mktemp("tls")))
    return Path(cert), Path(key)


@pytest.fixture(scope="session")
def fleet_key(tmp_path_factory: pytest.TempPathFactory) -> KeyPair:
    """The fleet's signing key pair for compiled artifacts (``fleet.key`` and its public half); read-only."""
    return make_keypair(tmp_path_factory.mktemp("keys"), "fleet.key")
