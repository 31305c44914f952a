"""Time to first token with the KV tiers: no cache, an L1 hit, and L2 hits on *another* replica (fs:// and Redis),
in ONE run on SmolLM2-135M-Instruct (CPU).

    python bench/ttft.py [--prefix-words 4000] [--repeat 3] [--json out.json]

Workload: one long shared prefix (a seeded pseudo-document of ``--prefix-words`` words, about 4k tokens with the
question) followed by a different short question per request, sent as streamed completions with ``max_tokens`` 1;
TTFT is measured by the client, from sending the request to the first content chunk.

Modes, each on fresh ``preheat serve`` processes started by this script:

- ``no cache``: a server without KV tiers: every request prefills the whole prompt (the baseline);
- ``L1 hit``: ``--kv-l1 2GiB``; one untimed request computes the prefix, then each timed request reuses it from host
  memory;
- ``L2 fs, other replica``: replica A (``--kv-l2 fs://DIR``) computes the prefix; replica B, a different process
  with the same ``--kv-l2`` and *no* L1, serves the timed requests, so every timed request reads the prefix from
  the shared directory;
- ``L2 redis, other replica``: the same with ``--kv-l2 redis://`` (a redis-server started here; skipped if absent).

Prints median TTFT per mode, its ratio to no-cache (targets: L1 <= 0.10, L2 <= 0.125), cached tokens, the
cross-replica hit rate (cached tokens / tokens in full shared chunks), and the L2 read speed per chunk (bytes read /
seconds reading, from the reading replica's /metrics).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from preheat.cli.demo import smollm2_checkpoint
from preheat.router.cluster import ServerProcess

TEXT = (
    "the river valley holds old stone towns where farmers grow grapes wheat and olives while merchants trade wool "
    "salt and iron along roads built centuries ago by careful engineers who measured every bridge and tunnel"
)
WORDS = TEXT.split(" ")
QUESTIONS = [
    "What do the farmers grow?",
    "Who built the roads?",
    "What do merchants trade?",
    "Where are the towns?",
    "What did the engineers measure?",
    "What is carried along the roads?",
]


def prefix_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "Read this report carefully.\n" + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def first_token(url: str, prompt: str) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one streamed completion."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=600)
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{url}: HTTP {response.status}: {response.read()[:300]!r}")
    ttft: float | None = None
    usage: dict[str, Any] = {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if ttft is None and chunk.get("choices"):
            ttft = time.perf_counter() - start
        if chunk.get("usage"):
            usage = chunk["usage"]
    conn.close()
    if ttft is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return ttft, int(usage["prompt_tokens"]), int(usage["prompt_tokens_details"]["cached_tokens"])


def metric(url: str, name: str, **labels: str) -> float:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


@contextmanager
def server(model: str, *extra: str) -> Iterator[ServerProcess]:
    with ServerProcess(model, "--max-model-len", "8192", *extra) as process:
        process.wait_ready(timeout=300)
        yield process


def wait_l2(url: str, chunks: int) -> None:
    deadline = time.monotonic() + 120
    while metric(url, "preheat_kv_stores_total", tier="l2") < chunks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: the L2 writer stored too few chunks")
        time.sleep(0.05)


def timed(url: str, prefix: str, repeat: int) -> list[tuple[float, int, int]]:
    return [first_token(url, prefix + QUESTIONS[i % len(QUESTIONS)]) for i in range(repeat)]


def run_mode(
    model: str, prefix: str, repeat: int, kv: list[str] | None, reader_kv: list[str] | None
) -> tuple[list[tuple[float, int, int]], dict[str, float] | None]:
    """Time ``repeat`` requests; with ``reader_kv``, a first replica computes the prefix and a second one reads it."""
    if reader_kv is None:
        with server(model, *(kv or [])) as replica:
            if kv:
                first_token(replica.url, prefix + "Prime the cache.")  # computes and stores the prefix
            return timed(replica.url, prefix, repeat), None
    with server(model, *(kv or [])) as writer:
        _, n_prompt, _ = first_token(writer.url, prefix + "Prime the cache.")
        wait_l2(writer.url, (n_prompt - 1) // 256)
    with server(model, *reader_kv) as reader:  # started after the writer stopped: only L2 can hold the prefix
        results = timed(reader.url, prefix, repeat)
        read_bytes = metric(reader.url, "preheat_kv_bytes_read_total", tier="l2")
        read_s = metric(reader.url, "preheat_kv_read_seconds_total", tier="l2")
        hits = metric(reader.url, "preheat_kv_hits_total", tier="l2")
    return results, {"l2_bytes_read": read_bytes, "l2_read_s": read_s, "l2_hits": hits}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-words", type=int, default=4000, help="words in the shared prefix (~4k tokens)")
    parser.add_argument("--repeat", type=int, default=3, help="timed requests per mode (default 3)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    model = smollm2_checkpoint(say=lambda line: print(line, file=sys.stderr))
    prefix = prefix_text(args.prefix_words)
    shared = tempfile.mkdtemp(prefix="preheat-kv-bench-")
    results: dict[str, Any] = {}
    try:
        with redis_server() as redis_url:
            modes: list[tuple[str, list[str] | None, list[str] | None]] = [
                ("no cache", None, None),
                ("L1 hit", ["--kv-l1", "2GiB"], None),
                ("L2 fs, other replica", ["--kv-l2", f"fs://{shared}"], ["--kv-l2", f"fs://{shared}"]),
            ]
            if redis_url is not None:
                modes.append(("L2 redis, other replica", ["--kv-l2", redis_url], ["--kv-l2", redis_url]))
            else:
                print("redis-server not found: skipping the Redis mode", file=sys.stderr)
            for name, kv, reader_kv in modes:
                print(f"running: {name}", file=sys.stderr)
                runs, l2 = run_mode(model, prefix, args.repeat, kv, reader_kv)
                results[name] = {"runs": runs, "l2": l2}
    finally:
        shutil.rmtree(shared, ignore_errors=True)

    base = statistics.median(r[0] for r in results["no cache"]["runs"])
    print(
        f"\nSmolLM2-135M-Instruct on CPU ({os.cpu_count()} cores); prompt of "
        f"{results['no cache']['runs'][0][1]} tokens, shared prefix + a short question; median of {args.repeat}\n"
    )
    print(f"{'mode':<26} {'TTFT':>9} {'vs no cache':>12} {'cached tokens':>14} {'hit rate':>9} {'L2 GB/s':>8}")
    summary: dict[str, Any] = {}
    for name, result in results.items():
        runs = result["runs"]
        ttft = statistics.median(r[0] for r in runs)
        prompt_tokens, cached = runs[0][1], min(r[2] for r in runs)
        # The question differs per request, so the shared full chunks are those before the prefix's end; the
        # engine may reuse every full chunk of the prompt but the one holding its last token.
        cacheable = max((r[1] - 1) // 256 * 256 for r in runs)
        hit_rate = cached / cacheable if cacheable else 0.0
        gbps = None
        if result["l2"] and result["l2"]["l2_read_s"] > 0:
            gbps = result["l2"]["l2_bytes_read"] / result["l2"]["l2_read_s"] / 1e9
        summary[name] = {
            "ttft_s": ttft,
            "ratio": ttft / base,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached,
            "hit_rate": hit_rate if name != "no cache" else None,
            "l2_gbps": gbps,
        }
        print(
            f"{name:<26} {ttft * 1000:>7.0f}ms {ttft / base:>11.3f}x {cached:>14} "
            f"{(f'{hit_rate:.0%}' if name != 'no cache' else '-'):>9} {(f'{gbps:.2f}' if gbps else '-'):>8}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"summary": summary, "raw": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
