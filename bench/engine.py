"""Engine speed: prefill and decode tokens/s of preheat's engine against transformers, on the same weights, in ONE run.

    python bench/engine.py [MODEL_DIR] [--repeat 5] [--dtype auto,float32] [--json out.json]

MODEL_DIR defaults to SmolLM2-135M-Instruct from the node cache (``preheat demo``'s copy). For each compute dtype:
preheat's engine (``Engine.from_checkpoint``, weights bound from ``preheat.load``) and transformers
(``AutoModelForCausalLM.from_pretrained`` on the same directory, its own KV cache) run the same forward passes:

- prefill: one pass over a prompt of P tokens, from an empty cache (what time to first token costs after loading);
- decode: 32 single-token steps after a 512-token prompt (steady-state generation).

Contenders alternate within each repetition so drifting machine load hits both; the best (minimum) time of the
repetitions is reported, as the least disturbed measurement on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from preheat.engine import Engine

PROMPTS = (37, 512, 2048)
DECODE_CONTEXT, DECODE_STEPS = 512, 32


Contender = tuple[Callable[[list[int]], None], Callable[[list[int]], float]]  # (prefill, decode -> seconds)


def ours(engine: Engine) -> Contender:
    model, cache = engine.model, engine.kv_cache
    assert model is not None
    assert cache is not None

    def prefill(ids: list[int]) -> None:
        seq = cache.new_sequence()
        model.forward(torch.tensor(ids), 0, cache, seq)
        cache.release(seq)

    def decode(ids: list[int]) -> float:
        seq = cache.new_sequence()
        model.forward(torch.tensor(ids), 0, cache, seq)
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            model.forward(torch.tensor([ids[-1]]), seq.length, cache, seq)
        elapsed = time.perf_counter() - start
        cache.release(seq)
        return elapsed

    return prefill, decode


def theirs(path: str, dtype: torch.dtype) -> Contender:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)

    def prefill(ids: list[int]) -> None:
        model(torch.tensor([ids]), use_cache=True)

    def decode(ids: list[int]) -> float:
        out = model(torch.tensor([ids]), use_cache=True)
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            out = model(torch.tensor([[ids[-1]]]), cache=out.cache, use_cache=True)
        return time.perf_counter() - start

    return prefill, decode


def timed(fn: Callable[[list[int]], None], ids: list[int]) -> float:
    start = time.perf_counter()
    fn(ids)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: SmolLM2 from the node cache)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", default="auto,float32", help="compute dtypes to measure, comma-separated")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    path = args.model
    if path is None:
        from preheat.cli.demo import smollm2_checkpoint

        path = smollm2_checkpoint(say=lambda _: None)
    results: dict[str, dict[str, float]] = {}
    for name in args.dtype.split(","):
        started = time.perf_counter()
        engine = Engine.from_checkpoint(path, dtype=name)
        built = time.perf_counter() - started
        engine.warmup()
        contenders = {f"preheat {name} ({engine.dtype})": ours(engine)}
        contenders[f"transformers ({engine.dtype})"] = theirs(path, engine.dtype)
        vocab = engine.config.vocab_size
        ids = [int(i) for i in torch.randint(0, vocab, (max(PROMPTS),), generator=torch.Generator().manual_seed(0))]
        times: dict[str, dict[str, list[float]]] = {c: {} for c in contenders}
        with torch.inference_mode():
            for prefill, decode in contenders.values():  # one untimed round: lazy init, page cache
                prefill(ids[:64])
                decode(ids[:DECODE_CONTEXT])
            for _ in range(args.repeat):
                for label, (prefill, decode) in contenders.items():
                    for p in PROMPTS:
                        times[label].setdefault(f"prefill {p}", []).append(timed(prefill, ids[:p]))
                    times[label].setdefault("decode", []).append(decode(ids[:DECODE_CONTEXT]))
        for label, measured in times.items():
            results[label] = {
                key: (DECODE_STEPS if key == "decode" else int(key.split()[-1])) / min(values)
                for key, values in measured.items()
            }
        results[f"preheat {name} ({engine.dtype})"]["build_s"] = built
    header = ["contender", *(f"prefill {p} tok/s" for p in PROMPTS), f"decode@{DECODE_CONTEXT} tok/s"]
    print(f"{header[0]:<36}" + "".join(f"{h:>20}" for h in header[1:]))
    for label, row in results.items():
        cells = [row[f"prefill {p}"] for p in PROMPTS] + [row["decode"]]
        print(f"{label:<36}" + "".join(f"{c:>20.1f}" for c in cells))
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
