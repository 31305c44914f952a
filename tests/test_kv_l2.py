"""The L2 tiers against real files, real processes and a real Redis: integrity, concurrency, quota, outages."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchunks import chunk, expect, key, same
from preheat.kv.fs import FileTier
from preheat.kv.redis_tier import RedisTier
from redisserver import RedisServer

TESTS = os.path.dirname(__file__)


def run_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env={**os.environ, "PYTHONPATH": TESTS})


# -- fs:// -------------------------------------------------------------------------------------------------------


def test_fs_chunks_survive_a_restart(tmp_path: Path) -> None:
    FileTier(str(tmp_path), expect()).put(key(0), chunk(0))
    again = FileTier(str(tmp_path), expect())  # a new process would build exactly this: no index to rebuild
    found = again.get(key(0))
    assert found is not None
    assert same(found, chunk(0))
    assert again.keys(10) == [key(0)]


def test_fs_flipped_bit_is_a_miss_and_the_file_is_removed(tmp_path: Path) -> None:
    tier = FileTier(str(tmp_path), expect())
    tier.put(key(0), chunk(0))
    path = Path(tier.path(key(0)))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert tier.get(key(0)) is None
    assert not path.exists()
    assert tier.stats.snapshot()["corrupt"] == 1


def test_fs_chunk_of_another_model_is_never_served(tmp_path: Path) -> None:
    FileTier(str(tmp_path), expect()).put(key(0), chunk(0))
    other = FileTier(str(tmp_path), expect(fp="e" * 32))
    assert other.get(key(0)) is None  # other fingerprint: another directory, and the header check besides


WRITER = """
import os, sys
from kvchunks import chunk, expect, key
from preheat.kv import chunkfile
from preheat.kv.fs import FileTier
tier = FileTier(sys.argv[1], expect())
pieces = chunkfile.encode(key(0), expect().fingerprint, chunk(0))
head = b"".join(pieces)
path = tier.path(key(0))
os.makedirs(os.path.dirname(path), exist_ok=True)
temp = os.path.join(os.path.dirname(path), f".{key(0)}.{os.getpid()}.dead.tmp")
with open(temp, "wb") as handle:          # the same temporary-name protocol as FileTier.put, stopped half-way
    handle.write(head[: len(head) // 2])
    handle.flush()
    print("written", flush=True)
    os.kill(os.getpid(), 9)
"""


def test_fs_writer_killed_mid_write_leaves_no_readable_chunk(tmp_path: Path) -> None:
    proc = run_python(WRITER, str(tmp_path))
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    tier = FileTier(str(tmp_path), expect(), max_bytes=10**9)
    assert tier.get(key(0)) is None  # only the temporary file exists
    temps = list(Path(tier.dir).rglob("*.tmp"))
    assert len(temps) == 1
    old = time.time() - 3600
    os.utime(temps[0], (old, old))
    tier.sweep()
    assert not list(Path(tier.dir).rglob("*.tmp"))  # a dead writer's leftovers are cleaned up


SAME_CHUNK = """
import sys
from kvchunks import chunk, expect, key
from preheat.kv.fs import FileTier
tier = FileTier(sys.argv[1], expect())
for _ in range(40):
    tier.put(key(0), chunk(0))
    got = tier.get(key(0))
    assert got is not None, "a reader saw a missing or corrupt chunk while another process wrote it"
    if tier.stats.corrupt:
        sys.exit("corrupt chunk seen")
"""


def test_fs_two_processes_writing_one_chunk_leave_one_valid_file(tmp_path: Path) -> None:
    # put() skips keys that exist, so remove the file between rounds to force real concurrent writes.
    procs = [run_python(SAME_CHUNK, str(tmp_path)) for _ in range(2)]
    tier = FileTier(str(tmp_path), expect())
    for _ in range(40):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tier.path(key(0)))
        time.sleep(0.005)
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    tier.put(key(0), chunk(0))
    assert [p.name for p in Path(tier.dir).rglob("*") if p.is_file()] == [Path(tier.path(key(0))).name]
    found = tier.get(key(0))
    assert found is not None
    assert same(found, chunk(0))


FILLER = """
import sys
from kvchunks import chunk, expect, key
from preheat.kv.fs import FileTier
tier = FileTier(sys.argv[1], expect(), max_bytes=int(sys.argv[2]))
for i in range(100, 103):
    tier.put(key(i), chunk(i))
tier.sweep()
"""


def test_fs_quota_is_enforced_across_processes_least_recently_used_first(tmp_path: Path) -> None:
    size = os.path.getsize(_one_file(tmp_path / "probe"))
    quota = 8 * size
    tier = FileTier(str(tmp_path), expect(), max_bytes=quota)
    now = time.time()
    for i in range(8):  # chunk 0 written first ... chunk 7 last
        tier.put(key(i), chunk(i))
        os.utime(tier.path(key(i)), (now - 100 + i, now - 100 + i))
    assert tier.get(key(0)) is not None  # read: now the most recently used
    proc = run_python(FILLER, str(tmp_path), str(quota))  # another process writes 3 more and sweeps
    assert proc.wait(timeout=120) == 0
    files = list(Path(tier.dir).rglob("*.kvc"))
    assert sum(f.stat().st_size for f in files) <= quota
    assert Path(tier.path(key(0))).exists()
    assert all(Path(tier.path(key(i))).exists() for i in (100, 101, 102))
    gone = [i for i in range(1, 8) if not Path(tier.path(key(i))).exists()]
    assert gone == list(range(1, len(gone) + 1))
    assert gone


def _one_file(root: Path) -> str:
    root.mkdir()
    tier = FileTier(str(root), expect())
    tier.put(key(0), chunk(0))
    return tier.path(key(0))


def test_fs_missing_directory_marks_the_tier_down(tmp_path: Path) -> None:
    tier = FileTier(str(tmp_path / "not-mounted"), expect())
    assert not tier.up
    assert not tier.put(key(0), chunk(0))
    assert tier.get(key(0)) is None
    assert not (tmp_path / "not-mounted").exists()  # never created: a missing mount must not fill the root disk


def test_fs_read_only_directory_marks_the_tier_down(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits: use the immutable attribute instead
        if subprocess.run(["chattr", "+i", str(root)], capture_output=True, check=False).returncode != 0:
            pytest.skip("cannot make a read-only directory here (chattr +i refused)")
    else:
        root.chmod(0o555)
    try:
        tier = FileTier(str(root), expect())
        assert not tier.up
        assert not tier.put(key(0), chunk(0))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(root)], check=False)
        root.chmod(0o755)


# -- redis:// ----------------------------------------------------------------------------------------------------


def test_redis_round_trip_and_corrupt_value_is_deleted(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, expect(fp="a" * 32))
    assert tier.up
    assert tier.put(key(0), chunk(0))
    found = tier.get(key(0))
    assert found is not None
    assert same(found, chunk(0))
    name = tier.prefix + key(0)
    value = bytearray(tier.client.get(name))  # type: ignore[arg-type]
    value[-3] ^= 0x40
    tier.client.set(name, bytes(value))
    assert tier.get(key(0)) is None
    assert tier.client.exists(name) == 0
    assert tier.stats.snapshot()["corrupt"] == 1
    assert tier.client.ttl(tier.prefix + key(0)) == -2
    tier.put(key(1), chunk(1))
    assert 0 < tier.client.ttl(tier.prefix + key(1)) <= tier.ttl_s  # every value expires
    tier.close()


def test_redis_down_at_start_then_back(own_redis: RedisServer) -> None:
    own_redis.stop()
    tier = RedisTier(own_redis.url, expect(fp="b" * 32), retry_s=0.2)
    assert not tier.up
    assert tier.get(key(0)) is None
    assert not tier.put(key(0), chunk(0))
    own_redis.start()
    time.sleep(0.3)
    assert tier.put(key(0), chunk(0))
    assert tier.up
    assert tier.get(key(0)) is not None


def test_redis_killed_mid_run_degrades_to_misses_and_recovers(own_redis: RedisServer) -> None:
    tier = RedisTier(own_redis.url, expect(fp="c" * 32), retry_s=0.2)
    tier.put(key(0), chunk(0))
    own_redis.stop()
    started = time.monotonic()
    assert tier.get(key(0)) is None  # an error, counted, not raised
    assert not tier.up
    assert tier.stats.snapshot()["errors"] >= 1
    assert tier.get(key(0)) is None  # while down: no new connection attempt, a miss at once
    assert time.monotonic() - started < 30
    own_redis.start()  # a fresh, empty Redis on the same port
    time.sleep(0.3)
    assert tier.put(key(1), chunk(1))
    assert tier.up
    assert tier.get(key(1)) is not None
