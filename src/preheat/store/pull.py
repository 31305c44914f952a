"""``pull``: download a checkpoint from an origin into the node-local cache, resumably, verified, published once.

1. Ask the origin for ``preheat.json``: its identity is the cache key (an origin without one, a plain Hugging Face
   layout, is keyed by its URI). A published entry is a hit: nothing is downloaded.
2. Take ``locks/<key>.pull``. Another process pulling the same key holds it, so we wait, then find its entry
   published and share it: the model is downloaded once per node.
3. Pin each file's version in the journal (its manifest digest; without a manifest the origin's ETag/Last-Modified
   and size) and drop the progress of every file whose version changed since an interrupted pull (store/journal.py).
4. Preallocate every file in ``partial/<key>/`` (a full disk fails here, before any download) and fetch the chunks
   the journal does not list yet, in parallel, each written with ``pwrite``, made durable, then recorded in the
   journal. Reads are held to the pinned version; a file that changes mid-pull starts that file over.
5. Verify every file against the manifest's digests; a mismatch names the first bad tensor, discards that file, and
   publishes nothing. Without a manifest, each safetensors header is validated and a manifest is written for the entry.
6. fsync the entry, ``rename`` the directory into ``models/<key>``, fsync the directories (``ModelCache.publish``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from preheat.checkpoint import manifest as mf
from preheat.checkpoint.layout import INDEX_NAME, SINGLE_NAME, open_checkpoint, resolve_remote_names
from preheat.errors import CacheError, CheckpointError, PreheatError, SourceChangedError
from preheat.io.reads import read_at_least
from preheat.sources.base import Origin, Source, Validator, Versioned, open_origin
from preheat.store import durable, journal, locks
from preheat.store.cache import ModelCache

if TYPE_CHECKING:
    from preheat.peer.pull import PeerOptions

log = logging.getLogger("preheat.cache")

MiB = 1024 * 1024
JOURNAL = ".journal"
CHANGE_RESTARTS = 3  # a file that changes mid-pull starts over; an origin that keeps changing fails after this many
# Small files a Hugging Face layout may carry beside its weights; fetched whole when present.
HF_EXTRA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class RemoteFile:
    """A file to fetch: its relative name, size, expected digest (None when the origin has no manifest) and, without a
    manifest, the version of it the origin named when the pull planned it."""

    name: str
    size: int
    digest: str | None
    validator: Validator | None = None

    def pin(self) -> journal.Pin | None:
        """What the journal pins this file's chunks to; None when nothing can tell its versions apart."""
        if self.digest is not None:
            return {"digest": self.digest, "size": self.size}
        if self.validator is None or self.validator.weak:
            return None
        return self.validator.to_json()


@dataclass
class PullResult:
    """What a pull did: where the entry is, whether it was already there, and how many bytes moved."""

    key: str
    path: str
    uri: str
    hit: bool
    bytes_total: int = 0
    bytes_fetched: int = 0
    bytes_resumed: int = 0
    seconds: float = 0.0
    files: int = 0
    notes: list[str] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)  # bytes kept from each source ("origin", "peer host:port")

    @property
    def mbps(self) -> float:
        return self.bytes_fetched / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "key": self.key,
            "path": self.path,
            "uri": self.uri,
            "hit": self.hit,
            "bytes_total": self.bytes_total,
            "bytes_fetched": self.bytes_fetched,
            "bytes_resumed": self.bytes_resumed,
            "seconds": self.seconds,
            "files": self.files,
            "mbps": self.mbps,
            "notes": self.notes,
            "sources": self.sources,
        }


def uri_key(uri: str) -> str:
    """The cache key of an origin without a manifest: a hash of its normalised URI."""
    return "url-" + xxhash.xxh3_128_hexdigest(uri.rstrip("/").encode())


