"""Registry entries are outside input: anyone who can write the registry writes them.

Whatever bytes sit in an entry (a Redis value, a file in the shared directory), a lookup either parses them into an
entry whose every field has its type and range, or skips them; it never raises anything but ``RegistryError``, never
blocks on a planted FIFO, and never reads more than ``MAX_ENTRY_BYTES`` of an entry, however large it is.
"""

from __future__ import annotations

import json
import math
import os
import threading
import tracemalloc
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strategies
from preheat.core.errors import RegistryError
from preheat.peer.registry import MAX_ENTRY_BYTES, FileRegistry, PeerEntry, RedisRegistry, valid_address
from preheat.testing.redisserver import RedisServer

IDENTITY = "xxh3-128:" + "cd" * 16
GOOD = {"identity": IDENTITY, "address": "10.0.0.9:9000", "name": "tiny", "expires": 4e9}

json_values = strategies.json_values(20, allow_nonfinite=True)
# Entries that are almost right: every field present or not, each a plausible value or any JSON at all.
near_entries = st.fixed_dictionaries(
    {},
    optional={
        "identity": st.sampled_from([IDENTITY, "xxh3-128:xyz", "../../etc", ""]) | json_values,
        "address": st.sampled_from(["10.0.0.9:9000", "[::1]:9000", "h:0", "h:99999", "evil/x#", "h:80@x"])
        | json_values,
        "name": json_values,
        "rank": st.integers(-3, 3) | json_values,
        "world_size": st.integers(-1, 3) | json_values,
        "load": st.integers(-(2**40), 2**40) | json_values,
        "origin": st.sampled_from(["http://origin/x", None]) | json_values,
        "expires": st.floats(allow_nan=True, allow_infinity=True) | json_values,
    },
)


def parse_or_registry_error(raw: str | bytes) -> PeerEntry | None:
    try:
        entry = PeerEntry.from_json(raw, where="fuzz")
    except RegistryError:
        return None
    entry.check()  # what parses is an entry in range
    assert valid_address(entry.address)
    assert math.isfinite(entry.expires)
    assert entry.load >= 0
    assert 0 <= entry.rank < entry.world_size
    return entry


@given(st.binary(max_size=2 * MAX_ENTRY_BYTES))
def test_any_bytes_as_an_entry_parse_or_raise_registry_error(raw: bytes) -> None:
    parse_or_registry_error(raw)


@given(json_values | near_entries)
def test_any_json_as_an_entry_parses_or_raises_registry_error(doc: object) -> None:
    parse_or_registry_error(json.dumps(doc))


@pytest.mark.parametrize(
    "doc",
    [
        {**GOOD, "rank": 1e400},  # json reads 1e400 as inf, and int(inf) is an OverflowError
        {**GOOD, "expires": float("nan")},  # NaN compares false with every clock: an entry that never expires
        {**GOOD, "load": -1_000_000},  # would sort first, ahead of every honest peer
        {**GOOD, "address": "attacker.example:80/steal#"},  # would become part of a URL
        {**GOOD, "address": "127.0.0.1:99999"},
        {**GOOD, "identity": "../../../etc"},
        {**GOOD, "rank": 2, "world_size": 2},
        {**GOOD, "rank": True},
        {**GOOD, "address": ["10.0.0.9:9000"]},
        {**GOOD, "name": "x" * 5000},
    ],
)
def test_an_entry_with_a_field_out_of_range_is_refused(doc: dict[str, object]) -> None:
    with pytest.raises(RegistryError, match="not a peer entry"):
        PeerEntry.from_json(json.dumps(doc), where="test")


def test_deeply_nested_json_is_a_registry_error_not_a_recursion_error() -> None:
    raw = "[" * (MAX_ENTRY_BYTES - 1)
    with pytest.raises(RegistryError, match="not JSON"):
        PeerEntry.from_json(raw, where="test")


def test_an_entry_over_the_cap_is_refused_before_it_is_parsed() -> None:
    raw = json.dumps({**GOOD, "pad": "x" * MAX_ENTRY_BYTES})
    with pytest.raises(RegistryError, match=f"over {MAX_ENTRY_BYTES} bytes"):
        PeerEntry.from_json(raw, where="test")


def test_a_good_entry_round_trips() -> None:
    entry = PeerEntry(identity=IDENTITY, address="[::1]:9000", name="tiny", rank=1, world_size=2, load=3)
    assert PeerEntry.from_json(entry.to_json(), where="test") == entry


# -- through the real registries ------------------------------------------------------------------------------------


