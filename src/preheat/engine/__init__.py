"""The reference inference engine: Llama-family models in plain torch over zero-copy weights, with a KV cache laid
out in whole token chunks for the KV tiers. See docs/engine.md.

>>> from preheat.engine import Engine, SamplingParams                                  # doctest: +SKIP
>>> engine = Engine.from_checkpoint("path/to/model")                                    # doctest: +SKIP
>>> for step in engine.generate(engine.encode_prompt("Hello"), SamplingParams(temperature=0)):  # doctest: +SKIP
...     print(step.text, end="")

Importing this package imports nothing heavy: torch comes with the first of the names below (``Engine`` ...).
Tokenizer and chat template live in the torch-free ``preheat.text``, shared with the server and the router.
transformers is imported only by the fallback for other architectures, jinja2 when a chat template is first rendered
(or at ``warmup``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from preheat.engine.engine import Engine, GenerationStep
    from preheat.engine.kv import PagedKVCache, Sequence
    from preheat.engine.sampling import SamplingParams

__all__ = ["Engine", "GenerationStep", "PagedKVCache", "SamplingParams", "Sequence"]
_HOMES = {
    "Engine": "preheat.engine.engine",
    "GenerationStep": "preheat.engine.engine",
    "PagedKVCache": "preheat.engine.kv",
    "Sequence": "preheat.engine.kv",
    "SamplingParams": "preheat.engine.sampling",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'preheat.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
