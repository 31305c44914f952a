"""``preheat.load`` on the CPU: every mode returns exactly the tensors that were written, with an honest report."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors, same_bytes, write
from preheat.checkpoint.writer import save_file
from preheat.core.errors import ConfigError, DeviceError

CPU_MODES = ["mmap", "read", "direct", "auto"]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_single_file_checkpoint_loads_exactly(single_checkpoint: WrittenCheckpoint, mode: str) -> None:
    result = preheat.load(single_checkpoint.root, mode=mode)
    assert_same_tensors(result, single_checkpoint.tensors)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_sharded_checkpoint_with_index_loads_exactly(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    result = preheat.load(sharded_checkpoint.root, mode=mode)
    assert_same_tensors(result, sharded_checkpoint.tensors)
    assert result.report.files == 3


@pytest.mark.parametrize("mode", CPU_MODES)
def test_bare_safetensors_file_path_loads_exactly(single_checkpoint: WrittenCheckpoint, mode: str) -> None:
    result = preheat.load(single_checkpoint.single_file, mode=mode)
    assert_same_tensors(result, single_checkpoint.tensors)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_directory_of_shards_without_index_loads_exactly(unindexed_checkpoint: WrittenCheckpoint, mode: str) -> None:
    result = preheat.load(unindexed_checkpoint.root, mode=mode)
    assert_same_tensors(result, unindexed_checkpoint.tensors)
    assert result.report.files == 2


@pytest.mark.parametrize("mode", CPU_MODES)
def test_load_agrees_with_the_reference_reader(single_checkpoint: WrittenCheckpoint, mode: str) -> None:
    reference = load_file(single_checkpoint.single_file)
    assert_same_tensors(preheat.load(single_checkpoint.single_file, mode=mode), reference)


@pytest.mark.parametrize("mode", ["mmap", "read", "direct"])
def test_a_kept_tensor_outlives_the_result_dict(single_checkpoint: WrittenCheckpoint, mode: str) -> None:
    result = preheat.load(single_checkpoint.root, mode=mode)
    kept = result["model.layers.1.mlp.down_proj.weight"]
    del result
    gc.collect()
    # Reuse freed memory, so a tensor pointing into a released buffer would show someone else's bytes.
    scribble = [torch.full((64 * 1024,), 3.0) for _ in range(16)]
    assert same_bytes(kept, single_checkpoint.tensors["model.layers.1.mlp.down_proj.weight"])
    del scribble


def test_writing_to_an_mmap_tensor_leaves_the_file_untouched(fresh_checkpoint: WrittenCheckpoint) -> None:
    before = fresh_checkpoint.single_file.read_bytes()
    result = preheat.load(fresh_checkpoint.root, mode="mmap")
    result["lm_head.weight"].fill_(7.0)
    result["model.norm.weight"].zero_()
    assert bool((result["lm_head.weight"] == 7.0).all())
    del result
    gc.collect()
    assert fresh_checkpoint.single_file.read_bytes() == before
    assert_same_tensors(preheat.load(fresh_checkpoint.root, mode="mmap"), fresh_checkpoint.tensors)


@pytest.mark.parametrize("mode", ["mmap", "read", "direct"])
def test_report_describes_the_load(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    report = preheat.load(sharded_checkpoint.root, mode=mode).report
    assert report.mode == mode
    assert report.device == "cpu"
    assert (report.rank, report.world_size) == (0, 1)
    assert report.files == 3
    assert report.tensors == len(sharded_checkpoint.tensors)
    assert report.bytes == sharded_checkpoint.data_bytes
    assert report.stages
    assert "plan" in report.stages
    assert all(seconds >= 0 for seconds in report.stages.values())
    assert report.gbps > 0
    if mode != "mmap":  # mapping reads lazily, with no threads of its own
        assert report.threads >= 1
        assert report.chunk_bytes >= 4096
        assert report.tuning
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["bytes"] == report.bytes
    assert as_json["gbps"] == pytest.approx(report.gbps)
    assert f"loaded {report.tensors} tensors" in report.summary()


def test_read_report_counts_every_byte_read_from_disk(single_checkpoint: WrittenCheckpoint) -> None:
    report = preheat.load(single_checkpoint.root, mode="read").report
    assert report.bytes_read == single_checkpoint.data_bytes
    assert {"plan", "allocate", "read", "views"} <= set(report.stages)


@pytest.mark.parametrize("mode", ["read", "direct"])
def test_progress_callback_reaches_the_total(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    calls: list[tuple[int, int]] = []
    preheat.load(sharded_checkpoint.root, mode=mode, chunk_bytes=16 * 1024, progress=lambda d, t: calls.append((d, t)))
    # The total is the bytes to read: the tensor bytes, plus (direct mode) the header bytes below each file's first
    # tensor that fall in the first O_DIRECT page.
    (total,) = {t for _, t in calls}
    files = len(list(sharded_checkpoint.root.glob("*.safetensors")))
    assert sharded_checkpoint.data_bytes <= total < sharded_checkpoint.data_bytes + 4096 * files
    assert len(calls) > 1
    assert all(0 < done <= total for done, _ in calls)
    assert max(done for done, _ in calls) == total


@pytest.mark.parametrize("mode", ["read", "direct"])
def test_one_thread_and_tiny_chunks_give_identical_tensors(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    result = preheat.load(sharded_checkpoint.root, mode=mode, threads=1, chunk_bytes=4096)
    assert (result.report.threads, result.report.chunk_bytes) == (1, 4096)
    assert_same_tensors(result, sharded_checkpoint.tensors)


def test_environment_sets_threads_and_chunk_size(
    single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_THREADS", "3")
    monkeypatch.setenv("PREHEAT_CHUNK_BYTES", "64KiB")
    result = preheat.load(single_checkpoint.root, mode="read")
    assert (result.report.threads, result.report.chunk_bytes) == (3, 64 * 1024)
    assert_same_tensors(result, single_checkpoint.tensors)


def test_arguments_override_the_environment(
    single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_THREADS", "3")
    monkeypatch.setenv("PREHEAT_CHUNK_BYTES", "64KiB")
    report = preheat.load(single_checkpoint.root, mode="read", threads=2, chunk_bytes=8192).report
    assert (report.threads, report.chunk_bytes) == (2, 8192)


def test_environment_sets_the_mode(single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_LOAD_MODE", "read")
    assert preheat.load(single_checkpoint.root).report.mode == "read"


def test_auto_mode_on_cpu_maps_the_files(single_checkpoint: WrittenCheckpoint) -> None:
    assert preheat.load(single_checkpoint.root, mode="auto").report.mode == "mmap"


def test_non_integer_thread_count_in_environment_is_a_config_error(
    single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_THREADS", "many")
    with pytest.raises(ConfigError, match="PREHEAT_THREADS='many'"):
        preheat.load(single_checkpoint.root, mode="read")


def test_malformed_chunk_size_in_environment_is_a_config_error(
    single_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_CHUNK_BYTES", "lots")
    with pytest.raises(ConfigError, match="'lots'"):
        preheat.load(single_checkpoint.root, mode="read")


def test_unknown_mode_is_a_config_error(single_checkpoint: WrittenCheckpoint) -> None:
    with pytest.raises(ConfigError, match="unknown mode 'turbo'"):
        preheat.load(single_checkpoint.root, mode="turbo")


def test_gds_on_cpu_is_a_config_error(single_checkpoint: WrittenCheckpoint) -> None:
    with pytest.raises(ConfigError, match="gds"):
        preheat.load(single_checkpoint.root, mode="gds")


def test_unsupported_device_is_a_config_error(single_checkpoint: WrittenCheckpoint) -> None:
    with pytest.raises(ConfigError, match="meta"):
        preheat.load(single_checkpoint.root, device="meta", mode="read")


def test_mmap_on_cuda_is_a_config_error(single_checkpoint: WrittenCheckpoint) -> None:
    with pytest.raises(ConfigError, match="mmap"):
        preheat.load(single_checkpoint.root, device="cuda", mode="mmap")


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0), (4, 4)])
def test_rank_outside_world_size_is_a_config_error(
    single_checkpoint: WrittenCheckpoint, rank: int, world_size: int
) -> None:
    with pytest.raises(ConfigError, match=f"rank {rank} is not within world size {world_size}"):
        preheat.load(single_checkpoint.root, rank=rank, world_size=world_size)


@pytest.mark.parametrize(("threads", "chunk_bytes"), [(0, None), (None, 100)])
def test_nonsense_tuning_is_a_config_error(
    single_checkpoint: WrittenCheckpoint, threads: int | None, chunk_bytes: int | None
) -> None:
    with pytest.raises(ConfigError):
        preheat.load(single_checkpoint.root, mode="read", threads=threads, chunk_bytes=chunk_bytes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_without_a_gpu_is_a_device_error(single_checkpoint: WrittenCheckpoint) -> None:
    with pytest.raises(DeviceError, match="CUDA"):
        preheat.load(single_checkpoint.root, device="cuda")


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per dtype, in an order that leaves some tensors at offsets not aligned to their element size."""
    gen = torch.Generator().manual_seed(7)
    return {
        "u8_odd": torch.randint(0, 256, (3,), dtype=torch.uint8, generator=gen),
        "f32": torch.randn(5, 7, generator=gen),
        "bool": torch.rand(9, generator=gen) > 0.5,
        "f16": torch.randn(4, 3, generator=gen).half(),
        "i8": torch.randint(-128, 128, (5,), dtype=torch.int8, generator=gen),
        "bf16": torch.randn(6, 2, generator=gen).bfloat16(),
        "i64": torch.randint(-(2**62), 2**62, (3, 2), dtype=torch.int64, generator=gen),
        "f8_e4m3": torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn),
        "scalar_f32": torch.tensor(3.5),
        "scalar_i64": torch.tensor(-42, dtype=torch.int64),
        "empty_f16": torch.empty(0, 4, dtype=torch.float16),
        "empty_bool": torch.empty(3, 0, dtype=torch.bool),
        "tail_u8": torch.arange(7, dtype=torch.uint8),
    }


