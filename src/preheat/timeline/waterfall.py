"""A recorded cold start read back as values: the waterfall, idle accelerator time and its cost, and the text table.

Pure: a parsed timeline document in, values and text out (``fetch`` gets the document from a server or a file). The
timeline format is the one ``preheat.core.timeline.Timeline.to_dict`` writes and every server serves at
``/v1/preheat/timeline`` (docs/server.md). The rule for idle time: every second from the origin (process start, or
``PREHEAT_T0`` when the platform passed the pod's creation time) to the ``ready`` mark counts as idle accelerator
time, because the accelerator is allocated and billed but serves nothing. A timeline without ``ready`` (a server that
never became ready) is idle for its whole length. The pictures are drawn above this module: ``svg`` (inline-SVG
HTML) and ``plot`` (the ``--plot`` file, HTML or PNG).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from preheat.core.errors import PlanError
from preheat.core.timeline import Stage

BAR_WIDTH = 32


@dataclass(frozen=True)
class Row:
    """One stage as the report shows it: seconds from the origin, bytes moved (if any), free-form detail.

    Unlike a ``Stage``, a row always has an end: a stage still running is drawn as an instant so far.
    """

    name: str
    start: float
    end: float
    nbytes: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # Any: JSON values chosen by whoever recorded the stage

    @classmethod
    def from_stage(cls, stage: Stage) -> Row:
        end = stage.end if stage.end is not None else stage.start
        return cls(stage.name, stage.start, end, stage.nbytes, stage.detail)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.duration / 1e9 if self.nbytes and self.duration > 0 else None


@dataclass(frozen=True)
class Unobserved:
    """A stage the timeline could not show (a merged multi-process start, ``timeline.merge``): ``unknown`` when it
    cannot be observed here, ``not_run`` when this start skipped it; never given a number."""

    name: str
    status: str
    why: str


@dataclass(frozen=True)
class Waterfall:
    """A timeline's stages in start order, with the numbers the report prints."""

    rows: list[Row]
    origin: float
    origin_source: str
    total: float
    unknown: tuple[Unobserved, ...] = ()

    @classmethod
    def from_dict(cls, data: object, *, where: str = "timeline") -> Waterfall:
        """Validate ``data`` (a parsed timeline JSON); raise ``PlanError`` naming ``where`` and the bad field."""
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise PlanError(f"{where}: not a preheat timeline (expected an object with a 'stages' list)")
        rows = []
        for i, record in enumerate(data["stages"]):
            try:
                stage = Stage.from_dict(record)
            except (KeyError, TypeError, ValueError) as exc:
                raise PlanError(f"{where}: stage {i} is malformed ({type(exc).__name__}: {exc})") from None
            rows.append(Row.from_stage(stage))
        rows.sort(key=lambda r: (r.start, r.end))
        total = float(data.get("total") or max((r.end for r in rows), default=0.0))
        unknown = []
        for i, entry in enumerate(data.get("unknown") or []):
            if not isinstance(entry, dict):
                raise PlanError(f"{where}: unknown stage {i} is not an object")
            unknown.append(Unobserved(str(entry.get("name")), str(entry.get("status")), str(entry.get("why", ""))))
        origin, source = float(data.get("origin") or 0.0), str(data.get("origin_source", "process start"))
        return cls(rows, origin, source, total, tuple(unknown))

    @property
    def ready(self) -> float | None:
        """When the server became ready (seconds from the origin), or None if it never did."""
        return next((r.start for r in self.rows if r.name == "ready"), None)

    @property
    def idle_seconds(self) -> float:
        """Idle accelerator seconds: origin -> ready (or the whole timeline when there is no ready mark)."""
        ready = self.ready
        return ready if ready is not None else self.total

    def idle_cost(self, gpu_cost_per_hour: float) -> float:
        return self.idle_seconds / 3600.0 * gpu_cost_per_hour

    @property
    def ttft(self) -> float | None:
        """The first request's time to first token, when the timeline recorded one."""
        mark = next((r for r in self.rows if r.name == "first_request_ttft"), None)
        value = mark.detail.get("ttft") if mark is not None else None
        return float(value) if isinstance(value, (int, float)) else None

    def to_dict(self, gpu_cost_per_hour: float) -> dict[str, object]:
        return {
            "origin": self.origin,
            "origin_source": self.origin_source,
            "total": self.total,
            "ready": self.ready,
            "ttft": self.ttft,
            "idle_seconds": self.idle_seconds,
            "gpu_cost_per_hour": gpu_cost_per_hour,
            "idle_cost": self.idle_cost(gpu_cost_per_hour),
            "stages": [
                {
                    "name": r.name,
                    "start": r.start,
                    "end": r.end,
                    "duration": r.duration,
                    "bytes": r.nbytes,
                    "gbps": r.gbps,
                    "detail": r.detail,
                }
                for r in self.rows
            ],
            "unknown": [{"name": u.name, "status": u.status, "why": u.why} for u in self.unknown],
        }


# -- text ----------------------------------------------------------------------------------------------------------
def _bar(row: Row, total: float, width: int = BAR_WIDTH) -> str:
    if total <= 0:
        return ""
    left = min(width - 1, int(row.start / total * width))
    if row.duration <= 0:
        return " " * left + "│"
    right = max(left + 1, min(width, round(row.end / total * width)))
    return " " * left + "█" * (right - left)


# Detail keys the table leaves out (--json has them): long paths, pids, and what the layout shows (nesting, gaps).
_HIDDEN = ("path", "pid", "within", "gap")


def _detail(row: Row, width: int = 60) -> str:
    parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.detail.items() if k not in _HIDDEN]
    text = ", ".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"  # --json has every detail in full


def render_text(waterfall: Waterfall, *, gpu_cost_per_hour: float = 32.0) -> str:
    """The waterfall table, the total, and idle accelerator seconds with their cost."""
    header = ("stage", "start s", "end s", "dur s", "bytes", "GB/s", "waterfall", "detail")
    lines = []
    for r in waterfall.rows:
        gbps = f"{r.gbps:.2f}" if r.gbps is not None else ""
        size = _bytes(r.nbytes) if r.nbytes else ""
        bar = _bar(r, waterfall.total)
        name = f"  {r.name}" if "within" in r.detail else r.name  # nested: inside the stage above, not in the sum
        lines.append((name, f"{r.start:.3f}", f"{r.end:.3f}", f"{r.duration:.3f}", size, gbps, bar, _detail(r)))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    right = {1, 2, 3, 4, 5}

    def fmt(cells: tuple[str, ...]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    text = [fmt(header), "  ".join("-" * w for w in widths)]
    text += [fmt(line) for line in lines]
    ready = waterfall.ready
    text.append("")
    text.append(f"total            {waterfall.total:.3f} s from {waterfall.origin_source}")
    text.append(f"ready            {ready:.3f} s" if ready is not None else "ready            never (no 'ready' mark)")
    if waterfall.ttft is not None:
        text.append(f"first token      {waterfall.ttft:.3f} s after the first request arrived")
    for u in waterfall.unknown:
        text.append(f"{u.status:<16} {u.name}: {u.why}")
    text.append(
        f"idle accelerator {waterfall.idle_seconds:.3f} s = ${waterfall.idle_cost(gpu_cost_per_hour):.4f} "
        f"at ${gpu_cost_per_hour:g}/h (origin -> ready)"
    )
    return "\n".join(text)


def _bytes(n: int) -> str:
    """Decimal units, like the GB/s column beside it."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
