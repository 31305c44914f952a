"""Ejecting dead replicas and readmitting them when they recover.

One checker thread per replica asks ``GET /health`` every ``interval`` seconds: a 200 puts the replica in rotation;
a refused connection takes it out at once (nothing listens there); timeouts and other answers (503 while loading,
a 5xx) take it out after ``failures`` in a row, so that one slow answer does not flap a busy replica. Requests that
fail to reach a replica eject it too (``Router.forward``), without waiting for the next check. A vLLM replica's
``/health`` is 200 while it sleeps, so one that answers vLLM's ``/is_sleeping`` is asked that too (sleeping.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from preheat.core.errors import ConnectError, HTTPClientError
from preheat.http.client import Timeouts, request
from preheat.http.control import VLLM_IS_SLEEPING
from preheat.router import sleeping
from preheat.router.capacity import NOT_SERVING, SLEEPING
from preheat.router.upstream import Replica

log = logging.getLogger("preheat.router")
MAX_ANSWER = 64 * 1024  # a /health answer is a few hundred bytes


class ReplicaLoop:
    """One daemon thread per replica calling ``tick(replica)``; ``tick_all()`` runs one round at once and waits.

    ``tick`` returns the seconds to wait before the next one (the health checker and the KV poller share this).
    Replicas may come and go while it runs (``--replicas-from``): ``add`` starts a thread that ticks at once,
    ``remove`` ends that replica's thread after its current tick."""

    def __init__(self, replicas: Sequence[Replica], interval: float, timeout: float) -> None:
        self.replicas, self.interval, self.timeout = list(replicas), interval, timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._leave: dict[Replica, threading.Event] = {}  # per replica: set when it leaves or everything stops
        self._started = False
        self._lock = threading.Lock()

    def tick(self, replica: Replica) -> float:
        raise NotImplementedError

    def tick_all(self) -> None:
        threads = [threading.Thread(target=self.tick, args=(r,), daemon=True) for r in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def start(self) -> None:
        with self._lock:
            self._started = True
            for replica in self.replicas:
                self._spawn(replica, self.interval)

    def add(self, replica: Replica) -> None:
        """Tick ``replica`` from now on (at once, then every interval)."""
        with self._lock:
            if replica in self._leave or self._stop.is_set():
                return
            self.replicas = [*self.replicas, replica]
            if self._started:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._spawn(replica, 0.0)

    def remove(self, replica: Replica) -> None:
        """Stop ticking ``replica`` (a tick under way finishes)."""
        with self._lock:
            self.replicas = [r for r in self.replicas if r is not replica]
            leave = self._leave.pop(replica, None)
        if leave is not None:
            leave.set()

    def _spawn(self, replica: Replica, first_wait: float) -> None:
        leave = self._leave[replica] = threading.Event()
        name = f"{type(self).__name__} {replica.url}"
        thread = threading.Thread(target=self._loop, args=(replica, leave, first_wait), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _loop(self, replica: Replica, leave: threading.Event, wait: float) -> None:
        while not leave.wait(wait):
            wait = self.tick(replica)

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            leaving, self._leave = list(self._leave.values()), {}
        for leave in leaving:
            leave.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout + 1)


class HealthChecker(ReplicaLoop):
    """``tick_all()`` once (the router's start), then ``start()`` the background checks; ``stop()`` ends them.

    ``on_change(replica, healthy, why)`` is called when a replica should enter or leave rotation; it sets the
    replica's flag (``Router.set_health``), so that a request that found the replica dead at the same moment does
    not count a second ejection. ``on_phase(replica, body)`` (optional) hears of every change of a replica's phase,
    with the ``/health`` body that said so (the cold-capacity side learns a sleeping replica's wake cost from it).
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        on_change: Callable[[Replica, bool, str], None],
        *,
        interval: float = 1.0,
        timeout: float = 2.0,
        failures: int = 2,
        on_phase: Callable[[Replica, dict[str, object]], None] | None = None,
    ) -> None:
        super().__init__(replicas, interval, timeout)
        self.on_change, self.failures, self.on_phase = on_change, failures, on_phase
        self._failed = {r.url: 0 for r in replicas}
        self._checking: dict[str, threading.Lock] = {}  # per replica: its loop and check_now never overlap

    def tick(self, replica: Replica) -> float:
        self.check_now(replica)
        return self.interval

    def check_now(self, replica: Replica) -> None:
        """One check of ``replica`` now, besides its loop's (another router ejected it: router/shared_redis.py)."""
        with self._lock:
            lock = self._checking.setdefault(replica.url, threading.Lock())
        with lock:
            self.check(replica)

    def remove(self, replica: Replica) -> None:
        super().remove(replica)
        self._failed.pop(replica.url, None)
        self._checking.pop(replica.url, None)

    def check(self, replica: Replica) -> None:
        """One check of ``replica``; ``on_change`` when it should enter or leave rotation."""
        body: dict[str, object] = {}
        slept = replica.slept
        try:
            answer = request(replica.url + "/health", timeouts=Timeouts.within(self.timeout), max_body=MAX_ANSWER)
            body = sleeping.json_object(answer.body)  # {} for plain text: a replica of another kind
            phase = str(body.get("status", "ok" if answer.status == 200 else answer.status))
            ok, why = answer.status == 200, f"/health answered {answer.status}"
            # A replica that says it takes no requests (asleep, on standby, draining) means it: out at once.
            definitive = answer.status == 503 and phase in NOT_SERVING
            if definitive:
                why += f" {phase}"
            if ok and self._asleep(replica, body):  # vLLM's /health says 200 while it sleeps
                ok, why, definitive, phase = False, f"{VLLM_IS_SLEEPING} says it is asleep", True, SLEEPING
        except ConnectError as exc:
            ok, why, definitive = False, "connection refused" if exc.refused else str(exc), exc.refused
            phase = "down"
        except HTTPClientError as exc:
            ok, why, definitive, phase = False, str(exc), False, "down"
        if replica.retired:  # it left while we asked: remove() dropped its count, which must stay dropped
            return
        if replica.held_out or replica.slept != slept:  # this router put it to sleep while we asked: stale
            return
        if ok:
            self._observe(replica, "ok", body)
            self._failed[replica.url] = 0
            if not replica.healthy and not replica.retired:  # a replica that left stays out
                self.on_change(replica, True, why)
            return
        self._failed[replica.url] = self._failed.get(replica.url, 0) + 1
        if replica.healthy and (definitive or self._failed[replica.url] >= self.failures):
            self.on_change(replica, False, why)
        # Out of rotation first, then the phase shown: whoever reads "sleeping" (or "down") in the router's state
        # can rely on no request going there any more.
        self._observe(replica, phase, body)

    def _asleep(self, replica: Replica, body: dict[str, object]) -> bool:
        """Whether a replica whose ``/health`` said 200 is a vLLM asleep (its ``/is_sleeping``). A preheat replica
        (its ``/health`` is a JSON object with a status) is not asked; nor is one that did not answer it once."""
        if "status" in body:
            replica.sleep_protocol = sleeping.PREHEAT
            return False
        if replica.sleep_protocol not in (None, sleeping.VLLM):
            return False
        asleep = sleeping.is_sleeping(replica.url, self.timeout)
        if asleep is None:
            if replica.sleep_protocol is None:  # not vLLM, or vLLM without its dev-mode routes: never asked again
                replica.sleep_protocol = sleeping.NONE
            return False
        replica.sleep_protocol = sleeping.VLLM
        return asleep

    def _observe(self, replica: Replica, phase: str, body: dict[str, object]) -> None:
        replica.prepared = body.get("prepared") is True
        version = body.get("version")
        replica.version = version if isinstance(version, int) and not isinstance(version, bool) else None
        epoch = body.get("epoch")
        replica.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0
        if phase == replica.phase:
            return
        replica.phase = phase
        if self.on_phase is not None:
            self.on_phase(replica, body)
