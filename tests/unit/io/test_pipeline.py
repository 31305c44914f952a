"""The staged reader (the CUDA pipeline) on a CPU destination, run many times on one pool of threads, as the
bucketed hand-off runs it: every run delivers its bytes, and the lanes (each with two staging buffers and, on CUDA,
a stream and pinned memory) stay one per thread instead of piling up run after run."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from preheat.core.errors import CheckpointError
from preheat.io.buffers import as_memoryview, host_buffer
from preheat.io.pipeline import StagedReader
from preheat.io.reads import Extent, FileJob, ParallelReader, plan_ops


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[str, bytes]:
    contents = bytes((i * 7 + i // 251) % 256 for i in range(200_000))
    path = tmp_path / "data.bin"
    path.write_bytes(contents)
    return str(path), contents


def _job(path: str, start: int, length: int, chunk: int) -> FileJob:
    dest = host_buffer(length).zero_()
    return FileJob(path, plan_ops([Extent(start, length, 0)], chunk_bytes=chunk), dest, os.path.getsize(path))


@pytest.mark.parametrize("reader_kind", ["staged", "parallel"])
def test_runs_on_a_borrowed_pool_deliver_every_byte(data_file: tuple[str, bytes], reader_kind: str) -> None:
    path, contents = data_file
    chunk = 4096
    reader = StagedReader(torch.device("cpu"), 3, chunk_bytes=chunk) if reader_kind == "staged" else None
    parallel = ParallelReader(3, chunk_bytes=chunk)
    with ThreadPoolExecutor(3) as pool:
        for k in range(12):
            start, length = k * 15_000, 15_000 + k * 311
            job = _job(path, start, length, chunk)
            got = reader.run([job], pool=pool) if reader is not None else parallel.run([job], pool=pool)
            assert got == length
            assert bytes(as_memoryview(job.dest)) == contents[start : start + length]
    if reader is not None:
        assert len(reader._lanes) <= 3  # one lane per thread of the pool, reused by every run


def test_a_failed_run_on_a_borrowed_pool_leaves_the_pool_usable(data_file: tuple[str, bytes]) -> None:
    path, contents = data_file
    reader = StagedReader(torch.device("cpu"), 2, chunk_bytes=4096)
    with ThreadPoolExecutor(2) as pool:
        past_the_end = _job(path, len(contents) - 1000, 1000, 4096)
        past_the_end.needed_size = len(contents) + 1  # the plan needs a byte the file does not have
        with pytest.raises(CheckpointError, match="truncated"):
            reader.run([past_the_end], pool=pool)
        job = _job(path, 0, 50_000, 4096)
        assert reader.run([job], pool=pool) == 50_000
        assert bytes(as_memoryview(job.dest)) == contents[:50_000]
