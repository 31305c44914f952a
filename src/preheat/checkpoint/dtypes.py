"""The safetensors dtype vocabulary and its torch equivalents."""

from __future__ import annotations

import torch

# safetensors name -> (torch dtype, bytes per element). Only dtypes torch can hold are listed; anything else in a
# header is reported as unknown rather than silently misread.
_TABLE: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
_FOR_TORCH: dict[torch.dtype, str] = {dtype: name for name, (dtype, _) in _TABLE.items()}


def is_known(name: str) -> bool:
    """True when ``name`` is a safetensors dtype preheat can load."""
    return name in _TABLE


def itemsize(name: str) -> int:
    """Bytes per element of the safetensors dtype ``name``."""
    return _TABLE[name][1]


def to_torch(name: str) -> torch.dtype:
    """The torch dtype for the safetensors dtype ``name``."""
    return _TABLE[name][0]


def from_torch(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (raises KeyError for dtypes safetensors cannot store)."""
    return _FOR_TORCH[dtype]


def known_names() -> list[str]:
    """All dtype names preheat understands, for error messages."""
    return sorted(_TABLE)
