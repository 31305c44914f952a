"""The bucketed hand-off: a checkpoint's tensors streamed into a destination in buckets of a bounded byte size, each
bucket checked, handed to an engine's copy (``hand_off``) and freed before the next one is filled.

    >>> report = handoff_in_buckets("model_dir", model.load_weights, device="cuda")   # doctest: +SKIP
    >>> report.buckets, report.peak_extra_bytes                                        # doctest: +SKIP

Where ``preheat.load`` returns every tensor at once (one buffer per file), this holds at most one bucket: the extra
memory of a load into an engine's own parameters is one bucket (or the largest tensor, when a bucket is smaller),
not the model. The reads are ``preheat.load``'s: its plan (mode, headers, TP slices, which tensors are checked) and
its readers, run once per bucket on one pool of threads: on CUDA the bucket is device memory filled by cuFile (GDS,
when active and the load need not be checked) or by the pinned double-buffered staging pipeline, one stream per
thread; on the CPU it is private memory filled by ``preadv`` (``read``) or O_DIRECT (``direct``), never a mapping.

Each tensor is checked against its digest in ``preheat.json`` as its bytes land (the rules of ``preheat.load``:
docs/loader.md, *Verification*); a mismatch in bucket k raises ``CheckpointError`` before bucket k is handed over.
Planning (``plan_buckets``) is pure: file plans in, buckets out.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from preheat.checkpoint import torch_dtypes
from preheat.checkpoint.digest import ExpectedDigest, TensorDigests
from preheat.core.config import LoaderSettings
from preheat.core.errors import ConfigError, DeviceError, DirectIOUnsupported
from preheat.core.sizes import format_bytes
from preheat.io.buffers import PAGE, mapped_buffer, round_up
from preheat.io.gds import gds_status, run_gds
from preheat.io.pipeline import StagedReader
from preheat.io.reads import Extent, FileJob, ParallelReader, plan_ops
from preheat.io.tuning import MIN_CHUNK
from preheat.loader.load import FilePlan, LoadPlan, LoadRequest, PlacedTensor, plan_load

log = logging.getLogger("preheat.load")

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
_ALIGN = 64  # each tensor starts on a cache line in its bucket: aligned for every dtype

HandOff = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
# (bytes, device) -> a uint8 tensor of that many bytes there: where a bucket's memory comes from.
Allocate = Callable[[int, torch.device], torch.Tensor]


# -- planning (pure) -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketTensor:
    """One tensor of a bucket: its ``nbytes`` start at ``offset`` of the bucket's buffer, filled from ``extents``
    (file ranges of file ``file`` of the load plan, each to a bucket offset)."""

    file: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class Bucket:
    tensors: tuple[BucketTensor, ...]
    nbytes: int  # the buffer it needs (tensor bytes plus alignment)


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]
    largest_tensor: int
    # Set when ``bucket_bytes`` cannot hold the largest tensor: every bucket then holds one tensor.
    one_per_bucket: str = ""


def tensor_extents(plan: FilePlan, placed: PlacedTensor) -> tuple[Extent, ...]:
    """The file ranges that fill ``placed`` (one of ``plan.tensors``), with destinations relative to its first byte.

    The plan's extents map file bytes to buffer offsets (``plan_file``: the whole data region in one extent, or a TP
    rank's runs); a tensor is the part of them that lands in its own byte range of the buffer. For the whole data
    region read from file offset 100 into offset 0, a tensor placed at offset 8 is the file's bytes from 108.
    """
    lo, hi = placed.offset, placed.offset + placed.nbytes
    starts = [e.dest_offset for e in plan.extents]
    out: list[Extent] = []
    for extent in plan.extents[max(0, bisect_right(starts, lo) - 1) :]:
        if extent.dest_offset >= hi:
            break
        a, b = max(lo, extent.dest_offset), min(hi, extent.dest_offset + extent.length)
        if b > a:
            out.append(Extent(extent.file_offset + a - extent.dest_offset, b - a, a - lo))
    return tuple(out)


def plan_buckets(files: Sequence[FilePlan], bucket_bytes: int, *, align: int = _ALIGN) -> BucketPlan:
    """Pack the tensors of ``files`` (in file order, then buffer order) into buckets of at most ``bucket_bytes``, each
    tensor at an ``align``-aligned offset of its bucket. A tensor larger than ``bucket_bytes`` gets a bucket of its
    own (the extra memory is then up to the largest tensor) and ``one_per_bucket`` says so; the others are still
    packed, so a bucket a little smaller than the embedding does not cut a model into one bucket per tensor."""
    if bucket_bytes < 1:
        raise ConfigError(f"bucket size must be at least 1 byte, not {bucket_bytes}")
    tensors = [(k, plan, placed) for k, plan in enumerate(files) for placed in plan.tensors]
    largest = max((placed.nbytes for _, _, placed in tensors), default=0)
    note = ""
    if largest > bucket_bytes:
        name = next(placed.name for _, _, placed in tensors if placed.nbytes == largest)
        larger = sum(1 for _, _, placed in tensors if placed.nbytes > bucket_bytes)
        note = (
            f"a bucket of {format_bytes(bucket_bytes)} cannot hold tensor {name!r} ({format_bytes(largest)}): "
            f"{larger} tensor(s) larger than a bucket get one tensor per bucket, so the extra memory is up to "
            f"{format_bytes(largest)}"
        )
    buckets: list[Bucket] = []
    current: list[BucketTensor] = []
    cursor = 0
    for k, plan, placed in tensors:
        alone = placed.nbytes > bucket_bytes
        start = round_up(cursor, align)
        if current and (alone or start + placed.nbytes > bucket_bytes):
            buckets.append(Bucket(tuple(current), cursor))
            current, start = [], 0
        current.append(
            BucketTensor(k, placed.name, placed.dtype, placed.shape, start, placed.nbytes, tensor_extents(plan, placed))
        )
        cursor = start + placed.nbytes
        if alone:  # nothing joins a tensor that fills more than a bucket on its own
            buckets.append(Bucket(tuple(current), cursor))
            current, cursor = [], 0
    if current:
        buckets.append(Bucket(tuple(current), cursor))
    return BucketPlan(tuple(buckets), largest, note)


# -- the report ------------------------------------------------------------------------------------------------------


@dataclass
class BucketReport:
    """What a bucketed hand-off did. ``peak_extra_bytes``: the most bucket memory alive at once, measured (a bucket
    counts until the last tensor viewing it is freed, so a hand-off that keeps views shows here); ``retained_bytes``:
    bucket memory still alive after the load (the hand-off kept views instead of copying); ``device_peak_bytes``:
    on CUDA, ``torch.cuda.max_memory_allocated`` during the load less the memory allocated before it (the hand-off's
    own allocations included). ``read_seconds`` (allocate, read, check) and ``handoff_seconds`` (the hand-off's
    copies and the frees) alternate bucket by bucket; their sum is the load."""

    source: str
    device: str
    mode: str
    bucket_bytes: int
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    bytes_read: int = 0
    largest_bucket: int = 0
    largest_tensor: int = 0
    peak_extra_bytes: int = 0
    retained_bytes: int = 0
    device_peak_bytes: int | None = None
    threads: int = 0
    plan_seconds: float = 0.0
    read_seconds: float = 0.0
    handoff_seconds: float = 0.0
    verified: bool = False
    verified_tensors: int = 0
    notes: list[str] = field(default_factory=list)
    # The union of what the hand-off returned, when every call returned a set of names (vLLM's load_weights does).
    loaded: set[str] | None = None

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-ready values (``loaded`` left out: it is the engine's, and long)."""
        out = asdict(self)
        out.pop("loaded")
        return out


