"""Digests: ``xxh3-128:<32 hex digits>`` of bytes, of files, and of byte ranges of a file in one streamed pass; and
``TensorDigests``, which checks tensors against their digests while a load's bytes land.

XXH3-128 detects corruption and truncation at memory speed; it is not a defence against a deliberate forger (see
docs/checkpoint-format.md). Used by manifests, ``preheat verify``, conversion, the model cache and ``preheat.load``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from preheat.core.errors import CheckpointError

DIGEST_PREFIX = "xxh3-128:"
HASH_CHUNK = 8 * 1024 * 1024  # large enough that per-call overhead vanishes, small enough to stay in L2/L3 cache


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """``"xxh3-128:<32 hex digits>"`` of ``data`` (the digest used everywhere in a manifest)."""
    return DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(data)


def hash_file(
    path: str,
    ranges: Sequence[tuple[int, int]] = (),
    *,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = HASH_CHUNK,
) -> tuple[str, list[str]]:
    """Stream ``path`` once; return its whole-file digest and the digest of each ``(offset, length)`` range.

    A range that runs past the end of the file gets the digest of the bytes that exist (so it will not match).
    ``progress(nbytes)`` is called after each chunk of ``chunk_bytes`` read.
    """
    whole = xxhash.xxh3_128()
    hashers = [xxhash.xxh3_128() for _ in ranges]
    order = sorted(range(len(ranges)), key=lambda k: ranges[k][0])
    first = 0  # ranges before this one in ``order`` ended before the current chunk
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    pos = 0
    try:
        with open(path, "rb", buffering=0) as handle:
            while True:
                n = handle.readinto(view)
                if not n:
                    break
                chunk = view[:n]
                whole.update(chunk)
                end = pos + n
                while first < len(order) and sum(ranges[order[first]]) <= pos:
                    first += 1
                for k in order[first:]:
                    start, length = ranges[k]
                    if start >= end:
                        break
                    lo, hi = max(start, pos), min(start + length, end)
                    if hi > lo:
                        hashers[k].update(chunk[lo - pos : hi - pos])
                pos = end
                if progress is not None:
                    progress(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found", path=path) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}", path=path) from None
    return DIGEST_PREFIX + whole.hexdigest(), [DIGEST_PREFIX + h.hexdigest() for h in hashers]


def file_digest(path: str) -> str:
    """The digest of a whole file, streamed in chunks (never loaded into memory at once)."""
    return hash_file(path)[0]


@dataclass(frozen=True)
class ExpectedDigest:
    """Tensor ``name`` is the ``nbytes`` bytes at absolute ``offset`` of its file, and they hash to ``digest``."""

    name: str
    offset: int
    nbytes: int
    digest: str


class _Stream:
    """One tensor being hashed front to back: the prefix hashed so far and the pieces that landed past it."""

    def __init__(self, expected: ExpectedDigest) -> None:
        self.expected = expected
        self.hasher = xxhash.xxh3_128()
        self.hashed = 0
        self.pending: dict[int, memoryview] = {}  # offset within the tensor -> bytes that landed there
        self.busy = False  # a thread is hashing this tensor's pieces (outside the lock)
        self.cond = threading.Condition()


class TensorDigests:
    """Checks the tensors of one file against their digests while the file's bytes land: in any order, from any
    number of threads (a ``preheat.io.reads.Landing``).

    XXH3 hashes a stream, so each tensor is hashed front to back. A piece that lands past the hashed prefix waits in
    ``pending``: as a view of the destination buffer when it is ``stable``, otherwise its thread waits until the
    prefix has passed it (its staging buffer is reused as soon as it returns). Whoever extends a prefix hashes all
    that became contiguous, outside the lock, so a reader thread rarely waits for another. The last byte of a tensor
    completes its digest; a mismatch raises ``CheckpointError`` in that reader thread, which fails the load.

    >>> check = TensorDigests([ExpectedDigest("w", 8, 4, digest_bytes(b"abcd"))], path="f", source="s")
    >>> check.landed(10, memoryview(b"cd"), stable=True); check.landed(8, memoryview(b"ab"), stable=True)
    >>> check.finish()
    1
    """

    def __init__(self, expected: Sequence[ExpectedDigest], *, path: str, source: str) -> None:
        self.path, self.source = path, source
        self._failed = False
        self._count_lock = threading.Lock()
        self.checked = 0  # tensors whose digest matched so far
        streams = []
        for item in sorted(expected, key=lambda e: e.offset):
            if item.nbytes:
                streams.append(_Stream(item))
            else:
                self._compare(item, digest_bytes(b""))
        self._streams = streams
        self._starts = [s.expected.offset for s in streams]

    def landed(self, file_offset: int, data: memoryview, *, stable: bool) -> None:
        """``data`` holds the file's bytes from ``file_offset``; bytes outside every tensor are ignored."""
        end = file_offset + len(data)
        index = max(0, bisect.bisect_right(self._starts, file_offset) - 1)
        while index < len(self._streams) and self._starts[index] < end:
            stream = self._streams[index]
            lo = max(file_offset, stream.expected.offset)
            hi = min(end, stream.expected.offset + stream.expected.nbytes)
            if hi > lo:
                self._feed(stream, lo - stream.expected.offset, data[lo - file_offset : hi - file_offset], stable)
            index += 1

    def abort(self) -> None:
        """The load failed elsewhere: release every thread waiting for its turn."""
        self._failed = True
        for stream in self._streams:
            with stream.cond:
                stream.cond.notify_all()

    def finish(self) -> int:
        """After the reads: every tensor must have been checked (a plan that skipped bytes is a bug, never a pass).
        Returns how many tensors were checked."""
        for stream in self._streams:
            if stream.hashed != stream.expected.nbytes:
                raise CheckpointError(
                    f"{self.path}: only {stream.hashed} of the {stream.expected.nbytes} bytes of tensor "
                    f"{stream.expected.name!r} were checked against its digest; nothing was loaded",
                    path=self.path,
                    tensor=stream.expected.name,
                )
        return self.checked

    def _feed(self, stream: _Stream, at: int, data: memoryview, stable: bool) -> None:
        with stream.cond:
            if self._failed:
                return
            stream.pending[at] = data
            drain = not stream.busy
            stream.busy = True
        if drain:
            self._drain(stream)
        if not stable:
            with stream.cond:
                while stream.hashed <= at and not self._failed:
                    stream.cond.wait()

    def _drain(self, stream: _Stream) -> None:
        """Hash pending pieces while they continue the prefix; the caller set ``busy``, and this clears it."""
        while True:
            with stream.cond:
                piece = stream.pending.pop(stream.hashed, None)
                if piece is None or self._failed:
                    stream.busy = False
                    stream.cond.notify_all()
                    return
            stream.hasher.update(piece)
            with stream.cond:
                stream.hashed += len(piece)
                complete = stream.hashed == stream.expected.nbytes
                stream.cond.notify_all()
            if complete:
                try:
                    self._compare(stream.expected, DIGEST_PREFIX + stream.hasher.hexdigest())
                except CheckpointError:
                    self.abort()
                    with stream.cond:
                        stream.busy = False
                    raise

    def _compare(self, expected: ExpectedDigest, actual: str) -> None:
        if actual != expected.digest:
            raise CheckpointError(
                f"{self.path}: tensor {expected.name!r} does not match its digest in preheat.json (expected "
                f"{expected.digest}, got {actual}): the bytes loaded from {self.source} were corrupted on the way or "
                "changed at the source; nothing was loaded",
                path=self.path,
                tensor=expected.name,
            )
        with self._count_lock:
            self.checked += 1
