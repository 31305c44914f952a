"""``preheat demo`` end to end, as ``make demo`` runs it: convert SmolLM2 once into the node cache, serve, ask, show the
timeline, and leave no server behind, even when interrupted.

The node cache lives under the test cache (``tests/smollm2.py``), so the ~25 s conversion happens once per machine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from preheat.cli.demo import next_steps, preheat_command, render_next_steps
from preheat.testing.smollm2 import cache_root, gguf_path

pytestmark = pytest.mark.slow


def demo_env() -> dict[str, str]:
    gguf_path()  # skips without the wheel or the GGUF reader
    return {**os.environ, "PREHEAT_CACHE_DIR": str(cache_root() / "node-cache"), "PYTHONUNBUFFERED": "1"}


def port_is_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def test_demo_answers_paris_and_shows_the_timeline() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "preheat", "demo"],
        env=demo_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    answer = next(line for line in out.splitlines() if line.startswith("A: "))
    assert "Paris" in answer
    for stage in ("imports", "engine_imports", "weight_load", "warmup", "ready", "first_request_ttft"):
        assert re.search(rf"^{stage}\s", out, re.MULTILINE), stage
    assert "idle accelerator" in out
    assert "time to first token:" in out
    url = re.search(r"listening on (http://\S+);", out)
    assert url is not None
    assert port_is_closed(url.group(1)), "the demo's server is gone"
    # It ends by saying what to run next: the steps tests/integration/test_readme.py finds in the README and runs.
    assert out.rstrip().endswith(render_next_steps(next_steps(preheat_command()), preheat_command()))


def test_interrupted_demo_leaves_no_server_behind() -> None:
    # With the node cache warm, a whole demo takes ~2 s after its server is listening; on a loaded 2-core VM this
    # test can be scheduled late enough that the demo has finished before the Ctrl-C is sent (seen once in CI).
    # Such a run did not test an interruption, so it is run again; an interrupted run must exit 130 and leave its
    # server stopped.
    for _attempt in range(3):
        interrupted = interrupt_demo()
        if interrupted:
            return
    pytest.fail("the demo finished before Ctrl-C reached it, three times")


def interrupt_demo() -> bool:
    """Start the demo, Ctrl-C it once its server listens; False when the demo had already finished by then."""
    env = demo_env()  # the node cache was filled by the test above, so the server starts at once
    demo = subprocess.Popen(
        [sys.executable, "-m", "preheat", "demo"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        url = None
        lines = []
        for line in demo.stdout:
            lines.append(line)
            match = re.search(r"listening on (http://\S+);", line)
            if match:
                url = match.group(1)
                break
        assert url is not None, lines
        demo.send_signal(signal.SIGINT)  # Ctrl-C while the model loads or answers
        demo.wait(timeout=60)
        if demo.returncode == 0:
            rest = demo.stdout.read()
            assert "answer complete" in rest, rest  # a clean exit only for a demo that did all of its work
            assert port_is_closed(url), "the finished demo's server is gone"
            return False
        assert demo.returncode == 130
        deadline = time.monotonic() + 30
        while not port_is_closed(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_is_closed(url), "the server was stopped with the demo"
        return True
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if demo.stdout is not None:
            demo.stdout.close()
