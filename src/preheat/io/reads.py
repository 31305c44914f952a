"""Parallel positional reads of byte extents into a destination buffer.

Pure planning (``plan_ops``) turns "these file ranges go to these buffer offsets" into read operations that are
large (split at ``chunk_bytes``) and few (nearby small ranges are merged into one ``preadv``, with the gap between
them landing in a scratch buffer, but only when the gap holds no page that would not be fetched anyway, so merging
never costs disk bytes). Operations are cut at page boundaries wherever they can be, so that O_DIRECT, which reads
whole pages, never reads a page twice. ``ParallelReader`` runs those operations on a thread pool; ``os.preadv``
releases the GIL, so threads read truly in parallel. A job's ``landing`` (a checksum over tensors, say) is told about
every useful byte range once it has landed.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from preheat.core.errors import CheckpointError, DirectIOUnsupported
from preheat.io.buffers import PAGE, as_memoryview, host_buffer, round_down, round_up
from preheat.sources.base import Source
from preheat.sources.local import LocalFile

if TYPE_CHECKING:  # torch is what the buffers are, but planning and reading need no import of it (io.buffers)
    import torch

DISCARD = -1  # dest offset of a piece whose bytes are read only to keep one syscall, then dropped
MAX_IOV = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
Progress = Callable[[int], None]


@dataclass(frozen=True)
class Extent:
    """``length`` bytes at ``file_offset`` belong at ``dest_offset`` of the destination buffer."""

    file_offset: int
    length: int
    dest_offset: int


@dataclass(frozen=True)
class ReadOp:
    """One syscall's worth of work: a contiguous file range scattered into pieces ``(dest_offset, length)``."""

    file_offset: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(length for _, length in self.pieces)

    @property
    def useful_bytes(self) -> int:
        return sum(length for dest, length in self.pieces if dest != DISCARD)


def split_extents(extents: Iterable[Extent], at: int) -> tuple[list[Extent], list[Extent]]:
    """The file bytes of ``extents`` before ``at`` and from ``at`` on (an extent across ``at`` is cut in two)."""
    before: list[Extent] = []
    after: list[Extent] = []
    for e in extents:
        head = min(max(at - e.file_offset, 0), e.length)
        if head:
            before.append(Extent(e.file_offset, head, e.dest_offset))
        if e.length > head:
            after.append(Extent(e.file_offset + head, e.length - head, e.dest_offset + head))
    return before, after


def _gap_is_free(end: int, start: int, page: int) -> bool:
    """True when no whole page lies strictly between a run ending at ``end`` and one starting at ``start``."""
    return start // page <= (end - 1) // page + 1


def useful_pieces(op: ReadOp) -> Iterator[tuple[int, int, int]]:
    """``(file_offset, dest_offset, length)`` of each piece of ``op`` that is kept (merged gaps left out)."""
    offset = op.file_offset
    for dest, length in op.pieces:
        if dest != DISCARD:
            yield offset, dest, length
        offset += length


def plan_ops(extents: Iterable[Extent], *, chunk_bytes: int, page: int = PAGE, max_iov: int = MAX_IOV) -> list[ReadOp]:
    """Merge neighbouring extents whose gap costs no extra pages into spans, then cut each span into operations of
    at most ``chunk_bytes`` (and ``max_iov`` pieces).

    Cuts fall on page boundaries whenever one lies inside the operation, so consecutive operations never share a
    page: an O_DIRECT reader, which widens every operation to whole pages, then reads each needed page once (a TP
    rank's row slices are a few KiB each; cutting them mid-page made ``direct`` read most pages twice). Operations
    start and end on useful bytes: a cut inside a merged gap drops the gap's bytes on both sides of it.
    """
    ops: list[ReadOp] = []
    for start, pieces in _spans(extents, page):
        ops.extend(_cut(start, pieces, chunk_bytes=chunk_bytes, page=page, max_iov=max_iov))
    return ops


