"""Entries of the node-local model cache: where they live, who is using them, and removing them.

Layout under the cache root (default ``~/.cache/preheat``, or ``PREHEAT_CACHE_DIR``)::

    models/<key>/               a published entry: the checkpoint's files, plus .preheat-cache.json
    partial/<key>/              a pull in progress (preallocated files + a journal of finished chunks)
    locks/<key>.pull            held exclusively by the one process downloading <key>
    locks/<key>.use             held shared by every process using <key>; gc/rm need it exclusively

An entry appears only by ``rename(partial/<key>, models/<key>)`` after every digest was checked and every file and
directory of it was fsynced, and the rename itself is fsynced: a directory under ``models/`` is always complete, also
after a power loss. ``<key>`` is the checkpoint identity from its manifest (``xxh3-128-...``), or
``url-<hash of the URI>`` for an origin without a manifest.

Each entry also records a *name*, what people call the model (``smollm2-135m-instruct``, the last part of
``https://host/models/llama-3-8b``), so commands take ``preheat serve NAME`` and a server answers to the name rather
than to the key: ``resolve_model`` and ``EntryMeta`` are the one place that reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from preheat.core import durable, env
from preheat.core.errors import CacheError
from preheat.core.jsonsafe import read_object
from preheat.sources.peer_uri import peer_name
from preheat.store import locks

META_NAME = ".preheat-cache.json"
META_BYTES = 1 << 20  # an entry's record: a key, a URI, a name, a time (a shared cache dir may hold anything)
STALE_AFTER = 3600.0  # seconds: an abandoned partial younger than this is kept for a pull to resume
# Extensions a source's last path part loses in its name: a single-file checkpoint is named for the model, not the
# format (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.Q4_1``).
NAME_SUFFIXES = (".gguf", ".safetensors")


def default_cache_dir() -> str:
    """``PREHEAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/preheat``, else ``~/.cache/preheat``."""
    explicit = env.get(env.CACHE_DIR)
    if explicit:
        return explicit
    base = env.get(env.XDG_CACHE_HOME) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "preheat")


def key_dirname(key: str) -> str:
    """A key as a directory name (``xxh3-128:ab..`` -> ``xxh3-128-ab..``); refuses anything that is not a name."""
    name = key.replace(":", "-")
    if not name or "/" in name or name.startswith(".") or "\\" in name:
        raise CacheError(f"invalid cache key {key!r}")
    return name


def source_name(uri: str) -> str:
    """The name a source's URI gives its model: the last part of its path, without a checkpoint file's extension;
    ``""`` when the URI has no path part.

    >>> source_name("https://models.internal/llama-3-8b/"), source_name("preheat://smollm2")
    ('llama-3-8b', 'smollm2')
    >>> source_name("file:///wheels/SmolLM2-135M-Instruct.Q4_1.gguf")
    'SmolLM2-135M-Instruct.Q4_1'
    """
    path = uri.split("?", 1)[0].split("#", 1)[0]
    name = peer_name(path)
    if name is not None:  # preheat://NAME is all name
        path = name
    elif "://" in path:
        scheme, rest = path.split("://", 1)
        # s3://bucket is all name too; http(s)://host alone names no model
        path = rest if scheme == "s3" else rest.partition("/")[2]
    last = path.rstrip("/").rsplit("/", 1)[-1]
    for suffix in NAME_SUFFIXES:
        if last.endswith(suffix) and len(last) > len(suffix):
            return last[: -len(suffix)]
    return last


@dataclass(frozen=True)
class EntryMeta:
    """What ``.preheat-cache.json`` says about a published entry: its key, origin URI, name and creation time."""

    key: str
    uri: str
    name: str
    created: float

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> EntryMeta | None:
        """The record of the entry in directory ``path``, or None when ``path`` is not a published entry (of any
        cache root: an entry copied elsewhere keeps its record). An entry published before names were recorded is
        named after its URI, else its key."""
        meta_path = os.path.join(os.fspath(path), META_NAME)
        try:
            meta = read_object(meta_path, max_bytes=META_BYTES)
            created = float(meta.get("created", os.stat(meta_path).st_mtime))
        except (OSError, ValueError, TypeError):  # ValueError: jsonsafe's JSONInputError too
            return None  # not a published entry (or being removed right now)
        key = str(meta.get("key", os.path.basename(os.path.normpath(path))))
        uri = str(meta.get("uri", ""))
        name = meta.get("name")
        return cls(key, uri, name if isinstance(name, str) and name else source_name(uri) or key, created)


@dataclass(frozen=True)
class CacheEntry:
    """A published entry: its key, name, directory, origin URI, size on disk and when it was created and last used."""

    key: str
    path: str
    uri: str
    size: int
    created: float
    last_used: float
    in_use: bool
    name: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Swept:
    """Something ``sweep`` removed: an abandoned ``partial`` pull, or a ``temp`` file or directory."""

    path: str
    kind: str
    size: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class Lease:
    """A shared "in use" lock on an entry; released by ``close()`` or when the lease is garbage collected."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        if self._fd is not None:
            self._finalizer()
            self._fd = None


