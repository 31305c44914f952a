"""Router routing quality: three workloads against 2 ``preheat serve`` replicas, through each router and policy.

    python bench/router.py [--workloads chat,private,hot] [--routers "preheat kv,smg cache_aware"] [--repeat 3]
                           [--json out.json]

Contenders, each in front of 2 fresh replicas (the same workload, seeded, for every one): preheat's router with
``round-robin``, ``least-load``, ``prefix`` and ``kv``; vLLM's ``vllm-router`` and SGLang's gateway ``smg``, both
``--policy cache_aware`` (Rust; installed into ``.venv-routers`` on first use, bench/router_peers.py). The replicas
are SmolLM2-135M-Instruct (float32, CPU) with an L1 only (``--kv-l1 100MiB``: about 2,200 tokens at 46 KB of K/V
per token, two chats' contexts, so a replica that sees every chat user keeps little of each) and 64-token chunks;
each generates one sequence at a time, so a request queued behind another waits for all of it.

Workloads (sessions run concurrently; a session waits for each answer before its next round; answers are greedy,
``--max-tokens`` long):

- ``chat``: the multi-user multi-turn chat. 4 users (``--chat-users``), ``--chat-rounds`` rounds each, arriving 0.5 s
  apart; every prompt starts with the same ~160-token system prompt and the user's own ~780-token document, and each
  round extends the last with the answer and a short question (~1,000 tokens and growing): the multi-round QA
  pattern LMCache and llm-d measure.
- ``private``: many users with short private contexts. ``--private-users`` users arriving ``--private-gap`` s apart,
  each with its own ~250-token notes and 3 rounds; no two users share more than the chat template's first tokens,
  so what matters is balance, with a little reuse across a user's rounds.
- ``hot``: a few hot shared prefixes with load spikes. 3 documents of ~620 tokens; single-turn questions (~15 tokens)
  about one of them: a trickle (one every ``--hot-trickle`` s, the documents in turn) with a spike every 4 s of
  ``--hot-spike`` questions at once about one document.

``--pin-replicas``: each replica on a core of its own with one compute thread, so that one replica's prefill does not
slow the other's (as on a fleet where each replica has its own accelerator); without it both use every core, and a
second replica computing adds about a third of a replica's speed on 2 cores. The router and the clients use any core.

Reported per workload and contender: mean and p90 TTFT (request sent -> first streamed event, through the router,
queueing included), the prompt-token hit rate (``cached_tokens / prompt_tokens`` from each answer's usage), requests
per replica (preheat's router names the replica; the peers do not), and the ratios of the mean and p90 to the best
contender's in the same workload. Then the router's overhead: 2 x N small non-streaming completions, alternately
straight to a replica and through preheat's router in front of it alone (the difference of the medians, next to the
router's own ``preheat_router_overhead_seconds`` mean). Each row also gives the router's own CPU seconds per run,
while the workload ran (it shares the replicas' two cores here; its start-up is left out), and preheat's rows their
own time per request under the workload (that same histogram's mean) and their decisions by reason (in the JSON).
With ``--repeat``, ``--paired``'s (``kv``'s) mean over each other contender's, repeat by repeat, and in how many
repeats it was the lower; ``--json`` keeps every request too (its session, round, TTFT, tokens and replica), to
compare two contenders' decisions request by request. ``--pool A.json B.json ...`` runs nothing and pools such files:
``--paired`` against each other contender, every request of every file that ran both, and each file's runs paired.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from preheat.cli.demo import smollm2_checkpoint
from preheat.router.cluster import ServerProcess
from router_peers import ensure_peers, running_router

MODEL_ID = "smollm2-135m-instruct"  # what the replicas serve: smg fills in "unknown" when a body names no model
CONTENDERS = ("preheat round-robin", "preheat least-load", "preheat prefix", "preheat kv", "vllm-router cache_aware",
              "smg cache_aware")  # fmt: skip
# A fixed vocabulary: seeded draws from it make every document and question, identical across runs and routers.
_VOCABULARY = """cache replica token prefix router memory latency queue request batch shard tier disk network kernel
model weight layer vector answer question system prompt history session user cluster node storage chunk hash key
value policy metric health retry stream event server client budget price second minute hour restart"""
WORDS = _VOCABULARY.split()
QUESTIONS = ("What does this mean?", "Summarise the last part.", "Which step comes next?", "Why is that so?")
Message = dict[str, str]


@dataclass(frozen=True)
class Session:
    """One client: from ``start`` s into the workload, ``messages`` then one more round per ``follow_ups`` entry
    (the previous answer and the question appended)."""

    start: float
    messages: tuple[Message, ...]
    follow_ups: tuple[str, ...] = ()


@dataclass
class Result:
    workload: str
    router: str
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    seconds: float = 0.0
    run_means: list[float] = field(default_factory=list)  # each run's mean TTFT, with --repeat
    moved: int = 0  # preheat kv: held requests an idle replica took from another's line (docs/router.md)
    router_cpu_s: float = 0.0  # the router's own CPU seconds while the workload ran: it shares the replicas' cores
    reasons: dict[str, int] = field(default_factory=dict)  # preheat: its decisions by reason (docs/router.md)
    # preheat: its own time per request (``preheat_router_overhead_seconds``: reading, routing and relaying, its
    # hold left out), summed, and how many requests that is; under the workload's load, unlike the overhead test.
    routing_s: float = 0.0
    routed: int = 0
    # One entry per answered request (run, session, round, sent at s into the run, TTFT, tokens, replica): for the
    # JSON, where two contenders' decisions and waits can be compared request by request.
    requests: list[dict[str, Any]] = field(default_factory=list)  # Any: JSON-ready values

    def add(self, run: Result) -> None:
        """Pool another run of the same workload and contender into this one."""
        self.ttfts += run.ttfts
        self.prompt_tokens += run.prompt_tokens
        self.cached_tokens += run.cached_tokens
        # Each run has fresh replicas (new URLs): pooled busiest with busiest, so the split stays a split of two.
        for i, n in enumerate(sorted(run.per_replica.values(), reverse=True)):
            self.per_replica[f"#{i}"] = self.per_replica.get(f"#{i}", 0) + n
        self.errors += run.errors
        self.seconds += run.seconds
        self.moved += run.moved
        self.router_cpu_s += run.router_cpu_s
        self.routing_s += run.routing_s
        self.routed += run.routed
        for reason, n in run.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        self.requests += [{**request, "run": len(self.run_means)} for request in run.requests]
        self.run_means.append(statistics.fmean(run.ttfts) if run.ttfts else float("nan"))

    def row(self) -> dict[str, Any]:  # Any: JSON-ready values
        ttfts = sorted(self.ttfts)
        return {
            "workload": self.workload,
            "router": self.router,
            "requests": len(ttfts),
            "runs": len(self.run_means),
            "run_means_s": self.run_means,
            "mean_ttft_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            "p90_ttft_s": p90(ttfts),
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "requests_per_replica": sorted(self.per_replica.values(), reverse=True),
            "errors": self.errors,
            "seconds": self.seconds,
            "moved": self.moved,
            "router_cpu_s": self.router_cpu_s,
            "routing_ms": 1e3 * self.routing_s / self.routed if self.routed else None,
            "reasons": self.reasons,
            "samples": self.requests,
        }


def p90(ttfts: Sequence[float]) -> float:
    """The 90th percentile of sorted TTFTs, the table's rule: the value 90% of the way up (nan for none)."""
    return ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else float("nan")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def chat(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    system = "You are the support assistant for this manual. " + text(rng, 150)
    follow = tuple(QUESTIONS[r % len(QUESTIONS)] for r in range(args.chat_rounds - 1))
    return [
        Session(
            0.5 * u,
            ({"role": "system", "content": system}, {"role": "user", "content": f"My document {u}: " + text(rng, 750)}),
            follow,
        )
        for u in range(args.chat_users)
    ]


def private(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed + 1)
    return [
        Session(
            args.private_gap * u,
            ({"role": "user", "content": f"My notes {u}: " + text(rng, 200)},),
            (QUESTIONS[u % 4], QUESTIONS[(u + 1) % 4]),
        )
        for u in range(args.private_users)
    ]


def hot(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed + 2)
    documents = [f"Reference {d}: " + text(rng, 500) for d in range(3)]

    def ask(start: float, d: int) -> Session:
        question = "Question: " + text(rng, 10)
        return Session(start, ({"role": "system", "content": documents[d]}, {"role": "user", "content": question}))

    sessions = [ask(t * args.hot_trickle, t % 3) for t in range(int(args.hot_seconds / args.hot_trickle))]
    for s, start in enumerate(range(2, int(args.hot_seconds), 4)):  # a spike every 4 s, the documents in turn
        sessions += [ask(float(start), s % 3) for _ in range(args.hot_spike)]
    return sorted(sessions, key=lambda s: s.start)


WORKLOADS: dict[str, Callable[[argparse.Namespace], list[Session]]] = {"chat": chat, "private": private, "hot": hot}


def post_stream(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any], str, str]:
    """One streamed chat request: (TTFT, usage, answer text, replica that answered as preheat's router names it)."""
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


