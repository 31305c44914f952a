"""The dtype vocabulary: one set of names and sizes for the format core, and its torch mapping beside it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from preheat.checkpoint import dtypes, torch_dtypes


def test_the_format_core_imports_without_torch() -> None:
    """Header, manifest and TP planning are pure: tools that only read checkpoints never pay for importing torch."""
    code = (
        "import sys, preheat.checkpoint.dtypes, preheat.checkpoint.safetensors, preheat.checkpoint.manifest, "
        "preheat.checkpoint.tp; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", dtypes.known_names())
def test_every_known_dtype_maps_to_torch_at_its_size_and_back(name: str) -> None:
    dtype = torch_dtypes.to_torch(name)
    assert dtype.itemsize == dtypes.itemsize(name)
    assert torch_dtypes.from_torch(dtype) == name


def test_every_torch_dtype_with_a_name_has_one_the_format_core_knows() -> None:
    names = set()
    for dtype in {value for value in vars(torch).values() if isinstance(value, torch.dtype)}:
        try:
            names.add(torch_dtypes.from_torch(dtype))
        except KeyError:
            continue  # safetensors cannot store it
    assert sorted(names) == dtypes.known_names()


def test_a_dtype_safetensors_cannot_store_has_no_name() -> None:
    assert not dtypes.is_known("F4")
    with pytest.raises(KeyError):
        torch_dtypes.from_torch(torch.complex64)
