"""``preheat convert``: Hugging Face / safetensors / preheat / GGUF in, a verified preheat checkpoint out.

It sits above the loader, not in ``checkpoint/``: a preheat or safetensors input is read with ``preheat.load``
(dequantized, from any source), while ``checkpoint/`` is the formats the loader itself is built on. ``inputs.py``
reads the input into memory; ``pipeline.py`` plans, writes, verifies and publishes the output.
"""

from preheat.convert.pipeline import convert

__all__ = ["convert"]
