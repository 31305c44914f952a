"""L2 in Redis: each chunk is one value (the ``chunkfile`` bytes, checksum included) under
``preheat:kv:<fingerprint>:<key>``.

- **Expiry**: every value has a TTL (``--kv-l2-ttl``, default one day), refreshed on each read, so chunks nobody
  reads age out. Give the Redis server a ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (or
  ``volatile-lru``): Redis then evicts the least recently used chunks when full, instead of refusing writes.
- **Integrity**: a value that fails its checks (checksum, MAC with ``--kv-secret-file``) is deleted and counted as
  corrupt; the request recomputes. A value larger than any chunk of the layout is refused after its first
  ``max_size + 1`` bytes (``GETRANGE``), never transferred whole.
- **Access**: ``redis://[user:password@]host:port/db`` authenticates with ``AUTH``; ``rediss://`` speaks TLS and
  verifies the server's certificate (``?ssl_ca_certs=/path/ca.pem`` for a private CA).
- **Failures**: a connection error or a timeout (1 s) marks the tier down for ``retry_s``; meanwhile every lookup is a
  miss and every store is dropped. The next try after that reconnects, so a restarted Redis is used again at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis

from preheat.kv import chunkfile
from preheat.kv.chunk import StoredChunk, decode_chunk, encode_chunk
from preheat.kv.settings import DEFAULT_TTL_S
from preheat.kv.tier import EvictHook, Health, TierStats

log = logging.getLogger("preheat.kv")


class RedisTier:
    """Chunks as Redis values. ``url``: ``redis://[user:password@]host:port/db`` (or ``rediss://`` for TLS)."""

    name = "l2"

    def __init__(
        self,
        url: str,
        expect: chunkfile.Expect,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        timeout_s: float = 1.0,
        retry_s: float = 1.0,
        on_evict: EvictHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.expect = expect
        self.ttl_s = ttl_s
        self.stats = TierStats()
        self.health = Health("l2 " + self.describe(), retry_s, clock)
        self.prefix = f"preheat:kv:{expect.fingerprint}:"
        self._on_evict = on_evict
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        try:
            self.client.ping()
        except redis.RedisError as exc:
            self.health.down(f"cannot reach {self.describe()}: {exc}")

    @property
    def up(self) -> bool:
        return self.health.up

    def describe(self) -> str:
        parts = urlsplit(self.url)
        host = parts.hostname or "localhost"
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path or "/0", "", ""))

    def get(self, key: str) -> StoredChunk | None:
        if not self.health.should_try():
            self.stats.add(misses=1)
            return None
        name, limit = self.prefix + key, self.expect.max_size
        start = time.perf_counter()
        try:
            # GETRANGE, not GET: a value larger than any chunk (planted, or another program's) is never transferred
            # whole, at most limit + 1 bytes are; EXPIRE refreshes the TTL as GETEX would and says if the key exists.
            pipe = self.client.pipeline(transaction=False)
            pipe.getrange(name, 0, limit)
            pipe.expire(name, self.ttl_s)
            blob, exists = pipe.execute(raise_on_error=False)
            for result in (blob, exists):  # a refused command (NOPERM ...) is a tier problem; WRONGTYPE a bad value
                if isinstance(result, redis.RedisError) and not str(result).startswith("WRONGTYPE"):
                    raise result
        except redis.RedisError as exc:
            self.stats.add(misses=1, errors=1)
            self.health.down(str(exc))
            return None
        self.health.ok()
        if not exists:
            self.stats.add(misses=1)
            return None
        try:
            if isinstance(blob, redis.RedisError):  # WRONGTYPE: a list or hash under a chunk's name
                raise chunkfile.CorruptChunkError(f"chunk {key}: not a string value ({blob})")
            assert isinstance(blob, bytes)
            chunk = decode_chunk(blob, key, self.expect)  # refuses a value over expect.max_size first
        except chunkfile.CorruptChunkError as exc:
            log.warning("KV L2: %s; deleting it from %s", exc, self.describe())
            self._delete(key)
            self.stats.rejected(exc)
            return None
        self.stats.hit(len(blob), time.perf_counter() - start)
        return chunk

    def put(self, key: str, chunk: StoredChunk) -> bool:
        if not self.health.should_try():
            return False
        value = b"".join(encode_chunk(key, self.expect.fingerprint, chunk, self.expect.mac_key))
        try:
            self.client.set(self.prefix + key, value, ex=self.ttl_s)
        except redis.RedisError as exc:
            self.stats.add(errors=1)
            self.health.down(str(exc))
            return False
        self.health.ok()
        self.stats.add(stores=1, bytes_written=len(value))
        return True

    def _delete(self, key: str) -> None:
        try:
            self.client.delete(self.prefix + key)
        except redis.RedisError:
            return
        if self._on_evict is not None:
            self._on_evict(self.name, key)

    def keys(self, limit: int) -> list[str]:
        if not self.health.should_try():
            return []
        found: list[str] = []
        try:
            for name in self.client.scan_iter(match=self.prefix + "*", count=1000):
                found.append(name.decode() if isinstance(name, bytes) else str(name))
                if len(found) >= limit:
                    break
        except redis.RedisError as exc:
            self.health.down(str(exc))
        return [name[len(self.prefix) :] for name in found]

    def close(self) -> None:
        self.client.close()
