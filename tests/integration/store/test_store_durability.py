"""Durability and garbage collection of the node cache.

The fsync order is observed by wrapping the ``os`` functions that reach the disk (the operating system's, not ours)
to record which path each call touched; the pull runs unchanged. gc runs as the real ``preheat cache gc`` against a
partial whose pull lock a real subprocess holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from commands import cli
from origins import make_origin
from preheat.core import durable
from preheat.store import ModelCache
from preheat.store.pull import JOURNAL, pull
from pulls import CHUNK, PullInterruptedError, interrupt_at

Event = tuple[str, str, str]  # operation, path, detail


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


@pytest.fixture
def disk_calls(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Every fsync, fdatasync, rename and journal write this process makes, in order, with the path it touched."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name descriptors")
    events: list[Event] = []
    real_fsync, real_fdatasync, real_rename, real_replace, real_write = (
        os.fsync,
        os.fdatasync,
        os.rename,
        os.replace,
        os.write,
    )

    def syncing(name: str, real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            events.append((name, _path_of(fd), ""))
            real(fd)

        return call

    def renaming(real: Callable[[str, str], None]) -> Callable[..., None]:
        def call(src: str, dst: str, *args: object, **kwargs: object) -> None:
            real(src, dst, *args, **kwargs)
            events.append(("rename", os.fspath(src), os.fspath(dst)))

        return call

    def write(fd: int, data: bytes) -> int:
        path = _path_of(fd)
        if path.endswith(JOURNAL):
            events.append(("journal", path, bytes(data).decode()))
        return real_write(fd, data)

    monkeypatch.setattr(os, "fsync", syncing("fsync", real_fsync))
    monkeypatch.setattr(os, "fdatasync", syncing("fdatasync", real_fdatasync))
    monkeypatch.setattr(os, "rename", renaming(real_rename))
    monkeypatch.setattr(os, "replace", renaming(real_replace))
    monkeypatch.setattr(os, "write", write)
    return events


def test_publish_syncs_every_file_before_the_rename_and_the_directories_after(
    tmp_path: Path, disk_calls: list[Event]
) -> None:
    origin = make_origin(tmp_path / "hf", manifest=False)
    cache = ModelCache(tmp_path / "cache")
    result = pull(str(origin), cache, threads=1, chunk_bytes=CHUNK)
    partial, entry = cache.partial_dir(result.key), result.path
    [published] = [
        i for i, (op, src, dst) in enumerate(disk_calls) if op == "rename" and (src, dst) == (partial, entry)
    ]
    synced_before = {path for op, path, _ in disk_calls[:published] if op in ("fsync", "fdatasync")}
    for dirpath, _dirs, files in os.walk(entry):
        where = os.path.normpath(os.path.join(partial, os.path.relpath(dirpath, entry)))  # its name before the rename
        for before in [where, *(os.path.join(where, f) for f in files)]:
            assert before in synced_before, f"{before} was not fsynced before the entry was renamed into place"
    synced_after = {path for op, path, _ in disk_calls[published:] if op == "fsync"}
    assert os.path.dirname(entry) in synced_after  # the rename itself reached the disk before pull returned


def test_a_chunk_is_journaled_only_after_its_bytes_are_on_disk(tmp_path: Path, disk_calls: list[Event]) -> None:
    origin = make_origin(tmp_path / "hf", manifest=False)
    cache = ModelCache(tmp_path / "cache")
    pull(str(origin), cache, threads=1, chunk_bytes=CHUNK)
    synced: set[str] = set()
    lines = 0
    for op, path, detail in disk_calls:
        if op in ("fsync", "fdatasync"):
            synced.add(path)
        elif op == "journal":
            written = os.path.join(os.path.dirname(path), json.loads(detail)["file"])
            assert written in synced, f"journal vouched for {written} before its bytes were synced"
            synced.clear()  # one thread: the next line needs its own sync
            lines += 1
    assert lines > 1


HOLD_LOCK = """
import sys
from preheat.store import locks
with locks.exclusive(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def abandoned_pull(tmp_path: Path, cache: ModelCache, seed: int) -> str:
    """The partial directory an interrupted pull leaves behind (no process runs that pull any more)."""
    partials = Path(cache.root) / "partial"
    before = set(os.listdir(partials)) if partials.is_dir() else set()
    with pytest.raises(PullInterruptedError):
        pull(str(make_origin(tmp_path / f"o{seed}", seed=seed)), cache, chunk_bytes=CHUNK, progress=interrupt_at(0.3))
    [new] = set(os.listdir(partials)) - before
    return str(partials / new)


def age(path: str, seconds: float) -> None:
    then = time.time() - seconds
    for dirpath, _dirs, files in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            os.utime(name, (then, then))
    if not os.path.isdir(path):
        os.utime(path, (then, then))


def test_gc_removes_abandoned_pulls_and_stale_temp_files_but_not_a_live_pull(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    dead = abandoned_pull(tmp_path, cache, seed=1)
    live = abandoned_pull(tmp_path, cache, seed=2)
    probe = Path(cache.root) / "locks" / ".probe-4242"  # left by a process killed in ensure_dirs()
    probe.write_text("")
    leftover = Path(cache.root) / "trash" / "x-1-2"  # left by a process killed while removing an entry
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "w.safetensors").write_bytes(b"\0" * 4096)
    for path in (dead, live, str(probe), str(leftover)):
        age(path, 7200)
    lock = cache.lock_path(os.path.basename(live), "pull")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"  # a pull of that key is running in another process
        done = cli("cache", "gc", "--cache-dir", cache.root, "--json")
        assert done.returncode == 0, done.stderr
        swept = {(s["kind"], s["path"]) for s in json.loads(done.stdout)["swept"]}
        assert swept == {("partial", dead), ("temp", str(probe)), ("temp", str(leftover))}
        assert not os.path.exists(dead)
        assert os.path.isdir(live)  # its pull lock is held: never touched, however old
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    swept_later = cache.sweep()
    assert [(s.kind, s.path) for s in swept_later] == [("partial", live)]  # once its process is gone, it goes too


def test_gc_keeps_a_recent_abandoned_pull_for_resuming(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    recent = abandoned_pull(tmp_path, cache, seed=1)
    done = cli("cache", "gc", "--cache-dir", cache.root, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"removed": [], "swept": []}
    assert os.path.isdir(recent)
    everything = cli("cache", "gc", "--cache-dir", cache.root, "--stale-after", "0", "--json")
    assert [s["path"] for s in json.loads(everything.stdout)["swept"]] == [recent]


def test_concurrent_atomic_writes_of_one_path_never_share_a_temp_file(tmp_path: Path) -> None:
    target = str(tmp_path / "blob")
    payloads = [bytes([i]) * 65536 for i in range(8)]
    threads = [threading.Thread(target=durable.write_file, args=(target, data)) for data in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert Path(target).read_bytes() in payloads  # one writer's bytes whole, never a mix
    assert os.listdir(tmp_path) == ["blob"]  # no temp file left behind


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "entry.json"
    durable.write_file(str(target), b"old")

    def encode_half_then_fail() -> None:
        with durable.replacing(str(target)) as out:
            out.write(b"new, half")
            raise RuntimeError("encoder broke")

    with pytest.raises(RuntimeError, match="encoder broke"):
        encode_half_then_fail()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["entry.json"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs, whose fsync answers EINVAL")
def test_a_directory_that_cannot_be_synced_is_let_be_but_a_file_that_cannot_is_an_error() -> None:
    # procfs refuses fsync with EINVAL, as some FUSE mounts do for directories: nothing more can be done there.
    durable.fsync_dir("/proc/self")
    durable.fsync_path("/proc/self")
    with pytest.raises(OSError, match="Invalid argument"):
        durable.fsync_path("/proc/self/status")  # a file's data not reaching the disk is a failed write
