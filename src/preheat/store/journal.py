"""The pull journal: which byte ranges of which version of each file are already on disk in ``partial/<key>/``.

The one journal of every downloader (plain pulls, peer pulls, write-through; spec: docs/cache.md). One JSON object
per line (``partial/<key>/.journal``)::

    {"file": "model-00001-of-00002.safetensors", "pin": {"size": 5242880, "etag": "\\"5e1f-...\\"", "modified": "..."}}
    {"file": "model-00001-of-00002.safetensors", "offset": 0, "length": 16777216}

A ``pin`` names the version of the file the chunks belong to: its manifest digest when the origin has a manifest,
otherwise the origin's validator (strong ETag, Last-Modified and size for HTTP and S3; size, mtime and inode for a
local path). A range counts only under a pin equal to the one the origin names now (``reconcile``): a file that
changed, or whose origin no longer names a version, starts over, so a resumed pull never mixes two versions. Ranges
are not tied to one way of cutting files: a piece counts as on disk when journaled ranges cover it (``Coverage``), so
a pull resumes what another pull of the same entry (other piece sizes, peers instead of the origin) left.

Writing order (``Appender``): a range's line is appended only after its bytes were ``fdatasync``ed, so a line that
survived a power loss never vouches for bytes that did not; lines are not fsynced one by one (a lost line only costs
refetching its range). The pins are written first, by an atomic, fsynced rewrite (``rewrite``). A torn last line, a
line of another format or a range without a pin is ignored: it only means a refetch. (The chunk lines of this
format's first version, ``{"file", "chunk", "chunk_bytes"}``, are read as the range they name.)
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from preheat.core import durable
from preheat.core.errors import JSONInputError
from preheat.core.jsonsafe import loads_bounded

MAX_LINE_BYTES = 1 << 20  # a line is a pin (a size, an ETag, a date) or a range: under 1 KiB
Pin = Mapping[str, object]
Chunk = tuple[str, int, int]  # file, offset, length: bytes on disk


@dataclass
class JournalState:
    """The pins by file and the ranges on disk."""

    pins: dict[str, Pin] = field(default_factory=dict)
    chunks: set[Chunk] = field(default_factory=set)


def parse(lines: Iterable[str]) -> JournalState:
    """The journal's content; lines that are not exactly a pin or a chunk are skipped (pure)."""
    state = JournalState()
    for line in lines:
        try:  # bounded: the cache directory may be shared, and a line is only a hint (a refetch at worst)
            doc = loads_bounded(line, max_bytes=MAX_LINE_BYTES)
        except JSONInputError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("file"), str):
            continue
        name = doc["file"]
        if isinstance(doc.get("pin"), dict):
            state.pins[name] = doc["pin"]
        elif _count(doc.get("offset")) and _count(doc.get("length")) and doc["length"] > 0:
            state.chunks.add((name, doc["offset"], doc["length"]))
        elif _count(doc.get("chunk")) and _count(doc.get("chunk_bytes")) and doc["chunk_bytes"] > 0:  # first version
            state.chunks.add((name, doc["chunk"] * doc["chunk_bytes"], doc["chunk_bytes"]))
    return state


def render(state: JournalState) -> str:
    """``state`` as journal lines: pins first (pure)."""
    lines = [json.dumps({"file": name, "pin": dict(pin)}, sort_keys=True) for name, pin in sorted(state.pins.items())]
    lines += [chunk_line(*chunk).rstrip("\n") for chunk in sorted(state.chunks)]
    return "".join(f"{line}\n" for line in lines)


def chunk_line(name: str, offset: int, length: int) -> str:
    """The line saying bytes ``[offset, offset + length)`` of ``name`` are on disk."""
    return json.dumps({"file": name, "offset": offset, "length": length}) + "\n"


def reconcile(state: JournalState, pins: Mapping[str, Pin | None]) -> tuple[JournalState, dict[str, str]]:
    """Keep the ranges whose file's pin is the one the origin names now (``pins``: None when it names none).

    Returns the state to resume from (pinned with ``pins``) and, for each file whose earlier ranges are dropped, why
    (pure).
    """
    kept = JournalState(pins={name: pin for name, pin in pins.items() if pin is not None})
    had = {name for name, _, _ in state.chunks}
    dropped: dict[str, str] = {}
    for name, pin in pins.items():
        old = state.pins.get(name)
        if name not in had:
            continue
        if pin is None:
            dropped[name] = "the origin names no version of it (no ETag or Last-Modified), so it cannot be resumed"
        elif old is None:
            dropped[name] = "its chunks were journaled without the version they belong to"
        elif dict(old) != dict(pin):
            dropped[name] = f"it changed on the origin (was {dict(old)}, now {dict(pin)})"
    kept.chunks = {c for c in state.chunks if c[0] in kept.pins and c[0] not in dropped}
    return kept, dropped


def read(path: str) -> JournalState:
    """The journal at ``path`` (empty when there is none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return parse(handle)
    except FileNotFoundError:
        return JournalState()


def rewrite(path: str, state: JournalState) -> None:
    """Replace the journal with ``state``, atomically and durably."""
    durable.write_file(path, render(state).encode())


def forget(path: str, names: Sequence[str]) -> None:
    """Drop the ranges of ``names`` (kept pinned) from the journal at ``path``, if there is one."""
    if not os.path.exists(path):
        return
    state = read(path)
    state.chunks = {c for c in state.chunks if c[0] not in names}
    rewrite(path, state)


class Coverage:
    """Which bytes of each file journaled ranges cover, merged, to ask whether a piece is already on disk (pure)."""

    def __init__(self, chunks: Iterable[Chunk]) -> None:
        spans: dict[str, list[tuple[int, int]]] = {}
        for name, offset, length in sorted(chunks):
            merged = spans.setdefault(name, [])
            if merged and offset <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], offset + length))
            else:
                merged.append((offset, offset + length))
        self._spans = spans
        self._starts = {name: [a for a, _ in merged] for name, merged in spans.items()}

    def covers(self, name: str, offset: int, length: int) -> bool:
        """Whether bytes ``[offset, offset + length)`` of ``name`` all lie in journaled ranges."""
        starts = self._starts.get(name)
        if not starts:
            return False
        i = bisect.bisect_right(starts, offset) - 1
        return i >= 0 and self._spans[name][i][1] >= offset + length


class Appender:
    """Appends range lines: ``O_APPEND`` and one ``write`` per line, so a line lands whole after the others."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)

    def chunk(self, name: str, offset: int, length: int) -> None:
        """Record bytes ``[offset, offset + length)`` of ``name``, which the caller has already made durable."""
        os.write(self._fd, chunk_line(name, offset, length).encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