def origin_key(origin: Origin) -> tuple[str, mf.Manifest | None]:
    """The cache key for ``origin`` and its manifest, if it has one."""
    if origin.exists(mf.MANIFEST_NAME):
        raw = origin.read_bytes(mf.MANIFEST_NAME)
        manifest = mf.Manifest.from_json(raw, where=origin.join(mf.MANIFEST_NAME))
        return manifest.identity, manifest
    return uri_key(origin.uri), None


def pull(
    uri: str,
    cache: ModelCache | None = None,
    *,
    threads: int = 16,
    chunk_bytes: int = 16 * MiB,
    progress: Progress | None = None,
    peers: PeerOptions | None = None,
) -> PullResult:
    """Make ``uri`` (``http(s)://``, ``s3://``, ``preheat://`` or a local directory) a verified entry of ``cache``.

    ``preheat://NAME`` is pulled from warm peers (docs/peer.md); ``peers`` is a ``preheat.peer.pull.PeerOptions``
    (default: from ``PREHEAT_REGISTRY``, ``PREHEAT_ORIGIN``, ``PREHEAT_PEER_TOKEN``).
    """
    if uri.startswith("preheat://"):
        from preheat.peer.pull import pull_from_peers

        return pull_from_peers(uri, cache, peers, chunk_bytes=chunk_bytes, progress=progress)
    cache = cache or ModelCache()
    cache.ensure_dirs()
    started = time.perf_counter()
    origin = open_origin(uri)
    key, manifest = origin_key(origin)
    published = cache.lookup(key)
    if published is not None:
        cache.touch(key)
        return PullResult(key, published, uri, hit=True, seconds=time.perf_counter() - started)
    with locks.exclusive(cache.lock_path(key, "pull")):
        published = cache.lookup(key)
        if published is not None:  # another process finished this pull while we waited for its lock
            cache.touch(key)
            result = PullResult(key, published, uri, hit=True, seconds=time.perf_counter() - started)
            result.notes.append("downloaded by another process; shared")
            return result
        notes: list[str] = []
        attempt = 1
        while True:
            try:
                result = _download(
                    origin, cache, key, manifest, threads=threads, chunk_bytes=chunk_bytes, progress=progress
                )
                break
            except SourceChangedError as exc:
                # With a manifest its digests name the bytes: an origin disagreeing with its own manifest is broken.
                if manifest is not None or attempt >= CHANGE_RESTARTS:
                    raise
                log.warning("pull %s: %s; starting the changed file over", origin.uri, exc)
                notes.append(f"{exc}; started that file over")
                attempt += 1
        result.notes[:0] = notes
    result.seconds = time.perf_counter() - started
    return result


def _plan_files(origin: Origin, manifest: mf.Manifest | None) -> tuple[list[RemoteFile], list[str]]:
    """Large files fetched in resumable chunks, and small extra files fetched whole."""
    if manifest is not None:
        large = [RemoteFile(f.name, f.size, f.digest) for f in manifest.files]
        large += [RemoteFile(f.name, f.size, f.digest) for f in manifest.extra_files]
        return large, []
    names = resolve_remote_names(origin)
    large = []
    for name in names:
        source = origin.open(name)
        try:
            version = source.validator() if isinstance(source, Versioned) else None
            large.append(RemoteFile(name, source.size(), None, version))
        finally:
            source.close()
    small = [n for n in (INDEX_NAME, *HF_EXTRA_FILES) if n not in names and origin.exists(n)]
    if SINGLE_NAME in names and INDEX_NAME in small:
        small.remove(INDEX_NAME)
    return large, small


