"""Reading a cold-start timeline back: the waterfall, idle accelerator time and its cost, as text, SVG or PNG.

The timeline format is the one ``preheat.timeline.Timeline.to_dict`` writes and every server serves at
``/v1/preheat/timeline`` (docs/server.md). The rule for idle time: every second from the origin (process start, or
``PREHEAT_T0`` when the platform passed the pod's creation time) to the ``ready`` mark counts as idle accelerator
time, because the accelerator is allocated and billed but serves nothing. A timeline without ``ready`` (a server that
never became ready) is idle for its whole length.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from preheat.errors import ConfigError, PreheatError, SourceError

TIMELINE_PATH = "/v1/preheat/timeline"
BAR_WIDTH = 32


@dataclass(frozen=True)
class Row:
    """One stage: seconds from the origin, bytes moved (if any), free-form detail."""

    name: str
    start: float
    end: float
    nbytes: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # Any: JSON values chosen by whoever recorded the stage

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.duration / 1e9 if self.nbytes and self.duration > 0 else None


@dataclass(frozen=True)
class Waterfall:
    """A timeline's stages in start order, with the numbers the report prints."""

    rows: list[Row]
    origin: float
    origin_source: str
    total: float

    @classmethod
    def from_dict(cls, data: object, *, where: str = "timeline") -> Waterfall:
        """Validate ``data`` (a parsed timeline JSON); raise ``PreheatError`` naming ``where`` and the bad field."""
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise PreheatError(f"{where}: not a preheat timeline (expected an object with a 'stages' list)")
        rows = []
        for i, stage in enumerate(data["stages"]):
            try:
                end = stage["end"] if stage["end"] is not None else stage["start"]  # still running: an instant so far
                nbytes = stage.get("bytes")
                row = Row(
                    name=str(stage["name"]),
                    start=float(stage["start"]),
                    end=float(end),
                    nbytes=None if nbytes is None else int(nbytes),
                    detail=dict(stage.get("detail") or {}),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise PreheatError(f"{where}: stage {i} is malformed ({type(exc).__name__}: {exc})") from None
            rows.append(row)
        rows.sort(key=lambda r: (r.start, r.end))
        total = float(data.get("total") or max((r.end for r in rows), default=0.0))
        return cls(rows, float(data.get("origin") or 0.0), str(data.get("origin_source", "process start")), total)

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
        }


def fetch(source: str, *, api_key: str | None = None, timeout: float = 10.0) -> object:
    """The timeline JSON from a server URL (its ``/v1/preheat/timeline``) or from a file."""
    if source.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        url = source if source.rstrip("/").endswith(TIMELINE_PATH) else source.rstrip("/") + TIMELINE_PATH
        request = urllib.request.Request(url)
        key = api_key or os.environ.get("PREHEAT_API_KEY")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            hint = " (pass --api-key or PREHEAT_API_KEY)" if exc.code == 401 else ""
            raise SourceError(f"{url}: HTTP {exc.code} {exc.reason}{hint}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SourceError(f"{url}: cannot fetch the timeline ({exc})") from None
    try:
        with open(source, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as exc:
        raise SourceError(f"{source}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise PreheatError(f"{source}: not JSON ({exc})") from None


# -- text ----------------------------------------------------------------------------------------------------------
def _bar(row: Row, total: float, width: int = BAR_WIDTH) -> str:
    if total <= 0:
        return ""
    left = min(width - 1, int(row.start / total * width))
    if row.duration <= 0:
        return " " * left + "│"
    right = max(left + 1, min(width, round(row.end / total * width)))
    return " " * left + "█" * (right - left)


def _detail(row: Row, width: int = 60) -> str:
    parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.detail.items() if k != "path"]
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
        lines.append((r.name, f"{r.start:.3f}", f"{r.end:.3f}", f"{r.duration:.3f}", size, gbps, bar, _detail(r)))
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


# -- pictures ------------------------------------------------------------------------------------------------------
def plot(waterfall: Waterfall, path: str, *, gpu_cost_per_hour: float = 32.0) -> str:
    """Draw the waterfall to ``path``: ``.html`` (self-contained, inline SVG) or ``.png`` (needs matplotlib)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".html", ".htm"):
        from preheat.timeline_svg import html_page

        page = html_page(waterfall, title=os.path.basename(path), gpu_cost_per_hour=gpu_cost_per_hour)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(page)
        return path
    if ext == ".png":
        _plot_png(waterfall, path, gpu_cost_per_hour)
        return path
    raise ConfigError(f"--plot {path}: write .html (inline SVG, no dependencies) or .png (needs matplotlib)")


def _plot_png(waterfall: Waterfall, path: str, gpu_cost_per_hour: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            f"--plot {path}: PNG needs matplotlib, which is not installed; write an .html plot instead "
            "(self-contained SVG, no dependencies) or `pip install matplotlib`"
        ) from None
    from preheat.timeline_svg import COLORS

    rows = waterfall.rows
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.6))
    for i, r in enumerate(rows):
        if r.duration > 0:
            ax.barh(i, r.duration, left=r.start, color=COLORS.get(r.name, "#3b82f6"), height=0.6)
            rate = f", {r.gbps:.2f} GB/s" if r.gbps is not None else ""
            ax.text(r.end, i, f"  {r.duration:.3f} s{rate}", va="center", fontsize=8)
        else:
            color = "#dc2626" if r.name == "ready" else "#16a34a"
            ax.axvline(r.start, color=color, linestyle="--", linewidth=1)
            ax.plot([r.start], [i], marker="D", color=color)
            ttft = f" (TTFT {waterfall.ttft:.3f} s)" if r.name == "first_request_ttft" and waterfall.ttft else ""
            ax.text(r.start, i, f"   at {r.start:.3f} s{ttft}", va="center", fontsize=8)
    ax.axvspan(0, waterfall.idle_seconds, color="#f59e0b", alpha=0.08)
    ax.set_yticks(range(len(rows)), [r.name for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(waterfall.total, 1e-9) * 1.2)  # room for the labels right of the last bar
    ax.set_xlabel(f"seconds from {waterfall.origin_source}")
    cost = waterfall.idle_cost(gpu_cost_per_hour)
    # "\$": a bare "$" starts matplotlib's math mode.
    price = f"\\${cost:.4f} at \\${gpu_cost_per_hour:g}/h"
    ax.set_title(f"cold start: idle accelerator {waterfall.idle_seconds:.2f} s = {price}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
