"""The bucketed hand-off into CUDA memory: buckets filled on the device (the pinned staging pipeline, or GDS), the
same tensors as ``preheat.load``, the extra device memory within one bucket (``torch.cuda.max_memory_allocated``),
a bad digest stopping the load before its bucket, and running out of device memory freeing what was allocated.
Skipped without a GPU; scripts/device_check.sh runs them on a lent one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors, write
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.errors import CheckpointError, DeviceError
from preheat.loader.buckets import handoff_in_buckets
from preheat.testing.synthetic import LlamaShape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = LlamaShape(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2)


class DeviceEngine:
    """Copies each bucket's tensors into its own device tensors, as an engine's parameters would be filled."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        copied = {}
        for name, tensor in weights:
            assert tensor.device.type == "cuda", name  # handed over on the device: the copy is device-to-device
            copied[name] = tensor.clone()
        self.calls.append(copied)
        return set(copied)

    def on_cpu(self) -> dict[str, torch.Tensor]:
        return {name: t.cpu() for call in self.calls for name, t in call.items()}


@pytest.fixture
def verified(tmp_path: Path) -> WrittenCheckpoint:
    written = write(tmp_path / "model", SHAPE, shards=2, seed=5)
    (written.root / MANIFEST_NAME).write_bytes(build_manifest(str(written.root)).to_json())
    return written


def _largest(written: WrittenCheckpoint) -> int:
    return max(t.numel() * t.element_size() for t in written.tensors.values())


@pytest.mark.parametrize("mode", ["auto", "read", "direct"])
@pytest.mark.parametrize("scale", [0.5, 3, 1000])
def test_device_buckets_hand_over_the_same_tensors(verified: WrittenCheckpoint, mode: str, scale: float) -> None:
    bucket = int(_largest(verified) * scale)
    engine = DeviceEngine()
    report = handoff_in_buckets(verified.root, engine, device="cuda", bucket_bytes=bucket, mode=mode, threads=3)
    assert_same_tensors(engine.on_cpu(), verified.tensors)
    assert report.device_peak_bytes is not None
    copies = report.bytes  # the engine's clones are the only other device allocations of the load
    assert report.device_peak_bytes <= copies + max(bucket, _largest(verified)) + 64 * report.tensors + (2 << 20)
    assert report.peak_extra_bytes == report.largest_bucket
    assert report.verified == (report.mode != "gds")


def test_device_bucket_peak_is_one_bucket_when_the_engine_copies_in_place(verified: WrittenCheckpoint) -> None:
    """Parameters allocated before the load (as an engine's are) and filled in place: the load's own peak is the
    bucket, not the model."""
    params = {name: torch.empty_like(t, device="cuda") for name, t in verified.tensors.items()}

    def copy_in(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            params[name].copy_(tensor)

    bucket = 2 * _largest(verified)
    report = handoff_in_buckets(verified.root, copy_in, device="cuda", bucket_bytes=bucket)
    assert report.buckets > 1
    assert report.device_peak_bytes is not None
    assert report.device_peak_bytes <= report.largest_bucket + (2 << 20)
    assert_same_tensors({n: t.cpu() for n, t in params.items()}, verified.tensors)


def test_device_bad_digest_stops_before_its_bucket(verified: WrittenCheckpoint) -> None:
    from preheat.checkpoint.layout import open_checkpoint

    names = list(preheat.load(verified.root, mode="read"))
    bad = names[len(names) // 2]
    for file, entry in open_checkpoint(str(verified.root)).entries():
        if entry.name == bad:
            raw = bytearray(Path(file.path).read_bytes())
            raw[entry.start] ^= 0x01
            Path(file.path).write_bytes(bytes(raw))
    engine = DeviceEngine()
    with pytest.raises(CheckpointError):
        handoff_in_buckets(verified.root, engine, device="cuda", bucket_bytes=1, verify=True)
    assert [n for call in engine.calls for n in call] == names[: names.index(bad)]


def test_device_out_of_memory_names_the_tensor_and_frees(verified: WrittenCheckpoint) -> None:
    names = list(preheat.load(verified.root, mode="read"))
    calls = []

    def runs_out(nbytes: int, device: torch.device) -> torch.Tensor:
        calls.append(nbytes)
        if len(calls) == 2:
            # A real device allocation failure: more bytes than the device has.
            too_much = torch.cuda.get_device_properties(device).total_memory * 2
            return torch.empty(too_much, dtype=torch.uint8, device=device)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    handed: list[str] = []

    def names_only(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        handed.extend(name for name, _ in weights)  # keeps nothing on the device

    before = torch.cuda.memory_allocated()
    with pytest.raises(DeviceError, match="out of cuda") as raised:
        handoff_in_buckets(verified.root, names_only, device="cuda", bucket_bytes=1, allocate=runs_out)
    assert repr(names[1]) in str(raised.value)
    assert handed == names[:1]
    assert torch.cuda.memory_allocated() <= before  # the first bucket was freed, the second never allocated
