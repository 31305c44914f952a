"""``preheat.load``: plan which bytes each tensor needs, read them in parallel, hand back tensors as views.

Stages (each timed in the ``LoadReport``):
1. plan: resolve the source, parse and validate every header, compute each tensor's bytes for this TP rank, and
   turn them into large read operations;
2. allocate: one buffer per file (host memory, or one device allocation on CUDA);
3. read: parallel ``preadv`` (``read``), O_DIRECT (``direct``), cuFile (``gds``) or the pinned staging pipeline
   (CUDA with ``read``/``direct``); ``mmap`` maps the files instead and reads lazily on first touch;
4. device_sync: wait for the last device copies;
5. views: tensors are views into the file buffers; a view keeps its buffer alive, so no caller ever needs ``.clone()``.

Verification (docs/loader.md) happens inside the read stage: each tensor is hashed as its bytes land and checked
against its digest in ``preheat.json``; ``checkpoint/loadverify.py`` decides which tensors can and must be checked.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from preheat.checkpoint import dtypes, torch_dtypes
from preheat.checkpoint.digest import TensorDigests
from preheat.checkpoint.header import CheckpointFile
from preheat.checkpoint.layout import Checkpoint, open_checkpoint
from preheat.checkpoint.loadverify import VerifyPlan, plan_verification
from preheat.checkpoint.manifest import MANIFEST_NAME
from preheat.checkpoint.tp import TPPlan, rank_slice
from preheat.core import env
from preheat.core.config import LoaderSettings, format_bytes
from preheat.core.errors import CacheError, CheckpointError, ConfigError, DeviceError, DirectIOUnsupported
from preheat.io.buffers import PAGE, host_buffer, round_down, round_up
from preheat.io.files import ensure_size
from preheat.io.gds import gds_status, run_gds
from preheat.io.pipeline import StagedReader
from preheat.io.premap import Premapped
from preheat.io.reads import Extent, FileJob, ParallelReader, gather, plan_ops, split_extents
from preheat.io.tuning import IOTuning, tune
from preheat.sources.base import is_uri

if TYPE_CHECKING:
    from preheat.store import ModelCache

log = logging.getLogger("preheat.load")

MODES = ("auto", "mmap", "read", "direct", "gds")
_TENSOR_ALIGN = 64  # packed TP slices start on cache-line boundaries, so every dtype view is aligned


@dataclass
class LoadReport:
    """What a load did and how long each stage took. ``gbps`` is delivered tensor bytes per second of wall time."""

    source: str
    mode: str
    device: str
    rank: int
    world_size: int
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    bytes_read: int = 0
    threads: int = 0
    chunk_bytes: int = 0
    tuning: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # True when every returned tensor was checked against its preheat.json digest during this load; when False,
    # ``notes`` says why (verify=False, no manifest, a lazy mode, TP slices).
    verified: bool = False
    verified_tensors: int = 0

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["seconds"] = self.seconds
        out["gbps"] = self.gbps
        return out

    def summary(self) -> str:
        return (
            f"loaded {self.tensors} tensors, {format_bytes(self.bytes)} from {self.files} file(s) in "
            f"{self.seconds:.3f} s ({self.gbps:.2f} GB/s, mode={self.mode}, device={self.device}, "
            f"rank {self.rank}/{self.world_size}, {'verified' if self.verified else 'UNVERIFIED'})"
        )


class LoadResult(dict[str, torch.Tensor]):
    """The loaded tensors by name (a plain dict to every caller), plus ``.report``, the ``LoadReport``.

    ``cache_write`` is the background thread saving a remote checkpoint into the node-local cache (None when there
    is nothing to write); ``join()`` it to wait for the entry to be published.
    """

    report: LoadReport
    cache_write: threading.Thread | None = None
    # Keeps a cache entry marked "in use" (gc and rm skip it) for as long as these tensors are alive.
    cache_lease: object | None = None
    # (plan, buffer) per file of a read-mode load: what write-through saves. Internal.
    file_buffers: list[tuple[FilePlan, torch.Tensor]] | None = None
    # mmap: every mapping was adopted from preheat.io.premap with its page tables already filled (nothing to fault in).
    populated: bool = False
    # One memoryview per mapped file of an mmap load, while its tensors are being checked. Internal.
    mappings: list[memoryview] | None = None


@dataclass(frozen=True)
class PlacedTensor:
    """A tensor's place in its file buffer: byte offset and size, dtype and (rank-local) shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FilePlan:
    """How one file is read: extents of file bytes into one buffer of ``buffer_bytes``, and the tensors in it."""

    file: CheckpointFile
    extents: tuple[Extent, ...]
    tensors: tuple[PlacedTensor, ...]
    buffer_bytes: int
    needed_size: int
    whole: bool  # every tensor is read whole (no TP slicing), so the buffer is an image of the data region


