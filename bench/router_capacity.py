"""Router capacity: requests/s and latency through each router in front of an instant upstream, in ONE run.

    python bench/router_capacity.py [--connections 16,256,2048] [--duration 10] [--json out.json]

The upstream is nginx answering every request at once (two ports, two "replicas"), so what is measured is the
router alone: its accept loop, parsing, policy, the relay and its connections to the replicas. Load comes from
``wrk`` (2 threads, keep-alive, ``--timeout 2s``: a request slower than 2 s counts as a timeout) posting chat
requests with 64 distinct prompts. Contenders, each started fresh as a new user would start it:

- ``preheat router`` with each policy (``kv`` tokenizes with SmolLM2's tokenizer, ``prefix`` reads text), as one
  process and as two (``--workers 2``: one per core here, as smg and vllm-router use every core by default);
- vLLM's ``vllm-router`` (Rust) ``--policy cache_aware``;
- SGLang's gateway ``smg launch`` (``sglang-router``, Rust) ``--policy cache_aware``.

The peers live in a venv of their own (``.venv-routers``, made on first use from the package index, as
bench/load.py's peers are installed beside it). Needs ``nginx`` and ``wrk`` (Debian: ``apt-get install
nginx-light wrk``). Ratios are against smg at the same concurrency, in this run.

``--rounds N`` runs every contender N times, round after round (so a slow minute of the VM falls on all of them,
not on one), and reports each one's median round with the range of its requests/s: on 2 shared cores one 10 s run
of the same router moves by up to a third.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from preheat.testing.ports import free_port
from router_peers import ensure_peers, running_router, wait_ready

ANSWER = (
    '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}'
)
MODELS = '{"object":"list","data":[{"id":"m","object":"model","owned_by":"bench"}]}'
NGINX = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_buffer_size 64k;
  server {{
    listen 127.0.0.1:{port_a} backlog=4096; listen 127.0.0.1:{port_b} backlog=4096;
    default_type application/json;
    location = /v1/models {{ return 200 '{models}'; }}
    location / {{ return 200 '{answer}'; }}
  }}
}}
"""
# 64 distinct chat prompts of ~40 words each, cycled by every wrk connection.
WRK_SCRIPT = """
local bodies = {}
for i = 1, 64 do
  local words = {}
  for w = 1, 40 do words[w] = "word" .. ((i * 7 + w) % 97) end
  bodies[i] = '{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"user ' .. i .. ': '
    .. table.concat(words, " ") .. '"}]}'
end
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, bodies[(n % 64) + 1])
end
"""
# --fresh: the same 64 bodies, each request's message made new by its thread and number ("user 2-81: ..."), so a
# router that tokenizes meets a piece it has not seen in every request.
WRK_FRESH = WRK_SCRIPT.replace(
    "local n = 0",
    'local n = 0\nlocal made = 0\nfunction setup(thread) made = made + 1; thread:set("id", made) end',
).replace(
    "bodies[(n % 64) + 1])",
    '(bodies[(n % 64) + 1]:gsub("user %d+:", "user " .. tostring(id) .. "-" .. n .. ":", 1)))',
)


@dataclass
class Result:
    router: str
    connections: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    over_2s: int  # wrk's timeouts: requests that took longer than --timeout 2s (or never finished)
    errors: int  # connect/read/write errors and non-2xx answers
    requests: int
    rounds: int = 1
    low: float = 0.0  # the lowest and highest requests/s of the rounds
    high: float = 0.0


def median_round(runs: list[Result]) -> Result:
    """One contender's rounds at one concurrency as one result: the median requests/s and latencies, every request
    over 2 s and every error of every round, the range of requests/s."""
    rates = sorted(r.requests_per_s for r in runs)
    first = runs[0]
    return Result(
        first.router, first.connections, statistics.median(rates),
        statistics.median(r.p50_ms for r in runs), statistics.median(r.p99_ms for r in runs),
        sum(r.over_2s for r in runs), sum(r.errors for r in runs), sum(r.requests for r in runs),
        rounds=len(runs), low=rates[0], high=rates[-1],
    )  # fmt: skip


def start_nginx(workdir: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    ports = [free_port(), free_port()]
    conf = workdir / "nginx.conf"
    conf.write_text(
        NGINX.format(dir=workdir, port_a=ports[0], port_b=ports[1], answer=ANSWER, models=MODELS), encoding="utf-8"
    )
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-g", "daemon off;"], stderr=subprocess.PIPE)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    wait_ready(urls[0] + "/health", proc)
    return proc, urls


def run_wrk(url: str, connections: int, duration: int, script: Path) -> tuple[float, float, float, int, int, int]:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{duration}s", "--timeout", "2s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=False,  # its numbers are parsed; a failed run shows as 0 requests
    ).stdout
    rps = float(_find(r"Requests/sec:\s+([\d.]+)", out) or 0)
    total = int(_find(r"(\d+) requests in", out) or 0)
    p50 = _ms(_find(r"\s50%\s+([\d.]+\w+)", out))
    p99 = _ms(_find(r"\s99%\s+([\d.]+\w+)", out))
    timeouts = int(_find(r"timeout (\d+)", out) or 0)
    socket = sum(int(_find(rf"{kind} (\d+)", out) or 0) for kind in ("connect", "read", "write"))
    non2xx = int(_find(r"Non-2xx or 3xx responses: (\d+)", out) or 0)
    return rps, p50, p99, timeouts, socket + non2xx, total


