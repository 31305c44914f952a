"""The node-local model cache: pulls from real origins (a directory, a real HTTP server), resume, sharing, faults."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import preheat
from commands import cli
from origins import make_origin
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.core.errors import CacheError, CheckpointError, PreheatError
from preheat.store import ModelCache
from preheat.store.pull import pull, uri_key
from preheat.testing.fileserver import Faults, FileServer
from preheat.testing.synthetic import LlamaShape
from pulls import kill_pull_after, spawn_pull
from tmpfs import mounted_tmpfs


def assert_loads_like(entry: str, origin: Path) -> None:
    got, want = preheat.load(entry, mode="read"), preheat.load(origin, mode="read")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.fixture
def origin_dir(tmp_path: Path) -> Path:
    return make_origin(tmp_path / "origin")


def test_pull_from_a_directory_publishes_a_verified_entry(origin_dir: Path, cache: ModelCache) -> None:
    result = pull(str(origin_dir), cache)
    assert not result.hit
    manifest = Manifest.from_json((origin_dir / MANIFEST_NAME).read_bytes(), where="origin")
    assert result.key == manifest.identity  # entries are keyed by the checkpoint's identity
    assert result.bytes_fetched == result.bytes_total == sum(f.size for f in manifest.files + manifest.extra_files)
    assert_loads_like(result.path, origin_dir)
    assert not os.path.exists(cache.partial_dir(result.key))


def test_second_pull_is_a_hit_that_moves_no_bytes(origin_dir: Path, cache: ModelCache) -> None:
    first = pull(str(origin_dir), cache)
    second = pull(str(origin_dir), cache)
    assert second.hit
    assert second.bytes_fetched == 0
    assert second.path == first.path


def test_origin_without_manifest_is_keyed_by_uri_and_gets_one(tmp_path: Path, cache: ModelCache) -> None:
    origin = make_origin(tmp_path / "hf", manifest=False)
    result = pull(str(origin), cache)
    assert result.key == uri_key(str(origin))
    entry = Path(result.path)
    assert (entry / MANIFEST_NAME).exists()  # written after validating every header, so the entry can be verified
    assert (entry / "config.json").exists()
    assert_loads_like(result.path, origin)


def test_pull_over_http_streams_into_the_cache(origin_dir: Path, cache: ModelCache) -> None:
    with FileServer(origin_dir) as server:
        result = pull(server.url, cache, threads=4, chunk_bytes=256 * 1024)
        sent = server.stats.snapshot().bytes_sent
    assert_loads_like(result.path, origin_dir)
    assert sent >= result.bytes_total  # every byte came over HTTP (plus the small manifest)


def test_wrong_bytes_are_rejected_naming_the_tensor_and_nothing_is_published(
    origin_dir: Path, cache: ModelCache
) -> None:
    manifest = Manifest.from_json((origin_dir / MANIFEST_NAME).read_bytes(), where="origin")
    first_file = manifest.files[0].name  # verified first, so its first bad tensor is the one reported
    victim = next(t for t in manifest.tensors if t.file == first_file and t.name.endswith("mlp.up_proj.weight"))
    corrupt = victim.offset + 10  # the fault flips this offset in every file long enough to have it
    with FileServer(origin_dir, faults=Faults(corrupt_offsets=frozenset({corrupt}))) as server:
        with pytest.raises(CheckpointError) as caught:
            pull(server.url, cache, threads=4, chunk_bytes=256 * 1024)
        assert caught.value.tensor == victim.name
        assert victim.name in str(caught.value)
        assert cache.lookup(manifest.identity) is None
        # Once the origin serves the right bytes, a retry fetches only the discarded file, then publishes.
        server.faults.corrupt_offsets = frozenset()
        retry = pull(server.url, cache, threads=4, chunk_bytes=256 * 1024)
    hit_files = [f for f in (*manifest.files, *manifest.extra_files) if f.size > corrupt]
    assert retry.bytes_fetched == sum(f.size for f in hit_files)
    assert_loads_like(retry.path, origin_dir)


def test_tampered_manifest_is_refused(origin_dir: Path, cache: ModelCache) -> None:
    doc = json.loads((origin_dir / MANIFEST_NAME).read_bytes())
    doc["files"][0]["digest"] = "xxh3-128:" + "0" * 32
    (origin_dir / MANIFEST_NAME).write_text(json.dumps(doc))
    # The manifest carries its identity, so an edited manifest is caught before a byte is downloaded.
    with pytest.raises(CheckpointError, match="edited after it was written"):
        pull(str(origin_dir), cache)
    assert cache.entries() == []


def test_manifest_listing_a_missing_file_fails_and_publishes_nothing(origin_dir: Path, cache: ModelCache) -> None:
    victim = next(origin_dir.glob("model-00002-*.safetensors"))
    victim.unlink()
    with FileServer(origin_dir) as server, pytest.raises(PreheatError, match="model-00002"):
        pull(server.url, cache, threads=2)
    assert cache.entries() == []


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path, cache: ModelCache) -> None:
    (tmp_path / "empty").mkdir()
    with FileServer(tmp_path / "empty") as server, pytest.raises(CheckpointError, match="no weights here"):
        pull(server.url, cache)


def test_gc_removes_least_recently_used_first_and_never_an_entry_in_use(tmp_path: Path, cache: ModelCache) -> None:
    results = [pull(str(make_origin(tmp_path / f"o{i}", seed=i)), cache) for i in range(3)]
    for age, result in zip((300, 200, 100), results, strict=True):  # results[0] is the least recently used
        meta = Path(result.path) / ".preheat-cache.json"
        os.utime(meta, (time.time() - age, time.time() - age))
    size = max(e.size for e in cache.entries())
    lease = cache.lease(results[0].key)  # in use: must survive although it is the oldest
    try:
        removed = cache.gc(max_bytes=size * 2)
    finally:
        lease.close()
    assert [e.key for e in removed] == [results[1].key]
    assert {e.key for e in cache.entries()} == {results[0].key, results[2].key}


def test_rm_refuses_an_entry_in_use_and_removes_it_once_free(origin_dir: Path, cache: ModelCache) -> None:
    result = pull(str(origin_dir), cache)
    with cache.using(result.key) as path:
        assert Path(path).exists()
        with pytest.raises(CacheError, match="in use"):
            cache.remove(result.key)
    cache.remove(result.key)
    assert cache.lookup(result.key) is None


def test_cli_pull_ls_gc_rm_warm(origin_dir: Path, tmp_path: Path) -> None:
    env = {"PREHEAT_CACHE_DIR": str(tmp_path / "cli-cache")}
    pulled = cli("pull", str(origin_dir), "--json", env=env)
    assert pulled.returncode == 0, pulled.stderr
    doc = json.loads(pulled.stdout)
    assert doc["hit"] is False
    warm = cli("cache", "warm", str(origin_dir), env=env)
    assert warm.returncode == 0
    assert warm.stdout.strip() == doc["path"]
    listed = json.loads(cli("cache", "ls", "--json", env=env).stdout)
    assert [e["key"] for e in listed] == [doc["key"]]
    assert cli("cache", "gc", "--max-size", "1GiB", env=env).returncode == 0
    assert json.loads(cli("cache", "ls", "--json", env=env).stdout)  # fits: nothing removed
    removed = cli("cache", "rm", str(origin_dir), env=env)  # by URI
    assert removed.returncode == 0, removed.stderr
    assert json.loads(cli("cache", "ls", "--json", env=env).stdout) == []
    missing = cli("cache", "rm", "nope", env=env)
    assert missing.returncode == 1
    assert "no cache entry" in missing.stderr


def test_cli_cache_ls_shows_whole_keys_uris_and_paths_on_a_narrow_terminal(tmp_path: Path) -> None:
    # What a user copies from `cache ls` (the key for `cache rm`, the path to load, the URI) is never cut at 80
    # columns, and the entry's path has a column of its own.
    deep = tmp_path / ("a-long-directory-name-" * 4) / "origin"
    tiny = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    origin = make_origin(deep, shape=tiny)
    env = {"PREHEAT_CACHE_DIR": str(tmp_path / ("cache-root-with-a-long-name-" * 2)), "COLUMNS": "80"}
    doc = json.loads(cli("pull", str(origin), "--json", env=env).stdout)
    listed = cli("cache", "ls", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[1].split() == ["NAME", "KEY", "SIZE", "LAST", "USED", "IN", "USE", "URI", "PATH"]
    (row,) = lines[2:]
    for whole in (doc["key"], str(origin), doc["path"]):
        assert len(whole) > 40, whole  # longer than its share of 80 columns
        assert whole in row.split(), whole
    assert "…" not in listed.stdout


def test_killed_pull_resumes_fetching_only_missing_chunks(origin_dir: Path, tmp_path: Path) -> None:
    cache_root = tmp_path / "cache"
    chunk = 128 * 1024
    total = sum(f.stat().st_size for f in origin_dir.iterdir() if f.name != MANIFEST_NAME)
    with FileServer(origin_dir, throttle_bps=2_000_000) as server:
        kill_pull_after(server.url, cache_root, total * 0.5, threads=2, chunk=chunk)
        result = pull(server.url, ModelCache(cache_root), threads=4, chunk_bytes=chunk)
    assert not result.hit
    assert result.bytes_resumed >= total * 0.45
    assert result.bytes_fetched <= result.bytes_total * 0.55
    assert_loads_like(result.path, origin_dir)


def test_concurrent_pulls_download_once_and_share(origin_dir: Path, tmp_path: Path) -> None:
    cache_root = tmp_path / "cache"
    with FileServer(origin_dir, throttle_bps=8_000_000) as server:
        procs = [spawn_pull(server.url, cache_root, threads=4, chunk="256KiB") for _ in range(3)]
        outputs = [p.communicate(timeout=120) for p in procs]
        sent = server.stats.snapshot().bytes_sent
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    docs = [json.loads(out) for out, _ in outputs]
    assert len({d["path"] for d in docs}) == 1
    total = max(d["bytes_total"] for d in docs)  # the processes that waited and shared report no transfer at all
    assert sum(d["bytes_fetched"] for d in docs) == total  # one process downloaded, two shared
    assert sent < total * 1.1  # the origin served the model once (plus manifests)


def test_disk_full_is_a_clear_error_and_leaves_no_partial_files(origin_dir: Path, tmp_path: Path) -> None:
    small = tmp_path / "small"
    with mounted_tmpfs(small, "size=1m"):
        cache = ModelCache(small / "cache")
        with pytest.raises(CacheError, match="disk full"):
            pull(str(origin_dir), cache)
        assert not any((small / "cache" / "partial").iterdir())
        assert cache.entries() == []


def test_read_only_cache_directory_is_a_clear_error(origin_dir: Path, tmp_path: Path) -> None:
    frozen = tmp_path / "ro"
    with mounted_tmpfs(frozen, "ro,size=1m"), pytest.raises(CacheError, match=r"cannot be created|not writable"):
        pull(str(origin_dir), ModelCache(frozen / "cache"))


def test_remote_load_writes_through_then_loads_from_the_cache(origin_dir: Path, cache: ModelCache) -> None:
    with FileServer(origin_dir) as server:
        first = preheat.load(server.url, cache=cache, mode="read")
        assert first.cache_write is not None
        first.cache_write.join(timeout=60)
        entries = cache.entries()
        assert len(entries) == 1
        assert entries[0].uri == server.url
        sent_before = server.stats.snapshot().bytes_sent
        second = preheat.load(server.url, cache=cache)
        sent_for_second = server.stats.snapshot().bytes_sent - sent_before
    assert any("node cache hit" in note for note in second.report.notes)
    assert sent_for_second < 64 * 1024  # only the manifest was asked for; the weights came from local disk
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
    with pytest.raises(CacheError, match="in use"):  # the loaded tensors hold a lease on the entry
        cache.remove(entries[0].key)


def test_rank_loads_do_not_write_through(origin_dir: Path, cache: ModelCache) -> None:
    with FileServer(origin_dir) as server:
        part = preheat.load(server.url, cache=cache, rank=1, world_size=2, verify=False)  # slices: no digests
    assert part.cache_write is None
    assert cache.entries() == []


def test_cache_warm_link_points_a_fixed_path_at_the_entry_and_moves_with_it(tmp_path: Path) -> None:
    # The path a Kubernetes vLLM pod's MODEL is (docs/kubernetes.md): made by the init container, replaced whole.
    env = {"PREHEAT_CACHE_DIR": str(tmp_path / "cache")}
    link = tmp_path / "model"
    tiny = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    first = cli("cache", "warm", str(make_origin(tmp_path / "a", shape=tiny)), "--link", str(link), env=env)
    assert first.returncode == 0, first.stderr
    assert link.is_symlink()
    assert link.resolve() == Path(first.stdout.strip())
    second = cli("cache", "warm", str(make_origin(tmp_path / "b", seed=1, shape=tiny)), "--link", str(link), env=env)
    assert second.returncode == 0, second.stderr
    assert link.resolve() == Path(second.stdout.strip()) != Path(first.stdout.strip())
    (tmp_path / "dir").mkdir()
    refused = cli("cache", "warm", str(tmp_path / "a"), "--link", str(tmp_path / "dir"), env=env)
    assert refused.returncode == 1
    assert f"cannot link {tmp_path / 'dir'}" in refused.stderr