def plan_file(file: CheckpointFile, tp_plan: TPPlan, rank: int, world_size: int, *, align_base: int) -> FilePlan:
    """Lay out ``file``'s tensors (rank ``rank``'s slices of them) in one buffer. Pure: no I/O.

    When nothing is sliced, the buffer mirrors the file's data region from ``round_down(data_start, align_base)``
    (one extent; direct I/O can read it in place). Otherwise each slice is packed at a 64-byte-aligned offset.
    """
    header = file.header
    slices = [(entry, rank_slice(entry, tp_plan, rank, world_size, path=file.path)) for entry in header.tensors]
    whole = all(s.dim is None or s.runs == ((e.start, e.nbytes),) for e, s in slices)
    if whole:
        base = round_down(header.data_start, align_base)
        end = header.data_end
        placed = tuple(PlacedTensor(e.name, e.dtype, e.shape, e.start - base, e.nbytes) for e, _ in slices)
        extents = (Extent(base, end - base, 0),) if end > base else ()
        return FilePlan(file, extents, placed, round_up(end - base, align_base), header.data_end, True)
    cursor = 0
    extents_list: list[Extent] = []
    placed_list: list[PlacedTensor] = []
    for entry, part in slices:
        cursor = round_up(cursor, _TENSOR_ALIGN)
        placed_list.append(PlacedTensor(entry.name, entry.dtype, part.shape, cursor, part.nbytes))
        for offset, length in part.runs:
            extents_list.append(Extent(offset, length, cursor))
            cursor += length
    return FilePlan(file, tuple(extents_list), tuple(placed_list), round_up(cursor, align_base), header.data_end, False)


def _resolve_mode(
    mode: str, device: torch.device, world_size: int, *, remote: bool = False, verify: bool | None = None
) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if remote:
        # Remote bytes arrive over sockets: they can only be read into buffers (streamed, never landing on disk).
        if mode not in ("auto", "read"):
            raise ConfigError(f"mode {mode!r} needs a local file; remote sources (http, https, s3) load with 'read'")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"device {device} was requested but torch sees no CUDA device")
        return "read"
    if device.type == "cpu":
        if mode == "gds":
            raise ConfigError("mode 'gds' reads into GPU memory; use device='cuda' or a CPU mode (mmap, read, direct)")
        if mode == "auto":
            # A TP rank's dim-1 slices would be strided views of a mapping, faulted in page by page; reading them
            # into one private buffer gives contiguous tensors and fetches only the rank's pages (docs/loader.md).
            return "mmap" if world_size == 1 else "read"
        return mode
    if device.type != "cuda":
        raise ConfigError(f"device {device} is not supported; use 'cpu' or 'cuda[:N]'")
    if mode == "mmap":
        raise ConfigError("mode 'mmap' is CPU only; on CUDA use 'auto', 'read', 'direct' or 'gds'")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device} was requested but torch sees no CUDA device")
    if mode == "auto":
        # GDS moves bytes past host memory, where nothing can hash them: a load that must be checked reads instead.
        status = gds_status()
        real_gds = status.available and not status.compat_mode
        return "gds" if real_gds and verify is not True else "read"
    return mode


@dataclass(frozen=True)
class LoadRequest:
    """What one load was asked for, validated: ``load``'s arguments less the cache choice (a cache hit loads the
    cached directory with the same request, ``source`` replaced)."""

    source: str
    device: torch.device
    rank: int = 0
    world_size: int = 1
    tp_plan: TPPlan = "auto"
    mode: str | None = None
    threads: int | None = None
    chunk_bytes: int | None = None
    progress: Callable[[int, int], None] | None = None
    dequantize: bool = False
    verify: bool | None = None
    premapped: dict[str, Premapped] | None = None  # mappings made while torch imported (io/premap.py): adopted

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not within world size {self.world_size}")
        if isinstance(self.tp_plan, str) and self.tp_plan != "auto":
            raise ConfigError(
                f"unknown tp_plan {self.tp_plan!r}: use 'auto' or a mapping of name patterns to a dim or None"
            )

    @property
    def remote(self) -> bool:
        return is_uri(self.source)


