"""Bringing cold replicas up: activating a standby (``POST /v1/preheat/load``) and waking a sleeping replica
(``POST /v1/preheat/wake``; a vLLM replica by its own routes, sleeping.py) when the router needs capacity (the
rules: capacity.py; spec: docs/router.md, *Standby and sleeping replicas*).

One cold start at a time: a burst of requests with no replica to go to brings up one replica, not every standby;
when it fails, the next waiting request brings up the next one. A replica is put in rotation only once its own
``/health`` answers 200, never on the strength of the load request's answer: the router never sends a request to
a replica that has not said it is ready.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from preheat.core.errors import ColdStartError, ConnectError, HTTPClientError, JSONInputError
from preheat.core.jsonsafe import loads_bounded
from preheat.http.client import Response, Timeouts, request
from preheat.http.control import LOAD_ROUTE, TIMELINE_ROUTE, WAKE_ROUTE
from preheat.router import sleeping
from preheat.router.capacity import SLEEPING, STANDBY, Cold, rank_cold
from preheat.router.metrics import RouterMetrics
from preheat.router.scrape import scrape
from preheat.router.upstream import Replica

log = logging.getLogger("preheat.router")
POLL_SECONDS = 0.05  # /health while a replica comes up: the first request waits on it
CONTROL_SECONDS = 10.0  # the load and wake routes answer at once (202): they only start the work
RETRY_FAILED_AFTER = 30.0  # a replica whose cold start failed is not tried again before this many seconds
MAX_ANSWER = 1 << 20
# A replica's refusals of the key, not of the model: preheat.http.control's codes.
ADMIN_REFUSALS = ("invalid_admin_key", "admin_key_required", "host_not_allowed")
KEPT_MEASUREMENTS = 16  # per kind: the mean of the last ones prices a replica whose own cost is unknown


@dataclass(frozen=True)
class ColdSettings:
    """``model``: what a standby is told to load (None: standbys are never activated); ``served_model_name``: the
    name it serves it under; ``admin_key``: the replicas' ``--admin-key``, sent on the load and wake requests (None:
    their control routes are open to this host); ``api_key``: their ``--api-key``, sent to read a timeline;
    ``timeout``: seconds a cold start may take; ``wake``: whether sleeping replicas may be woken; ``saturation``: in
    flight per replica at which the fleet counts as saturated."""

    model: str | None = None
    served_model_name: str | None = None
    admin_key: str | None = None
    api_key: str | None = None
    timeout: float = 300.0
    wake: bool = True
    saturation: int = 3


class ColdStarter:
    """Brings up the best cold replica of ``replicas`` when asked (``need``), and lets a request wait for a replica
    in rotation (``wait_for_replica``). ``admit(replica, why)`` puts a replica in rotation (``Router.set_health``)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        admit: Callable[[Replica, str], None],
        metrics: RouterMetrics,
        settings: ColdSettings,
    ) -> None:
        self.replicas, self.admit, self.metrics, self.settings = list(replicas), admit, metrics, settings
        # Control requests carry the admin key alone; reads carry the API key alone: each key where it is needed.
        self.headers = {"Content-Type": "application/json"}
        if settings.admin_key:
            self.headers["Authorization"] = f"Bearer {settings.admin_key}"
        self.read_headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.control_headers = {k: v for k, v in self.headers.items() if k == "Authorization"}
        self.errors: dict[str, str] = {}  # the last failed cold start's reason, per replica
        self._refused: set[str] = set()  # replicas that may never load the model (403)
        self._failed_at: dict[str, float] = {}
        self._measured: dict[str, list[float]] = {STANDBY: [], SLEEPING: []}
        self._cond = threading.Condition()
        self._busy: str | None = None  # the replica coming up now

    # -- what can be brought up ----------------------------------------------------------------------------------
    def candidates(self) -> list[Cold]:
        """The cold replicas that may be brought up now (none that is coming up, refused, or failed lately)."""
        now = time.monotonic()
        out: list[Cold] = []
        for r in self.replicas:
            if r.healthy or r.url in self._refused or now - self._failed_at.get(r.url, -1e9) < RETRY_FAILED_AFTER:
                continue
            if r.phase == STANDBY and r.standby and self.settings.model is not None:
                out.append(Cold(r.url, STANDBY, None, r.prepared))
            elif r.phase == SLEEPING and self.settings.wake:
                out.append(Cold(r.url, SLEEPING, r.wake_seconds))
        return out

    def available(self) -> bool:
        """Whether a cold start is under way or could start now (the router's ``/health`` says ``cold``)."""
        return self._busy is not None or bool(self.candidates())

    def need(self, why: str) -> bool:
        """Start bringing up the best cold replica unless one is coming up already; True when one is."""
        with self._cond:
            return self._start(why)

    def _start(self, why: str) -> bool:
        if self._busy is not None:
            return True
        ranked = rank_cold(self.candidates(), self._measured)
        if not ranked:
            return False
        chosen = ranked[0]
        replica = next(r for r in self.replicas if r.url == chosen.name)
        self._busy = replica.url
        action = "activating" if chosen.kind == STANDBY else "waking"
        log.warning("%s %s (%s)", action, replica.url, why)
        threading.Thread(
            target=self._bring_up, args=(replica, chosen.kind), name=f"preheat-router {action}", daemon=True
        ).start()
        return True

    def wait_for_replica(self, healthy: Callable[[], bool], why: str, timeout: float | None = None) -> bool:
        """Wait until ``healthy()`` (a replica this request may go to is in rotation), bringing cold replicas up one
        after another meanwhile; False when none is left to try or ``timeout`` (default: the cold-start timeout)
        passed."""
        deadline = time.monotonic() + (self.settings.timeout if timeout is None else timeout)
        with self._cond:
            while not healthy():
                if not self._start(why):
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Woken when a cold start ends; the timeout catches a replica the health checker admitted.
                self._cond.wait(min(remaining, 0.1))
            return True

    def why_none(self) -> str:
        """What the last cold starts said, for the 503 a request gets when none succeeded."""
        with self._cond:  # cold starts end on their own threads
            errors = list(self.errors.items())
        if not errors:
            return "no standby or sleeping replica to bring up"
        return "; ".join(f"{url}: {error}" for url, error in errors)

    # -- one cold start ------------------------------------------------------------------------------------------
    def _bring_up(self, replica: Replica, kind: str) -> None:
        started = time.monotonic()
        counter = self.metrics.activations if kind == STANDBY else self.metrics.wakes
        try:
            if kind == STANDBY:
                self._activate(replica)
            else:
                self._wake(replica)
        except ColdStartError as exc:
            outcome = "refused" if exc.refused else "failed"
            counter.inc(replica=replica.url, outcome=outcome)
            log.warning("%s of %s %s: %s", "activation" if kind == STANDBY else "wake", replica.url, outcome, exc)
            with self._cond:
                self.errors[replica.url] = str(exc)
                if exc.refused:
                    self._refused.add(replica.url)
                self._failed_at[replica.url] = time.monotonic()
        else:
            seconds = time.monotonic() - started
            counter.inc(replica=replica.url, outcome="ok")
            (self.metrics.activation_seconds if kind == STANDBY else self.metrics.wake_seconds).observe(seconds)
            with self._cond:
                self.errors.pop(replica.url, None)
                kept = self._measured[kind]
                kept.append(seconds)
                del kept[:-KEPT_MEASUREMENTS]
            if kind == SLEEPING:
                replica.wake_seconds = seconds
            replica.phase = "ok"
            replica.last_active = time.monotonic()  # just up: not idle since before it slept (--sleep-idle)
            self.admit(replica, f"{'activated' if kind == STANDBY else 'woken'} in {seconds:.2f} s")
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()

    def _activate(self, replica: Replica) -> None:
        model = self.settings.model
        assert model is not None  # candidates() offers standbys only with a model
        body: dict[str, object] = {"model": model, "wait": False}
        if self.settings.served_model_name:
            body["served_model_name"] = self.settings.served_model_name
        answer = self._post(replica, LOAD_ROUTE, body)
        code = _error_code(answer)
        if answer.status == 403:
            raise ColdStartError(f"refused {model}: {_message(answer)}", refused=code == "model_not_allowed")
        if answer.status not in (200, 202) and code not in ("is_loading", "is_ready"):
            raise ColdStartError(f"{LOAD_ROUTE} answered {answer.status}: {_message(answer)}")
        # "serving" with a 503: a vLLM standby handing its socket to vLLM's own server, which answers 200 next.
        self._until_ready(replica, waiting=("loading", "warming", "standby", "serving"), gone=STANDBY)

    def _wake(self, replica: Replica) -> None:
        if replica.sleep_protocol == sleeping.VLLM:
            self._wake_vllm(replica)
            return
        answer = self._post(replica, WAKE_ROUTE, {"wait": False})
        if answer.status not in (200, 202) and _error_code(answer) not in ("is_waking", "is_ready"):
            raise ColdStartError(f"{WAKE_ROUTE} answered {answer.status}: {_message(answer)}")
        self._until_ready(replica, waiting=("waking", "sleeping"), gone=SLEEPING)

    def _wake_vllm(self, replica: Replica) -> None:
        """vLLM's wake (sleeping.py): at level 2 its weights are reloaded before it serves. A reload that fails
        puts it back to sleep at level 2, so that no request ever reaches the garbage a bare wake leaves."""
        signals = scrape(replica.url, CONTROL_SECONDS, self.read_headers)
        level = sleeping.vllm_level(replica, signals.sleep_state if signals is not None else None)
        error = sleeping.wake_vllm(replica, level, self.control_headers)
        if error is not None:
            if level >= 2 and sleeping.sleep(replica, 2, self.control_headers) is None:
                replica.sleep_level = 2
            raise ColdStartError(error)
        replica.sleep_level = None
        deadline = time.monotonic() + self.settings.timeout
        while time.monotonic() < deadline:
            if sleeping.is_sleeping(replica.url, CONTROL_SECONDS) is False:
                return
            time.sleep(POLL_SECONDS)
        raise ColdStartError(f"still asleep {self.settings.timeout:g} s after its wake")

    def _post(self, replica: Replica, path: str, body: dict[str, object]) -> Response:
        try:
            answer = request(
                replica.url + path,
                "POST",
                timeouts=Timeouts.within(CONTROL_SECONDS),
                body=json.dumps(body).encode(),
                headers=self.headers,
                max_body=MAX_ANSWER,
            )
        except HTTPClientError as exc:
            raise ColdStartError(str(exc)) from None
        if answer.status == 401 or _error_code(answer) in ADMIN_REFUSALS:
            raise ColdStartError(
                f"{path} refused the router's admin key ({_message(answer)}): pass the replicas' --admin-key as "
                "PREHEAT_ROUTER_REPLICA_ADMIN_KEY (or --replica-admin-key)"
            )
        return answer

    def _until_ready(self, replica: Replica, *, waiting: tuple[str, ...], gone: str) -> None:
        """Poll ``/health`` until 200. A replica back in phase ``gone`` with ``last_error`` has failed (a standby
        whose load failed goes back to standby; a failed wake leaves it asleep); ``waiting`` phases go on."""
        deadline = time.monotonic() + self.settings.timeout
        while time.monotonic() < deadline:
            try:
                answer = request(
                    replica.url + "/health", timeouts=Timeouts.within(CONTROL_SECONDS), max_body=MAX_ANSWER
                )
            except ConnectError as exc:
                if exc.refused:
                    raise ColdStartError(f"the replica went away: {exc}") from None
                answer = None
            except HTTPClientError:
                answer = None  # a replica busy loading may answer late: ask again
            state = _json(answer.body) if answer is not None else {}
            status = state.get("status")
            if answer is not None and answer.status == 200:
                served = self.settings.served_model_name
                if served and gone == STANDBY and state.get("model") not in (None, served):
                    raise ColdStartError(f"it serves {state.get('model')!r}, not {served!r}", refused=True)
                return
            if status == "failed" or (status == gone and state.get("last_error")):
                raise ColdStartError(str(state.get("last_error") or state.get("error") or status))
            if status is not None and status not in waiting:
                raise ColdStartError(f"/health says {status}")
            time.sleep(POLL_SECONDS)
        raise ColdStartError(f"not ready after {self.settings.timeout:g} s")

    # -- what the health checker sees ----------------------------------------------------------------------------
    def observed(self, replica: Replica, health: dict[str, object]) -> None:
        """The health checker saw ``replica`` change phase: a newly sleeping replica's wake cost is the ``ready``
        of its last wake's timeline, when its timeline is one (unknown otherwise, until the router wakes it)."""
        if replica.phase != SLEEPING or replica.wake_seconds is not None:
            return
        try:
            answer = request(
                replica.url + TIMELINE_ROUTE, timeouts=Timeouts.within(CONTROL_SECONDS), headers=self.read_headers,
                max_body=16 * MAX_ANSWER,
            )  # fmt: skip
        except HTTPClientError as exc:
            log.debug("%s%s: %s", replica.url, TIMELINE_ROUTE, exc)
            return
        replica.wake_seconds = wake_cost(_json(answer.body)) if answer.status == 200 else None


def wake_cost(timeline: Mapping[str, object]) -> float | None:
    """The ``ready`` of a wake's timeline (its origin is the wake request); None for any other timeline.

    >>> wake_cost({"origin_source": "wake request", "stages": [{"name": "ready", "start": 0.12, "end": 0.12}]})
    0.12
    """
    if timeline.get("origin_source") != "wake request":
        return None
    stages = timeline.get("stages")
    for stage in stages if isinstance(stages, list) else ():
        if isinstance(stage, dict) and stage.get("name") == "ready" and isinstance(stage.get("start"), (int, float)):
            return float(stage["start"])
    return None


def _json(raw: bytes) -> dict[str, object]:
    try:
        value = loads_bounded(raw, max_bytes=16 * MAX_ANSWER, max_depth=16)
    except (JSONInputError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _error_code(answer: Response) -> str | None:
    error = _json(answer.body).get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _message(answer: Response) -> str:
    error = _json(answer.body).get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else answer.body[:200].decode("utf-8", "replace")
