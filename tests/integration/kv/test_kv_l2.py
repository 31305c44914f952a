"""The L2 tiers against real files, real processes and a real Redis: integrity, concurrency, quota, outages."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from kvchunks import Clock, chunk, expect, key, same
from preheat.core.errors import ConfigError
from preheat.kv.fileio import make_root
from preheat.kv.fs import FileTier
from preheat.kv.redis_tier import RedisTier
from preheat.testing.redisserver import RedisServer

# A child imports this folder's test modules and the helpers one folder up (tests/).
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.pathsep.join((HERE, os.path.dirname(os.path.dirname(HERE))))


def is_up(tier: RedisTier) -> bool:
    """``tier.up`` read afresh: after ``assert not tier.up`` mypy would keep it False across the calls that revive
    the tier, and call the test's remaining lines unreachable."""
    return tier.up


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


def test_fs_store_over_a_damaged_file_replaces_it(tmp_path: Path) -> None:
    # A lookup stops at the first missing chunk, so damaged files after it are never read: a store of the recomputed
    # chunk must not take the damaged file for a stored one, or the chunk would never heal.
    tier = FileTier(str(tmp_path), expect())
    tier.put(key(0), chunk(0))
    path = Path(tier.path(key(0)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert tier.put(key(0), chunk(0))
    found = FileTier(str(tmp_path), expect()).get(key(0))
    assert found is not None
    assert same(found, chunk(0))
    assert tier.stats.snapshot()["corrupt"] == 1
    assert tier.put(key(0), chunk(0))  # a valid file is kept as it is
    assert tier.stats.snapshot()["stores"] == 2


def test_fs_planted_huge_file_is_a_miss_without_reading_it(tmp_path: Path) -> None:
    tier = FileTier(str(tmp_path), expect())
    path = Path(tier.path(key(0)))
    path.parent.mkdir(parents=True, exist_ok=True)  # the tier made its shards
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)  # 1 GiB, sparse: costs no disk, but a reader that trusts it allocates 1 GiB
    with allocations() as peak:
        assert tier.get(key(0)) is None
    assert peak() < 8 << 20
    assert not path.exists()
    assert tier.stats.snapshot()["corrupt"] == 1
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)
    with allocations() as peak:
        assert tier.put(key(0), chunk(0))  # checking the planted file before replacing it reads none of it either
    assert peak() < 8 << 20
    assert tier.get(key(0)) is not None