@dataclass(frozen=True)
class LoadPlan:
    """Everything decided before the first tensor byte is read: the mode, the checkpoint (files and parsed headers),
    which tensors are checked, and for the read modes each file's read plan and the I/O tuning."""

    request: LoadRequest
    mode: str
    checkpoint: Checkpoint
    # The rank and world size the files are sliced for: (0, 1) when the checkpoint is pre-sharded, since its files
    # already hold this rank's slices.
    part_rank: int
    parts: int
    checks: VerifyPlan
    files: tuple[FilePlan, ...]  # empty for mmap, which needs no read plan
    tuning: IOTuning | None  # None for mmap, which needs no thread tuning
    verify_threads: int  # threads hashing mapped pages (mmap with verification)
    seconds: float  # the time planning took (the report's "plan" stage)


def load(
    source: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    rank: int = 0,
    world_size: int = 1,
    tp_plan: TPPlan = "auto",
    mode: str | None = None,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    dequantize: bool = False,
    cache: ModelCache | str | os.PathLike[str] | bool | None = None,
    verify: bool | None = None,
    premapped: dict[str, Premapped] | None = None,
) -> LoadResult:
    """Load every tensor of a safetensors checkpoint (this rank's slices of them when ``world_size > 1``).

    >>> weights = preheat.load("model_dir", rank=1, world_size=2)      # doctest: +SKIP
    >>> weights.report.gbps                                             # doctest: +SKIP

    ``mode``: ``auto`` (CPU: ``mmap``, or ``read`` for a TP rank; CUDA: ``gds`` when GPUDirect Storage is active,
    else ``read`` through pinned staging buffers), ``mmap``, ``read``, ``direct`` (O_DIRECT, bypasses the page
    cache) or ``gds``.
    ``threads``/``chunk_bytes`` default to values tuned for the storage (``PREHEAT_THREADS``/``PREHEAT_CHUNK_BYTES``
    override). ``progress(done_bytes, total_bytes)`` is called from reader threads as bytes land.
    ``dequantize``: for a quantized preheat checkpoint (``preheat convert --dtype int8|fp8``), return each quantized
    weight restored to its compute dtype and no ``.scale`` tensors (default: the raw int8/fp8 weights and scales).
    A checkpoint pre-sharded with ``preheat convert --tp W`` must be loaded with ``world_size=W``; rank r then opens
    only its own files, which already hold its slices.
    ``cache`` (remote sources only): a ``ModelCache``, a cache directory, ``True`` for the default one, ``False`` for
    none; ``None`` uses the cache only when ``PREHEAT_CACHE_DIR`` is set. A cached checkpoint loads from local disk;
    otherwise it streams from the origin into memory and is written through to the cache in the background.
    ``verify``: check every tensor against its digest in ``preheat.json`` as its bytes land. ``None`` (default):
    required for remote sources (a checkpoint without a manifest, or TP slices of an unsharded one, is refused unless
    ``verify=False``); for local ones, done when there is a manifest and the mode reads into memory (``read``,
    ``direct``, CUDA staging), not for ``mmap``/``gds``. ``True``: every tensor or the load fails before reading.
    ``False``: nothing. ``report.verified`` says whether every tensor was checked, ``report.notes`` why not.
    ``premapped`` (``mmap`` mode): files ``preheat.io.premap.map_files`` already mapped, by real path; each one the
    load uses is taken out of the dict (still the same file, else mapped again), what is left is the caller's.
    Raises ``CheckpointError`` naming the file and tensor for any malformed or truncated input, or a tensor whose
    bytes do not match its digest (naming the source too); never returns a partial result.
    """
    settings = LoaderSettings.from_env()
    request = LoadRequest(
        os.fspath(source),
        torch.device(device),
        rank=rank,
        world_size=world_size,
        tp_plan=tp_plan,
        mode=mode,
        threads=threads,
        chunk_bytes=chunk_bytes,
        progress=progress,
        dequantize=dequantize,
        verify=verify,
        premapped=premapped,
    )
    node_cache = _node_cache(cache) if request.remote else None
    if node_cache is not None:
        hit = _load_cached(node_cache, request, settings)
        if hit is not None:
            return hit
    return _load_request(request, settings, node_cache)


