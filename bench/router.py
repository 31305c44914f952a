"""Router benchmark: a multi-round chat workload against 2 replicas, once per policy, plus the router's overhead.

    python bench/router.py [--users 4] [--rounds 10] [--only kv "round-robin, no L2"] [--json out.json]

Workload (seeded, the same for every policy): U users each hold a conversation of R rounds. Every conversation
starts with the same system prompt (~160 tokens) and a first user message carrying that user's own document (~780
tokens); each round adds the previous answer and a new short question, so round r's prompt (~1,000 tokens and
growing) extends round r-1's. Users run concurrently (arriving ``--stagger`` s apart), each waiting for its answer
before its next round: the multi-round QA pattern LMCache and llm-d measure. Answers are greedy and short
(``--max-tokens``).

Each configuration starts 2 fresh ``preheat serve`` replicas of SmolLM2-135M-Instruct (float32, CPU) with an L1 each
(``--kv-l1 64MiB``: about 1.3 users' contexts at 46 KB of K/V per token, so a replica that sees every user keeps
little across rounds, as a DRAM tier under many users does), 64-token chunks, and, except for the baseline, one
shared ``fs://`` L2; then a ``preheat router`` process:

- ``round-robin, no L2``: the baseline (a replica only reuses what it computed itself and still holds);
- ``round-robin``, ``least-load``, ``session``, ``prefix``, ``kv``: with the shared L2.

Reported per configuration: mean and p90 TTFT (request sent -> first streamed event, through the router, so queueing
behind other users' requests counts), the cache hit rate (``cached_tokens / prompt_tokens`` from each answer's
usage), requests per replica, the speed-up of the mean TTFT over the baseline (target for ``kv``: >= 3x), and the
replicas' own measured prefill cost per recomputed token at the end of the run.

Router overhead: 2 x N small non-streaming completions (``"Hi"``, 1 token), sent one at a time and alternately
straight to a replica and through a router in front of that replica alone; the overhead is the difference of the
median latencies (target: <= 2 ms), next to the router's own ``preheat_router_overhead_seconds`` mean.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from preheat.cli.demo import smollm2_checkpoint
from preheat.core.procs import Child
from preheat.router.cluster import ServerProcess

# A fixed vocabulary: seeded draws from it make every user's document, identical across runs and policies.
_VOCABULARY = """cache replica token prefix router memory latency queue request batch shard tier disk network kernel
model weight layer vector answer question system prompt history session user cluster node storage chunk hash key
value policy metric health retry stream event server client budget price second minute hour restart"""
WORDS = _VOCABULARY.split()
QUESTIONS = ("What does this mean?", "Summarise the last part.", "Which step comes next?", "Why is that so?")


@dataclass
class Result:
    name: str
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    prefill_s_per_token: list[float] = field(
        default_factory=list
    )  # as the replicas measured it: how busy the machine was

    def row(self, baseline: float | None) -> dict[str, Any]:  # Any: JSON-ready values
        ttfts = sorted(self.ttfts)
        mean = statistics.fmean(ttfts) if ttfts else float("nan")
        p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else float("nan")
        return {
            "config": self.name,
            "mean_ttft_s": mean,
            "p90_ttft_s": p90,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "requests_per_replica": sorted(self.per_replica.values(), reverse=True),
            "errors": self.errors,
            "speedup": baseline / mean if baseline and mean else None,
            "prefill_ms_per_token": statistics.fmean(self.prefill_s_per_token) * 1e3
            if self.prefill_s_per_token
            else None,
        }


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def conversations(users: int, seed: int, system_words: int, history_words: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    system = "You are the support assistant for this manual. " + text(rng, system_words)
    return system, [f"My document {u}: " + text(rng, history_words) for u in range(users)]


def post_stream(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any], str, str]:
    """One streamed chat request: (TTFT, usage, answer text, replica that answered)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
    ttft: float | None = None
    usage: dict[str, Any] = {}
    answer: list[str] = []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if ttft is None:
            ttft = time.perf_counter() - sent
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            answer.append(choice.get("delta", {}).get("content") or "")
    conn.close()
    return ttft or 0.0, usage, "".join(answer), response.getheader("X-Preheat-Replica") or "?"


def run_workload(url: str, name: str, args: argparse.Namespace) -> Result:
    system, documents = conversations(args.users, args.seed, args.system_words, args.history_words)
    result = Result(name)
    lock = threading.Lock()

    def user(u: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": documents[u]}]
        for r in range(args.rounds):
            body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "user": f"user-{u}"}  # fmt: skip
            try:
                ttft, usage, answer, replica = post_stream(url, body)
            except (OSError, RuntimeError, http.client.HTTPException) as exc:
                print(f"  {name}: user {u} round {r}: {exc}", file=sys.stderr)
                with lock:
                    result.errors += 1
                return
            with lock:
                result.ttfts.append(ttft)
                result.prompt_tokens += int(usage.get("prompt_tokens", 0))
                result.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                result.per_replica[replica] = result.per_replica.get(replica, 0) + 1
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": QUESTIONS[r % len(QUESTIONS)]}]  # fmt: skip

    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    for thread in threads:
        thread.start()
        time.sleep(args.stagger)  # users arrive one after another, as they would
    for thread in threads:
        thread.join()
    return result


def start_router(replicas: list[str], policy: str, model: str, chunk_tokens: int = 256) -> Child:
    args = ["router", *(a for u in replicas for a in ("--replica", u)), "--policy", policy, "--port", "0"]
    args += ["--kv-chunk-tokens", str(chunk_tokens)]
    router = Child("router", [*args, "--model", model], echo=lambda line: None, own_group=True, merge_stderr=True)
    router.wait_address()
    return router


