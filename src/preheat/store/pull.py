"""``pull``: download a checkpoint from an origin into the node-local cache, resumably, verified, published once.

1. Ask the origin for ``preheat.json``: its identity is the cache key (an origin without one, a plain Hugging Face
   layout, is keyed by its URI). A published entry is a hit: nothing is downloaded.
2. Take ``locks/<key>.pull``. Another process pulling the same key holds it, so we wait, then find its entry
   published and share it: the model is downloaded once per node.
3. ``download`` (shared by every downloader: this one, peer pulls in ``preheat.peer.pull`` and write-through in
   ``preheat.store.writethrough``): pin each file's version in the journal (its manifest digest; without a manifest
   the origin's ETag/Last-Modified and size) and drop the progress of every file whose version changed since an
   interrupted pull (``preheat.store.journal``); preallocate every file in ``partial/<key>/`` (a full disk fails
   here, before any download); fetch the pieces the journal does not cover with ``preheat.store.fetch`` (each
   written with ``pwrite``, made durable, then journaled). Reads are held to the pinned version; a file that changes
   mid-pull starts that file over.
4. Verify every file against the manifest's digests; a mismatch names the first bad tensor, discards that file, and
   publishes nothing. Without a manifest, each safetensors header is validated and a manifest is written for the entry.
5. fsync the entry, ``rename`` the directory into ``models/<key>``, fsync the directories (``ModelCache.publish``).

Every write failure of every downloader maps to one ``CacheError`` (``cache_write_error``): a full disk says how much
was needed and what to run.

``preheat://`` names are not this module's: they are pulled from peers by ``preheat.peer.pull.pull_from_peers``,
which the callers that know about peers (``preheat pull``, ``preheat cache warm``, ``preheat serve``) choose. The
store sits below the peers and never imports them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from preheat.checkpoint import manifest as mf
from preheat.checkpoint.layout import INDEX_NAME, SINGLE_NAME, open_checkpoint, resolve_remote_names
from preheat.core import durable
from preheat.core.errors import CacheError, CheckpointError, ConfigError, PreheatError, SourceChangedError
from preheat.sources.base import Origin, Versioned
from preheat.sources.open import open_origin
from preheat.sources.peer_uri import SCHEME, is_peer_uri
from preheat.store import journal, locks
from preheat.store.cache import ModelCache
from preheat.store.fetch import PieceFetch, PieceSource, Progress
from preheat.store.pieces import PiecePlan, RemoteFile, plan_chunks

log = logging.getLogger("preheat.cache")

MiB = 1024 * 1024
JOURNAL = ".journal"
OLD_JOURNALS = (".peer-journal",)  # earlier peer pulls' tab-separated journal: never published inside an entry
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
__all__ = ["JOURNAL", "Progress", "PullResult", "RemoteFile", "download", "origin_key", "pull", "uri_key"]


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
) -> PullResult:
    """Make ``uri`` (``http(s)://``, ``s3://`` or a local directory) a verified entry of ``cache``.

    >>> pull("https://models.internal/llama-3-8b").path  # doctest: +SKIP
    '/root/.cache/preheat/models/xxh3-128-4f1c...'
    """
    if is_peer_uri(uri):
        raise ConfigError(
            f"{uri}: {SCHEME} names are pulled from peers: use preheat.peer.pull.pull_from_peers "
            "(or 'preheat pull', which does)"
        )
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
                result = _pull_once(
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


def plan_files(origin: Origin, manifest: mf.Manifest | None) -> tuple[list[RemoteFile], list[str]]:
    """Large files fetched in resumable pieces, and small extra files fetched whole."""
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


def _pull_once(
    origin: Origin,
    cache: ModelCache,
    key: str,
    manifest: mf.Manifest | None,
    *,
    threads: int,
    chunk_bytes: int,
    progress: Progress | None,
) -> PullResult:
    large, small = plan_files(origin, manifest)
    notes = [
        f"{origin.join(f.name)}: the origin names no version (no ETag or Last-Modified); "
        "an interrupted pull of it starts over"
        for f in large
        if f.pin() is None
    ]
    source = PieceSource("origin", origin, streams=max(1, threads), fallback=True)
    result = download(
        cache,
        key,
        origin.uri,
        plan_chunks(large, chunk_bytes),
        [source],
        manifest=manifest,
        small=small,
        small_from=origin,
        progress=progress,
    )
    result.notes += notes
    return result


def download(
    cache: ModelCache,
    key: str,
    uri: str,
    plan: PiecePlan,
    sources: Sequence[PieceSource],
    *,
    manifest: mf.Manifest | None,
    small: Sequence[str] = (),
    small_from: Origin | None = None,
    check_pieces: bool = False,
    progress: Progress | None = None,
) -> PullResult:
    """Fetch ``plan`` from ``sources`` into ``partial/<key>``, verify it, publish it as ``key`` (the caller holds
    ``locks/<key>.pull``). The one download path of every puller.

    Resumes from the journal (pieces it covers under the versions the plan's files name now are kept); fetches
    the ``small`` files whole from ``small_from``; verifies every file with a digest (``check_pieces``:
    tensors as they land and whole files with requeues to other sources, for plans cut at tensors; otherwise whole
    files at the end, discarding bad ones); without a manifest, validates the headers and writes one. Write failures
    are ``cache_write_error``s.
    """
    partial = cache.partial_dir(key)
    journal_path = os.path.join(partial, JOURNAL)
    result = PullResult(key, cache.entry_dir(key), uri, hit=False, bytes_total=plan.total_bytes, files=len(plan.files))
    try:
        os.makedirs(partial, exist_ok=True)
        landed = _resume(partial, journal_path, plan.files, result)
        preallocate(partial, plan.files)
        fetch = PieceFetch(
            plan,
            list(sources),
            partial,
            progress=progress,
            journal_path=journal_path,
            landed=landed,
            check_files=check_pieces,
        )
        try:
            result.sources = fetch.run()
        finally:
            result.notes += fetch.notes
        result.bytes_resumed = fetch.resumed
        result.bytes_fetched = sum(result.sources.values())
        for name in small:
            assert small_from is not None, "small files need the origin to read them from"
            write_small(partial, name, small_from.read_bytes(name))
        if not check_pieces:
            verify_files(partial, plan.files, manifest, journal_path)
        for name in (JOURNAL, *OLD_JOURNALS):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(partial, name))
        if manifest is None:
            describe(partial)
        else:
            write_small(partial, mf.MANIFEST_NAME, manifest.to_json())
    except OSError as exc:
        raise cache_write_error(exc, uri, cache, partial, plan.total_bytes) from None
    result.path = cache.publish(key, uri)
    return result


def cache_write_error(exc: OSError, uri: str, cache: ModelCache, partial: str, needed: int) -> CacheError:
    """The one ``CacheError`` for a failed write into ``partial`` of the cache (a full disk also removes the partial
    files, which could not be resumed into anyway)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        shutil.rmtree(partial, ignore_errors=True)
        return CacheError(
            f"disk full while pulling {uri} into {cache.root}: it needs {needed} bytes; "
            "free space or run 'preheat cache gc --max-size ...'"
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return CacheError(f"cache directory {cache.root} is not writable: {exc.strerror}")
    return CacheError(f"pull of {uri} failed writing to {partial}: {exc}")


def _resume(partial: str, journal_path: str, files: Sequence[RemoteFile], result: PullResult) -> journal.Coverage:
    """What an interrupted pull already has of the versions the origin names now; the journal is rewritten pinned
    to those versions, and every other file's partial bytes are discarded."""
    state, dropped = journal.reconcile(journal.read(journal_path), {f.name: f.pin() for f in files})
    journal.rewrite(journal_path, state)
    for name, why in sorted(dropped.items()):
        log.warning("pull %s: discarding the partial %s: %s", result.uri, name, why)
        result.notes.append(f"discarded the partial {name}: {why}")
        with contextlib.suppress(FileNotFoundError):
            os.truncate(os.path.join(partial, name), 0)
    return journal.Coverage(state.chunks)


def preallocate(partial: str, files: Sequence[RemoteFile]) -> None:
    """Create every file at its size, its blocks claimed (``posix_fallocate``): a full disk fails before a download."""
    for f in files:
        path = os.path.join(partial, f.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if os.fstat(fd).st_size != f.size:
                os.ftruncate(fd, f.size)
            if f.size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, f.size)
        finally:
            os.close(fd)


def write_small(partial: str, name: str, data: bytes) -> None:
    """Write a small file (config, tokenizer, manifest) of the entry whole, atomically and durably."""
    path = os.path.join(partial, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    durable.write_file(path, data)


def verify_files(
    partial: str, files: Sequence[RemoteFile], manifest: mf.Manifest | None, journal_path: str | None
) -> None:
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
        if journal_path is not None:
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


def describe(partial: str) -> None:
    """An origin without a manifest: validate every header, then write a manifest so the entry can be verified."""
    try:
        open_checkpoint(partial)
    except PreheatError as exc:
        raise CheckpointError(f"pulled files are not a valid checkpoint: {exc}", path=partial) from None
    write_small(partial, mf.MANIFEST_NAME, mf.build_manifest(partial).to_json())
