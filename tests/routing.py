"""Helpers for the router tests: real replicas (``preheat serve`` subprocesses), an in-process router in front of
them, a whole ``preheat up`` fleet, and a TCP proxy that makes a replica slow on demand. Nothing of the router is
mocked."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from netfaults import LoopbackProxy
from preheat.router.app import RouterService
from preheat.router.cluster import ServerProcess
from preheat.router.settings import RouterSettings
from serving import Client

NAME = "tiny"


def start_up(
    model: Path, *extra: str, lines: list[str] | None = None, stderr: Path | None = None
) -> tuple[subprocess.Popen[str], str, list[int], list[str]]:
    """Run ``preheat up`` until it prints ``ready``; returns it, the router's URL, every child's pid and the
    replicas' URLs (standby replicas' included, after the serving ones). ``lines``: gets what it printed on stdout
    up to ``ready``; ``stderr``: a file for its stderr (its warnings and the children's log; a file, not a pipe,
    so that nothing blocks once the test stops reading)."""
    command = [sys.executable, "-m", "preheat", "up", str(model), "--replicas", "2", "--port", "0",
               "--served-model-name", NAME, "--max-model-len", "256", *extra]  # fmt: skip
    with contextlib.ExitStack() as files:
        errors = files.enter_context(stderr.open("w")) if stderr is not None else subprocess.DEVNULL
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
    pids: list[int] = []
    router = ""
    replicas: list[str] = []
    assert up.stdout is not None
    for line in up.stdout:
        if lines is not None:
            lines.append(line.rstrip("\n"))
        if found := re.match(r"(replica \d+|standby \d+|router): (\S+) \(pid (\d+)\)", line):
            pids.append(int(found.group(3)))
            router = found.group(2) if found.group(1) == "router" else router
            replicas += [found.group(2)] if found.group(1) != "router" else []
        if line.startswith("ready: "):
            return up, router, pids, replicas
    up.wait()
    pytest.fail(f"preheat up exited with {up.returncode} before it was ready")


def start_replicas(model: str, count: int, *extra: str) -> list[ServerProcess]:
    """``count`` replicas of ``model`` started together (their loads overlap), each waited for."""
    replicas: list[ServerProcess] = []
    try:
        for _ in range(count):
            replicas.append(ServerProcess(model, "--served-model-name", NAME, *extra))
        for replica in replicas:
            replica.wait_ready(timeout=120)
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


@contextlib.contextmanager
def running_router(replicas: Sequence[str], policy: str = "round-robin", **flags: Any) -> Iterator[RouterService]:
    """A router on a free port in this process (its own threads), stopped on exit; a ``findings`` flag (a callable)
    feeds its dashboard instead of becoming a setting."""
    findings: Callable[[], Mapping[str, Any] | None] | None = flags.pop("findings", None)
    unknown = set(flags) - {f.name for f in fields(RouterSettings)}
    assert not unknown, f"not RouterSettings fields (a renamed flag?): {sorted(unknown)}"  # resolve() ignores them
    settings = RouterSettings.resolve({"replicas": list(replicas), "policy": policy, "port": 0, **flags}, {})
    service = RouterService(settings, findings)
    service.start()
    thread = threading.Thread(target=service.serve, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.httpd.shutdown()
        thread.join(timeout=10)
        service.close()


def replica_of(reply: Any) -> str:  # Any: serving.Reply or serving.Stream
    return str(reply.headers.get("X-Preheat-Replica"))


def wait_until(condition: Any, what: str, deadline: float = 30.0) -> None:  # Any: a zero-argument callable
    """Poll ``condition()`` until true; raise naming ``what`` after ``deadline`` s (a hang, not a speed check)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def router_metric(url: str, name: str, **labels: str) -> float:
    return Client(url).metric(name, **labels)


class SlowProxy(LoopbackProxy):
    """A TCP proxy to a replica that holds each piece of its answers for ``delay`` seconds (0: a plain pipe), until
    ``release()``: a replica that answers slowly, for as long as a test wants."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.delay = 0.0
        self.released = threading.Event()

    def release(self) -> None:
        self.delay = 0.0
        self.released.set()

    def closing(self) -> None:
        self.released.set()

    def handle(self, client: socket.socket) -> None:
        try:
            upstream = self.connect_upstream()
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
        self._pump(upstream, client, True)

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if answers and self.delay:
                    self.released.wait(self.delay)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