def _load_request(request: LoadRequest, settings: LoaderSettings, node_cache: ModelCache | None) -> LoadResult:
    """Plan, execute, then what follows the read: write-through of a remote load, dequantisation, the totals."""
    plan = plan_load(request, settings)
    result = execute_load(plan)
    report = result.report
    if node_cache is not None and plan.parts == 1 and request.device.type == "cpu" and result.file_buffers is not None:
        _write_through(result, node_cache, request.source)
    result.file_buffers = None
    if request.dequantize and plan.checkpoint.manifest is not None:
        from preheat.checkpoint.quant import dequantize_weights

        dequantize_weights(result, plan.checkpoint.manifest, where=request.source)
    report.tensors = len(result)
    report.bytes = sum(t.numel() * t.element_size() for t in result.values())
    log.info("%s", report.summary())
    return result


def plan_load(request: LoadRequest, settings: LoaderSettings) -> LoadPlan:
    """Choose the mode, resolve the source and parse its headers, decide which tensors are checked, and (for the
    read modes) lay out each file's buffer and tune the reads. Reads headers only."""
    mode = _resolve_mode(
        request.mode or settings.mode,
        request.device,
        request.world_size,
        remote=request.remote,
        verify=request.verify,
    )
    started = time.perf_counter()
    checkpoint = open_checkpoint(request.source, rank=request.rank, world_size=request.world_size)
    part_rank, parts = (0, 1) if checkpoint.presharded else (request.rank, request.world_size)
    checks = plan_verification(
        checkpoint,
        [_whole_tensors(f, request.tp_plan, part_rank, parts) for f in checkpoint.files],
        verify=request.verify,
        remote=request.remote,
        mode=mode,
        rank=request.rank,
        world_size=request.world_size,
    )
    files: tuple[FilePlan, ...] = ()
    tuning = None
    if mode != "mmap":
        align = PAGE if mode in ("direct", "gds") else 1
        files = tuple(plan_file(f, request.tp_plan, part_rank, parts, align_base=align) for f in checkpoint.files)
        tuning = tune(
            checkpoint.files[0].path if checkpoint.files else request.source,
            sum(e.length for p in files for e in p.extents),
            threads=request.threads if request.threads is not None else settings.threads,
            chunk_bytes=request.chunk_bytes if request.chunk_bytes is not None else settings.chunk_bytes,
            dma=mode in ("direct", "gds"),
            scattered=not all(p.whole for p in files),
            remote=request.remote,
        )
    return LoadPlan(
        request,
        mode,
        checkpoint,
        part_rank,
        parts,
        checks,
        files,
        tuning,
        verify_threads=request.threads or settings.threads or 8,
        seconds=time.perf_counter() - started,
    )


def execute_load(plan: LoadPlan) -> LoadResult:
    """Read (or map) what ``plan`` says and check it; the result's ``report`` holds the stages so far."""
    request = plan.request
    report = LoadReport(request.source, plan.mode, str(request.device), request.rank, request.world_size)
    report.files = len(plan.checkpoint.files)
    report.stages["plan"] = plan.seconds
    if plan.tuning is None:  # mmap: the kernel reads pages when they are touched
        result = _load_mmap(
            plan.checkpoint, request.tp_plan, plan.part_rank, plan.parts, report, premapped=request.premapped
        )
        if plan.checks.count and result.mappings is not None:
            _check_mapped(result.mappings, plan.checkpoint, plan.checks, plan.verify_threads, report)
        result.mappings = None
        if request.progress is not None:
            mapped = plan.checkpoint.total_bytes
            request.progress(mapped, mapped)
    else:
        tuning = plan.tuning
        report.threads, report.chunk_bytes, report.tuning = tuning.threads, tuning.chunk_bytes, tuning.reason
        result = _load_read(
            list(plan.files),
            mode=plan.mode,
            device=request.device,
            threads=tuning.threads,
            chunk_bytes=tuning.chunk_bytes,
            progress=_Progress(request.progress, sum(e.length for p in plan.files for e in p.extents)),
            report=report,
            checks=plan.checks,
        )
    _report_verification(report, plan.checks)
    result.report = report
    return result


