"""Staged reads: file -> small staging buffers -> destination memory, with the copy of one chunk overlapping the
read of the next.

On CUDA the staging buffers are pinned (page-locked) so the host-to-device copy runs as DMA on a per-thread CUDA
stream while the thread reads its next chunk into the other buffer of its pair (double buffering). The destination is
one device allocation per file; tensors become views of it. With a CPU destination the same code runs with plain
staging memory and synchronous copies, which is how the pipeline's logic is tested on machines without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from preheat.io.buffers import PAGE, as_memoryview, host_buffer, round_down, round_up
from preheat.io.reads import DISCARD, FileJob, OpenJobs, Progress, ReadOp, gather, read_at_least, useful_pieces
from preheat.sources.base import Source


@dataclass
class _Lane:
    """One reader thread's resources: two staging buffers, the events guarding them, and a stream."""

    staging: list[torch.Tensor]
    events: list[torch.cuda.Event | None] = field(default_factory=lambda: [None, None])
    stream: torch.cuda.Stream | None = None
    turn: int = 0


class StagedReader:
    """Read ``FileJob``s whose ``dest`` lives on ``device`` through double-buffered staging memory."""

    def __init__(
        self, device: torch.device, threads: int, *, chunk_bytes: int, progress: Progress | None = None
    ) -> None:
        self.device = device
        self.threads = threads
        # Direct reads are widened to page boundaries, so a staging buffer holds a chunk plus two pages.
        self.staging_bytes = round_up(chunk_bytes, PAGE) + 2 * PAGE
        self.progress = progress
        self._cuda = device.type == "cuda"
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()

    def run(self, jobs: Sequence[FileJob], *, pool: ThreadPoolExecutor | None = None) -> int:
        """Execute all jobs; returns bytes read from files. Waits until every copy has landed.

        ``pool``: threads to run on, kept by the caller across runs (a bucketed load runs once per bucket), so each
        thread keeps its lane, and the lane its pinned staging buffers and stream; default: a pool for this run."""
        if pool is None:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="preheat-stage") as own:
                return self.run(jobs, pool=own)
        with OpenJobs(jobs) as opened:
            futures: list[Future[int]] = [
                pool.submit(self._run_op, source, op, job) for job, source, _ in opened for op in job.ops
            ]
            try:
                total = gather(futures, jobs)
            finally:
                # A borrowed pool is not shut down here: wait for the ops still running, so that no thread writes
                # into ``dest`` or reads a source after this returns (the caller frees the one, we close the other).
                wait(futures)
                self.synchronize()  # each lane's last copies may still be in flight on its stream
        return total

    def synchronize(self) -> None:
        for lane in self._lanes.values():
            if lane.stream is not None:
                lane.stream.synchronize()

    def _lane(self) -> _Lane:
        ident = threading.get_ident()
        lane = self._lanes.get(ident)
        if lane is None:
            staging = [
                host_buffer(self.staging_bytes, align=PAGE, pinned=self._cuda, hugepages=False) for _ in range(2)
            ]
            lane = _Lane(staging, stream=torch.cuda.Stream(self.device) if self._cuda else None)  # type: ignore[no-untyped-call]
            with self._lock:
                self._lanes[ident] = lane
        return lane

    def _run_op(self, source: Source, op: ReadOp, job: FileJob) -> int:
        lane = self._lane()
        slot = lane.turn
        lane.turn ^= 1
        pending = lane.events[slot]
        if pending is not None:
            pending.synchronize()  # the copy out of this buffer must finish before we overwrite it
        staging = lane.staging[slot]
        view = as_memoryview(staging)
        if job.direct:
            lo = round_down(op.file_offset, PAGE)
            hi = round_up(op.file_offset + op.length, PAGE)
            # Read up to the op's last byte at least (a shorter file is an error), the rest of the page if present.
            read_at_least(source, view[: hi - lo], lo, op.file_offset + op.length - lo, path=job.path, direct=True)
            cursor, got = op.file_offset - lo, hi - lo
        else:
            read_at_least(source, view[: op.length], op.file_offset, op.length, path=job.path)
            cursor, got = 0, op.length
        self._copy_out(lane, slot, staging=staging, cursor=cursor, op=op, dest=job.dest)
        if job.landing is not None:
            # Host bytes exist only here, in a staging buffer this lane reuses next: the landing must be done with
            # them before we return (the device copy reads the same buffer meanwhile; both only read it).
            for file_offset, _, length in useful_pieces(op):
                at = cursor + file_offset - op.file_offset
                job.landing.landed(file_offset, view[at : at + length], stable=False)
        if self.progress is not None:
            self.progress(op.useful_bytes)
        return got

    def _copy_out(
        self, lane: _Lane, slot: int, *, staging: torch.Tensor, cursor: int, op: ReadOp, dest: torch.Tensor
    ) -> None:
        if lane.stream is None:
            for piece_dest, length in op.pieces:
                if piece_dest != DISCARD:
                    dest[piece_dest : piece_dest + length].copy_(staging[cursor : cursor + length])
                cursor += length
            return
        with torch.cuda.stream(lane.stream):
            for piece_dest, length in op.pieces:
                if piece_dest != DISCARD:
                    dest[piece_dest : piece_dest + length].copy_(staging[cursor : cursor + length], non_blocking=True)
                cursor += length
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(lane.stream)
        lane.events[slot] = event