def measure(name: str, url: str, connections: int, duration: int, script: Path) -> Result:
    """One wrk run through router ``name``, printed as it ends."""
    rps, p50, p99, over, errors, total = run_wrk(url, connections, duration, script)
    print(f"{name:26s} {connections:5d} conns {rps:9.0f} req/s  p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  "
          f"over 2 s {over:6d}  errors {errors:6d}", file=sys.stderr)  # fmt: skip
    return Result(name, connections, rps, p50, p99, over, errors, total)


def _find(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1) if match else None


def _ms(value: str | None) -> float:
    if not value:
        return float("nan")
    number, unit = re.match(r"([\d.]+)(\w+)", value).groups()  # type: ignore[union-attr]  # wrk's own format
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", default="16,256,2048", help="wrk connections, comma-separated")
    parser.add_argument("--duration", type=int, default=10, help="seconds per (router, concurrency)")
    parser.add_argument(
        "--routers",
        default="preheat round-robin,preheat least-load,preheat prefix,preheat kv,preheat round-robin x2,"
        "preheat least-load x2,preheat prefix x2,preheat kv x2,vllm-router cache_aware,smg cache_aware",
        help="contenders, comma-separated ('preheat POLICY xN': N router processes, --workers N)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of every contender, interleaved; medians shown")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument(
        "--fresh", action="store_true",
        help="every request's message new (the 64 prompts with a per-request number): a tokenizing router's cache "
        "of chat pieces never holds the last message",
    )  # fmt: skip
    args = parser.parse_args()
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed: apt-get install nginx-light wrk", file=sys.stderr)
            return 2
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 2,048 connections need ~4,200 descriptors per side
    peers = ensure_peers()
    from preheat.testing.smollm2 import SmolLM2, cache_root

    tokenizer = str(SmolLM2(cache_root()).path("bf16"))
    connections = [int(c) for c in args.connections.split(",") if c]
    runs: dict[tuple[str, int], list[Result]] = {}
    names = [r.strip() for r in args.routers.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="router-capacity-") as tmp:
        workdir = Path(tmp)
        script = workdir / "chat.lua"
        script.write_text(WRK_FRESH if args.fresh else WRK_SCRIPT, encoding="utf-8")
        nginx, upstreams = start_nginx(workdir)
        try:
            for _round in range(args.rounds):
                for name in names:
                    log = workdir / f"{name.replace(' ', '-')}.log"
                    try:
                        with running_router(name, upstreams, peers, tokenizer, log) as url:
                            for c in connections:
                                runs.setdefault((name, c), []).append(measure(name, url, c, args.duration, script))
                    except Exception as exc:  # one router failing must not hide the others
                        print(f"{name}: {exc}", file=sys.stderr)
        finally:
            nginx.terminate()
            nginx.wait(10)
    results = [median_round(r) for r in runs.values()]
    smg = {r.connections: r for r in results if r.router.startswith("smg")}
    rounds = f"median of {args.rounds} interleaved rounds, " if args.rounds > 1 else ""
    cores = os.cpu_count()
    fresh = "; every message new (--fresh)" if args.fresh else ""
    print(f"\ninstant upstream (nginx, 2 ports); wrk -t2, {args.duration} s each; {rounds}{cores} cores shared by all"
          f"{fresh}")  # fmt: skip
    print(f"{'router':26s} {'conns':>5s} {'req/s':>8s} {'range':>13s} {'x smg':>6s} {'p50 ms':>8s} {'p99 ms':>8s} "
          f"{'p99 x smg':>9s} {'over 2 s':>8s} {'errors':>6s}")  # fmt: skip
    for r in results:
        ref = smg.get(r.connections)
        ratio = r.requests_per_s / ref.requests_per_s if ref and ref.requests_per_s else float("nan")
        p99_ratio = r.p99_ms / ref.p99_ms if ref and ref.p99_ms else float("nan")
        spread = f"{r.low:6.0f}-{r.high:<6.0f}"
        print(f"{r.router:26s} {r.connections:5d} {r.requests_per_s:8.0f} {spread:>13s} {ratio:6.2f} {r.p50_ms:8.2f} "
              f"{r.p99_ms:8.2f} {p99_ratio:9.2f} {r.over_2s:8d} {r.errors:6d}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