def _write_through(result: LoadResult, node_cache: ModelCache, uri: str) -> None:
    """Save a remote load's file buffers into the node cache in the background (``result.cache_write``)."""
    from preheat.store.writethrough import LoadedFile, start_write_through

    loaded = [
        LoadedFile(plan.file.name, plan.file.size, plan.file.header.data_start, plan.file.header.data_end, buf)
        for plan, buf in result.file_buffers or ()
    ]
    result.cache_write = start_write_through(node_cache, uri, loaded)
    result.report.notes.append(f"writing through to the node cache at {node_cache.root} in the background")


def _node_cache(cache: ModelCache | str | os.PathLike[str] | bool | None) -> ModelCache | None:
    from preheat.store import ModelCache

    if cache is None:
        return ModelCache() if env.get(env.CACHE_DIR) else None
    if cache is False:
        return None
    if cache is True:
        return ModelCache()
    if isinstance(cache, ModelCache):
        return cache
    return ModelCache(cache)


def _load_cached(cache: ModelCache, request: LoadRequest, settings: LoaderSettings) -> LoadResult | None:
    """Load ``request.source`` from the node cache when it holds it (one small request asks the origin for its
    identity): the cached directory loads by the local rules, with no cache."""
    from preheat.sources.open import open_origin
    from preheat.store.pull import origin_key

    try:
        key, manifest = origin_key(open_origin(request.source))
        if manifest is None and request.verify is not False:
            return None  # the load from the origin refuses it, saying why (no manifest: nothing to check against)
        path = cache.lookup(key)
        if path is None:
            return None
        lease = cache.lease(key)
    except (CacheError, OSError) as exc:
        log.warning("node cache at %s unusable, loading from the origin: %s", cache.root, exc)
        return None
    result = _load_request(replace(request, source=os.fspath(path)), settings, None)
    result.cache_lease = lease
    result.report.source = request.source
    # The entry is a local directory now, loaded by the local rules; its files were checked when it was published.
    result.report.notes.append(f"node cache hit: {path} (every file was checked against the digests when cached)")
    return result


class _Progress:
    """Sums bytes landed by all reader threads and reports (done, total) to the caller's callback."""

    def __init__(self, callback: Callable[[int, int], None] | None, total: int) -> None:
        self.callback, self.total, self.done = callback, total, 0
        self._lock = threading.Lock()

    def restart(self) -> None:
        """The read starts over (O_DIRECT refused: buffered now); the bytes counted so far land again."""
        with self._lock:
            self.done = 0

    def __call__(self, nbytes: int) -> None:
        if self.callback is not None:
            with self._lock:
                self.done += nbytes
                done = min(self.done, self.total)
            self.callback(done, self.total)


