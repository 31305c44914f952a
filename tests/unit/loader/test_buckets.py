"""The bucketed hand-off on the CPU: the same tensors as ``preheat.load`` at any bucket size, at most one bucket of
extra memory (measured), a bad digest stops the load before its bucket is handed over, and running out of memory
frees what was allocated and names the tensor."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors, write
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.errors import CheckpointError, ConfigError, DeviceError
from preheat.io.buffers import mapped_buffer
from preheat.loader.buckets import BucketReport, handoff_in_buckets

Handed = list[dict[str, torch.Tensor]]


class Engine:
    """A hand-off that copies, as an engine's weight loaders do: every call is one bucket, kept by name."""

    def __init__(self) -> None:
        self.calls: Handed = []

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        copied = {name: tensor.clone() for name, tensor in weights}
        self.calls.append(copied)
        return set(copied)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for call in self.calls:
            assert not set(call) & set(out), "a tensor was handed over twice"
            out |= call
        return out


def _sizes(written: WrittenCheckpoint) -> list[int]:
    return sorted(t.numel() * t.element_size() for t in written.tensors.values())


@pytest.fixture
def verified(tmp_path: Path) -> WrittenCheckpoint:
    """A three-file checkpoint with a ``preheat.json``, so every tensor is checked against its digest."""
    written = write(tmp_path / "model", shards=3, seed=4)
    (written.root / MANIFEST_NAME).write_bytes(build_manifest(str(written.root)).to_json())
    return written


