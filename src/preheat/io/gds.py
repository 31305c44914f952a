"""GPUDirect Storage through kvikio's cuFile bindings: file bytes go straight into device memory, no CPU bounce.

kvikio is optional (``pip install kvikio-cu12``). Without the GDS kernel driver, kvikio runs in "compatibility mode"
(POSIX reads through its own pinned bounce buffers); ``gds_status`` says which one a load will get.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from preheat.core.errors import CheckpointError, DeviceError
from preheat.io.reads import DISCARD, FileJob, Progress


@dataclass(frozen=True)
class GDSStatus:
    available: bool
    compat_mode: bool
    detail: str


def _kvikio() -> ModuleType | None:
    try:
        return importlib.import_module("kvikio")
    except ImportError:
        return None


def gds_status() -> GDSStatus:
    """Whether kvikio is importable, a GPU is present, and whether true GDS (not compatibility mode) is active. Never
    raises: a kvikio this code does not fit is reported as unavailable, with the reason (``auto`` then reads through
    the pinned pipeline)."""
    kvikio = _kvikio()
    if kvikio is None:
        return GDSStatus(False, False, "kvikio is not installed (pip install kvikio-cu12 or kvikio-cu13)")
    if not torch.cuda.is_available():
        return GDSStatus(False, False, "no CUDA device")
    try:
        defaults = _defaults(kvikio)
        if hasattr(defaults, "is_compat_mode_preferred"):
            compat = bool(defaults.is_compat_mode_preferred())
        else:  # kvikio < 24.10 spelled it differently
            compat = bool(defaults.compat_mode())
    except Exception as exc:  # an unknown kvikio: no GDS, said why, never a failed load
        version = getattr(kvikio, "__version__", "?")
        return GDSStatus(False, False, f"kvikio {version} is not usable here ({type(exc).__name__}: {exc})")
    detail = "kvikio in compatibility mode (POSIX reads, no GDS driver)" if compat else "GPUDirect Storage via cuFile"
    return GDSStatus(True, compat, detail)


def _defaults(kvikio: ModuleType) -> ModuleType:
    """``kvikio.defaults``: a submodule that kvikio 26.x no longer imports with the package (seen on an H200 with
    kvikio-cu13 26.10: ``module 'kvikio' has no attribute 'defaults'``)."""
    return importlib.import_module(f"{kvikio.__name__}.defaults")


def run_gds(jobs: Sequence[FileJob], *, threads: int, chunk_bytes: int, progress: Progress | None = None) -> int:
    """Read every job's pieces straight into its device buffer with cuFile; returns the bytes read."""
    kvikio = _kvikio()
    if kvikio is None or not torch.cuda.is_available():
        raise DeviceError(f"mode 'gds' needs kvikio and a CUDA device: {gds_status().detail}")
    _set_threads(kvikio, threads)
    total = 0
    for job in jobs:
        handle = kvikio.CuFile(job.path, "r")
        try:
            futures = []
            for op in job.ops:
                cursor = op.file_offset
                for dest, length in op.pieces:
                    if dest != DISCARD and length:
                        target = job.dest[dest : dest + length]
                        futures.append((handle.pread(target, length, cursor, task_size=chunk_bytes), length, cursor))
                    cursor += length
            for future, length, offset in futures:
                got = future.get()
                if got != length:
                    raise CheckpointError(
                        f"{job.path}: cuFile read {got} of {length} bytes at {offset}; the file is truncated",
                        path=job.path,
                    )
                total += got
                if progress is not None:
                    progress(got)
        finally:
            handle.close()
    torch.cuda.synchronize()
    return total


def _set_threads(kvikio: ModuleType, threads: int) -> None:
    defaults = _defaults(kvikio)
    if hasattr(defaults, "set"):
        defaults.set("num_threads", threads)
    elif hasattr(defaults, "num_threads_reset"):
        defaults.num_threads_reset(threads)
