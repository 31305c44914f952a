"""The chunk format (header + checksum) and KV quantization: anything wrong is caught, right bytes round-trip."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvchunks import FP, LAYOUT, chunk, expect, exported, key, same
from preheat.core.errors import CorruptChunkError
from preheat.kv import chunkfile
from preheat.kv.chunk import decode_chunk, encode_chunk, store_form
from preheat.kv.memory import MemoryTier


def blob(kv_dtype: str = "auto", k: str | None = None) -> bytearray:
    return bytearray(b"".join(encode_chunk(k or key(0), FP, chunk(0, kv_dtype))))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_a_chunk_round_trips_bit_for_bit(kv_dtype: str) -> None:
    decoded = decode_chunk(blob(kv_dtype), key(0), expect(kv_dtype))
    assert same(decoded, chunk(0, kv_dtype))


@pytest.mark.parametrize("offset", [0, 20, 100, -1, -5000])
def test_any_flipped_bit_is_detected(offset: int) -> None:
    data = blob()
    data[offset] ^= 0x10
    with pytest.raises(CorruptChunkError):
        decode_chunk(data, key(0), expect())


def test_a_torn_chunk_is_detected() -> None:
    data = blob()
    for cut in (0, 10, 200, len(data) - 1):
        with pytest.raises(CorruptChunkError):
            decode_chunk(data[:cut], key(0), expect())


def test_a_chunk_under_another_key_fingerprint_or_dtype_is_refused() -> None:
    with pytest.raises(CorruptChunkError, match="key"):
        decode_chunk(blob(), key(1), expect())
    with pytest.raises(CorruptChunkError, match="fingerprint"):
        decode_chunk(blob(), key(0), expect(fp="f" * 32))
    with pytest.raises(CorruptChunkError, match="dtype"):
        decode_chunk(blob("int8"), key(0), expect("auto"))


@pytest.mark.parametrize(("kv_dtype", "tolerance"), [("int8", 0.01), ("fp8", 0.07)])
def test_quantized_chunks_are_close_and_smaller(kv_dtype: str, tolerance: float) -> None:
    x = exported(3)
    stored = store_form(x, kv_dtype)
    back = torch.empty_like(x)
    stored.load_into(back)
    relative = ((back - x).abs().amax(dim=-1) / x.abs().amax(dim=-1)).max().item()
    assert relative < tolerance
    # float32 K/V with head_dim 8: 8 one-byte values + one 4-byte scale instead of 32 bytes, (8 + 4) / 32.
    assert stored.nbytes == x.numel() * x.element_size() * (8 + 4) // 32


def test_memory_tier_keeps_the_most_recently_used_within_its_capacity() -> None:
    size = chunk(0).nbytes
    evicted: list[str] = []
    tier = MemoryTier(2 * size, on_evict=lambda tier, k: evicted.append(k))
    tier.put(key(0), chunk(0))
    tier.put(key(1), chunk(1))
    assert tier.get(key(0)) is not None  # 0 is now more recent than 1
    tier.put(key(2), chunk(2))
    assert evicted == [key(1)]
    assert tier.get(key(1)) is None
    assert tier.get(key(0)) is not None
    assert tier.get(key(2)) is not None
    assert tier.used <= tier.capacity
    assert not MemoryTier(size - 1).put(key(0), chunk(0))  # bigger than the whole tier: not stored
    assert tier.stats.snapshot()["hits"] == 3
    assert tier.stats.snapshot()["misses"] == 1


def test_layout_shape_matches_the_engine_export() -> None:
    assert tuple(exported().shape) == (2, *LAYOUT.block_shape)


def test_the_chunk_format_imports_without_torch() -> None:
    """The byte format is pure bytes + header: a reader of chunk files (a tool, a fuzzer) never pays for torch."""
    code = "import sys, preheat.kv.chunkfile; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_chunk_format_round_trips_bytes() -> None:
    contents = chunkfile.Contents("int8", "I8", (2, 3), data=bytes(range(6)), scales=bytes(8), scale_shape=(2,))
    blob = b"".join(chunkfile.encode("k", FP, contents))
    payload = chunkfile.decode(blob, "k", chunkfile.Expect(FP, "I8", (2, 3)))
    assert payload.data.tobytes() == bytes(range(6))
    assert payload.scales is not None
    assert payload.scales.tobytes() == bytes(8)