def _bucket_sizes(written: WrittenCheckpoint) -> dict[str, int]:
    sizes = _sizes(written)
    return {"smaller-than-a-tensor": sizes[-1] // 3, "a-few-tensors": 3 * sizes[len(sizes) // 2], "whole": 1 << 30}


@pytest.mark.parametrize("size", ["smaller-than-a-tensor", "a-few-tensors", "whole"])
def test_buckets_hand_over_the_same_tensors_as_preheat_load(verified: WrittenCheckpoint, size: str) -> None:
    engine = Engine()
    report = handoff_in_buckets(verified.root, engine, bucket_bytes=_bucket_sizes(verified)[size])
    assert_same_tensors(engine.tensors, preheat.load(verified.root, mode="read"))
    assert_same_tensors(engine.tensors, verified.tensors)
    assert report.verified
    assert report.verified_tensors == len(verified.tensors)
    assert report.buckets == len(engine.calls)
    assert report.loaded == set(verified.tensors)  # the union of what every call returned
    if size == "whole":
        assert report.buckets == 1


@pytest.mark.parametrize("size", ["smaller-than-a-tensor", "a-few-tensors", "whole"])
def test_extra_memory_stays_within_one_bucket(verified: WrittenCheckpoint, size: str) -> None:
    bucket = _bucket_sizes(verified)[size]
    report = handoff_in_buckets(verified.root, Engine(), bucket_bytes=bucket)
    one = max(bucket, _sizes(verified)[-1]) if size != "whole" else verified.data_bytes
    assert 0 < report.peak_extra_bytes <= one + 64 * len(verified.tensors)  # alignment padding at most
    assert report.peak_extra_bytes == report.largest_bucket  # one bucket alive at a time, never two
    assert report.retained_bytes == 0


def test_a_hand_off_that_keeps_views_shows_in_the_peak(verified: WrittenCheckpoint) -> None:
    kept: list[torch.Tensor] = []

    def keeps(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        kept.extend(tensor for _, tensor in weights)  # views, not copies: their buckets cannot be freed

    bucket = _bucket_sizes(verified)["a-few-tensors"]
    report = handoff_in_buckets(verified.root, keeps, bucket_bytes=bucket)
    assert report.buckets > 2
    assert report.peak_extra_bytes > report.largest_bucket
    assert report.retained_bytes == report.peak_extra_bytes
    assert report.loaded is None  # the hand-off returned no names


def test_a_tensor_larger_than_a_bucket_gets_one_of_its_own_and_says_so(verified: WrittenCheckpoint) -> None:
    engine = Engine()
    bucket = _sizes(verified)[-1] - 1  # just too small for the largest tensor
    report = handoff_in_buckets(verified.root, engine, bucket_bytes=bucket)
    sizes = {name: t.numel() * t.element_size() for name, t in verified.tensors.items()}
    larger = [name for name, size in sizes.items() if size > bucket]
    assert larger  # the checkpoint has tensors both sides of the bucket size: both rules are exercised
    assert any(size <= bucket for size in sizes.values())
    for call in engine.calls:
        if any(sizes[name] > bucket for name in call):
            assert len(call) == 1  # alone in its bucket
        else:
            assert sum(sizes[name] for name in call) <= bucket
    assert report.buckets == len(engine.calls) < len(verified.tensors)  # the small ones were still packed
    assert any("cannot hold tensor" in note and "one tensor per bucket" in note for note in report.notes)
    assert report.peak_extra_bytes == report.largest_tensor == _sizes(verified)[-1]


def test_rank_slices_match_preheat_load(wide_checkpoint: WrittenCheckpoint) -> None:
    for rank in range(2):
        engine = Engine()
        report = handoff_in_buckets(wide_checkpoint.root, engine, bucket_bytes=1 << 20, rank=rank, world_size=2)
        assert_same_tensors(engine.tensors, preheat.load(wide_checkpoint.root, rank=rank, world_size=2, mode="read"))
        assert report.bytes < wide_checkpoint.data_bytes  # the rank's slices, not every tensor whole


def test_direct_reads_hand_over_the_same_tensors(verified: WrittenCheckpoint) -> None:
    engine = Engine()
    report = handoff_in_buckets(verified.root, engine, bucket_bytes=64 * 1024, mode="direct")
    assert_same_tensors(engine.tensors, verified.tensors)
    assert report.verified


def test_a_bad_digest_in_bucket_k_stops_before_bucket_k_is_handed_over(verified: WrittenCheckpoint) -> None:
    names = list(preheat.load(verified.root, mode="read"))  # file order: one tensor per bucket below
    bad = names[len(names) // 2]
    _flip_a_bit_of(verified.root, bad)
    engine = Engine()
    with pytest.raises(CheckpointError, match="does not match its digest") as raised:
        handoff_in_buckets(verified.root, engine, bucket_bytes=1)
    assert raised.value.tensor == bad
    assert [name for call in engine.calls for name in call] == names[: names.index(bad)]


def test_a_bad_digest_in_a_single_bucket_hands_nothing_over(verified: WrittenCheckpoint) -> None:
    _flip_a_bit_of(verified.root, next(iter(verified.tensors)))
    engine = Engine()
    with pytest.raises(CheckpointError):
        handoff_in_buckets(verified.root, engine, bucket_bytes=1 << 30)
    assert engine.calls == []


def test_out_of_memory_frees_what_was_allocated_and_names_the_tensor(verified: WrittenCheckpoint) -> None:
    allocated: list[Watch] = []

    def runs_out_at_the_third(nbytes: int, device: torch.device) -> torch.Tensor:
        if len(allocated) == 2:
            raise torch.OutOfMemoryError(f"simulated: no {nbytes} bytes left on {device}")
        buffer = mapped_buffer(nbytes)
        allocated.append(Watch(buffer))
        return buffer

    names = list(preheat.load(verified.root, mode="read"))
    engine = Engine()
    with pytest.raises(DeviceError, match="out of cpu memory") as raised:
        handoff_in_buckets(verified.root, engine, bucket_bytes=1, allocate=runs_out_at_the_third)
    needed = verified.tensors[names[2]].numel() * verified.tensors[names[2]].element_size()
    assert repr(names[2]) in str(raised.value)
    assert f"({needed} bytes)" in str(raised.value)
    assert len(engine.calls) == 2
    assert not any(watch.alive() for watch in allocated)


def test_a_failing_hand_off_frees_its_bucket(verified: WrittenCheckpoint) -> None:
    allocated: list[Watch] = []

    def tracked(nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = mapped_buffer(nbytes)
        allocated.append(Watch(buffer))
        return buffer

    def refuses(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("the engine refused a weight")

    with pytest.raises(RuntimeError, match="refused") as raised:
        handoff_in_buckets(verified.root, refuses, bucket_bytes=1 << 30, allocate=tracked)
    assert raised.value.__traceback__ is not None  # the traceback's frames are alive, and still hold no bucket
    assert len(allocated) == 1
    assert not allocated[0].alive()


def test_mmap_mode_is_refused(verified: WrittenCheckpoint) -> None:
    with pytest.raises(ConfigError, match="mmap"):
        handoff_in_buckets(verified.root, Engine(), mode="mmap")


def test_a_checkpoint_without_manifest_is_handed_over_unverified_saying_why(
    single_checkpoint: WrittenCheckpoint,
) -> None:
    engine = Engine()
    report = handoff_in_buckets(single_checkpoint.root, engine, bucket_bytes=64 * 1024)
    assert_same_tensors(engine.tensors, single_checkpoint.tensors)
    assert not report.verified
    assert any("preheat.json" in note for note in report.notes)


def test_report_is_json_ready(verified: WrittenCheckpoint) -> None:
    report = handoff_in_buckets(verified.root, Engine(), bucket_bytes=1 << 20)
    out = report.to_dict()
    assert "loaded" not in out
    assert out["buckets"] == report.buckets
    assert out["device_peak_bytes"] is None
    assert isinstance(report, BucketReport)


class Watch:
    """Whether a buffer's memory is still alive (any view of it keeps it so): a weak reference to its storage."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._ref = StorageWeakRef(buffer.untyped_storage())  # type: ignore[no-untyped-call]  # untyped in torch

    def alive(self) -> bool:
        return not self._ref.expired()  # type: ignore[no-untyped-call]  # untyped in torch


def _flip_a_bit_of(root: Path, name: str) -> None:
    """One bit of tensor ``name``'s last byte: the header still matches the manifest, the digest does not."""
    from preheat.checkpoint.layout import open_checkpoint

    for file, entry in open_checkpoint(str(root)).entries():
        if entry.name == name:
            raw = bytearray(Path(file.path).read_bytes())
            raw[entry.start + entry.nbytes - 1] ^= 0x40
            Path(file.path).write_bytes(bytes(raw))
            return
    raise AssertionError(f"no tensor {name!r}")


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2), (3, 4)])
def test_planned_buckets_cover_every_byte_of_every_tensor_once(
    wide_checkpoint: WrittenCheckpoint, rank: int, world_size: int
) -> None:
    from preheat.checkpoint.layout import open_checkpoint
    from preheat.loader.buckets import plan_buckets
    from preheat.loader.load import plan_file

    files = [
        plan_file(f, "auto", rank, world_size, align_base=1) for f in open_checkpoint(str(wide_checkpoint.root)).files
    ]
    placed = {t.name: t.nbytes for plan in files for t in plan.tensors}
    for bucket_bytes in (1, 100_000, 1 << 30):
        plan = plan_buckets(files, bucket_bytes)
        seen = []
        for bucket in plan.buckets:
            assert bucket.nbytes <= max(bucket_bytes, plan.largest_tensor) or len(bucket.tensors) == 1
            for tensor in bucket.tensors:
                seen.append(tensor.name)
                assert tensor.offset % 64 == 0
                assert tensor.offset + tensor.nbytes <= bucket.nbytes
                covered = sorted((e.dest_offset, e.length) for e in tensor.extents)
                assert sum(length for _, length in covered) == tensor.nbytes == placed[tensor.name]
                cursor = 0
                for offset, length in covered:  # contiguous from 0: no byte twice, none left out
                    assert offset == cursor
                    cursor += length
        assert seen == list(placed)  # every tensor once, in file order
