"""Warm start: a replica that scales up loads the fleet's hottest chunks from L2 into its host tier before it takes
traffic (``preheat serve --kv-warm``), and ``preheat kv warm`` reads and verifies a namespace on a node before an
engine starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvchunks import CHUNK_TOKENS, FP, chunk, expect, key, same
from preheat.kv.events import EventLog
from preheat.kv.fs import FileTier
from preheat.kv.memory import MemoryTier
from preheat.kv.store import Namespace, open_store, storage_name
from preheat.kv.tiered import TieredKV
from preheat.kv.warm import warm_into, warm_tiers
from preheat.router.cluster import ServerProcess
from serving import Client, complete, long_prompt

NS = Namespace(model="org/model@rev", engine="test-engine", layout={"page": 64})


def tiers(root: Path, l1_bytes: int) -> TieredKV:
    return TieredKV(fingerprint=FP, chunk_tokens=CHUNK_TOKENS, events=EventLog(), l1=MemoryTier(l1_bytes),
                    l2=FileTier(str(root), expect()))


def test_warm_tiers_fills_l1_with_the_most_recent_l2_chunks_within_its_capacity(tmp_path: Path) -> None:
    l2 = FileTier(str(tmp_path), expect())
    for i in range(6):
        l2.put(key(i), chunk(i))
        os.utime(l2.path(key(i)), (1000 + i, 1000 + i))  # key(5) is the most recently used
    size = chunk(0).nbytes
    fresh = tiers(tmp_path, l1_bytes=int(size * 3.5))  # room for 3 chunks within 90% of L1
    report = warm_tiers(fresh)
    assert report.loaded == 3
    assert fresh.l1 is not None
    assert sorted(fresh.l1.keys(10)) == sorted(key(i) for i in (3, 4, 5))
    found = fresh.l1.get(key(5))
    assert found is not None
    assert same(found, chunk(5))
    again = warm_tiers(fresh)
    assert again.loaded == 0  # what L1 holds is not read twice


def test_warm_tiers_skips_damaged_chunks(tmp_path: Path) -> None:
    l2 = FileTier(str(tmp_path), expect())
    for i in range(3):
        l2.put(key(i), chunk(i))
    path = Path(l2.path(key(1)))
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x40
    path.write_bytes(bytes(blob))
    fresh = tiers(tmp_path, l1_bytes=1 << 30)
    report = warm_tiers(fresh)
    assert (report.loaded, report.skipped) == (2, 1)
    assert fresh.l1 is not None
    assert not fresh.l1.contains(key(1))
    assert not path.exists()


def test_warm_into_stops_at_the_byte_budget(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    for i in range(5):
        store.put(f"k{i}", bytes(1000))
    loaded: list[str] = []

    def sink(k: str) -> int | None:
        value = store.get(k)
        loaded.append(k)
        return None if value is None else len(value)

    report = warm_into(store, sink, max_bytes=3500)  # stored sizes (with headers) decide before anything is read
    assert report.loaded == len(loaded) == 3
    assert report.bytes == 3000


def test_kv_warm_cli_reads_verifies_and_removes_damaged_values(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    for i in range(4):
        store.put(f"k{i}", bytes([i]) * 5000)
    damaged = Path(store.storage.path(storage_name("k2")))  # type: ignore[attr-defined]  # an fs:// store
    blob = bytearray(damaged.read_bytes())
    blob[-1] ^= 1
    damaged.write_bytes(bytes(blob))
    listed = subprocess.run([sys.executable, "-m", "preheat", "kv", "ls", f"fs://{tmp_path}", "--json"],
                            capture_output=True, text=True, check=True)
    assert json.loads(listed.stdout) == [{"id": NS.id, "namespace": NS.to_dict()}]
    done = subprocess.run([sys.executable, "-m", "preheat", "kv", "warm", f"fs://{tmp_path}",
                           "--namespace", NS.id, "--json"], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    assert (report["loaded"], report["skipped"], report["bytes"]) == (3, 1, 15000)
    assert not damaged.exists()
    assert bytes(store.get("k1") or b"") == bytes([1]) * 5000
    bad = subprocess.run([sys.executable, "-m", "preheat", "kv", "warm", f"fs://{tmp_path}",
                          "--namespace", "not-an-id"], capture_output=True, text=True, check=False)
    assert bad.returncode != 0
    assert "32 hex digits" in bad.stderr


def test_kv_warm_cli_checks_engine_chunks_without_taking_them_for_damaged_ones(tmp_path: Path) -> None:
    l2 = FileTier(str(tmp_path), expect())
    for i in range(3):
        l2.put(key(i), chunk(i))
    done = subprocess.run([sys.executable, "-m", "preheat", "kv", "warm", f"fs://{tmp_path}",
                           "--namespace", FP, "--json"], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["loaded"] == 3
    assert all(Path(l2.path(key(i))).exists() for i in range(3))


def test_a_replica_started_with_kv_warm_serves_the_fleets_prefixes_from_l1(kv_model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "kv"
    shared.mkdir()
    kv = ("--kv-l1", "64MiB", "--kv-l2", f"fs://{shared}")
    prompt = long_prompt(seed=3)
    with ServerProcess(str(kv_model), *kv) as first:
        first.wait_ready()
        client = Client(first.url)
        text, n_prompt, _ = complete(client, prompt)
        full = (n_prompt - 1) // 256
        while client.metric("preheat_kv_stores_total", tier="l2") < full:
            pass  # the L2 writer runs in the background
    with ServerProcess(str(kv_model), *kv, "--kv-warm", "all") as scaled_up:
        scaled_up.wait_ready()  # /health said "warming" until L1 was filled
        client = Client(scaled_up.url)
        assert client.metric("preheat_kv_stores_total", tier="l1") == full  # before any request
        assert complete(client, prompt) == (text, n_prompt, full * 256)
        assert client.metric("preheat_kv_hits_total", tier="l1") == full
        assert client.metric("preheat_kv_hits_total", tier="l2") == full  # read once, by the warm-up
        stages = [s["name"] for s in client.get("/v1/preheat/timeline").json()["stages"]]
        assert "kv_warm" in stages