def plant(registry_root: Path, name: str, data: bytes) -> None:
    group = registry_root / IDENTITY.replace(":", "-")
    group.mkdir(parents=True, exist_ok=True)
    (group / name).write_bytes(data)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.binary(max_size=512)
    | json_values.map(lambda d: json.dumps(d).encode())
    | near_entries.map(lambda d: json.dumps(d).encode())
)
def test_a_file_registry_lookup_survives_any_planted_entry(tmp_path: Path, raw: bytes) -> None:
    root = tmp_path / "registry"
    plant(root, "planted.json", raw)
    plant(root, "good.json", json.dumps(GOOD).encode())
    found = FileRegistry(str(root)).find(IDENTITY)
    assert GOOD["address"] in [e.address for e in found]
    for entry in found:
        entry.check()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=512) | near_entries.map(lambda d: json.dumps(d).encode()))
def test_a_redis_registry_lookup_survives_any_planted_value(redis_server: RedisServer, raw: bytes) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(f"preheat:peer:{IDENTITY}:planted", raw, ex=60)
        client.set(f"preheat:peer:{IDENTITY}:good", json.dumps(GOOD), ex=60)
        found = RedisRegistry(redis_server.url).find(IDENTITY)
        assert GOOD["address"] in [e.address for e in found]
        for entry in found:
            entry.check()
    finally:
        client.delete(f"preheat:peer:{IDENTITY}:planted", f"preheat:peer:{IDENTITY}:good")
        client.close()


def test_a_redis_key_of_another_type_does_not_fail_the_lookup(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.rpush(f"preheat:peer:{IDENTITY}:a-list", "x")
        client.set(f"preheat:peer:{IDENTITY}:good", json.dumps(GOOD), ex=60)
        assert [e.address for e in RedisRegistry(redis_server.url).find(IDENTITY)] == [GOOD["address"]]
    finally:
        client.delete(f"preheat:peer:{IDENTITY}:a-list", f"preheat:peer:{IDENTITY}:good")
        client.close()


def peak_bytes_of(action: object) -> int:
    tracemalloc.start()
    try:
        action()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_file_entry_is_skipped_after_reading_only_the_cap(tmp_path: Path) -> None:
    root = tmp_path / "registry"
    plant(root, "good.json", json.dumps(GOOD).encode())
    group = root / IDENTITY.replace(":", "-")
    with open(group / "huge.json", "wb") as handle:
        handle.truncate(256 << 20)  # sparse: 256 MiB that cost no disk
    registry = FileRegistry(str(root))
    found: list[PeerEntry] = []
    peak = peak_bytes_of(lambda: found.extend(registry.find(IDENTITY)))
    assert [e.address for e in found] == [GOOD["address"]]
    assert peak < 1 << 20  # the cap (16 KiB) and bookkeeping, not the file


def test_a_huge_redis_value_is_skipped_after_reading_only_the_cap(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(f"preheat:peer:{IDENTITY}:huge", b"{" + b" " * (8 << 20), ex=60)
        client.set(f"preheat:peer:{IDENTITY}:good", json.dumps(GOOD), ex=60)
        registry = RedisRegistry(redis_server.url)
        found: list[PeerEntry] = []
        peak = peak_bytes_of(lambda: found.extend(registry.find(IDENTITY)))
        assert [e.address for e in found] == [GOOD["address"]]
        assert peak < 1 << 20
    finally:
        client.delete(f"preheat:peer:{IDENTITY}:huge", f"preheat:peer:{IDENTITY}:good")
        client.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_planted_non_file_in_the_registry_directory_is_skipped(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "registry"
    plant(root, "good.json", json.dumps(GOOD).encode())
    planted = root / IDENTITY.replace(":", "-") / "planted.json"
    if kind == "fifo":
        os.mkfifo(planted)  # open() for reading would wait for a writer that never comes
    elif kind == "symlink":
        secret = tmp_path / "elsewhere.json"
        secret.write_text(json.dumps({**GOOD, "address": "10.6.6.6:666"}))
        planted.symlink_to(secret)
    else:
        planted.mkdir()
    registry = FileRegistry(str(root))
    found: list[PeerEntry] = []
    lookup = threading.Thread(target=lambda: found.extend(registry.find(IDENTITY)), daemon=True)
    lookup.start()
    lookup.join(timeout=60)  # a deadline for a hang, not a speed limit
    assert not lookup.is_alive(), "the lookup blocked on the planted entry"
    assert [e.address for e in found] == [GOOD["address"]]