def run_config(name: str, policy: str, shared_l2: bool, model: str, args: argparse.Namespace) -> Result:
    tiers = ["--kv-l1", args.kv_l1, "--kv-chunk-tokens", str(args.kv_chunk_tokens), "--max-model-len", "4096"]
    with tempfile.TemporaryDirectory(prefix="preheat-bench-l2-") as l2:
        if shared_l2:
            tiers += ["--kv-l2", f"fs://{l2}"]
        replicas = [ServerProcess(model, *tiers) for _ in range(2)]
        router: Child | None = None
        try:
            for replica in replicas:
                replica.wait_ready()
            router = start_router([r.url for r in replicas], policy, model, args.kv_chunk_tokens)
            time.sleep(0.5)  # the router's first health checks and KV polls
            assert router.url is not None
            result = run_workload(router.url, name, args)
            for replica in replicas:
                cost = (json.loads(urlopen_text(replica.url + "/v1/kv/events")).get("costs") or {}).get(
                    "prefill_s_per_token"
                )
                if cost:
                    result.prefill_s_per_token.append(float(cost))
            return result
        finally:
            if router is not None:
                router.signal_group(15)
                router.reap(10)
                router.close()
            for replica in replicas:
                replica.stop()


def small_latency(url: str, conn_cache: dict[str, http.client.HTTPConnection]) -> float:
    conn = conn_cache.get(url)
    if conn is None:
        parts = urlsplit(url)
        conn = conn_cache[url] = http.client.HTTPConnection(parts.netloc, timeout=60)
    body = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return time.perf_counter() - started


def measure_overhead(model: str, n: int) -> dict[str, float]:
    with ServerProcess(model, "--max-model-len", "256") as replica:
        replica.wait_ready()
        router = start_router([replica.url], "round-robin", model)
        try:
            assert router.url is not None
            conns: dict[str, http.client.HTTPConnection] = {}
            for _ in range(5):  # warm both paths (connections, first-request costs)
                small_latency(replica.url, conns), small_latency(router.url, conns)
            direct, via = [], []
            for _ in range(n):
                direct.append(small_latency(replica.url, conns))
                via.append(small_latency(router.url, conns))
            metrics = urlopen_text(router.url + "/metrics")
        finally:
            router.signal_group(15)
            router.reap(10)
            router.close()
    own_sum = _metric(metrics, "preheat_router_overhead_seconds_sum")
    own_count = _metric(metrics, "preheat_router_overhead_seconds_count")
    return {
        "direct_median_ms": statistics.median(direct) * 1e3,
        "router_median_ms": statistics.median(via) * 1e3,
        "overhead_median_ms": (statistics.median(via) - statistics.median(direct)) * 1e3,
        "router_own_mean_ms": own_sum / own_count * 1e3 if own_count else float("nan"),
    }


def urlopen_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _metric(text_: str, name: str) -> float:
    for line in text_.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


CONFIGS = (
    ("round-robin, no L2", "round-robin", False),
    ("round-robin", "round-robin", True),
    ("least-load", "least-load", True),
    ("session", "session", True),
    ("prefix", "prefix", True),
    ("kv", "kv", True),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--system-words", type=int, default=150, help="shared system prompt (~1.2 tokens a word)")
    parser.add_argument("--history-words", type=int, default=750, help="each user's own document")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between users' first requests")
    parser.add_argument("--kv-l1", default="64MiB", help="per replica: about 1.3 users' contexts")
    parser.add_argument("--kv-chunk-tokens", type=int, default=64, help="the replicas' --kv-chunk-tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overhead-requests", type=int, default=50)
    parser.add_argument("--only", nargs="*", default=None, help="run only these configurations (by name)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    model = smollm2_checkpoint(say=lambda line: print(line, file=sys.stderr))
    rows: list[dict[str, Any]] = []
    baseline: float | None = None
    for name, policy, shared in CONFIGS:
        if args.only and name not in args.only:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        result = run_config(name, policy, shared, model, args)
        row = result.row(baseline)
        if name == "round-robin, no L2":
            baseline = row["mean_ttft_s"]
            row["speedup"] = 1.0
        rows.append(row)
    overhead = measure_overhead(model, args.overhead_requests)
    print(
        f"\n{args.users} users x {args.rounds} rounds, 2 replicas, SmolLM2-135M-Instruct f32 on CPU, seed {args.seed}"
    )
    print(f"{'config':<20} {'mean TTFT':>10} {'p90 TTFT':>10} {'hit rate':>9} {'per replica':>12} {'vs baseline':>12} "
          f"{'prefill ms/token':>17}")  # fmt: skip
    for row in rows:
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        per = "/".join(map(str, row["requests_per_replica"]))
        errors = f"  ({row['errors']} errors)" if row["errors"] else ""
        prefill = row["prefill_ms_per_token"] or 0.0
        print(f"{row['config']:<20} {row['mean_ttft_s'] * 1e3:>8.0f}ms {row['p90_ttft_s'] * 1e3:>8.0f}ms "
              f"{row['hit_rate']:>8.1%} {per:>12} {speedup:>12} {prefill:>17.1f}{errors}")  # fmt: skip
    print(
        f"router overhead (small non-streaming, median of {args.overhead_requests}): "
        f"{overhead['overhead_median_ms']:.2f} ms (direct {overhead['direct_median_ms']:.2f} ms, via router "
        f"{overhead['router_median_ms']:.2f} ms; router's own mean {overhead['router_own_mean_ms']:.2f} ms)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"configs": rows, "overhead": overhead, "args": vars(args)}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
