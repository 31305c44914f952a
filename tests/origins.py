"""Model origins for the node-cache tests: a checkpoint as an origin serves it (Hugging Face layout, with or without
a ``preheat.json``), another version of its weights as an upload would write it, and the check that a published entry
holds exactly one version."""

from __future__ import annotations

from pathlib import Path

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

MEDIUM = LlamaShape(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4)  # ~5 MB in bf16


def make_origin(root: Path, *, seed: int = 0, manifest: bool = True, shape: LlamaShape = MEDIUM) -> Path:
    """A checkpoint as an origin serves it: HF layout in two shards, plus preheat.json when ``manifest``."""
    write_llama_checkpoint(root, shape, shards=2, seed=seed)
    if manifest:
        (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


def weight_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def new_version(origin: Path, seed: int) -> dict[str, bytes]:
    """Other weights of the same shapes (so every file keeps its size), as an upload would write them."""
    fresh = origin.parent / f"{origin.name}-v{seed}"
    write_llama_checkpoint(fresh, MEDIUM, shards=2, seed=seed)
    return {p.name: p.read_bytes() for p in weight_files(fresh)}


def assert_entry_holds(entry: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (Path(entry) / name).read_bytes() == data, f"{name} is not exactly the origin's current version"
