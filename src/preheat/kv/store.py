"""One engine-neutral blob store over preheat's L2 tiers: opaque values under an engine's own keys, per namespace.

LMCache, SGLang HiCache and vLLM's offloading connector each name KV by their own keys (strings of hashes) and hand
over opaque bytes. ``BlobStore`` keeps those bytes in the same self-checking format, through the same code, as the
reference engine's chunks (``FileTier``/``RedisTier``: their ``read``/``write``/``contains`` path), so every value
gets what preheat's L2 has: an XXH3-128 checksum (and the fleet MAC with a secret), the directory as its index (a
restarted process finds every entry), a quota with LRU across processes (``fs://``), TTL and Redis's own LRU
(``redis://``), and a **miss** for anything unreadable: a flipped byte, a truncated file, a value of another
namespace, a dead Redis, a full disk. No method raises on a storage failure; each returns None/False and counts it
in ``stats`` (``TierStats``: hits, misses, corrupt, errors, refused...).

Spec (layout on disk and in Redis, per namespace): docs/kv-store.md.

>>> import tempfile
>>> ns = Namespace(model="org/model@rev", engine="example", layout={"chunk_tokens": 256, "dtype": "bfloat16"})
>>> with tempfile.TemporaryDirectory() as root:
...     store = open_store(f"fs://{root}", ns)
...     store.put("chunk-0", b"opaque bytes"), bytes(store.get("chunk-0") or b""), store.get("chunk-1")
(True, b'opaque bytes', None)

**Keys name their contents.** A ``put`` of a key whose stored value is valid keeps that value (on ``fs://``, only
its recency is refreshed); engines' keys are hashes of token prefixes, so the same key means the same K/V. A damaged
value under the key is replaced.

**Threads and processes.** A ``BlobStore`` may be used from many threads; any number of processes (on any number of
nodes sharing the directory or Redis) may open the same namespace at once.

**For integrations** (``preheat.integrations.*``): build a ``Namespace`` from what makes the engine's bytes mean
something (model identity and revision, engine and its version's KV layout, dtype, chunk/page size, TP rank, ...),
open the store once per engine instance with ``open_store``, and call the batch forms from the engine's I/O thread:
``get_many`` and ``put_many`` are one round trip on Redis; ``exists_many``/``prefix_length`` never read values.
``exists`` only says a value is probably there (it is not read): a following ``get`` verifies and may still miss,
so an integration must treat a ``get`` miss after a positive ``exists`` as an ordinary miss.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence

from preheat.core.config import parse_size
from preheat.core.errors import ConfigError
from preheat.kv import chunkfile, mac
from preheat.kv.backends import list_namespaces, open_l2
from preheat.kv.blob_reads import PEEK_BYTES, Allocate, fitted, framed_reader, split_reader
from preheat.kv.fanout import DEFAULT_THREADS, FanOut
from preheat.kv.namespace import Namespace, key_of, storage_name
from preheat.kv.settings import DEFAULT_TTL_S
from preheat.kv.tier import Storage, TierStats

__all__ = ["DEFAULT_MAX_VALUE", "BlobStore", "Namespace", "Storage", "Value", "key_of", "list_namespaces",
           "open_storage", "open_store", "storage_name"]  # the namespace's names too: one import for an integration

log = logging.getLogger("preheat.kv")

Bytes = bytes | bytearray | memoryview
Value = Bytes | tuple[Bytes, ...]  # one buffer, or parts stored one after the other (no joined copy)
DEFAULT_MAX_VALUE = 256 << 20  # bytes; a value larger than this is refused (a 70B model's 256-token chunk is ~80 MiB)
_HEAD_BYTES = 16 + 64 * 1024  # enough to read any header's claimed key (prefix + the largest header)


class BlobStore:
    """Opaque values under engine keys in one namespace, on one L2 (``open_store`` builds it from a URL)."""

    def __init__(self, storage: Storage, namespace: Namespace, *, io_threads: int = DEFAULT_THREADS) -> None:
        expect = storage.expect
        if not isinstance(expect, chunkfile.BlobExpect) or expect.fingerprint != namespace.id:
            raise ConfigError(f"{storage.describe()}: not opened for the values of namespace {namespace.id}")
        self.storage = storage
        self.namespace = namespace
        self.expect = expect
        self._described = threading.Event()
        from preheat.kv.fs import FileTier  # here: the file tier imports torch

        self._files = storage if isinstance(storage, FileTier) else None  # fs://: reads straight into buffers
        self._fanout = FanOut(io_threads)  # fs:// batches over threads (Redis batches are one round trip)

    @property
    def stats(self) -> TierStats:
        """The counters of this store's storage: hits, misses, corrupt, mac_failures, errors, refused, ..."""
        return self.storage.stats

    @property
    def up(self) -> bool:
        """False while the storage is down (a missing mount, a dead Redis): every call is then a miss."""
        return self.storage.up

    @property
    def max_value_bytes(self) -> int:
        return self.expect.max_payload_bytes

    def describe(self) -> str:
        """Where the values live, without credentials, and the namespace id (``fs:///kv#<id>``)."""
        return f"{self.storage.describe()}#{self.namespace.id}"

    # -- single values ----------------------------------------------------------------------------------------------

    def put(self, key: str, value: Value) -> bool:
        """Store ``value`` (one buffer, or a tuple of parts stored one after the other) under ``key``; False when
        it was not stored (bad key, larger than ``max_value_bytes`` or than the quota, storage down, disk full).
        Never raises for a storage failure."""
        return self.put_many([(key, value)])[0]

    def get(self, key: str) -> memoryview | None:
        """The verified value of ``key`` (a read-only view of the bytes read), or None: absent, damaged (removed
        and counted as corrupt), of another namespace, storage down."""
        return self.get_many([key])[0]

    def get_into(self, key: str, allocate: Allocate, *, peek: bool = True) -> int | None:
        """Read the value of ``key`` into the caller's memory, and return its length ``n``; None for a miss
        (absent, damaged, another namespace, no room, storage down).

        ``allocate(n, peek)`` hands back the buffer(s) to fill, in order (their lengths summing to at least ``n``),
        or None when there is no room (a miss). ``peek`` is the value's first bytes (up to ``PEEK_BYTES``), *not
        yet verified*: enough to read a small header the engine keeps at the front of its value, to size its
        buffers. On ``fs://`` the value is read straight into those buffers (no intermediate copy) and verified
        there: after a None, the buffers (if any were allocated) hold garbage and are the caller's to free. With
        ``peek=False`` (an engine that sizes its buffers from ``n`` alone) ``allocate`` gets ``b""``, and on ``fs://``
        header and value are read in one system call, or for a value of ``PIECEWISE_BYTES`` or more into one buffer,
        a MiB at a time, each hashed as it lands (``allocate`` may be called twice for a file whose header is not
        where this preheat puts it: the last buffers it hands back are filled).

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = open_store(f"fs://{root}", Namespace("m", "e"))
        ...     _ = store.put("k", b"abc"); buffer = bytearray(8)
        ...     store.get_into("k", lambda n, peek: memoryview(buffer)), bytes(buffer[:3])
        (3, b'abc')
        """
        name = self._name(key)
        if name is None:
            self.stats.add(misses=1)
            return None
        if self._files is not None:
            if peek:
                return self._files.read_split(name, chunkfile.head_length, *split_reader(key, self.expect, allocate),
                                              extra=PEEK_BYTES)
            return self._files.read_framed(name, framed_reader(key, self.expect, allocate),
                                           lambda: (chunkfile.head_length, *split_reader(key, self.expect, allocate)))
        value = self.get(key)
        if value is None:
            return None
        buffers = fitted(allocate(len(value), bytes(value[:PEEK_BYTES]) if peek else b""), len(value))
        if buffers is None:
            return None
        offset = 0
        for buffer in buffers:
            buffer[:] = value[offset : offset + len(buffer)]
            offset += len(buffer)
        return len(value)

    def exists(self, key: str) -> bool:
        """Whether a value is probably stored under ``key`` (not read, so not verified: a ``get`` may still miss)."""
        return self.exists_many([key])[0]

    def remove(self, key: str) -> bool:
        """Remove the value of ``key``; False when there was none."""
        name = self._name(key)
        return name is not None and self.storage.remove(name)

    # -- batches ----------------------------------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        """``put`` of every (key, value), in order; one round trip on Redis."""
        self._describe_namespace()
        done = [False] * len(items)
        todo: list[tuple[int, str, str, list[memoryview]]] = []
        total = 0  # the batch's bytes: whether to spread it over threads (fs://)
        for i, (key, value) in enumerate(items):
            name = self._name(key)
            parts = [memoryview(p).cast("B") for p in (value if isinstance(value, tuple) else (value,))]
            size = sum(p.nbytes for p in parts)
            if name is None:
                continue
            if size > self.expect.max_payload_bytes:
                self.stats.add(refused=1)
                log.debug("KV store: %r is %d bytes, more than a value may be (%d)", key, size,
                          self.expect.max_payload_bytes)
                continue
            todo.append((i, key, name, parts))
            total += size
        files = self._files
        if files is not None and self.expect.mac_key is None:  # checksum computed as the payload is written
            written = self._fanout.map(
                lambda item: files.write_unsummed(item[2], self._unsummed(item[1], item[3]), self._checker(item[1])),
                todo, total)
        elif files is not None:
            written = self._fanout.map(
                lambda item: files.write(item[2], self._encoder(item[1], item[3]), self._checker(item[1])), todo, total)
        else:
            written = self.storage.write_many([(name, self._encoder(key, data), self._checker(key))
                                               for _, key, name, data in todo])
        for (i, _key, _name, _data), ok in zip(todo, written, strict=True):
            done[i] = ok
        return done

    def get_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        """``get`` of every key, in order; one round trip on Redis."""
        if self._files is not None:  # one read per value, into a buffer of its own
            return self._fanout.map(self._get_file, keys, len(keys) * self._typical_value())
        out: list[memoryview | None] = [None] * len(keys)
        names = [(i, self._name(key), key) for i, key in enumerate(keys)]
        valid = [(i, name, key) for i, name, key in names if name is not None]
        if len(valid) < len(keys):
            self.stats.add(misses=len(keys) - len(valid))
        found = self.storage.read_many([name for _, name, _ in valid], [self._checker(key) for _, _, key in valid])
        for (i, _name, _key), value in zip(valid, found, strict=True):
            out[i] = value
        return out

    def get_into_many(self, items: Sequence[tuple[str, Allocate]], *, peek: bool = True,
                      nbytes: int | None = None) -> list[int | None]:
        """``get_into`` of every (key, allocate), in order. On ``fs://`` a batch of ``nbytes`` (the caller's buffers;
        estimated from the values read so far when not given) of ``fanout.MIN_BYTES`` or more is read on up to
        ``io_threads`` threads, each value by one of them: ``allocate`` may then be called from any of those
        threads, once per value, and the buffers of two values must not overlap."""
        if self._files is None:
            return [self.get_into(key, allocate, peek=peek) for key, allocate in items]
        total = nbytes if nbytes is not None else len(items) * self._typical_value()
        return self._fanout.map(lambda item: self.get_into(item[0], item[1], peek=peek), items, total)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """``exists`` of every key, in order; one round trip on Redis."""
        names = [self._name(key) for key in keys]
        valid = [name for name in names if name is not None]
        found = iter(self.storage.contains_many(valid))
        return [next(found) if name is not None else False for name in names]

    def prefix_length(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` exist (SGLang's ``batch_exists``: KV of a page is only usable after every page
        before it)."""
        n = 0
        for found in self.exists_many(keys):
            if not found:
                break
            n += 1
        return n

    # -- listing ----------------------------------------------------------------------------------------------------

    def entries(self, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` (key, stored size) pairs, most recently used first: the warm-up order. Keys stored under
        a hash are read from their (unverified) headers; a ``get`` verifies."""
        out: list[tuple[str, int]] = []
        for name, size in self.storage.entries(limit):
            try:
                key = key_of(name)
            except UnicodeDecodeError:
                continue  # not a name this store writes
            if key is None:
                head = self.storage.head(name, _HEAD_BYTES)
                key = chunkfile.peek_key(head) if head is not None else None
            if key is not None and self._name(key) == name:
                out.append((key, size))
        return out

    def keys(self, limit: int) -> list[str]:
        """Up to ``limit`` keys, most recently used first."""
        return [key for key, _size in self.entries(limit)]

    def close(self) -> None:
        self._fanout.close()
        self.storage.close()

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _name(self, key: str) -> str | None:
        if not isinstance(key, str) or not key or len(key) > chunkfile.MAX_KEY_CHARS:
            return None
        return storage_name(key)

    def _encoder(self, key: str, data: list[memoryview]) -> Callable[[], list[bytes | memoryview]]:
        return lambda: chunkfile.encode_blob(key, self.expect.fingerprint, data, self.expect.mac_key)

    def _unsummed(self, key: str, data: list[memoryview]) -> Callable[[], chunkfile.Unsummed]:
        return lambda: chunkfile.encode_blob_unsummed(key, self.expect.fingerprint, data)

    def _checker(self, key: str) -> Callable[[bytes | bytearray], memoryview]:
        expect = self.expect
        return lambda blob: chunkfile.decode_blob(blob, key, expect).toreadonly()

    def _typical_value(self) -> int:
        """The mean size of the values this store has read (0 before the first: a first batch of unknown values
        stays on the calling thread): a batch's bytes when the caller does not say."""
        stats = self.storage.stats
        return stats.bytes_read // stats.hits if stats.hits else 0

    def _get_file(self, key: str) -> memoryview | None:
        """``get`` on ``fs://``: the value read (in one call with its header) into a buffer of its size, verified."""
        found: list[bytearray] = []

        def allocate(n: int, peek: bytes) -> memoryview:
            found.append(bytearray(n))
            return memoryview(found[-1])

        n = self.get_into(key, allocate, peek=False)
        return None if n is None else memoryview(found[-1]).toreadonly()

    def _describe_namespace(self) -> None:
        """Leave the namespace's description beside its values, once per process (``preheat kv ls`` shows it)."""
        if self._described.is_set():
            return
        self._described.set()
        self.storage.describe_namespace(json.dumps(self.namespace.to_dict(), sort_keys=True, indent=1).encode())


def open_store(
    url: str,
    namespace: Namespace,
    *,
    max_value_bytes: int = DEFAULT_MAX_VALUE,
    max_bytes: int | str | None = None,
    ttl_s: int = DEFAULT_TTL_S,
    secret_file: str | None = None,
    io_threads: int = DEFAULT_THREADS,
) -> BlobStore:
    """The blob store of ``namespace`` at ``url``: ``fs:///shared/kv`` (made if missing and its parent exists:
    ``fileio.make_root``; else down, saying why), or
    ``redis://[user:password@]host:port/db`` / ``rediss://...``.

    ``max_value_bytes``: the largest value accepted (larger stored values are refused unread); ``max_bytes``: the
    quota of an ``fs://`` directory across every process and namespace sharing it (``8GiB``; LRU by last use);
    ``ttl_s``: Redis expiry after the last read; ``secret_file``: the fleet secret (docs/kv-cache.md), values are
    then signed and only signed ones are read; ``io_threads``: how many threads an ``fs://`` batch is read or
    written on (``kv/fanout.py``). A bad URL, secret or ``io_threads`` raises ``ConfigError``; an unreachable store
    does not: it comes back down (every call a miss) and is retried.
    """
    mac_key = mac.derive_key(mac.read_secret_file(secret_file)) if secret_file is not None else None
    expect = chunkfile.BlobExpect(namespace.id, max_value_bytes, mac_key=mac_key)
    return BlobStore(open_storage(url, expect, max_bytes=max_bytes, ttl_s=ttl_s), namespace, io_threads=io_threads)


def open_storage(
    url: str, expect: chunkfile.BlobExpect, *, max_bytes: int | str | None = None, ttl_s: int = DEFAULT_TTL_S
) -> Storage:
    """The storage at ``url`` for values ``expect`` describes (``open_store``; tools that read a namespace by its
    id alone, as ``preheat kv warm``, use it directly)."""
    quota = parse_size(max_bytes) if isinstance(max_bytes, str) else max_bytes
    return open_l2(url, expect, max_bytes=quota, ttl_s=ttl_s)  # the backend of url's scheme: kv/backends.py