def _download(
    origin: Origin,
    cache: ModelCache,
    key: str,
    manifest: mf.Manifest | None,
    *,
    threads: int,
    chunk_bytes: int,
    progress: Progress | None,
) -> PullResult:
    partial = cache.partial_dir(key)
    large, small = _plan_files(origin, manifest)
    total = sum(f.size for f in large)
    result = PullResult(key, cache.entry_dir(key), origin.uri, hit=False, bytes_total=total, files=len(large))
    os.makedirs(partial, exist_ok=True)
    journal_path = os.path.join(partial, JOURNAL)
    try:
        done = _resume(partial, journal_path, large, result)
        _preallocate(partial, large)
        chunks = [
            (f, index, offset, min(chunk_bytes, f.size - offset))
            for f in large
            for index, offset in enumerate(range(0, f.size, chunk_bytes))
            if (f.name, index, chunk_bytes) not in done
        ]
        result.bytes_resumed = total - sum(c[3] for c in chunks)
        if result.bytes_resumed:
            result.notes.append(f"resumed: {result.bytes_resumed} bytes were already here")
        for f in large:
            if f.pin() is None:
                result.notes.append(
                    f"{origin.join(f.name)}: the origin names no version (no ETag or Last-Modified); "
                    "an interrupted pull of it starts over"
                )
        fetcher = _ChunkFetcher(origin, partial, journal_path, chunk_bytes)
        result.bytes_fetched = _fetch_chunks(
            fetcher, chunks, threads=threads, progress=progress, already=result.bytes_resumed, total=total
        )
        for name in small:
            _write_small(partial, name, origin.read_bytes(name))
        _verify(partial, large, manifest, journal_path)
        os.unlink(journal_path)
        if manifest is None:
            _describe(partial)
        else:
            _write_small(partial, mf.MANIFEST_NAME, manifest.to_json())
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            shutil.rmtree(partial, ignore_errors=True)
            raise CacheError(
                f"disk full while pulling {origin.uri} into {cache.root}: it needs {total} bytes; "
                "free space or run 'preheat cache gc --max-size ...'"
            ) from None
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise CacheError(f"cache directory {cache.root} is not writable: {exc.strerror}") from None
        raise CacheError(f"pull of {origin.uri} failed writing to {partial}: {exc}") from None
    result.path = cache.publish(key, origin.uri)
    result.sources = {"origin": result.bytes_fetched} if result.bytes_fetched else {}
    return result


def _resume(partial: str, journal_path: str, files: list[RemoteFile], result: PullResult) -> set[journal.Chunk]:
    """Chunks an interrupted pull already has of the versions the origin names now; the journal is rewritten pinned
    to those versions, and every other file's partial bytes are discarded."""
    state, dropped = journal.reconcile(journal.read(journal_path), {f.name: f.pin() for f in files})
    journal.rewrite(journal_path, state)
    for name, why in sorted(dropped.items()):
        log.warning("pull %s: discarding the partial %s: %s", result.uri, name, why)
        result.notes.append(f"discarded the partial {name}: {why}")
        with contextlib.suppress(FileNotFoundError):
            os.truncate(os.path.join(partial, name), 0)
    return state.chunks


def _preallocate(partial: str, files: list[RemoteFile]) -> None:
    for f in files:
        path = os.path.join(partial, f.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if os.fstat(fd).st_size != f.size:
                os.ftruncate(fd, f.size)
            if f.size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, f.size)  # claim the blocks now: a full disk fails before any download
        finally:
            os.close(fd)


