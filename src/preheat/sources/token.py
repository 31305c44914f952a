"""Which origins ``PREHEAT_HTTP_TOKEN`` is sent to: only the hosts ``PREHEAT_HTTP_TOKEN_HOSTS`` names, and never
over plain http beyond loopback.

A model URI does not always come from the operator: a standby replica loads what its control route is told (within
``--allow-model``), a router tells standbys what to load. Without a binding, the node's origin credential would go to
whatever host such a URI names, and over plain http to every network hop on the way. So the token is bound to hosts
the operator lists (``HOST`` for every port of it, ``HOST:PORT`` for one; IPv6 as ``[ADDR]:PORT``), and an origin
the list does not name gets no token (a 401/403 there says how to add it). A token set with no list is a
``ConfigError`` at the first http(s) origin: silently sending nothing would look like a wrong token.

Pure but for the two variables read by ``origin_token``; ``token=`` given to ``HTTPOrigin`` (a caller naming the
origin and its credential together, as the peer pull does with the peer token) does not pass here.

>>> token_for("https://models.internal/llama", "s3cret", ("models.internal",))
's3cret'
>>> token_for("https://elsewhere.example/llama", "s3cret", ("models.internal",)) is None
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from preheat.core import env
from preheat.core.errors import ConfigError
from preheat.http.control import is_loopback

HOSTS_HOW = "PREHEAT_HTTP_TOKEN_HOSTS=HOST[:PORT],... (the origins the token is for)"


def matches(entry: str, host: str, port: int | None) -> bool:
    """Whether ``entry`` (``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or a bare IPv6 address) names ``host:port``.

    >>> matches("127.0.0.1:8001", "127.0.0.1", 8001), matches("127.0.0.1:8001", "127.0.0.1", 8002)
    (True, False)
    >>> matches("Models.Internal", "models.internal", 443), matches("[::1]:80", "::1", 80)
    (True, True)
    """
    entry = entry.strip().lower()
    name, wanted = entry, None
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        wanted = rest[1:] if rest.startswith(":") else None
    elif entry.count(":") == 1:
        name, wanted = entry.split(":")
    if name != host.lower():
        return False
    return wanted is None or (wanted.isdigit() and int(wanted) == port)


def token_for(url: str, token: str | None, hosts: Sequence[str]) -> str | None:
    """The token to send to the origin of ``url``: ``token`` when ``hosts`` names it, else None. ``ConfigError`` for
    a token with no hosts at all, and for a named origin reached over plain http beyond loopback."""
    if token is None:
        return None
    if not hosts:
        raise ConfigError(
            f"PREHEAT_HTTP_TOKEN is set, and no host is named for it: set {HOSTS_HOW}, e.g. "
            f"PREHEAT_HTTP_TOKEN_HOSTS={urlsplit(url).netloc or 'models.example.com'}, so that it never goes to a "
            "host a model URI names without you"
        )
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # not a port: no entry names it
        return None
    if not any(matches(entry, host, port) for entry in hosts):
        return None
    if parts.scheme != "https" and not is_loopback(host):
        raise ConfigError(
            f"{url}: PREHEAT_HTTP_TOKEN would cross the network in clear text (plain http to {host}): give the "
            "origin as https://, or take its host out of PREHEAT_HTTP_TOKEN_HOSTS"
        )
    return token


def origin_token(url: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``PREHEAT_HTTP_TOKEN`` for the origin of ``url`` under ``PREHEAT_HTTP_TOKEN_HOSTS`` (``token_for``)."""
    hosts: tuple[str, ...] = env.get(env.HTTP_TOKEN_HOSTS, environ)
    return token_for(url, env.get(env.HTTP_TOKEN, environ), hosts)


def withheld_hint(url: str, environ: Mapping[str, str] | None = None) -> str | None:
    """What to say when an origin refuses a request that went without ``PREHEAT_HTTP_TOKEN`` because its host is
    not listed; None when the token is not set."""
    if env.get(env.HTTP_TOKEN, environ) is None:
        return None
    where = urlsplit(url).netloc
    return f"PREHEAT_HTTP_TOKEN is not sent to {where}: add {where} to PREHEAT_HTTP_TOKEN_HOSTS if it is for it"
