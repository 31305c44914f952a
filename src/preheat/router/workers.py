"""``preheat router --workers N``: N router processes on one port, so that the data path uses N cores.

One router is one event loop on one core (aioproxy.py); past it, a second process is the only way to a second core
for Python. The parent here serves nothing: it reserves the port (a socket bound with ``SO_REUSEPORT`` and never
listening, so that ``--port 0`` has one number for all and no other program takes it meanwhile), starts the
workers, and waits. Each worker is a whole router (``app.run``) whose listening socket is bound to that port with
``SO_REUSEPORT``: the kernel spreads new connections across the workers' sockets, with no accept lock and no hand-off
between processes. Measured on 2 cores with nginx and wrk beside it (docs/benchmarks.md, *Router capacity*): two
workers serve ~1.8x the requests of one.

What the workers share and what they do not:

- the port, and the dashboard's logins (``SignedSessions``, with a key made here and handed over the start pipe);
- not their view: each worker health-checks the replicas, reads their KV events and counts its own requests in
  flight. ``--shared-state redis://`` gives the workers (and other hosts' routers) one view, as it does for separate
  routers; without it, ``least-load`` and ``prefix`` know only their own worker's traffic (a warning says so).
- ``/metrics`` and ``/health`` are answered by whichever worker takes the connection: each is that worker's own.
  Prometheus scrapes through the port see one worker at a time (with ``--shared-state``, fleet-wide counts are on
  every worker's ``/metrics``).

The workers are started fresh (``spawn``), not forked: the parent has loaded nothing a worker could inherit half of
(a tokenizer's thread pool, a Redis connection). A worker that dies is started again, at most ``RESTARTS`` times a
minute; SIGINT/SIGTERM stop them all. A worker whose parent is gone (SIGKILL) stops too (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from preheat.core.errors import RouterError

log = logging.getLogger("preheat.router")
READY_TIMEOUT = 600.0  # a worker's start: its tokenizer (perhaps asked of the replicas) and first health checks
RESTARTS = 5  # workers restarted within a minute before the router gives up
STOP_WAIT = 10.0  # seconds a worker has to stop after SIGTERM before it is killed


@dataclass(frozen=True)
class WorkerSlot:
    """What a worker process is told: which it is, the port to bind (with ``SO_REUSEPORT``), the dashboard's session
    key, where to say it is serving, and the parent's log level."""

    index: int
    port: int
    session_key: bytes
    ready: Any  # Any: a multiprocessing Connection (no public type); gets (index, healthy, replicas) once serving
    log_level: int = logging.WARNING

    def serving(self, healthy: int, total: int) -> None:
        with contextlib.suppress(OSError):
            self.ready.send((self.index, healthy, total))


# A worker's entry point: (flags, slot) -> exit code. A module-level function (spawn pickles it by name).
WorkerMain = Callable[[Mapping[str, object], WorkerSlot], int]


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` and not listening: the port is the router's (the workers
    bind it too), and no connection is ever queued on this one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RouterError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (a worker must not serve on for a killed router)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker(main: WorkerMain, flags: Mapping[str, object], slot: WorkerSlot, parent: int) -> None:
    _die_with_parent()
    if os.getppid() != parent:
        return  # the parent died before the request above took effect
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the workers with SIGTERM
    raise SystemExit(main(flags, slot))


def supervise(
    flags: Mapping[str, object], *, host: str, port: int, count: int, main: WorkerMain, say: Callable[[str], None],
    describe: Callable[[int, int, int], list[str]],
) -> int:  # fmt: skip
    """Run ``count`` workers (``main(flags, slot)``) on ``host:port`` until SIGINT/SIGTERM; the exit code.
    ``describe(port, healthy, total)``: the lines to print once every worker serves (``port``: the one reserved)."""
    from preheat.http.server import sigterm_interrupts

    reserved = reserve_port(host, port)
    port = reserved.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    key = secrets.token_bytes(32)
    workers: dict[int, BaseProcess] = {}
    restarts: list[float] = []

    def start(index: int) -> None:
        slot = WorkerSlot(index, port, key, send, logging.getLogger().level)
        proc = context.Process(
            target=_worker, args=(main, dict(flags), slot, os.getpid()), name=f"preheat-router-{index}"
        )
        proc.start()
        workers[index] = proc

    try:
        with sigterm_interrupts():
            for index in range(count):
                start(index)
            counts = _wait_ready(receive, workers, count)
            for line in describe(port, *counts):
                say(line)
            while True:
                sentinels = {proc.sentinel: index for index, proc in workers.items()}
                for ready in multiprocessing.connection.wait([*sentinels, receive]):
                    if ready is receive:
                        with contextlib.suppress(EOFError, OSError):
                            receive.recv()  # a restarted worker serving again
                        continue
                    index = sentinels[ready]  # type: ignore[index]  # a sentinel is an int
                    code = _reaped(workers[index])
                    now = time.monotonic()
                    restarts[:] = [t for t in restarts if now - t < 60.0] + [now]
                    if len(restarts) > RESTARTS:
                        log.error("router worker %d exited (code %s), the %dth restart in a minute: stopping",
                                  index, code, len(restarts))  # fmt: skip
                        return 1
                    log.warning("router worker %d exited (code %s); starting another", index, code)
                    start(index)
    except KeyboardInterrupt:
        say("preheat router: shutting down")
        return 0
    except RouterError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _stop(list(workers.values()))
        reserved.close()
        receive.close()
        send.close()


def _wait_ready(
    receive: multiprocessing.connection.Connection, workers: Mapping[int, BaseProcess], count: int
) -> tuple[int, int]:
    """Until every worker said it serves: the first one's (healthy replicas, replicas). ``RouterError`` when one
    exits first, or none is ready within ``READY_TIMEOUT``."""
    waiting = set(range(count))
    counts: tuple[int, int] | None = None
    deadline = time.monotonic() + READY_TIMEOUT
    while waiting:
        sentinels = {proc.sentinel: index for index, proc in workers.items()}
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait([*sentinels, receive], timeout=max(left, 0.0))
        if not ready:
            raise RouterError(f"router workers {sorted(waiting)} did not start within {READY_TIMEOUT:g} s")
        for item in ready:
            if item is receive:
                index, healthy, total = receive.recv()
                counts = counts or (healthy, total)  # the first to serve: the others saw the same replicas
                waiting.discard(index)
            else:
                index = sentinels[item]  # type: ignore[index]  # a sentinel is an int
                code = _reaped(workers[index])
                raise RouterError(f"router worker {index} exited (code {code}) before serving: see its error above")
    assert counts is not None  # count >= 1 workers said so
    return counts


def _reaped(proc: BaseProcess) -> int | None:
    """The exit code of a worker whose sentinel is ready (it has exited: joined here, so the code is known)."""
    proc.join(5)
    return proc.exitcode


def _stop(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(OSError):
                proc.terminate()
    deadline = time.monotonic() + STOP_WAIT
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
