"""Which hosts ``PREHEAT_HTTP_TOKEN`` is for (``preheat.sources.token``): pure, no server."""

from __future__ import annotations

import pytest

from preheat.core.errors import ConfigError
from preheat.sources.token import matches, origin_token, token_for


@pytest.mark.parametrize(
    ("entry", "host", "port", "named"),
    [
        ("models.internal", "models.internal", 443, True),
        ("MODELS.internal", "models.internal", 8443, True),  # a host alone: every port of it
        ("models.internal:8443", "models.internal", 8443, True),
        ("models.internal:8443", "models.internal", 443, False),
        ("models.internal", "evil-models.internal", 443, False),  # no suffix matching
        ("internal", "models.internal", 443, False),
        ("[::1]:8000", "::1", 8000, True),
        ("[::1]:8000", "::1", 8001, False),
        ("::1", "::1", 8001, True),  # a bare IPv6 address: every port
        ("10.0.0.7:x", "10.0.0.7", 80, False),  # not a port: names nothing
    ],
)
def test_an_entry_names_a_host_and_maybe_one_port(entry: str, host: str, port: int, named: bool) -> None:
    assert matches(entry, host, port) is named


def test_the_scheme_gives_the_port_an_entry_is_compared_with() -> None:
    assert token_for("https://models.internal/m", "t", ("models.internal:443",)) == "t"
    assert token_for("https://models.internal:8443/m", "t", ("models.internal:443",)) is None
    assert token_for("http://127.0.0.1/m", "t", ("127.0.0.1:80",)) == "t"  # loopback: plain http is fine


def test_no_token_is_never_an_error_and_a_token_needs_its_hosts() -> None:
    assert origin_token("http://10.0.0.7/m", {}) is None
    assert origin_token("http://10.0.0.7/m", {"PREHEAT_HTTP_TOKEN_HOSTS": "10.0.0.7"}) is None
    with pytest.raises(ConfigError, match="no host is named"):
        origin_token("https://models.internal/m", {"PREHEAT_HTTP_TOKEN": "t"})
    with pytest.raises(ConfigError, match="clear text"):
        origin_token("http://[fd00::7]:80/m", {"PREHEAT_HTTP_TOKEN": "t", "PREHEAT_HTTP_TOKEN_HOSTS": "[fd00::7]:80"})
