"""Warm start: load the hottest values of a namespace into an engine's host tier before a replica takes traffic.

A replica that scales up starts with an empty host tier and would recompute the fleet's hot prefixes on its first
requests; warming reads the most recently used values of its namespace from the shared L2 first (``fs://``: by
file recency, which every hit refreshes; ``redis://``: by ``OBJECT IDLETIME``), verifies each, and hands it to
the engine: the reference engine's L1 (``warm_tiers``), LMCache's local CPU backend
(``preheat.integrations.lmcache.warm``), or, for ``preheat kv warm`` without an engine, the node's page cache (the
values are read and verified, so the engine's first reads come from memory).

``preheat serve --kv-warm SIZE`` warms L1 between the model's warm-up and ``ready``: ``/health`` answers 503
``{"status": "warming"}`` until it is done, so a router (or any load balancer) that waits for 200 waits for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preheat.core.errors import ConfigError
from preheat.kv import chunkfile, mac
from preheat.kv.store import BlobStore, open_storage

if TYPE_CHECKING:
    from preheat.kv.tiered import TieredKV

log = logging.getLogger("preheat.kv")

LIST_LIMIT = 1_000_000  # entries considered at most (a listing of the namespace, most recent first)


@dataclass
class WarmReport:
    """What a warm-up did: values loaded and their bytes, values skipped (damaged, vanished, already there, no
    room), and how long it took."""

    loaded: int = 0
    bytes: int = 0
    skipped: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"loaded": self.loaded, "bytes": self.bytes, "skipped": self.skipped, "seconds": self.seconds}


def warm_into(
    store: BlobStore,
    sink: Callable[[str], int | None],
    *,
    max_bytes: int | None = None,
    max_entries: int | None = None,
    progress: Callable[[WarmReport], None] | None = None,
) -> WarmReport:
    """Hand the hottest keys of ``store`` to ``sink`` (which loads the value into the engine and returns its size
    in bytes, or None when it skipped it), most recently used first, until ``max_bytes`` or ``max_entries`` are
    reached. Stored sizes decide the byte budget before a value is read, so the budget is never exceeded."""
    return _warm(store.entries, sink, max_bytes=max_bytes, max_entries=max_entries, progress=progress)


def warm_namespace(
    url: str,
    namespace_id: str,
    *,
    max_bytes: int | None = None,
    max_entries: int | None = None,
    secret_file: str | None = None,
    max_value_bytes: int = 1 << 30,
    progress: Callable[[WarmReport], None] | None = None,
) -> WarmReport:
    """``preheat kv warm`` without an engine: read and verify the hottest values of the namespace ``namespace_id``
    (a blob store's, or the reference engine's chunks: any kind), so the node's page cache holds them for the
    engine that starts next, and damaged ones are removed before it asks. With ``secret_file``, signed values are
    checked against it; without, their checksums are (a fleet's signed values are never taken for damaged ones)."""
    if not _is_id(namespace_id):
        raise ConfigError(f"--namespace {namespace_id!r}: a namespace id is 32 hex digits (preheat kv ls shows them)")
    mac_key = mac.derive_key(mac.read_secret_file(secret_file)) if secret_file is not None else None
    storage = open_storage(url, chunkfile.BlobExpect(namespace_id, max_value_bytes, mac_key=mac_key))
    if not storage.up:
        raise ConfigError(f"{storage.describe()} cannot be reached or written")

    def read(name: str) -> int | None:
        header = storage.read(name, lambda blob: chunkfile.verify_any(blob, namespace_id, mac_key))
        payload = header.get("payload_bytes") if header is not None else None
        return payload if isinstance(payload, int) else None

    try:
        return _warm(storage.entries, read, max_bytes=max_bytes, max_entries=max_entries, progress=progress)
    finally:
        storage.close()


def _is_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def warm_tiers(tiers: TieredKV, *, max_bytes: int | None = None, max_entries: int | None = None) -> WarmReport:
    """The reference engine: copy the hottest chunks of its L2 into its L1 (into at most 90% of L1's capacity,
    less what L1 holds already, or ``max_bytes`` if smaller), verified as any L2 read is. Nothing to do without
    both tiers."""
    l1, l2 = tiers.l1, tiers.l2
    if l1 is None or l2 is None or not l2.up:
        return WarmReport()
    room = max(0, int(l1.capacity * 0.9) - l1.used)  # never evict what L1 holds for what L2 holds
    budget = room if max_bytes is None else min(max_bytes, room)

    def load(key: str) -> int | None:
        if l1.contains(key):
            return None
        chunk = l2.get(key)
        if chunk is None or not l1.put(key, tiers.for_l1(chunk)):
            return None
        tiers.events.emit("store", "l1", key)
        return chunk.nbytes

    return _warm(l2.entries, load, max_bytes=budget, max_entries=max_entries, progress=None)


def _warm(
    entries: Callable[[int], list[tuple[str, int]]],
    sink: Callable[[str], int | None],
    *,
    max_bytes: int | None,
    max_entries: int | None,
    progress: Callable[[WarmReport], None] | None,
) -> WarmReport:
    start = time.perf_counter()
    report = WarmReport()
    limit = LIST_LIMIT if max_entries is None else min(max_entries, LIST_LIMIT)
    for key, stored_size in entries(limit):
        if max_entries is not None and report.loaded >= max_entries:
            break
        if max_bytes is not None and report.bytes + stored_size > max_bytes:
            continue  # a smaller, colder value may still fit
        loaded = sink(key)
        if loaded is None:
            report.skipped += 1
        else:
            report.loaded += 1
            report.bytes += loaded
        if progress is not None:
            progress(report)
    report.seconds = time.perf_counter() - start
    log.info("KV warm-up: %d values (%d bytes) loaded, %d skipped, in %.2f s", report.loaded, report.bytes,
             report.skipped, report.seconds)
    return report
