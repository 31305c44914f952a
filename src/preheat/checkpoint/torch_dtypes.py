"""safetensors dtype names (``dtypes``) <-> torch dtypes, for the code that builds or describes tensors."""

from __future__ import annotations

import torch

# The names are ``dtypes``'s, one for one (tests/integration/checkpoint/test_dtypes.py checks names and sizes agree).
_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_FROM_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in _TO_TORCH.items()}


def to_torch(name: str) -> torch.dtype:
    """The torch dtype for the safetensors dtype ``name`` (``dtypes.is_known(name)``; KeyError otherwise)."""
    return _TO_TORCH[name]


def from_torch(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (raises KeyError for dtypes safetensors cannot store)."""
    return _FROM_TORCH[dtype]
