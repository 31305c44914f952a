"""Which storage keeps a KV L2 or blob store, chosen by its URL's scheme: the one place ``fs://`` and ``redis://``
are told apart (the shape of LMCache's connector registry and vLLM's connector factory table).

Each ``Backend`` says what its URLs look like (``check``: pure, no import), what start-up makes before any model loads
(``prepare``), whether it takes a quota, and which functions open it and list its namespaces, as ``"module:name"``
strings imported on first use: checking ``--kv-l2`` imports neither redis-py nor torch, and opening an ``fs://`` L2
never imports redis-py. Callers ask this module (``check_url``, ``prepare``, ``open_l2``, ``list_namespaces``) and
never compare schemes themselves; a new kind of storage is one entry in ``BACKENDS``.

>>> backend_for("redis://kv:6379/0").scheme, quota_refusal("fs:///shared/kv"), quota_schemes()
('redis', None, 'fs://')
>>> backend_for("s3://bucket/kv")
Traceback (most recent call last):
...
preheat.core.errors.ConfigError: 's3://bucket/kv': unknown scheme 's3'; use fs:///shared/kv, redis://host:6379/0 or rediss://host:6380/0
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast
from urllib.parse import parse_qs, urlsplit

from preheat.core.errors import ConfigError
from preheat.kv.fileio import make_root

if TYPE_CHECKING:  # types only: the tiers import torch, and --kv-l2 is checked before torch is imported
    from preheat.kv import chunkfile
    from preheat.kv.tier import EvictHook, SharedTier

# What a redis(s):// URL may say in its query (redis-py passes the rest to its connection, which would fail late).
REDIS_QUERY = (
    "db", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
)
_FS = "fs://"


class Opener(Protocol):
    """What a backend's ``opener`` is: the storage at ``url`` for values ``expect`` describes. An unreachable one
    comes back marked down, never raising; ``max_bytes`` reaches only backends that take a quota, ``ttl_s`` (None:
    the backend's default) only those that expire values."""

    def __call__(
        self,
        url: str,
        expect: chunkfile.AnyExpect,
        *,
        max_bytes: int | None,
        ttl_s: int | None,
        on_evict: EvictHook | None,
    ) -> SharedTier: ...


Namespaces = list[tuple[str, "dict[str, object] | None"]]  # (namespace id, its description or None)
Lister = Callable[[str], Namespaces]


@dataclass(frozen=True)
class Backend:
    """One kind of shared KV storage, named by its URL scheme."""

    scheme: str  # "fs": URLs start with "fs://"
    example: str  # a URL to show in errors: "fs:///shared/kv"
    opener: str  # "module:function", an ``Opener``; imported on first use
    lister: str  # "module:function": the namespaces stored at a URL (``preheat kv ls``); imported on first use
    check: Callable[[str], str | None]  # what is wrong with a URL of this scheme (no password in it), or None
    no_quota: str | None = None  # why ``max_bytes`` does not apply here; None: it does
    prepare: Callable[[str], None] | None = None  # what start-up makes before a model loads (fs: the directory)


def fs_root(url: str) -> str:
    """The directory of an ``fs://`` URL, as given: ``fs:///shared/kv`` -> ``/shared/kv``."""
    return url[len(_FS) :]


def _check_fs(url: str) -> str | None:
    if not fs_root(url).startswith("/"):
        return f"{url!r}: an fs:// URL takes an absolute path (fs:///shared/kv)"
    return None


def _prepare_fs(url: str) -> None:
    make_root(os.path.abspath(fs_root(url)))


def _check_redis(url: str) -> str | None:
    """What redis-py would only reject at its first command. Never repeats the password."""
    parts = urlsplit(url)
    shown = f"{parts.scheme}://{parts.hostname or ''}..."
    try:
        parts.port  # noqa: B018  # the property raises ValueError for a port that is not a number in range
    except ValueError:
        return f"{shown}: the port is not a number from 0 to 65535"
    if not parts.hostname:
        return f"{shown}: no host (redis://[user:password@]host:port/db)"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"{shown}: the database {db!r} is not a number (redis://host:port/0)"
    for name in parse_qs(parts.query):
        if name not in REDIS_QUERY:
            return f"{shown}: unknown option {name!r} (known: {', '.join(REDIS_QUERY)})"
        if name.startswith("ssl_") and parts.scheme != "rediss":
            return f"{shown}: {name} is a TLS option: use rediss://"
    return None


_REDIS_QUOTA = "Redis uses its own maxmemory and LRU policy"
BACKENDS: dict[str, Backend] = {
    backend.scheme: backend
    for backend in (
        Backend("fs", "fs:///shared/kv", "preheat.kv.fs:open_url", "preheat.kv.namespace:list_fs", _check_fs,
                prepare=_prepare_fs),
        Backend("redis", "redis://host:6379/0", "preheat.kv.redis_tier:open_url", "preheat.kv.namespace:list_redis",
                _check_redis, no_quota=_REDIS_QUOTA),
        Backend("rediss", "rediss://host:6380/0", "preheat.kv.redis_tier:open_url",
                "preheat.kv.namespace:list_redis", _check_redis, no_quota=_REDIS_QUOTA),
    )
}


def _label(flag: str | None) -> str:
    return f"{flag} " if flag else ""


def backend_for(url: str, flag: str | None = None) -> Backend:
    """The backend of ``url``'s scheme; ``ConfigError`` naming every known scheme for any other (``flag``, such as
    ``--kv-l2``, starts the message). The message never repeats a password."""
    scheme, sep, _ = url.partition("://")
    backend = BACKENDS.get(scheme) if sep else None
    if backend is None:
        shown = url.rsplit("@", maxsplit=1)[-1]
        *first, last = (b.example for b in BACKENDS.values())
        what = f"unknown scheme {scheme!r}" if sep else "not a URL"
        raise ConfigError(f"{_label(flag)}{shown!r}: {what}; use {', '.join(first)} or {last}")
    return backend


def check_url(url: str, flag: str | None = None) -> Backend:
    """Refuse a URL of no known scheme, or one its backend would refuse late (a relative ``fs://`` path, a Redis port
    that is no number...): ``ConfigError``, starting with ``flag`` when given. Pure: nothing is imported or opened."""
    backend = backend_for(url, flag)
    problem = backend.check(url)
    if problem is not None:
        raise ConfigError(f"{_label(flag)}{problem}")
    return backend


def quota_refusal(url: str) -> str | None:
    """Why the storage at ``url`` takes no quota, or None when it does."""
    return backend_for(url).no_quota


def quota_schemes() -> str:
    """The schemes that take a quota, for messages: ``fs://``."""
    return " or ".join(f"{b.scheme}://" for b in BACKENDS.values() if b.no_quota is None)


def prepare(url: str, flag: str | None = None) -> None:
    """What the backend of ``url`` makes at start-up, before any model loads: the directory of an ``fs://`` L2 when
    it is missing and its parent exists (``fileio.make_root``), so a directory that cannot be made stops the start
    at once instead of a replica serving with its L2 down. ``ConfigError`` names the URL."""
    backend = check_url(url, flag)
    if backend.prepare is None:
        return
    try:
        backend.prepare(url)
    except ConfigError as exc:
        raise ConfigError(f"{_label(flag)}{url}: {exc}") from None


def resolve(target: str) -> object:
    """The attribute ``"module:name"`` names, importing its module now (the registry's lazy half)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def open_l2(
    url: str,
    expect: chunkfile.AnyExpect,
    *,
    max_bytes: int | None = None,
    ttl_s: int | None = None,
    on_evict: EvictHook | None = None,
) -> SharedTier:
    """The storage at ``url`` holding values ``expect`` describes: an L2 ``Tier`` of the reference engine's chunks
    (``chunkfile.Expect``) or a blob store's ``Storage`` (``chunkfile.BlobExpect``). A bad URL, or a quota for a
    backend without one, raises ``ConfigError``; an unreachable storage does not: it comes back down and is
    retried."""
    backend = check_url(url)
    if max_bytes is not None and backend.no_quota is not None:
        raise ConfigError(f"a quota is for an {quota_schemes()} store ({backend.no_quota})")
    opener = cast(Opener, resolve(backend.opener))
    return opener(url, expect, max_bytes=max_bytes, ttl_s=ttl_s, on_evict=on_evict)


def list_namespaces(url: str) -> Namespaces:
    """The namespaces stored at ``url``: (id, description) pairs, the description None where there is none (the
    reference engine's chunks, whose id is its KV fingerprint). Redis lists described namespaces only.
    ``ConfigError`` for a URL of no known scheme or a storage that cannot be listed (each lister checks its URL)."""
    lister = cast(Lister, resolve(backend_for(url).lister))
    return lister(url)
