"""Bad input stops the load with a ``CheckpointError`` that names the file (and tensor), never a partial result,
a crash or a SIGBUS."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import preheat
from checkpoints import WrittenCheckpoint, write, write_raw
from preheat.checkpoint.layout import open_checkpoint
from preheat.checkpoint.writer import save_file
from preheat.core.errors import CheckpointError, SourceError
from preheat.io.buffers import PAGE, host_buffer
from preheat.io.pipeline import StagedReader
from preheat.io.reads import FileJob, ParallelReader, plan_ops
from preheat.loader.load import plan_file
from preheat.sources.base import READ_BYTES_LIMIT
from preheat.sources.local import LocalOrigin

MODES = ["mmap", "read", "direct"]


def load_fails(
    source: Path, mode: str = "read", *, path: Path | None = None, tensor: str | None = None
) -> CheckpointError:
    """Load ``source`` expecting a CheckpointError that names ``path`` (default: ``source``) and ``tensor``."""
    named = path or source
    with pytest.raises(CheckpointError) as caught:
        preheat.load(source, mode=mode)
    error = caught.value
    assert str(named) in str(error)
    assert error.path == str(named)
    if tensor is not None:
        assert error.tensor == tensor
        assert repr(tensor) in str(error)
    return error


@pytest.mark.parametrize("mode", MODES)
def test_truncated_file_names_file_and_last_tensor(fresh_checkpoint: WrittenCheckpoint, mode: str) -> None:
    path = fresh_checkpoint.single_file
    os.truncate(path, path.stat().st_size - 10)
    error = load_fails(fresh_checkpoint.root, mode, path=path, tensor="lm_head.weight")
    assert "truncated" in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_file_truncated_inside_its_header_is_refused(fresh_checkpoint: WrittenCheckpoint, mode: str) -> None:
    path = fresh_checkpoint.single_file
    os.truncate(path, 100)
    load_fails(path, mode)


@pytest.mark.parametrize("mode", MODES)
def test_header_length_beyond_file_size_is_refused(tmp_path: Path, mode: str) -> None:
    header = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}
    path = write_raw(tmp_path / "model.safetensors", header, b"\0" * 4, declared_length=10_000)
    error = load_fails(path, mode)
    assert "header length 10000" in str(error)


def f32(begin: int, end: int, shape: list[int] | None = None) -> dict[str, object]:
    return {"dtype": "F32", "shape": shape if shape is not None else [(end - begin) // 4], "data_offsets": [begin, end]}


MALFORMED_HEADERS: dict[str, tuple[dict[str, object], int, str, str]] = {
    # case: (header, data bytes, tensor named, message fragment)
    "overlapping offsets": ({"a": f32(0, 16), "b": f32(8, 24)}, 24, "b", "overlaps"),
    "offsets past the end": ({"a": f32(0, 8), "b": f32(8, 32)}, 16, "b", "ends at byte"),
    "unknown dtype": ({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, 8, "a", "unknown dtype 'F4'"),
    "size disagrees with shape": ({"a": f32(0, 16, [3])}, 16, "a", "need 12"),
    "reversed offsets": ({"a": {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}}, 8, "a", "invalid data_offsets"),
    "negative dimension": ({"a": f32(0, 4, [-1])}, 8, "a", "invalid shape"),
    "entry is not an object": ({"a": [1, 2, 3]}, 0, "a", "not an object"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(MALFORMED_HEADERS))
def test_malformed_header_names_file_and_tensor(tmp_path: Path, case: str, mode: str) -> None:
    header, data_bytes, tensor, fragment = MALFORMED_HEADERS[case]
    path = tmp_path / "model.safetensors"
    write_raw(path, header, b"\x01" * data_bytes)
    error = load_fails(tmp_path, mode, path=path, tensor=tensor)
    assert fragment in str(error)


NOT_SAFETENSORS: dict[str, Callable[[Path], object]] = {
    "text file": lambda p: p.write_text("these are not the weights you are looking for\n" * 20),
    "pickle": lambda p: p.write_bytes(pickle.dumps({"weight": [0.5] * 64}, protocol=2)),
    "torch.save zip": lambda p: torch.save({"weight": torch.ones(8)}, p),
    "three bytes": lambda p: p.write_bytes(b"abc"),
    "empty file": lambda p: p.write_bytes(b""),
    "header of garbage": lambda p: p.write_bytes((12).to_bytes(8, "little") + b"\xff\xfe not json"),
    "header is a json array": lambda p: p.write_bytes((9).to_bytes(8, "little") + b"[1, 2, 3]"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(NOT_SAFETENSORS))
def test_file_that_is_not_safetensors_is_refused(tmp_path: Path, kind: str, mode: str) -> None:
    path = tmp_path / "model.safetensors"
    NOT_SAFETENSORS[kind](path)
    load_fails(path, mode)


HOSTILE_HEADERS: dict[str, bytes] = {
    # json.loads raised RecursionError (a crash, not a CheckpointError) for the first two, ValueError for the third
    "100,000 nested lists": b"[" * 100_000,
    "nested metadata": b'{"__metadata__": {"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}",
    "5,000-digit offset": b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, ' + b"4" * 5_000 + b"]}}",
    "100-dimensional tensor": b'{"a": {"dtype": "U8", "shape": ['
    + b",".join([b"1"] * 100)
    + b'], "data_offsets": [0, 1]}}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_header_json_is_a_checkpoint_error(tmp_path: Path, case: str) -> None:
    raw = HOSTILE_HEADERS[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    load_fails(path)


def test_index_with_every_tensor_in_its_own_shard_name_resolves_in_linear_time(tmp_path: Path) -> None:
    # 50,000 distinct shard names: the old "if path not in files" made this quadratic (minutes); the per-test timeout
    # catches a regression, nothing here measures time.
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"t{i}": f"s{i:05d}.safetensors" for i in range(50_000)}})
    )
    error = load_fails(tmp_path, path=tmp_path / "s00000.safetensors")
    assert "missing" in str(error)


def test_deeply_nested_index_names_the_index(tmp_path: Path) -> None:
    written = write(tmp_path / "model", shards=2)
    index = written.root / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    error = load_fails(written.root, path=index)
    assert "nested deeper than 64 levels" in str(error)


def test_local_origin_reads_only_regular_files_of_bounded_size(tmp_path: Path) -> None:
    origin = LocalOrigin(str(tmp_path))
    with open(tmp_path / "config.json", "wb") as handle:
        handle.truncate(READ_BYTES_LIMIT + 1)  # sparse: no disk used, and never read
    with pytest.raises(SourceError, match=f"at most {READ_BYTES_LIMIT} bytes, and this one is {READ_BYTES_LIMIT + 1}"):
        origin.read_bytes("config.json")
    os.mkfifo(tmp_path / "tokenizer.json")  # opening it for reading would wait for a writer forever
    with pytest.raises(SourceError, match="not a regular file"):
        origin.read_bytes("tokenizer.json")
    (tmp_path / "small.json").write_bytes(b"{}")
    assert origin.read_bytes("small.json") == b"{}"


def test_shard_missing_from_index_names_the_shard(tmp_path: Path) -> None:
    written = write(tmp_path / "model", shards=3)
    missing = written.root / "model-00002-of-00003.safetensors"
    os.remove(missing)
    error = load_fails(written.root, path=missing)
    assert "missing" in str(error)


def test_index_that_is_not_json_names_the_index(tmp_path: Path) -> None:
    written = write(tmp_path / "model", shards=2)
    index = written.root / "model.safetensors.index.json"
    index.write_text("{ not json")
    load_fails(written.root, path=index)


def test_index_pointing_outside_the_directory_is_refused(tmp_path: Path) -> None:
    written = write(tmp_path / "model", shards=2)
    index = written.root / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    load_fails(written.root, path=index)


def test_index_naming_a_tensor_no_shard_holds_is_refused(tmp_path: Path) -> None:
    written = write(tmp_path / "model", shards=2)
    index = written.root / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    load_fails(written.root, path=index, tensor="model.ghost.weight")


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    error = load_fails(tmp_path)
    assert "no weights" in str(error)


def test_directory_named_like_a_shard_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").mkdir()
    load_fails(tmp_path, path=tmp_path / "b.safetensors")


@pytest.mark.parametrize("name", ["missing", "missing.safetensors"])
def test_nonexistent_path_is_refused(tmp_path: Path, name: str) -> None:
    load_fails(tmp_path / name)


def test_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    save_file({"shared": torch.ones(2), "a": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"b": torch.ones(2), "shared": torch.zeros(2)}, tmp_path / "b.safetensors")
    error = load_fails(tmp_path, path=tmp_path / "b.safetensors", tensor="shared")
    assert str(tmp_path / "a.safetensors") in str(error)


def test_tensor_in_two_indexed_shards_is_refused(tmp_path: Path) -> None:
    save_file({"shared": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.ones(2), "shared": torch.zeros(2)}, tmp_path / "two.safetensors")
    index = {"weight_map": {"shared": "one.safetensors", "b": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    load_fails(tmp_path, path=tmp_path / "two.safetensors", tensor="shared")


READERS: dict[str, Callable[[], ParallelReader | StagedReader]] = {
    "parallel": lambda: ParallelReader(2, chunk_bytes=16 * 1024),
    "staged": lambda: StagedReader(torch.device("cpu"), 2, chunk_bytes=16 * 1024),
}


def planned_jobs(root: Path, *, direct: bool, world_size: int) -> list[FileJob]:
    """Plan rank 0's read of ``root`` the way the loader does, before anything is read."""
    jobs = []
    for file in open_checkpoint(root).files:
        plan = plan_file(file, "auto", 0, world_size, align_base=PAGE if direct else 1)
        ops = plan_ops(plan.extents, chunk_bytes=16 * 1024)
        dest = host_buffer(plan.buffer_bytes, align=PAGE)
        jobs.append(FileJob(file.path, ops, dest, plan.needed_size, direct=direct))
    return jobs


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_file_truncated_after_planning_is_refused(
    fresh_checkpoint: WrittenCheckpoint, reader: str, direct: bool, world_size: int
) -> None:
    jobs = planned_jobs(fresh_checkpoint.root, direct=direct, world_size=world_size)
    path = fresh_checkpoint.single_file
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as caught:
        READERS[reader]().run(jobs)
    assert caught.value.path == str(path)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_file_that_shrinks_while_reading_is_refused(
    fresh_checkpoint: WrittenCheckpoint, reader: str, direct: bool
) -> None:
    """The up-front size check passes (needed_size 0), then the reads themselves meet the shorter file: they must
    fail rather than leave the missing tail as zeros."""
    jobs = [
        FileJob(job.path, job.ops, job.dest, 0, direct=job.direct)
        for job in planned_jobs(fresh_checkpoint.root, direct=direct, world_size=1)
    ]
    path = fresh_checkpoint.single_file
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated while loading") as caught:
        READERS[reader]().run(jobs)
    assert caught.value.path == str(path)


