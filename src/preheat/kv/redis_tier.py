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
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.connection import PythonRespSerializer

from preheat.core.errors import CorruptChunkError
from preheat.kv import chunkfile
from preheat.kv.chunk import StoredChunk, decode_chunk, encode_chunk
from preheat.kv.settings import DEFAULT_TTL_S
from preheat.kv.tier import Check, Encode, EvictHook, Health, TierStats, chunk_expect

log = logging.getLogger("preheat.kv")
T = TypeVar("T")
_BUFFER_CUTOFF = 6000  # redis-py's own: arguments larger than this are sent as separate buffers, not copied


class RedisTier:
    """Chunks as Redis values. ``url``: ``redis://[user:password@]host:port/db`` (or ``rediss://`` for TLS).

    ``get``/``put`` store the reference engine's chunks; ``read``/``write``/``contains`` and their batch forms are the
    same path for any self-checking value (``kv/store.py``). ``expect`` says what a read accepts (``chunkfile.Expect``
    or ``chunkfile.BlobExpect``); its fingerprint is part of every key.
    """

    name = "l2"

    def __init__(
        self,
        url: str,
        expect: chunkfile.AnyExpect,
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
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            # redis-py's pure-Python packer sends a large value as it is; hiredis's copies it into the command first,
            # which made a 1 MiB SET 5x (in a pipeline 10x) slower (bench/kvstore.py).
            command_packer=PythonRespSerializer(_BUFFER_CUTOFF, _encode),
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
        expect = chunk_expect(self.expect)
        return self.read(key, lambda blob: decode_chunk(blob, key, expect))

    def put(self, key: str, chunk: StoredChunk) -> bool:
        expect = chunk_expect(self.expect)
        return self.write(key, lambda: encode_chunk(key, expect.fingerprint, chunk, expect.mac_key), _any)

    # -- the one storage path: the reference engine's chunks (above) and the blob store (kv/store.py) --------------

    def read(self, name: str, decode: Callable[[bytes | bytearray], T]) -> T | None:
        """``decode`` of the value stored under ``name``, or None (absent, refused by ``decode`` with
        ``CorruptChunkError``, not a string, tier down); counts a hit or a miss, deletes what was refused, and
        refreshes the TTL."""
        return self.read_many([name], [decode])[0]

    def read_many(self, names: Sequence[str], decodes: Sequence[Callable[[bytes | bytearray], T]]) -> list[T | None]:
        """``read`` of every name in one round trip (one pipeline)."""
        if not names:
            return []
        if not self.health.should_try():
            self.stats.add(misses=len(names))
            return [None] * len(names)
        limit = self.expect.max_size
        start = time.perf_counter()
        try:
            # GETRANGE, not GET: a value larger than any chunk (planted, or another program's) is never transferred
            # whole, at most limit + 1 bytes are; EXPIRE refreshes the TTL as GETEX would and says if the key exists.
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.getrange(self.prefix + name, 0, limit)
                pipe.expire(self.prefix + name, self.ttl_s)
            results = pipe.execute(raise_on_error=False)
            for result in results:  # a refused command (NOPERM ...) is a tier problem; WRONGTYPE a bad value
                if isinstance(result, redis.RedisError) and not str(result).startswith("WRONGTYPE"):
                    raise result
        except redis.RedisError as exc:
            self.stats.add(misses=len(names), errors=1)
            self.health.down(str(exc))
            return [None] * len(names)
        self.health.ok()
        elapsed = (time.perf_counter() - start) / len(names)
        out: list[T | None] = []
        for i, (name, decode) in enumerate(zip(names, decodes, strict=True)):
            blob, exists = results[2 * i], results[2 * i + 1]
            if not exists:
                self.stats.add(misses=1)
                out.append(None)
                continue
            try:
                if isinstance(blob, redis.RedisError):  # WRONGTYPE: a list or hash under a chunk's name
                    raise CorruptChunkError(f"chunk {name}: not a string value ({blob})")
                assert isinstance(blob, bytes)
                value = decode(blob)  # refuses a value over expect.max_size first
            except CorruptChunkError as exc:
                log.warning("KV L2: %s; deleting it from %s", exc, self.describe())
                self._delete(name)
                self.stats.rejected(exc)
                out.append(None)
                continue
            self.stats.hit(len(blob), elapsed)
            out.append(value)
        return out

    def write(self, name: str, encode: Encode, check: Check) -> bool:
        """Store the pieces ``encode`` makes (joined) under ``name`` with the TTL; False when not stored (tier
        down). ``check`` is not called: SET replaces, and reading the old value first would cost a round trip to
        save writing the same bytes. Never raises."""
        return self.write_many([(name, encode, check)])[0]

    def write_many(self, items: Sequence[tuple[str, Encode, Check]]) -> list[bool]:
        """``write`` of every item in one round trip."""
        if not items:
            return []
        if not self.health.should_try():
            return [False] * len(items)
        values = [(name, b"".join(encode())) for name, encode, _check in items]
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(self.prefix + name, value, ex=self.ttl_s)
            pipe.execute()
        except redis.RedisError as exc:
            self.stats.add(errors=1)
            self.health.down(str(exc))
            return [False] * len(items)
        self.health.ok()
        self.stats.add(stores=len(values), bytes_written=sum(len(v) for _, v in values))
        return [True] * len(items)

    def contains(self, name: str) -> bool:
        """Whether a value is stored under ``name`` (unread: a later ``read`` still verifies it and may miss)."""
        return self.contains_many([name])[0]

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """``contains`` of every name in one round trip; all False while the tier is down."""
        if not names or not self.health.should_try():
            return [False] * len(names)
        try:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(self.prefix + name)
            found = pipe.execute()
        except redis.RedisError as exc:
            self.stats.add(errors=1)
            self.health.down(str(exc))
            return [False] * len(names)
        self.health.ok()
        return [bool(n) for n in found]

    def describe_namespace(self, description: bytes) -> None:
        """Leave ``description`` (JSON) under ``preheat:kv:<namespace id>`` (no TTL: a few hundred bytes)."""
        try:
            self.client.set(self.prefix[:-1], description, nx=True)
        except redis.RedisError as exc:
            log.debug("KV L2: could not describe the namespace in %s: %s", self.describe(), exc)

    def remove(self, name: str) -> bool:
        """Delete what is stored under ``name``; False when nothing was (or the tier is down)."""
        try:
            removed = int(self.client.delete(self.prefix + name))
        except redis.RedisError as exc:
            self.health.down(str(exc))
            return False
        return removed > 0

    def head(self, name: str, nbytes: int) -> bytes | None:
        """The first ``nbytes`` stored under ``name``, unverified (listing reads the key a header claims), or None."""
        try:
            blob = self.client.getrange(self.prefix + name, 0, nbytes - 1)
        except redis.RedisError:
            return None
        return blob if isinstance(blob, bytes) and blob else None

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

    def entries(self, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` stored names with their sizes, least idle first (``OBJECT IDLETIME``; scan order where
        the server refuses it, as under an LFU ``maxmemory-policy``). The warm-up order."""
        names = self.keys(limit)
        if not names:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(self.prefix + name)
                pipe.object("idletime", self.prefix + name)
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            self.health.down(str(exc))
            return []
        rows = []
        for i, name in enumerate(names):
            size, idle = results[2 * i], results[2 * i + 1]
            if isinstance(size, int) and size > 0:
                rows.append((idle if isinstance(idle, int) else 0, i, name, size))
        rows.sort()
        return [(name, size) for _idle, _i, name, size in rows]

    def close(self) -> None:
        self.client.close()


def open_url(
    url: str,
    expect: chunkfile.AnyExpect,
    *,
    max_bytes: int | None = None,
    ttl_s: int | None = None,
    on_evict: EvictHook | None = None,
) -> RedisTier:
    """The ``RedisTier`` of a ``redis://`` or ``rediss://`` URL: their entries in ``kv/backends.py``, which checked
    the URL and refuses a quota (``max_bytes``: Redis's own maxmemory evicts). ``ttl_s`` None: ``DEFAULT_TTL_S``."""
    del max_bytes
    return RedisTier(url, expect, ttl_s=DEFAULT_TTL_S if ttl_s is None else ttl_s, on_evict=on_evict)


def _any(_blob: bytes | bytearray) -> None:
    """A ``Check`` that never runs: Redis stores replace (``RedisTier.write``)."""


def _encode(value: bytes | memoryview | str | int | float) -> bytes | memoryview:
    """One command argument as bytes, as redis-py's own encoder makes it (values pass through uncopied)."""
    if isinstance(value, bytes | memoryview):
        return value
    if isinstance(value, str):
        return value.encode()
    return repr(value).encode() if isinstance(value, float) else str(value).encode()
