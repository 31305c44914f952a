"""``preheat timeline --plot``: the waterfall drawn to a file, ``.html`` (inline SVG) or ``.png`` (matplotlib).

The top of the timeline modules: ``core.timeline`` (recording) <- ``waterfall`` (reading back, text) <- ``svg``
(the SVG page) <- this one.
"""

from __future__ import annotations

import os

from preheat.core.errors import ConfigError
from preheat.timeline.svg import COLORS, html_page
from preheat.timeline.waterfall import Waterfall


def plot(waterfall: Waterfall, path: str, *, gpu_cost_per_hour: float = 32.0) -> str:
    """Draw the waterfall to ``path``: ``.html`` (self-contained, inline SVG) or ``.png`` (needs matplotlib)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".html", ".htm"):
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