def test_file_removed_after_planning_is_refused(fresh_checkpoint: WrittenCheckpoint) -> None:
    jobs = planned_jobs(fresh_checkpoint.root, direct=False, world_size=1)
    os.remove(fresh_checkpoint.single_file)
    with pytest.raises(CheckpointError, match="removed after the load was planned"):
        ParallelReader(2, chunk_bytes=16 * 1024).run(jobs)


# Run in a child process: if a truncated mapping were ever touched, SIGBUS would kill the child (and fail the test)
# instead of killing pytest.
_MMAP_CHILD = textwrap.dedent(
    """
    import os, sys
    import preheat
    import torch

    from preheat.core.config import LoaderSettings
    from preheat.core.errors import CheckpointError
    from preheat.loader.load import LoadRequest, execute_load, plan_load

    root, path = sys.argv[1], sys.argv[2]
    size = os.path.getsize(path)

    os.truncate(path, size - 10)
    try:
        weights = preheat.load(root, mode="mmap")
        print("loaded", sum(float(t.float().sum()) for t in weights.values()))
    except CheckpointError as exc:
        print("before load:", exc.path, exc)

    # Restore the length (zeros), plan, then shrink the file between planning and mapping.
    os.truncate(path, size)
    plan = plan_load(LoadRequest(root, torch.device("cpu"), mode="mmap"), LoaderSettings.from_env())
    os.truncate(path, size - 10)
    try:
        weights = execute_load(plan)
        print("mapped", sum(float(t.float().sum()) for t in weights.values()))
    except CheckpointError as exc:
        print("after planning:", exc.path, exc)
    """
)


def test_mmap_of_truncated_file_is_an_error_not_sigbus(fresh_checkpoint: WrittenCheckpoint) -> None:
    path = fresh_checkpoint.single_file
    child = subprocess.run(
        [sys.executable, "-c", _MMAP_CHILD, str(fresh_checkpoint.root), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert len(lines) == 2, child.stdout
    assert lines[0].startswith(f"before load: {path} ")
    assert "truncated" in lines[0]
    assert lines[1].startswith(f"after planning: {path} ")
    assert "truncated" in lines[1]