def run_sessions(url: str, result: Result, sessions: Sequence[Session], max_tokens: int) -> None:
    lock = threading.Lock()
    began = time.perf_counter()

    def client(index: int, session: Session) -> None:
        time.sleep(max(session.start - (time.perf_counter() - began), 0.0))
        messages = list(session.messages)
        for r in range(1 + len(session.follow_ups)):
            body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            at = time.perf_counter() - began
            try:
                ttft, usage, answer, replica = post_stream(url, body)
            except (OSError, RuntimeError, http.client.HTTPException) as exc:
                print(f"  {result.router}: round {r}: {exc}", file=sys.stderr)
                with lock:
                    result.errors += 1
                return
            with lock:
                result.ttfts.append(ttft)
                result.prompt_tokens += int(usage.get("prompt_tokens", 0))
                result.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                if replica != "?":
                    result.per_replica[replica] = result.per_replica.get(replica, 0) + 1
                result.requests.append({
                    "session": index, "round": r, "at_s": round(at, 4), "ttft_s": round(ttft, 4),
                    "prompt_tokens": int(usage.get("prompt_tokens", 0)),
                    "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                    "replica": replica,
                })  # fmt: skip
            if r < len(session.follow_ups):
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": session.follow_ups[r]},
                ]

    threads = [threading.Thread(target=client, args=(i, s)) for i, s in enumerate(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.perf_counter() - began


def run_one(workload: str, router: str, *, model: str, peers: Path, logs: Path, args: argparse.Namespace) -> Result:
    tiers = ["--kv-l1", args.kv_l1, "--kv-chunk-tokens", str(args.kv_chunk_tokens), "--max-model-len", "4096"]
    result = Result(workload, router)
    with tempfile.TemporaryDirectory(prefix="preheat-bench-l2-") as l2:
        if args.shared_l2:
            tiers += ["--kv-l2", f"fs://{l2}"]
        replicas = [start_replica(model, tiers, core=i if args.pin_replicas else None) for i in range(2)]
        try:
            for replica in replicas:
                replica.wait_ready()
            log = logs / f"{workload}-{router.replace(' ', '-')}.log"
            preheat_args = ["--kv-chunk-tokens", str(args.kv_chunk_tokens)]
            usage: dict[str, float] = {}
            urls = [r.url for r in replicas]
            with running_router(router, urls, peers, model, log, preheat_args=preheat_args, usage=usage) as url:
                run_sessions(url, result, WORKLOADS[workload](args), args.max_tokens)
                if router.startswith("preheat "):
                    metrics = urlopen_text(url + "/metrics")
                    result.moved = int(_metric(metrics, "preheat_router_moved_total", every=True))
                    result.reasons = _reasons(metrics)
                    result.routing_s = _metric(metrics, "preheat_router_overhead_seconds_sum")
                    result.routed = int(_metric(metrics, "preheat_router_overhead_seconds_count"))
            result.router_cpu_s = usage.get("cpu_s", 0.0)
        finally:
            for replica in replicas:
                replica.stop()
    return result


def start_replica(model: str, tiers: Sequence[str], *, core: int | None) -> ServerProcess:
    """A ``preheat serve`` replica; ``core``: on that core of this process's (modulo their number) with one compute
    thread (``--pin-replicas``)."""
    if core is None:
        return ServerProcess(model, *tiers)
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    os.sched_setaffinity(0, {cores[core % len(cores)]})  # the child inherits this thread's affinity at its spawn
    try:
        return ServerProcess(model, *tiers, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.sched_setaffinity(0, before)


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


def measure_overhead(model: str, n: int, peers: Path, logs: Path) -> dict[str, float]:
    with ServerProcess(model, "--max-model-len", "256") as replica:
        replica.wait_ready()
        with running_router("preheat round-robin", [replica.url], peers, model, logs / "overhead.log") as url:
            conns: dict[str, http.client.HTTPConnection] = {}
            for _ in range(5):  # warm both paths (connections, first-request costs)
                small_latency(replica.url, conns), small_latency(url, conns)
            direct, via = [], []
            for _ in range(n):
                direct.append(small_latency(replica.url, conns))
                via.append(small_latency(url, conns))
            metrics = urlopen_text(url + "/metrics")
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


def _metric(text_: str, name: str, *, every: bool = False) -> float:
    """The value of the series ``name`` without labels; ``every``: the sum of its series with labels too."""
    total = 0.0
    for line in text_.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
        if every and line.startswith(name + "{"):
            total += float(line.split()[-1])
    return total


def _reasons(text_: str) -> dict[str, int]:
    """``preheat_router_decisions_total`` by reason."""
    counts: dict[str, int] = {}
    for line in text_.splitlines():
        if line.startswith("preheat_router_decisions_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = counts.get(reason, 0) + int(float(line.split()[-1]))
    return counts


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'workload':<8} {'router':<24} {'mean TTFT':>10} {'x best':>7} {'p90 TTFT':>10} {'x best':>7} "
          f"{'hit rate':>9} {'per replica':>12} {'router CPU/run':>15} {'runs: mean range':>18}")  # fmt: skip
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        best_mean = min(r["mean_ttft_s"] for r in mine)
        best_p90 = min(r["p90_ttft_s"] for r in mine)
        for row in mine:
            row["mean_x_best"] = row["mean_ttft_s"] / best_mean
            row["p90_x_best"] = row["p90_ttft_s"] / best_p90
            per = "/".join(map(str, row["requests_per_replica"])) or "-"
            errors = f"  ({row['errors']} errors)" if row["errors"] else ""
            errors += f"  ({row['moved']} moved)" if row["moved"] else ""
            means = row["run_means_s"]
            spread = f"{min(means) * 1e3:.0f}-{max(means) * 1e3:.0f}ms" if len(means) > 1 else "-"
            print(f"{workload:<8} {row['router']:<24} {row['mean_ttft_s'] * 1e3:>8.0f}ms {row['mean_x_best']:>6.2f}x "
                  f"{row['p90_ttft_s'] * 1e3:>8.0f}ms {row['p90_x_best']:>6.2f}x {row['hit_rate']:>8.1%} "
                  f"{per:>12} {row['router_cpu_s'] / max(len(means), 1):>14.2f}s {spread:>18}{errors}")  # fmt: skip


def paired_ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> list[float]:  # Any: a table row's values
    """One contender's run means over another's, repeat by repeat (the same repeat ran both within minutes)."""
    return [a / b for a, b in zip(mine["run_means_s"], theirs["run_means_s"], strict=True)]


def print_paired(rows: list[dict[str, Any]], against: str) -> None:
    """``against``'s mean over each other contender's, repeat by repeat. One repeat runs every contender within a few
    minutes, so a drift of the machine's speed over the whole run falls on both sides of each ratio; how often
    ``against`` is lower, out of the repeats, is a sign test the pooled means cannot give."""
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["router"]: r for r in rows if r["workload"] == workload}
        if against not in mine or len(mine[against]["run_means_s"]) < 2:
            continue
        print(f"{workload}: {against}'s mean / each contender's, repeat by repeat")
        for router, row in mine.items():
            if router == against:
                continue
            ratios = paired_ratios(mine[against], row)
            lower = sum(r < 1.0 for r in ratios)
            row[f"paired_{against.replace(' ', '_')}"] = ratios
            print(f"  vs {router:<24} {' '.join(f'{r:.2f}' for r in ratios)}  (lower in {lower} of {len(ratios)}; "
                  f"geometric mean {statistics.geometric_mean(ratios):.3f})")  # fmt: skip


def pool(paths: Sequence[str], against: str) -> list[dict[str, Any]]:
    """``against`` beside each other contender over several ``--json`` files: per workload and contender, every
    request of every file that ran both, pooled, and the repeat-by-repeat ratios of their means within each file. A
    4-run table is one pairing, and its p90 (the 29th longest of 288 requests in private) moves by several percent
    between pairings of the same code; pooled, the pairings give one stand."""
    pooled: dict[tuple[str, str], dict[str, Any]] = {}  # Any: counts and lists, by key
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            saved = json.load(handle)
        rows = {(row["workload"], row["router"]): row for row in saved["rows"]}
        for (workload, router), row in rows.items():
            mine = rows.get((workload, against))
            if router == against or mine is None:
                continue
            entry = pooled.setdefault((workload, router), {"files": 0, "mine": [], "theirs": [], "ratios": []})
            entry["files"] += 1
            entry["mine"] += [r["ttft_s"] for r in saved["requests"][f"{workload}: {against}"]]
            entry["theirs"] += [r["ttft_s"] for r in saved["requests"][f"{workload}: {router}"]]
            entry["ratios"] += paired_ratios(mine, row)
    return [
        {
            "workload": workload,
            "router": router,
            "files": entry["files"],
            "runs": len(entry["ratios"]),
            "mean_s": (statistics.fmean(entry["mine"]), statistics.fmean(entry["theirs"])),
            "p90_s": (p90(sorted(entry["mine"])), p90(sorted(entry["theirs"]))),
            "ratios": entry["ratios"],
        }
        for (workload, router), entry in pooled.items()
    ]


def print_pooled(pooled: list[dict[str, Any]], against: str) -> None:
    for row in pooled:
        (mine, theirs), (mine90, theirs90), ratios = row["mean_s"], row["p90_s"], row["ratios"]
        print(f"{row['workload']}: {against} / {row['router']}, {row['files']} file(s), {row['runs']} runs: mean "
              f"{mine * 1e3:,.0f} / {theirs * 1e3:,.0f} ms ({mine / theirs:.3f}x), p90 {mine90 * 1e3:,.0f} / "
              f"{theirs90 * 1e3:,.0f} ms ({mine90 / theirs90:.3f}x); the lower in {sum(r < 1.0 for r in ratios)} of "
              f"{len(ratios)} runs (geometric mean {statistics.geometric_mean(ratios):.3f})")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="chat,private,hot", help="comma-separated, of " + ",".join(WORKLOADS))
    parser.add_argument("--routers", default=",".join(CONTENDERS), help="contenders, comma-separated")
    parser.add_argument("--chat-users", type=int, default=4)
    parser.add_argument("--chat-rounds", type=int, default=10)
    parser.add_argument("--private-users", type=int, default=24)
    parser.add_argument("--private-gap", type=float, default=0.5, help="seconds between private users' arrivals")
    parser.add_argument("--hot-seconds", type=float, default=30.0, help="how long the hot workload sends")
    parser.add_argument("--hot-trickle", type=float, default=1.0, help="seconds between trickle questions")
    parser.add_argument("--hot-spike", type=int, default=5, help="questions at once in a spike")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-l1", default="100MiB", help="per replica: about 2 chat users' contexts")
    parser.add_argument("--kv-chunk-tokens", type=int, default=64, help="the replicas' --kv-chunk-tokens")
    parser.add_argument("--shared-l2", action="store_true", help="give the replicas one shared fs:// L2 too")
    parser.add_argument("--pin-replicas", action="store_true",
                        help="each replica on a core of its own, one compute thread (replicas that do not slow each "
                             "other, as with an accelerator each)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per workload and contender (fresh replicas each), pooled: the table gives the mean "
                             "and p90 of every request of every run, and the range of the runs' means")  # fmt: skip
    parser.add_argument("--paired", default="preheat kv",
                        help="with --repeat: this contender's mean over each other's, repeat by repeat")  # fmt: skip
    parser.add_argument("--overhead-requests", type=int, default=50, help="0: skip the overhead measurement")
    parser.add_argument("--logs", default=None, help="keep the routers' logs in this directory")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                        help="run nothing: pool these --json files, --paired against each other contender (every "
                             "request of every file that ran both, and each file's runs paired)")  # fmt: skip
    args = parser.parse_args()
    if args.pool:
        print_pooled(pool(args.pool, args.paired), args.paired)
        return 0
    model = smollm2_checkpoint(say=lambda line: print(line, file=sys.stderr))
    peers = ensure_peers()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    rows: list[dict[str, Any]] = []
    overhead: dict[str, float] | None = None
    with tempfile.TemporaryDirectory(prefix="preheat-bench-router-") as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for workload in workloads:
            pooled = {router: Result(workload, router) for router in routers}
            for repeat in range(args.repeat):
                # Each repeat starts one contender further on: a drift of the machine's speed during the run is
                # spread over the contenders instead of always falling on the last ones.
                for router in routers[repeat % len(routers) :] + routers[: repeat % len(routers)]:
                    print(f"{workload}: {router} (run {repeat + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
                    run = run_one(workload, router, model=model, peers=peers, logs=logs, args=args)
                    row = run.row()
                    print(f"  mean {row['mean_ttft_s']:.2f} s, p90 {row['p90_ttft_s']:.2f} s, hit rate "
                          f"{row['hit_rate']:.1%}, {row['seconds']:.0f} s, router CPU {row['router_cpu_s']:.2f} s"
                          + (f", its own time {row['routing_ms']:.2f} ms a request" if row["routing_ms"] else ""),
                          file=sys.stderr, flush=True)  # fmt: skip
                    pooled[router].add(run)
            rows += [pooled[router].row() for router in routers]
        if args.overhead_requests:
            overhead = measure_overhead(model, args.overhead_requests, peers, logs)
    print(f"\n2 replicas of SmolLM2-135M-Instruct f32 on CPU, L1 {args.kv_l1} each, seed {args.seed}, "
          f"{args.repeat} run(s) each")
    print_table(rows)
    print_paired(rows, args.paired)
    if overhead is not None:
        print(
            f"router overhead (small non-streaming, median of {args.overhead_requests}): "
            f"{overhead['overhead_median_ms']:.2f} ms (direct {overhead['direct_median_ms']:.2f} ms, via router "
            f"{overhead['router_median_ms']:.2f} ms; router's own mean {overhead['router_own_mean_ms']:.2f} ms)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            requests = {f"{row['workload']}: {row['router']}": row.pop("samples") for row in rows}
            json.dump({"rows": rows, "overhead": overhead, "args": vars(args), "requests": requests}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
