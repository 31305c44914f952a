"""The cold-start timeline: every stage of a replica's start, timestamped from one origin.

The origin is ``PREHEAT_T0`` (epoch seconds) when the platform passes it, e.g. a pod's creation time, so node
provisioning and the image pull show up as the first stage; otherwise it is this process's start time (read from
/proc, so interpreter start and imports are counted too). Stages are ``Stage`` values (JSON
``{name, start, end, detail, bytes?}``) in seconds relative to the origin, in the order they began.

    timeline = Timeline.from_env()
    with timeline.stage("weight_load") as stage:
        weights = preheat.load(...)
        stage.nbytes = weights.report.bytes
    timeline.mark("ready")
    json.dumps(timeline.to_dict())
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from preheat.core import env

FORMAT_VERSION = 1


class _StageRecordRequired(TypedDict):
    name: str
    start: float
    end: float | None  # None: the stage is still running
    detail: dict[str, Any]  # Any: JSON values chosen by whoever records the stage


class StageRecord(_StageRecordRequired, total=False):
    """A stage's JSON record, as ``Stage.to_dict`` writes it (``bytes`` only when set)."""

    bytes: int


class TimelineDocument(TypedDict):
    """The JSON served at ``/v1/preheat/timeline`` and saved by ``preheat timeline``, as ``Timeline.to_dict``
    writes it (a replica's, read back from outside, is checked value by value where it is used)."""

    version: int
    origin: float
    origin_source: str
    total: float
    stages: list[StageRecord]


def process_start_time() -> float:
    """This process's start as epoch seconds (Linux /proc), falling back to now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 overall; 20th after the command name
        # The boot time from CLOCK_BOOTTIME, not /proc/stat's btime: btime is whole seconds, which would put the
        # start up to 1 s too early and inflate the first stage by as much.
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME off Linux
        return time.time()


@dataclass
class Stage:
    """One stage of a cold start, in seconds from the timeline's origin; an instant (``start == end``) is a mark.

    ``end`` is None while the stage runs. Inside ``Timeline.stage``'s block, set ``nbytes`` (bytes moved, for the
    GB/s) and add to ``detail``.
    """

    name: str
    start: float
    end: float | None = None
    nbytes: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # Any: JSON values chosen by whoever records the stage

    def to_dict(self) -> StageRecord:
        """The JSON record: ``name, start, end, detail`` and ``bytes`` when set, in this order (the wire format)."""
        record: StageRecord = {"name": self.name, "start": self.start, "end": self.end, "detail": self.detail}
        if self.nbytes is not None:
            record["bytes"] = self.nbytes
        return record

    @classmethod
    def from_dict(cls, record: object) -> Stage:
        """A stage from its JSON record (every format version so far). Raises ``KeyError``, ``TypeError`` or
        ``ValueError`` for a malformed one; the caller names the file.

        >>> Stage.from_dict({"name": "fetch", "start": 0.5, "end": 1, "bytes": 10, "detail": {"cache": "miss"}})
        Stage(name='fetch', start=0.5, end=1.0, nbytes=10, detail={'cache': 'miss'})
        """
        if not isinstance(record, dict):
            raise TypeError(f"a stage is an object, not {type(record).__name__}")
        end, nbytes = record["end"], record.get("bytes")
        return cls(
            name=str(record["name"]),
            start=float(record["start"]),
            end=None if end is None else float(end),
            nbytes=None if nbytes is None else int(nbytes),
            detail=dict(record.get("detail") or {}),
        )


class Timeline:
    """Ordered stages of a cold start relative to ``origin`` (epoch seconds). Thread-safe."""

    def __init__(self, origin: float | None = None, *, origin_source: str = "process start") -> None:
        self.origin = origin if origin is not None else process_start_time()
        self.origin_source = origin_source
        self._stages: list[Stage] = []
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Timeline:
        """Origin from ``PREHEAT_T0`` when set (the platform's clock, e.g. pod creation), else process start."""
        origin = env.get(env.T0)  # ConfigError naming PREHEAT_T0 when it is not epoch seconds
        return cls() if origin is None else cls(origin, origin_source=env.T0.name)

    def now(self) -> float:
        """Seconds since the origin."""
        return time.time() - self.origin

    def add(self, name: str, start: float, end: float, *, nbytes: int | None = None, **detail: object) -> None:
        """Record a stage that was timed elsewhere (``start``/``end`` relative to the origin)."""
        record = Stage(name, start, end, nbytes, dict(detail))
        with self._lock:
            self._stages.append(record)
            self._stages.sort(key=lambda s: s.start)

    @contextmanager
    def stage(self, name: str, **detail: object) -> Iterator[Stage]:
        """Time the block as stage ``name``; set ``stage.nbytes`` or ``stage.detail[...]`` inside it."""
        record = Stage(name, self.now(), None, None, dict(detail))
        with self._lock:
            self._stages.append(record)
        try:
            yield record
        finally:
            record.end = self.now()

    def mark(self, name: str, *, nbytes: int | None = None, **detail: object) -> None:
        """An instant (``start == end``), e.g. ``ready`` or the first request's first token."""
        at = self.now()
        self.add(name, at, at, nbytes=nbytes, **detail)

    def rebase(self, origin: float, source: str) -> None:
        """Move the origin to ``origin`` (epoch seconds) once the platform's clock is learnt late (a pod's creation,
        read from the API after start): every stage recorded so far keeps its moment, so its times shift."""
        with self._lock:
            shift = self.origin - origin
            for stage in self._stages:
                stage.start += shift
                if stage.end is not None:
                    stage.end += shift
            self.origin, self.origin_source = origin, source

    def discard(self, name: str) -> None:
        """Drop the stages called ``name`` (one that finer stages have replaced)."""
        with self._lock:
            self._stages = [s for s in self._stages if s.name != name]

    def stages(self) -> list[Stage]:
        """A snapshot: copies, so a stage still running does not change under the caller."""
        with self._lock:
            return [replace(s, detail=dict(s.detail)) for s in self._stages]

    def to_dict(self) -> TimelineDocument:
        """The JSON served at ``/v1/preheat/timeline``."""
        stages = self.stages()
        ends = [s.end for s in stages if s.end is not None]
        return {
            "version": FORMAT_VERSION,
            "origin": self.origin,
            "origin_source": self.origin_source,
            "total": max(ends) if ends else 0.0,
            "stages": [s.to_dict() for s in stages],
        }