def _spans(extents: Iterable[Extent], page: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Runs of extents in file order, each as ``(file_offset, pieces)`` with free gaps as ``DISCARD`` pieces."""
    spans: list[tuple[int, list[tuple[int, int]]]] = []
    end = 0
    for extent in sorted((e for e in extents if e.length), key=lambda e: e.file_offset):
        gap = extent.file_offset - end
        if spans and gap >= 0 and _gap_is_free(end, extent.file_offset, page):
            pieces = spans[-1][1]
            if gap:
                pieces.append((DISCARD, gap))
            pieces.append((extent.dest_offset, extent.length))
        else:
            spans.append((extent.file_offset, [(extent.dest_offset, extent.length)]))
        end = extent.file_offset + extent.length
    return spans


def _cut(start: int, pieces: list[tuple[int, int]], *, chunk_bytes: int, page: int, max_iov: int) -> Iterator[ReadOp]:
    """Cut one span (contiguous ``pieces`` from file offset ``start``, first and last kept) into operations."""
    starts: list[int] = []
    offset = start
    for _, length in pieces:
        starts.append(offset)
        offset += length
    span_end = offset
    limit_iov = max(max_iov, 1)
    k, cursor = 0, start  # piece k holds the next unplanned byte, at file offset ``cursor``
    while k < len(pieces):
        if pieces[k][0] == DISCARD:  # an operation never starts in a gap
            k += 1
            cursor = starts[k] if k < len(pieces) else span_end
            continue
        # The furthest cut allowed: chunk_bytes of file, or the end of the max_iov-th piece, or the span's end.
        cut, j = span_end, k
        while j < len(pieces):
            piece_end = starts[j] + pieces[j][1]
            if piece_end >= cursor + chunk_bytes:
                cut = cursor + chunk_bytes
                break
            if j - k + 1 >= limit_iov:
                cut = piece_end
                break
            j += 1
        if cut < span_end and cut - cut % page > cursor:
            cut -= cut % page
        out: list[tuple[int, int]] = []
        m = k
        while m < len(pieces) and starts[m] < cut:
            lo, hi = max(starts[m], cursor), min(starts[m] + pieces[m][1], cut)
            dest = pieces[m][0]
            out.append((dest if dest == DISCARD else dest + lo - starts[m], hi - lo))
            m += 1
        while out[-1][0] == DISCARD:  # the first piece is kept, so this stops
            out.pop()
        yield ReadOp(cursor, tuple(out))
        cursor = cut
        while k < len(pieces) and starts[k] + pieces[k][1] <= cursor:
            k += 1


class Landing(Protocol):
    """Told about bytes of a job once they are in host memory; must be thread-safe (every reader thread calls it).

    ``stable`` says whether ``data`` stays valid after the call returns (the destination buffer) or is about to be
    reused (a staging buffer); a landing that needs the bytes later must finish with unstable ones before returning.
    ``abort()`` is called when the job fails, so that a reader waiting inside ``landed`` gives up.
    """

    def landed(self, file_offset: int, data: memoryview, *, stable: bool) -> None: ...

    def abort(self) -> None: ...


@dataclass
class FileJob:
    """Read ``ops`` of one file into ``dest`` (a CPU uint8 tensor, or a CUDA one for the staged/GDS readers).

    ``open_source`` opens where the bytes come from (an HTTP or S3 object, say); when it is None, the local file at
    ``path`` is opened (with O_DIRECT when ``direct``). Either way the reader closes what it opened.
    ``needed_size`` is the file size the plan relies on, checked again right before reading.
    ``landing`` is told about every kept byte range of every op, by file offset, once it has landed.
    """

    path: str
    ops: Sequence[ReadOp]
    dest: torch.Tensor
    needed_size: int
    direct: bool = False
    # Sliced (TP) reads touch scattered ranges: turn kernel readahead off so only the requested pages are fetched.
    scattered: bool = False
    open_source: Callable[[], Source] | None = None
    landing: Landing | None = None


class OpenJobs:
    """Opens every job's source (checking its size against the plan) and closes what it opened."""

    def __init__(self, jobs: Sequence[FileJob]) -> None:
        self.jobs = jobs
        self.opened: list[Source] = []

    def __enter__(self) -> list[tuple[FileJob, Source, int]]:
        out = []
        try:
            for job in self.jobs:
                if job.open_source is not None:
                    source = job.open_source()
                else:
                    source = LocalFile.from_fd(job.path, _open(job.path, direct=job.direct, scattered=job.scattered))
                self.opened.append(source)
                out.append((job, source, _checked_size(source, job)))
        except BaseException:
            self.__exit__()
            raise
        return out

    def __exit__(self, *exc: object) -> None:
        for source in self.opened:
            source.close()


class ParallelReader:
    """Runs read operations of many files on one pool of threads, so small files never serialize a load."""

    def __init__(self, threads: int, *, chunk_bytes: int, progress: Progress | None = None) -> None:
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.progress = progress
        self._local = threading.local()

    def run(self, jobs: Sequence[FileJob], *, pool: ThreadPoolExecutor | None = None) -> int:
        """Execute every job; return the bytes read from files. Raises ``CheckpointError`` on any failure.

        ``pool``: threads to run on, kept by the caller across runs (a bucketed load runs once per bucket); default:
        a pool for this run."""
        if pool is None:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="preheat-read") as own:
                return self.run(jobs, pool=own)
        with OpenJobs(jobs) as opened:
            futures: list[Future[int]] = []
            try:
                for job, source, size in opened:
                    view = as_memoryview(job.dest)
                    futures.extend(pool.submit(self._run_op, source, op, view, job, size) for op in job.ops)
                return gather(futures, jobs)
            finally:
                # A borrowed pool is not shut down here: no op may still write into ``dest`` or read a source once
                # this returns (the caller frees the one, OpenJobs closes the other).
                wait(futures)

    def _run_op(self, source: Source, op: ReadOp, view: memoryview, job: FileJob, size: int) -> int:
        if job.direct:
            got = self._direct_op(source, op, view, job, size)
        else:
            got = readv_all(source, op, view, self._scratch(), path=job.path)
        if job.landing is not None:
            # The bytes stay in the destination buffer, so the landing may keep views of them for later.
            for file_offset, dest, length in useful_pieces(op):
                job.landing.landed(file_offset, view[dest : dest + length], stable=True)
        if self.progress is not None:
            self.progress(op.useful_bytes)
        return got

    def _scratch(self) -> memoryview:
        scratch: memoryview | None = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = memoryview(bytearray(2 * PAGE))
            self._local.scratch = scratch
        return scratch

    def _direct_op(self, source: Source, op: ReadOp, view: memoryview, job: FileJob, size: int) -> int:
        """O_DIRECT needs page-aligned offsets, lengths and addresses: read in place when the op allows it, else
        through a per-thread aligned bounce buffer."""
        first = op.pieces[0]
        base = job.dest.data_ptr()
        in_place = (
            len(op.pieces) == 1
            and op.file_offset % PAGE == 0
            and (base + first[0]) % PAGE == 0
            and (first[1] % PAGE == 0 or op.file_offset + first[1] >= size)
            and first[0] + round_up(first[1], PAGE) <= len(view)  # room for the page-padded tail read at EOF
        )
        if in_place:
            dest, length = first
            padded = round_up(length, PAGE)
            # Every byte of the op is required: a file shorter than the op is an error, never a zero-filled tail.
            return read_at_least(source, view[dest : dest + padded], op.file_offset, length, path=job.path, direct=True)
        lo = round_down(op.file_offset, PAGE)
        hi = round_up(op.file_offset + op.length, PAGE)
        bounce = self._bounce(hi - lo)
        read_at_least(source, bounce[: hi - lo], lo, op.file_offset + op.length - lo, path=job.path, direct=True)
        cursor = op.file_offset - lo
        for dest, length in op.pieces:
            if dest != DISCARD:
                view[dest : dest + length] = bounce[cursor : cursor + length]
            cursor += length
        return hi - lo

    def _bounce(self, nbytes: int) -> memoryview:
        bounce: torch.Tensor | None = getattr(self._local, "bounce", None)
        if bounce is None or bounce.numel() < nbytes:
            bounce = host_buffer(max(nbytes, self.chunk_bytes + 2 * PAGE), align=PAGE, hugepages=False)
            self._local.bounce = bounce
        return as_memoryview(bounce)


