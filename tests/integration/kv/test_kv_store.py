"""The engine-neutral blob store (``preheat.kv.store``) over a real directory, real processes and a real Redis:
round trips, batches, namespaces, every fault a miss and a counter (never wrong bytes, never an exception), restart
survival, and two processes sharing one store."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvchunks import Clock, tiny_tmpfs
from kvstorekit import NS, counters, damage, stored_path, value
from preheat.core.errors import ConfigError
from preheat.kv import chunkfile
from preheat.kv.blob_reads import PIECEWISE_BYTES
from preheat.kv.redis_tier import RedisTier
from preheat.kv.store import BlobStore, Namespace, open_store
from preheat.testing.redisserver import RedisServer

# A child imports the helpers at tests/ top level (kvstorekit), as this module does.
TESTS = str(Path(__file__).resolve().parents[2])
OTHER = Namespace(model="org/other-model@0123abcd", engine="test-engine", layout=dict(NS.layout))
# Keys as engines write them: LMCache's "fmt@model@world@worker@hash@dtype", SGLang's hex page hashes, vLLM's ints.
KEYS = ["vllm@org/model@1@0@5f3a9c@bfloat16", "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "1234567890123", ".hidden?*/../x", "ü" * 200]


def into(buffer: bytearray) -> Callable[[int, bytes], memoryview]:
    """An ``allocate`` for ``get_into`` that hands back ``buffer``."""
    return lambda _n, _peek: memoryview(buffer)


# -- round trips ---------------------------------------------------------------------------------------------------


def test_values_round_trip_under_engine_keys(store_url: str) -> None:
    store = open_store(store_url, NS)
    for i, key in enumerate(KEYS):
        assert store.put(key, value(i))
    for i, key in enumerate(KEYS):
        assert store.exists(key)
        assert bytes(store.get(key) or b"") == value(i)
        buffer = bytearray(len(value(i)) + 10)
        assert store.get_into(key, into(buffer)) == len(value(i))
        assert bytes(buffer[: len(value(i))]) == value(i)
    assert store.get("absent") is None
    assert not store.exists("absent")
    assert sorted(store.keys(100)) == sorted(KEYS)  # long keys are stored under a hash and listed from headers
    assert counters(store)["hits"] == 2 * len(KEYS)
    assert counters(store)["misses"] == 1
    store.close()


def test_batches_keep_order_and_report_each_value(store_url: str) -> None:
    store = open_store(store_url, NS)
    items = [(f"page-{i:03d}", value(i, 1000 + i)) for i in range(20)]
    assert store.put_many(items[:15]) == [True] * 15
    keys = [k for k, _ in items]
    got = store.get_many(keys)
    assert [bytes(v) if v is not None else None for v in got] == [v for _, v in items[:15]] + [None] * 5
    assert store.exists_many(keys) == [True] * 15 + [False] * 5
    assert store.prefix_length(keys) == 15
    assert store.prefix_length(["page-000", "absent", "page-002"]) == 1
    assert store.get_many([]) == []
    assert store.put_many([]) == []


def test_an_empty_value_and_a_bad_key_are_handled(store_url: str) -> None:
    store = open_store(store_url, NS)
    assert store.put("empty", b"")
    empty = store.get("empty")
    assert empty is not None
    assert bytes(empty) == b""
    assert not store.put("", b"x")  # no key: not stored, no exception
    assert store.get("") is None
    assert not store.put("k" * 5000, b"x")  # longer than any header takes
    assert [v is not None for v in store.get_many(["", "empty"])] == [False, True]


def test_a_put_keeps_a_valid_value_and_replaces_a_damaged_one(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    store.put("k", value(1))
    damage(store, "k", "flip")
    assert store.put("k", value(1))  # the damaged file is replaced: a recompute heals it
    assert bytes(store.get("k") or b"") == value(1)
    assert counters(store)["corrupt"] == 1


# -- namespaces ----------------------------------------------------------------------------------------------------


def test_namespaces_never_answer_for_each_other(store_url: str) -> None:
    store, other = open_store(store_url, NS), open_store(store_url, OTHER)
    store.put("shared-key", value(1))
    other.put("shared-key", value(2))
    assert bytes(store.get("shared-key") or b"") == value(1)
    assert bytes(other.get("shared-key") or b"") == value(2)
    assert not other.exists("only-in-ns")
    assert NS.id != OTHER.id


def test_a_value_moved_into_another_namespace_is_a_miss(tmp_path: Path) -> None:
    store, other = open_store(f"fs://{tmp_path}", NS), open_store(f"fs://{tmp_path}", OTHER)
    store.put("k", value(1))
    target = stored_path(other, "k")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(stored_path(store, "k").read_bytes())  # someone copies NS's file into OTHER's directory
    assert other.get("k") is None
    assert other.get_into("k", lambda n, _peek: memoryview(bytearray(n))) is None
    assert counters(other)["corrupt"] == 1
    assert not target.exists()
    assert bytes(store.get("k") or b"") == value(1)


def test_the_namespace_is_described_beside_its_values(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    store.put("k", b"v")
    description = (tmp_path / "v1" / NS.id / "namespace.json").read_text()
    assert '"model": "org/model@0123abcd"' in description
    assert store.keys(10) == ["k"]  # the description is not a value


# -- faults --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_value_is_a_miss_counted_and_removed(store_url: str, how: str) -> None:
    store = open_store(store_url, NS)
    for key in ("a", "b"):
        store.put(key, value(7))
    damage(store, "a", how)
    damage(store, "b", how)
    assert store.get("a") is None
    assert store.get_into("b", lambda n, _peek: memoryview(bytearray(n))) is None
    assert counters(store)["corrupt"] == 2
    assert not store.exists("a")  # removed
    assert store.get("a") is None
    assert counters(store)["corrupt"] == 2


def test_a_planted_huge_or_special_file_is_a_miss(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS, max_value_bytes=1 << 20)
    path = stored_path(store, "huge")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)  # sparse: 1 GiB under a value's name, never read
    assert store.get("huge") is None
    assert not store.exists("huge")
    fifo = stored_path(store, "fifo")
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    assert store.get_into("fifo", lambda n, _peek: memoryview(bytearray(n))) is None  # never blocks
    assert not store.put("big", bytes((1 << 20) + 1))  # larger than any value may be
    assert counters(store)["refused"] == 1


def test_a_quota_smaller_than_one_value_stores_nothing(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS, max_bytes=32 << 10)
    assert not store.put("k", value(1, 64 << 10))
    assert counters(store)["refused"] == 1
    assert store.get("k") is None
    assert not list(tmp_path.rglob("*.kvc"))
    assert store.put("small", b"fits")


def test_the_quota_evicts_least_recently_used_values(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS, max_bytes="400KiB")
    for i in range(4):
        store.put(f"k{i}", value(i, 64 << 10))
        os.utime(stored_path(store, f"k{i}"), (1000 + i, 1000 + i))
    assert store.get("k0") is not None  # k0 is used again: k1 is now the oldest
    for i in range(4, 8):
        store.put(f"k{i}", value(i, 64 << 10))
    assert store.get("k1") is None
    assert store.get("k0") is not None
    assert counters(store)["evictions"] >= 1
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvc")) <= 400 << 10


def test_a_full_disk_is_a_failed_put_not_an_exception(tmp_path: Path) -> None:
    # Without root, the RLIMIT_FSIZE test below still covers a failing write.
    with tiny_tmpfs(tmp_path / "tiny", "256k") as mount:
        store = open_store(f"fs://{mount}", NS)
        results = [store.put(f"k{i}", value(i, 64 << 10)) for i in range(8)]
        assert results[0]
        assert not all(results)
        assert counters(store)["errors"] >= 1
        assert store.up  # a full disk is not a dead mount: reads go on
        assert bytes(store.get("k0") or b"") == value(0, 64 << 10)
        assert not list(mount.rglob("*.tmp"))  # no partial file left behind


FSIZE = """
import resource, signal, sys
from kvstorekit import NS, value
from preheat.kv.store import open_store
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
store = open_store("fs://" + sys.argv[1], NS)
print(store.put("big", value(1, 64 << 10)), store.put("small", b"x" * 100), store.stats.snapshot()["errors"])
"""


def test_a_write_over_the_file_size_limit_is_a_failed_put(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", FSIZE, str(tmp_path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": TESTS})
    assert out.stdout.split() == ["False", "True", "1"]
    assert not list(tmp_path.rglob("*.tmp"))


def test_redis_killed_mid_run_is_misses_then_recovers(own_redis: RedisServer) -> None:
    clock = Clock()
    storage = RedisTier(own_redis.url, chunkfile.BlobExpect(NS.id, 1 << 20), retry_s=5, clock=clock)
    store = BlobStore(storage, NS)
    assert store.put_many([("a", b"1"), ("b", b"2")]) == [True, True]
    own_redis.stop()
    assert store.get_many(["a", "b"]) == [None, None]
    assert not store.up
    assert store.put_many([("c", b"3")]) == [False]
    assert store.exists_many(["a"]) == [False]
    assert store.get_into("a", lambda n, _peek: memoryview(bytearray(n))) is None
    assert counters(store)["errors"] >= 1
    own_redis.start()  # empty again: nothing persisted
    clock.advance(5.1)
    assert store.put("c", b"3")
    assert bytes(store.get("c") or b"") == b"3"
    assert store.get("a") is None


def test_redis_down_at_open_is_a_store_that_misses(own_redis: RedisServer) -> None:
    own_redis.stop()
    store = open_store(own_redis.url, NS)
    assert not store.up
    assert store.get("a") is None
    assert not store.put("a", b"1")


def test_bad_urls_are_refused_at_open(tmp_path: Path) -> None:
    for bad in ("s3://bucket/kv", "fs://relative/path", "redis://:pw@host:notaport/0"):
        with pytest.raises(ConfigError) as caught:
            open_store(bad, NS)
        assert "pw" not in str(caught.value)
    with pytest.raises(ConfigError):
        open_store("redis://127.0.0.1:6379/0", NS, max_bytes="1GiB")
    missing = open_store(f"fs://{tmp_path / 'not-mounted' / 'kv'}", NS)  # a missing mount: down, nothing made
    assert not missing.up
    assert not missing.put("k", b"v")
    assert not (tmp_path / "not-mounted").exists()
    fresh = open_store(f"fs://{tmp_path / 'fresh'}", NS)  # its parent exists: made, as `preheat serve` does
    assert fresh.up
    assert fresh.put("k", b"v")


def test_signed_values_refuse_unsigned_ones(tmp_path: Path) -> None:
    secret = tmp_path / "kv.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    root = tmp_path / "kv"
    root.mkdir()
    plain, signed = open_store(f"fs://{root}", NS), open_store(f"fs://{root}", NS, secret_file=str(secret))
    plain.put("forged", value(1))
    assert signed.get("forged") is None
    assert counters(signed)["mac_failures"] == 1
    signed.put("genuine", value(2))
    assert bytes(signed.get("genuine") or b"") == value(2)
    assert signed.get_into("genuine", lambda n, _peek: memoryview(bytearray(n))) == len(value(2))
    assert plain.get("genuine") is None


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_signed_value_read_in_one_call_is_a_miss(tmp_path: Path, how: str) -> None:
    # SGLang's and vLLM's reads (no peek: header, value and tag in one preadv) check the tag as every read does.
    secret = tmp_path / "kv.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    root = tmp_path / "kv"
    root.mkdir()
    store = open_store(f"fs://{root}", NS, secret_file=str(secret))
    for key in ("good", "bad"):
        assert store.put(key, value(3))
    buffer = bytearray(len(value(3)))
    assert store.get_into("good", into(buffer), peek=False) == len(buffer)
    assert bytes(buffer) == value(3)
    damage(store, "bad", how)
    assert store.get_into("bad", lambda n, _peek: memoryview(bytearray(n)), peek=False) is None
    assert counters(store)["corrupt"] == 1
    assert not stored_path(store, "bad").exists()


# -- restarts and other processes ----------------------------------------------------------------------------------

READER = """
import sys
from kvstorekit import NS, value
from preheat.kv.store import open_store
store = open_store(sys.argv[1], NS)
found = [store.get(f"k{i}") for i in range(int(sys.argv[2]))]
print(sum(v is not None and bytes(v) == value(i) for i, v in enumerate(found)))
"""

WRITER = """
import sys
from kvstorekit import NS, value
from preheat.kv.store import open_store
store = open_store(sys.argv[1], NS)
first, count = int(sys.argv[2]), int(sys.argv[3])
print(sum(store.put(f"k{i}", value(i)) for i in range(first, first + count)))
"""


def python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": TESTS})


def test_a_restarted_process_finds_every_entry(store_url: str) -> None:
    writer = python(WRITER, store_url, "0", "40")
    assert writer.communicate()[0].strip() == "40"
    reader = python(READER, store_url, "40")  # a new process: the directory (or Redis) is the index
    assert reader.communicate()[0].strip() == "40"


def test_two_processes_share_one_fs_store(tmp_path: Path) -> None:
    url = f"fs://{tmp_path}"
    writers = [python(WRITER, url, "0", "30"), python(WRITER, url, "20", "30")]  # overlapping keys 20..29
    assert [w.communicate()[0].strip() for w in writers] == ["30", "30"]
    reader = python(READER, url, "50")
    assert reader.communicate()[0].strip() == "50"
    assert not list(tmp_path.rglob("*.tmp"))


@contextlib.contextmanager
def _no_core() -> Iterator[None]:
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, old)


def test_a_writer_killed_mid_write_leaves_no_value(tmp_path: Path) -> None:
    url = f"fs://{tmp_path}"
    with _no_core():
        writer = python(WRITER.replace("value(i)", "value(i, 8 << 20)"), url, "0", "1000")
        reader_store = open_store(url, NS)
        while not list(tmp_path.rglob("*.kvc")):
            pass
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    found = [reader_store.get(f"k{i}") for i in range(1000)]
    assert all(v is None or bytes(v) == value(i, 8 << 20) for i, v in enumerate(found))
    assert counters(reader_store)["corrupt"] == 0  # a partial write is never under a value's name


def test_get_into_scatters_a_value_by_the_header_it_peeks_at(store_url: str) -> None:
    # An engine keeping a small header at the front of its value (LMCache's RemoteMetadata) sizes its buffers from
    # it, then receives the rest straight into its own memory.
    store = open_store(store_url, NS)
    body = value(3, 100_000)
    store.put("k", len(body).to_bytes(8, "little") + body)
    header, data = bytearray(8), bytearray(200_000)

    def allocate(n: int, peek: bytes) -> list[memoryview]:
        assert n == 8 + int.from_bytes(peek[:8], "little")  # the header, unverified, then checked with the rest
        return [memoryview(header), memoryview(data)]

    assert store.get_into("k", allocate) == 8 + len(body)
    assert bytes(data[: len(body)]) == body
    assert store.get_into("k", lambda _n, _peek: [memoryview(bytearray(8))]) is None  # no room: a miss
    assert store.get("k") is not None  # and nothing was removed


def test_get_into_without_a_peek_reads_header_and_value_at_once_and_checks_both(tmp_path: Path) -> None:
    # SGLang and vLLM size their buffers from the length alone: header and value are then read in one call.
    store = open_store(f"fs://{tmp_path}", NS)
    for key in ("k", "header", "room"):
        store.put(key, value(5))
    buffer = bytearray(len(value(5)))
    assert store.get_into("k", lambda n, peek: memoryview(buffer), peek=False) == len(buffer)
    assert bytes(buffer) == value(5)
    assert store.get_into("room", lambda n, peek: None, peek=False) is None  # no room: a miss, the value stays
    assert store.exists("room")
    path = stored_path(store, "header")
    blob = bytearray(path.read_bytes())
    blob[70] ^= 0x01  # inside the JSON header, after the checksum
    path.write_bytes(bytes(blob))
    assert store.get_into("header", lambda n, peek: memoryview(bytearray(n)), peek=False) is None
    assert counters(store)["corrupt"] == 1
    assert not path.exists()


def test_a_value_whose_header_is_laid_out_otherwise_still_reads(tmp_path: Path) -> None:
    # Another writer of the format (an older or newer preheat) may lay the JSON header out differently: the
    # one-call read cannot place its value, so the header is read first, and the value is found all the same.
    store = open_store(f"fs://{tmp_path}", NS)
    store.put("k", value(6))
    path = stored_path(store, "k")
    blob = path.read_bytes()
    head = chunkfile.head_length(blob)
    header = json.loads(blob[16:head])
    raw = json.dumps(header, indent=2).encode()  # valid, longer, keys in another layout
    raw += b" " * (-(16 + len(raw)) % 64)
    path.write_bytes(blob[:8] + struct.pack("<II", 1, len(raw)) + raw + blob[head:])
    assert bytes(store.get("k") or b"") == value(6)
    buffer = bytearray(len(value(6)))
    assert store.get_into("k", lambda n, peek: memoryview(buffer), peek=False) == len(buffer)
    assert bytes(buffer) == value(6)
    assert counters(store)["corrupt"] == 0


def test_a_hit_refreshes_the_lru_recency_to_the_second(tmp_path: Path) -> None:
    # Recency is the file's mtime, shared by every process: a hit sets it to now unless it is under a second
    # old already (a hot value is not re-stamped on every read).
    store = open_store(f"fs://{tmp_path}", NS)
    store.put("k", value(1))
    path = stored_path(store, "k")
    os.utime(path, (1000, 1000))
    assert store.get("k") is not None
    refreshed = path.stat().st_mtime
    assert refreshed > 1000 + 86400
    recent = time.time() - 0.25
    os.utime(path, (recent, recent))
    assert store.get_into("k", lambda n, peek: memoryview(bytearray(n)), peek=False) is not None
    assert path.stat().st_mtime == pytest.approx(recent, abs=1e-3)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_large_value_read_in_one_call_is_checked_all_the_same(tmp_path: Path, how: str) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    big = value(8, (9 << 20) + 123)
    for key in ("good", "bad"):
        assert store.put(key, big)
    buffer = bytearray(len(big))
    assert store.get_into("good", lambda n, peek: memoryview(buffer), peek=False) == len(big)
    assert bytes(buffer) == big
    damage(store, "bad", how)
    assert store.get_into("bad", lambda n, peek: memoryview(bytearray(n)), peek=False) is None
    assert bytes(store.get("good") or b"") == big
    assert counters(store)["corrupt"] == 1


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_value_read_and_hashed_piece_by_piece_is_checked_all_the_same(tmp_path: Path, how: str) -> None:
    # A value of PIECEWISE_BYTES or more is read a MiB at a time and hashed as it arrives: a flipped byte or a
    # truncated file anywhere in it is still a miss, never a value.
    store = open_store(f"fs://{tmp_path}", NS)
    big = value(9, PIECEWISE_BYTES + (1 << 20) + 123)
    for key in ("good", "bad"):
        assert store.put(key, big)
    buffer = bytearray(len(big))
    assert store.get_into("good", into(buffer), peek=False) == len(big)
    assert bytes(buffer) == big
    damage(store, "bad", how)
    assert store.get_into("bad", lambda n, _peek: memoryview(bytearray(n)), peek=False) is None
    assert counters(store)["corrupt"] == 1
    assert not stored_path(store, "bad").exists()


# -- the write path: payload first, hashed as it is written ----------------------------------------------------------

WRITE_SIZES = [0, 1, 100, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 123]


@pytest.mark.parametrize("size", WRITE_SIZES)
def test_a_stored_value_is_the_chunk_format_byte_for_byte(tmp_path: Path, size: int) -> None:
    # fs:// writes a value's payload before its header (hashing it as it goes, in pieces above a MiB), and the file
    # is still exactly what encode_blob makes: older preheats and Redis read the same bytes.
    store = open_store(f"fs://{tmp_path}", NS)
    for key in ("k", "ü/é?" * 40):
        data = value(size, size)
        assert store.put(key, data)
        pieces = chunkfile.encode_blob(key, NS.id, data)
        assert stored_path(store, key).read_bytes() == b"".join(bytes(p) for p in pieces)
        got = store.get(key)
        assert got is not None
        assert bytes(got) == data


def test_a_value_stored_in_parts_across_piece_boundaries_is_one_value(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    parts = (value(1, (1 << 20) - 7), value(2, 3), value(3, (2 << 20) + 5), b"", value(4, 1000))
    assert store.put("parts", parts)
    joined = b"".join(parts)
    assert bytes(store.get("parts") or b"") == joined
    assert stored_path(store, "parts").read_bytes() == b"".join(
        bytes(p) for p in chunkfile.encode_blob("parts", NS.id, joined))


@pytest.mark.parametrize("where", ["first byte", "first piece", "a middle piece", "last partial piece", "last byte"])
@pytest.mark.parametrize("size", [(3 << 20) + 123, PIECEWISE_BYTES + (2 << 20) + 123])
def test_a_flipped_byte_in_any_piece_is_a_miss(tmp_path: Path, where: str, size: int) -> None:
    # Values above a MiB are written (and from PIECEWISE_BYTES on, read) a MiB at a time, hashed piece by piece:
    # a byte flipped in any piece, the last partial one included, is a miss, counted and removed; never a value.
    store = open_store(f"fs://{tmp_path}", NS)
    data = value(size, size)
    assert store.put("k", data)
    path = stored_path(store, "k")
    blob = bytearray(path.read_bytes())
    start = len(blob) - size
    offset = {"first byte": 0, "first piece": 1000, "a middle piece": (2 << 20) + 17,
              "last partial piece": size - 60, "last byte": size - 1}[where]
    blob[start + offset] ^= 0x40
    path.write_bytes(bytes(blob))
    assert store.get_into("k", lambda n, _peek: memoryview(bytearray(n)), peek=False) is None
    assert counters(store)["corrupt"] == 1
    assert not path.exists()
    assert store.put("k", data)  # a recompute stores it again
    assert store.get_into("k", lambda n, _peek: memoryview(bytearray(n)), peek=False) == size


def test_a_shard_directory_removed_under_a_running_store_is_made_again(tmp_path: Path) -> None:
    # The store makes its 256 shard directories when it opens (no mkdir on the put path); one removed while it
    # runs (by hand, by a cleanup job) costs the next put into it a mkdir, not the value.
    store = open_store(f"fs://{tmp_path}", NS)
    shard = stored_path(store, "k").parent
    assert shard.is_dir()
    shard.rmdir()
    assert store.put("k", value(1))
    assert bytes(store.get("k") or b"") == value(1)
    restarted = open_store(f"fs://{tmp_path}", NS)  # a second process on the directory finds what is there
    assert bytes(restarted.get("k") or b"") == value(1)


def test_shard_directories_that_cannot_be_made_at_open_leave_the_store_up(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Making the shards up front only saves puts a mkdir: a disk or inode quota too full for them (the probe's one
    # small file still fits) must not take the store down, reads of what is there included.
    store = open_store(f"fs://{tmp_path}", NS)
    assert store.put("k", value(1))
    empty = next(p for p in stored_path(store, "k").parent.parent.iterdir() if p.is_dir() and not any(p.iterdir()))
    empty.rmdir()

    def full(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with monkeypatch.context() as patched:
        patched.setattr(os, "mkdir", full)
        reopened = open_store(f"fs://{tmp_path}", NS)
        assert reopened.up
        assert bytes(reopened.get("k") or b"") == value(1)
    assert not empty.exists()
    key = next(f"n{i}" for i in range(100000) if stored_path(reopened, f"n{i}").parent == empty)
    assert reopened.put(key, value(2))  # the first put into the missing shard makes it
    assert bytes(reopened.get(key) or b"") == value(2)
