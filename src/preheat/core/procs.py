"""Child processes of preheat, and the one line by which a server says where it listens.

``pdeathsig`` makes a child die with its parent; ``end`` stops one (SIGTERM, then SIGKILL); ``Child`` runs
``python -m preheat ARGS``, reads its output on a thread and learns its address from the listening line. Every
preheat server prints that line once its socket is bound (``listening_line``), and every parent finds it there
(``listening_url``): ``preheat up``'s replicas and router (``router/cluster.py``), ``ServerProcess`` (the demo, the
tests and the benchmarks), and the tests' own children. Readiness beyond the address (``/health``) is a probe the
caller passes, so this module stays below the HTTP client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from preheat.core.errors import ProcessError

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


_C = TypeVar("_C", bound="Child")

LISTENING = "listening on "
ADDRESS_TIMEOUT = 120.0  # a server prints its address once its socket is bound, before any model loads


def listening_line(who: str, url: str, detail: str = "") -> str:
    """The line a server prints once its socket is bound: ``preheat serve: listening on http://127.0.0.1:8000``,
    then ``detail`` in parentheses when given. Parents find the URL again with ``listening_url``."""
    return f"{who}: {LISTENING}{url}" + (f" ({detail})" if detail else "")


def listening_url(line: str) -> str | None:
    """The URL of a listening line, or None when ``line`` is no such line.

    >>> listening_url("preheat router: listening on http://127.0.0.1:9000 (policy kv)")
    'http://127.0.0.1:9000'
    """
    if LISTENING not in line:
        return None
    rest = line.split(LISTENING, 1)[1].split()
    return rest[0].rstrip(";") if rest else None


class Child:
    """``python -m preheat ARGS`` as a child that never outlives its parent; ``url`` once it printed its listening
    line, ``lines`` its output so far (each also passed to ``echo``).

    ``own_group``: the child runs in its own session, so that stopping it reaches anything it started and a Ctrl-C
    in the terminal reaches the parent alone (``preheat up``); otherwise it shares the parent's group.
    ``merge_stderr``: its standard error is read with its output (else it goes where the parent's goes).
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        echo: Callable[[str], None] | None = None,
        env: Mapping[str, str] | None = None,
        own_group: bool = False,
        merge_stderr: bool = False,
    ) -> None:
        self.name, self.echo, self.own_group = name, echo, own_group
        self.url: str | None = None
        self.lines: list[str] = []
        self.started = time.time()  # just before the spawn: what a start is timed from
        self._listening = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preheat", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else None,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=own_group,
            env=None if env is None else dict(env),
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        self._reader = threading.Thread(target=self._read, name=f"{name} output", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if self.url is None and (url := listening_url(line)) is not None:
                self.url = url
                self._listening.set()
            if self.echo is not None:
                self.echo(f"[{self.name}] {line}")
        self._listening.set()  # the child exited: stop waiting for an address

    def wait_address(self, timeout: float = ADDRESS_TIMEOUT) -> str:
        """The child's URL once it printed its listening line; ``ProcessError`` if it exits first or ``timeout``
        passes."""
        self._listening.wait(timeout)
        if self.url is None:
            code = self.proc.poll()
            raise ProcessError(f"{self.name} did not start listening (exit code {code}): {self.lines[-5:]}")
        return self.url

    def wait_until(self, probe: Callable[[str], bool], timeout: float) -> None:
        """Poll ``probe(url)`` until it is true; ``ProcessError`` if the child exits or ``timeout`` passes."""
        url = self.wait_address(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessError(f"{self.name} exited with code {self.proc.returncode}: {self.lines[-5:]}")
            if probe(url):
                return
            time.sleep(0.05)
        raise ProcessError(f"{self.name} at {url} was not ready after {timeout:.0f} s")

    def signal_group(self, signum: int) -> None:
        """``signum`` to the child's process group (its own session), or to the child alone when it has none."""
        with contextlib.suppress(ProcessLookupError):  # already gone
            if self.own_group:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)

    def reap(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the child to exit; True when it has."""
        try:
            self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        """Let go of the output pipe once the child has exited (it ends with the child)."""
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` seconds; always reaps the child."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            if not self.reap(grace_s):
                self.signal_group(signal.SIGKILL)
                self.reap(5.0)
        self.close()

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
