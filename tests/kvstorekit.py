"""The engine-neutral blob store's test kit: a namespace, seeded values, the store's counters, where a value lies on
disk, and a stored value damaged on disk or in Redis. Imported by the store's tests and by the child processes they
start (``PYTHONPATH`` = tests/)."""

from __future__ import annotations

import random
from pathlib import Path

from preheat.kv.redis_tier import RedisTier
from preheat.kv.store import BlobStore, Namespace, storage_name

NS = Namespace(model="org/model@0123abcd", engine="test-engine", layout={"chunk_tokens": 256, "dtype": "bfloat16"})


def value(seed: int, size: int = 64 << 10) -> bytes:
    return random.Random(seed).randbytes(size)


def counters(store: BlobStore) -> dict[str, float]:
    return store.stats.snapshot()


def stored_path(store: BlobStore, key: str) -> Path:
    return Path(store.storage.path(storage_name(key)))  # type: ignore[attr-defined]  # fs:// stores only


def damage(store: BlobStore, key: str, how: str) -> None:
    """Flip a byte of (or truncate) the stored value of ``key``, on disk or in Redis."""
    if isinstance(store.storage, RedisTier):
        name = store.storage.prefix + storage_name(key)
        blob = bytearray(store.storage.client.get(name))  # type: ignore[arg-type]  # sync client: bytes
        blob = blob[: len(blob) // 2] if how == "truncate" else blob
        if how == "flip":
            blob[len(blob) // 2] ^= 0x01
        store.storage.client.set(name, bytes(blob))
        return
    path = stored_path(store, key)
    blob = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
        return
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
