"""The router's request path: choose a replica, forward the request unchanged, relay the answer as it comes. This
module holds what every request shares (``Router``: the replicas, the policy, the metrics) and the router's own
routes (``RouterHandler``); the data path that carries the requests is aioproxy.py, on one event loop. The rules
below are its contract.

Bodies pass through byte for byte: a non-streaming answer is relayed with its Content-Length, a streamed one chunk
by chunk as the replica writes its chunks (one server-sent event each), so tokens reach the client as they are made.
Sizes the replica chooses are bounded: a non-streaming answer over ``max_answer_bytes`` is refused
(``answer_too_large``, unread when its Content-Length says so), and so is a server-sent event over
``max_event_bytes`` (``event_too_large``). Nothing goes out to the client before a plain answer is whole or a stream's
first event is (``first_look``), so a refusal there is retried on another replica, as a failure is, and the client
hears of it (a 502) only when no other replica can take the request; a later event over the bound ends its stream
with an ``event_too_large`` error event. Each refusal is counted in ``preheat_router_refused_answers_total``, each
error answered in ``preheat_router_errors_total``.

Authentication: with an API key (``--api-key``) every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>``; a request without it is answered 401 before its body is read, tokenized, indexed or
sent anywhere. With ``--replica-api-key`` the router presents its own key to the replicas in place of the client's.
Control routes (load, sleep, wake, refit: ``preheat.http.control.is_control_path``) are never forwarded, however
spelt: the router answers 404 itself, so its key (or its place in front of the replicas) never grants control.

Failures: a request that fails before the client got anything (the connection refused, reset or closed, the answer
cut before it was whole or before its first event) ejects that replica and is retried once on another; one that
fails after (the replica died mid-stream) ends with a final ``data: {"error": ...}`` event and ``[DONE]``, as the
replica itself ends a failed stream.
A replica that answers a 503 saying it is not serving (asleep, on standby, draining: capacity.refused_code) never
started the request: it is ejected and the request goes to another replica.

Cold capacity (``ColdStarter``, activation.py): a request that finds no replica in rotation waits while a standby is
activated or a sleeping replica woken; one that finds every replica saturated starts one and goes on at once.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec

from preheat.dashboard.login import Login
from preheat.dashboard.state import ReplicaRow, StateDocument
from preheat.dashboard.watch import Findings, FleetWatcher
from preheat.dashboard.web import answer, is_dashboard_path
from preheat.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from preheat.http.server import CLOSE, TrackedHandler
from preheat.router.activation import ColdStarter
from preheat.router.hold import Holds
from preheat.router.metrics import RouterMetrics
from preheat.router.policies import Candidate, Decision, Policy, RouteRequest
from preheat.router.prompts import PromptReader
from preheat.router.sse import EventFramer
from preheat.router.upstream import Replica
from preheat.text.request import MAX_BODY_BYTES

log = logging.getLogger("preheat.router")
P = ParamSpec("P")
MAX_BODY = MAX_BODY_BYTES  # the replica's own limit: larger bodies are refused here, without a round trip
# Per-connection headers are not forwarded (RFC 9110 7.6.1); Host and Content-Length are set again for the replica.
HOP_HEADERS = frozenset(
    ("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
     "content-length", "proxy-authorization", "proxy-authenticate")
)  # fmt: skip
# Which replica answered, and why it was chosen: for clients, logs, benchmarks and tests (bodies stay unchanged).
REPLICA_HEADER = "X-Preheat-Replica"
REASON_HEADER = "X-Preheat-Route"
REFUSAL_BYTES = 64 * 1024  # a 503 this long or shorter is read to see whether it says "not serving"
# Defaults of --max-answer-bytes and --max-event-bytes (router/settings.py): far beyond any answer with logprobs.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_EVENT_BYTES = 16 * 1024 * 1024


class Router:
    """The replicas, the policy and the metrics: everything a request thread shares. ``api_key``: what clients must
    present (None: anyone may ask); ``replica_api_key``: what the router presents to replicas in place of the
    client's ``Authorization`` (None: the client's passes through)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        policy: Policy,
        prompts: PromptReader,
        *,
        api_key: str | None = None,
        replica_api_key: str | None = None,
        newest_version: bool = False,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
        steal: bool = True,
    ) -> None:
        """``steal``: an idle replica takes a request held for another (hold.py)."""
        self.replicas, self.policy, self.prompts = list(replicas), policy, prompts
        self.max_answer_bytes, self.max_event_bytes = max_answer_bytes, max_event_bytes
        self.newest_version = newest_version  # route only to replicas on the newest weights version (docs/refit.md)
        self.api_key = api_key
        self.replica_authorization = f"Bearer {replica_api_key}" if replica_api_key else None
        # kv's requests held for replicas that generate one sequence at a time (the data path's)
        self.holds = Holds(steal=steal)
        self.metrics = RouterMetrics(
            lambda: [(r.url, r.healthy, r.in_flight) for r in self.replicas],
            policy.index_sizes,
            policy.reported_loads,
            self.holds.held,
        )
        self.cold: ColdStarter | None = None  # standby and sleeping replicas to bring up (RouterService sets it)
        self._membership = threading.Lock()
        # GET /dashboard (preheat.dashboard): scrapes the replicas when a page polls; findings: the doctor's, given
        # by the command line (the router cannot import the doctor, which sits above it).
        self.dashboard = FleetWatcher(replica_api_key or api_key)
        self.findings: Findings | None = None

    def dashboard_state(self) -> StateDocument:
        """The dashboard's state document: every replica as the router sees it, joined with its own metrics."""
        rows = [ReplicaRow(r.url, r.healthy, r.phase, r.standby, r.in_flight, r.finished) for r in self.replicas]
        up = any(r.healthy for r in self.replicas)
        status = "ok" if up else "cold" if self.cold is not None and self.cold.available() else "no_replica"
        samples = self.metrics.decisions.family().samples
        return self.dashboard.state(rows, status=status, policy=self.policy.name, decision_samples=samples,
                                    findings=self.findings)  # fmt: skip

    # -- membership (``--replicas-from``): ``replicas`` is replaced, never changed in place, so that a request
    # thread iterating over it meanwhile sees the old list or the new one, whole -------------------------------------
    def add_replica(self, replica: Replica) -> bool:
        """``replica`` joins (out of rotation until its health check passes); False when its URL is here already."""
        with self._membership:
            if any(r.url == replica.url for r in self.replicas):
                return False
            self._set_replicas([*self.replicas, replica])
        log.warning("replica %s joined", replica.url)
        return True

    def remove_replica(self, url: str) -> Replica | None:
        """The replica at ``url`` leaves: no new request goes to it, those on it finish, the policy forgets it."""
        with self._membership:
            gone = next((r for r in self.replicas if r.url == url), None)
            if gone is None:
                return None
            self._set_replicas([r for r in self.replicas if r is not gone])
        gone.retire()
        self.policy.forget(url)
        self.metrics.forget_replica(url)
        log.warning("replica %s left (%d in flight finish there)", url, gone.in_flight)
        return gone

    def _set_replicas(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        if self.cold is not None:
            self.cold.replicas = replicas  # a sleeping replica that left is not woken

    def healthy(self, exclude: Sequence[Replica] = ()) -> list[Replica]:
        pool = [r for r in self.replicas if r.healthy and r not in exclude]
        if self.newest_version:  # --newest-version: the others finish their swap first (docs/refit.md)
            # (epoch, version): a restarted trainer's version 1 is newer than its last epoch's 500 (docs/refit.md).
            newest = max(((r.epoch, r.version) for r in pool if r.version is not None), default=None)
            if newest is not None:
                pool = [r for r in pool if (r.epoch, r.version) == newest]
        return pool

    def set_health(self, replica: Replica, healthy: bool, why: str) -> None:
        """A replica enters or leaves rotation (health checker or a failed request)."""
        if healthy and replica.retired:
            return  # it left the fleet (a health check or cold start finishing just after)
        if not replica.set_healthy(healthy):
            return  # already so: the health checker and a failed request can find a dead replica at the same time
        if healthy:
            log.warning("replica %s is in rotation (%s)", replica.url, why)
            return
        replica.close_idle()
        self.policy.forget(replica.url)  # back from the dead (or from sleep), its cache may have restarted empty
        self.metrics.ejections.inc(replica=replica.url)
        log.warning("replica %s ejected: %s", replica.url, why)

    def in_rotation(self, url: str) -> Replica | None:
        """The replica at ``url`` if it is among ``healthy()`` now."""
        return next((r for r in self.healthy() if r.url == url), None)

    def choose(self, request: RouteRequest, pool: Sequence[Replica], retry: bool = False) -> tuple[Replica, Decision]:
        candidates = [candidate(r) for r in pool]
        decision = self.policy.choose(request, candidates)
        reason = "retry" if retry else decision.reason
        self.metrics.decisions.inc(policy=self.policy.name, reason=reason)
        return next(r for r in pool if r.url == decision.replica), decision


def candidate(replica: Replica) -> Candidate:
    """What a policy knows of ``replica`` now."""
    r = replica
    return Candidate(r.url, r.in_flight, r.service_seconds, r.finished, r.load, r.load_finished)


class RouterRoutes:
    """What the router's own routes read of their server: the router, the dashboard's logins (``Login``) and the
    listener's TLS context (None: plain http; the login cookie is ``Secure`` over https)."""

    def __init__(self, router: Router, login: Login, tls: ssl.SSLContext | None) -> None:
        self.router, self.login, self.tls = router, login, tls


class RouterHandler(TrackedHandler):
    """The router's own routes (``/health``, ``/metrics``, the dashboard), answered on an in-memory connection by the
    data path (``aioproxy.answer_in_memory``, on a worker thread): every other request is forwarded there."""

    server_version = "preheat-router"
    server: RouterRoutes  # type: ignore[assignment]  # .router, .login and .tls are read: no socket server behind it

    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self.health()
        elif path == "/metrics":
            self.send_body(200, self.server.router.metrics.render().encode(), METRICS_CONTENT_TYPE)
        elif is_dashboard_path(path):  # read-only; its own key check: a browser sends a cookie, not a Bearer header
            answer(self, self.server.router.api_key, self.server.router.dashboard_state, self.server.login)
        else:
            self.send_body(404, f"no route {path[:200]}\n".encode(), "text/plain")

    def do_POST(self) -> None:  # noqa: N802 - http.server dispatches on this name
        if is_dashboard_path(self.path.split("?", 1)[0]):  # the dashboard's login form
            answer(self, self.server.router.api_key, self.server.router.dashboard_state, self.server.login)
        else:
            self.send_body(404, b"no route\n", "text/plain", CLOSE)

    def health(self) -> None:
        router = self.server.router
        replicas: list[dict[str, object]] = []
        for r in router.replicas:
            replicas.append(
                {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "state": r.phase, "standby": r.standby}
            )
            if r.wake_seconds is not None:
                replicas[-1]["wake_seconds"] = round(r.wake_seconds, 3)
        up = any(r.healthy for r in router.replicas)
        # No replica in rotation, but one can be activated or woken: requests are served (after a cold start).
        cold = not up and router.cold is not None and router.cold.available()
        state = "ok" if up else "cold" if cold else "no_replica"
        status = {"status": state, "policy": router.policy.name, "replicas": replicas}
        self.send_body(200 if up or cold else 503, json.dumps(status).encode(), "application/json")


@dataclass(frozen=True)
class Head:
    """What the router read of an answer before relaying any of it (``first_look``): a plain answer's whole
    ``body``; a stream of server-sent events' first whole events (``events``), the ``framer`` holding what came after
    them, and whether the stream ``ended`` there; nothing of any other stream."""

    body: bytes | None = None
    events: bytes = b""
    framer: EventFramer | None = None
    ended: bool = False


@dataclass(frozen=True)
class Refused:
    """An answer the router would not relay, refused before a byte of it went out: ``code`` (answer_too_large,
    event_too_large, replica_failed) and the client's ``message`` if no other replica takes the request."""

    code: str
    message: str


@dataclass(frozen=True)
class Ending:
    """How a relay reports the end of an exchange: ``over()`` when the replica's part is over (its last byte came
    or it failed), ``count(status)`` just before the client's last byte goes out (it calls ``over()`` too). Each
    acts once."""

    over: Callable[[], None]
    count: Callable[[int], None]


def event_too_large(replica: Replica, limit: int) -> str:
    """The message of an event over ``--max-event-bytes``, refused first or ending a stream."""
    return (
        f"replica {replica.url} sent a server-sent event longer than the router relays ({limit} bytes, "
        "--max-event-bytes)"
    )


def _once(action: Callable[P, None]) -> Callable[P, None]:
    """``action(...)`` on the first call, nothing on later ones (one handler thread calls it)."""
    pending = [action]

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        if pending:
            pending.pop()(*args, **kwargs)

    return call
