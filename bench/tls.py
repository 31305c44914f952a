"""TLS on the API: what https adds to a one-token completion, against plain http on the same machine.

    python bench/tls.py [--requests 200] [--json out.json]

Two ``preheat serve`` replicas of SmolLM2-135M-Instruct (float32, CPU, the same flags), one of them with a
self-signed certificate made here (``--ssl-certfile/--ssl-keyfile``). N one-token completions (``"Hi"``,
``max_tokens`` 1, greedy) are sent one at a time, alternately to the plain-http and the https replica, each over
one kept-alive connection (as the router and OpenAI clients send them), after a warm-up of both. Reported: the
median and p90 latency of each, and the difference of the medians (target: TLS adds <= 1 ms). Then the same with a
new connection per request, where https pays its handshake each time (a client that does not keep connections),
and ``GET /health`` over kept-alive connections: a route that costs the server nothing, so the difference there is
TLS's alone, without the model's noise.

Alternating puts both replicas under the same load from the rest of the machine at the same moments; the two
processes are otherwise identical, so the difference is TLS's (record encryption and the extra system calls).
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from preheat.cli.demo import smollm2_checkpoint
from preheat.http.tls import TLSFiles, use_fleet
from preheat.router.cluster import ServerProcess
from preheat.testing.certs import self_signed_certificate

BODY = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
HEADERS = {"Content-Type": "application/json"}
WARMUP = 10


def opener(url: str, context: ssl.SSLContext) -> Callable[[], http.client.HTTPConnection]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if parts.scheme == "https":
        return lambda: http.client.HTTPSConnection(host, port, timeout=60, context=context)
    return lambda: http.client.HTTPConnection(host, port, timeout=60)


def one(conn: http.client.HTTPConnection, health: bool = False) -> float:
    """Seconds for one completion (``health``: one ``GET /health``) on ``conn``, from sending the request to the end
    of its answer."""
    started = time.perf_counter()
    if health:
        conn.request("GET", "/health")
    else:
        conn.request("POST", "/v1/completions", BODY, HEADERS)
    answer = conn.getresponse()
    data = answer.read()
    took = time.perf_counter() - started
    if answer.status != 200:
        raise RuntimeError(f"HTTP {answer.status}: {data[:200]!r}")
    return took


def alternate(
    urls: dict[str, str], context: ssl.SSLContext, n: int, *, keep_alive: bool, health: bool = False
) -> dict[str, list[float]]:
    """``n`` completions (or health checks) to each URL, one at a time, alternating; kept-alive connections or one
    per request."""
    make = {name: opener(url, context) for name, url in urls.items()}
    kept = {name: open_() for name, open_ in make.items()}
    times: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for i in range(WARMUP + n):
            for name in urls:
                if keep_alive:
                    took = one(kept[name], health)
                else:
                    conn = make[name]()
                    try:
                        took = one(conn, health)
                    finally:
                        conn.close()
                if i >= WARMUP:
                    times[name].append(took)
    finally:
        for conn in kept.values():
            conn.close()
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="completions per scheme, per connection mode")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    model = smollm2_checkpoint(say=lambda line: print(line, file=sys.stderr))
    flags = ["--max-model-len", "256", "--served-model-name", "smollm2"]
    results: dict[str, Any] = {}  # Any: JSON-ready values
    with tempfile.TemporaryDirectory(prefix="preheat-bench-tls-") as directory:
        cert, key = self_signed_certificate(directory)
        context = TLSFiles(ca_certs=cert).client_context()
        use_fleet(TLSFiles(ca_certs=cert))  # wait_ready asks the https replica's /health
        with (
            ServerProcess(model, *flags) as plain,
            ServerProcess(model, *flags, "--ssl-certfile", cert, "--ssl-keyfile", key) as secure,
        ):
            plain.wait_ready()
            secure.wait_ready()
            urls = {"http": plain.url, "https": secure.url}
            modes = (("kept-alive", True, False), ("new connection", False, False), ("GET /health", True, True))
            for mode, keep_alive, health in modes:
                print(f"{mode}: {args.requests} requests per scheme ...", file=sys.stderr, flush=True)
                times = alternate(urls, context, args.requests, keep_alive=keep_alive, health=health)
                results[mode] = {name: summary(t) for name, t in times.items()}
                results[mode]["added_median_ms"] = (
                    results[mode]["https"]["median_ms"] - results[mode]["http"]["median_ms"]
                )
    print(f"\none-token completions, SmolLM2-135M-Instruct f32 on CPU, {args.requests} per scheme, alternating")
    print(
        f"{'connection':<16} {'http median':>12} {'https median':>13} {'http p90':>9} {'https p90':>10} {'TLS adds':>9}"
    )
    for mode, row in results.items():
        http_, https = row["http"], row["https"]
        print(f"{mode:<16} {http_['median_ms']:>10.2f}ms {https['median_ms']:>11.2f}ms {http_['p90_ms']:>7.2f}ms "
              f"{https['p90_ms']:>8.2f}ms {row['added_median_ms']:>7.2f}ms")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"results": results, "args": vars(args)}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
