"""The child process of engines.cpuprobe: ``python cpuprobe_child.py SPEC_JSON``.

It imports the modules of ``SPEC_JSON["imports"]`` and prints ``NATIVE <module>`` (flushed) just before each
extension module's code first runs and ``LOADED <module>`` (or ``FAILED <module>``) once it has, so when a build for
CPU features this machine lacks kills the process with SIGILL, the parent knows which module it died in. With
``SPEC_JSON["hidden"]`` flags, it plays the CPU without them: an extension module whose recorded needs
(``SPEC_JSON["needs"]``) include a hidden flag ends the process with a real SIGILL right where the real CPU would,
and, with ``SPEC_JSON["torch_dispatch"]``, torch's CPU checks answer as that CPU would, so an engine that picks its
build by them (vLLM's CPU platform) picks the one it would pick there.

Standard library only until the imports start: it runs in every engine venv and in ``.venv``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import resource
import signal
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import ClassVar

# torch's CPU checks and the /proc/cpuinfo flags each one needs; torch.cpu._is_avx512_supported is
# at::cpu::is_avx512_supported (AVX-512 F, BW, VL and DQ), the others add one feature to it.
TORCH_CHECKS: dict[str, frozenset[str]] = {
    "_is_avx2_supported": frozenset({"avx2"}),
    "_is_avx512_supported": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "_is_avx512_vnni_supported": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    "_is_avx512_bf16_supported": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
    "_is_amx_tile_supported": frozenset({"amx_tile"}),
    "_is_amx_fp16_supported": frozenset({"amx_tile", "amx_fp16"}),
}


def answer_no() -> bool:
    return False


class Announcing(importlib.machinery.ExtensionFileLoader):
    """The regular loader of an extension module, which first names the module (and, for a hidden flag it needs, dies
    as that CPU would) at the one step that runs its code: the ``dlopen`` in ``create_module``."""

    needs: ClassVar[dict[str, frozenset[str]]] = {}
    hidden: ClassVar[frozenset[str]] = frozenset()

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        print(f"NATIVE {spec.name}", flush=True)
        if self.hidden & self.needs.get(spec.name, frozenset()):
            os.kill(os.getpid(), signal.SIGILL)  # what the CPU without those flags does here, signal and all
        try:
            return super().create_module(spec)
        except BaseException:
            print(f"FAILED {spec.name}", flush=True)  # its loading is over: a later death is not its doing
            raise

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        print(f"LOADED {module.__spec__.name if module.__spec__ else module.__name__}", flush=True)


class Announce(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: the regular path finder's spec, with ``Announcing`` as an extension's loader (so
    a ``find_spec`` that only asks whether a module exists announces nothing)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or type(spec.loader) is not importlib.machinery.ExtensionFileLoader:
            return None  # everything else is found as before, by the finders after this one
        spec.loader = Announcing(spec.loader.name, spec.loader.path)
        return spec


def fool_torch(hidden: frozenset[str]) -> None:
    import torch.cpu

    for name, flags in TORCH_CHECKS.items():
        if flags & hidden and hasattr(torch.cpu, name):
            setattr(torch.cpu, name, answer_no)


def main() -> None:
    spec = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # dying here is an answer, not a crash to keep a core of
    Announcing.needs = {module: frozenset(flags) for module, flags in spec["needs"].items()}
    hidden = Announcing.hidden = frozenset(spec["hidden"])
    sys.meta_path.insert(0, Announce())
    if hidden and spec["torch_dispatch"]:
        fool_torch(hidden)
    for module in spec["imports"]:
        importlib.import_module(module)
    print("IMPORTED", flush=True)


if __name__ == "__main__":
    main()
