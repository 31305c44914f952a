"""Resuming a pull from an origin without a manifest: the journal pins each file's version (ETag, Last-Modified, size;
for a local path mtime and inode), so a file that changed on the origin starts over and the published entry holds
exactly one version of it, never a mix. Real origins: preheat's FileServer, a moto S3 server, a local directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from origins import assert_entry_holds, new_version, weight_files
from preheat.core.errors import SourceChangedError
from preheat.sources.http import HTTPOrigin
from preheat.store import ModelCache, journal
from preheat.store.pull import pull
from preheat.testing.fileserver import FileServer
from pulls import CHUNK, PullInterruptedError, interrupt_at, kill_pull_after


def replace_files(origin: Path, files: dict[str, bytes]) -> None:
    """Replace the files atomically (write aside, rename over), as a careful upload does."""
    for name, data in files.items():
        assert len(data) == (origin / name).stat().st_size  # the nasty case: same size, other bytes
        (origin / f".{name}.upload").write_bytes(data)
        os.replace(origin / f".{name}.upload", origin / name)


def test_killed_pull_of_a_changed_origin_publishes_only_the_new_bytes(hf_origin: Path, tmp_path: Path) -> None:
    cache_root = tmp_path / "cache"
    total = sum(p.stat().st_size for p in weight_files(hf_origin))
    newer = new_version(hf_origin, seed=1)
    with FileServer(hf_origin, throttle_bps=1_000_000) as server:
        kill_pull_after(server.url, cache_root, total * 0.3, threads=2, chunk=CHUNK)
        replace_files(hf_origin, newer)
        result = pull(server.url, ModelCache(cache_root), threads=4, chunk_bytes=CHUNK)
    assert_entry_holds(result.path, newer)
    assert any("changed on the origin" in note for note in result.notes), result.notes
    assert result.bytes_fetched == result.bytes_total  # every weight file changed: nothing could be kept


def test_unchanged_files_still_resume(hf_origin: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    with FileServer(hf_origin) as server:
        with pytest.raises(PullInterruptedError):
            pull(server.url, cache, threads=1, chunk_bytes=CHUNK, progress=interrupt_at(0.5))
        result = pull(server.url, cache, threads=4, chunk_bytes=CHUNK)
    assert_entry_holds(result.path, {p.name: p.read_bytes() for p in weight_files(hf_origin)})
    assert result.bytes_resumed >= result.bytes_total * 0.45


def test_a_file_replaced_mid_pull_is_fetched_again_whole(hf_origin: Path, tmp_path: Path) -> None:
    newer = new_version(hf_origin, seed=2)
    lock, replaced = threading.Lock(), threading.Event()

    def replace_at_a_third(done: int, total: int) -> None:
        with lock:
            if done >= total / 3 and not replaced.is_set():
                replace_files(hf_origin, newer)  # the reads after this one ask for a version that is gone
                replaced.set()

    with FileServer(hf_origin) as server:
        result = pull(
            server.url, ModelCache(tmp_path / "cache"), threads=2, chunk_bytes=CHUNK, progress=replace_at_a_third
        )
        statuses = server.stats.snapshot().statuses
    assert_entry_holds(result.path, newer)
    assert replaced.is_set()
    assert statuses.get(412), statuses  # the conditional GETs caught the change
    assert any("started that file over" in note for note in result.notes), result.notes


def test_an_origin_that_stops_naming_versions_is_not_resumed(hf_origin: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    with FileServer(hf_origin) as server:
        with pytest.raises(PullInterruptedError):
            pull(server.url, cache, threads=1, chunk_bytes=CHUNK, progress=interrupt_at(0.5))
        server.faults.omit_validators = True  # no ETag, no Last-Modified: a same-size change would be invisible
        result = pull(server.url, cache, threads=4, chunk_bytes=CHUNK)
    assert_entry_holds(result.path, {p.name: p.read_bytes() for p in weight_files(hf_origin)})
    assert result.bytes_resumed == 0
    assert any("names no version" in note for note in result.notes), result.notes


def test_a_local_file_rewritten_in_place_is_not_resumed(hf_origin: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    with pytest.raises(PullInterruptedError):
        pull(str(hf_origin), cache, threads=1, chunk_bytes=CHUNK, progress=interrupt_at(0.5))
    newer = new_version(hf_origin, seed=3)
    for name, data in newer.items():  # same inode, same size: only the mtime tells
        with open(hf_origin / name, "r+b") as handle:
            handle.write(data)
    result = pull(str(hf_origin), cache, threads=2, chunk_bytes=CHUNK)
    assert_entry_holds(result.path, newer)
    assert any("changed on the origin" in note for note in result.notes), result.notes


def test_http_file_names_its_version_and_refuses_another(hf_origin: Path) -> None:
    name = weight_files(hf_origin)[0].name
    with FileServer(hf_origin) as server, HTTPOrigin(server.url) as origin:
        first = origin.open(name)
        seen = first.validator()
        assert seen.etag is not None
        assert seen.etag.startswith('"')  # strong
        assert seen.modified is not None
        first.require(seen)
        replace_files(hf_origin, {name: bytes(255 - b for b in (hf_origin / name).read_bytes())})
        with pytest.raises(SourceChangedError):
            first.readv(0, [memoryview(bytearray(16))])  # If-Match on the old ETag: 412
        with pytest.raises(SourceChangedError):
            origin.open(name).require(seen)  # a fresh probe sees the new version
        first.close()


def test_journal_keeps_chunks_only_under_the_version_named_now() -> None:
    old = {"size": 10, "etag": '"a"'}
    state = journal.JournalState(
        pins={"a": old, "b": old, "c": old},
        chunks={("a", 0, 4), ("b", 0, 4), ("c", 1, 4), ("d", 0, 4)},
    )
    kept, dropped = journal.reconcile(state, {"a": old, "b": {"size": 10, "etag": '"b"'}, "c": None, "d": old})
    assert kept.chunks == {("a", 0, 4)}  # b changed, c names no version, d's chunks were never pinned
    assert set(dropped) == {"b", "c", "d"}
    assert kept.pins == {"a": old, "b": {"size": 10, "etag": '"b"'}, "d": old}


names = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12)
pins = st.fixed_dictionaries({"size": st.integers(0, 2**40)}, optional={"etag": st.text(max_size=8)})


@given(
    st.dictionaries(names, pins, max_size=4),
    st.sets(st.tuples(names, st.integers(0, 1000), st.integers(1, 2**30)), max_size=8),
)
def test_journal_round_trips(pinned: dict[str, dict[str, object]], chunks: set[journal.Chunk]) -> None:
    state = journal.JournalState(pins=dict(pinned), chunks=chunks)
    again = journal.parse(journal.render(state).splitlines(keepends=True))
    assert again.pins == state.pins
    assert again.chunks == state.chunks


@given(st.lists(st.text(max_size=60), max_size=6))
def test_a_damaged_journal_only_loses_progress(lines: list[str]) -> None:
    state = journal.parse(lines)  # never raises, whatever the lines
    assert all(isinstance(c[1], int) and c[2] > 0 for c in state.chunks)


@given(
    st.lists(st.tuples(st.integers(0, 64), st.integers(1, 16)), max_size=8),
    st.integers(0, 80),
    st.integers(1, 16),
)
def test_a_piece_counts_as_on_disk_exactly_when_journaled_ranges_cover_it(
    ranges: list[tuple[int, int]], offset: int, length: int
) -> None:
    on_disk = {b for start, n in ranges for b in range(start, start + n)}
    coverage = journal.Coverage({("f", start, n) for start, n in ranges})
    assert coverage.covers("f", offset, length) == all(b in on_disk for b in range(offset, offset + length))
    assert not coverage.covers("other", offset, length)