class ModelCache:
    """A directory of verified checkpoints shared by every process on the node."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root) if root is not None else default_cache_dir())

    # -- paths -------------------------------------------------------------------------------------------------
    def entry_dir(self, key: str) -> str:
        return os.path.join(self.root, "models", key_dirname(key))

    def partial_dir(self, key: str) -> str:
        return os.path.join(self.root, "partial", key_dirname(key))

    def lock_path(self, key: str, kind: str) -> str:
        return os.path.join(self.root, "locks", f"{key_dirname(key)}.{kind}")

    def ensure_dirs(self) -> None:
        """Create the cache's directories; a read-only or unwritable cache is a clear ``CacheError``."""
        for sub in ("models", "partial", "locks", "trash"):
            path = os.path.join(self.root, sub)
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise CacheError(f"cache directory {path} cannot be created: {exc.strerror}") from None
        probe = os.path.join(self.root, "locks", f".probe-{os.getpid()}")
        try:
            with open(probe, "w", encoding="ascii"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise CacheError(
                f"cache directory {self.root} is not writable ({exc.strerror}); set PREHEAT_CACHE_DIR or --cache-dir "
                "to a writable directory"
            ) from None

    # -- lookup and use ------------------------------------------------------------------------------------------
    def lookup(self, key: str) -> str | None:
        """The published directory of ``key``, or None (also for strings that cannot be keys, such as URIs)."""
        try:
            path = self.entry_dir(key)
        except CacheError:
            return None
        return path if os.path.isfile(os.path.join(path, META_NAME)) else None

    def find_uri(self, uri: str) -> str | None:
        """The key of a published entry pulled from ``uri``, if any (no network)."""
        for entry in self.entries():  # the most recently used first, when several came from it
            if entry.uri == uri:
                return entry.key
        return None

    def find_name(self, name: str) -> str | None:
        """The directory of the newest published entry named ``name`` (``EntryMeta.name``), if any (no network)."""
        named = [(meta.created, path) for path, meta in self._published() if meta.name == name]
        return max(named)[1] if named else None

    def name_entry(self, key: str, name: str) -> None:
        """Record ``name`` as the name of the published entry ``key`` (atomically: the entry stays published)."""
        meta_path = os.path.join(self.entry_dir(key), META_NAME)
        try:
            meta = read_object(meta_path, max_bytes=META_BYTES)
            durable.write_file(meta_path, json.dumps({**meta, "name": name}).encode())
        except (OSError, ValueError) as exc:  # ValueError: jsonsafe's JSONInputError (not JSON, not an object)
            raise CacheError(f"cache entry {key} in {self.root} cannot be named {name!r}: {exc}") from None

    def lease(self, key: str) -> Lease:
        """Mark ``key`` in use until the lease is closed (gc and rm skip it) and record the use for LRU."""
        self.ensure_dirs()
        lease = Lease(locks.hold_shared(self.lock_path(key, "use")))
        self.touch(key)
        return lease

    @contextmanager
    def using(self, key: str) -> Iterator[str]:
        """``with cache.using(key) as path:`` the entry cannot be removed inside the block."""
        lease = self.lease(key)
        try:
            path = self.lookup(key)
            if path is None:
                raise CacheError(f"cache entry {key} is not in {self.root}")
            yield path
        finally:
            lease.close()

    def touch(self, key: str) -> None:
        meta = os.path.join(self.entry_dir(key), META_NAME)
        if os.path.exists(meta):
            now = time.time()
            os.utime(meta, (now, now))

    # -- listing, removal, gc ------------------------------------------------------------------------------------
    def _published(self) -> Iterator[tuple[str, EntryMeta]]:
        """(directory, record) of every published entry, in name order; without sizes or locks (cheap)."""
        models = os.path.join(self.root, "models")
        for name in _listdir(models):
            path = os.path.join(models, name)
            meta = EntryMeta.read(path)
            if meta is not None:
                yield path, meta

    def entries(self) -> list[CacheEntry]:
        """Published entries, most recently used first."""
        out = []
        for path, meta in self._published():
            try:
                last_used = os.stat(os.path.join(path, META_NAME)).st_mtime
            except OSError:
                continue  # removed since it was read
            out.append(
                CacheEntry(
                    key=meta.key,
                    path=path,
                    uri=meta.uri,
                    size=_tree_size(path),
                    created=meta.created,
                    last_used=last_used,
                    in_use=self._in_use(meta.key),
                    name=meta.name,
                )
            )
        out.sort(key=lambda e: e.last_used, reverse=True)
        return out

    def _in_use(self, key: str) -> bool:
        lock = self.lock_path(key, "use")
        if not os.path.exists(lock):
            return False
        fd = locks.try_exclusive(lock)
        if fd is None:
            return True
        os.close(fd)
        return False

    def remove(self, key: str) -> None:
        """Remove the entry ``key``; refuses (``CacheError``) while any process uses it."""
        path = self.lookup(key)
        if path is None:
            raise CacheError(f"no cache entry {key} in {self.root}")
        fd = locks.try_exclusive(self.lock_path(key, "use"))
        if fd is None:
            raise CacheError(f"cache entry {key} is in use by another process; not removed")
        try:
            # Rename first so the entry disappears atomically; the slow delete happens out of sight.
            trash = os.path.join(self.root, "trash", f"{key_dirname(key)}-{os.getpid()}-{time.monotonic_ns()}")
            os.makedirs(os.path.dirname(trash), exist_ok=True)
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        finally:
            os.close(fd)

    def gc(self, max_bytes: int) -> list[CacheEntry]:
        """Remove least recently used entries until the cache holds at most ``max_bytes``; entries in use stay."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed: list[CacheEntry] = []
        for entry in reversed(entries):  # least recently used first
            if total <= max_bytes:
                break
            if entry.in_use:
                continue
            try:
                self.remove(entry.key)
            except CacheError:
                continue  # became in use between listing and removal
            removed.append(entry)
            total -= entry.size
        shutil.rmtree(os.path.join(self.root, "trash"), ignore_errors=True)
        return removed

    def sweep(self, stale_after: float = STALE_AFTER) -> list[Swept]:
        """Remove what dead processes left behind, untouched for ``stale_after`` seconds: ``partial/<key>`` of pulls
        no process runs (nobody holds ``locks/<key>.pull``) and temporary files (``trash/``, ``locks/.probe-*``).

        A live pull's partial is never touched, whatever its age: the sweep holds the pull lock while it removes one,
        so a pull that starts meanwhile waits and then starts afresh. Lock files stay (removing a lock file that a
        process is about to open would let two processes hold "the" lock).
        """
        now = time.time()
        swept: list[Swept] = []
        partials = os.path.join(self.root, "partial")
        for name in sorted(os.listdir(partials)) if os.path.isdir(partials) else []:
            path = os.path.join(partials, name)
            if name.startswith(".") or not os.path.isdir(path):
                continue
            held = locks.try_exclusive(os.path.join(self.root, "locks", f"{name}.pull"))
            if held is None:
                continue  # a pull is running
            try:
                if now - _newest_mtime(path) >= stale_after:
                    size = _tree_size(path)
                    self._discard(path, name)
                    swept.append(Swept(path, "partial", size))
            finally:
                os.close(held)
        leftovers = [os.path.join(self.root, "trash", n) for n in _listdir(os.path.join(self.root, "trash"))]
        leftovers += [
            os.path.join(self.root, "locks", n) for n in _listdir(os.path.join(self.root, "locks")) if n.startswith(".")
        ]
        for path in leftovers:
            try:
                if now - _newest_mtime(path) < stale_after:
                    continue
                size = _tree_size(path)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                continue  # removed by its owner meanwhile
            swept.append(Swept(path, "temp", size))
        return swept

    def _discard(self, path: str, name: str) -> None:
        """Rename ``path`` into ``trash/`` (it vanishes at once), then delete it."""
        trash = os.path.join(self.root, "trash", f"{name}-{os.getpid()}-{time.monotonic_ns()}")
        os.makedirs(os.path.dirname(trash), exist_ok=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def publish(self, key: str, uri: str, *, name: str | None = None) -> str:
        """Atomically and durably move a finished ``partial/<key>`` into ``models/<key>``; returns the entry directory.
        ``name``: what the entry is called (default ``source_name(uri)``, else the key).

        Every file and directory of the entry is fsynced before the rename, and the directories whose names changed
        after it: once this returns, a power loss leaves the complete entry; before, it leaves no entry.
        """
        partial = self.partial_dir(key)
        name = name or source_name(uri) or key
        meta = {"key": key, "uri": uri, "name": name, "created": time.time(), "format": 1}
        with open(os.path.join(partial, META_NAME), "w", encoding="utf-8") as handle:
            json.dump(meta, handle)
        durable.fsync_tree(partial)
        target = self.entry_dir(key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(partial, target)
        durable.fsync_path(os.path.dirname(target))
        durable.fsync_path(os.path.dirname(partial))
        return target


def resolve_model(model: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """MODEL as ``preheat serve`` and ``preheat up`` take it: a URI or an existing path as it is; else, a plain name
    (no ``/``) of a node-cache entry: the directory of the newest entry of that name; else MODEL unchanged, for the
    caller to refuse naming what it expected.

    >>> resolve_model("https://models.internal/llama-3-8b")
    'https://models.internal/llama-3-8b'
    """
    if not model or "://" in model or os.path.exists(model) or "/" in model or model in (".", ".."):
        return model
    return ModelCache(cache_dir).find_name(model) or model


def link_entry(link: str, entry: str) -> None:
    """Point the symlink ``link`` at the entry directory ``entry``, replacing what ``link`` was (atomically: a reader
    sees the old target or the new one). A fixed path for a programme that must be given one before the entry's key
    is known: a Kubernetes vLLM replica's MODEL is the link its init container made (docs/kubernetes.md).
    ``CacheError`` when it cannot be made (a missing directory, an existing directory at ``link``)."""
    temp = durable.temp_path(link)
    try:
        os.symlink(os.path.abspath(entry), temp)
        os.replace(temp, link)
    except OSError as exc:
        durable.discard(temp)
        raise CacheError(f"cannot link {link} to {entry}: {exc.strerror}") from None
    durable.fsync_dir(os.path.dirname(os.path.abspath(link)))


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def _newest_mtime(path: str) -> float:
    """The latest modification time of ``path`` or anything under it (0 when it is gone)."""
    paths = [path]
    if os.path.isdir(path) and not os.path.islink(path):
        for dirpath, dirs, files in os.walk(path):
            paths += [os.path.join(dirpath, name) for name in (*dirs, *files)]
    newest = 0.0
    for one in paths:
        try:
            newest = max(newest, os.lstat(one).st_mtime)
        except OSError:
            continue
    return newest


def _tree_size(path: str) -> int:
    if not os.path.isdir(path):
        try:
            return os.lstat(path).st_blocks * 512
        except OSError:
            return 0
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total
