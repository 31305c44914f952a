"""The peer registry: entries with a TTL refreshed by a heartbeat, in a real Redis and in a shared directory.

No test sleeps for a fixed time against a TTL. Expiry as the registry's readers see it runs on a ``Clock`` the test
moves by hand; what needs real time (Redis forgetting a key, a heartbeat thread beating, a killed process's entry
going) is waited for by polling the condition up to a generous deadline, never asserted to take a given time.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from commands import cli
from peers import write_peer_checkpoint
from preheat.core.errors import ConfigError, RegistryError
from preheat.peer.registry import FileRegistry, Heartbeat, PeerEntry, RedisRegistry, Registry, open_registry
from preheat.testing.ports import free_port
from preheat.testing.redisserver import RedisServer

IDENTITY = "xxh3-128:" + "ab" * 16


class Clock:
    """Epoch seconds that move only when the test says so."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def entry(address: str, load: int = 0) -> PeerEntry:
    return PeerEntry(identity=IDENTITY, address=address, name="tiny", load=load, origin="http://origin/tiny")


def registries(tmp_path: Path, redis: RedisServer) -> list[Registry]:
    return [FileRegistry(str(tmp_path / "registry")), RedisRegistry(redis.url)]


def wait_until(predicate: Callable[[], object], timeout: float = 30.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass: a deadline for progress, not a speed test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_entries_are_found_by_identity_or_name_least_loaded_first(
    kind: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    registry = registries(tmp_path, redis_server)[kind == "redis"]
    registry.announce(entry("10.0.0.1:9000", load=3), ttl=30)
    registry.announce(entry("10.0.0.2:9000", load=1), ttl=30)
    by_name = registry.find("tiny")
    assert [e.address for e in by_name] == ["10.0.0.2:9000", "10.0.0.1:9000"]
    assert [e.address for e in registry.find(IDENTITY)] == ["10.0.0.2:9000", "10.0.0.1:9000"]
    assert by_name[0].origin == "http://origin/tiny"
    assert registry.find("another-model") == []
    for e in by_name:
        registry.withdraw(e)
    assert registry.find("tiny") == []


def test_a_file_entry_is_gone_once_its_ttl_has_passed_and_is_tidied_up(tmp_path: Path) -> None:
    clock = Clock()
    registry = FileRegistry(str(tmp_path / "registry"), clock=clock)
    registry.announce(entry("10.0.0.3:9000"), ttl=10)  # announced once, then the process "died"
    clock.advance(9.9)
    assert [e.address for e in registry.find("tiny")] == ["10.0.0.3:9000"]
    clock.advance(0.2)
    assert registry.find("tiny") == []
    assert list((tmp_path / "registry").rglob("*.json")) == []  # the reader removed the stale file


def test_redis_itself_forgets_an_entry_whose_heartbeat_stopped(redis_server: RedisServer) -> None:
    registry = RedisRegistry(redis_server.url)
    registry.announce(entry("10.0.0.3:9001"), ttl=300)
    assert [e.address for e in registry.find("tiny")] == ["10.0.0.3:9001"]
    registry.announce(entry("10.0.0.3:9001"), ttl=0.2)  # the last beat of a process that then died
    key = f"preheat:peer:{IDENTITY}:10.0.0.3:9001"
    raw = redis.Redis.from_url(redis_server.url)
    try:
        assert wait_until(lambda: not raw.exists(key))  # expired by Redis, not merely filtered by the reader
    finally:
        raw.close()
    assert registry.find("tiny") == []


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_reader_skips_an_entry_past_its_expiry_on_its_own_clock(
    kind: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    clock = Clock()
    registry: Registry = (
        FileRegistry(str(tmp_path / "registry"), clock=clock)
        if kind == "file"
        else RedisRegistry(redis_server.url, clock=clock)
    )
    registry.announce(entry("10.0.0.3:9002"), ttl=60)
    assert [e.address for e in registry.find("tiny")] == ["10.0.0.3:9002"]
    clock.advance(61)  # Redis still holds the key (its own TTL is real time), the entry says it has expired
    assert registry.find("tiny") == []
    registry.withdraw(entry("10.0.0.3:9002"))


def test_a_heartbeat_keeps_an_entry_alive_past_its_ttl(tmp_path: Path) -> None:
    clock = Clock()
    registry = FileRegistry(str(tmp_path / "registry"), clock=clock)
    beat = Heartbeat(registry, lambda: entry("10.0.0.4:9000"), ttl=0.6).start()
    try:
        [first] = registry.find("tiny")
        clock.advance(1.5)  # the first announcement's TTL has passed: only a later beat can bring the entry back
        assert wait_until(lambda: [e.expires for e in registry.find("tiny")] == [clock() + 0.6])
        assert first.expires < clock()
    finally:
        beat.stop()
    assert registry.find("tiny") == []  # a clean stop withdraws at once


def test_a_killed_seed_peer_leaves_redis_within_its_ttl(tmp_path: Path, redis_server: RedisServer) -> None:
    root = write_peer_checkpoint(tmp_path / "ckpt")
    command = [sys.executable, "-m", "preheat.peer", str(root), "--registry", redis_server.url, "--name", "ttl-test"]
    proc = subprocess.Popen([*command, "--ttl", "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().rsplit(" at ", 1)[1].strip()
        registry = RedisRegistry(redis_server.url)
        [first] = registry.find("ttl-test")  # announced before the address was printed, for 3 s
        assert first.address == address
        # Re-announced with a later expiry: the heartbeat, not the first SET, is what keeps it there.
        assert wait_until(lambda: any(e.expires > first.expires for e in registry.find("ttl-test")))
        proc.kill()  # no clean shutdown: the entry must expire by itself
        proc.wait()
        assert wait_until(lambda: registry.find("ttl-test") == [])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_redis_down_is_a_registry_error_within_seconds() -> None:
    registry = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(RegistryError, match="lookup failed"):
        registry.find("tiny")


def test_a_heartbeat_survives_a_registry_outage(tmp_path: Path) -> None:
    registry = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0")
    beat = Heartbeat(registry, lambda: entry("10.0.0.5:9000"), ttl=0.3)
    beat.beat()
    assert beat.failing  # logged, not raised: the replica keeps serving its own clients


@pytest.mark.parametrize("url", ["http://registry", "redis", "s3://bucket/registry"])
def test_unknown_registry_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError):
        open_registry(url)


@pytest.mark.parametrize(("url", "kind"), [
    ("redis://127.0.0.1:6379/0", RedisRegistry),
    ("rediss://127.0.0.1:6380/0", RedisRegistry),
    ("unix:///run/redis/redis.sock", RedisRegistry),  # a Redis on a local socket
    ("file:///shared/registry", FileRegistry),
])
def test_each_registry_scheme_opens_its_kind(url: str, kind: type) -> None:
    assert isinstance(open_registry(url), kind)  # nothing is dialled until the registry is used


def test_serve_refuses_a_registry_it_could_not_open_before_loading_anything(tmp_path: Path) -> None:
    done = cli("serve", str(tmp_path / "no-model"), "--port", "0", "--registry", "s3://bucket/registry")
    assert done.returncode != 0
    assert "--registry 's3://bucket/registry': use redis://host:port[/db] or file:///shared/dir" in done.stderr


# A real full disk in a child process: RLIMIT_FSIZE caps the size of any file it writes, and with SIGXFSZ ignored
# the write past the cap fails with EFBIG, as a write to a full volume fails with ENOSPC.
ANNOUNCE_ON_A_FULL_DISK = """
import resource, signal, sys
from preheat.core.errors import RegistryError
from preheat.peer.registry import FileRegistry, PeerEntry
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
entry = PeerEntry(identity=sys.argv[2], address="10.0.0.5:9000", name="tiny", load=7, origin="http://origin/tiny")
try:
    FileRegistry(sys.argv[1]).announce(entry, ttl=60)
except RegistryError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_failed_announce_keeps_the_old_entry_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    root = tmp_path / "registry"
    registry = FileRegistry(str(root))
    registry.announce(entry("10.0.0.5:9000", load=0), ttl=3600)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    child = subprocess.run(
        [sys.executable, "-c", ANNOUNCE_ON_A_FULL_DISK, str(root), IDENTITY],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == 3, child.stderr
    assert "cannot write" in child.stdout
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # no temporary file beside the entry
    assert [e.load for e in registry.find(IDENTITY)] == [0]  # readers still see the whole old entry
