"""What a blob store's namespace is, how an engine's keys become file- and Redis-safe names, and which namespaces a
store holds (``kv/store.py`` keeps the values; docs/kv-store.md has the layout).

>>> Namespace("m", "e", {"page": 64}).id == Namespace("m", "e", {"page": 64}).id
True
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote

import xxhash

from preheat.core.errors import ConfigError, JSONInputError
from preheat.core.jsonsafe import load_object
from preheat.kv.backends import check_url, fs_root

NAMESPACE_FILE = "namespace.json"
_SAFE = frozenset(string.ascii_letters + string.digits + "-_@=+,.")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_@=+,.-]*")  # every character in _SAFE
_MAX_NAME = 160  # escaped keys longer than this are stored under a hash (file names stop at 255 bytes)
_DESCRIPTION_BYTES = 64 << 10  # a description is a few hundred bytes: a larger one is someone else's, not parsed


@dataclass(frozen=True)
class Namespace:
    """Whose values these are: values of one namespace never answer for another's, even under the same key.

    ``model``: the model's identity (a ``preheat.json`` identity, or a Hugging Face ``repo@revision``);
    ``engine``: the engine and whatever of its version changes the bytes (``lmcache-0.5``); ``layout``: JSON-ready
    facts that make the bytes mean something (dtype, KV shape, chunk or page size, TP rank and size, ...). The
    namespace's ``id`` (XXH3-128 of the canonical JSON of all three) names its directory and Redis prefix, and is
    in every value's header.

    >>> Namespace("m", "e", {"page": 64}).id == Namespace("m", "e", {"page": 64}).id
    True
    >>> Namespace("m", "e", {"page": 64}).id == Namespace("m", "e", {"page": 32}).id
    False
    """

    model: str
    engine: str
    layout: Mapping[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"format": 1, "model": self.model, "engine": self.engine, "layout": dict(self.layout)}

    @property
    def id(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(canonical.encode())


@functools.lru_cache(maxsize=1 << 16)  # engines read the keys they wrote: the mapping is paid once per key
def storage_name(key: str) -> str:
    """The file- and Redis-safe name of an engine key: two hex characters of its hash (the shard directory), then
    the key with every character outside ``[A-Za-z0-9-_@=+,.]`` (and a leading ``.``) %-escaped as UTF-8 bytes, or
    ``~`` and a BLAKE2b-160 of the key when that is longer than 160 characters. The stored header holds the key
    itself, which every read checks, so two keys can never answer for each other.

    >>> storage_name("vllm@org/model@1@0@5f3a@bfloat16")[2:]
    'vllm@org%2Fmodel@1@0@5f3a@bfloat16'
    """
    shard = xxhash.xxh3_64_hexdigest(key.encode())[:2]
    if _ALL_SAFE.fullmatch(key):  # hex hashes and most engines' keys: nothing to escape
        escaped = key
    else:
        escaped = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    if len(escaped) > _MAX_NAME:
        escaped = "~" + hashlib.blake2b(key.encode(), digest_size=20).hexdigest()
    return shard + escaped


def key_of(name: str) -> str | None:
    """The engine key ``storage_name`` escaped into ``name``; None for a hashed name (read its header instead)."""
    rest = name[2:]
    if rest.startswith("~") or len(name) < 3:
        return None
    return unquote(rest, errors="strict") if "%" in rest else rest


def list_fs(url: str) -> list[tuple[str, dict[str, object] | None]]:
    """The namespaces in an ``fs://`` directory, described or not (``backends.list_namespaces`` calls it)."""
    out: list[tuple[str, dict[str, object] | None]] = []
    top = os.path.join(fs_root(url), "v1")
    try:
        names = sorted(os.listdir(top))
    except OSError as exc:
        raise ConfigError(f"{url}: cannot list namespaces ({exc.strerror or exc})") from None
    for name in names:
        if len(name) == 32 and os.path.isdir(os.path.join(top, name)):
            out.append((name, _description(os.path.join(top, name, NAMESPACE_FILE))))
    return out


def list_redis(url: str) -> list[tuple[str, dict[str, object] | None]]:
    """The described namespaces in a Redis database (``backends.list_namespaces`` calls it)."""
    check_url(url)
    import redis  # here: listing an fs:// directory imports no redis-py

    out: list[tuple[str, dict[str, object] | None]] = []
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        for raw in client.scan_iter(match="preheat:kv:" + "?" * 32, count=1000):
            ident = (raw.decode() if isinstance(raw, bytes) else str(raw)).rsplit(":", 1)[-1]
            blob = client.get(raw)
            out.append((ident, _parse_description(blob) if isinstance(blob, bytes) else None))
    except redis.RedisError as exc:
        raise ConfigError(f"{url.rsplit('@', maxsplit=1)[-1]}: cannot list namespaces ({exc})") from None
    finally:
        client.close()
    return sorted(out)


def _description(path: str) -> dict[str, object] | None:
    try:
        with open(path, "rb") as handle:
            return _parse_description(handle.read(_DESCRIPTION_BYTES + 1))
    except OSError:
        return None


def _parse_description(blob: bytes) -> dict[str, object] | None:
    try:
        return load_object(blob, max_bytes=_DESCRIPTION_BYTES)
    except JSONInputError:  # someone else's key, or a damaged one: listed without a description
        return None
