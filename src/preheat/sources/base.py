"""The source protocol: random-access bytes of one file (``Source``) inside a directory-like place (``Origin``).

A ``Source`` answers ``size()`` and ``readv(offset, buffers)``, which fills the buffers with consecutive bytes from
``offset`` and returns how many bytes it wrote (fewer only at end of file; 0 means end of file). Implementations must
be safe to call from many threads at once: the loader reads different ranges of one source in parallel.

An ``Origin`` is where a checkpoint's files live (a directory, a URL prefix, an S3 prefix): it opens sources by
relative name and fetches small files (``config.json``, ``preheat.json``, an index) whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from preheat.errors import ConfigError

REMOTE_SCHEMES = ("http://", "https://", "s3://")


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
        """The whole content of small file ``name`` (configs, manifests, indexes)."""
        ...

    def open(self, name: str) -> Source:
        """A ``Source`` for file ``name``."""
        ...


def is_uri(location: str) -> bool:
    """True for the remote schemes preheat can stream from (``http://``, ``https://``, ``s3://``)."""
    return location.startswith(REMOTE_SCHEMES)


def check_name(name: str) -> str:
    """Refuse names that could escape an origin (absolute paths, ``..``): the names come from remote manifests."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"refusing file name {name!r}: only plain relative names inside the checkpoint are allowed")
    return name


def open_origin(location: str) -> Origin:
    """The origin for a local directory, an ``http(s)://`` prefix or an ``s3://bucket/prefix``."""
    if location.startswith("preheat://"):  # a name peers resolve, not a place: it is pulled, then loaded locally
        raise ConfigError(
            f"{location}: preheat:// names are pulled from peers into the node cache first: run "
            "'preheat pull preheat://NAME --registry URL' (or preheat.store.pull.pull) and load the entry it prints"
        )
    if location.startswith(("http://", "https://")):
        from preheat.sources.http import HTTPOrigin

        return HTTPOrigin(location)
    if location.startswith("s3://"):
        from preheat.sources.s3 import S3Origin

        return S3Origin(location)
    from preheat.sources.local import LocalOrigin

    return LocalOrigin(location)
