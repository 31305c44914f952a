"""Weights mapped, and their page tables filled, before torch is there (docs/server.md, *Start-up order*).

A CPU load maps each safetensors file and hands out views of the mapping (``preheat.loader.load``'s ``mmap`` mode); the
engine then fills the mapping's page tables (``MADV_POPULATE_READ``, ~0.06 s for SmolLM2's 538 MB) so the first
forward pass does not fault page by page. Neither needs torch, and the kernel does both with the GIL released, so a
server does them while torch imports: ``map_files`` maps each file exactly as the loader would and populates it,
and the loader adopts a mapping (``Premapped.adopt``) instead of mapping the file again, when it is still the same
file (device, inode, size and modification time unchanged since it was mapped). Torch-free (a test checks it).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from dataclasses import dataclass

from preheat.io.buffers import populate_read

log = logging.getLogger("preheat.io")


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


@dataclass
class Premapped:
    """One file mapped privately and readable (copy-on-write, as the loader maps it), whole, pages populated."""

    path: str
    mapping: mmap.mmap
    identity: tuple[int, int, int, int]
    populated: bool  # page tables filled (False on a kernel without MADV_POPULATE_READ)

    def adopt(self, fd: int, length: int) -> mmap.mmap | None:
        """The mapping, for a loader that opened ``fd`` and needs its first ``length`` bytes; None (and the mapping
        closed) when the file changed since it was mapped or is shorter: the loader then maps it itself."""
        if _identity(os.fstat(fd)) == self.identity and len(self.mapping) >= length:
            return self.mapping
        log.info("%s changed since it was mapped at start-up: mapping it again", self.path)
        self.close()
        return None

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # views of it are alive (a loader adopted it): they keep it mapped
            self.mapping.close()


def map_files(paths: list[str]) -> dict[str, Premapped]:
    """Map and populate each of ``paths`` (blocking this thread, the GIL released); what cannot be mapped is left
    out, for the loader to map (or report) itself."""
    mapped: dict[str, Premapped] = {}
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            log.info("start-up mapping of %s skipped: %s", path, exc)
            continue
        try:
            stat = os.fstat(fd)
            if stat.st_size == 0:
                continue
            mapping = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            log.info("start-up mapping of %s skipped: %s", path, exc)
            continue
        finally:
            os.close(fd)
        address = _address(mapping)
        # False (old kernel): the engine touches the pages itself later.
        populated = address is not None and populate_read(address, len(mapping))
        mapped[os.path.realpath(path)] = Premapped(path, mapping, _identity(stat), populated)
    return mapped


def _address(mapping: mmap.mmap) -> int | None:
    import ctypes

    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    except (TypeError, ValueError):
        return None
