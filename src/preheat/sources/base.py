"""The source protocol: random-access bytes of one file (``Source``) inside a directory-like place (``Origin``).

A ``Source`` answers ``size()`` and ``readv(offset, buffers)``, which fills the buffers with consecutive bytes from
``offset`` and returns how many bytes it wrote (fewer only at end of file; 0 means end of file). Implementations must
be safe to call from many threads at once: the loader reads different ranges of one source in parallel.

An ``Origin`` is where a checkpoint's files live (a directory, a URL prefix, an S3 prefix): it opens sources by
relative name and fetches small files (``config.json``, ``preheat.json``, an index) whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from preheat.core.errors import ConfigError, SourceError

REMOTE_SCHEMES = ("http://", "https://", "s3://")
# The most ``Origin.read_bytes`` holds in memory: files fetched whole are configs, tokenizers (~35 MB at most),
# indexes and manifests (~390 bytes a tensor: 256 MiB is ~650,000 tensors, a large MoE pre-sharded 8 ways). A server
# that announces or sends more gets ``SourceError`` instead of the process's memory. ``NetSettings.whole_file_limit``
# overrides it per remote origin.
READ_BYTES_LIMIT = 256 * 1024 * 1024


@runtime_checkable
class Source(Protocol):
    """Random-access bytes of one file."""

    @property
    def name(self) -> str:
        """A path or URL naming this source in messages."""
        ...

    def size(self) -> int:
        """Total size in bytes."""
        ...

    def readv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in order with bytes from ``offset``; return the count (short only at end of file)."""
        ...

    def close(self) -> None:
        """Release connections or descriptors. Safe to call twice."""
        ...


@runtime_checkable
class Origin(Protocol):
    """A directory-like place holding a checkpoint's files."""

    @property
    def uri(self) -> str:
        """The origin's own address: a path, ``http(s)://host/prefix`` or ``s3://bucket/prefix``."""
        ...

    def join(self, name: str) -> str:
        """The full path or URL of ``name`` inside this origin (for messages and cache keys)."""
        ...

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists in this origin."""
        ...

    def read_bytes(self, name: str) -> bytes:
        """The whole content of small file ``name`` (configs, manifests, indexes); ``SourceError`` past
        ``READ_BYTES_LIMIT`` bytes (``too_large``)."""
        ...

    def open(self, name: str) -> Source:
        """A ``Source`` for file ``name``."""
        ...


@dataclass(frozen=True)
class Validator:
    """What names one version of an origin's file, so a resumed pull can tell whether it changed.

    ``etag``: a strong entity tag (HTTP ``ETag``, S3 ``ETag``; weak ``W/`` tags say nothing about bytes and are not
    kept). ``modified``: HTTP ``Last-Modified``, S3 ``LastModified`` or a local file's ``st_mtime_ns``. ``inode``:
    local files only (a file replaced by rename gets a new one). Two validators are the same version only if every
    field is equal; one that has neither ``etag`` nor ``modified`` (and no inode) cannot tell versions of equal size
    apart, so it is ``weak`` and a pull never resumes over it.
    """

    size: int
    etag: str | None = None
    modified: str | None = None
    inode: int | None = None

    @property
    def weak(self) -> bool:
        return self.etag is None and self.modified is None and self.inode is None

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"size": self.size}
        fields = (("etag", self.etag), ("modified", self.modified), ("inode", self.inode))
        doc.update({k: v for k, v in fields if v is not None})
        return doc


def strong_etag(value: str | None) -> str | None:
    """``value`` if it is a strong entity tag (``"..."``), else None (absent, or weak ``W/"..."``)."""
    value = (value or "").strip()
    return value if len(value) >= 2 and value.startswith('"') and value.endswith('"') else None


@runtime_checkable
class Versioned(Protocol):
    """A ``Source`` that can name the version of the file it reads, and hold its reads to one version."""

    def validator(self) -> Validator:
        """The file's validator as first seen by this source (the same request that learnt its size)."""
        ...

    def require(self, pinned: Validator) -> None:
        """Read only version ``pinned`` from now on: raise ``SourceChangedError`` if this source sees another one
        now, or when a later read finds the file changed (HTTP ``If-Match``/``If-Unmodified-Since``, S3 ``IfMatch``,
        a local ``fstat``)."""
        ...


def too_large(where: str, size: int | None, limit: int) -> SourceError:
    """The error for a file fetched whole that has (``size``) or sends more than ``limit`` bytes."""
    has = f"is {size} bytes" if size is not None else "sent more than that"
    return SourceError(
        f"{where}: refused: files read whole (configs, tokenizers, indexes, manifests) may have at most {limit} "
        f"bytes, and this one {has}"
    )


def is_uri(location: str) -> bool:
    """True for the remote schemes preheat can stream from (``http://``, ``https://``, ``s3://``)."""
    return location.startswith(REMOTE_SCHEMES)


def check_name(name: str) -> str:
    """Refuse names that could escape an origin (absolute paths, ``..``): the names come from remote manifests."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"refusing file name {name!r}: only plain relative names inside the checkpoint are allowed")
    return name
