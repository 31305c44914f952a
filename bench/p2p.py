"""Peer-to-peer benchmark: time to ready for a new replica fed by 1 peer, 2 peers, a peer killed mid-pull, the HTTP
origin and the local disk (page cache dropped), plus the compile stage cold and with a peer's artifacts, in ONE run.

    python bench/p2p.py [--size 48MB] [--peer-mbps 20] [--origin-mbps 10] [--no-compile] [--json out.json]

Every replica is a fresh `preheat serve` process with an empty node cache, timed by its own timeline (process start
-> ready). Warm replicas are `preheat serve --peer --peer-max-mbps N` processes announced in a file registry; the
cap makes the peer count matter on one machine (loopback is otherwise faster than any NIC). The origin is preheat's
FileServer with a per-connection throttle (object stores cap each connection). The "killed" run kills one of two
peers once it has sent a quarter of the model, and reports the delay beyond the surviving peer's own transfer time
(the bytes it sent / its capped rate): that is what failure detection and reassignment cost.

Compile: `preheat serve --compile` of a tiny model with an empty Inductor cache (cold), then a second replica, with
another empty cache, that installs the first one's artifacts from it as a peer once they are signed by a key the
newcomer trusts (`preheat artifacts keygen|sign`, `--trust-key`). The compile stage includes the
warm-up forward passes that trigger compilation. Ratios are what matter: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.config import parse_size
from preheat.core.timeline import Stage
from preheat.router.cluster import ServerProcess
from preheat.testing.fileserver import FileServer
from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint


@dataclass
class Run:
    name: str
    ready: float = 0.0
    stage: float = 0.0  # fetch (or compile) seconds
    nbytes: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    note: str = ""

    @property
    def mbps(self) -> float:
        return self.nbytes / self.stage / 1e6 if self.stage else 0.0


def make_model(root: Path, size: int) -> Path:
    """A servable random-weight Llama of about ``size`` bytes (float32) with a manifest."""
    make_tiny_servable_model(root)
    config = json.loads((root / "config.json").read_text())
    vocab, hidden = int(config["vocab_size"]), 512
    per_layer = LlamaShape(vocab, hidden, 1536, 1, 8, 4).nbytes(torch.float32)
    layers = max(1, round(size / per_layer))
    shape = LlamaShape(vocab, hidden, 1536, layers, 8, 4)
    write_llama_checkpoint(root, shape, dtype=torch.float32)
    (root / "config.json").write_text(json.dumps({**config, **shape.config()}, indent=2))
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


def evict(root: Path) -> None:
    """Drop the model's pages from the page cache (no root needed for files we can open)."""
    for path in root.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timeline(process: ServerProcess) -> dict[str, Stage]:
    with urllib.request.urlopen(process.url + "/v1/preheat/timeline", timeout=10) as response:
        data = json.loads(response.read())
    return {stage.name: stage for stage in map(Stage.from_dict, data["stages"])}


def duration(stage: Stage) -> float:
    if stage.end is None:
        raise RuntimeError(f"stage {stage.name} never ended")
    return stage.end - stage.start


def measure(
    name: str,
    model: str,
    *extra: str,
    env: dict[str, str] | None = None,
    stage: str = "fetch",
    during: Callable[[], None] | None = None,
) -> Run:
    cache = tempfile.mkdtemp(prefix="p2p-cache-")
    try:
        with ServerProcess(model, "--cache-dir", cache, *extra, env=env) as process:
            if during is not None:
                during()
            process.wait_ready()
            stages = timeline(process)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    run = Run(name, ready=stages["ready"].start)
    if stage in stages:
        s = stages[stage]
        run.stage = duration(s)
        run.nbytes = s.nbytes or 0
        run.sources = dict(s.detail.get("sources", {}))
        run.note = str(s.detail.get("artifacts", ""))
    return run


def peer(model: Path, registry: str, mbps: float, *extra: str) -> ServerProcess:
    process = ServerProcess(
        str(model),
        "--served-model-name",
        "bench",
        "--peer",
        "--registry",
        registry,
        "--peer-max-mbps",
        str(mbps),
        *extra,
    )
    process.wait_ready()
    deadline = time.monotonic() + 30
    while not any("peer serving" in line for line in process.lines):
        if time.monotonic() > deadline:
            raise RuntimeError(f"peer never started serving: {process.lines[-5:]}")
        time.sleep(0.05)
    return process


def peer_address(process: ServerProcess) -> str:
    line = next(line for line in process.lines if "peer serving" in line)
    return line.split(" on ", 1)[1].split(",", 1)[0]


