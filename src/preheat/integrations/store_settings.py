"""The store keys an engine's own configuration carries for preheat (LMCache's plugin keys, SGLang's HiCache extra
config, a vLLM offloading tier's entry): one parser and one ``open_store`` call for every integration, and one rule
for what their namespaces are keyed by (``namespace_model``: the checkpoint's content identity, not its name).

>>> StoreSettings.from_mapping({"url": "fs:///kv", "max_bytes": "1GiB", "ttl_s": 60}, where="tier").max_bytes
1073741824
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TypedDict

from preheat.checkpoint.layout import read_manifest
from preheat.core.config import parse_size
from preheat.core.errors import CheckpointError, ConfigError
from preheat.kv.fanout import DEFAULT_THREADS, check_threads
from preheat.kv.store import BlobStore, Namespace, open_store
from preheat.sources.peer_uri import is_peer_uri, parse_peer_uri

log = logging.getLogger("preheat.integrations")
_warned: set[str] = set()  # the model names namespace_model has warned about (once each per process)

KEYS = ("url", "max_bytes", "ttl_s", "secret_file", "model_identity", "io_threads")


class _Optional(TypedDict, total=False):
    """``open_store``'s keywords passed only when set (its own default applies otherwise)."""

    ttl_s: int


@dataclass(frozen=True)
class StoreSettings:
    """``url`` (``fs:///dir`` or ``redis://host:port/db``), ``max_bytes`` (``fs://`` quota), ``ttl_s`` (Redis expiry
    after the last read), ``secret_file`` (fleet MAC, docs/kv-cache.md), ``model_identity`` (``repo@revision``,
    instead of the checkpoint's content identity or, without one, the engine's model name), ``io_threads``
    (threads an ``fs://`` batch is spread over; default ``min(4, cores)``)."""

    url: str
    max_bytes: int | None = None
    ttl_s: int | None = None
    secret_file: str | None = None
    model_identity: str | None = None
    io_threads: int = DEFAULT_THREADS

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], *, where: str,  # the engine's own config: checked here
                     others: Collection[str] = ()) -> StoreSettings:
        """Read preheat's keys from ``values``; ``ConfigError`` (naming ``where``) for a missing URL, a bad value,
        or a key that is neither preheat's nor one of the engine's own ``others``."""
        unknown = sorted(set(values) - set(KEYS) - set(others))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown} for preheat (known: {list(KEYS)})")
        url = values.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError(f"{where}: \"url\" is missing (fs:///dir or redis://host:port/db)")

        def text(name: str) -> str | None:
            found = values.get(name)
            return None if found is None else str(found)

        max_bytes, ttl, threads = text("max_bytes"), text("ttl_s"), text("io_threads")
        try:
            settings = cls(url=url, max_bytes=parse_size(max_bytes) if max_bytes is not None else None,
                           ttl_s=int(ttl) if ttl is not None else None, secret_file=text("secret_file"),
                           model_identity=text("model_identity"),
                           io_threads=check_threads(int(threads)) if threads is not None else DEFAULT_THREADS)
        except ValueError as exc:  # a ConfigError too: it is a ValueError, and gains the where
            raise ConfigError(f"{where}: {exc}") from None
        return settings

    def open(self, namespace: Namespace, max_value_bytes: int) -> BlobStore:
        """The blob store these settings name, for ``namespace``'s values of at most ``max_value_bytes``."""
        extra: _Optional = {"ttl_s": self.ttl_s} if self.ttl_s is not None else {}
        return open_store(self.url, namespace, max_value_bytes=max_value_bytes, max_bytes=self.max_bytes,
                          secret_file=self.secret_file, io_threads=self.io_threads, **extra)


def namespace_model(model_identity: str | None, model: object, engine: str) -> str:
    """What an engine's KV namespace is keyed by, so that values stored for other weights never answer for these:

    1. ``model_identity`` when the engine's preheat keys give one (``repo@revision``);
    2. else the content identity of the checkpoint ``model`` names: a ``preheat://xxh3-128:...`` name, or a directory
       whose ``preheat.json`` gives it (same weights, same namespace, whatever the directory is called; other weights
       under the same name, another namespace);
    3. else ``model`` itself (a hub name, a directory without a manifest), with a warning once: values another
       checkpoint of that name stored would be served to this one.

    >>> namespace_model("org/m@rev", "org/m", "lmcache"), namespace_model(None, "preheat://xxh3-128:" + "0" * 32, "x")
    ('org/m@rev', 'xxh3-128:00000000000000000000000000000000')
    """
    if model_identity:
        return model_identity
    name = str(model)
    if is_peer_uri(name):
        uri = parse_peer_uri(name)
        if uri.is_identity:
            return uri.name
    why = "it has no preheat.json"
    if name and os.path.isdir(name):
        try:
            manifest = read_manifest(name)
        except CheckpointError as exc:
            manifest, why = None, f"its preheat.json is unreadable ({exc})"
        if manifest is not None:
            return manifest.identity
    elif is_peer_uri(name):
        why = "a preheat:// name is not a content identity"
    else:
        why = "it is not a checkpoint directory"
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "%s KV store: no content identity for model %r (%s): its namespace is keyed by that name, so values "
            "stored for other weights under the same name would be served; give \"model_identity\" "
            "(repo@revision) in preheat's store settings, or load a directory converted by `preheat convert`",
            engine,
            name,
            why,
        )
    return name
