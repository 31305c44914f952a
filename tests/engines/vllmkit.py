"""Helpers of the tests that run vLLM itself (tests/engines/test_vllm_*.py): a tiny Llama vLLM's CPU attention
accepts, vLLM started in a child process (tests/engines/vllm_driver.py) that generates greedily, the load's timeline
stages, and a file dropped from the page cache so a load reads it from disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint

DRIVER = Path(__file__).with_name("vllm_driver.py")
PROMPTS = ["The capital of France is", "Cold starts are measured", "Hello, world!"]
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_vllm_tiny(root: Path, *, hidden: int = 256, intermediate: int = 512, layers: int = 2) -> Path:
    """A servable random Llama vLLM's CPU attention accepts (head_dim 64), float32, with a ``preheat.json``."""
    make_tiny_servable_model(root)
    config = json.loads((root / "config.json").read_text())
    shape = LlamaShape(config["vocab_size"], hidden, intermediate, layers, hidden // 64, 2)
    write_llama_checkpoint(root, shape, dtype=torch.float32)  # rewrites config.json for the new shape
    new = {**config, **shape.config(), "torch_dtype": "float32"}
    (root / "config.json").write_text(json.dumps(new, indent=2))
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


def side_files(src: Path, dst: Path) -> Path:
    """What vLLM reads before any loader runs (config.json, tokenizer), without the weights."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def run_engine(
    model: Path | str,
    load_format: str,
    *,
    extra: Mapping[str, object] | None = None,
    tp: int = 1,
    env: dict[str, str] | None = None,
    reload: bool = False,
) -> dict[str, Any]:  # Any: the driver's JSON
    """Start vLLM on ``model`` in a child process, generate greedily from ``PROMPTS``; the driver's RESULT
    (``reload``: then zero the weights and reload them through vLLM's ``reload_weights``, vllm_driver.py)."""
    job = {"model": str(model), "load_format": load_format, "extra": extra, "prompts": PROMPTS, "tp": tp}
    if reload:
        job["reload"] = True
    child_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), json.dumps(job)],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=600,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the engine died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    result["log"] = proc.stderr
    return result


def stages(path: Path) -> dict[str, dict[str, Any]]:  # Any: JSON as the timeline file holds it
    return {s["name"]: s for s in json.loads(path.read_text())["stages"]}


def drop_pages(path: Path) -> None:
    """Evict ``path`` from the page cache (works without root for pages nobody maps), so reads hit the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
