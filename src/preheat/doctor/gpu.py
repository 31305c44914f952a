"""CUDA checks: driver and CUDA versions, GPUs and their memory, pinned host-to-device bandwidth, GDS, NIXL.

Without a CUDA device (or without torch) each says so as ``info``: a CPU node is not a misconfigured GPU node. The
H2D probe copies one pinned buffer (at most ``probe_bytes``, 256 MiB by default) a few times within its bound.
"""

from __future__ import annotations

import glob
import importlib.util
import shutil
import subprocess
import time
from typing import Any

from preheat.core.config import format_bytes
from preheat.doctor.check import Check, DoctorOptions
from preheat.doctor.findings import Finding

GB = 1e9
SLOW_H2D_GBPS = 10.0  # PCIe Gen4 x16 moves ~25 GB/s pinned; under 10 is a narrow link, a far NUMA node or pageable


def checks(options: DoctorOptions) -> list[Check]:
    # torch's import and CUDA's initialisation take seconds on a busy node, hence the generous first bound.
    found = [Check("gpu.cuda", "gpu", 10.0, check_cuda), Check("gpu.gds", "gpu", 3.0, check_gds),
             Check("gpu.nixl", "gpu", 2.0, check_nixl)]
    if options.io:
        found.insert(1, Check("gpu.h2d", "gpu", 10.0, check_h2d))  # after gpu.cuda: torch is imported by then
    return found


def _torch() -> Any:  # Any: the torch module, imported late (optional at this layer, and slow)
    import torch

    return torch


def nvidia_devices() -> list[str]:
    """The NVIDIA device nodes this process can see (``/dev/nvidia0``...): none means no CUDA, known without
    importing torch, which takes seconds on a busy node and would spend the check's bound on a CPU node."""
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def cuda_available() -> bool:
    if not nvidia_devices():
        return False
    try:
        return bool(_torch().cuda.is_available())
    except ImportError:
        return False