class _ChunkFetcher:
    """Fetches chunks in parallel: each thread keeps one source (one connection) per file, writes with pwrite, and
    records each finished chunk in the journal, so an interrupted pull knows exactly what it already has."""

    def __init__(self, origin: Origin, partial: str, journal_path: str, chunk_bytes: int) -> None:
        self.origin, self.partial, self.chunk_bytes = origin, partial, chunk_bytes
        self.journal = journal.Appender(journal_path)
        self.lock = threading.Lock()
        self.local = threading.local()
        self.sources: list[Source] = []
        self.fds: dict[str, int] = {}
        self.fetched = 0

    def fd(self, name: str) -> int:
        with self.lock:
            if name not in self.fds:
                self.fds[name] = os.open(os.path.join(self.partial, name), os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            return self.fds[name]

    def source(self, f: RemoteFile) -> Source:
        """This thread's source for ``f``, held to the version the pull pinned (``SourceChangedError`` otherwise)."""
        mine: dict[str, Source] | None = getattr(self.local, "sources", None)
        if mine is None:
            mine = self.local.sources = {}
        if f.name not in mine:
            source = self.origin.open(f.name)
            with self.lock:
                self.sources.append(source)
            if f.validator is not None and isinstance(source, Versioned):
                source.require(f.validator)
            mine[f.name] = source
        return mine[f.name]

    def fetch(self, f: RemoteFile, index: int, offset: int, length: int) -> int:
        view = memoryview(bytearray(length))
        read_at_least(self.source(f), view, offset, length, path=self.origin.join(f.name))
        fd = self.fd(f.name)
        written = 0
        while written < length:
            written += os.pwrite(fd, view[written:], offset + written)
        os.fdatasync(fd)  # the journal line below must never survive a power loss that the bytes did not
        with self.lock:
            self.journal.chunk(f.name, index, self.chunk_bytes)
            self.fetched += length
        return length

    def close(self) -> None:
        self.journal.close()
        for fd in self.fds.values():
            os.close(fd)
        for source in self.sources:
            source.close()


def _fetch_chunks(
    fetcher: _ChunkFetcher,
    chunks: list[tuple[RemoteFile, int, int, int]],
    *,
    threads: int,
    progress: Progress | None,
    already: int,
    total: int,
) -> int:
    landed = already

    def one(chunk: tuple[RemoteFile, int, int, int]) -> int:
        nonlocal landed
        n = fetcher.fetch(*chunk)
        if progress is not None:
            with fetcher.lock:
                landed += n
                current = landed
            progress(current, total)
        return n

    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="preheat-pull") as pool:
            futures: list[Future[int]] = [pool.submit(one, c) for c in chunks]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        fetcher.close()
    return fetcher.fetched


def _write_small(partial: str, name: str, data: bytes) -> None:
    path = os.path.join(partial, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    durable.write_file(path, data)


def _verify(partial: str, files: list[RemoteFile], manifest: mf.Manifest | None, journal_path: str) -> None:
    """Check every downloaded file's digest. Every bad file is discarded (so a retry refetches exactly those), then
    the first one is reported, naming its first bad tensor."""
    bad: list[tuple[RemoteFile, str, str | None]] = []
    for f in files:
        if f.digest is None:
            continue
        path = os.path.join(partial, f.name)
        actual = mf.file_digest(path)
        if actual != f.digest:
            bad.append((f, actual, _first_bad_tensor(partial, f.name, manifest)))
    for f, _, _ in bad:
        os.unlink(os.path.join(partial, f.name))
    if bad:
        journal.forget(journal_path, [f.name for f, _, _ in bad])
        f, actual, culprit = bad[0]
        what = f"tensor {culprit!r} in {f.name}" if culprit else f"file {f.name}"
        others = f" ({len(bad) - 1} more bad file(s) discarded too)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"digest mismatch for {what}: the origin served bytes that do not match its manifest "
            f"(expected {f.digest}, got {actual}); nothing was published{others}",
            path=os.path.join(partial, f.name),
            tensor=culprit,
        )


def _first_bad_tensor(partial: str, name: str, manifest: mf.Manifest | None) -> str | None:
    if manifest is None:
        return None
    path = os.path.join(partial, name)
    with open(path, "rb") as handle:
        for record in manifest.tensors:
            if record.file != name:
                continue
            handle.seek(record.offset)
            if mf.digest_bytes(handle.read(record.nbytes)) != record.digest:
                return record.name
    return None


def _describe(partial: str) -> None:
    """An origin without a manifest: validate every header, then write a manifest so the entry can be verified."""
    try:
        open_checkpoint(partial)
    except PreheatError as exc:
        raise CheckpointError(f"pulled files are not a valid checkpoint: {exc}", path=partial) from None
    _write_small(partial, mf.MANIFEST_NAME, mf.build_manifest(partial).to_json())
