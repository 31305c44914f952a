"""Pick reader threads and chunk size for the storage a checkpoint lives on.

The rules, and why (docs/loader.md has the measurements behind them):
- Local block devices (ext4/xfs on NVMe, SSD, virtio): one thread per core up to 8. A warm page cache is bound by
  memory copy speed, which scales with cores; a cold NVMe needs a queue depth of a few requests to reach its peak.
- Remote origins (HTTP(S), S3): 16 threads, each with its own connection, 16 MiB ranged requests. Object stores
  and CDNs cap each connection (often ~50-100 MB/s), so bandwidth comes from parallel streams.
- Network and parallel filesystems (NFS, Lustre, GPFS, BeeGFS, WekaFS, CephFS, FUSE mounts): 16 threads. Each
  request pays a network round trip, and striped filesystems only reach their aggregate bandwidth (FSx for Lustre:
  ~94 GiB/s over 20 targets) with many requests in flight.
- O_DIRECT and GPUDirect reads are DMA, not CPU copies: at least 8 threads, so the device sees a deeper queue
  (measured here: cold direct 1.9 GB/s with 2 threads, 2.2 GB/s with 8).
- A TP rank reading its slices of an unsharded checkpoint issues many small reads (row slices of a few KiB, readahead
  off so that no neighbour's bytes are fetched). Those are latency-bound: 16 threads (measured here, cold, rank 1 of
  2 of a 2 GB checkpoint: 4.1 s with 2 threads, 1.5 s with 16, 1.9 s with 32).
- Chunks of 64 MiB on local filesystems (warm 2 GB here: 16 MiB 6.4 GB/s, 64 MiB 7.3, 256 MiB 8.5, noisy; larger
  chunks mean fewer, longer kernel copies into huge pages), 32 MiB on network filesystems; always shrunk so that
  each thread gets at least 4 chunks, so a small checkpoint still spreads over every thread.
Users override either with ``threads=``/``chunk_bytes=`` or ``PREHEAT_THREADS``/``PREHEAT_CHUNK_BYTES``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from preheat.core.errors import ConfigError
from preheat.io.buffers import PAGE, round_up
from preheat.io.files import mount_of

MiB = 1024 * 1024
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "glusterfs",
        "gpfs",
        "beegfs",
        "wekafs",
        "virtiofs",
        "fuse",
    }
)
MIN_CHUNK = 1 * MiB


@dataclass(frozen=True)
class IOTuning:
    """The thread count and chunk size a load will use, and one line saying why."""

    threads: int
    chunk_bytes: int
    reason: str


def cpu_cores() -> int:
    """The cores this process may run on: its CPU affinity, which a container's cpuset narrows (``os.cpu_count()``
    counts the machine's), or every core where the platform has no affinity call (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS or fstype.startswith("fuse.")


def tune(
    path: str,
    total_bytes: int,
    *,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    dma: bool = False,
    scattered: bool = False,
    remote: bool = False,
) -> IOTuning:
    """Choose threads and chunk size for reading ``total_bytes`` from the filesystem holding ``path``."""
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be at least 1, got {threads}")
    if chunk_bytes is not None and chunk_bytes < PAGE:
        raise ConfigError(f"chunk_bytes must be at least {PAGE} bytes, got {chunk_bytes}")
    fstype = path.split("://", 1)[0] if remote else (mount_of(path).fstype or "unknown")
    cores = os.cpu_count() or 1
    if remote:
        auto_threads, auto_chunk, kind = 16, 16 * MiB, "remote origin, one connection per thread"
    elif is_network_fs(fstype):
        auto_threads, auto_chunk, kind = 16, 32 * MiB, "network filesystem"
    else:
        auto_threads, auto_chunk, kind = max(2, min(cores, 8)), 64 * MiB, "local filesystem"
    if dma:
        auto_threads, kind = max(auto_threads, 8), kind + ", DMA reads"
    if scattered:
        auto_threads, kind = max(auto_threads, 16), kind + ", scattered TP slices"
    chosen_threads = threads if threads is not None else auto_threads
    if chunk_bytes is not None:
        chosen_chunk = round_up(chunk_bytes, PAGE)
    else:
        # Give every thread at least 4 chunks so a small checkpoint still spreads over all of them.
        per_thread = total_bytes // max(1, chosen_threads * 4)
        chosen_chunk = round_up(max(MIN_CHUNK, min(auto_chunk, per_thread)), PAGE)
    reason = (
        f"{fstype} ({kind}), {cores} cores: {chosen_threads} threads"
        f"{' (set)' if threads is not None else ''}, {chosen_chunk // 1024} KiB chunks"
        f"{' (set)' if chunk_bytes is not None else ''}"
    )
    return IOTuning(chosen_threads, chosen_chunk, reason)
