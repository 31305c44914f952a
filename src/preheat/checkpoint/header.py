"""One local safetensors file: open it and read its validated header (``read_header``), as a ``CheckpointFile``.

Its own module because both sides of a checkpoint need it: ``layout`` finds a checkpoint's files and reads their
headers, and ``manifest.build_manifest`` reads them to describe a directory; ``layout`` also reads manifests, so
neither could hold it without the two importing each other.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from preheat.checkpoint.safetensors import PREFIX_BYTES, SafetensorsHeader, header_length, parse_header
from preheat.core.errors import CheckpointError
from preheat.io.files import read_exact
from preheat.sources.base import Origin, Source
from preheat.sources.local import LocalFile


@dataclass(frozen=True)
class CheckpointFile:
    """One weights file: where it is, how big it was when planned, and its parsed header.

    ``path`` is a local path or a URL (for messages); remote files also carry their ``origin`` and relative ``name``.
    """

    path: str
    size: int
    header: SafetensorsHeader
    origin: Origin | None = None
    name: str = ""

    def open_source(self) -> Source:
        """Open this file's bytes (remote files only; local files are opened by the readers themselves)."""
        if self.origin is None:
            return LocalFile(self.path)
        return self.origin.open(self.name)


def read_header(path: str) -> CheckpointFile:
    """Open ``path``, read and validate its safetensors header."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found", path=path) from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a safetensors file", path=path) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open: {exc.strerror}", path=path) from None
    try:
        if hasattr(os, "posix_fadvise"):
            # Readahead after a header read would pull megabytes that a TP rank may never need.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            # Linux opens a directory read-only without complaint; only the first read fails (EISDIR).
            raise CheckpointError(f"{path}: is not a regular file, so it cannot be a safetensors file", path=path)
        size = info.st_size
        prefix = read_exact(fd, 0, min(PREFIX_BYTES, size), path=path)
        length = header_length(prefix, path=path, file_size=size)
        raw = read_exact(fd, PREFIX_BYTES, length, path=path)
        return CheckpointFile(path, size, parse_header(raw, path=path, file_size=size))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the header: {exc.strerror}", path=path) from None
    finally:
        os.close(fd)
