"""Digests: ``xxh3-128:<32 hex digits>`` of bytes, of files, and of byte ranges of a file in one streamed pass.

XXH3-128 detects corruption and truncation at memory speed; it is not a defence against a deliberate forger (see
docs/checkpoint-format.md). Used by manifests, ``preheat verify``, conversion and the model cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

from preheat.errors import CheckpointError

DIGEST_PREFIX = "xxh3-128:"
_HASH_CHUNK = 8 * 1024 * 1024  # large enough that per-call overhead vanishes, small enough to stay in L2/L3 cache


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """``"xxh3-128:<32 hex digits>"`` of ``data`` (the digest used everywhere in a manifest)."""
    return DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(data)


def hash_file(
    path: str,
    ranges: Sequence[tuple[int, int]] = (),
    *,
    progress: Callable[[int], None] | None = None,
) -> tuple[str, list[str]]:
    """Stream ``path`` once; return its whole-file digest and the digest of each ``(offset, length)`` range.

    A range that runs past the end of the file gets the digest of the bytes that exist (so it will not match).
    ``progress(nbytes)`` is called after each chunk.
    """
    whole = xxhash.xxh3_128()
    hashers = [xxhash.xxh3_128() for _ in ranges]
    order = sorted(range(len(ranges)), key=lambda k: ranges[k][0])
    first = 0  # ranges before this one in ``order`` ended before the current chunk
    buf = bytearray(_HASH_CHUNK)
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
