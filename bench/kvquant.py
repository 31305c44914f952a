"""Accuracy of quantized KV chunks (``--kv-dtype int8|fp8``) on SmolLM2-135M-Instruct, against exact chunks.

    python bench/kvquant.py [--prompts 12] [--tokens 32] [--json out.json]

Each prompt is a long seeded document (about 1k tokens, so 3 full 256-token chunks come from the cache) and a
question. For each KV dtype the prompt is run once to store its chunks, then again so its prefix is restored from L1;
the restored run's greedy tokens are compared position by position with the run without any cache. Prints, per
dtype: greedy tokens identical up to the first difference (mean fraction of the answer), tokens equal at the same
position, and the cosine similarity of the first logits. ``auto`` (exact chunks) must be 100%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from preheat.cli.demo import smollm2_checkpoint
from preheat.engine import Engine
from preheat.engine.sampling import SamplingParams
from preheat.kv.build import build_tiers
from preheat.kv.settings import KVSettings
from ttft import QUESTIONS, prefix_text  # bench/ is on sys.path: Python puts a script's folder first


def first_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    state = engine.backend.begin()
    try:
        with torch.inference_mode():
            cached = engine._restore_prefix(state, engine._chunk_keys(ids), len(ids))
            return engine.backend.step(state, ids[cached:], cached).float()
    finally:
        engine.backend.end(state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = Engine.from_checkpoint(smollm2_checkpoint(say=lambda line: print(line, file=sys.stderr)))
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    prompts = [
        engine.encode_chat([{"role": "user", "content": prefix_text(700, seed=i) + QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(args.prompts)
    ]
    reference = [[s.token_id for s in engine.generate(ids, params)] for ids in prompts]
    exact_logits = [first_logits(engine, ids) for ids in prompts]
    spec = engine.kv_spec()
    assert spec is not None  # SmolLM2 runs on the native engine
    results = {}
    for kv_dtype in ("auto", "int8", "fp8"):
        tiers = build_tiers(spec, KVSettings(l1="4GiB", kv_dtype=kv_dtype))
        engine.attach_kv_tiers(tiers)
        prefix_share, same_pos, cosines, cached = [], [], [], []
        for ids, ref, logits in zip(prompts, reference, exact_logits, strict=True):
            list(engine.generate(ids, params))  # stores the chunks
            steps = list(engine.generate(ids, params))  # restores them
            tokens = [s.token_id for s in steps]
            cached.append(steps[0].cached_tokens)
            pairs = list(zip(tokens, ref, strict=False))
            agree = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
            prefix_share.append(agree / len(ref))
            same_pos.append(sum(a == b for a, b in zip(tokens, ref, strict=False)) / len(ref))
            cosines.append(torch.nn.functional.cosine_similarity(first_logits(engine, ids), logits, dim=0).item())
        engine.attach_kv_tiers(None)
        results[kv_dtype] = {
            "identical_prefix": statistics.mean(prefix_share),
            "same_position": statistics.mean(same_pos),
            "all_identical": sum(p == 1.0 for p in prefix_share) / len(prefix_share),
            "first_logits_cosine_min": min(cosines),
            "cached_tokens_mean": statistics.mean(cached),
            "bytes_per_token": tiers.l1.used / max(len(tiers.l1), 1) / 256 if tiers and tiers.l1 else None,
        }
    print(f"\nSmolLM2-135M-Instruct, {args.prompts} prompts of ~1k tokens, {args.tokens} greedy tokens each\n")
    print(f"{'KV dtype':<8} {'answers identical':>18} {'tokens before 1st diff':>23} {'same position':>14} "
          f"{'min cos(logits)':>16} {'bytes/token':>12}")
    for name, r in results.items():
        print(f"{name:<8} {r['all_identical']:>18.0%} {r['identical_prefix']:>23.1%} {r['same_position']:>14.1%} "
              f"{r['first_logits_cosine_min']:>16.5f} {r['bytes_per_token']:>12.0f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