# -- execution -------------------------------------------------------------------------------------------------------


def handoff_in_buckets(
    path: str | os.PathLike[str],
    hand_off: HandOff,
    *,
    device: str | torch.device = "cpu",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    threads: int | None = None,
    verify: bool | None = None,
    rank: int = 0,
    world_size: int = 1,
    mode: str | None = None,
    allocate: Allocate | None = None,
) -> BucketReport:
    """Read the checkpoint at ``path`` (rank ``rank``'s slices of it when ``world_size > 1``, as ``preheat.load``
    cuts them) into ``device`` one bucket of at most ``bucket_bytes`` at a time, and call ``hand_off`` with each
    bucket's ``(name, tensor)`` pairs, in file order; the tensors are views of the bucket, valid during the call only
    unless the hand-off keeps them (then their bucket stays alive, and ``retained_bytes`` says so).

    ``mode``: ``preheat.load``'s (default ``PREHEAT_LOAD_MODE``): ``auto`` reads on the CPU and, on CUDA, uses GDS
    when it is active and the load need not be checked, else the pinned staging pipeline; ``read``, ``direct``,
    ``gds``; ``mmap`` is refused (a bucket is private memory). ``verify``: as ``preheat.load``'s (``None``: checked
    when there is a ``preheat.json`` and the bytes pass through host memory). ``allocate(nbytes, device)``: where a
    bucket's memory comes from (default: a private anonymous mapping on the CPU, returned to the system when freed;
    ``torch.empty`` on CUDA). On CUDA the device's peak-memory statistics are reset (to measure the load's).

    Raises ``CheckpointError`` (a tensor that does not match its digest: raised before its bucket is handed over),
    ``DeviceError`` (out of memory for a bucket: what was allocated is freed, and the message names the tensor and
    the bytes needed) or ``ConfigError``. Whatever the hand-off raises propagates, its bucket freed.
    """
    started = time.perf_counter()
    dev = torch.device(device)
    settings = LoaderSettings.from_env()
    chosen = mode or settings.mode
    if chosen == "mmap":
        raise ConfigError(
            "the bucketed hand-off reads each bucket into private memory; mode 'mmap' maps the files instead: use "
            "'auto', 'read' or 'direct' (or preheat.load(mode='mmap') for a mapping)"
        )
    if chosen == "auto" and dev.type == "cpu":
        chosen = "read"
    request = LoadRequest(
        os.fspath(path), dev, rank=rank, world_size=world_size, mode=chosen, threads=threads, verify=verify
    )
    plan = plan_load(request, settings)
    assert plan.tuning is not None  # a read mode, never mmap (refused above)
    align = PAGE if plan.mode in ("direct", "gds") else _ALIGN
    buckets = plan_buckets(plan.files, bucket_bytes, align=align)
    report = BucketReport(request.source, str(dev), plan.mode, bucket_bytes)
    report.buckets = len(buckets.buckets)
    report.tensors = sum(len(b.tensors) for b in buckets.buckets)
    report.bytes = sum(t.nbytes for b in buckets.buckets for t in b.tensors)
    report.largest_bucket = max((b.nbytes for b in buckets.buckets), default=0)
    report.largest_tensor = buckets.largest_tensor
    report.threads = plan.tuning.threads
    if buckets.one_per_bucket:
        report.notes.append(buckets.one_per_bucket)
        log.warning("preheat: %s", buckets.one_per_bucket)
    if plan.mode == "gds":
        status = gds_status()
        if status.compat_mode:
            report.notes.append(status.detail)
    if plan.checks.reason:
        report.notes.append(f"not verified against preheat.json: {plan.checks.reason}")
    report.plan_seconds = time.perf_counter() - started
    _Run(plan, report, allocate or _allocate).all(buckets.buckets, hand_off)
    report.verified = plan.checks.complete and report.verified_tensors == plan.checks.total
    log.info(
        "preheat: %d tensors, %s in %d bucket(s) of <= %s handed over (read %.2f s, hand-off %.2f s, peak extra %s, "
        "%s)",
        report.tensors,
        format_bytes(report.bytes),
        report.buckets,
        format_bytes(bucket_bytes),
        report.read_seconds,
        report.handoff_seconds,
        format_bytes(report.peak_extra_bytes),
        "verified" if report.verified else "UNVERIFIED",
    )
    return report


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    # Private memory that goes back to the system the moment the bucket's last view is freed (io.buffers): the
    # allocator's heap would keep freed buckets, and a load's footprint would be all of them after all.
    return mapped_buffer(nbytes)


