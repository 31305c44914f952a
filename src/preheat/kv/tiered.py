"""``TieredKV``: the engine's view of the KV tiers, L1 (host memory) then L2 (shared), then recompute.

``lookup`` walks a prompt's chunk keys in order, L1 first then L2, and stops at the first chunk found nowhere: K/V
of a chunk are only valid after every chunk before it. L2 hits are promoted to L1. ``store`` puts a new chunk in L1
at once (one host copy, quantized if ``kv_dtype`` says so) and queues it for L2 on a background thread; when that
queue is full the chunk is dropped for L2 (counted), so a slow or dead L2 never delays a request. ``close`` gives
what is queued a deadline to reach L2 and drops (and counts) the rest, so a hung L2 never holds up a shutdown either.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import torch

from preheat.kv.chunk import StoredChunk, store_form
from preheat.kv.events import Costs, EventLog
from preheat.kv.memory import MemoryTier
from preheat.kv.tier import Tier

log = logging.getLogger("preheat.kv")

DEFAULT_QUEUE = 64  # chunks waiting for L2 (for SmolLM2 in float32, 64 x 12 MB)
CLOSE_DEADLINE_S = 5.0  # what a shutdown waits for queued chunks to reach L2 (Kubernetes' grace period is 30 s)


class TieredKV:
    """The tiers of one engine. Thread-safe: the generation thread looks up and stores, a writer thread feeds L2,
    HTTP threads read stats and events."""

    def __init__(
        self,
        *,
        fingerprint: str,
        chunk_tokens: int,
        events: EventLog,
        l1: MemoryTier | None = None,
        l2: Tier | None = None,
        kv_dtype: str = "auto",
        pin: bool = False,
        queue_size: int = DEFAULT_QUEUE,
        keyed: bool = False,
    ) -> None:
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens
        self.kv_dtype = kv_dtype
        self.pin = pin
        self.l1 = l1
        self.l2 = l2
        self.keyed = keyed  # L2 chunks are signed and checked with the fleet's MAC key (--kv-secret-file)
        self.events = events
        self.costs = Costs()
        self.dropped = 0  # chunks not written to L2: its queue was full, or still queued at close's deadline
        self._closing = False
        self._queue: queue.Queue[tuple[str, StoredChunk] | None] = queue.Queue(maxsize=queue_size)
        self._writer: threading.Thread | None = None
        if l2 is not None:
            self._writer = threading.Thread(target=self._write_l2, name="preheat-kv-l2-writer", daemon=True)
            self._writer.start()

    @property
    def tiers(self) -> list[Tier]:
        return [t for t in (self.l1, self.l2) if t is not None]

    def lookup(self, keys: list[str]) -> list[StoredChunk]:
        """The chunks of the longest run of leading ``keys`` found in some tier (L2 hits promoted to L1)."""
        found: list[StoredChunk] = []
        for key in keys:
            chunk, tier = self._get(key)
            if chunk is None:
                break
            if tier == "l2" and self.l1 is not None and self.l1.put(key, self.for_l1(chunk)):
                self.events.emit("store", "l1", key)
            found.append(chunk)
        return found

    def _get(self, key: str) -> tuple[StoredChunk | None, str]:
        if self.l1 is not None:
            start = time.perf_counter()
            chunk = self.l1.get(key)
            if chunk is not None:
                self.costs.observe("l1", time.perf_counter() - start, self.chunk_tokens)
                return chunk, "l1"
        if self.l2 is not None:
            start = time.perf_counter()
            chunk = self.l2.get(key)
            if chunk is not None:
                self.costs.observe("l2", time.perf_counter() - start, self.chunk_tokens)
                return chunk, "l2"
        return None, ""

    def for_l1(self, chunk: StoredChunk) -> StoredChunk:
        """``chunk`` (read from L2) as L1 keeps it: as it is, or copied to pinned memory on a CUDA engine."""
        if not self.pin:
            return chunk  # views of the bytes read from L2: kept as they are, no copy
        data = torch.empty(chunk.data.shape, dtype=chunk.data.dtype, pin_memory=True)
        data.copy_(chunk.data)
        scales = None
        if chunk.scales is not None:
            scales = torch.empty(chunk.scales.shape, dtype=torch.float32, pin_memory=True)
            scales.copy_(chunk.scales)
        return StoredChunk(data, scales)

    def store(self, key: str, view: torch.Tensor) -> None:
        """Keep the chunk exported as ``view`` (copied now: the engine reuses its blocks). Skips keys L1 holds."""
        if self.l1 is not None and self.l1.contains(key):
            return
        chunk = store_form(view, self.kv_dtype, pin=self.pin)
        if self.l1 is not None and self.l1.put(key, chunk):
            self.events.emit("store", "l1", key)
        if self.l2 is not None:
            try:
                if self._closing:
                    raise queue.Full  # the writer is being stopped: nothing more goes its way
                self._queue.put_nowait((key, chunk))
            except queue.Full:
                self.dropped += 1

    def _write_l2(self) -> None:
        assert self.l2 is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, chunk = item
                if self.l2.put(key, chunk):
                    self.events.emit("store", "l2", key)
            except Exception:  # the writer must outlive any one bad chunk; the failure is logged, the chunk dropped
                log.exception("KV L2 writer: storing a chunk failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued chunk has been written to L2 (tests, benchmarks, shutdown)."""
        if self._writer is not None:
            self._queue.join()

    def close(self, deadline_s: float = CLOSE_DEADLINE_S) -> None:
        """Write what is queued for L2 within ``deadline_s`` seconds, then close the tiers. Chunks still queued at
        the deadline (an L2 write that hangs, with the queue full behind it) are dropped and counted in
        ``dropped``; the writer thread, stuck in that write, is left to end with the process (it is a daemon)."""
        writer = self._writer
        if writer is not None:
            self._closing = True
            until = time.monotonic() + max(deadline_s, 0.0)
            with contextlib.suppress(queue.Full):  # full until the deadline: the writer is stuck, see below
                self._queue.put(None, timeout=max(deadline_s, 0.0))  # the writer's signal to stop, after the queue
            writer.join(timeout=max(until - time.monotonic(), 0.0))
            if writer.is_alive():
                lost = self._drop_queued()
                log.warning(
                    "KV L2: %d queued chunk(s) dropped at shutdown: L2 did not take them within %g s (a write hangs)",
                    lost,
                    deadline_s,
                )
        for tier in self.tiers:
            tier.close()

    def _drop_queued(self) -> int:
        """Take every chunk off the L2 queue unwritten (counted in ``dropped``) and leave the stop signal alone in
        it, so a writer whose hung write ever returns ends there."""
        lost = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            if item is not None:
                lost += 1
        self.dropped += lost
        self._queue.put_nowait(None)  # room: the queue was just emptied, and store() queues nothing more
        return lost
