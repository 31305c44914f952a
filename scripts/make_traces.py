"""Make the small sample traces shipped in examples/traces/ (seeded: the same files every run). docs/plan.md
describes each one.

    python scripts/make_traces.py [--out examples/traces] [--seed 0]

- rag.jsonl             150 chat requests (preheat JSON Lines, ``messages``): one of 3 long system prompts, then 1-2
                        of 12 retrieved documents, then a question; arrivals ~1/s. For ``preheat analyze``.
- mooncake.jsonl        2,000 Mooncake-style requests (``hash_ids`` of 512-token blocks): 40 conversations whose
                        turns extend the previous turn's prompt, plus one-off prompts. For ``preheat analyze``.
- azure-day.csv         one day, Azure LLM inference columns (TIMESTAMP, ContextTokens, GeneratedTokens): a diurnal
                        rate (near-silent night, busy afternoon) of ~4,400 requests. For ``preheat simulate``.
- burstgpt-hour.csv     one hour, BurstGPT columns: idle stretches and three bursts. For ``preheat simulate``.
- coldstart-8b.json     a cold-start timeline in ``preheat timeline --json`` form with the seed's stage sizes for an
                        8B model on one GPU (image pull, download, load, warm-up). For ``--cold-start``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from datetime import datetime, timedelta

import numpy as np

WORDS = [
    "replica",
    "cache",
    "prefix",
    "token",
    "shard",
    "weight",
    "tensor",
    "latency",
    "throughput",
    "node",
    "pool",
    "spot",
    "warm",
    "cold",
    "start",
    "load",
    "memory",
    "bandwidth",
    "router",
    "request",
    "queue",
    "batch",
    "decode",
    "prefill",
    "chunk",
    "layer",
    "head",
    "vector",
    "index",
    "storage",
    "network",
    "disk",
    "volume",
]


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words))


def rag(rng: np.random.Generator, n: int = 150) -> list[dict[str, object]]:
    """Chats sharing long system prompts and retrieved documents: high prefix sharing."""
    systems = [f"You are assistant {i}. " + _text(rng, 120) for i in range(3)]
    docs = [f"Document {i}: " + _text(rng, 90) for i in range(12)]
    out = []
    t = 0.0
    for _ in range(n):
        t += float(rng.exponential(1.0))
        picked = rng.choice(len(docs), size=int(rng.integers(1, 3)), replace=False)
        context = "\n\n".join(docs[i] for i in sorted(picked))
        question = "Question: " + _text(rng, int(rng.integers(8, 20))) + "?"
        out.append(
            {
                "timestamp": round(t, 3),
                "messages": [
                    {"role": "system", "content": systems[int(rng.integers(len(systems)))]},
                    {"role": "user", "content": context + "\n\n" + question},
                ],
                "output_tokens": int(rng.integers(20, 200)),
            }
        )
    return out


def mooncake(rng: np.random.Generator, n: int = 2000) -> list[dict[str, object]]:
    """Multi-turn conversations (each turn's prompt extends the last) mixed with one-off prompts."""
    next_id = 0
    conversations: list[list[int]] = []
    out = []
    t_ms = 0
    for _ in range(n):
        t_ms += int(rng.exponential(400))
        if rng.random() < 0.7:
            if not conversations or rng.random() < 0.05:
                conversations.append([])
                conversations = conversations[-40:]
            blocks = conversations[int(rng.integers(len(conversations)))]
            grow = int(rng.integers(1, 3))
            blocks.extend(range(next_id, next_id + grow))
            next_id += grow
            hashes = list(blocks)
        else:
            size = int(rng.integers(1, 5))
            hashes = list(range(next_id, next_id + size))
            next_id += size
        length = len(hashes) * 512 - int(rng.integers(0, 400))
        out.append(
            {"timestamp": t_ms, "input_length": length, "output_length": int(rng.integers(10, 300)), "hash_ids": hashes}
        )
    return out


def azure_day(rng: np.random.Generator, mean_rate: float = 0.05) -> list[tuple[str, int, int]]:
    """One day of Azure-style rows at a diurnal rate (peak mid-afternoon, ~10% of the peak at night)."""
    start = datetime(2023, 11, 16, 0, 0, 0)
    rows = []
    for minute in range(24 * 60):
        hour = minute / 60.0
        # Quiet nights (gaps longer than an idle timeout), a busy afternoon: max(0, sin)^3 averages ~0.21.
        rate = mean_rate * (0.02 + max(0.0, float(np.sin(2 * np.pi * (hour - 8.0) / 24.0))) ** 3 / 0.21)
        for offset in np.sort(rng.uniform(0, 60, size=rng.poisson(rate * 60))):
            stamp = start + timedelta(minutes=minute, seconds=float(offset))
            context = int(np.clip(rng.lognormal(np.log(1000), 0.8), 16, 8000))
            generated = int(np.clip(rng.lognormal(np.log(200), 0.7), 1, 2000))
            rows.append((stamp.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", context, generated))
    return rows


def burstgpt_hour(rng: np.random.Generator) -> list[tuple[float, str, int, int, int, str]]:
    """One hour: a trickle, three bursts of a few hundred requests, and idle gaps longer than a cold start."""
    times = list(rng.uniform(0, 3600, size=60))
    for centre in (600.0, 1900.0, 3000.0):
        times += list(rng.normal(centre, 30.0, size=int(rng.integers(200, 400))))
    rows = []
    for t in sorted(x for x in times if 0 <= x < 3600):
        request = int(np.clip(rng.lognormal(np.log(600), 0.9), 8, 8000))
        response = int(np.clip(rng.lognormal(np.log(250), 0.6), 1, 2000))
        rows.append((round(t, 3), "ChatGPT", request, response, request + response, "Conversation log"))
    return rows


def coldstart_8b() -> dict[str, object]:
    """A timeline shaped like the seed's numbers for an 8B BF16 model (16 GB) on one GPU."""
    stages = [
        ("platform", 40.0, {"note": "image pull and container start (PREHEAT_T0 = pod creation)"}),
        ("imports", 3.0, {}),
        ("config", 0.1, {}),
        ("fetch", 120.0, {"cache": "miss", "total_bytes": 16_060_000_000}),
        ("engine_imports", 2.0, {}),
        ("weight_load", 25.0, {"mode": "read", "device": "cuda"}),
        ("model_build", 3.0, {}),
        ("tokenizer", 0.5, {}),
        ("warmup", 8.0, {}),
    ]
    t = 0.0
    records: list[dict[str, object]] = []
    for name, seconds, detail in stages:
        record: dict[str, object] = {"name": name, "start": round(t, 3), "end": round(t + seconds, 3), "detail": detail}
        if name == "fetch":
            record["bytes"] = 16_060_000_000
        records.append(record)
        t += seconds
    records.append({"name": "ready", "start": round(t, 3), "end": round(t, 3), "detail": {}})
    return {
        "version": 1,
        "origin": 1700000000.0,
        "origin_source": "PREHEAT_T0",
        "total": round(t, 3),
        "stages": records,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "examples", "traces"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    for name, records in (("rag.jsonl", rag(rng)), ("mooncake.jsonl", mooncake(rng))):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    with open(os.path.join(args.out, "azure-day.csv"), "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        writer.writerows(azure_day(rng))
    with open(os.path.join(args.out, "burstgpt-hour.csv"), "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        writer.writerows(burstgpt_hour(rng))
    with open(os.path.join(args.out, "coldstart-8b.json"), "w", encoding="utf-8") as handle:
        json.dump(coldstart_8b(), handle, indent=2)
        handle.write("\n")
    for name in sorted(os.listdir(args.out)):
        print(f"{os.path.join(args.out, name)}: {os.path.getsize(os.path.join(args.out, name)):,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
