"""`preheat convert | verify | info`: real files in, real checkpoints out, checked the way users would check them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors, write
from preheat.checkpoint.layout import read_manifest
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.checkpoint.verify import verify_checkpoint
from preheat.checkpoint.writer import save_file
from preheat.convert import convert
from preheat.convert import pipeline as convert_module
from preheat.core.errors import CheckpointError, ConfigError
from preheat.testing.synthetic import LlamaShape


def preheat_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preheat.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [("keep", torch.bfloat16), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_convert_round_trips(
    sharded_checkpoint: WrittenCheckpoint, tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    result = convert(sharded_checkpoint.root, tmp_path / "out", dtype=dtype)
    loaded = preheat.load(tmp_path / "out")
    assert_same_tensors(loaded, {k: v.to(torch_dtype) for k, v in sharded_checkpoint.tensors.items()})
    assert result.identity == read_manifest(str(tmp_path / "out")).identity  # type: ignore[union-attr]
    assert result.source_format == "safetensors"
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors", MANIFEST_NAME]
    assert leftovers(tmp_path) == []


def test_config_says_the_stored_dtype(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    convert(single_checkpoint.root, tmp_path / "out", dtype="fp16")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float16"
    assert read_manifest(str(tmp_path / "out")).config == config  # type: ignore[union-attr]


def test_output_is_plain_safetensors_with_a_valid_index(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    convert(single_checkpoint.root, tmp_path / "out", shard_bytes=64 * 1024)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1
    found = {}
    for name in files:
        for tensor_name, tensor in load_file(out / name).items():  # the reference reader accepts every file
            assert index["weight_map"][tensor_name] == name
            found[tensor_name] = tensor
    assert_same_tensors(found, single_checkpoint.tensors)


def test_a_single_safetensors_file_converts_with_its_neighbours(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    convert(single_checkpoint.single_file, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    assert_same_tensors(preheat.load(tmp_path / "out"), single_checkpoint.tensors)


def test_tied_embeddings_are_stored_once(tmp_path: Path) -> None:
    tied = LlamaShape(vocab_size=251, tie_word_embeddings=True)
    written = write(tmp_path / "src", tied)
    tensors = dict(written.tensors)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # some exporters write both
    save_file(tensors, tmp_path / "src" / "model.safetensors")
    convert(tmp_path / "src", tmp_path / "out")
    loaded = preheat.load(tmp_path / "out")
    assert "lm_head.weight" not in loaded
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_tp2_writes_one_directory_per_rank_holding_its_slices(
    sharded_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    out = tmp_path / "tp2"
    convert(sharded_checkpoint.root, out, tp=2)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["rank-00000-of-00002", "rank-00001-of-00002"]
    for rank in (0, 1):
        for mode in ("read", "mmap"):
            got = preheat.load(out, rank=rank, world_size=2, mode=mode)
            want = preheat.load(sharded_checkpoint.root, rank=rank, world_size=2, mode="read")
            assert_same_tensors(got, dict(want))
            assert got.report.files == 1  # only its own file was opened


def test_a_rank_needs_only_its_own_directory(sharded_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    convert(sharded_checkpoint.root, out, tp=2)
    shutil.rmtree(out / "rank-00001-of-00002")
    rank0 = preheat.load(out, rank=0, world_size=2)
    assert_same_tensors(rank0, dict(preheat.load(sharded_checkpoint.root, rank=0, world_size=2, mode="read")))
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002.*missing"):
        preheat.load(out, rank=1, world_size=2)


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_presharded_checkpoint_refuses_another_world_size(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path, world_size: int
) -> None:
    convert(single_checkpoint.root, tmp_path / "tp2", tp=2)
    with pytest.raises(CheckpointError, match="world_size=2"):
        preheat.load(tmp_path / "tp2", rank=0, world_size=world_size)


def test_an_existing_destination_needs_force(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious").write_text("keep me")
    with pytest.raises(ConfigError, match="--force"):
        convert(single_checkpoint.root, out)
    assert (out / "precious").read_text() == "keep me"
    convert(single_checkpoint.root, out, force=True, dtype="fp16")
    assert not (out / "precious").exists()
    assert verify_checkpoint(out).ok
    assert leftovers(tmp_path) == []


def test_a_tensor_that_cannot_be_sharded_fails_before_anything_is_written(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match="not divisible by world size 3") as caught:
        convert(single_checkpoint.root, tmp_path / "out", tp=3)
    assert caught.value.tensor is not None
    assert list(tmp_path.iterdir()) == []


def test_an_unconvertible_tensor_midway_leaves_no_destination(tmp_path: Path) -> None:
    written = write(tmp_path / "src")
    tensors = dict(written.tensors)
    bad = "model.layers.1.mlp.down_proj.weight"  # late in the file: earlier shards are already on disk
    tensors[bad] = tensors[bad].clone()
    tensors[bad][3, 5] = float("inf")
    save_file(tensors, tmp_path / "src" / "model.safetensors")
    with pytest.raises(CheckpointError, match="infinite") as caught:
        convert(tmp_path / "src", tmp_path / "out", dtype="int8", shard_bytes=16 * 1024)
    assert caught.value.tensor == bad
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_a_full_disk_midway_leaves_no_destination(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def save_until_full(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", path)
        save_file(tensors, path, metadata)

    monkeypatch.setattr(convert_module, "save_file", save_until_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        convert(single_checkpoint.root, tmp_path / "out", shard_bytes=16 * 1024)
    assert len(calls) == 3
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_a_killed_conversion_leaves_a_temp_dir_that_the_next_one_removes(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / f"out.tmp-{int(gone.stdout)}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    assert preheat_cli("verify", str(stale)).returncode == 1  # never mistaken for a checkpoint
    convert(single_checkpoint.root, tmp_path / "out")
    assert leftovers(tmp_path) == []


def test_the_manifest_matches_a_fresh_hash_of_the_output(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    result = convert(single_checkpoint.root, tmp_path / "out", tp=2, dtype="int8")
    rebuilt = build_manifest(
        str(tmp_path / "out"),
        tp_dims={t.name: t.tp.dim for t in read_manifest(str(tmp_path / "out")).tensors if t.tp},  # type: ignore[union-attr]
        quant={t.name: t.quant for t in read_manifest(str(tmp_path / "out")).tensors if t.quant},  # type: ignore[union-attr]
    )
    assert rebuilt.identity == result.identity


def test_convert_cli_prints_a_json_summary(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    result = preheat_cli("convert", str(single_checkpoint.root), str(tmp_path / "out"), "--tp", "2", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tp"] == 2
    assert summary["files"] == 2
    assert summary["identity"].startswith("xxh3-128:")
    again = preheat_cli("convert", str(single_checkpoint.root), str(tmp_path / "out"))
    assert again.returncode == 1
    assert "--force" in again.stderr


def test_verify_passes_a_good_checkpoint(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    convert(single_checkpoint.root, tmp_path / "out", tp=2)
    result = preheat_cli("verify", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:")


def test_verify_names_the_tensor_whose_byte_flipped(single_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(single_checkpoint.root, out, tp=2)
    manifest = read_manifest(str(out))
    assert manifest is not None
    victim = next(t for t in manifest.tensors if t.name.endswith("layers.1.mlp.up_proj.weight") and t.tp.rank == 1)  # type: ignore[union-attr]
    with open(out / victim.file, "r+b") as handle:
        handle.seek(victim.offset + victim.nbytes // 2)
        byte = handle.read(1)
        handle.seek(victim.offset + victim.nbytes // 2)
        handle.write(bytes([byte[0] ^ 0x40]))
    result = preheat_cli("verify", str(out))
    assert result.returncode == 1
    assert "FAILED" in result.stdout
    assert repr(victim.name) in result.stdout
    assert victim.file in result.stdout
    report = json.loads(preheat_cli("verify", str(out), "--json").stdout)
    assert [(p["file"], p["tensor"]) for p in report["problems"]] == [(victim.file, victim.name)]


def test_verify_reports_a_changed_side_file_and_a_missing_one(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(single_checkpoint.root, out)
    (out / "config.json").write_text("{}")
    os.remove(out / "model.safetensors")
    report = verify_checkpoint(out)
    assert not report.ok
    assert {p.file for p in report.problems} == {"config.json", "model.safetensors"}
    assert "missing" in report.problems[0].message


def test_verify_without_a_manifest_says_what_to_do(single_checkpoint: WrittenCheckpoint) -> None:
    result = preheat_cli("verify", str(single_checkpoint.root))
    assert result.returncode == 1
    assert "preheat convert" in result.stderr


def test_info_json_reports_identity_size_dtypes_and_layout(
    single_checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    converted = convert(single_checkpoint.root, out, tp=2, dtype="int8")
    result = preheat_cli("info", str(out), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["identity"] == converted.identity
    assert info["size"] == converted.bytes
    assert info["tensors"] == converted.tensors
    assert set(info["dtypes"]) == {"BF16", "F32", "I8"}
    assert info["tp"]["world_size"] == 2
    assert [r["files"] for r in info["tp"]["ranks"]] == [
        ["rank-00000-of-00002/model-00001-of-00001.safetensors"],
        ["rank-00001-of-00002/model-00001-of-00001.safetensors"],
    ]
    assert info["quantization"]["method"] == "int8"
    assert info["model"]["model_type"] == "llama"
    human = preheat_cli("info", str(out))
    assert human.returncode == 0
    assert converted.identity in human.stdout
