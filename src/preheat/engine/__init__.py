"""The reference inference engine: Llama-family models in plain torch over zero-copy weights, with a KV cache laid
out in whole token chunks for the KV tiers. See docs/engine.md.

>>> from preheat.engine import Engine, SamplingParams                                  # doctest: +SKIP
>>> engine = Engine.from_checkpoint("path/to/model")                                    # doctest: +SKIP
>>> for step in engine.generate(engine.encode_prompt("Hello"), SamplingParams(temperature=0)):  # doctest: +SKIP
...     print(step.text, end="")

Importing this package does not import transformers (only the fallback for other architectures does) nor jinja2
(imported when a chat template is first rendered, or at ``warmup``).
"""

from preheat.engine.engine import Engine, GenerationStep
from preheat.engine.kv import KVLayout, PagedKVCache, Sequence
from preheat.engine.sampling import SamplingParams

__all__ = ["Engine", "GenerationStep", "KVLayout", "PagedKVCache", "SamplingParams", "Sequence"]
