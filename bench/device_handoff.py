"""Weights into a model that already lives on the device: the bucketed hand-off against the engines' default paths.

    python bench/device_handoff.py [--size 4GB] [--dir .bench] [--buckets 64MiB,512MiB,2GiB] [--json out.json]

Stands in for vLLM's weight loaders where vLLM cannot be installed (a GPU machine without network): a transformers
Llama is built on the device with empty parameters (``meta`` then ``to_empty``: no random init), and each contender
copies the checkpoint's tensors into those parameters, one ``param.copy_(tensor)`` per tensor, as vLLM's
``weight_loader`` does. Contenders, each from call to "every parameter written" (one device sync):

- safetensors ``load_file`` on the CPU (a mapping), then pageable host-to-device copies: vLLM's default path;
- ``preheat.load(device="cuda")`` of the whole checkpoint, then device-to-device copies: fast, but the model's size
  again in device memory until the copies end;
- ``preheat.loader.buckets.handoff_in_buckets`` at each ``--buckets`` size: device buckets filled by the pinned
  pipeline, handed over and freed one at a time.

Printed per contender: seconds, GB/s, the peak extra device memory above the model's own parameters (measured with
``torch.cuda.max_memory_allocated``), and whether the parameters equal the reference (the first contender's).
Without CUDA it runs on the CPU (the hand-off logic, not the speed, is then what it shows).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

import preheat
from preheat.core.config import parse_size
from preheat.loader.buckets import handoff_in_buckets
from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

HandOff = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


@dataclass
class Row:
    name: str
    seconds: float
    gbps: float
    peak_extra_bytes: int
    equal: bool
    detail: str = ""


def ensure_checkpoint(root: str, size: int) -> str:
    """The checkpoint bench/load.py builds for the same --size (shared, so one machine builds it once)."""
    shape = LlamaShape.of_size(size)
    path = os.path.join(root, f"llama-{size // 10**6}MB")
    if not os.path.exists(os.path.join(path, ".complete")):
        print(f"building a {shape.nbytes() / 1e9:.2f} GB Llama-shaped checkpoint in {path} ...", file=sys.stderr)
        write_llama_checkpoint(path, shape, shards=2)
        open(os.path.join(path, ".complete"), "w").close()
    return path


def build_model(path: str, device: torch.device) -> nn.Module:
    """A transformers Llama of the checkpoint's config, parameters allocated on ``device`` but not initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    built: nn.Module = model.to_empty(device=device)
    return built


def copier(model: nn.Module) -> HandOff:
    """vLLM's weight loaders in one line each: ``param.copy_(loaded)`` by name."""
    params = dict(model.named_parameters())

    @torch.no_grad()  # as vLLM loads: parameters are leaves that require grad
    def hand_off(items: Iterable[tuple[str, torch.Tensor]]) -> object:
        for name, tensor in items:
            params[name].copy_(tensor, non_blocking=True)
        return None

    return hand_off


def fingerprint(model: nn.Module) -> list[float]:
    return [float(p.float().sum()) for p in model.parameters()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    name: str, run: Callable[[], str], model: nn.Module, device: torch.device, *, total: int,
    reference: list[float] | None,
) -> Row:  # fmt: skip
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    detail = run()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else -1
    prints = fingerprint(model)
    equal = reference is None or prints == reference
    return Row(name, seconds, total / seconds / 1e9, peak, equal, detail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4GB", help="checkpoint size (default 4GB, bench/load.py's on the GPU)")
    parser.add_argument("--dir", default=".bench", help="where the generated checkpoint is cached")
    parser.add_argument("--buckets", default="64MiB,512MiB,2GiB", help="bucket sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per contender (the best is shown)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    path = ensure_checkpoint(args.dir, parse_size(args.size))
    model = build_model(path, device)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    hand_off = copier(model)

    def safetensors_pageable() -> str:
        from safetensors.torch import load_file

        for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
            hand_off(load_file(os.path.join(path, file), device="cpu").items())
        return "pageable host->device copies"

    def preheat_whole() -> str:
        weights = preheat.load(path, device)
        hand_off(weights.items())
        sync(device)
        del weights
        return "whole checkpoint on the device, then device->device"

    def bucketed(size: int) -> Callable[[], str]:
        def run() -> str:
            report = handoff_in_buckets(path, hand_off, device=str(device), bucket_bytes=size)
            return (
                f"{report.buckets} buckets, largest {report.largest_bucket / 2**20:.0f} MiB, "
                f"read {report.read_seconds:.2f} s, hand-off {report.handoff_seconds:.2f} s"
            )

        return run

    contenders: list[tuple[str, Callable[[], str]]] = [
        ("safetensors load_file + pageable copies", safetensors_pageable),
        ("preheat.load(cuda) whole + D2D copies", preheat_whole),
    ]
    contenders += [(f"preheat buckets of {b.strip()}", bucketed(parse_size(b))) for b in args.buckets.split(",") if b]

    rows: list[Row] = []
    reference: list[float] | None = None
    for name, run in contenders:
        try:
            run()  # untimed: page cache and allocator warm, as for every contender
            best: Row | None = None
            for _ in range(args.repeat):
                row = measure(name, run, model, device, total=total, reference=reference)
                best = row if best is None or row.seconds < best.seconds else best
            assert best is not None
        except Exception as exc:  # one contender failing must not hide the others
            rows.append(Row(name, float("nan"), float("nan"), -1, False, f"{type(exc).__name__}: {exc}"[:160]))
            continue
        if reference is None:
            reference = fingerprint(model)
        rows.append(best)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{total / 1e9:.2f} GB of bf16 parameters on {device} ({where}); best of {args.repeat} warm runs each")
    print(f"{'contender':42s} {'seconds':>8s} {'GB/s':>7s} {'peak extra':>11s} {'equal':>6s}  detail")
    baseline = rows[0].seconds if rows and rows[0].seconds == rows[0].seconds else float("nan")
    for r in rows:
        peak = f"{r.peak_extra_bytes / 2**20:8.0f} MiB" if r.peak_extra_bytes >= 0 else "n/a"
        ratio = baseline / r.seconds if r.seconds == r.seconds else float("nan")
        print(f"{r.name:42s} {r.seconds:8.2f} {r.gbps:7.2f} {peak:>11s} {r.equal!s:>6s}  {ratio:.2f}x  {r.detail}")
    print("(Nx: the first row's seconds over this row's; peak extra: device memory above the model's parameters)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"total_bytes": total, "device": str(device), "rows": [asdict(r) for r in rows]}, out, indent=2)
    return 0 if all(r.equal for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
