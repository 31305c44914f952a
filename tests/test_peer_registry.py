"""The peer registry: entries with a TTL refreshed by a heartbeat, in a real Redis and in a shared directory."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from peers import write_peer_checkpoint
from preheat.errors import ConfigError, RegistryError
from preheat.peer.registry import FileRegistry, Heartbeat, PeerEntry, RedisRegistry, Registry, open_registry
from redisserver import RedisServer, free_port

IDENTITY = "xxh3-128:" + "ab" * 16


def entry(address: str, load: int = 0) -> PeerEntry:
    return PeerEntry(identity=IDENTITY, address=address, name="tiny", load=load, origin="http://origin/tiny")


def registries(tmp_path: Path, redis: RedisServer) -> list[Registry]:
    return [FileRegistry(str(tmp_path / "registry")), RedisRegistry(redis.url)]


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


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


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_an_entry_disappears_when_its_heartbeat_stops(kind: str, tmp_path: Path, redis_server: RedisServer) -> None:
    registry = registries(tmp_path, redis_server)[kind == "redis"]
    registry.announce(entry("10.0.0.3:9000"), ttl=0.5)  # announced once, then the process "died"
    assert registry.find("tiny")
    assert wait_until(lambda: registry.find("tiny") == [])


def test_a_heartbeat_keeps_an_entry_alive_past_its_ttl(tmp_path: Path) -> None:
    registry = FileRegistry(str(tmp_path / "registry"))
    beat = Heartbeat(registry, lambda: entry("10.0.0.4:9000"), ttl=0.6).start()
    try:
        time.sleep(1.5)
        assert [e.address for e in registry.find("tiny")] == ["10.0.0.4:9000"]
    finally:
        beat.stop()
    assert registry.find("tiny") == []  # a clean stop withdraws at once


def test_a_killed_seed_peer_leaves_redis_within_its_ttl(tmp_path: Path, redis_server: RedisServer) -> None:
    root = write_peer_checkpoint(tmp_path / "ckpt")
    command = [sys.executable, "-m", "preheat.peer", str(root), "--registry", redis_server.url, "--name", "ttl-test"]
    proc = subprocess.Popen([*command, "--ttl", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().rsplit(" at ", 1)[1].strip()
        registry = RedisRegistry(redis_server.url)
        assert [e.address for e in registry.find("ttl-test")] == [address]
        time.sleep(1.2)  # longer than the TTL: only the heartbeat keeps it there
        assert [e.address for e in registry.find("ttl-test")] == [address]
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
