"""``bench/router.py --pool``: several runs' ``--json`` files read as one pairing of ``--paired`` with each other
contender (docs/benchmarks.md reads the router target's stand from it). Run as a user runs it, on files written in
the shape ``--json`` writes; it starts no replica."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def saved(path: Path, runs: dict[str, list[list[float]]]) -> Path:
    """A ``--json`` file of workload "private": per contender, each run's TTFTs."""
    rows = [{"workload": "private", "router": router, "run_means_s": [sum(r) / len(r) for r in each]}
            for router, each in runs.items()]  # fmt: skip
    requests = {
        f"private: {router}": [{"run": n, "ttft_s": t} for n, run in enumerate(each) for t in run]
        for router, each in runs.items()
    }
    path.write_text(json.dumps({"rows": rows, "requests": requests}))
    return path


def pooled(*files: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "router.py", "--pool", *map(str, files)], cwd=BENCH, capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


def test_pool_pairs_every_file_that_ran_both_and_pools_their_requests(tmp_path: Path) -> None:
    # kv's requests: 1, 2, 3 and 4 s in the first file's one run; 1 s x 10 in the second's two runs.
    first = saved(tmp_path / "a.json", {"preheat kv": [[1.0, 2.0, 3.0, 4.0]], "smg cache_aware": [[2.0] * 4]})
    second = saved(
        tmp_path / "b.json",
        {"preheat kv": [[1.0] * 5] * 2, "smg cache_aware": [[2.0] * 5, [0.5] * 5], "preheat prefix": [[1.0] * 5] * 2},
    )
    lines = pooled(first, second)
    [smg] = [line for line in lines if "/ smg cache_aware" in line]
    # 14 requests each: kv's mean 20/14 s, smg's 20.5/14 s; the p90 is the 13th of 14 (index int(0.9 x 14) = 12).
    # The runs' ratios: 2.5/2, 1/2 and 1/0.5, so kv the lower in one, and a geometric mean of 1.25 ** (1/3).
    assert smg == (
        "private: preheat kv / smg cache_aware, 2 file(s), 3 runs: mean 1,429 / 1,464 ms (0.976x), "
        "p90 3,000 / 2,000 ms (1.500x); the lower in 1 of 3 runs (geometric mean 1.077)"
    )
    [prefix] = [line for line in lines if "/ preheat prefix" in line]
    assert prefix.startswith("private: preheat kv / preheat prefix, 1 file(s), 2 runs: mean 1,000 / 1,000 ms (1.000x)")
    assert len(lines) == 2  # kv is not paired with itself