@pytest.mark.timeout(60)  # a reader that opens the FIFO blocks forever: the test must end anyway
def test_fs_planted_fifo_or_symlink_is_a_miss_and_never_blocks(tmp_path: Path) -> None:
    tier = FileTier(str(tmp_path), expect())
    path = Path(tier.path(key(0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    assert tier.get(key(0)) is None
    assert not path.exists()
    os.mkfifo(path)
    assert tier.put(key(0), chunk(0))  # replaced by the chunk
    assert path.is_file()
    assert tier.get(key(0)) is not None
    target = tmp_path / "elsewhere.kvc"
    os.rename(path, target)
    path.symlink_to(target)  # a valid chunk, but through a link: links are never followed
    assert tier.get(key(0)) is None
    assert not path.is_symlink()
    assert target.exists()
    assert tier.stats.snapshot()["corrupt"] == 3  # FIFO read, FIFO replaced by a store, symlink read


class allocations:  # noqa: N801  # reads as a verb in ``with allocations() as peak``
    """Track Python allocations inside the block; ``peak()`` is the most bytes held at once above the start."""

    def __enter__(self) -> Callable[[], int]:
        tracemalloc.start()
        tracemalloc.reset_peak()
        self.base = tracemalloc.get_traced_memory()[0]
        self.top = 0
        return lambda: self.top - self.base

    def __exit__(self, *exc: object) -> None:
        self.top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def test_fs_chunk_of_another_model_is_never_served(tmp_path: Path) -> None:
    FileTier(str(tmp_path), expect()).put(key(0), chunk(0))
    other = FileTier(str(tmp_path), expect(fp="e" * 32))
    assert other.get(key(0)) is None  # other fingerprint: another directory, and the header check besides


WRITER = """
import os, sys
from kvchunks import chunk, expect, key
from preheat.kv.chunk import encode_chunk
from preheat.kv.fs import FileTier
tier = FileTier(sys.argv[1], expect())
pieces = encode_chunk(key(0), expect().fingerprint, chunk(0))
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
import contextlib, os, sys, time
from kvchunks import chunk, expect, key
from preheat.kv.fs import FileTier
tier = FileTier(sys.argv[1], expect())
path = tier.path(key(0))
open(os.path.join(sys.argv[1], "ready." + sys.argv[2]), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(sys.argv[1], "go")):  # both writers start their loops together
    assert time.monotonic() < deadline, "never told to go"
    time.sleep(0.001)
for _ in range(60):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # so that put() really writes (it keeps a valid file) while the other process reads
    assert tier.put(key(0), chunk(0))
    tier.get(key(0))  # None when the other process just unlinked it: fine; a torn or corrupt chunk is not
if tier.stats.corrupt:
    sys.exit("a reader saw a torn or corrupt chunk while another process wrote it")
"""


def test_fs_two_processes_writing_one_chunk_leave_one_valid_file(tmp_path: Path) -> None:
    procs = [run_python(SAME_CHUNK, str(tmp_path), str(i)) for i in range(2)]
    wait_for(lambda: all((tmp_path / f"ready.{i}").exists() for i in range(2)) or any(p.poll() for p in procs))
    (tmp_path / "go").touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    tier = FileTier(str(tmp_path), expect())
    tier.put(key(0), chunk(0))
    assert [p.name for p in Path(tier.dir).rglob("*") if p.is_file()] == [Path(tier.path(key(0))).name]
    found = tier.get(key(0))
    assert found is not None
    assert same(found, chunk(0))


def wait_for(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds (a bound for a stuck run, not a timing
    assertion: a healthy run on a busy machine passes however slow it is)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


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


def test_fs_missing_directory_is_created_when_the_tier_opens(tmp_path: Path) -> None:
    root = tmp_path / "fresh-kv"  # a fresh machine: `--kv-l2 fs:///tmp/preheat-kv` names nothing yet
    tier = FileTier(str(root), expect())
    assert tier.up, tier.health.reason
    assert root.is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700  # K/V reveal prompts: no other local user reads them
    assert tier.put(key(0), chunk(0))
    assert tier.get(key(0)) is not None


def test_fs_directory_under_a_missing_parent_is_down_until_it_is_mounted(tmp_path: Path) -> None:
    clock = Clock()
    root = tmp_path / "not-mounted" / "kv"
    tier = FileTier(str(root), expect(), retry_s=5, clock=clock)
    assert not tier.up
    assert str(tmp_path / "not-mounted") in tier.health.reason
    assert not tier.put(key(0), chunk(0))
    assert tier.get(key(0)) is None
    assert not root.parent.exists()  # no tree made: a missing mount must not put the cache on the root disk
    root.mkdir(parents=True)  # mounted
    clock.advance(4.9)
    assert not tier.put(key(0), chunk(0))  # not probed again before retry_s
    clock.advance(0.2)
    assert tier.put(key(0), chunk(0))
    assert tier.up


def test_fs_directory_gone_while_running_is_down_and_never_made_again(tmp_path: Path) -> None:
    clock = Clock()
    root = tmp_path / "kv"
    tier = FileTier(str(root), expect(), retry_s=5, clock=clock)
    assert tier.put(key(0), chunk(0))
    shutil.rmtree(root)  # the share was unmounted under a running replica
    assert not tier.put(key(1), chunk(1))
    assert not tier.up
    clock.advance(5.1)
    assert not tier.put(key(1), chunk(1))
    assert not root.exists()  # only opening a tier makes its directory, never a retry


def test_fs_directory_that_cannot_be_made_is_refused_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for root, named in ((blocker, blocker), (blocker / "kv", blocker)):
        with pytest.raises(ConfigError, match=re.escape(str(named))):
            make_root(str(root))
        tier = FileTier(str(root), expect())  # an engine's integration opens it anyway: down, saying why
        assert not tier.up
        assert str(named) in tier.health.reason
    assert blocker.read_text() == "not a directory"


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
    clock = Clock()
    tier = RedisTier(own_redis.url, expect(fp="b" * 32), retry_s=5, clock=clock)
    assert not tier.up
    assert tier.get(key(0)) is None
    assert not tier.put(key(0), chunk(0))
    own_redis.start()
    clock.advance(4.9)
    assert not tier.put(key(0), chunk(0))  # still inside retry_s: not even tried
    clock.advance(0.2)
    assert tier.put(key(0), chunk(0))
    assert is_up(tier)
    assert tier.get(key(0)) is not None


def test_redis_killed_mid_run_degrades_to_misses_and_recovers(own_redis: RedisServer) -> None:
    clock = Clock()
    tier = RedisTier(own_redis.url, expect(fp="c" * 32), retry_s=5, clock=clock)
    tier.put(key(0), chunk(0))
    own_redis.stop()
    assert tier.get(key(0)) is None  # an error, counted, not raised
    assert not tier.up
    errors = tier.stats.snapshot()["errors"]
    assert errors >= 1
    assert tier.get(key(0)) is None  # while down: a miss at once, without trying the connection again
    assert not tier.put(key(1), chunk(1))
    assert tier.stats.snapshot()["errors"] == errors
    own_redis.start()  # a fresh, empty Redis on the same port
    clock.advance(5.1)
    assert tier.put(key(1), chunk(1))
    assert is_up(tier)
    assert tier.get(key(1)) is not None


def test_redis_value_larger_than_any_chunk_is_refused_without_transferring_it(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, expect(fp="1" * 32))
    name = tier.prefix + key(0)
    tier.client.set(name, b"PHKVCHNK" + bytes(32 << 20))  # 32 MiB under a chunk's name
    with allocations() as peak:
        assert tier.get(key(0)) is None
    assert peak() < 4 << 20
    assert tier.client.exists(name) == 0
    assert tier.stats.snapshot()["corrupt"] == 1
    assert tier.up
    tier.close()


def test_redis_value_of_another_type_is_a_miss_and_the_tier_stays_up(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, expect(fp="2" * 32))
    name = tier.prefix + key(0)
    tier.client.rpush(name, b"not a chunk")
    assert tier.get(key(0)) is None
    assert tier.up
    assert tier.client.exists(name) == 0
    assert tier.stats.snapshot()["corrupt"] == 1
    assert tier.put(key(0), chunk(0))
    assert tier.get(key(0)) is not None
    tier.close()


PASSWORD = "p@ss:w/rd 1"  # characters a URL must quote


def test_redis_authenticates_with_the_password_in_the_url() -> None:
    server = RedisServer(password=PASSWORD)
    try:
        tier = RedisTier(server.url, expect(fp="3" * 32))
        assert tier.up
        assert tier.put(key(0), chunk(0))
        assert tier.get(key(0)) is not None
        assert "p@ss" not in tier.describe()
        anonymous = RedisTier(server.url.replace(server.url.split("@")[0] + "@", "redis://"), expect(fp="3" * 32))
        assert not anonymous.up
        assert "auth" in anonymous.health.reason.lower()
        wrong = RedisTier(f"redis://:nope@127.0.0.1:{server.port}/0", expect(fp="3" * 32))
        assert not wrong.up
        assert "nope" not in wrong.health.reason
        for t in (tier, anonymous, wrong):
            t.close()
    finally:
        server.stop()


def test_redis_over_tls_verifies_the_server_certificate() -> None:
    server = RedisServer(tls=True, password=PASSWORD)
    try:
        assert server.url.startswith("rediss://")
        tier = RedisTier(server.url, expect(fp="4" * 32))
        assert tier.up, tier.health.reason
        assert tier.put(key(0), chunk(0))
        found = tier.get(key(0))
        assert found is not None
        assert same(found, chunk(0))
        assert tier.describe() == f"rediss://127.0.0.1:{server.port}/0"
        untrusted = RedisTier(server.url.split("?")[0], expect(fp="4" * 32))  # the system CAs never signed it
        assert not untrusted.up
        assert "certificate" in untrusted.health.reason.lower()
        plain = RedisTier(server.url.split("?")[0].replace("rediss://", "redis://"), expect(fp="4" * 32))
        assert not plain.up
        for t in (tier, untrusted, plain):
            t.close()
    finally:
        server.stop()
