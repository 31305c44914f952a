"""The replicas behind the router: their URL, health, requests in flight, and a small pool of kept-alive connections.

The router is on every request's path, so a request reuses an idle HTTP/1.1 connection to its replica instead of
paying a TCP handshake (and a replica thread start) each time: each replica has a ``preheat.http.pool.Pool``, which
resends a request once on a fresh connection when a kept-alive one turns out closed by the replica meanwhile (safe:
the replica never saw it). The pool's errors become ``UpstreamError``, which says whether the replica can have
started on the request.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from preheat.core.errors import HTTPClientError, ResponseTimeoutError, RouterError, UpstreamError
from preheat.http.client import CONNECT_SECONDS, Origin, Timeouts
from preheat.http.pool import Pool

POOL_SIZE = 32  # idle connections kept per replica; more concurrent requests open (then close) extra ones
SERVICE_EWMA = 0.2  # weight of the newest request in a replica's mean request duration


def moving_mean(old: float | None, value: float) -> float:
    """The router's running mean of a per-replica measurement: ``value`` weighted ``SERVICE_EWMA`` (the first one
    whole). A request's duration here; ``kv``'s time to the first byte and estimated service (policies.py) too."""
    return value if old is None else old + SERVICE_EWMA * (value - old)


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    url: str
    scheme: str = "http"


def parse_url(url: str) -> Address:
    """``http(s)://host:port`` (a trailing slash or path is refused: the router forwards paths as they come); an
    https replica is verified with the system's CAs and the router's ``--ssl-ca-certs`` (``preheat.http.tls``).

    >>> parse_url("https://10.0.0.5")
    Address(host='10.0.0.5', port=443, url='https://10.0.0.5:443', scheme='https')
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise RouterError(f"replica {url!r}: give it as http://host:port or https://host:port (no path)")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6 (a pod's address may be one)
    return Address(parts.hostname, port, f"{parts.scheme}://{host}:{port}", parts.scheme)


@dataclass(frozen=True)
class EventSource:
    """Where an engine replica (vLLM, SGLang) publishes its KV events: ``endpoint`` (its ZMQ PUB socket) and
    ``replay`` (its ROUTER socket for missed batches), as ``tcp://HOST:PORT``."""

    endpoint: str
    replay: str | None = None


@dataclass(frozen=True)
class ReplicaSpec:
    """One ``--replica``: its URL and, for an engine replica, where its KV events come from."""

    url: str
    events: EventSource | None = None


SPEC_OPTIONS = ("events", "replay")


def parse_replica_spec(spec: str) -> ReplicaSpec:
    """``URL[,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT]]`` (the form ``--kv-events`` builds, and the one
    ``PREHEAT_ROUTER_REPLICAS`` takes).

    >>> parse_replica_spec("http://a:8000,events=tcp://a:5557,replay=tcp://a:5558")
    ReplicaSpec(url='http://a:8000', events=EventSource(endpoint='tcp://a:5557', replay='tcp://a:5558'))
    """
    url, *options = [part.strip() for part in spec.split(",")]
    values: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in SPEC_OPTIONS or not value or name in values:
            raise RouterError(f"replica {spec!r}: options are events=tcp://HOST:PORT and replay=tcp://HOST:PORT")
        if not value.startswith(("tcp://", "ipc://")) or "*" in value:
            raise RouterError(f"replica {spec!r}: {name}={value!r} must be tcp://HOST:PORT (the replica's host)")
        values[name] = value
    address = parse_url(url)
    if "replay" in values and "events" not in values:
        raise RouterError(f"replica {spec!r}: replay= needs events=")
    events = EventSource(values["events"], values.get("replay")) if "events" in values else None
    return ReplicaSpec(address.url, events)


def join_replica_specs(parts: Sequence[str]) -> tuple[str, ...]:
    """Comma-separated items into specs: ``events=``/``replay=`` items belong to the URL before them.

    >>> join_replica_specs(["http://a:1", "events=tcp://a:5557", "http://b:2"])
    ('http://a:1,events=tcp://a:5557', 'http://b:2')
    """
    specs: list[str] = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part.partition("=")[0] in SPEC_OPTIONS and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return tuple(specs)


class Replica:
    """One replica: ``healthy`` (set by the health checker and by failed requests), ``in_flight`` (requests through
    this router now), ``finished`` (requests it answered through this router so far), ``service_seconds`` (moving
    mean of a request's duration there) and its connection pool.

    Its phase as last seen (``/health``'s ``status``: ``ok``, ``standby``, ``sleeping``, ``loading``...; ``down``
    when nothing answered; ``unknown`` before the first check), ``prepared`` (a standby done with its imports),
    ``standby`` (given with ``--standby``: the router may activate it) and ``wake_seconds`` (what its last wake took,
    None while unknown) are what the router knows of it as cold capacity (capacity.py)."""

    def __init__(
        self, url: str, *, timeout: float = 300.0, connect_timeout: float = CONNECT_SECONDS, standby: bool = False
    ) -> None:
        self.address = parse_url(url)
        self.url = self.address.url
        self.timeouts = Timeouts(connect=connect_timeout, read=timeout)
        self.healthy = False  # until the first health check says otherwise
        self.standby = standby
        self.retired = False  # left the fleet (--replicas-from): requests still on it finish, nothing new comes
        self.phase = "unknown"
        self.prepared = False
        self.wake_seconds: float | None = None
        self.version: int | None = None  # the weights version /health reports (--follow replicas; docs/refit.md)
        self.epoch = 0  # and its publisher's epoch: versions are ordered by (epoch, version)
        self.in_flight = 0
        self.finished = 0
        self.service_seconds: float | None = None
        self.last_active = time.monotonic()  # when a request last began or ended here (the idle sleeper reads it)
        # What its own /metrics said last (router/scrape.py; engine replicas): its engine, (running, waiting) and how
        # many of this router's requests had finished there when it was asked (None: not scraped, or not exported).
        self.engine: str | None = None
        self.load: tuple[int, int] | None = None
        self.load_finished = 0
        # The sleep protocol it speaks (router/sleeping.py): "preheat" (its /health is preheat's JSON), "vllm" (it
        # answers vLLM's /is_sleeping), "none" (neither); None until its /health was seen.
        self.sleep_protocol: str | None = None
        self.sleep_level: int | None = None  # the level it was put to sleep at, when known
        # Being put to sleep by this router (held out of rotation meanwhile), and how many times it was: a health
        # check that began before a sleep must not put the sleeper back in rotation with what it saw then.
        self.held_out = False
        self.slept = 0
        self.origin = Origin(self.address.scheme, self.address.host, self.address.port)
        self.pool = Pool(self.timeouts, idle=POOL_SIZE)
        # Bumped by ``close_idle``: the event-loop data path's pooled connections opened before it are not reused.
        self.connection_epoch = 0
        self._lock = threading.Lock()

    def set_healthy(self, healthy: bool) -> bool:
        """Enter (True) or leave rotation; False when it already was so (another thread got there first), or when
        it left the fleet (``retire``): checked under the lock, so a health check finishing as it leaves cannot put
        it back."""
        with self._lock:
            if healthy and (self.retired or self.held_out):
                return False
            changed, self.healthy = self.healthy != healthy, healthy
            return changed

    # -- load ----------------------------------------------------------------------------------------------------
    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.last_active = time.monotonic()

    def end(self, seconds: float | None) -> None:
        """One request is over; ``seconds`` (None when it failed) feeds the mean request duration."""
        with self._lock:
            self.in_flight -= 1
            self.last_active = time.monotonic()
            if seconds is not None:
                self.finished += 1
                self.service_seconds = moving_mean(self.service_seconds, seconds)

    # -- connections ---------------------------------------------------------------------------------------------
    def release(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """Return ``conn`` to the pool once ``response`` was read to its end, unless either side asked to close or the
        answer is an error: a server that refuses a request early (401, 404) may not have read its body, and the
        unread bytes would be taken for the next request sent on this connection."""
        if response.status >= 400 or self.retired:
            conn.close()
            return
        self.pool.release(self.origin, conn, response)  # which closes it when either side asked to, or it is unread

    def retire(self) -> None:
        """The replica left the fleet: out of rotation, its idle connections closed, and those of the requests
        still on it closed as they finish (not pooled for nobody)."""
        with self._lock:
            self.retired, self.healthy = True, False
        self.close_idle()

    def close_idle(self) -> None:
        """Close every pooled connection (the replica was ejected: they point at a dead or restarted process)."""
        self.connection_epoch += 1
        self.pool.close_idle()

    def send(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send one request and wait for the response's status line and headers.

        ``UpstreamError(before_first_byte=True)`` when the replica refused, reset or closed before answering
        anything (a kept-alive connection it had closed is retried once on a fresh one first); ``False`` when it
        did not answer within the timeout: it may still be generating, and a second copy of a slow request on
        another replica only makes a slow fleet slower.
        """
        try:
            return self.pool.send(self.origin, method, path, body=body, headers=headers)
        except HTTPClientError as exc:  # ConnectError (nothing sent), ResponseTimeoutError or ExchangeError
            fresh = not isinstance(exc, ResponseTimeoutError)
            raise UpstreamError(str(exc), before_first_byte=fresh) from exc

    def __repr__(self) -> str:
        return f"Replica({self.url}, healthy={self.healthy}, phase={self.phase}, in_flight={self.in_flight})"
