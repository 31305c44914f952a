"""``preheat.json`` from anyone (a peer, an origin): ``Manifest.from_json`` returns a manifest that passed every check,
or raises ``CheckpointError`` naming where it came from; never another exception, whatever the bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.checkpoint.manifest import FileRecord, Manifest, QuantInfo, TensorRecord, TPInfo, rank_dir
from preheat.checkpoint.safetensors import MAX_DIMS, MAX_INT
from preheat.core.errors import CheckpointError
from strategies import FUZZ, huge_ints, json_values

WHERE = "http://origin/ckpt/preheat.json"
DIGEST = "xxh3-128:" + "ab" * 16


def sample(world: int) -> Manifest:
    """A small valid manifest: one file per rank, a weight and its int8 scale in each."""
    files, tensors = [], []
    for rank in range(world):
        name = f"{rank_dir(rank, world)}/model.safetensors" if world > 1 else "model.safetensors"
        files.append(FileRecord(name, 4096, DIGEST))
        tp = TPInfo(0, rank, world) if world > 1 else None
        tensors.append(TensorRecord("w", name, 8, 64, "I8", (8, 8), DIGEST, tp, QuantInfo("int8", "w.scale", "BF16")))
        tensors.append(TensorRecord("w.scale", name, 72, 16, "BF16", (8,), DIGEST, tp))
    extra = (FileRecord("config.json", 10, DIGEST),)
    return Manifest(1, {"model_type": "llama", "nested": {"a": [1, 2]}}, tuple(files), tuple(tensors), world, extra)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:  # Any: JSON values and keys
    """Every place inside a JSON value, as key/index paths (the root is ``()``)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += paths(inner, (*prefix, index))
    return found


def replaced(doc: Any, path: tuple[Any, ...], new: Any) -> Any:  # Any: JSON values
    if not path:
        return new
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = replaced(doc[path[0]], path[1:], new)
    return copy


@st.composite
def mutated_manifests(draw: st.DrawFn) -> bytes:
    """A valid manifest's JSON with one value anywhere in it replaced (and its identity kept or dropped)."""
    doc: dict[str, Any] = json.loads(sample(draw(st.sampled_from([1, 2, 3]))).to_json())
    if draw(st.booleans()):
        del doc["identity"]  # identity is optional: without it, the mutated manifest reaches every other check
    path = draw(st.sampled_from(paths(doc)))
    new = draw(json_values(6) | huge_ints() | st.sampled_from(["../../etc/passwd", "/abs", "", "a//b", "rank-1"]))
    return json.dumps(replaced(doc, path, new)).encode()


def parsed(raw: bytes) -> Manifest | CheckpointError:
    try:
        return Manifest.from_json(raw, where=WHERE)
    except CheckpointError as exc:
        return exc


def check(raw: bytes) -> None:
    manifest = parsed(raw)
    if isinstance(manifest, CheckpointError):
        assert manifest.path == WHERE
        assert WHERE in str(manifest)
        return
    assert Manifest.from_json(manifest.to_json(), where=WHERE) == manifest
    names = [f.name for f in (*manifest.files, *manifest.extra_files)]
    assert len(set(names)) == len(names)
    by_name = {f.name: f for f in manifest.files}
    for tensor in manifest.tensors:
        assert 0 <= tensor.offset <= tensor.offset + tensor.nbytes <= by_name[tensor.file].size <= MAX_INT
        assert len(tensor.shape) <= MAX_DIMS


@FUZZ
@given(mutated_manifests())
def test_a_manifest_with_any_value_changed_is_valid_or_a_checkpoint_error(raw: bytes) -> None:
    check(raw)


@FUZZ
@given(st.binary(max_size=300) | json_values().map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_manifest_or_a_checkpoint_error(raw: bytes) -> None:
    check(raw)


def test_the_samples_are_valid() -> None:
    for world in (1, 2, 3):
        manifest = sample(world)
        assert Manifest.from_json(manifest.to_json(), where=WHERE) == manifest


def plain_body() -> bytes:
    """The one-rank sample as compact JSON without its identity, for byte-level edits."""
    doc = json.loads(sample(1).to_json())
    del doc["identity"]
    return json.dumps(doc).encode()


def hostile_manifests() -> dict[str, bytes]:
    body = plain_body()
    return {
        "nesting": b"[" * 100_000,
        "deep config": body.replace(b'"config": {', b'"config": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b", "),
        "5000-digit size": body.replace(b'"size": 4096', b'"size": ' + b"9" * 5_000),
        "size past 2**63": body.replace(b'"size": 4096', b'"size": ' + str(2**63).encode()),
        "huge shape": body.replace(b'"shape": [8, 8]', b'"shape": [' + b", ".join([b"9" * 4000] * 100) + b"]"),
        "NaN": body.replace(b'"size": 4096', b'"size": NaN'),
        "rank beyond any": body.replace(b'"tp_world_size": 1', b'"tp_world_size": ' + str(10**18).encode()),
        "unhashable quant method": body.replace(b'"method": "int8"', b'"method": []'),
    }


@pytest.mark.parametrize("case", sorted(hostile_manifests()))
def test_hostile_manifests_are_refused_not_crashed_on(case: str) -> None:
    raw = hostile_manifests()[case]
    assert raw != plain_body()  # the edit found its place
    assert Manifest.from_json(plain_body(), where=WHERE) == sample(1)
    with pytest.raises(CheckpointError, match=WHERE):
        Manifest.from_json(raw, where=WHERE)
