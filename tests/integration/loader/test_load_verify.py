"""A load checks every tensor against ``preheat.json`` as its bytes land: one flipped byte anywhere stops it, naming the
tensor, the file and the source; a checkpoint that cannot be checked loads only when the caller says so, and the
report says it was not checked. Real files, a real HTTP origin (``FileServer``, whose fault injection flips bytes on
the wire) and a real S3 server (moto)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors
from preheat.checkpoint.digest import ExpectedDigest, TensorDigests, digest_bytes
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest, TensorRecord, build_manifest
from preheat.convert import convert
from preheat.core.errors import CheckpointError, ConfigError
from preheat.io.buffers import PAGE, as_memoryview, host_buffer
from preheat.io.pipeline import StagedReader
from preheat.io.reads import Extent, FileJob, ParallelReader, plan_ops
from preheat.store import ModelCache
from preheat.testing.fileserver import FileServer
from s3moto import BUCKET, moto_s3

KiB = 1024


@pytest.fixture(scope="module")
def origin(
    tmp_path_factory: pytest.TempPathFactory, wide_checkpoint: WrittenCheckpoint, single_checkpoint: WrittenCheckpoint
) -> Path:
    """``model/``: the 11 MiB checkpoint with a manifest; ``hf/``: a Hugging Face directory without one;
    ``tp2/``: ``model`` converted with ``--tp 2`` (per-rank files, per-rank digests)."""
    root = tmp_path_factory.mktemp("verify-origin")
    shutil.copytree(wide_checkpoint.root, root / "model")
    (root / "model" / MANIFEST_NAME).write_bytes(build_manifest(str(root / "model")).to_json())
    shutil.copytree(single_checkpoint.root, root / "hf")
    convert(root / "model", root / "tp2", tp=2)
    return root


@pytest.fixture
def server(origin: Path) -> Iterator[FileServer]:
    with FileServer(origin) as running:
        yield running


def manifest_of(root: Path) -> Manifest:
    return Manifest.from_json((root / MANIFEST_NAME).read_bytes(), where=str(root))


def largest(manifest: Manifest, prefix: str = "") -> TensorRecord:
    return max((t for t in manifest.tensors if t.file.startswith(prefix)), key=lambda t: t.nbytes)


def flip_on_disk(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0xFF]))


# -- remote loads ------------------------------------------------------------------------------------------------------


def test_remote_load_checks_every_tensor(server: FileServer, wide_checkpoint: WrittenCheckpoint) -> None:
    weights = preheat.load(server.url_for("model"), cache=False)
    assert_same_tensors(weights, wide_checkpoint.tensors)
    assert weights.report.verified
    assert weights.report.verified_tensors == len(wide_checkpoint.tensors)
    assert "UNVERIFIED" not in weights.report.summary()


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
@pytest.mark.parametrize("chunk", [64 * KiB, 4 * 1024 * KiB])
def test_a_byte_flipped_in_transit_stops_the_load_naming_tensor_file_and_source(
    server: FileServer, origin: Path, where: str, chunk: int
) -> None:
    manifest = manifest_of(origin / "model")
    target = largest(manifest)  # several 64 KiB reads, landing in any order on 4 threads
    offset = {
        "first byte": target.offset,
        "middle": target.offset + target.nbytes // 2 + 7,
        "last byte": target.offset + target.nbytes - 1,
    }[where]
    server.faults.corrupt_offsets = frozenset({offset})
    url = server.url_for("model")
    with pytest.raises(CheckpointError) as caught:
        preheat.load(url, cache=False, threads=4, chunk_bytes=chunk)
    assert caught.value.tensor == target.name
    message = str(caught.value)
    assert server.url_for(f"model/{target.file}") in message  # the file
    assert f"from {url} " in message  # the source as the caller named it
    assert target.name in message
    assert MANIFEST_NAME in message
    assert server.stats.snapshot().bytes_sent > 0


def test_a_failed_check_publishes_nothing_in_the_node_cache(server: FileServer, origin: Path, tmp_path: Path) -> None:
    target = largest(manifest_of(origin / "model"))
    server.faults.corrupt_offsets = frozenset({target.offset + 1})
    cache = ModelCache(tmp_path / "cache")
    with pytest.raises(CheckpointError, match="does not match its digest"):
        preheat.load(server.url_for("model"), cache=cache)
    assert cache.entries() == []


def test_remote_checkpoint_without_manifest_is_refused_unless_verify_false(
    server: FileServer, single_checkpoint: WrittenCheckpoint
) -> None:
    url = server.url_for("hf")
    with pytest.raises(CheckpointError, match=r"no preheat\.json") as caught:
        preheat.load(url, cache=False)
    assert "preheat convert" in str(caught.value)
    assert "verify=False" in str(caught.value)
    weights = preheat.load(url, cache=False, verify=False)
    assert_same_tensors(weights, single_checkpoint.tensors)
    assert not weights.report.verified
    assert weights.report.verified_tensors == 0
    assert any("verify=False" in note for note in weights.report.notes)
    assert "UNVERIFIED" in weights.report.summary()


def test_remote_tp_slices_of_an_unsharded_checkpoint_need_verify_false(server: FileServer) -> None:
    url = server.url_for("model")
    with pytest.raises(ConfigError, match="--tp 2"):
        preheat.load(url, cache=False, rank=1, world_size=2)
    weights = preheat.load(url, cache=False, rank=1, world_size=2, verify=False)
    assert not weights.report.verified
    assert any("verify=False" in note for note in weights.report.notes)


def test_presharded_ranks_are_checked_against_their_own_digests(
    server: FileServer, origin: Path, tmp_path: Path
) -> None:
    for rank in range(2):
        weights = preheat.load(server.url_for("tp2"), cache=False, rank=rank, world_size=2)
        assert weights.report.verified
        assert weights.report.verified_tensors == len(weights)
    target = largest(manifest_of(origin / "tp2"), prefix="rank-00001-of-00002/")
    server.faults.corrupt_offsets = frozenset({target.offset + target.nbytes // 3})
    with pytest.raises(CheckpointError) as caught:
        preheat.load(server.url_for("tp2"), cache=False, rank=1, world_size=2)
    assert caught.value.tensor == target.name
    assert target.file in str(caught.value)


# -- local loads -------------------------------------------------------------------------------------------------------


@pytest.fixture
def damaged(origin: Path, tmp_path: Path) -> tuple[Path, TensorRecord]:
    """A copy of ``model/`` whose largest tensor has one byte flipped on disk (its manifest still the original's)."""
    root = tmp_path / "model"
    shutil.copytree(origin / "model", root)
    target = largest(manifest_of(root))
    flip_on_disk(root / target.file, target.offset + target.nbytes // 2)
    return root, target


@pytest.mark.parametrize("mode", ["read", "direct"])
def test_a_byte_flipped_on_local_disk_stops_a_read_load(damaged: tuple[Path, TensorRecord], mode: str) -> None:
    root, target = damaged
    with pytest.raises(CheckpointError) as caught:
        preheat.load(root, mode=mode, chunk_bytes=64 * KiB, threads=4)
    assert caught.value.tensor == target.name
    assert str(root / target.file) in str(caught.value)


def test_mmap_stays_lazy_and_unverified_unless_asked(damaged: tuple[Path, TensorRecord]) -> None:
    root, target = damaged
    lazy = preheat.load(root, mode="mmap")
    assert not lazy.report.verified
    assert any("mmap" in note for note in lazy.report.notes)
    with pytest.raises(CheckpointError) as caught:
        preheat.load(root, mode="mmap", verify=True)
    assert caught.value.tensor == target.name


def test_local_load_with_a_manifest_is_verified(origin: Path, wide_checkpoint: WrittenCheckpoint) -> None:
    for mode in ("read", "direct"):
        weights = preheat.load(origin / "model", mode=mode)
        assert weights.report.verified, mode
        assert_same_tensors(weights, wide_checkpoint.tensors)
    checked = preheat.load(origin / "model", mode="mmap", verify=True)
    assert checked.report.verified
    assert "verify" in checked.report.stages


def test_local_hugging_face_directory_loads_unverified_unless_verify_true(origin: Path) -> None:
    weights = preheat.load(origin / "hf", mode="read")
    assert not weights.report.verified
    assert any("no preheat.json" in note for note in weights.report.notes)
    with pytest.raises(CheckpointError, match="preheat convert"):
        preheat.load(origin / "hf", mode="read", verify=True)


def test_local_tp_rank_checks_the_tensors_it_reads_whole(origin: Path) -> None:
    weights = preheat.load(origin / "model", mode="read", rank=0, world_size=2)
    replicated = [name for name in weights if name.endswith("norm.weight")]
    assert weights.report.verified_tensors == len(replicated)
    assert not weights.report.verified
    assert any("TP slices" in note for note in weights.report.notes)
    with pytest.raises(ConfigError, match="--tp 2"):
        preheat.load(origin / "model", mode="read", rank=0, world_size=2, verify=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_checks_bytes_in_its_staging_buffers(origin: Path, damaged: tuple[Path, TensorRecord]) -> None:
    weights = preheat.load(origin / "model", "cuda", mode="read", chunk_bytes=64 * KiB, threads=4)
    assert weights.report.verified
    with pytest.raises(CheckpointError) as caught:
        preheat.load(damaged[0], "cuda", mode="read", chunk_bytes=64 * KiB, threads=4)
    assert caught.value.tensor == damaged[1].name


# -- the readers: bytes are checked where they land, in any order ------------------------------------------------------

Reader = Callable[[int], ParallelReader | StagedReader]
READERS: dict[str, Reader] = {
    "parallel": lambda chunk: ParallelReader(4, chunk_bytes=chunk),
    # Host bytes exist only in its staging buffers, reused as soon as a read returns: it must wait for its turn.
    "staged": lambda chunk: StagedReader(torch.device("cpu"), 4, chunk_bytes=chunk),
}


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_readers_check_every_tensor_as_it_lands(
    damaged: tuple[Path, TensorRecord], origin: Path, reader: str, direct: bool
) -> None:
    manifest = manifest_of(origin / "model")
    expected = [ExpectedDigest(t.name, t.offset, t.nbytes, t.digest) for t in manifest.tensors]
    for root, bad in ((origin / "model", None), (damaged[0], damaged[1].name)):
        path = root / manifest.files[0].name
        size = path.stat().st_size
        check = TensorDigests(expected, path=str(path), source=str(root))
        dest = host_buffer(size, align=PAGE)
        ops = plan_ops([Extent(0, size, 0)], chunk_bytes=3 * PAGE)  # ~900 reads over 4 threads
        job = FileJob(str(path), ops, dest, size, direct=direct, landing=check)
        if bad is None:
            READERS[reader](3 * PAGE).run([job])
            assert check.finish() == len(expected)
            assert bytes(as_memoryview(dest)) == path.read_bytes()
        else:
            with pytest.raises(CheckpointError) as caught:
                READERS[reader](3 * PAGE).run([job])
            assert caught.value.tensor == bad


@settings(max_examples=200, deadline=None)
@given(data=st.data(), size=st.integers(1, 300), flip=st.booleans())
def test_pieces_may_land_in_any_order(data: st.DataObject, size: int, flip: bool) -> None:
    blob = bytes((i * 31 + 7) % 256 for i in range(size + 20))
    tensors = [ExpectedDigest("a", 10, size // 2, digest_bytes(blob[10 : 10 + size // 2]))]
    tensors.append(
        ExpectedDigest("b", 10 + size // 2, size - size // 2, digest_bytes(blob[10 + size // 2 : 10 + size]))
    )
    landed = bytearray(blob)
    if flip:
        landed[data.draw(st.integers(10, 10 + size - 1))] ^= 1
    cuts = sorted(data.draw(st.sets(st.integers(1, len(landed) - 1), max_size=12)))
    bounds = list(zip([0, *cuts], [*cuts, len(landed)], strict=True))
    order = data.draw(st.permutations(bounds))
    view = memoryview(bytes(landed))

    def land_all() -> int:
        check = TensorDigests(tensors, path="file", source="source")
        for lo, hi in order:
            check.landed(lo, view[lo:hi], stable=True)
        return check.finish()

    if flip:
        with pytest.raises(CheckpointError, match="does not match its digest"):
            land_all()
    else:
        assert land_all() == 2


# -- the CLI -----------------------------------------------------------------------------------------------------------


def preheat_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preheat.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_refuses_an_unverifiable_url_and_loads_it_with_no_verify(server: FileServer) -> None:
    url = server.url_for("hf")
    refused = preheat_cli("load", url)
    assert refused.returncode != 0
    assert "--no-verify" in refused.stderr
    loaded = preheat_cli("load", url, "--no-verify", "--json")
    assert loaded.returncode == 0, loaded.stderr
    (report,) = json.loads(loaded.stdout)
    assert report["verified"] is False
    checked = preheat_cli("load", server.url_for("model"), "--json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)[0]["verified"] is True


# -- S3 ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(origin: Path) -> Iterator[None]:
    """moto's S3 holding ``model/`` as ``s3://models/good/`` and, with one byte flipped in its largest tensor (the
    manifest unchanged), as ``s3://models/bad/``."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    with pytest.MonkeyPatch.context() as patch, moto_s3(patch) as client:
        target = largest(manifest_of(origin / "model"))
        for path in (origin / "model").iterdir():
            data = bytearray(path.read_bytes())
            client.put_object(Bucket=BUCKET, Key=f"good/{path.name}", Body=bytes(data))
            if path.name == target.file:
                data[target.offset + 5] ^= 0xFF
            client.put_object(Bucket=BUCKET, Key=f"bad/{path.name}", Body=bytes(data))
        yield


@pytest.mark.usefixtures("s3")
def test_s3_loads_are_checked_too(origin: Path) -> None:
    assert preheat.load(f"s3://{BUCKET}/good", cache=False).report.verified
    target = largest(manifest_of(origin / "model"))
    with pytest.raises(CheckpointError) as caught:
        preheat.load(f"s3://{BUCKET}/bad", cache=False)
    assert caught.value.tensor == target.name
    assert f"s3://{BUCKET}/bad" in str(caught.value)
