"""A striped pull: the pieces of a plan fetched from several sources at once into preallocated files.

Every source (each peer, and the origin) runs ``streams`` threads that take the next piece nobody holds, read it with
one ranged request and write it with ``pwrite``. When the last piece a tensor overlaps lands, the tensor is read back
and checked against its manifest digest, so a bad byte is caught within a piece's time, not at the end.

What goes wrong, and what happens:

- a source that fails a read (connection refused or reset: a dead peer; no byte for ``stall_timeout`` seconds: a
  frozen one; 401/403: a wrong token) is dropped, and the piece goes back to the queue for the others;
- a tensor that fails its digest: its pieces go back to the queue, each barred from the source that sent it; a source
  that alone sent the tensor (or is caught twice) is dropped;
- the origin is the fallback: it takes only pieces no live peer may take, so with healthy peers it sends nothing and
  with none it sends everything;
- a piece no live source may take ends the pull with ``SourceError`` (or ``CheckpointError`` when it was bad bytes).

After the pieces, each file's whole digest is checked (it also covers bytes outside tensors, like the safetensors
header); a mismatch requeues that file's non-tensor pieces elsewhere, a few rounds at most.
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
from preheat.errors import CheckpointError, PreheatError, SourceError
from preheat.io.reads import read_at_least
from preheat.peer.plan import Piece, PiecePlan
from preheat.sources.base import Origin, Source

log = logging.getLogger("preheat.peer")
Progress = Callable[[int, int], None]
_ROUNDS = 3  # whole-file re-checks before giving up on a file whose non-tensor bytes keep coming back wrong
_STRIKES = 2  # bad tensors a source may share the blame for before it is dropped


@dataclass(eq=False)
class StripeSource:
    """One place pieces come from. ``label`` names it in results and on the timeline (``peer host:port``,
    ``origin``); ``fallback`` sources only take pieces no live non-fallback source may take."""

    label: str
    origin: Origin
    streams: int = 4
    fallback: bool = False
    alive: bool = True
    why: str | None = None
    bytes: int = 0
    strikes: int = 0
    _files: dict[tuple[int, str], Source] = field(default_factory=dict)


class StripedFetch:
    """Fetch every piece of ``plan`` into the preallocated files under ``root`` from ``sources``; ``run()`` returns
    the bytes each source delivered (``{label: bytes}``), counting only bytes that were kept."""

    def __init__(
        self,
        plan: PiecePlan,
        sources: list[StripeSource],
        root: str,
        *,
        progress: Progress | None = None,
        journal: str | None = None,
    ) -> None:
        if not sources:
            raise SourceError("a striped pull needs at least one source")
        self.plan, self.sources, self.root, self.progress = plan, sources, root, progress
        self.cond = threading.Condition()
        self.pending: deque[int] = deque(p.index for p in plan.pieces)
        self.barred: dict[int, set[str]] = {}
        self.served_by: dict[int, StripeSource] = {}
        self.done: set[int] = set()
        self.in_flight = 0
        self.remaining = {name: len(pieces) for name, pieces in plan.tensor_pieces.items()}
        self.failure: PreheatError | None = None
        self.landed = 0
        self.notes: list[str] = []
        self._fds: dict[str, int] = {}
        self.resumed = 0
        self._journal = None if journal is None else open(journal, "a+", encoding="utf-8")  # noqa: SIM115 - run()
        if self._journal is not None:
            self._resume()

    # -- public ---------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, int]:
        try:
            self._check_resumed()
            for _ in range(_ROUNDS):
                self._round()
                bad = self._bad_files()
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
                for handle in source._files.values():
                    handle.close()

    # -- one round: every queued piece lands and verifies (or the pull fails) -------------------------------------
    def _round(self) -> None:
        threads = [
            threading.Thread(target=self._worker, args=(source,), name=f"preheat-stripe-{source.label}", daemon=True)
            for source in self.sources
            if source.alive
            for _ in range(max(1, source.streams))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.failure is not None:
            raise self.failure
        if len(self.done) != len(self.plan.pieces):  # every worker left (all sources dropped) with work queued
            raise self._stuck()

    def _worker(self, source: StripeSource) -> None:
        while True:
            with self.cond:
                piece = self._next(source)
                if piece is None:
                    return
                self.in_flight += 1
            try:
                fd, complete = self._fetch(source, piece)
            except (PreheatError, OSError) as exc:  # a short body (EOF) is a CheckpointError: the peer is lost too
                self._lost(source, piece, exc)
                return
            for record in complete:
                if _tensor_digest(fd, record) != record.digest:
                    self._blame(record)

    def _next(self, source: StripeSource) -> Piece | None:
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

    def _takers(self, index: int) -> list[StripeSource]:
        barred = self.barred.get(index, set())
        return [s for s in self.sources if s.alive and s.label not in barred]

    def _may_take(self, source: StripeSource, index: int) -> bool:
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
    def _handle(self, source: StripeSource, name: str) -> Source:
        key = (threading.get_ident(), name)  # one source (one connection) per thread and file
        handle = source._files.get(key)
        if handle is None:
            handle = source._files[key] = source.origin.open(name)
        return handle

    def _fd(self, name: str) -> int:
        with self.cond:
            if name not in self._fds:
                self._fds[name] = os.open(os.path.join(self.root, name), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            return self._fds[name]

    def _fetch(self, source: StripeSource, piece: Piece) -> tuple[int, list[mf.TensorRecord]]:
        """Read ``piece`` from ``source`` and write it; return the file's descriptor and the tensors now complete."""
        view = memoryview(bytearray(piece.length))
        read_at_least(self._handle(source, piece.file), view, piece.offset, piece.length, path=source.label)
        fd = self._fd(piece.file)
        written = 0
        while written < piece.length:
            written += os.pwrite(fd, view[written:], piece.offset + written)
        complete: list[mf.TensorRecord] = []
        with self.cond:
            self.in_flight -= 1
            self.done.add(piece.index)
            self.served_by[piece.index] = source
            source.bytes += piece.length
            self.landed += piece.length
            if self._journal is not None:  # a killed pull resumes from here; every tensor is re-checked then
                self._journal.write(f"{piece.file}\t{piece.offset}\t{piece.length}\n")
                self._journal.flush()
            landed = self.landed
            for record in self.plan.piece_tensors.get(piece.index, ()):
                self.remaining[record.name] -= 1
                if self.remaining[record.name] == 0:
                    complete.append(record)
            self.cond.notify_all()
        if self.progress is not None:
            self.progress(landed, self.plan.total_bytes)
        return fd, complete

    def _lost(self, source: StripeSource, piece: Piece, exc: BaseException) -> None:
        with self.cond:
            self.in_flight -= 1
            self.pending.appendleft(piece.index)  # first in line: it is the one the load is waiting for
            if source.fallback:  # the origin itself failed: nothing is left to fall back to
                self.failure = exc if isinstance(exc, PreheatError) else SourceError(f"{source.label}: {exc}")
            else:
                self._drop(source, f"{type(exc).__name__}: {exc}")
            self.cond.notify_all()

    def _drop(self, source: StripeSource, why: str) -> None:
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
                sender = self.served_by.pop(index, None)
                self.done.discard(index)
                self.landed -= self.plan.pieces[index].length  # progress goes back: these bytes come again
                if sender is not None:
                    sender.bytes -= self.plan.pieces[index].length
                    self.barred.setdefault(index, set()).add(sender.label)
                self.pending.append(index)
                for other in self.plan.piece_tensors.get(index, ()):
                    self.remaining[other.name] += 1
            why = f"sent bytes that fail tensor {record.name!r}'s digest"
            for sender in senders:
                sender.strikes += 1
                if sender.fallback:
                    continue  # the origin is the trust root: its pieces are barred, and a stuck pull says so
                if len(senders) == 1 or sender.strikes >= _STRIKES:
                    self._drop(sender, why)
            self.cond.notify_all()

    # -- resuming ------------------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Mark the pieces an interrupted pull of the same plan journaled as landed (checked by ``_check_resumed``)."""
        assert self._journal is not None
        self._journal.seek(0)
        wanted = {(p.file, p.offset, p.length): p.index for p in self.plan.pieces}
        for line in self._journal:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
                continue  # a line torn by the kill
            index = wanted.get((parts[0], int(parts[1]), int(parts[2])))
            if index is None or index in self.done:
                continue
            self.done.add(index)
            self.pending.remove(index)
            self.resumed += self.plan.pieces[index].length
            for record in self.plan.piece_tensors.get(index, ()):
                self.remaining[record.name] -= 1
        self.landed = self.resumed  # progress counts what is already here, as a plain pull's does
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
            if digest.file_digest(os.path.join(self.root, f.name)) != f.digest:
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
                if piece.file not in names or covered.get(piece.index, 0) >= piece.length:
                    continue
                sender = self.served_by.pop(piece.index, None)
                self.done.discard(piece.index)
                self.landed -= piece.length
                if sender is not None:
                    sender.bytes -= piece.length
                    self.barred.setdefault(piece.index, set()).add(sender.label)
                self.pending.append(piece.index)
                for record in self.plan.piece_tensors.get(piece.index, ()):  # re-checked when the piece lands again
                    self.remaining[record.name] += 1


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