def kill_mid_pull(process: ServerProcess, after_bytes: float) -> None:
    """SIGKILL ``process`` once its peer server has sent ``after_bytes`` (it is then mid-pull, by construction)."""
    url = f"http://{peer_address(process)}/peer/v1/info"

    def sent() -> int:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(json.loads(response.read())["bytes_sent"])

    before = sent()  # what it sent to earlier runs
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sent() - before < after_bytes:
        time.sleep(0.01)
    process.proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="48MB", help="checkpoint size (default 48MB)")
    parser.add_argument("--peer-mbps", type=float, default=20.0, help="each peer's outbound cap, MB/s (default 20)")
    parser.add_argument("--origin-mbps", type=float, default=10.0, help="origin cap per connection, MB/s")
    parser.add_argument("--no-compile", action="store_true", help="skip the compile runs (~1 min on 2 cores)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="p2p-bench-"))
    runs: list[Run] = []
    try:
        model = make_model(work / "model", parse_size(args.size))
        model_bytes = sum(p.stat().st_size for p in model.iterdir() if p.suffix == ".safetensors")
        registry = f"file://{work / 'registry'}"
        with FileServer(model, throttle_bps=int(args.origin_mbps * 1e6)) as origin:
            origin_env = {**os.environ, "PREHEAT_ORIGIN": origin.url}
            evict(model)
            runs.append(measure("local disk, page cache dropped", str(model), stage="weight_load"))
            runs.append(measure(f"HTTP origin ({args.origin_mbps:g} MB/s per connection)", origin.url))
            with peer(model, registry, args.peer_mbps):
                one = measure(
                    f"1 peer ({args.peer_mbps:g} MB/s cap)", "preheat://bench", "--registry", registry, env=origin_env
                )
                runs.append(one)
                with peer(model, registry, args.peer_mbps) as second:
                    runs.append(measure("2 peers", "preheat://bench", "--registry", registry, env=origin_env))

                    def kill_soon() -> None:
                        threading.Thread(target=kill_mid_pull, args=(second, 0.25 * model_bytes), daemon=True).start()

                    killed = measure(
                        "2 peers, one killed mid-pull",
                        "preheat://bench",
                        "--registry",
                        registry,
                        env=origin_env,
                        during=kill_soon,
                    )
                    survivor = max(killed.sources.values()) if killed.sources else 0
                    ideal = survivor / one.mbps / 1e6 if one.mbps else 0.0
                    killed.note = f"delay beyond the survivor's transfer: {killed.stage - ideal:+.2f} s"
                    runs.append(killed)
        if not args.no_compile:
            tiny = make_tiny_servable_model(work / "tiny")
            (tiny / MANIFEST_NAME).write_bytes(build_manifest(str(tiny)).to_json())
            creg = f"file://{work / 'compile-registry'}"
            env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
            cold_cache = tempfile.mkdtemp(prefix="p2p-compile-")
            with ServerProcess(
                str(tiny), "--compile", "--peer", "--registry", creg, "--cache-dir", cold_cache, env=env
            ) as cold:
                cold.wait_ready()
                stages = timeline(cold)
                s = stages["compile"]
                cold_run = Run(
                    "compile, cold (empty Inductor cache)",
                    stages["ready"].start,
                    duration(s),
                    note=str(s.detail.get("artifacts")),
                )
                runs.append(cold_run)
                deadline = time.monotonic() + 60
                while not any("peer serving" in line for line in cold.lines) and time.monotonic() < deadline:
                    time.sleep(0.05)
                # Peers' artifacts are code: the newcomer installs them only when signed by a key it trusts.
                key = work / "fleet.key"
                preheat = [sys.executable, "-m", "preheat", "artifacts"]
                subprocess.run([*preheat, "keygen", str(key)], check=True, capture_output=True)
                subprocess.run(
                    [*preheat, "sign", "--key", str(key), "--cache-dir", cold_cache], check=True, capture_output=True
                )
                runs.append(
                    measure(
                        "compile, signed artifacts from a peer",
                        str(tiny),
                        "--compile",
                        "--registry",
                        creg,
                        "--trust-key",
                        f"{key}.pub",
                        env=env,
                        stage="compile",
                    )
                )
            shutil.rmtree(cold_cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(runs, args)
    return 0


def report(runs: list[Run], args: argparse.Namespace) -> None:
    by = {r.name.split(" (")[0]: r for r in runs}
    print(f"\n{'run':44} {'ready s':>8} {'stage s':>8} {'MB':>7} {'MB/s':>7}  sources / note")
    for r in runs:
        sources = ", ".join(f"{k}: {v / 1e6:.1f} MB" for k, v in r.sources.items())
        print(f"{r.name:44} {r.ready:8.2f} {r.stage:8.2f} {r.nbytes / 1e6:7.1f} {r.mbps:7.1f}  {sources} {r.note}")
    one, two = by.get("1 peer"), by.get("2 peers")
    if one and two and one.mbps:
        print(f"\n2 peers / 1 peer fetch throughput: {two.mbps / one.mbps:.2f}x (target >= 1.6x)")
    compiles = [r for r in runs if r.name.startswith("compile")]
    if len(compiles) == 2 and compiles[1].stage:
        print(f"compile stage, cold / with artifacts: {compiles[0].stage / compiles[1].stage:.2f}x (target >= 3x)")
    killed = next((r for r in runs if "killed" in r.name), None)
    if killed:
        print(f"peer killed mid-pull: {killed.note} (target < 3 s)")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in runs], indent=2))


if __name__ == "__main__":
    sys.exit(main())