def driver_version(timeout_s: float) -> str | None:
    """The NVIDIA driver's version from nvidia-smi, None when it is missing or does not answer in time."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def _no_cuda(check_id: str, what: str) -> list[Finding]:
    return [Finding(check_id, "gpu", "info", f"no CUDA device: {what} not checked", evidence={})]


def _model_bytes(options: DoctorOptions) -> int | None:
    from preheat.doctor.node import model_files

    model = model_files(options.model) if options.model else None
    return model.nbytes if model else None


def check_cuda(options: DoctorOptions, bound_s: float) -> list[Finding]:
    if not nvidia_devices():
        return [Finding("gpu.none", "gpu", "info", "no CUDA device (no /dev/nvidia*)", evidence={"devices": []})]
    try:
        torch = _torch()
    except ImportError:
        return [Finding("gpu.none", "gpu", "info", "no CUDA device (torch is not installed)", evidence={})]
    if not torch.cuda.is_available():
        return [Finding("gpu.none", "gpu", "info", "no CUDA device",
                        evidence={"torch": torch.__version__, "torch_cuda": torch.version.cuda})]
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                        "capability": f"{props.major}.{props.minor}"})
    total = sum(int(d["memory_bytes"]) for d in devices)
    evidence: dict[str, object] = {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "driver": driver_version(min(3.0, bound_s / 2)), "count": len(devices), "devices": devices,
        "model_bytes": _model_bytes(options),
    }
    model = evidence["model_bytes"]
    names = ", ".join(sorted({str(d["name"]) for d in devices}))
    if isinstance(model, int) and model > total:
        return [Finding("gpu.memory", "gpu", "fail",
                        f"the model ({format_bytes(model)}) is larger than all GPU memory ({format_bytes(total)})",
                        evidence=evidence,
                        fix="Use more GPUs (tensor parallel) or a quantized checkpoint (`preheat convert`).")]
    largest = max(int(d["memory_bytes"]) for d in devices)
    if isinstance(model, int) and model > largest * 0.9:
        return [Finding("gpu.memory", "gpu", "info",
                        f"the model ({format_bytes(model)}) needs more than one of the {len(devices)} GPUs",
                        evidence=evidence,
                        fix="Load with --world-size N (tensor parallel); a pre-sharded checkpoint makes each rank "
                        "read only its slice.")]
    return [Finding("gpu.cuda", "gpu", "ok", f"{len(devices)} x {names}, {format_bytes(total)} of GPU memory",
                    evidence=evidence)]


def check_h2d(options: DoctorOptions, bound_s: float) -> list[Finding]:
    if not cuda_available():
        return _no_cuda("gpu.h2d", "host-to-device bandwidth")
    torch = _torch()
    nbytes = max(16 * 1024 * 1024, min(options.probe_bytes, 256 * 1024 * 1024))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # the first copy pays for context and page setup: not timed
    torch.cuda.synchronize()
    deadline = time.monotonic() + bound_s * 0.7
    copies, start = 0, time.perf_counter()
    while copies < 5 and time.monotonic() < deadline:
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        copies += 1
    elapsed = max(time.perf_counter() - start, 1e-9)
    gbps = nbytes * copies / elapsed / GB
    model = _model_bytes(options)
    seconds = model / (gbps * GB) if model else None
    evidence = {"bytes": nbytes, "copies": copies, "gbps": round(gbps, 2), "pinned": True,
                "model_bytes": model}
    del host, device
    if gbps < SLOW_H2D_GBPS:
        return [Finding("gpu.h2d_slow", "gpu", "warn", f"pinned host-to-device copies run at {gbps:.1f} GB/s",
                        seconds=seconds, evidence=evidence,
                        fix="Check the link (`nvidia-smi -q | grep -A3 'Link Width'`: x16 expected), run on the GPU's "
                        "NUMA node, and keep the GPU out of a power-saving P-state.")]
    return [Finding("gpu.h2d", "gpu", "ok", f"pinned host-to-device copies run at {gbps:.1f} GB/s",
                    seconds=seconds, evidence=evidence)]


def check_gds(options: DoctorOptions, bound_s: float) -> list[Finding]:
    if importlib.util.find_spec("kvikio") is None:
        return [Finding("gpu.gds", "gpu", "info", "GPUDirect Storage: kvikio is not installed",
                        evidence={"kvikio": False},
                        fix="Optional: `pip install kvikio-cu12` and the nvidia-fs driver let `--mode gds` read files "
                        "straight into GPU memory.")]
    if not cuda_available():
        return _no_cuda("gpu.gds", "GPUDirect Storage")
    from preheat.io.gds import gds_status

    status = gds_status()
    evidence = {"kvikio": True, "available": status.available, "compat_mode": status.compat_mode,
                "detail": status.detail}
    if status.compat_mode:
        return [Finding("gpu.gds_compat", "gpu", "info", "kvikio runs in compatibility mode (no real cuFile)",
                        evidence=evidence,
                        fix="`--mode gds` bounces through host memory here, no faster than `--mode read`: install the "
                        "nvidia-fs kernel driver and check `gdscheck -p` for real GDS.")]
    return [Finding("gpu.gds", "gpu", "ok", "GPUDirect Storage is active (cuFile)", evidence=evidence)]


def check_nixl(options: DoctorOptions, bound_s: float) -> list[Finding]:
    present = importlib.util.find_spec("nixl") is not None
    evidence = {"nixl": present}
    if not present:
        return [Finding("gpu.nixl", "gpu", "info", "NIXL is not installed: peers send weights over TCP",
                        evidence=evidence,
                        fix="Optional: `pip install nixl-cu12` lets peers holding the model on GPU send it device to "
                        "device (docs/peer.md).")]
    if not cuda_available():
        return [Finding("gpu.nixl", "gpu", "info", "NIXL is installed, but there is no CUDA device to use it",
                        evidence=evidence)]
    return [Finding("gpu.nixl", "gpu", "ok", "NIXL is installed: GPU peers can send weights device to device",
                    evidence=evidence)]