def _load_read(
    plans: list[FilePlan],
    *,
    mode: str,
    device: torch.device,
    threads: int,
    chunk_bytes: int,
    progress: _Progress,
    report: LoadReport,
    checks: VerifyPlan,
) -> LoadResult:
    direct = mode == "direct"
    t0 = time.perf_counter()
    buffers: list[torch.Tensor] = []
    for plan in plans:
        if device.type == "cuda":
            buffers.append(torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=device))
        else:
            buffers.append(host_buffer(plan.buffer_bytes, align=PAGE if direct else 64))
    t1 = time.perf_counter()
    report.stages["allocate"] = t1 - t0
    if mode == "gds":
        status = gds_status()
        if status.compat_mode:
            report.notes.append(status.detail)

    def read(direct: bool) -> list[TensorDigests | None]:
        """Read every file into its buffer; returns the digests checked as the bytes landed (new ones each call, so
        that a retry never hashes a byte twice). Sets ``report.bytes_read``."""
        digests = [
            TensorDigests(expected, path=p.file.path, source=report.source) if expected else None
            for p, expected in zip(plans, checks.files, strict=True)
        ]
        jobs = [
            job
            for p, buf, digest in zip(plans, buffers, digests, strict=True)
            for job in _file_jobs(p, buf, digest, direct=direct, chunk_bytes=chunk_bytes)
        ]
        if mode == "gds":
            report.bytes_read = run_gds(jobs, threads=threads, chunk_bytes=chunk_bytes, progress=progress)
        elif device.type == "cuda":
            report.bytes_read = StagedReader(device, threads, chunk_bytes=chunk_bytes, progress=progress).run(jobs)
        else:
            report.bytes_read = ParallelReader(threads, chunk_bytes=chunk_bytes, progress=progress).run(jobs)
        return digests

    # No O_DIRECT probe beforehand: a probe reads a page from disk that the load then reads again. A filesystem
    # without O_DIRECT refuses the open (or the first read) of a direct job instead, with DirectIOUnsupported, and
    # the load starts over with buffered reads into the same buffers.
    try:
        digests = read(direct)
    except DirectIOUnsupported as exc:
        note = f"O_DIRECT is not supported for {exc.path}; fell back to buffered reads"
        log.warning("%s", note)
        report.notes.append(note)
        report.mode = "read"
        progress.restart()
        digests = read(False)
    t2 = time.perf_counter()
    if device.type == "cuda" and mode != "gds":
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()
    report.stages["read"] = t2 - t1
    if t3 > t2:
        report.stages["device_sync"] = t3 - t2
    report.verified_tensors = sum(d.finish() for d in digests if d is not None)
    result = LoadResult()
    for plan, buf in zip(plans, buffers, strict=True):
        for placed in plan.tensors:
            result[placed.name] = _view(buf, placed, plan.file.path)
    result.file_buffers = list(zip(plans, buffers, strict=True))
    report.stages["views"] = time.perf_counter() - t3
    return result


def _file_jobs(
    plan: FilePlan, buf: torch.Tensor, digest: TensorDigests | None, *, direct: bool, chunk_bytes: int
) -> list[FileJob]:
    """The read jobs of one file: one, or for O_DIRECT two, so that no page is read from disk twice.

    Reading the header put the file's first pages in the page cache, and the last of them usually holds the first
    tensor bytes too. O_DIRECT bypasses the cache, so it would fetch that page again: the bytes before the first page
    boundary after the header are read buffered instead (a cache hit; one page from disk if it was evicted, with
    readahead off so that nothing past it comes along), and O_DIRECT reads from that boundary on. Listed in file order,
    so a checksum that needs a tensor's bytes in order gets them as before.
    """
    source = plan.file.open_source if plan.file.origin is not None else None
    scattered = not plan.whole

    def job(extents: Sequence[Extent], *, direct: bool, scattered: bool) -> FileJob:
        ops = plan_ops(extents, chunk_bytes=chunk_bytes)
        return FileJob(
            plan.file.path,
            ops,
            buf,
            plan.needed_size,
            direct=direct,
            scattered=scattered,
            open_source=source,
            landing=digest,
        )

    if not direct:
        return [job(plan.extents, direct=False, scattered=scattered)]
    cached, rest = split_extents(plan.extents, round_up(plan.file.header.data_start, PAGE))
    jobs = [job(cached, direct=False, scattered=True)] if cached else []
    return [*jobs, job(rest, direct=True, scattered=scattered)]


def _view(buf: torch.Tensor, placed: PlacedTensor, path: str) -> torch.Tensor:
    raw = buf[placed.offset : placed.offset + placed.nbytes]
    dtype = torch_dtypes.to_torch(placed.dtype)
    if placed.offset % dtypes.itemsize(placed.dtype):
        # The format does not promise aligned offsets; an unaligned tensor gets its own aligned copy.
        raw = raw.clone()
    try:
        return raw.view(dtype).view(placed.shape)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{path}: cannot view tensor {placed.name!r}: {exc}", path=path, tensor=placed.name
        ) from None


def _prefetch_rank_pages(mapping: mmap.mmap, file: CheckpointFile, tp_plan: TPPlan, rank: int, world_size: int) -> None:
    """A rank touches scattered slices. Fault-time readahead would pull in other ranks' bytes, and turning it off
    alone makes every fault a 4 KiB synchronous read (17 s instead of 2 s for 1 GB here). So: readahead off
    (MADV_RANDOM), then ask for exactly this rank's pages, merged into large ranges, to be read asynchronously."""
    mapping.madvise(mmap.MADV_RANDOM)
    plan = plan_file(file, tp_plan, rank, world_size, align_base=1)
    for op in plan_ops(plan.extents, chunk_bytes=64 * 1024 * 1024):
        start = round_down(op.file_offset, PAGE)
        end = min(round_up(op.file_offset + op.length, PAGE), len(mapping))
        if end > start:
            mapping.madvise(mmap.MADV_WILLNEED, start, end - start)


