"""``vllm serve MODEL --load-format preheat``, and vLLM's whole start on preheat's timeline (docs/integrations.md).

vLLM calls ``register()`` in every process it starts, through the ``vllm.general_plugins`` entry point in
pyproject.toml. Importing this package never imports vLLM: ``register()`` does, and only there is vLLM needed. Besides
the loader, ``register()`` installs the start-up hooks (``startup_hooks``): every vLLM process, with any load format,
records its stages for ``preheat timeline`` (``PREHEAT_VLLM_STARTUP=off`` turns that off).

    vllm serve /models/llama --load-format preheat \\
        --model-loader-extra-config '{"source": "preheat://llama", "registry": "redis://reg:6379"}'
"""

from __future__ import annotations

import logging
import time

from preheat.core.errors import ConfigError
from preheat.integrations.vllm.options import ALLOWED, LOAD_FORMAT, SUPPORTED_VLLM, LoadOptions, parse_options

__all__ = ["ALLOWED", "LOAD_FORMAT", "SUPPORTED_VLLM", "LoadOptions", "parse_options", "register"]

log = logging.getLogger("preheat.vllm")
_registered: set[str] = set()  # load formats registered in this process


def register() -> None:
    """Register the loader under ``--load-format preheat``. Idempotent. Raises ``ConfigError`` when vLLM is not
    installed. A vLLM whose loader registry moved is logged, not raised: a plugin must not stop vLLM from serving
    other load formats; the supported-version check happens when ``--load-format preheat`` is used."""
    if LOAD_FORMAT in _registered:
        return
    entered = time.time()  # the end of this process's imports on the start-up timeline
    try:
        import vllm  # only to tell "no vLLM" from "a vLLM we do not fit"
    except ImportError as exc:
        raise ConfigError(
            f"preheat's --load-format {LOAD_FORMAT} plugs into vLLM, which is not installed here ({exc}): "
            f"pip install 'vllm=={SUPPORTED_VLLM[-1]}.*'"
        ) from None
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        _register_loader()
        _let_aot_load(version)
    finally:
        _record_startup(version, entered)
        _follow_versions()


def _follow_versions() -> None:
    """``PREHEAT_VLLM_FOLLOW``: the API server follows a refit name (``follow_app``), start-up timeline or not."""
    from preheat.integrations.vllm.startup_hooks import install_follow

    status = install_follow()
    if status not in ("installed", "not following"):
        log.error("preheat: PREHEAT_VLLM_FOLLOW is set but this vLLM cannot follow: %s", status)


def _let_aot_load(version: str) -> None:
    """vLLM loads back its saved AOT function on a CPU build too (``preheat.integrations.vllm.aot``); only on the
    versions whose loading path was read, and never at the cost of vLLM's start."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        return
    try:
        from preheat.integrations.vllm.aot import install

        install()
    except Exception as exc:  # vLLM then compiles again, as it would without preheat
        log.warning("preheat: vLLM's AOT load is left as it is in this process (%s: %s)", type(exc).__name__, exc)


def _record_startup(version: str, entered: float) -> None:
    try:
        from preheat.integrations.vllm.startup_hooks import install

        install(version, entered=entered)
    except Exception as exc:  # the start-up timeline observes vLLM: nothing in it may stop vLLM from starting
        log.warning("preheat: vLLM's start-up timeline is off in this process (%s: %s)", type(exc).__name__, exc)


def _register_loader() -> None:
    try:
        from vllm.model_executor.model_loader import register_model_loader

        from preheat.integrations.vllm.loader import PreheatModelLoader
    except ImportError as exc:
        supported = " and ".join(f"{v}.x" for v in SUPPORTED_VLLM)
        log.warning(
            "preheat: --load-format %s is unavailable in this vLLM (%s); it supports vLLM %s",
            LOAD_FORMAT,
            exc,
            supported,
        )
        return
    register_model_loader(LOAD_FORMAT)(PreheatModelLoader)
    _registered.add(LOAD_FORMAT)
