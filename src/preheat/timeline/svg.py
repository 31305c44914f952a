"""The cold-start waterfall as a self-contained HTML page with an inline SVG: no scripts, fonts or libraries.

One row per stage (a bar from start to end, an instant as a diamond), a shaded band for the idle accelerator time
(origin -> ready), a time axis with round-number ticks, and the numbers table under the picture.
"""

from __future__ import annotations

import math
from html import escape

from preheat.timeline.waterfall import Waterfall, render_text

ROW = 26
LABEL = 150
CHART = 640
RIGHT = 170
TOP = 40
AXIS = 34
COLORS = {
    "platform": "#9ca3af",
    "scheduling": "#cbd5e1",
    "pod_setup": "#94a3b8",
    "image_pull": "#78716c",
    "container_start": "#a8a29e",
    "imports": "#a855f7",
    "config": "#64748b",
    "fetch": "#0ea5e9",
    "engine_imports": "#8b5cf6",
    "weight_load": "#2563eb",
    "model_build": "#14b8a6",
    "tokenizer": "#f59e0b",
    "warmup": "#ef4444",
}


def _ticks(total: float) -> list[float]:
    """About six round ticks (1, 2 or 5 times a power of ten) covering [0, total]."""
    if total <= 0:
        return [0.0]
    raw = total / 6
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(total / step) + 1)]


def svg(waterfall: Waterfall, *, gpu_cost_per_hour: float = 32.0) -> str:
    """The waterfall as one ``<svg>`` element."""
    rows = waterfall.rows
    total = max(waterfall.total, max((r.end for r in rows), default=0.0), 1e-9)
    height = TOP + ROW * len(rows) + AXIS
    width = LABEL + CHART + RIGHT

    def x(seconds: float) -> float:
        return LABEL + seconds / total * CHART

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    ready = waterfall.ready
    idle_end = ready if ready is not None else total
    parts.append(
        f'<rect x="{x(0):.1f}" y="{TOP - 6}" width="{x(idle_end) - x(0):.1f}" height="{ROW * len(rows) + 6}" '
        'fill="#f59e0b" fill-opacity="0.10"/>'
    )
    cost = waterfall.idle_cost(gpu_cost_per_hour)
    parts.append(
        f'<text x="{x(0):.1f}" y="{TOP - 12}" fill="#92400e">idle accelerator {waterfall.idle_seconds:.2f} s '
        f"= ${cost:.4f} at ${gpu_cost_per_hour:g}/h</text>"
    )
    axis_y = TOP + ROW * len(rows)
    for tick in _ticks(total):
        parts.append(f'<line x1="{x(tick):.1f}" y1="{TOP - 6}" x2="{x(tick):.1f}" y2="{axis_y}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{x(tick):.1f}" y="{axis_y + 16}" text-anchor="middle" fill="#374151">{tick:g}</text>')
    parts.append(
        f'<text x="{x(total / 2):.1f}" y="{axis_y + 30}" text-anchor="middle" fill="#374151">'
        f"seconds from {escape(waterfall.origin_source)}</text>"
    )
    for i, r in enumerate(rows):
        y = TOP + i * ROW
        mid = y + ROW / 2
        parts.append(f'<text x="{LABEL - 8}" y="{mid + 4:.1f}" text-anchor="end">{escape(r.name)}</text>')
        if r.duration > 0:
            color = COLORS.get(r.name, "#3b82f6")
            w = max(x(r.end) - x(r.start), 1.5)
            parts.append(
                f'<rect x="{x(r.start):.1f}" y="{y + 5}" width="{w:.1f}" height="{ROW - 10}" rx="2" fill="{color}">'
                f"<title>{escape(r.name)}: {r.start:.3f}-{r.end:.3f} s</title></rect>"
            )
            label = f"{r.duration:.3f} s" + (f", {r.gbps:.2f} GB/s" if r.gbps is not None else "")
        else:
            color = "#dc2626" if r.name == "ready" else "#16a34a"
            cx = x(r.start)
            parts.append(
                f'<path d="M{cx:.1f},{y + 5} l6,{ROW / 2 - 5:.1f} l-6,{ROW / 2 - 5:.1f} l-6,-{ROW / 2 - 5:.1f} z" '
                f'fill="{color}"><title>{escape(r.name)} at {r.start:.3f} s</title></path>'
            )
            parts.append(
                f'<line x1="{cx:.1f}" y1="{TOP - 6}" x2="{cx:.1f}" y2="{axis_y}" stroke="{color}" '
                'stroke-dasharray="4 3"/>'
            )
            label = f"at {r.start:.3f} s"
            if r.name == "first_request_ttft" and waterfall.ttft is not None:
                label += f" (TTFT {waterfall.ttft:.3f} s)"
        gap = 8 if r.duration > 0 else 12  # clear of the bar's end, or of the instant's diamond
        parts.append(f'<text x="{x(r.end) + gap:.1f}" y="{mid + 4:.1f}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def html_page(waterfall: Waterfall, *, title: str = "preheat timeline", gpu_cost_per_hour: float = 32.0) -> str:
    """A complete HTML document: the SVG waterfall and the text table under it."""
    table = escape(render_text(waterfall, gpu_cost_per_hour=gpu_cost_per_hour))
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:24px;color:#111827}pre{font-size:12px;background:#f9fafb;"
        "padding:12px;border:1px solid #e5e7eb}</style></head><body>\n"
        f"<h2>preheat cold-start timeline</h2>\n{svg(waterfall, gpu_cost_per_hour=gpu_cost_per_hour)}\n"
        f"<pre>{table}</pre>\n</body></html>\n"
    )
