"""Weight-only int8/fp8 quantization: the math, the stored checkpoint, loading with and without dequantize, and the
quality check on the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import preheat
from checkpoints import WrittenCheckpoint, same_bytes, write
from predictions import Predictor, agreement
from preheat.checkpoint.layout import read_manifest
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest, QuantInfo, build_manifest
from preheat.checkpoint.quant import GROUP, dequantize, is_quantizable, quantize, quantize_with
from preheat.checkpoint.safetensors import TensorEntry
from preheat.checkpoint.tp import rank_slice
from preheat.checkpoint.writer import save_file
from preheat.convert import convert
from preheat.core.errors import CheckpointError
from preheat.testing.smollm2 import SmolLM2
from preheat.testing.synthetic import LlamaShape

LINEAR = "model.layers.0.mlp.down_proj.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def scale_shape(method: str, out: int, cols: int) -> tuple[int, ...]:
    """The shape of a weight's scales: one per row (int8), or per row and GROUP input columns (fp8)."""
    return (out,) if method == "int8" else (out, cols // GROUP)


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
@given(
    rows=st.integers(1, 8),
    groups=st.integers(1, 4),
    magnitude=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_fp8_keeps_three_mantissa_bits_per_group_of_32(rows: int, groups: int, magnitude: float, seed: int) -> None:
    weight = torch.randn(rows, groups * GROUP, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, scale = quantize(LINEAR, weight, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    assert scale.dtype == torch.float32
    assert scale.shape == (rows, groups)
    restored = dequantize(q, scale, torch.float32)
    # Relative error of a normal e4m3 value is at most 2**-4; tiny values fall in the subnormal range instead.
    per_element = scale.repeat_interleave(GROUP, dim=1)
    bound = torch.maximum(weight.abs() * 2**-4, per_element * 2**-9)
    assert bool(((restored - weight).abs() <= bound * (1 + 1e-5)).all())


def test_an_fp8_outlier_sets_the_scale_of_its_own_group_only() -> None:
    weight = torch.ones(2, 3 * GROUP)
    weight[0, GROUP + 5] = -100.0
    _, scale = quantize(LINEAR, weight, "fp8")
    assert torch.equal(scale, torch.tensor([[1.0, 100.0, 1.0], [1.0, 1.0, 1.0]]) / 448)


def test_a_row_or_group_of_zeros_quantizes_to_zeros() -> None:
    weight = torch.zeros(3, 2 * GROUP)
    weight[1] = torch.arange(2.0 * GROUP)
    weight[2, GROUP:] = 1.0
    for method in ("int8", "fp8"):
        q, scale = quantize(LINEAR, weight, method)
        restored = dequantize(q, scale, torch.float32)
        assert bool((scale[0] == 1.0).all())
        assert torch.equal(restored[0], torch.zeros(2 * GROUP))
        assert torch.equal(restored[2, :GROUP], torch.zeros(GROUP))
    assert torch.equal(quantize(LINEAR, weight, "fp8")[1][2], torch.tensor([1.0, 1 / 448]))


def test_fp8_refuses_a_weight_whose_input_columns_are_not_whole_groups() -> None:
    weight = torch.randn(4, GROUP + 16)
    with pytest.raises(CheckpointError, match=r"48 input columns, not a multiple of 32.*--dtype int8") as caught:
        quantize(LINEAR, weight, "fp8")
    assert caught.value.tensor == LINEAR
    assert quantize(LINEAR, weight, "int8")[1].shape == (4,)  # one scale per row: any width


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_an_fp8_tp_slice_quantized_alone_is_bit_identical_to_the_slice_of_the_whole(dim: int, world_size: int) -> None:
    weight = torch.randn(16, 8 * GROUP, generator=torch.Generator().manual_seed(dim)).to(torch.bfloat16)
    weight[3, 5] = 40.0  # an outlier: a per-row scale would differ between the whole row and a slice without it
    q, scale = quantize(LINEAR, weight, "fp8")
    size = weight.shape[dim] // world_size
    for rank in range(world_size):
        part_q, part_scale = quantize(LINEAR, weight.narrow(dim, rank * size, size), "fp8")
        assert same_bytes(part_q, q.narrow(dim, rank * size, size))
        scale_size = size if dim == 0 else size // GROUP
        assert same_bytes(part_scale, scale.narrow(dim, rank * scale_size, scale_size))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_column_slice_quantized_with_its_scales_is_bit_identical(method: str) -> None:
    """What the converter does for a row-parallel weight: int8 slices use the whole rows' scales, fp8 their groups'."""
    weight = torch.randn(8, 4 * GROUP, generator=torch.Generator().manual_seed(1))
    q, scale = quantize(O_PROJ, weight, method)
    for lo in (0, 2 * GROUP):
        part = weight[:, lo : lo + 2 * GROUP]
        part_scale = scale if method == "int8" else scale[:, lo // GROUP : lo // GROUP + 2]
        assert same_bytes(quantize_with(part, part_scale, method), q[:, lo : lo + 2 * GROUP])


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
            group = GROUP if method == "fp8" else None
            assert (info.method, info.scale, info.compute_dtype, info.group) == (method, f"{name}.scale", "BF16", group)
            assert raw[name].dtype == stored
            assert raw[f"{name}.scale"].dtype == torch.float32
            assert raw[f"{name}.scale"].shape == scale_shape(method, *tensor.shape)
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


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("presharded", [True, False])
def test_tp_ranks_dequantize_to_slices_of_the_whole(tmp_path: Path, presharded: bool, method: str) -> None:
    source = write(tmp_path / "src").root
    convert(source, tmp_path / "q", dtype=method)
    whole = preheat.load(tmp_path / "q", dequantize=True)
    if presharded:
        convert(source, tmp_path / "q2", dtype=method, tp=2)
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


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_presharded_ranks_hold_the_bytes_the_loader_slices(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path, method: str
) -> None:
    """Each rank's slice quantized alone is bit-identical to its slice of the whole weight quantized at once."""
    convert(single_checkpoint.root, tmp_path / "q", dtype=method)
    convert(single_checkpoint.root, tmp_path / "q2", dtype=method, tp=2)
    for rank in (0, 1):
        sliced = preheat.load(tmp_path / "q", rank=rank, world_size=2)
        presharded = preheat.load(tmp_path / "q2", rank=rank, world_size=2)
        assert sorted(presharded) == sorted(sliced)
        for name, tensor in sliced.items():
            assert same_bytes(presharded[name], tensor), name


@pytest.fixture(scope="module")
def tp2_manifests(
    single_checkpoint: WrittenCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Manifest]:
    """The manifests of ``--tp 2`` conversions of the tiny model, by method."""
    manifests = {}
    for method in ("int8", "fp8"):
        out = tmp_path_factory.mktemp(method) / "q2"
        convert(single_checkpoint.root, out, dtype=method, tp=2)
        manifests[method] = Manifest.from_json((out / MANIFEST_NAME).read_bytes(), where=str(out))
    return manifests


@pytest.mark.parametrize(
    ("method", "name", "dim", "shape"),
    [
        ("fp8", O_PROJ, 1, (64, 1)),  # 64 input columns: 32 per rank, one group
        ("fp8", LINEAR, 1, (64, 2)),  # down_proj: 128 input columns, 64 per rank
        ("fp8", "model.layers.0.mlp.up_proj.weight", 0, (64, 2)),  # column-parallel: rows split, groups whole
        ("int8", O_PROJ, None, (64,)),  # per-row scales span every column: each rank needs them all
        ("int8", "model.layers.0.mlp.up_proj.weight", 0, (64,)),
    ],
)
def test_a_scale_follows_its_weights_split(
    tp2_manifests: dict[str, Manifest], method: str, name: str, dim: int | None, shape: tuple[int, ...]
) -> None:
    records = [t for t in tp2_manifests[method].tensors if t.name == f"{name}.scale"]
    assert len(records) == 2  # one per rank
    for record in records:
        assert record.tp is not None
        assert (record.tp.dim, record.shape) == (dim, shape)


def test_fp8_tp_that_would_split_a_group_is_refused_naming_the_weight(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    # o_proj has 64 input columns: 16 per rank over 4 ranks, half a group each.
    with pytest.raises(CheckpointError, match=r"64 input columns: split over 4 ranks.*multiple of 32") as caught:
        convert(single_checkpoint.root, tmp_path / "q4", dtype="fp8", tp=4)
    assert caught.value.tensor == O_PROJ
    assert not (tmp_path / "q4").exists()
    convert(single_checkpoint.root, tmp_path / "q4", dtype="int8", tp=4)  # per-row scales split anywhere


def test_loading_fp8_on_ranks_that_would_split_a_group_is_refused(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    convert(single_checkpoint.root, tmp_path / "q", dtype="fp8")
    with pytest.raises(CheckpointError, match="whole quantization groups") as caught:
        preheat.load(tmp_path / "q", rank=0, world_size=4)
    assert caught.value.tensor == f"{O_PROJ}.scale"


def test_fp8_conversion_refuses_a_model_with_partial_groups(tmp_path: Path) -> None:
    source = write(tmp_path / "src", LlamaShape(hidden_size=64, intermediate_size=80, num_hidden_layers=1)).root
    with pytest.raises(CheckpointError, match="80 input columns, not a multiple of 32") as caught:
        convert(source, tmp_path / "fp8", dtype="fp8")
    assert caught.value.tensor == LINEAR  # down_proj: the only weight with 80 input columns
    assert not (tmp_path / "fp8").exists()
    convert(source, tmp_path / "int8", dtype="int8")


def test_a_custom_tp_plan_that_splits_a_weight_but_not_its_group_scale_is_refused(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    convert(single_checkpoint.root, tmp_path / "q", dtype="fp8")
    with pytest.raises(CheckpointError, match="split the scale like the weight") as caught:
        preheat.load(tmp_path / "q", rank=0, world_size=2, tp_plan={O_PROJ: 1}, dequantize=True)
    assert caught.value.tensor == O_PROJ


@pytest.fixture(scope="module")
def fp8_manifest(single_checkpoint: WrittenCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("fp8") / "q"
    convert(single_checkpoint.root, out, dtype="fp8")
    return (out / MANIFEST_NAME).read_bytes()


def test_the_manifest_records_a_group_only_for_grouped_scales(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path, fp8_manifest: bytes
) -> None:
    convert(single_checkpoint.root, tmp_path / "int8", dtype="int8")
    int8 = [t["quant"] for t in json.loads((tmp_path / "int8" / MANIFEST_NAME).read_bytes())["tensors"] if t["quant"]]
    fp8 = [t["quant"] for t in json.loads(fp8_manifest)["tensors"] if t["quant"]]
    assert int8
    assert all("group" not in q for q in int8)  # so int8 manifests written before groups keep their identity
    assert fp8
    assert all(q["group"] == GROUP for q in fp8)


@pytest.mark.parametrize("group", [0, -32, "32", True, 1.5, None])
def test_an_invalid_group_is_refused_naming_the_manifest(fp8_manifest: bytes, group: object) -> None:
    doc = json.loads(fp8_manifest)
    del doc["identity"]
    next(t for t in doc["tensors"] if t["quant"])["quant"]["group"] = group
    with pytest.raises(CheckpointError, match=r"quant\.group") as caught:
        Manifest.from_json(json.dumps(doc).encode(), where="m/preheat.json")
    assert caught.value.path == "m/preheat.json"


def test_an_fp8_checkpoint_without_group_has_per_row_scales(tmp_path: Path) -> None:
    """Checkpoints written before grouped scales (``quant`` without ``group``, scale ``[out]``) still dequantize."""
    weight = torch.randn(4, 48, generator=torch.Generator().manual_seed(0))
    scale = weight.abs().amax(dim=1) / 448
    q = quantize_with(weight, scale, "fp8")
    save_file({LINEAR: q, f"{LINEAR}.scale": scale}, str(tmp_path / "model.safetensors"), {"format": "pt"})
    manifest = build_manifest(str(tmp_path), quant={LINEAR: QuantInfo("fp8", f"{LINEAR}.scale", "F32")})
    (tmp_path / MANIFEST_NAME).write_bytes(manifest.to_json())
    assert "group" not in json.loads(manifest.to_json())["tensors"][0]["quant"]
    assert manifest.tensors[0].quant == QuantInfo("fp8", f"{LINEAR}.scale", "F32", None)
    restored = preheat.load(tmp_path, dequantize=True)
    assert sorted(restored) == [LINEAR]
    assert torch.equal(restored[LINEAR], q.float() * scale[:, None])


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
    every position of every prompt (316 predictions) and after each whole prompt (41). Measured: 97.8% / 97.6%."""
    last, every = smollm2_agreement("int8")
    assert min(last, every) >= 0.95, f"int8: {last:.1%} of prompts, {every:.1%} of positions agree"


@pytest.mark.slow
def test_smollm2_fp8_keeps_95_percent_of_greedy_next_tokens(smollm2_agreement: Agreement) -> None:
    """Greedy top-1 next-token agreement with the unquantized model at every position of every prompt of
    tests/data/prompts.txt (316 predictions), with one scale per row and group of 32 inputs. Measured: 96.8%.

    The target is asserted on all positions: after each whole prompt only (41 predictions) it measured 95.1%, two
    misses, so one near-tied token flipping by a rounding difference would swing it by 2.4 points."""
    last, every = smollm2_agreement("fp8")
    assert every >= 0.95, f"fp8: {last:.1%} of prompts, {every:.1%} of positions agree"
