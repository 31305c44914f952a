"""The store keys an engine's own configuration carries for preheat (LMCache's plugin keys, SGLang's HiCache extra
config, a vLLM offloading tier's entry): one parser and one ``open_store`` call for every integration.

>>> StoreSettings.from_mapping({"url": "fs:///kv", "max_bytes": "1GiB", "ttl_s": 60}, where="tier").max_bytes
1073741824
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from preheat.core.config import parse_size
from preheat.core.errors import ConfigError
from preheat.kv.fanout import DEFAULT_THREADS
from preheat.kv.store import BlobStore, Namespace, open_store

KEYS = ("url", "max_bytes", "ttl_s", "secret_file", "model_identity", "io_threads")


@dataclass(frozen=True)
class StoreSettings:
    """``url`` (``fs:///dir`` or ``redis://host:port/db``), ``max_bytes`` (``fs://`` quota), ``ttl_s`` (Redis expiry
    after the last read), ``secret_file`` (fleet MAC, docs/kv-cache.md), ``model_identity`` (``repo@revision``,
    instead of the engine's model name), ``io_threads`` (threads an ``fs://`` batch is spread over; default
    ``min(4, cores)``)."""

    url: str
    max_bytes: int | None = None
    ttl_s: int | None = None
    secret_file: str | None = None
    model_identity: str | None = None
    io_threads: int = DEFAULT_THREADS

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, where: str,  # Any: the engine's JSON
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
                           io_threads=int(threads) if threads is not None else DEFAULT_THREADS)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if settings.io_threads < 1:
            raise ConfigError(f"{where}: \"io_threads\" must be at least 1, not {settings.io_threads}")
        return settings

    def open(self, namespace: Namespace, max_value_bytes: int) -> BlobStore:
        """The blob store these settings name, for ``namespace``'s values of at most ``max_value_bytes``."""
        extra: dict[str, Any] = {"ttl_s": self.ttl_s} if self.ttl_s is not None else {}
        return open_store(self.url, namespace, max_value_bytes=max_value_bytes, max_bytes=self.max_bytes,
                          secret_file=self.secret_file, io_threads=self.io_threads, **extra)
