"""The safetensors dtype vocabulary: names and bytes per element. Pure and torch-free, so the format core (headers,
manifests, TP plans) and the tools around it load without torch; ``torch_dtypes`` maps the names to torch.

    >>> itemsize("BF16"), is_known("F4")
    (2, False)
"""

from __future__ import annotations

# safetensors name -> bytes per element. Only dtypes torch can hold are listed (``torch_dtypes`` has the same
# names); anything else in a header is reported as unknown rather than silently misread.
_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def is_known(name: str) -> bool:
    """True when ``name`` is a safetensors dtype preheat can load."""
    return name in _ITEMSIZE


def itemsize(name: str) -> int:
    """Bytes per element of the safetensors dtype ``name``."""
    return _ITEMSIZE[name]


def known_names() -> list[str]:
    """All dtype names preheat understands, for error messages."""
    return sorted(_ITEMSIZE)
