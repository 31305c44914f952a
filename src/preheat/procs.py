"""Child processes that never outlive their parent: ``pdeathsig`` for any child, and ``ServerProcess``, a
``preheat serve`` started on a free port, waited for, and always stopped.

Used by ``preheat demo``, ``preheat up`` (``router/cluster.py``), the benchmarks and the tests; it sits below the
router and the server, which are siblings, so that both can use it, and above ``preheat.http``, whose client polls
``/health``. It starts ``preheat serve`` as a command and imports nothing of the server. The child never outlives
its parent: ``stop()`` runs from ``__exit__`` (Ctrl-C included), and on Linux the kernel also sends it SIGTERM if
the parent dies outright (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from preheat.errors import ProcessError
from preheat.http.client import HTTPClientError, Timeouts, request

HEALTH_TIMEOUT = 600.0


PR_SET_PDEATHSIG = 1


def pdeathsig() -> Callable[[], None] | None:
    """A function to run in the child between fork and exec that asks Linux for SIGTERM when the parent dies.

    Everything is looked up here, in the parent: after a fork in a threaded parent (pytest, the benchmark) the child
    must not import or load libraries, only make the one system call. Linux sends the signal when the *thread* that
    forked the child exits, not the process: start children from a thread that lives as long as they should (the
    main thread, or one long-lived spawner), never from a short-lived worker thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return arm


def end(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:  # Any: text or bytes pipes, or none
    """SIGTERM ``proc``, SIGKILL it after ``grace_s`` seconds, and reap it either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def healthy(url: str) -> bool:
    """Whether ``url`` (a ``/health`` route) answers 200 now; any other answer, or none (not accepting yet, still
    loading), is False."""
    try:
        return request(url, timeouts=Timeouts.within(5.0), max_body=65536).status == 200
    except HTTPClientError:
        return False


class ServerProcess:
    """``preheat serve MODEL --port 0 EXTRA...`` as a child; a context manager that always stops it.

    ``url`` is known once the constructor returns (the child printed its address); ``wait_ready()`` waits for
    ``/health``; ``lines`` collects the child's stdout. ``started`` is ``time.time()`` just before the spawn.
    """

    def __init__(self, model: str, *extra: str, env: Mapping[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "preheat", "serve", model, "--port", "0", *extra]
        self.lines: list[str] = []
        self.started = time.time()
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=None if env is None else dict(env),
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        self._drainer: threading.Thread | None = None
        try:
            self.url = self._wait_for_address()
        except BaseException:
            self.stop()
            raise
        self._drainer = threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True)
        self._drainer.start()

    def _wait_for_address(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if "listening on " in line:
                return line.split("listening on ", 1)[1].split()[0]
        self.proc.wait()
        raise ProcessError(f"preheat serve exited (code {self.proc.returncode}) before listening: {self.lines}")

    def _drain(self, stream: IO[str] | None) -> None:
        for line in stream or ():
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = HEALTH_TIMEOUT) -> None:
        """Poll ``/health`` until 200; raise ``ProcessError`` if the server exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessError(f"preheat serve exited with code {self.proc.returncode}: {self.lines[-5:]}")
            if healthy(self.url + "/health"):
                return
            time.sleep(0.05)
        raise ProcessError(f"preheat serve at {self.url} was not ready after {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; always reaps the child."""
        end(self.proc)
        if self._drainer is not None:
            self._drainer.join(timeout=5)  # the pipe ends when the child does
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
