"""`preheat simulate` throughput: a 1-day, 1M-request trace (target: under 60 s on this machine).

    python bench/simulate.py [--requests 1000000] [--keep trace.csv]

Writes a seeded synthetic Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens): a diurnal Poisson rate
(quiet night, busy afternoon) with ten 5-minute bursts at 4x, lognormal prompt (median 1,000) and output (median
200) lengths. Then times reading it and simulating every preset policy (scale-to-zero, warm-replicas, node-cache,
quantized, warm-pool, all-four) against examples/traces/coldstart-8b.json, and prints seconds and requests/s per
step. There is no peer to put beside it: no open-source simulator joins a measured cold-start timeline with an
autoscaling cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from preheat.plan.coldstart import ColdStart
from preheat.plan.simulate import PRESETS, SimSettings, simulate
from preheat.plan.traces import Problems, read_arrays

TIMELINE = os.path.join(os.path.dirname(__file__), "..", "examples", "traces", "coldstart-8b.json")
DAY = 86_400


def write_trace(path: str, requests: int, seed: int = 0) -> None:
    """``requests`` arrivals over one day at a diurnal rate with bursts, as an Azure LLM inference CSV."""
    rng = np.random.default_rng(seed)
    minutes = np.arange(DAY // 60)
    shape = 0.15 + np.maximum(0.0, np.sin(2 * np.pi * (minutes / 60.0 - 8.0) / 24.0)) ** 2
    for start in rng.integers(0, len(minutes) - 5, size=10):
        shape[start : start + 5] *= 4.0
    counts = rng.multinomial(requests, shape / shape.sum())
    times = np.sort(np.repeat(minutes * 60.0, counts) + rng.uniform(0, 60, size=requests))
    stamps = np.datetime_as_string(
        np.datetime64("2023-11-16T00:00:00") + (times * 1e6).astype("timedelta64[us]"), unit="us"
    )
    context = np.clip(rng.lognormal(np.log(1000), 0.8, size=requests), 16, 8000).astype(np.int64)
    generated = np.clip(rng.lognormal(np.log(200), 0.7, size=requests), 1, 2000).astype(np.int64)
    with open(path, "w", encoding="ascii") as handle:
        handle.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        handle.writelines(
            f"{s.replace('T', ' ')}0,{c},{g}\n"
            for s, c, g in zip(stamps, context.tolist(), generated.tolist(), strict=True)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--keep", default=None, help="write the trace here and keep it (default: a temp file)")
    args = parser.parse_args()
    path = args.keep or os.path.join(tempfile.mkdtemp(prefix="preheat-bench-"), "trace.csv")
    started = time.perf_counter()
    write_trace(path, args.requests)
    print(f"wrote {path}: {os.path.getsize(path) / 1e6:.0f} MB in {time.perf_counter() - started:.1f} s")
    with open(TIMELINE, encoding="utf-8") as handle:
        cold = ColdStart.from_timeline(json.load(handle), where=TIMELINE)
    try:
        started = time.perf_counter()
        trace = read_arrays(path, Problems(path, strict=True))
        reading = time.perf_counter() - started
    finally:
        if args.keep is None:
            os.remove(path)
            os.rmdir(os.path.dirname(path))
    n = len(trace)
    print(f"\n{n:,} requests over {trace.arrival[-1] / 3600:.1f} h")
    print(f"{'step':<34}{'seconds':>9}{'requests/s':>13}{'p99 TTFT s':>12}{'cost $':>10}{'starts':>8}")
    print(f"{'read + parse the CSV':<34}{reading:>9.1f}{n / reading:>13,.0f}")
    total = reading
    for name, policy in PRESETS.items():
        started = time.perf_counter()
        result = simulate(trace, cold, policy, SimSettings(gpu_cost_per_hour=4.0))
        seconds = time.perf_counter() - started
        total += seconds
        doc = result.to_dict()
        print(
            f"{'simulate ' + name:<34}{seconds:>9.1f}{n / seconds:>13,.0f}{doc['ttft_p99_s']:>12.2f}"
            f"{doc['cost']:>10,.0f}{doc['cold_starts']:>8}"
        )
    print(f"{'total: read + 6 policies':<34}{total:>9.1f}  (target: read + one policy < 60 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
