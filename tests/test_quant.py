"""Weight-only int8/fp8 quantization: the math, the stored checkpoint, loading with and without dequantize, and the
quality check on the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import preheat
from conftest import WrittenCheckpoint, write
from preheat.checkpoint.convert import convert
from preheat.checkpoint.layout import read_manifest
from preheat.checkpoint.quant import dequantize, is_quantizable, quantize
from preheat.checkpoint.safetensors import TensorEntry
from preheat.checkpoint.tp import rank_slice
from preheat.errors import CheckpointError
from smollm2 import Predictor, SmolLM2, agreement

LINEAR = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("model.layers.3.self_attn.q_proj.weight", (8, 8), True),
        ("model.layers.3.mlp.down_proj.weight", (8, 16), True),
        ("model.embed_tokens.weight", (100, 8), False),
        ("lm_head.weight", (100, 8), False),
        ("model.layers.3.input_layernorm.weight", (8,), False),
        ("model.norm.weight", (8,), False),
        ("model.layers.3.self_attn.q_proj.bias", (8,), False),
    ],
)
def test_only_linear_projection_weights_are_quantized(name: str, shape: tuple[int, ...], expected: bool) -> None:
    assert is_quantizable(name, shape, torch.bfloat16) is expected


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), cols=st.integers(1, 40), magnitude=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_int8_error_is_at_most_half_a_step_per_row(rows: int, cols: int, magnitude: float, seed: int) -> None:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, scale = quantize(LINEAR, weight, "int8")
    assert q.dtype == torch.int8
    assert scale.dtype == torch.float32
    assert scale.shape == (rows,)
    assert int(q.abs().max()) <= 127
    error = (dequantize(q, scale, torch.float32) - weight).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_fp8_keeps_three_mantissa_bits_per_row(rows: int, cols: int, seed: int) -> None:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize(LINEAR, weight, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    restored = dequantize(q, scale, torch.float32)
    # Relative error of a normal e4m3 value is at most 2**-4; tiny values fall in the subnormal range instead.
    bound = torch.maximum(weight.abs() * 2**-4, scale[:, None] * 2**-9)
    assert bool(((restored - weight).abs() <= bound * (1 + 1e-5)).all())


def test_a_row_of_zeros_quantizes_to_zeros() -> None:
    weight = torch.zeros(3, 4)
    weight[1] = torch.arange(4.0)
    for method in ("int8", "fp8"):
        q, scale = quantize(LINEAR, weight, method)
        assert scale[0] == 1.0
        assert torch.equal(dequantize(q, scale, torch.float32)[0], torch.zeros(4))


def test_non_finite_weights_are_refused_naming_the_tensor() -> None:
    weight = torch.ones(2, 2)
    weight[0, 1] = float("nan")
    with pytest.raises(CheckpointError, match="NaN") as caught:
        quantize(LINEAR, weight, "int8")
    assert caught.value.tensor == LINEAR


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_checkpoint_stores_weights_and_f32_scales(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path, method: str
) -> None:
    out = tmp_path / method
    convert(single_checkpoint.root, out, dtype=method)
    manifest = read_manifest(str(out))
    assert manifest is not None
    records = {t.name: t for t in manifest.tensors}
    raw = preheat.load(out)
    stored = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[method]
    for name, tensor in single_checkpoint.tensors.items():
        info = records[name].quant
        if is_quantizable(name, tuple(tensor.shape), tensor.dtype):
            assert info is not None
            assert (info.method, info.scale, info.compute_dtype) == (method, f"{name}.scale", "BF16")
            assert raw[name].dtype == stored
            assert raw[f"{name}.scale"].dtype == torch.float32
            assert raw[f"{name}.scale"].shape == (tensor.shape[0],)
        else:
            assert info is None
            assert torch.equal(raw[name], tensor)  # embeddings, norms, lm_head: untouched


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_dequantize_restores_the_compute_dtype(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path, method: str
) -> None:
    out = tmp_path / method
    convert(single_checkpoint.root, out, dtype=method)
    restored = preheat.load(out, dequantize=True)
    assert sorted(restored) == sorted(single_checkpoint.tensors)
    for name, tensor in single_checkpoint.tensors.items():
        assert restored[name].dtype == torch.bfloat16
        tolerance = 0.01 if method == "int8" else 0.07
        assert torch.allclose(restored[name].float(), tensor.float(), atol=tolerance * float(tensor.abs().max()))


def test_dequantize_is_a_no_op_for_unquantized_checkpoints(single_checkpoint: WrittenCheckpoint) -> None:
    assert sorted(preheat.load(single_checkpoint.root, dequantize=True)) == sorted(single_checkpoint.tensors)


@pytest.mark.parametrize("presharded", [True, False])
def test_tp_ranks_dequantize_to_slices_of_the_whole(tmp_path: Path, presharded: bool) -> None:
    source = write(tmp_path / "src").root
    convert(source, tmp_path / "q", dtype="int8")
    whole = preheat.load(tmp_path / "q", dequantize=True)
    if presharded:
        convert(source, tmp_path / "q2", dtype="int8", tp=2)
    target = tmp_path / ("q2" if presharded else "q")
    for rank in (0, 1):
        part = preheat.load(target, rank=rank, world_size=2, dequantize=True)
        assert sorted(part) == sorted(whole)
        for name, tensor in part.items():
            full = whole[name]
            entry = TensorEntry(name, "BF16", tuple(full.shape), 0, full.numel() * 2)
            piece = rank_slice(entry, "auto", rank, 2, path="x")
            want = full if piece.dim is None else full.narrow(piece.dim, piece.start, piece.shape[piece.dim])
            assert torch.equal(tensor, want), name


class Agreement:
    """Greedy predictions of SmolLM2 per dtype, computed once per module (one model skeleton, batched prompts)."""

    def __init__(self, smollm2: SmolLM2) -> None:
        self.smollm2 = smollm2
        self.predictor = Predictor(smollm2.path("keep"))
        self.reference = self.predictor.predict(smollm2.path("keep"))
        self._cache: dict[str, tuple[float, float]] = {}

    def __call__(self, method: str) -> tuple[float, float]:
        """(share of prompts, share of all positions) whose greedy next token matches the unquantized model."""
        if method not in self._cache:
            self._cache[method] = agreement(self.reference, self.predictor.predict(self.smollm2.path(method)))
        return self._cache[method]


@pytest.fixture(scope="module")
def smollm2_agreement(smollm2: SmolLM2) -> Agreement:
    return Agreement(smollm2)


@pytest.mark.slow
def test_smollm2_int8_keeps_95_percent_of_greedy_next_tokens(smollm2_agreement: Agreement) -> None:
    """Greedy top-1 next-token agreement with the unquantized model over tests/data/prompts.txt, teacher-forced at
    every prompt position (~630 predictions) and after each whole prompt (41)."""
    last, every = smollm2_agreement("int8")
    assert min(last, every) >= 0.95, f"int8: {last:.1%} of prompts, {every:.1%} of positions agree"


@pytest.mark.slow
def test_smollm2_fp8_stays_near_its_measured_agreement(smollm2_agreement: Agreement) -> None:
    # Measured: 87.8% of prompts, 90.8% of positions. Three mantissa bits with one scale per output row cannot
    # reach the 95% on this model (docs/checkpoint-format.md); this guards against regressions while the
    # xfail below keeps the gap visible.
    last, every = smollm2_agreement("fp8")
    assert every >= 0.85, f"fp8: {last:.1%} of prompts, {every:.1%} of positions agree"


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="fp8 weight-only with per-output-channel scales agrees on ~91% of positions on SmolLM2-135M, below the "
    "issue's 95% target; per-group scales (32 inputs) measured 96.8% (see docs/checkpoint-format.md)",
)
def test_smollm2_fp8_meets_the_95_percent_target(smollm2_agreement: Agreement) -> None:
    last, every = smollm2_agreement("fp8")
    assert min(last, every) >= 0.95, f"fp8: {last:.1%} of prompts, {every:.1%} of positions agree"
