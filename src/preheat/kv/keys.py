"""Portable KV chunk keys: which chunk of which prompt, under which model and KV layout (spec: docs/kv-keys.md).

A prompt's K/V is cached in *full* chunks of C tokens (default 256). Chunk i's key is a chained hash::

    key[0] = XXH3-128(fingerprint_bytes || tokens[0:C] as uint32 little-endian)
    key[i] = XXH3-128(key[i-1]        || tokens[i*C:(i+1)*C] as uint32 little-endian)

so a key names the chunk *and every token before it* (K/V depend on the whole prefix). The fingerprint seeds the
chain with everything that makes K/V bytes comparable: the checkpoint identity, the KV layout (dtype, layers, KV
heads, head dim, block size), the stored KV dtype, the TP rank and size, C, and the RoPE settings. It is a hash of
canonical JSON, so it is the same in every process and on every machine (no ``hash()``, no PYTHONHASHSEED).

Pure: no torch, no I/O. The engine, the router (``preheat router --policy kv``) and ``preheat analyze`` all call
these functions, so a key computed anywhere names the same chunk everywhere (``--policy prefix`` chains the same
hash over prompt text, ``chained_keys``: keys of its own, naming no cached K/V).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

import xxhash

from preheat.core.errors import KVError

KEY_VERSION = 1  # bump when the recipe below changes: old chunks then simply stop matching
DEFAULT_CHUNK_TOKENS = 256
KV_DTYPES = ("auto", "int8", "fp8")  # --kv-dtype; part of the fingerprint. auto: the compute dtype's bytes exactly
_U32_MAX = 2**32 - 1
K = TypeVar("K", bound=Hashable)  # a chunk key: hex strings here, integers in the analyzer's compact traces


def fingerprint(
    *,
    identity: str,
    layout: Mapping[str, object],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    tp_rank: int = 0,
    tp_size: int = 1,
    rope: Mapping[str, object] | None = None,
    kv_dtype: str | None = None,
) -> str:
    """The 32-hex-digit seed of every chunk key for one model + KV layout.

    ``identity``: the checkpoint's ``preheat.json`` identity (or another string naming the exact weights).
    ``layout``: ``KVLayout.to_dict()`` (or any JSON object describing the cache). ``kv_dtype``: how chunks are
    *stored* when that differs from the layout's dtype (``int8``/``fp8`` tiers), so quantized and exact chunks
    never answer for each other.

    >>> fp = fingerprint(identity="abc", layout={"num_layers": 2}, chunk_tokens=4)
    >>> fp == fingerprint(identity="abc", layout={"num_layers": 2}, chunk_tokens=4), len(fp)
    (True, 32)
    >>> fp == fingerprint(identity="abd", layout={"num_layers": 2}, chunk_tokens=4)
    False
    """
    check_chunk_tokens(chunk_tokens)
    if not identity:
        raise KVError("a KV fingerprint needs the checkpoint identity (got an empty string)")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise KVError(f"TP rank {tp_rank} is not in 0..{tp_size - 1}")
    document = {
        "version": KEY_VERSION,
        "identity": identity,
        "layout": dict(layout),
        "kv_dtype": kv_dtype,
        "chunk_tokens": chunk_tokens,
        "tp": [tp_rank, tp_size],
        "rope": dict(rope) if rope is not None else None,
    }
    try:
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise KVError(f"the KV fingerprint's fields must be plain JSON values: {exc}") from exc
    return xxhash.xxh3_128_hexdigest(b"preheat-kv-fingerprint\x00" + canonical.encode("ascii"))


def chunk_keys(
    fingerprint_hex: str,
    token_ids: Sequence[int],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    *,
    limit: int | None = None,
) -> list[str]:
    """Keys (32 hex digits) of the full chunks of ``token_ids``, in order; a trailing partial chunk has none.

    ``limit`` caps how many keys are computed (the engine never restores a prompt's last token, so it asks for
    ``cacheable_chunks(len(prompt), C)``).

    >>> fp = "0" * 32
    >>> keys = chunk_keys(fp, list(range(10)), 4)
    >>> len(keys), keys == chunk_keys(fp, list(range(8)), 4), keys[0] == chunk_keys(fp, [0, 1, 2, 3, 99], 4)[0]
    (2, True, True)
    """
    check_chunk_tokens(chunk_tokens)
    seed = _seed(fingerprint_hex)
    count = len(token_ids) // chunk_tokens
    if limit is not None:
        count = min(count, max(limit, 0))
    if count == 0:
        return []
    try:
        packed = array("I", token_ids[: count * chunk_tokens])
    except (OverflowError, TypeError) as exc:
        raise KVError(f"token ids must be integers in 0..{_U32_MAX}: {exc}") from exc
    if packed.itemsize != 4:  # pragma: no cover - every platform CPython supports has a 4-byte unsigned int
        raise KVError("this platform's array('I') is not 32-bit")
    if array("I", [1]).tobytes() != b"\x01\x00\x00\x00":
        packed.byteswap()  # keys are defined on little-endian ids
    return chained_keys(seed, memoryview(packed).cast("B"), chunk_tokens * 4, count)


def chained_keys(seed: bytes, data: bytes | memoryview, step: int, count: int) -> list[str]:
    """The chain of ``chunk_keys`` over any bytes: ``count`` keys of ``step``-byte chunks of ``data``, each the
    XXH3-128 of the key before it (``seed`` for the first) and its chunk. The router keys prompt text with it too.

    >>> a, b = chained_keys(b"\\0" * 16, b"abcdef", 2, 3), chained_keys(b"\\0" * 16, b"abXdef", 2, 3)
    >>> a[0] == b[0], a[1] == b[1], a[2] == b[2]  # a chunk's key names every byte before it too
    (True, False, False)
    """
    keys: list[str] = []
    prev = seed
    view = memoryview(data)
    for i in range(count):
        digest = xxhash.xxh3_128_digest(prev + bytes(view[i * step : (i + 1) * step]))
        keys.append(digest.hex())
        prev = digest
    return keys


def cacheable_chunks(n_prompt_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """How many leading full chunks of a prompt may come from a cache: the last prompt token is always computed
    (its logits start generation), so a prompt of exactly k*C tokens can reuse k-1 chunks.

    >>> cacheable_chunks(512, 256), cacheable_chunks(513, 256), cacheable_chunks(255, 256)
    (1, 2, 0)
    """
    return max(n_prompt_tokens - 1, 0) // chunk_tokens


def split_hits(keys: Iterable[K], l1: Container[K], l2: Container[K]) -> tuple[int, int]:
    """How many leading chunks of ``keys`` restore from L1 and from L2; the run ends at the first chunk in neither
    (K/V of a chunk are only valid after every chunk before it). The engine, the router and the analyzer all count
    hits this way.

    >>> split_hits(["a", "b", "c", "d"], {"a", "c"}, {"b"})
    (2, 1)
    """
    in_l1 = in_l2 = 0
    for key in keys:
        if key in l1:
            in_l1 += 1
        elif key in l2:
            in_l2 += 1
        else:
            break
    return in_l1, in_l2


def check_chunk_tokens(chunk_tokens: int) -> None:
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise KVError(f"the KV chunk size must be a positive number of tokens (got {chunk_tokens!r})")


def _seed(fingerprint_hex: str) -> bytes:
    try:
        seed = bytes.fromhex(fingerprint_hex)
    except ValueError:
        seed = b""
    if len(seed) != 16:
        raise KVError(f"a KV fingerprint is 32 hex digits (got {fingerprint_hex!r})")
    return seed
