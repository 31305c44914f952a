"""``preheat serve`` with KV tiers, as real processes: chunks computed by one replica are hits on another, on a
restarted one, and a missing or dying L2 only ever costs recomputation."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from preheat.router.cluster import ServerProcess
from preheat.testing.redisserver import RedisServer
from serving import Client, complete, long_prompt


def serve(model: Path, *kv: str) -> ServerProcess:
    process = ServerProcess(str(model), *kv)
    process.wait_ready()
    return process


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    path = tmp_path / "kv"
    path.mkdir()
    return path


def test_a_chunk_computed_on_one_replica_is_a_hit_on_another(kv_model: Path, shared_dir: Path) -> None:
    prompt = long_prompt()
    kv = ("--kv-l1", "64MiB", "--kv-l2", f"fs://{shared_dir}")
    with serve(kv_model, *kv) as a, serve(kv_model, *kv) as b:
        ca, cb = Client(a.url), Client(b.url)
        text, n_prompt, cached = complete(ca, prompt)
        assert cached == 0
        assert n_prompt > 512
        full_chunks = (n_prompt - 1) // 256 * 256
        _wait_for_l2(ca, full_chunks // 256)
        assert complete(cb, prompt) == (text, n_prompt, full_chunks)  # same answer, prefix not recomputed
        assert cb.metric("preheat_kv_hits_total", tier="l2") == full_chunks // 256
        assert cb.metric("preheat_prompt_tokens_cached_total") == full_chunks
        assert complete(cb, prompt)[2] == full_chunks
        assert cb.metric("preheat_kv_hits_total", tier="l1") == full_chunks // 256  # promoted on the first hit
        events = cb.get("/v1/kv/events").json()
        assert events["reset"]
        assert len(events["l1"]) == full_chunks // 256
        assert events["l2_id"] == f"fs://{shared_dir}"
        assert events["costs"]["prefill_s_per_token"] > 0
        assert events["costs"]["l2_s_per_token"] > 0
        later = cb.get(f"/v1/kv/events?epoch={events['epoch']}&since={events['seq']}").json()
        assert later["reset"] is False
        assert later["events"] == []
    with serve(kv_model, *kv) as restarted:  # a new process: the directory is the index, no warm-up
        assert complete(Client(restarted.url), prompt) == (text, n_prompt, full_chunks)


def _wait_for_l2(client: Client, chunks: int) -> None:
    deadline = time.monotonic() + 120
    while client.metric("preheat_kv_stores_total", tier="l2") < chunks:
        assert time.monotonic() < deadline, "the L2 writer did not store the chunks"
        time.sleep(0.05)


def test_a_fleet_secret_signs_chunks_and_refuses_another_fleets(
    kv_model: Path, shared_dir: Path, tmp_path: Path
) -> None:
    ours, theirs = tmp_path / "ours.secret", tmp_path / "theirs.secret"
    ours.write_text("a" * 64 + "\n")
    theirs.write_text("b" * 64 + "\n")
    for path in (ours, theirs):
        path.chmod(0o600)
    prompt = long_prompt(5)
    with serve(kv_model, "--kv-l2", f"fs://{shared_dir}", "--kv-secret-file", str(ours)) as a:
        client = Client(a.url)
        text, n_prompt, _ = complete(client, prompt)
        chunks = (n_prompt - 1) // 256
        _wait_for_l2(client, chunks)
        assert any("signed (MAC)" in line for line in a.lines)
    files = list(shared_dir.rglob("*.kvc"))
    assert len(files) == chunks
    assert all(f.read_bytes()[8:12] == (2).to_bytes(4, "little") for f in files)  # format version 2: keyed
    with serve(kv_model, "--kv-l2", f"fs://{shared_dir}", "--kv-secret-file", str(theirs)) as b:
        client = Client(b.url)
        assert complete(client, prompt) == (text, n_prompt, 0)
        _wait_for_l2(client, chunks)
        # The lookup refused the first chunk; each store found the other fleet's file and replaced it.
        assert client.metric("preheat_kv_mac_failures_total", tier="l2") == chunks


def test_events_report_stores_after_a_snapshot(kv_model: Path) -> None:
    with serve(kv_model, "--kv-l1", "64MiB") as replica:
        client = Client(replica.url)
        first = client.get("/v1/kv/events").json()
        assert first["reset"]
        assert first["l1"] == []
        assert first["l2_id"] is None
        complete(client, long_prompt(1))
        later = client.get(f"/v1/kv/events?epoch={first['epoch']}&since={first['seq']}").json()
        assert [(e["op"], e["tier"]) for e in later["events"]] == [("store", "l1")] * len(later["events"])
        assert len(later["events"]) >= 2
        stale = client.get("/v1/kv/events?epoch=another&since=1").json()
        assert stale["reset"]
        assert len(stale["l1"]) == len(later["events"])
        # A 'since' that is not a plain decimal (a superscript digit, 5,000 digits) is a full snapshot, never a 500.
        for since in ("%C2%B2", "9" * 5000):
            odd = client.get(f"/v1/kv/events?epoch={first['epoch']}&since={since}")
            assert odd.status == 200
            assert odd.json()["reset"]


def test_without_kv_tiers_the_events_route_says_so(kv_model: Path) -> None:
    with serve(kv_model) as replica:
        reply = Client(replica.url).get("/v1/kv/events")
        assert reply.status == 404
        assert "--kv-l1" in reply.json()["error"]["message"]


def test_a_missing_l2_directory_is_created_and_every_tier_says_it_is_up(kv_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "preheat-kv"  # a fresh machine: nothing there yet
    with serve(kv_model, "--kv-l1", "64MiB", "--kv-l2", f"fs://{root}") as replica:
        client = Client(replica.url)
        assert client.metric("preheat_kv_tier_up", tier="l2") == 1
        assert client.metric("preheat_kv_tier_up", tier="l1") == 1
        complete(client, long_prompt(2))
        _wait_for_l2(client, 1)  # chunks land in the directory it made
    assert root.is_dir()
    tiers = [line for line in replica.lines if "KV tiers:" in line]
    assert len(tiers) == 1, replica.lines
    assert "L1 64.00 MiB host memory up" in tiers[0]
    assert f"L2 fs://{root} up" in tiers[0]


def test_an_l2_directory_that_cannot_be_created_stops_the_start_naming_it(kv_model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    command = [sys.executable, "-m", "preheat", "serve", str(kv_model), "--port", "0", "--kv-l2", f"fs://{blocker}/kv"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0
    assert "listening on" not in refused.stdout  # refused before it bound, let alone loaded the model
    assert f"cannot create {blocker}/kv: its parent {blocker} is not a directory" in refused.stderr
    assert blocker.read_text() == "in the way"


def test_redis_down_at_start_then_killed_mid_run_never_fails_a_request(kv_model: Path, own_redis: RedisServer) -> None:
    own_redis.stop()
    kv = ("--kv-l2", own_redis.url)
    with serve(kv_model, *kv) as replica:
        client = Client(replica.url)
        prompt = long_prompt(3)
        text, _, cached = complete(client, prompt)
        assert cached == 0
        assert client.metric("preheat_kv_tier_up", tier="l2") == 0
        own_redis.start()
        assert _eventually(lambda: complete(client, prompt)[2] > 0)  # the tier came back: stored, then hit
        assert client.metric("preheat_kv_tier_up", tier="l2") == 1
        own_redis.stop()
        assert complete(client, prompt) == (text, complete(client, prompt)[1], 0)  # recomputed, same answer
        assert client.metric("preheat_kv_tier_up", tier="l2") == 0
        own_redis.start()  # empty again: the chunks are stored anew, then hit
        assert _eventually(lambda: complete(client, prompt)[2] > 0)
        assert complete(client, prompt)[0] == text


def _eventually(check: Callable[[], bool], timeout: float = 120.0) -> bool:
    """Whether ``check`` comes true before ``timeout`` (a bound for a stuck run: a slow machine only waits longer)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def test_redis_l2_is_shared_between_replicas(kv_model: Path, redis_url: str) -> None:
    prompt = long_prompt(4)
    with serve(kv_model, "--kv-l2", redis_url) as a, serve(kv_model, "--kv-l2", redis_url) as b:
        text, n_prompt, _ = complete(Client(a.url), prompt)
        full = (n_prompt - 1) // 256 * 256
        _wait_for_l2(Client(a.url), full // 256)
        assert complete(Client(b.url), prompt) == (text, n_prompt, full)