def gather(futures: Sequence[Future[int]], jobs: Sequence[FileJob] = ()) -> int:
    """Sum the futures' results; on the first failure cancel the rest, abort the jobs' landings (so that no thread
    still running waits for bytes that will never land) and re-raise it."""
    total = 0
    try:
        for future in futures:
            total += future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        for job in jobs:
            if job.landing is not None:
                job.landing.abort()
        raise
    return total


def _open(path: str, *, direct: bool, scattered: bool = False) -> int:
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct:
        flags |= os.O_DIRECT
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: file not found (it was removed after the load was planned)", path=path
        ) from None
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:  # the filesystem has no O_DIRECT (ramfs, some FUSE mounts)
            raise DirectIOUnsupported(path) from None
        raise CheckpointError(f"{path}: cannot open: {exc.strerror}", path=path) from None
    if scattered and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _checked_size(source: Source, job: FileJob) -> int:
    size = source.size()
    if size < job.needed_size:
        raise CheckpointError(
            f"{job.path}: file is {size} bytes but its header needs {job.needed_size}; it was truncated after it "
            "was opened or is still being written",
            path=job.path,
        )
    return size


def readv_all(source: Source, op: ReadOp, view: memoryview, scratch: memoryview, *, path: str) -> int:
    """Read the whole op, continuing after short reads; end of file before the end is a truncated file."""
    buffers = [scratch[:length] if dest == DISCARD else view[dest : dest + length] for dest, length in op.pieces]
    offset, total = op.file_offset, op.length
    done = 0
    while done < total:
        got = _readv(source, buffers, offset + done, path=path)
        if got == 0:
            raise CheckpointError(
                f"{path}: file ended at byte {offset + done} while {total - done} more bytes were expected; "
                "it was truncated while loading",
                path=path,
            )
        done += got
        buffers = _advance(buffers, got)
    return total


