"""PNG pictures for the planning tools (matplotlib, the optional ``plot`` extra): hit rate against cache size, and
cost against p99 TTFT per policy with its Pareto frontier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from preheat.core.errors import ConfigError


def _pyplot(path: str) -> Any:  # Any: matplotlib ships no types we check against
    if not path.lower().endswith(".png"):
        raise ConfigError(f"--plot {path}: write a .png file")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            f"--plot {path}: PNG needs matplotlib, which is not installed: `pip install 'preheat[plot]'`"
        ) from None
    return plt


def _save(plt: Any, fig: Any, path: str) -> str:  # Any: as in _pyplot
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_hit_rates(sweep: Sequence[dict[str, float | int]], path: str, *, shared_prefix_ratio: float) -> str:
    """Hit rate (fraction of prompt tokens) against cache capacity, one line per routing plus a shared L2."""
    plt = _pyplot(path)
    by_bytes = bool(sweep) and "capacity_bytes" in sweep[0]
    largest = max((float(p.get("capacity_bytes", 0)) for p in sweep), default=0.0)
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    xs = [float(p["capacity_bytes"]) / scale if by_bytes else float(p["capacity_chunks"]) for p in sweep]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    series = (
        ("round_robin_l1", "L1 per replica, round-robin"),
        ("prefix_aware_l1", "L1 per replica, prefix-aware"),
        ("shared_l2", "one shared L2"),
    )
    for key, label in series:
        ax.plot(xs, [float(p[key]) for p in sweep], marker="o", label=label)
    ax.axhline(shared_prefix_ratio, color="grey", linestyle="--", linewidth=1, label="shared prefix ratio")
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity per tier ({unit})" if by_bytes else "cache capacity per tier (chunks)")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("KV cache hit rate against capacity")
    return _save(plt, fig, path)


def frontier(points: Sequence[tuple[str, float, float]]) -> list[int]:
    """Indices of the (name, cost, p99) points no other point beats on both cost and p99 (ties kept).

    >>> frontier([("a", 1.0, 9.0), ("b", 2.0, 1.0), ("c", 3.0, 5.0)])
    [0, 1]
    """
    keep = []
    for i, (_, cost, p99) in enumerate(points):
        if not any(c <= cost and p <= p99 and (c < cost or p < p99) for _, c, p in points):
            keep.append(i)
    return keep


def plot_frontier(points: Sequence[tuple[str, float, float]], path: str) -> str:
    """Cost against p99 TTFT, one labelled point per policy, the Pareto frontier joined by a line."""
    plt = _pyplot(path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    best = set(frontier(points))
    labels: dict[tuple[float, float], list[str]] = {}  # policies at the same spot share one label
    for i, (name, cost, p99) in enumerate(points):
        labels.setdefault((p99, cost), []).append(name)
        ax.scatter([p99], [cost], color="tab:blue" if i in best else "tab:grey", zorder=3)
    for (p99, cost), names in labels.items():
        ax.annotate(", ".join(names), (p99, cost), textcoords="offset points", xytext=(5, 4), fontsize=8)
    line = sorted((points[i][2], points[i][1]) for i in best)
    ax.plot([p for p, _ in line], [c for _, c in line], color="tab:blue", linewidth=1, label="frontier")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("p99 time to first token (s)")
    ax.set_ylabel("cost over the trace (\\$)")  # "\$": a bare "$" starts matplotlib's math mode
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Cost against p99 TTFT per policy")
    return _save(plt, fig, path)
