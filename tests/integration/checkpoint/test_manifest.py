"""The preheat.json manifest: identity, validation, and what a loader trusts it for."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import preheat
from checkpoints import WrittenCheckpoint, write
from hostile import ScriptedServer, endless
from preheat.checkpoint.layout import open_checkpoint, read_remote_manifest, resolve_files, resolve_remote_names
from preheat.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    QuantInfo,
    TensorRecord,
    TPInfo,
    build_manifest,
    digest_bytes,
    file_digest,
    hash_file,
    rank_dir,
)
from preheat.core.errors import CheckpointError, ConfigError, SourceError
from preheat.sources.base import READ_BYTES_LIMIT
from preheat.sources.http import HTTPOrigin
from preheat.sources.local import LocalOrigin
from preheat.sources.net import NetSettings
from preheat.sources.s3 import S3Origin
from preheat.testing.fileserver import Faults, FileServer
from s3moto import BUCKET, moto_s3


def manifest_of(checkpoint: WrittenCheckpoint) -> Manifest:
    return build_manifest(str(checkpoint.root))


def written(root: Path) -> Manifest:
    """Build and write the manifest of ``root``, as ``preheat convert`` does."""
    built = build_manifest(str(root))
    (root / MANIFEST_NAME).write_bytes(built.to_json())
    return built


def test_digest_format_is_xxh3_128_hex() -> None:
    digest = digest_bytes(b"preheat")
    assert digest.startswith("xxh3-128:")
    assert len(digest) == len("xxh3-128:") + 32
    assert digest == digest_bytes(memoryview(b"preheat"))


def test_file_digest_equals_digest_of_its_bytes(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    (tmp_path / "blob").write_bytes(data)
    assert file_digest(str(tmp_path / "blob")) == digest_bytes(data)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=300),
    cuts=st.lists(st.tuples(st.integers(0, 320), st.integers(0, 80)), max_size=6),
    chunk=st.integers(1, 64),
)
def test_range_digests_match_the_bytes_at_any_chunk_size(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, cuts: list[tuple[int, int]], chunk: int
) -> None:
    path = tmp_path_factory.mktemp("hash") / "blob"
    path.write_bytes(data)
    whole, parts = hash_file(str(path), cuts, chunk_bytes=chunk)  # small chunks put range boundaries everywhere
    assert whole == digest_bytes(data)
    assert parts == [digest_bytes(data[start : start + length]) for start, length in cuts]


def test_manifest_describes_every_tensor_and_file(single_checkpoint: WrittenCheckpoint) -> None:
    built = manifest_of(single_checkpoint)
    assert built.format_version == FORMAT_VERSION
    assert [f.name for f in built.files] == ["model.safetensors"]
    assert [f.name for f in built.extra_files] == ["config.json"]
    assert built.config["model_type"] == "llama"
    by_name = {t.name: t for t in built.tensors}
    assert sorted(by_name) == sorted(single_checkpoint.tensors)
    raw = single_checkpoint.single_file.read_bytes()
    for name, tensor in single_checkpoint.tensors.items():
        record = by_name[name]
        assert record.shape == tuple(tensor.shape)
        assert record.dtype == "BF16"
        assert record.digest == digest_bytes(raw[record.offset : record.offset + record.nbytes])
        assert record.tp is None
        assert record.quant is None


def test_identity_is_stable_across_processes(single_checkpoint: WrittenCheckpoint) -> None:
    here = manifest_of(single_checkpoint).identity
    code = (
        "from preheat.checkpoint.manifest import build_manifest; import sys; "
        "print(build_manifest(sys.argv[1]).identity)"
    )
    there = subprocess.run(
        [sys.executable, "-c", code, str(single_checkpoint.root)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == here


def test_identity_survives_a_json_round_trip_in_any_formatting(single_checkpoint: WrittenCheckpoint) -> None:
    built = manifest_of(single_checkpoint)
    again = Manifest.from_json(built.to_json(), where="m")
    assert again == built
    assert again.identity == built.identity
    reformatted = json.dumps(json.loads(built.to_json()), indent=7).encode()  # other whitespace, same content
    assert Manifest.from_json(reformatted, where="m").identity == built.identity
    assert json.loads(built.to_json())["identity"] == built.identity


def test_identity_changes_when_one_byte_of_one_tensor_changes(fresh_checkpoint: WrittenCheckpoint) -> None:
    before = manifest_of(fresh_checkpoint)
    victim = before.tensors[3]
    with open(fresh_checkpoint.single_file, "r+b") as handle:
        handle.seek(victim.offset + 1)
        old = handle.read(1)
        handle.seek(victim.offset + 1)
        handle.write(bytes([old[0] ^ 0x01]))
    after = manifest_of(fresh_checkpoint)
    assert after.identity != before.identity
    changed = [a.name for a, b in zip(before.tensors, after.tensors, strict=True) if a.digest != b.digest]
    assert changed == [victim.name]


def _edits() -> dict[str, Callable[[Manifest], Manifest]]:
    def tensor0(m: Manifest, **changes: object) -> Manifest:
        first = dataclasses.replace(m.tensors[0], **changes)  # type: ignore[arg-type]
        return dataclasses.replace(m, tensors=(first, *m.tensors[1:]))

    return {
        "config value": lambda m: dataclasses.replace(m, config={**m.config, "rope_theta": 10000.5}),
        "config key": lambda m: dataclasses.replace(m, config={**m.config, "extra": None}),
        "tensor name": lambda m: tensor0(m, name="renamed"),
        "tensor offset": lambda m: tensor0(m, offset=m.tensors[0].offset + 2),
        "tensor shape": lambda m: tensor0(m, shape=tuple(reversed(m.tensors[0].shape))),
        "tensor dtype": lambda m: tensor0(m, dtype="F16"),
        "tensor digest": lambda m: tensor0(m, digest="xxh3-128:" + "0" * 32),
        "tp info": lambda m: tensor0(m, tp=TPInfo(0, 0, 1)),
        "quant info": lambda m: tensor0(m, quant=QuantInfo("int8", "x.scale", "BF16")),
        "file size": lambda m: dataclasses.replace(m, files=(dataclasses.replace(m.files[0], size=1),)),
        "extra file digest": lambda m: dataclasses.replace(
            m, extra_files=(FileRecord("config.json", 1, "xxh3-128:" + "1" * 32),)
        ),
        "tensor order": lambda m: dataclasses.replace(m, tensors=tuple(reversed(m.tensors))),
        "tp world size": lambda m: dataclasses.replace(m, tp_world_size=2),
    }


@pytest.mark.parametrize("edit", sorted(_edits()))
def test_identity_changes_when_any_field_changes(single_checkpoint: WrittenCheckpoint, edit: str) -> None:
    built = manifest_of(single_checkpoint)
    assert _edits()[edit](built).identity != built.identity


def test_tampered_manifest_is_refused_naming_it(tmp_path: Path) -> None:
    root = write(tmp_path / "model").root
    written(root)
    doc = json.loads((root / MANIFEST_NAME).read_text())
    doc["tensors"][0]["digest"] = "xxh3-128:" + "a" * 32  # still well formed: only the identity gives it away
    (root / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="edited after it was written") as caught:
        preheat.load(root)
    assert caught.value.path == str(root / MANIFEST_NAME)


def test_manifest_listing_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    root = write(tmp_path / "model", shards=2).root
    written(root)
    os.remove(root / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"listed in .*preheat\.json but missing") as caught:
        preheat.load(root)
    assert caught.value.path == str(root / "model-00002-of-00002.safetensors")


def test_a_replaced_weights_file_is_caught_before_any_data_is_read(tmp_path: Path) -> None:
    root = write(tmp_path / "model").root
    written(root)
    from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

    write_llama_checkpoint(tmp_path / "other", LlamaShape(vocab_size=300))
    shutil.copy(tmp_path / "other" / "model.safetensors", root / "model.safetensors")
    with pytest.raises(CheckpointError, match="says"):
        open_checkpoint(root)


def test_loader_takes_the_file_list_from_the_manifest(tmp_path: Path) -> None:
    root = write(tmp_path / "model").root
    written(root)
    (root / "scratch.safetensors").write_bytes(b"not listed, so never opened")
    assert resolve_files(str(root)) == [str(root / "model.safetensors")]
    assert len(preheat.load(root)) > 0


def _doc(checkpoint: WrittenCheckpoint) -> dict[str, object]:
    doc: dict[str, object] = json.loads(manifest_of(checkpoint).to_json())
    del doc["identity"]  # optional: edits below would otherwise fail the identity check first
    return doc


def _set(doc: dict[str, object], path: tuple[str | int, ...], value: object) -> None:
    target: object = doc
    for key in path[:-1]:
        target = target[key]  # type: ignore[index]
    target[path[-1]] = value  # type: ignore[index]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("format_version",), 2, "format_version 2"),
        (("files", 0, "name"), "/etc/passwd", "refusing file name"),
        (("files", 0, "name"), "../model.safetensors", "refusing file name"),
        (("extra_files", 0, "name"), "a/../../b", "refusing file name"),
        (("extra_files", 0, "name"), ".journal", r"'\.journal' in extra_files: names starting with '\.' .* reserved"),
        (("files", 0, "name"), ".cache/model.safetensors", r"names starting with '\.' \(files or directories\)"),
        (("files", 0, "digest"), "md5:abc", "digest of"),
        (("files", 0, "size"), -1, "size of"),
        (("tensors", 0, "file"), "other.safetensors", "not listed in files"),
        (("tensors", 0, "dtype"), "F128", "unknown dtype"),
        (("tensors", 0, "nbytes"), 3, "cannot span"),
        (("tensors", 0, "offset"), 10**12, "past the end"),
        (("tensors", 0, "shape"), "big", "must be a JSON array"),
        (("tensors", 0, "quant"), {"method": "int4", "scale": "s", "compute_dtype": "BF16"}, "quantization method"),
        (("tensors", 0, "tp"), {"dim": 0, "rank": 0, "world_size": 4}, "tp_world_size 1"),
        (("tp_world_size",), 0, "tp_world_size must be"),
        (("config",), [], "config must be a JSON object"),
    ],
)
def test_invalid_manifests_are_refused_naming_the_manifest(
    single_checkpoint: WrittenCheckpoint, path: tuple[str | int, ...], value: object, message: str
) -> None:
    doc = _doc(single_checkpoint)
    _set(doc, path, value)
    with pytest.raises(CheckpointError, match=message) as caught:
        Manifest.from_json(json.dumps(doc).encode(), where="the/preheat.json")
    assert caught.value.path == "the/preheat.json"
    assert str(caught.value).startswith("the/preheat.json: ")


def test_convert_leaves_dot_files_and_dot_directories_out_of_the_manifest(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(single_checkpoint.root, root)
    (root / ".journal").write_text("a pull's journal")
    (root / ".env").write_text("SECRET=1")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / ".hidden").write_text("x")
    (root / "tokenizer" / "vocab.txt").write_text("a b c")
    names = [record.name for record in (*written(root).files, *written(root).extra_files)]
    assert "tokenizer/vocab.txt" in names
    assert not [name for name in names if any(part.startswith(".") for part in name.split("/"))]


@pytest.mark.parametrize("key", ["format_version", "config", "files", "extra_files", "tensors", "tp_world_size"])
def test_a_missing_key_is_named(single_checkpoint: WrittenCheckpoint, key: str) -> None:
    doc = _doc(single_checkpoint)
    del doc[key]
    with pytest.raises(CheckpointError, match=key):
        Manifest.from_json(json.dumps(doc).encode(), where="m.json")


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[1, 2]", b'{"format_version": NaN}'])
def test_garbage_is_not_a_manifest(data: bytes) -> None:
    with pytest.raises(CheckpointError, match=r"m\.json"):
        Manifest.from_json(data, where="m.json")


def _tp_manifest() -> Manifest:
    def record(rank: int) -> TensorRecord:
        return TensorRecord(
            "w",
            f"rank-{rank:05d}-of-00002/a.safetensors",
            8,
            4,
            "F32",
            (1,),
            "xxh3-128:" + "0" * 32,
            TPInfo(0, rank, 2),
        )

    files = tuple(FileRecord(f"rank-{r:05d}-of-00002/a.safetensors", 12, "xxh3-128:" + "0" * 32) for r in (0, 1))
    return Manifest(FORMAT_VERSION, {}, files, (record(0), record(1)), 2)


def test_files_for_rank_of_a_presharded_checkpoint() -> None:
    tp = Manifest.from_json(_tp_manifest().to_json(), where="m")
    assert [f.name for f in tp.files_for_rank(1, 2)] == ["rank-00001-of-00002/a.safetensors"]
    with pytest.raises(CheckpointError, match="world_size=2"):
        tp.files_for_rank(0, 4)
    with pytest.raises(CheckpointError, match="pre-sharded"):
        tp.files_for_rank(0, 1)
    with pytest.raises(ConfigError):
        tp.files_for_rank(2, 2)


def test_files_for_rank_of_an_unsharded_checkpoint_is_every_file(single_checkpoint: WrittenCheckpoint) -> None:
    built = manifest_of(single_checkpoint)
    assert built.files_for_rank(3, 4) == list(built.files)


def test_a_rank_without_files_is_refused() -> None:
    broken = dataclasses.replace(_tp_manifest(), tp_world_size=3)
    with pytest.raises(CheckpointError):
        Manifest.from_json(broken.to_json(), where="m")


def test_remote_names_come_from_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "tp"
    for rank in (0, 1):
        write(root / f"rank-{rank:05d}-of-00002", seed=rank)
        os.remove(root / f"rank-{rank:05d}-of-00002" / "config.json")
    written(root)
    origin = LocalOrigin(str(root))
    assert resolve_remote_names(origin, rank=1, world_size=2) == ["rank-00001-of-00002/model.safetensors"]


# -- bounds: many records, and manifests from servers that send too much ---------------------------------------------
DIGEST = "xxh3-128:" + "cd" * 16


def many_files(count: int, world: int = 1) -> Manifest:
    """A manifest of ``count`` one-tensor files (or, with ``world``, one file per rank of a pre-sharded checkpoint)."""
    names = [f"{rank_dir(i, world)}/m.safetensors" if world > 1 else f"shard-{i:06d}.safetensors" for i in range(count)]
    files = tuple(FileRecord(name, 16, DIGEST) for name in names)
    tensors = tuple(
        TensorRecord(
            "w" if world > 1 else f"t{i}", name, 8, 8, "F32", (2,), DIGEST, TPInfo(0, i, world) if world > 1 else None
        )
        for i, name in enumerate(names)
    )
    return Manifest(FORMAT_VERSION, {}, files, tensors, world, ())


# The name and rank checks used to be quadratic (20,000 files: 10.8 s; 5,000 ranks: 16 s). These check the answers on
# big inputs; a quadratic regression is caught by the per-test timeout (nothing here measures time).
def test_a_manifest_of_20000_files_parses_and_still_finds_a_duplicate() -> None:
    manifest = many_files(20_000)
    raw = manifest.to_json()
    assert Manifest.from_json(raw, where="big") == manifest
    doc = json.loads(raw)
    doc["extra_files"] = [doc["files"][-1]]
    del doc["identity"]
    with pytest.raises(CheckpointError, match=r"'shard-019999\.safetensors' is listed more than once"):
        Manifest.from_json(json.dumps(doc).encode(), where="big")


def test_a_manifest_pre_sharded_for_5000_ranks_parses_and_still_finds_a_missing_rank() -> None:
    manifest = many_files(5_000, world=5_000)
    assert Manifest.from_json(manifest.to_json(), where="tp") == manifest
    assert [t.name for t in manifest.tensors_in(f"{rank_dir(4_999, 5_000)}/m.safetensors")] == ["w"]
    doc = json.loads(manifest.to_json())
    del doc["identity"]
    doc["files"].pop(1234)
    doc["tensors"].pop(1234)
    with pytest.raises(CheckpointError, match="rank 1234 of 5000 has no files"):
        Manifest.from_json(json.dumps(doc).encode(), where="tp")


def test_an_oversized_remote_manifest_is_refused_without_being_read(tmp_path: Path) -> None:
    with open(tmp_path / MANIFEST_NAME, "wb") as handle:
        handle.truncate(READ_BYTES_LIMIT + 1)  # sparse: the server announces it, the client never downloads it
    with FileServer(str(tmp_path)) as server, HTTPOrigin(server.url) as origin:
        url = origin.join(MANIFEST_NAME)
        with pytest.raises(SourceError, match=f"GET {url}: refused: .* at most {READ_BYTES_LIMIT} bytes") as caught:
            open_checkpoint(origin.uri)
        assert f"is {READ_BYTES_LIMIT + 1} bytes" in str(caught.value)
        assert origin.stats.snapshot().bytes == 0


def test_a_manifest_cut_short_in_transit_is_fetched_again_not_half_parsed(tmp_path: Path) -> None:
    manifest = many_files(100)
    (tmp_path / MANIFEST_NAME).write_bytes(manifest.to_json())
    with FileServer(str(tmp_path), faults=Faults(drop_after_bytes=1000)) as server, HTTPOrigin(server.url) as origin:
        assert read_remote_manifest(origin) == manifest
        assert server.stats.snapshot().drops == 1
        assert origin.stats.snapshot().retries == 1


def test_a_manifest_streamed_without_end_is_cut_at_the_limit() -> None:
    def script(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Iterable[bytes]]:
        return 200, {"Content-Type": "application/json"}, endless(b" " * 65536)  # chunked: no length announced

    limit = 1 << 20
    with (
        ScriptedServer(script) as server,
        HTTPOrigin(server.url, settings=NetSettings(whole_file_limit=limit)) as origin,
    ):
        with pytest.raises(SourceError, match=f"at most {limit} bytes, and this one sent more than that"):
            read_remote_manifest(origin)
        with pytest.raises(SourceError, match=rf"{server.url}/config\.json"):
            origin.read_bytes("config.json")


def test_an_oversized_s3_object_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with moto_s3(monkeypatch) as client:
        client.put_object(Bucket=BUCKET, Key="big/preheat.json", Body=b" " * 4096)
        origin = S3Origin(f"s3://{BUCKET}/big", settings=NetSettings(whole_file_limit=1024, attempts=1))
        with pytest.raises(SourceError, match=r"s3://models/big/preheat\.json: refused: .* and this one is 4096 bytes"):
            origin.read_bytes(MANIFEST_NAME)
        assert S3Origin(f"s3://{BUCKET}/big").read_bytes(MANIFEST_NAME) == b" " * 4096