@pytest.mark.parametrize("mode", ["mmap", "read", "direct"])
def test_every_dtype_round_trips(tmp_path: Path, mode: str) -> None:
    tensors = every_dtype()
    path = tmp_path / "dtypes.safetensors"
    save_file(tensors, path)
    result = preheat.load(path, mode=mode)
    assert_same_tensors(result, tensors)
    assert result["scalar_f32"].shape == ()
    assert result["empty_f16"].shape == (0, 4)


def test_every_dtype_file_is_readable_by_the_reference_reader(tmp_path: Path) -> None:
    tensors = every_dtype()
    path = tmp_path / "dtypes.safetensors"
    save_file(tensors, path)
    assert_same_tensors(load_file(path), tensors)


@pytest.mark.parametrize("mode", ["mmap", "read", "direct"])
def test_file_without_tensors_loads_as_empty(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "empty.safetensors"
    save_file({}, path, {"format": "pt"})
    result = preheat.load(path, mode=mode)
    assert dict(result) == {}
    assert result.report.bytes == 0


# -- mappings made while torch imports (preheat.io.premap) -------------------------------------------------------------
def test_a_load_adopts_the_files_mapped_before_it_and_gets_the_same_tensors(
    fresh_checkpoint: WrittenCheckpoint,
) -> None:
    from preheat.io.premap import map_files

    mapped = map_files([str(fresh_checkpoint.single_file)])
    assert len(mapped) == 1
    result = preheat.load(fresh_checkpoint.root, mode="mmap", premapped=mapped)
    assert_same_tensors(result, fresh_checkpoint.tensors)
    assert mapped == {}  # taken by the load
    assert result.populated


def test_a_file_replaced_after_it_was_mapped_is_mapped_again(tmp_path: Path) -> None:
    from preheat.io.premap import map_files

    first = write(tmp_path / "m", seed=1)
    mapped = map_files([str(first.single_file)])
    second = write(tmp_path / "m", seed=2)  # same names, new bytes: the early mapping shows the old file
    assert not all(same_bytes(second.tensors[k], first.tensors[k]) for k in first.tensors)
    result = preheat.load(second.root, mode="mmap", premapped=mapped)
    assert_same_tensors(result, second.tensors)
    assert not result.populated
