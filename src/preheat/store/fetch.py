"""The one fetcher: the pieces of a plan fetched from one or more sources at once into preallocated files.

Every downloader uses it: a plain pull (the origin as its only source), a striped pull from peers (each peer a
source, the origin the fallback) and a load's write-through (the load's buffers a source, the origin the fallback for
the bytes they do not hold). Each source runs ``streams`` threads that take the next piece nobody holds, read it with
one ranged request, write it with ``pwrite``, ``fdatasync`` it and only then journal it (``preheat.store.journal``),
so a killed pull resumes from what is on disk and nothing else. When the last piece a tensor overlaps lands, the
tensor is read back and checked against its manifest digest (plans with tensors: ``preheat.peer.plan``), so a bad
byte is caught within a piece's time, not at the end.

What goes wrong, and what happens:

- a source that fails a read (connection refused or reset: a dead peer; no byte for its stall timeout: a frozen one;
  401/403: a wrong token) is dropped, and the piece goes back to the queue for the others;
- a tensor that fails its digest: its pieces go back to the queue, each barred from the source that sent it; a source
  that alone sent the tensor (or is caught twice) is dropped;
- a ``fallback`` source (the origin) takes only pieces no live other source may take, so with healthy peers it sends
  nothing and with none it sends everything; its own failure ends the pull with its error (it is the trust root:
  ``SourceChangedError`` from a file replaced mid-pull reaches the caller, which starts that file over);
- a piece no live source may take ends the pull with ``SourceError`` (or ``CheckpointError`` when it was bad bytes);
- a write that fails (a full disk) ends the pull with the ``OSError``, which the caller maps to ``CacheError``; so
  does an exception from the progress callback (the caller stopping the pull).

With ``check_files``, each file's whole digest is checked after the pieces (it also covers bytes outside tensors,
like the safetensors header); a mismatch requeues that file's non-tensor pieces elsewhere, a few rounds at most.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from preheat.checkpoint import digest
from preheat.checkpoint import manifest as mf
from preheat.core.errors import CheckpointError, PreheatError, SourceError
from preheat.io.reads import read_at_least
from preheat.sources.base import Origin, Source, Versioned
from preheat.store import journal
from preheat.store.pieces import Piece, PiecePlan

log = logging.getLogger("preheat.cache")
Progress = Callable[[int, int], None]
_ROUNDS = 3  # whole-file re-checks before giving up on a file whose non-tensor bytes keep coming back wrong
_STRIKES = 2  # bad tensors a source may share the blame for before it is dropped


@dataclass(eq=False)
class PieceSource:
    """One place pieces come from. ``label`` names it in results and on the timeline (``peer host:port``,
    ``origin``); ``fallback`` sources only take pieces no live non-fallback source may take; ``holds`` (None: every
    piece) says which pieces this source has at all."""

    label: str
    origin: Origin
    streams: int = 4
    fallback: bool = False
    holds: Callable[[Piece], bool] | None = None
    alive: bool = True
    why: str | None = None
    bytes: int = 0
    strikes: int = 0
    handles: dict[tuple[int, str], Source] = field(default_factory=dict)


class PieceFetch:
    """Fetch every piece of ``plan`` into the preallocated files under ``root`` from ``sources``; ``run()`` returns
    the bytes each source delivered (``{label: bytes}``), counting only bytes that were kept.

    ``journal_path``: append each landed piece there (after its ``fdatasync``); ``landed``: what the journal already
    vouches for (pieces it covers are not fetched again, and count as ``resumed``)."""

    def __init__(
        self,
        plan: PiecePlan,
        sources: list[PieceSource],
        root: str,
        *,
        progress: Progress | None = None,
        journal_path: str | None = None,
        landed: journal.Coverage | None = None,
        check_files: bool = False,
    ) -> None:
        if not sources:
            raise SourceError("a pull needs at least one source")
        self.plan, self.sources, self.root, self.progress = plan, sources, root, progress
        self.check_files = check_files
        self.files = {f.name: f for f in plan.files}
        self.cond = threading.Condition()
        self.pending: deque[int] = deque(p.index for p in plan.pieces)
        self.barred: dict[int, set[str]] = {}
        self.served_by: dict[int, PieceSource] = {}
        self.done: set[int] = set()
        self.in_flight = 0
        self.remaining = {name: len(pieces) for name, pieces in plan.tensor_pieces.items()}
        self.failure: BaseException | None = None
        self.landed = 0
        self.notes: list[str] = []
        self._fds: dict[str, int] = {}
        self.resumed = 0
        if landed is not None:
            self._resume(landed)
        self._journal = None if journal_path is None else journal.Appender(journal_path)

    # -- public ---------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, int]:
        try:
            self._check_resumed()
            for _ in range(_ROUNDS if self.check_files else 1):
                self._round()
                bad = self._bad_files() if self.check_files else []
                if not bad:
                    return {s.label: s.bytes for s in self.sources if s.bytes}
                self._requeue_gaps(bad)
            raise CheckpointError(
                f"{', '.join(bad)}: bytes outside the tensors (headers, extra files) kept failing the file digest "
                f"after {_ROUNDS} rounds from {', '.join(s.label for s in self.sources)}; nothing was published"
            )
        finally:
            if self._journal is not None:
                self._journal.close()
            for fd in self._fds.values():
                os.close(fd)
            for source in self.sources:
                for handle in source.handles.values():
                    handle.close()

    # -- one round: every queued piece lands and verifies (or the pull fails) -------------------------------------
    def _round(self) -> None:
        threads = [
            threading.Thread(target=self._worker, args=(source,), name=f"preheat-fetch-{source.label}", daemon=True)
            for source in self.sources
            if source.alive
            for _ in range(max(1, source.streams))
        ]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException as exc:  # Ctrl-C: stop the workers before the descriptors they write to are closed
            self._fail(exc)
            for thread in threads:
                thread.join()
            raise
        if self.failure is not None:
            raise self.failure
        if len(self.done) != len(self.plan.pieces):  # every worker left (all sources dropped) with work queued
            raise self._stuck()

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = exc
            self.cond.notify_all()

    def _worker(self, source: PieceSource) -> None:
        try:
            self._work(source)
        except BaseException as exc:  # a local write failed, or the progress callback stopped the pull: all stop
            self._fail(exc)

    def _work(self, source: PieceSource) -> None:
        while True:
            with self.cond:
                piece = self._next(source)
                if piece is None:
                    return
                self.in_flight += 1
            try:
                view = self._read(source, piece)
            except (PreheatError, OSError) as exc:  # a short body (EOF) is a CheckpointError: the source is lost too
                self._lost(source, piece, exc)
                return
            fd, complete = self._land(source, piece, view)
            for record in complete:
                if _tensor_digest(fd, record) != record.digest:
                    self._blame(record)

    def _next(self, source: PieceSource) -> Piece | None:
        """The next piece ``source`` may take, waiting while others are in flight; None when this worker is done."""
        while True:
            if self.failure is not None or not source.alive or len(self.done) == len(self.plan.pieces):
                return None
            for index in self.pending:
                if self._may_take(source, index):
                    self.pending.remove(index)
                    return self.plan.pieces[index]
            if self.pending and not self.in_flight and not any(self._takers(i) for i in self.pending):
                self.failure = self._stuck()
                self.cond.notify_all()
                return None
            if not self.pending and not self.in_flight:
                return None
            self.cond.wait(0.1)

    def _takers(self, index: int) -> list[PieceSource]:
        barred = self.barred.get(index, set())
        piece = self.plan.pieces[index]
        return [s for s in self.sources if s.alive and s.label not in barred and (s.holds is None or s.holds(piece))]

    def _may_take(self, source: PieceSource, index: int) -> bool:
        takers = self._takers(index)
        if source not in takers:
            return False
        # The origin waits its turn: it takes a piece only when no live peer may.
        return not source.fallback or all(s.fallback for s in takers)

    def _stuck(self) -> PreheatError:
        index = self.pending[0] if self.pending else 0
        piece = self.plan.pieces[index]
        reasons = "; ".join(f"{s.label}: {s.why}" for s in self.sources if s.why) or "no sources"
        barred = self.barred.get(index)
        if barred:
            return CheckpointError(
                f"{piece.file} bytes {piece.offset}+{piece.length}: every source sent bytes that fail the manifest's "
                f"digests or is gone ({reasons}); nothing was published",
                path=piece.file,
            )
        return SourceError(
            f"{piece.file} bytes {piece.offset}+{piece.length}: no source left to fetch it from ({reasons}); pass "
            "--origin (or PREHEAT_ORIGIN) so a pull can fall back to the origin"
        )

    # -- fetching --------------------------------------------------------------------------------------------------
    def _handle(self, source: PieceSource, name: str) -> Source:
        """This thread's handle on ``name`` at ``source`` (one connection per thread and file), held to the version
        the pull pinned when the plan names one (``SourceChangedError`` otherwise)."""
        key = (threading.get_ident(), name)
        handle = source.handles.get(key)
        if handle is None:
            handle = source.origin.open(name)
            with self.cond:
                source.handles[key] = handle
            validator = self.files[name].validator if name in self.files else None
            if validator is not None and isinstance(handle, Versioned):
                handle.require(validator)
        return handle

    def _fd(self, name: str) -> int:
        with self.cond:
            if name not in self._fds:
                self._fds[name] = os.open(os.path.join(self.root, name), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            return self._fds[name]

    def _read(self, source: PieceSource, piece: Piece) -> memoryview:
        view = memoryview(bytearray(piece.length))
        handle = self._handle(source, piece.file)
        where = source.origin.join(piece.file) if source.fallback else source.label
        read_at_least(handle, view, piece.offset, piece.length, path=where)
        return view

    def _land(self, source: PieceSource, piece: Piece, view: memoryview) -> tuple[int, list[mf.TensorRecord]]:
        """Write ``piece``, make it durable, journal it; return the file's descriptor and the tensors now complete."""
        fd = self._fd(piece.file)
        written = 0
        while written < piece.length:
            written += os.pwrite(fd, view[written:], piece.offset + written)
        os.fdatasync(fd)  # the journal line below must never survive a power loss that the bytes did not
        complete: list[mf.TensorRecord] = []
        with self.cond:
            self.in_flight -= 1
            self.done.add(piece.index)
            self.served_by[piece.index] = source
            source.bytes += piece.length
            self.landed += piece.length
            if self._journal is not None:  # a killed pull resumes from here; every tensor is re-checked then
                self._journal.chunk(piece.file, piece.offset, piece.length)
            landed = self.landed
            for record in self.plan.piece_tensors.get(piece.index, ()):
                self.remaining[record.name] -= 1
                if self.remaining[record.name] == 0:
                    complete.append(record)
            self.cond.notify_all()
        if self.progress is not None:
            self.progress(landed, self.plan.total_bytes)
        return fd, complete

    def _lost(self, source: PieceSource, piece: Piece, exc: BaseException) -> None:
        with self.cond:
            self.in_flight -= 1
            self.pending.appendleft(piece.index)  # first in line: it is the one the load is waiting for
            if source.fallback:  # the origin itself failed: nothing is left to fall back to
                self.failure = exc if isinstance(exc, PreheatError) else SourceError(f"{source.label}: {exc}")
            else:
                self._drop(source, f"{type(exc).__name__}: {exc}")
            self.cond.notify_all()

    def _drop(self, source: PieceSource, why: str) -> None:
        if source.alive:
            source.alive, source.why = False, why
            log.warning("pull: dropping %s, its pieces go to the others: %s", source.label, why)
            self.notes.append(f"dropped {source.label}: {why}")

    def _blame(self, record: mf.TensorRecord) -> None:
        """``record`` failed its digest: requeue its pieces, each barred from its sender, and drop a sure culprit."""
        with self.cond:
            pieces = [i for i in self.plan.tensor_pieces[record.name] if i in self.done]
            senders = {self.served_by[i] for i in pieces if i in self.served_by}  # resumed pieces have no sender
            for index in pieces:
                self._requeue(index)
            why = f"sent bytes that fail tensor {record.name!r}'s digest"
            for sender in senders:
                sender.strikes += 1
                if sender.fallback:
                    continue  # the origin is the trust root: its pieces are barred, and a stuck pull says so
                if len(senders) == 1 or sender.strikes >= _STRIKES:
                    self._drop(sender, why)
            self.cond.notify_all()

    def _requeue(self, index: int) -> None:
        """Put landed piece ``index`` back in the queue, barred from the source that sent it (under ``cond``)."""
        sender = self.served_by.pop(index, None)
        self.done.discard(index)
        self.landed -= self.plan.pieces[index].length  # progress goes back: these bytes come again
        if sender is not None:
            sender.bytes -= self.plan.pieces[index].length
            self.barred.setdefault(index, set()).add(sender.label)
        self.pending.append(index)
        for record in self.plan.piece_tensors.get(index, ()):  # re-checked when the piece lands again
            self.remaining[record.name] += 1

    # -- resuming ------------------------------------------------------------------------------------------------------
    def _resume(self, landed: journal.Coverage) -> None:
        """Mark the pieces the journal covers as landed (their tensors are checked by ``_check_resumed``)."""
        for piece in self.plan.pieces:
            if not landed.covers(piece.file, piece.offset, piece.length):
                continue
            self.done.add(piece.index)
            self.pending.remove(piece.index)
            self.resumed += piece.length
            for record in self.plan.piece_tensors.get(piece.index, ()):
                self.remaining[record.name] -= 1
        self.landed = self.resumed  # progress counts what is already here
        if self.resumed:
            self.notes.append(f"resumed: {self.resumed} bytes were already here")

    def _check_resumed(self) -> None:
        """Check every tensor the resumed pieces completed; a bad one (a torn write) is fetched again."""
        records = {r.name: r for pieces in self.plan.piece_tensors.values() for r in pieces}
        for name, count in list(self.remaining.items()):
            if count == 0 and name in records and self.plan.tensor_pieces[name]:
                record = records[name]
                if _tensor_digest(self._fd(record.file), record) != record.digest:
                    self._blame(record)

    # -- whole files -----------------------------------------------------------------------------------------------
    def _bad_files(self) -> list[str]:
        bad = []
        for f in self.plan.files:
            if f.digest is not None and digest.file_digest(os.path.join(self.root, f.name)) != f.digest:
                bad.append(f.name)
        return bad

    def _requeue_gaps(self, names: list[str]) -> None:
        """Refetch, elsewhere, the pieces of ``names`` holding bytes no tensor digest covers."""
        covered: dict[int, int] = {}
        for piece_index, records in self.plan.piece_tensors.items():
            piece = self.plan.pieces[piece_index]
            covered[piece_index] = sum(
                max(0, min(piece.offset + piece.length, r.offset + r.nbytes) - max(piece.offset, r.offset))
                for r in records
            )
        with self.cond:
            for piece in self.plan.pieces:
                if piece.file in names and covered.get(piece.index, 0) < piece.length:
                    self._requeue(piece.index)


def _tensor_digest(fd: int, record: mf.TensorRecord) -> str:
    """The digest of ``record``'s bytes as written (read back through the page cache in bounded chunks)."""
    hasher = xxhash.xxh3_128()
    done = 0
    while done < record.nbytes:
        block = os.pread(fd, min(8 << 20, record.nbytes - done), record.offset + done)
        if not block:
            break
        hasher.update(block)
        done += len(block)
    return digest.DIGEST_PREFIX + hasher.hexdigest()