def _readv(source: Source, buffers: list[memoryview], offset: int, *, path: str, direct: bool = False) -> int:
    try:
        return source.readv(offset, buffers)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            # Offset, length and memory are page-aligned by construction: the filesystem refuses O_DIRECT reads.
            raise DirectIOUnsupported(path) from None
        raise CheckpointError(f"{path}: read failed at byte {offset}: {exc.strerror}", path=path) from None


def _advance(buffers: list[memoryview], consumed: int) -> list[memoryview]:
    while consumed and buffers:
        head = buffers[0]
        if consumed >= len(head):
            consumed -= len(head)
            buffers = buffers[1:]
        else:
            buffers = [head[consumed:], *buffers[1:]]
            consumed = 0
    return buffers


def read_at_least(
    source: Source, target: memoryview, offset: int, want: int, *, path: str, direct: bool = False
) -> int:
    """Read at least ``want`` bytes into ``target`` (which may be longer: O_DIRECT reads whole pages).

    ``direct``: ``source`` was opened with O_DIRECT, so EINVAL means the filesystem refuses it
    (``DirectIOUnsupported``), not a failed read."""
    done = 0
    while done < want:
        got = _readv(source, [target[done:]], offset + done, path=path, direct=direct)
        if got == 0:
            raise CheckpointError(
                f"{path}: file ended at byte {offset + done} while {want - done} more bytes were expected; "
                "it was truncated while loading",
                path=path,
            )
        done += got
    return done


def direct_io_supported(path: str) -> bool:
    """True when ``path`` can be opened with O_DIRECT and read at an aligned offset (ramfs and some FUSE cannot).
    ``preheat doctor`` asks; a load does not, since this reads a page from disk that the load then reads again: its
    direct reads raise ``DirectIOUnsupported`` instead, and it reads again buffered. The page read into is an
    anonymous mapping (page-aligned), not a torch buffer: the doctor must not pay torch's import inside its time
    bound."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    page = mmap.mmap(-1, PAGE)
    try:
        os.preadv(fd, [memoryview(page)], 0)
        return True
    except OSError:
        return False
    finally:
        page.close()
        os.close(fd)