def _load_mmap(
    checkpoint: Checkpoint,
    tp_plan: TPPlan,
    rank: int,
    world_size: int,
    report: LoadReport,
    *,
    premapped: dict[str, Premapped] | None = None,
) -> LoadResult:
    """Map every file privately (copy-on-write: writes never reach the file), or adopt its ``premapped`` mapping,
    and return views; rank slices along dim 1 are strided views, so nothing is copied."""
    t0 = time.perf_counter()
    result = LoadResult()
    mappings: list[memoryview] = []
    populated = bool(checkpoint.files)
    for file in checkpoint.files:
        header = file.header
        if header.data_end == 0 or not header.tensors:
            mappings.append(memoryview(b""))
            continue
        fd = os.open(file.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            ensure_size(fd, header.data_end, path=file.path)
            early = premapped.pop(os.path.realpath(file.path), None) if premapped else None
            adopted = early.adopt(fd, header.data_end) if early is not None else None
            populated = populated and adopted is not None and early is not None and early.populated
            mapping = (
                adopted
                if adopted is not None
                else mmap.mmap(fd, header.data_end, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            )
        finally:
            os.close(fd)
        if world_size > 1:
            _prefetch_rank_pages(mapping, file, tp_plan, rank, world_size)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        mappings.append(memoryview(mapping))
        for entry in header.tensors:
            part = rank_slice(entry, tp_plan, rank, world_size, path=file.path)
            tensor = _view(
                whole, PlacedTensor(entry.name, entry.dtype, entry.shape, entry.start, entry.nbytes), file.path
            )
            if part.dim is not None and part.shape != entry.shape:
                tensor = tensor.narrow(part.dim, part.start, part.shape[part.dim])
            result[entry.name] = tensor
    report.stages["map"] = time.perf_counter() - t0
    result.populated = populated
    report.bytes_read = 0  # pages are read on first touch, by whoever touches them
    result.mappings = mappings
    return result


def _check_mapped(
    mappings: list[memoryview], checkpoint: Checkpoint, checks: VerifyPlan, threads: int, report: LoadReport
) -> None:
    """``verify=True`` with ``mmap``: hash every checked tensor's mapped pages now (faulting them in), in parallel."""
    t0 = time.perf_counter()
    step = 64 * 1024 * 1024
    digests = [
        TensorDigests(expected, path=file.path, source=report.source)
        for file, expected in zip(checkpoint.files, checks.files, strict=True)
    ]
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="preheat-verify") as pool:
        futures = [
            pool.submit(_land, digest, view, start, min(step, item.offset + item.nbytes - start))
            for digest, view, expected in zip(digests, mappings, checks.files, strict=True)
            for item in expected
            for start in range(item.offset, item.offset + item.nbytes, step)
        ]
        gather(futures)
    report.verified_tensors = sum(d.finish() for d in digests)
    report.stages["verify"] = time.perf_counter() - t0


def _land(digest: TensorDigests, view: memoryview, start: int, length: int) -> int:
    digest.landed(start, view[start : start + length], stable=True)
    return length


def _whole_tensors(file: CheckpointFile, tp_plan: TPPlan, rank: int, world_size: int) -> set[str]:
    """The tensors of ``file`` that rank ``rank`` reads whole (all of them without TP, or pre-sharded)."""
    whole = set()
    for entry in file.header.tensors:
        part = rank_slice(entry, tp_plan, rank, world_size, path=file.path)
        if part.runs == ((entry.start, entry.nbytes),) or entry.nbytes == 0:
            whole.add(entry.name)
    return whole


def _report_verification(report: LoadReport, checks: VerifyPlan) -> None:
    report.verified = checks.complete and report.verified_tensors == checks.total
    if checks.reason:
        checked = f"{report.verified_tensors} of {checks.total} tensors checked" if report.verified_tensors else ""
        note = f"not verified against {MANIFEST_NAME}: {checks.reason}"
        report.notes.append(f"{note} ({checked})" if checked else note)
