"""Read probes of the node: does the model's filesystem take O_DIRECT, and how fast does the model read cold and warm.

The O_DIRECT probe writes a 4 KiB scratch file in the cache directory (removed at once) when no model file is given.
The read probe reads at most ``probe_bytes`` of the model's largest files: cold with O_DIRECT where the filesystem
allows it, so it does not evict the model from the page cache a real start would use (elsewhere it drops only the
probed files), then warm from the page cache.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from preheat.doctor.check import Check, DoctorOptions
from preheat.doctor.findings import Finding
from preheat.doctor.node import cache_dir, existing_parent, missing, model_of
from preheat.io.files import mount_of
from preheat.io.reads import direct_io_supported

GB = 1e9
PROBE_CHUNK = 16 * 1024 * 1024
SLOW_COLD_GBPS = 1.0  # under this a cold read is slower than a single SATA SSD; NVMe reads 2-7 GB/s


def checks(options: DoctorOptions) -> list[Check]:
    found = [Check("node.o_direct", "node", 2.0, check_o_direct)]
    if options.io and options.model:
        found.append(Check("node.read_speed", "node", 8.0, check_read_speed))
    return found


def check_o_direct(options: DoctorOptions, bound_s: float) -> list[Finding]:
    model = model_of(options)
    if model is not None and model.files:
        target = model.files[0][0]
        supported = direct_io_supported(target)
    else:
        target = existing_parent(cache_dir(options))
        try:
            with tempfile.NamedTemporaryFile(dir=target, prefix=".preheat-doctor-") as scratch:
                scratch.write(b"\0" * 4096)
                scratch.flush()
                supported = direct_io_supported(scratch.name)
        except OSError as exc:
            return [Finding("node.o_direct", "node", "info", f"O_DIRECT not probed: {target} is not writable",
                            evidence={"path": target, "error": exc.strerror},
                            fix="Pass the model directory to probe its files instead.")]
    fstype = mount_of(target).fstype
    evidence = {"path": target, "fstype": fstype, "supported": supported}
    if supported:
        return [Finding("node.o_direct", "node", "ok", f"O_DIRECT works on {fstype}", evidence=evidence)]
    return [Finding("node.o_direct", "node", "info", f"O_DIRECT is not supported on {fstype}", evidence=evidence,
                    fix="`--mode direct` and GDS fall back to buffered reads here; cold-read numbers include the page "
                    "cache.")]


# -- read speed ------------------------------------------------------------------------------------------------------


def timed_read(
    paths: list[tuple[str, int]], max_bytes: int, seconds: float, *, direct: bool, threads: int
) -> tuple[int, float]:
    """Read up to ``max_bytes`` of ``paths`` (in order) with ``threads`` threads for at most ``seconds``.

    Returns (bytes, elapsed seconds). O_DIRECT needs aligned buffers and offsets: anonymous mmaps are page-aligned
    and every chunk offset is a multiple of the chunk size.
    """
    jobs: list[tuple[str, int, int]] = []
    planned = 0
    for path, size in paths:
        offset = 0
        while offset < size and planned < max_bytes:
            length = min(PROBE_CHUNK, size - offset, max_bytes - planned)
            jobs.append((path, offset, length))
            offset += length
            planned += length
    start = time.monotonic()
    deadline = start + seconds
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def worker(slice_: list[tuple[str, int, int]]) -> int:
        buffer = mmap.mmap(-1, PROBE_CHUNK)
        fds: dict[str, int] = {}
        done = 0
        try:
            for path, offset, length in slice_:
                if time.monotonic() > deadline:
                    break
                if path not in fds:
                    fds[path] = os.open(path, flags)
                # O_DIRECT reads whole pages; the file's tail may be shorter, which pread reports as fewer bytes.
                want = length if not direct else -(-length // 4096) * 4096
                done += min(length, os.preadv(fds[path], [memoryview(buffer)[:want]], offset))
        finally:
            for fd in fds.values():
                os.close(fd)
            buffer.close()
        return done

    slices = [jobs[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        total = sum(pool.map(worker, slices))
    return total, max(time.monotonic() - start, 1e-9)


def drop_page_range(path: str, offset: int, length: int) -> None:
    """Ask the kernel to evict ``length`` bytes of ``path`` from ``offset`` out of the page cache (clean pages only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_read_speed(options: DoctorOptions, bound_s: float) -> list[Finding]:

    model = model_of(options)
    if model is None:
        return [missing(options)]
    files = [(path, size) for path, size in model.files if size > 0]
    if not files:
        return [Finding("node.read_speed", "node", "info", f"{options.model} has no data to read",
                        evidence={"path": options.model})]
    threads = max(2, min(os.cpu_count() or 1, 8))
    direct = direct_io_supported(files[0][0])
    if not direct:
        # No O_DIRECT here: evict only the byte ranges the cold probe reads (clean pages), so a live node keeps the
        # rest of its model warm; the probe then faults exactly those ranges back in.
        left = options.probe_bytes
        for path, size in files:
            if left <= 0:
                break
            drop_page_range(path, 0, min(size, left))
            left -= size
    cold_bytes, cold_s = timed_read(files, options.probe_bytes, bound_s * 0.5, direct=direct, threads=threads)
    cached = cold_bytes
    if direct:  # O_DIRECT left the page cache as it was: bring the probed bytes in before timing a warm read
        cached, _ = timed_read(files, cold_bytes, bound_s * 0.25, direct=False, threads=threads)
    warm_bytes, warm_s = timed_read(files, cached, bound_s * 0.15, direct=False, threads=threads)
    cold, warm = cold_bytes / cold_s, warm_bytes / warm_s
    seconds = model.nbytes / cold if cold > 0 else None
    evidence = {"path": options.model, "model_bytes": model.nbytes, "probed_bytes": cold_bytes,
                "cold_gbps": round(cold / GB, 3), "warm_gbps": round(warm / GB, 3), "cold_method":
                "O_DIRECT" if direct else "fadvise(DONTNEED)", "threads": threads,
                "model_cold_read_s": None if seconds is None else round(seconds, 3)}
    title = f"model reads at {cold / GB:.2f} GB/s cold, {warm / GB:.2f} GB/s from the page cache"
    if cold / GB < SLOW_COLD_GBPS:
        return [Finding("node.read_slow", "node", "warn", title, seconds=seconds, evidence=evidence,
                        fix="Keep the model on local NVMe (the node cache, `preheat pull`), pull from peers that hold "
                        "it, or pre-shard/quantize the checkpoint so each rank reads less.")]
    return [Finding("node.read_speed", "node", "ok", title, seconds=seconds, evidence=evidence)]
