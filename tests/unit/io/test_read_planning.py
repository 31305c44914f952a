"""Read planning (``plan_ops``) as properties, the readers that execute plans, and size parsing for settings."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import WrittenCheckpoint
from preheat.checkpoint.header import CheckpointFile
from preheat.checkpoint.layout import open_checkpoint
from preheat.checkpoint.safetensors import PREFIX_BYTES, encode_header, parse_header
from preheat.core.config import parse_size
from preheat.core.errors import CheckpointError, ConfigError, DirectIOUnsupported
from preheat.io.buffers import PAGE, as_memoryview, host_buffer
from preheat.io.pipeline import StagedReader
from preheat.io.reads import (
    DISCARD,
    MAX_IOV,
    Extent,
    FileJob,
    ParallelReader,
    ReadOp,
    plan_ops,
    read_at_least,
    split_extents,
)
from preheat.loader.load import plan_file
from preheat.sources.local import LocalFile
from preheat.testing.synthetic import LlamaShape

Layout = tuple[list[Extent], int, int]  # extents, file size, destination size


@st.composite
def layouts(draw: st.DrawFn, page: int) -> Layout:
    """Disjoint file runs (some adjacent, some a few pages apart, some empty) packed into a destination in a
    shuffled order, the way TP slices of many tensors land in one buffer."""
    count = draw(st.integers(0, 12))
    offset = draw(st.integers(0, 3 * page))
    runs: list[tuple[int, int]] = []
    for _ in range(count):
        length = draw(st.integers(0, 3 * page))
        runs.append((offset, length))
        offset += length + draw(st.one_of(st.just(0), st.integers(1, page), st.integers(page, 4 * page)))
    file_size = offset + draw(st.integers(0, page))
    extents: list[Extent | None] = [None] * count
    dest = 0
    for index in draw(st.permutations(range(count))):
        dest += draw(st.integers(0, 8))
        extents[index] = Extent(runs[index][0], runs[index][1], dest)
        dest += runs[index][1]
    return [e for e in extents if e is not None], file_size, dest


def pattern(size: int) -> bytes:
    """File contents where every byte differs from its neighbours and no page repeats another."""
    return bytes((i * 7 + i // 251) % 256 for i in range(size))


def apply_ops(ops: list[ReadOp], data: bytes, dest_size: int) -> tuple[bytearray, list[int]]:
    """Execute ``ops`` against ``data`` in memory; also count how often each destination byte is written."""
    dest = bytearray(dest_size)
    writes = [0] * dest_size
    for op in ops:
        assert op.file_offset + op.length <= len(data)
        cursor = op.file_offset
        for target, length in op.pieces:
            if target != DISCARD:
                dest[target : target + length] = data[cursor : cursor + length]
                for k in range(target, target + length):
                    writes[k] += 1
            cursor += length
    return dest, writes


def copy_extents(extents: list[Extent], data: bytes, dest_size: int) -> bytearray:
    dest = bytearray(dest_size)
    for e in extents:
        dest[e.dest_offset : e.dest_offset + e.length] = data[e.file_offset : e.file_offset + e.length]
    return dest


def touched_pages(extents: list[Extent], page: int) -> set[int]:
    pages: set[int] = set()
    for e in extents:
        if e.length:
            pages.update(range(e.file_offset // page, math.ceil((e.file_offset + e.length) / page)))
    return pages


PAGES = st.sampled_from([16, 64, 4096])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), page=PAGES)
def test_ops_deliver_every_extent_byte_exactly_once(data: st.DataObject, page: int) -> None:
    extents, file_size, dest_size = data.draw(layouts(page))
    chunk_bytes = data.draw(st.integers(1, 4 * page))
    ops = plan_ops(extents, chunk_bytes=chunk_bytes, page=page)
    contents = pattern(file_size)
    got, writes = apply_ops(ops, contents, dest_size)
    assert got == copy_extents(extents, contents, dest_size)
    wanted = [0] * dest_size
    for e in extents:
        for k in range(e.dest_offset, e.dest_offset + e.length):
            wanted[k] = 1
    assert writes == wanted


@settings(max_examples=300, deadline=None)
@given(data=st.data(), page=PAGES)
def test_no_op_exceeds_the_chunk_size(data: st.DataObject, page: int) -> None:
    extents, _, _ = data.draw(layouts(page))
    chunk_bytes = data.draw(st.integers(1, 4 * page))
    for op in plan_ops(extents, chunk_bytes=chunk_bytes, page=page):
        assert op.useful_bytes <= chunk_bytes
        assert op.length <= chunk_bytes + 2 * page
        assert all(length > 0 for _, length in op.pieces)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), page=PAGES)
def test_merged_gaps_never_fetch_an_untouched_page(data: st.DataObject, page: int) -> None:
    extents, _, _ = data.draw(layouts(page))
    ops = plan_ops(extents, chunk_bytes=data.draw(st.integers(1, 4 * page)), page=page)
    needed = touched_pages(extents, page)
    for op in ops:
        cursor = op.file_offset
        for target, length in op.pieces:
            if target == DISCARD:
                assert length < 2 * page  # fits the reader's two-page scratch buffer
                assert set(range(cursor // page, math.ceil((cursor + length) / page))) <= needed
            cursor += length
    fetched = touched_pages([Extent(op.file_offset, op.length, 0) for op in ops], page)
    assert fetched == needed


@settings(max_examples=200, deadline=None)
@given(data=st.data(), page=PAGES, max_iov=st.sampled_from([1, 2, 3, 4, 7, MAX_IOV]))
def test_no_op_has_more_pieces_than_iov_max(data: st.DataObject, page: int, max_iov: int) -> None:
    extents, file_size, dest_size = data.draw(layouts(page))
    ops = plan_ops(extents, chunk_bytes=data.draw(st.integers(1, 8 * page)), page=page, max_iov=max_iov)
    assert all(len(op.pieces) <= max(max_iov, 1) for op in ops)
    contents = pattern(file_size)
    assert apply_ops(ops, contents, dest_size)[0] == copy_extents(extents, contents, dest_size)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), page=PAGES)
def test_split_extents_keeps_every_byte_on_its_side_of_the_cut(data: st.DataObject, page: int) -> None:
    extents, file_size, dest_size = data.draw(layouts(page))
    at = data.draw(st.integers(0, file_size))
    before, after = split_extents(extents, at)
    assert all(e.length > 0 and e.file_offset + e.length <= at for e in before)
    assert all(e.length > 0 and e.file_offset >= at for e in after)
    contents = pattern(file_size)
    assert copy_extents(before + after, contents, dest_size) == copy_extents(extents, contents, dest_size)
    assert sum(e.length for e in before + after) == sum(e.length for e in extents)


def test_neighbours_within_a_page_become_one_read() -> None:
    ops = plan_ops([Extent(0, 100, 0), Extent(150, 100, 100)], chunk_bytes=1 << 20, page=4096)
    assert ops == [ReadOp(0, ((0, 100), (DISCARD, 50), (100, 100)))]


def test_neighbours_with_an_untouched_page_between_stay_apart() -> None:
    ops = plan_ops([Extent(0, 100, 0), Extent(2 * 4096, 100, 100)], chunk_bytes=1 << 20, page=4096)
    assert ops == [ReadOp(0, ((0, 100),)), ReadOp(2 * 4096, ((100, 100),))]


def test_large_extent_is_split_at_chunk_size() -> None:
    ops = plan_ops([Extent(4096, 10_000, 64)], chunk_bytes=4096, page=4096)
    assert [(op.file_offset, op.pieces) for op in ops] == [
        (4096, ((64, 4096),)),
        (8192, ((64 + 4096, 4096),)),
        (12288, ((64 + 8192, 10_000 - 8192),)),
    ]


def test_no_extents_plan_no_reads() -> None:
    assert plan_ops([], chunk_bytes=4096) == []
    assert plan_ops([Extent(100, 0, 0)], chunk_bytes=4096) == []


def direct_pages(ops: list[ReadOp], page: int) -> list[int]:
    """The pages an O_DIRECT reader fetches for ``ops``: each op widened to whole pages, repeats counted."""
    return [p for op in ops for p in range(op.file_offset // page, math.ceil((op.file_offset + op.length) / page))]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), page=PAGES)
def test_direct_reads_every_needed_page_exactly_once(data: st.DataObject, page: int) -> None:
    extents, _, _ = data.draw(layouts(page))
    ops = plan_ops(extents, chunk_bytes=data.draw(st.integers(page, 4 * page)), page=page)
    fetched = direct_pages(ops, page)
    assert sorted(fetched) == sorted(touched_pages(extents, page))  # no page twice, none that is not needed


def test_large_extent_is_cut_at_page_boundaries() -> None:
    ops = plan_ops([Extent(100, 10_000, 0)], chunk_bytes=5000, page=4096)
    assert [(op.file_offset, op.length) for op in ops] == [(100, 3996), (4096, 4096), (8192, 1908)]


def header_only(shape: LlamaShape) -> CheckpointFile:
    """A bf16 checkpoint file of ``shape`` as the planner sees it: the header alone, no bytes behind it."""
    spec = {name: ("BF16", dims, math.prod(dims) * 2) for name, dims in shape.tensor_shapes().items()}
    raw = encode_header(spec)
    size = len(raw) + sum(nbytes for _, _, nbytes in spec.values())
    return CheckpointFile("model.safetensors", size, parse_header(raw[PREFIX_BYTES:], path="model", file_size=size))


# The shape the hardening review measured (16 KV heads, hidden 2048, intermediate 5632, 7 layers: about 1 GB), where
# rank 0 of 2 read 92% of the file with ``direct`` against 60% with ``read``; and TinyLlama's layers (4 KV heads).
TP_SHAPES = [LlamaShape(32000, 2048, 5632, 7, 16, 16), LlamaShape(32000, 2048, 5632, 2, 32, 4)]


@pytest.mark.parametrize("chunk", [4096, 5000, 8192, 1 << 20])
@pytest.mark.parametrize("shape", TP_SHAPES, ids=["review", "tinyllama"])
def test_direct_plan_of_a_tp_rank_fetches_only_its_pages(shape: LlamaShape, chunk: int) -> None:
    file = header_only(shape)
    for world_size in (2, 4):
        for rank in range(world_size):
            plan = plan_file(file, "auto", rank, world_size, align_base=PAGE)
            fetched = direct_pages(plan_ops(plan.extents, chunk_bytes=chunk), PAGE)
            assert len(fetched) == len(touched_pages(list(plan.extents), PAGE)), (world_size, rank)


# Readers: the same jobs through the thread-pool reader and the staged (CUDA pipeline) reader on a CPU destination.

Reader = Callable[[int], ParallelReader | StagedReader]
READERS: dict[str, Reader] = {
    "parallel": lambda chunk: ParallelReader(3, chunk_bytes=chunk),
    "staged": lambda chunk: StagedReader(torch.device("cpu"), 3, chunk_bytes=chunk),
}


def read_into_zeros(
    reader: Reader, path: str, extents: list[Extent], dest_size: int, *, chunk: int, direct: bool
) -> bytes:
    """Run one job into a zeroed, page-aligned buffer, so bytes written outside the extents would show."""
    dest = host_buffer(dest_size, align=PAGE).zero_()
    job = FileJob(path, plan_ops(extents, chunk_bytes=chunk), dest, os.path.getsize(path), direct=direct)
    reader(chunk).run([job])
    return bytes(as_memoryview(dest))


@pytest.fixture(scope="module")
def pattern_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    contents = pattern(64 * 4096 + 123)  # a ragged end, so the last direct read is short
    path = tmp_path_factory.mktemp("pattern") / "pattern.bin"
    path.write_bytes(contents)
    return str(path), contents


@settings(max_examples=40, deadline=None)
@given(data=st.data(), direct=st.booleans(), chunk=st.sampled_from([4096, 3 * 4096, 64 * 1024, 5000]))
def test_readers_deliver_exactly_the_planned_bytes(
    pattern_file: tuple[str, bytes], data: st.DataObject, direct: bool, chunk: int
) -> None:
    path, contents = pattern_file
    extents, _, dest_size = data.draw(layouts(PAGE))
    extents = [e for e in extents if e.file_offset + e.length <= len(contents)]
    want = bytes(copy_extents(extents, contents, dest_size))
    for name, reader in READERS.items():
        assert read_into_zeros(reader, path, extents, dest_size, chunk=chunk, direct=direct) == want, name


@pytest.mark.parametrize("reader", sorted(READERS))
def test_direct_read_of_the_file_tail_fits_an_exact_size_buffer(pattern_file: tuple[str, bytes], reader: str) -> None:
    """The last page of a file is short; an O_DIRECT read of it must not need room for a whole page."""
    path, contents = pattern_file
    tail = len(contents) % PAGE
    extents = [Extent(len(contents) - tail, tail, PAGE)]
    got = read_into_zeros(READERS[reader], path, extents, PAGE + tail, chunk=1 << 20, direct=True)
    assert got == bytes(PAGE) + contents[-tail:]


def test_an_o_direct_read_the_kernel_refuses_is_a_signal_to_read_buffered(pattern_file: tuple[str, bytes]) -> None:
    """EINVAL from a read on an O_DIRECT descriptor means the filesystem will not do it (the loader then reads
    buffered); from any other read it is a failed read. A real refusal: an O_DIRECT read into misaligned memory."""
    path, _ = pattern_file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip(f"{path}: this filesystem has no O_DIRECT at all")
    misaligned = as_memoryview(host_buffer(2 * PAGE, align=PAGE))[1 : 1 + PAGE]
    source = LocalFile.from_fd(path, fd)
    try:
        with pytest.raises(DirectIOUnsupported):
            read_at_least(source, misaligned, 0, PAGE, path=path, direct=True)
        with pytest.raises(CheckpointError, match="read failed at byte 0"):
            read_at_least(source, misaligned, 0, PAGE, path=path)
    finally:
        source.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("chunk", [4096, 64 * 1024])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_staged_reader_matches_parallel_reader_on_a_checkpoint(
    sharded_checkpoint: WrittenCheckpoint, world_size: int, chunk: int, direct: bool
) -> None:
    for file in open_checkpoint(sharded_checkpoint.root).files:
        contents = Path(file.path).read_bytes()
        for rank in range(world_size):
            plan = plan_file(file, "auto", rank, world_size, align_base=PAGE if direct else 1)
            want = bytes(copy_extents(list(plan.extents), contents, plan.buffer_bytes))
            ops = plan_ops(plan.extents, chunk_bytes=chunk)
            totals = {}
            for name, reader in READERS.items():
                dest = host_buffer(plan.buffer_bytes, align=PAGE).zero_()
                totals[name] = reader(chunk).run([FileJob(file.path, ops, dest, plan.needed_size, direct)])
                assert bytes(as_memoryview(dest)) == want, (name, rank)
            if not direct:  # buffered reads fetch the ops' bytes, merged gaps included, and nothing else
                assert totals["parallel"] == totals["staged"] == sum(op.length for op in ops)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_reader_reports_progress_of_useful_bytes(pattern_file: tuple[str, bytes], reader: str) -> None:
    path, _ = pattern_file
    extents = [Extent(0, 10_000, 0), Extent(10_050, 30_000, 10_000), Extent(100_000, 5, 40_000)]
    seen: list[int] = []
    dest = host_buffer(40_005)
    job = FileJob(path, plan_ops(extents, chunk_bytes=8192), dest, 0)
    instance = READERS[reader](8192)
    instance.progress = seen.append
    instance.run([job])
    assert sum(seen) == 40_005


# Sizes, as written in flags and PREHEAT_* variables.


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1048576),
        ("0", 0),
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("64M", 64_000_000),
        ("64m", 64_000_000),
        ("1.5GB", 1_500_000_000),
        ("2TiB", 2 * 2**40),
        ("10b", 10),
        (" 4 KiB ", 4096),
        ("16kb", 16_000),
        (".5MiB", 2**19),
        (4096, 4096),
    ],
)
def test_parse_size_reads_what_people_write(text: str | int, size: int) -> None:
    assert parse_size(text) == size


def test_parse_size_takes_percentages_of_a_total() -> None:
    assert parse_size("20%", total=1000) == 200
    assert parse_size("12.5%", total=8 * 2**30) == 2**30


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "cannot parse"),
        ("lots", "cannot parse"),
        ("-5", "cannot parse"),
        ("1e9", "cannot parse"),
        ("1.2.3GiB", "cannot parse"),
        ("5 parsecs", "unknown size unit 'parsecs'"),
        ("3 KB/s", "cannot parse"),
        ("20%", "no total"),
        (-1, "must not be negative"),
    ],
)
def test_parse_size_refuses_nonsense(text: str | int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_size(text)


def test_size_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        parse_size("lots")


@given(st.integers(0, 2**50))
def test_parse_size_round_trips_plain_byte_counts(n: int) -> None:
    assert parse_size(str(n)) == n
    assert parse_size(f"{n}KiB") == n * 1024