class _Run:
    """One bucketed load: the readers and their threads (kept across buckets, so a CUDA lane keeps its pinned
    staging buffers and stream), the digests expected per file, and the live-bucket accounting."""

    def __init__(self, plan: LoadPlan, report: BucketReport, allocate: Allocate) -> None:
        assert plan.tuning is not None
        self.plan, self.report, self.allocate = plan, report, allocate
        self.device = plan.request.device
        self.cuda = self.device.type == "cuda"
        self.direct = plan.mode == "direct"
        self.expected: list[dict[str, ExpectedDigest]] = [{d.name: d for d in f} for f in plan.checks.files]
        tuning = plan.tuning
        self.threads, self.chunk_bytes = tuning.threads, tuning.chunk_bytes
        self.staged = StagedReader(self.device, self.threads, chunk_bytes=self.chunk_bytes) if self.cuda else None
        self.reader = ParallelReader(self.threads, chunk_bytes=self.chunk_bytes)
        self.alive: list[tuple[_Watch, int]] = []  # every bucket allocated and not yet seen freed

    def all(self, buckets: Sequence[Bucket], hand_off: HandOff) -> None:
        base = 0
        if self.cuda:
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        loaded: set[str] | None = set()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="preheat-bucket") as pool:
            for bucket in buckets:
                returned = self.one(bucket, hand_off, pool)
                if loaded is not None and isinstance(returned, (set, frozenset)):
                    loaded |= {str(name) for name in returned}
                else:
                    loaded = None
        self.report.loaded = loaded if buckets else None
        self.report.retained_bytes = self.live_bytes()
        if self.cuda:
            self.report.device_peak_bytes = torch.cuda.max_memory_allocated(self.device) - base

    def one(self, bucket: Bucket, hand_off: HandOff, pool: ThreadPoolExecutor) -> object:
        """Fill, check and hand over one bucket. The views are the only references to it once ``views`` returns,
        and the list holding them is emptied after the hand-off, also when it raised (a traceback keeps its frames'
        locals, the hand-off's argument among them, alive)."""
        t0 = time.perf_counter()
        views = self.views(bucket, pool)
        t1 = time.perf_counter()
        self.report.read_seconds += t1 - t0
        try:
            returned = hand_off(views)
            if self.cuda:
                # The hand-off's copies are queued on the current stream; the next bucket may reuse this memory and
                # is written on the readers' streams, which do not wait for that one. Wait here (which also makes
                # handoff_seconds the copies' time, not the time to queue them).
                torch.cuda.current_stream(self.device).synchronize()
            return returned
        finally:
            views.clear()
            self.report.handoff_seconds += time.perf_counter() - t1

    def views(self, bucket: Bucket, pool: ThreadPoolExecutor) -> list[tuple[str, torch.Tensor]]:
        buffer = self.fill(bucket, pool)
        return [(t.name, _view(buffer, t)) for t in bucket.tensors]

    def fill(self, bucket: Bucket, pool: ThreadPoolExecutor) -> torch.Tensor:
        """A fresh buffer holding ``bucket``'s bytes, each checked tensor checked; freed again if anything fails."""
        buffer: torch.Tensor | None = self.allocate_for(bucket)
        try:
            assert buffer is not None
            try:
                self.report.verified_tensors += self.read(bucket, buffer, pool, direct=self.direct)
            except DirectIOUnsupported as exc:
                # The filesystem refuses O_DIRECT: this bucket and the rest are read buffered, into the same memory.
                note = f"O_DIRECT is not supported for {exc.path}; fell back to buffered reads"
                log.warning("%s", note)
                self.report.notes.append(note)
                self.direct, self.report.mode = False, "read"
                self.report.verified_tensors += self.read(bucket, buffer, pool, direct=False)
            out, buffer = buffer, None
            return out
        finally:
            buffer = None

    def allocate_for(self, bucket: Bucket) -> torch.Tensor:
        nbytes = bucket.nbytes
        try:
            buffer = self.allocate(nbytes, self.device)
        except (torch.OutOfMemoryError, MemoryError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno not in (errno.ENOMEM, None):
                raise
            if self.cuda:
                torch.cuda.empty_cache()  # the buckets freed so far go back to the device, not only to torch's cache
            first = bucket.tensors[0].name if bucket.tensors else "(none)"
            more = f" and {len(bucket.tensors) - 1} more" if len(bucket.tensors) > 1 else ""
            raise DeviceError(
                f"out of {self.device} memory for the bucket holding tensor {first!r}{more}: it needs "
                f"{format_bytes(nbytes)} ({nbytes} bytes), and {format_bytes(self.live_bytes())} of earlier buckets "
                "are still held; nothing of this load is kept. Free memory on the device or use a smaller bucket "
                "(`bucket` in --model-loader-extra-config, PREHEAT_VLLM_BUCKET)"
            ) from exc
        live = self.live_bytes() + nbytes
        self.alive.append((_Watch(buffer), nbytes))
        self.report.peak_extra_bytes = max(self.report.peak_extra_bytes, live)
        return buffer

    def live_bytes(self) -> int:
        self.alive = [(watch, n) for watch, n in self.alive if watch.alive()]
        return sum(n for _, n in self.alive)

    def read(self, bucket: Bucket, buffer: torch.Tensor, pool: ThreadPoolExecutor, *, direct: bool) -> int:
        """Read ``bucket`` into ``buffer`` with preheat.load's readers; returns the tensors checked (new digests each
        call, so that a retry never hashes a byte twice). A digest mismatch raises ``CheckpointError`` here."""
        jobs, digests = self.jobs(bucket, buffer, direct=direct)
        if self.plan.mode == "gds":
            self.report.bytes_read += run_gds(jobs, threads=self.threads, chunk_bytes=self.chunk_bytes)
        elif self.staged is not None:
            self.report.bytes_read += self.staged.run(jobs, pool=pool)
        else:
            self.report.bytes_read += self.reader.run(jobs, pool=pool)
        return sum(d.finish() for d in digests)

    def bucket_chunk(self, bucket: Bucket) -> int:
        """Read operations of at most the tuned chunk, yet small enough that every bucket spreads over every thread:
        cut by the whole checkpoint's chunk size, a bucket of one 11 MiB tensor was one read on one thread (on an
        H200, 64 MiB buckets ran at 3.9 GB/s against 17.6 GB/s for 512 MiB ones, each bucket waiting on one lane)."""
        share = round_up(-(-bucket.nbytes // self.threads), PAGE)
        return max(MIN_CHUNK, min(self.chunk_bytes, share))

    def jobs(self, bucket: Bucket, buffer: torch.Tensor, *, direct: bool) -> tuple[list[FileJob], list[TensorDigests]]:
        by_file: dict[int, list[BucketTensor]] = {}
        for tensor in bucket.tensors:
            by_file.setdefault(tensor.file, []).append(tensor)
        jobs: list[FileJob] = []
        digests: list[TensorDigests] = []
        for k, tensors in by_file.items():
            file = self.plan.files[k].file
            expected = [self.expected[k][t.name] for t in tensors if t.name in self.expected[k]]
            landing = TensorDigests(expected, path=file.path, source=self.report.source) if expected else None
            if landing is not None:
                digests.append(landing)
            extents = [Extent(e.file_offset, e.length, t.offset + e.dest_offset) for t in tensors for e in t.extents]
            ops = plan_ops(extents, chunk_bytes=self.bucket_chunk(bucket))
            if not ops:
                continue
            jobs.append(
                FileJob(
                    file.path,
                    ops,
                    buffer,
                    self.plan.files[k].needed_size,
                    direct=direct,
                    scattered=not self.plan.files[k].whole,
                    open_source=file.open_source if file.origin is not None else None,
                    landing=landing,
                )
            )
        return jobs, digests


class _Watch:
    """Whether a bucket's memory is still alive: a weak reference to its storage, which every view of it shares (a
    reference to the tensor object would die with our own variable while a view the hand-off kept lives on)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._ref = StorageWeakRef(buffer.untyped_storage())  # type: ignore[no-untyped-call]  # untyped in torch

    def alive(self) -> bool:
        return not self._ref.expired()  # type: ignore[no-untyped-call]  # untyped in torch


def _view(buffer: torch.Tensor, tensor: BucketTensor) -> torch.Tensor:
    raw = buffer[tensor.offset : tensor.offset + tensor.nbytes]
    return raw.view(torch_dtypes.to_torch(tensor.dtype)).view(tensor.shape)
