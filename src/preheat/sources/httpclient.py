"""A small HTTP/1.1 client on ``http.client`` for the HTTP(S) source.

What it adds to the standard library: keep-alive connections (one per thread and host, so reader threads never share
a socket), separate connect and read timeouts, redirects, and status codes mapped to preheat's errors (404 ->
``SourceNotFoundError``, 401/403 -> ``SourceAccessError``, 5xx/429 and network failures -> ``TransientError`` for the
retry loop in ``preheat.sources.net``).

Credentials and redirects: the bearer token goes only to the token's origin, where an origin is the scheme, host and
port of a URL (RFC 6454; the default port filled in, so ``https://h`` and ``https://h:443`` are one origin, and two
ports on one host are two origins). A redirect that changes any of the three drops the token, and any
``Authorization`` or ``Cookie`` header the caller gave, for the rest of that request's redirects, even one that comes
back (``https://a -> http://a`` or ``https://a -> https://b -> https://a`` is answered without it).

Connection opening (the timeout policy, TCP_NODELAY), the origin comparison, the credential rule and the description
of socket failures are ``preheat.http.client``'s (``connect``, ``origin``, ``without_credentials``, ``describe``);
this module adds the per-thread pool, the ranged-read response handling and the mapping to ``sources`` errors.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from preheat.core.errors import SourceAccessError, SourceError, SourceNotFoundError
from preheat.http.client import ConnectError, Timeouts, connect, describe, origin, without_credentials
from preheat.http.ranges import parse_length
from preheat.sources.net import NetSettings, TransientError
from preheat.sources.stats import TransferStats

REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
DRAIN_LIMIT = 64 * 1024  # read an unwanted body this small to keep the connection; close it for anything larger
USER_AGENT = "preheat/0.1"
# Errors a server's idle-timeout produces on a kept-alive connection: safe to resend at once on a fresh one.
_STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.BadStatusLine)


@dataclass(eq=False)
class Connection:
    """One HTTP connection to ``host:port`` (TLS with ``tls``), opened by ``preheat.http.client.connect`` on first
    use and again once closed. ``owner`` is the thread it belongs to, or None for a dedicated one (a stream that
    moves between threads), which is closed for good when released."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    timeouts: Timeouts
    owner: threading.Thread | None
    requests: int = 0
    live: http.client.HTTPConnection | None = None  # None until first opened

    def opened(self) -> http.client.HTTPConnection:
        """The connection, (re)connected now if it is closed (by ``reset`` or by a server's ``Connection: close``).
        Raises ``ConnectError``."""
        if self.live is None or self.live.sock is None:
            self.live = connect(self.host, self.port, self.timeouts, tls=self.tls)
        return self.live

    def reset(self) -> None:
        """Close the socket; the next request reconnects."""
        if self.live is not None:
            self.live.close()
        self.requests = 0


class ConnectionPool:
    """Keep-alive connections, one per (thread, scheme, host), plus dedicated ones handed out on request.

    Connections of threads that have ended are closed when the next one is created; ``close_all`` (also run when the
    pool is garbage-collected) closes everything.
    """

    def __init__(self, settings: NetSettings) -> None:
        self._settings = settings
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[Connection] = []
        weakref.finalize(self, _close_each, self._all)

    def get(self, scheme: str, netloc: str) -> Connection:
        """This thread's connection to ``scheme://netloc``."""
        conns: dict[tuple[str, str], Connection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((scheme, netloc))
        if conn is None:
            conn = conns[(scheme, netloc)] = self._new(scheme, netloc, threading.current_thread())
        return conn

    def dedicated(self, scheme: str, netloc: str) -> Connection:
        """A new connection no thread owns; give it back with ``release``."""
        return self._new(scheme, netloc, None)

    def detach(self, conn: Connection) -> None:
        """Make this thread's ``conn`` dedicated (its response is kept as a stream); the thread gets a new one."""
        conns: dict[tuple[str, str], Connection] = self._local.__dict__.get("conns", {})
        for key, value in list(conns.items()):
            if value is conn:
                del conns[key]
        conn.owner = None

    def release(self, conn: Connection) -> None:
        """Close ``conn``; a dedicated one is also forgotten."""
        conn.reset()
        if conn.owner is None:
            with self._lock:
                if conn in self._all:
                    self._all.remove(conn)

    def close_all(self) -> None:
        with self._lock:
            conns = list(self._all)
        _close_each(conns)

    def _new(self, scheme: str, netloc: str, owner: threading.Thread | None) -> Connection:
        _, host, port = origin_of(f"{scheme}://{netloc}")
        assert port is not None  # http(s) only: HTTPClient checks the scheme and the port first
        # A TLS context per connection: SSL_CERT_FILE is read when it is made (certificates verified).
        tls = ssl.create_default_context() if scheme == "https" else None
        conn = Connection(host, port, tls, timeouts_of(self._settings), owner)
        with self._lock:
            dead = [c for c in self._all if c.owner is not None and not c.owner.is_alive()]
            for c in dead:
                self._all.remove(c)
            self._all.append(conn)
        _close_each(dead)
        return conn


def _close_each(conns: list[Connection]) -> None:
    for conn in conns:
        if conn.live is not None:
            conn.live.close()


@dataclass(eq=False)
class Response:
    """A response whose body has not been read yet. Either read the body to its end, ``drain()`` or ``abandon()``:
    a half-read body would leave the connection unusable."""

    method: str
    url: str  # after redirects
    body: http.client.HTTPResponse
    conn: Connection
    pool: ConnectionPool = field(repr=False)

    @property
    def status(self) -> int:
        return self.body.status

    def header(self, name: str) -> str | None:
        return self.body.getheader(name)

    def int_header(self, name: str) -> int | None:
        value = self.header(name)
        return parse_length(value)  # ASCII digits only, at most 19 of them: anything else is None

    def drain(self) -> None:
        """Discard a small body to keep the connection alive; close the connection for a large or unknown one."""
        remaining = self.body.length
        if self.method == "HEAD" or (remaining is not None and remaining <= DRAIN_LIMIT):
            try:
                self.body.read()
            except (OSError, http.client.HTTPException):
                self.abandon()
                return
            if self.conn.owner is None:
                self.pool.release(self.conn)
        else:
            self.abandon()

    def abandon(self) -> None:
        """Close the connection, dropping whatever the server still has to send."""
        self.body.close()
        self.pool.release(self.conn)


class HTTPClient:
    """Sends requests with timeouts, redirects and the optional bearer token; counts requests in ``stats``."""

    def __init__(self, *, token: str | None, token_netloc: str, settings: NetSettings, stats: TransferStats) -> None:
        self.settings = settings
        self.timeouts = timeouts_of(settings)
        self.stats = stats
        self.pool = ConnectionPool(settings)
        self._token = token or None  # "" means none (a peer origin passes it so PREHEAT_HTTP_TOKEN is not read)
        self._token_netloc = token_netloc

    def send(
        self, method: str, url: str, headers: Mapping[str, str] | None = None, *, dedicated: bool = False
    ) -> Response:
        """Send ``method url`` and return the response once its headers have arrived, following redirects.

        ``dedicated`` sends it on a new connection that no thread owns (for a body read by several threads in turn).
        Raises ``TransientError`` for network failures, ``SourceError`` for TLS failures and redirect loops.
        """
        given = dict(headers or {})
        authorize = self._token is not None and urlsplit(url).netloc == self._token_netloc
        here = origin_of(url)
        limit = min(self.settings.redirects, MAX_REDIRECTS)
        for _ in range(limit + 1):
            response = self._send_once(method, url, given, dedicated=dedicated, authorize=authorize)
            location = response.header("Location")
            if response.status not in REDIRECTS or not location:
                return response
            response.drain()
            if limit == 0:
                raise SourceError(f"{url}: answered a redirect to {location[:200]!r}, and this source follows none")
            url = urljoin(url, location)
            there = origin_of(url)
            if there != here:  # another scheme, host or port: credentials stay behind, for good
                authorize = False
                given = without_credentials(given)
            here = there
        raise SourceError(f"{url}: more than {limit} redirects")

    def check(self, response: Response, what: str) -> None:
        """Return for 2xx; otherwise release the response and raise the error its status means."""
        status = response.status
        if 200 <= status < 300:
            return
        reason = response.body.reason
        response.drain()
        if status in (404, 410):
            raise SourceNotFoundError(
                f"{response.url}: not found (HTTP {status}); check the URL and that it was uploaded"
            )
        if status in (401, 403):
            raise SourceAccessError(f"{response.url}: access denied (HTTP {status} {reason}); {self._token_hint()}")
        if status in (408, 429) or status >= 500:
            raise TransientError(f"HTTP {status} {reason}")
        raise SourceError(f"{what}: unexpected answer HTTP {status} {reason}")

    def _token_hint(self) -> str:
        if self._token is None:
            return (
                "if the server needs a token, set PREHEAT_HTTP_TOKEN (sent as 'Authorization: Bearer <token>') "
                "or pass token= to HTTPOrigin"
            )
        return "a bearer token was sent (PREHEAT_HTTP_TOKEN or token=) and refused: check that it is valid here"

    def _send_once(
        self, method: str, url: str, headers: Mapping[str, str], *, dedicated: bool, authorize: bool
    ) -> Response:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SourceError(f"{url}: not an http(s) URL")
        try:
            parts.port  # noqa: B018 - raises ValueError for a port that is not 0-65535 (a redirect may name one)
        except ValueError:
            raise SourceError(f"{url}: not a valid port") from None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **headers}
        if authorize and self._token is not None:
            sent["Authorization"] = f"Bearer {self._token}"
        conn = (
            self.pool.dedicated(parts.scheme, parts.netloc) if dedicated else self.pool.get(parts.scheme, parts.netloc)
        )
        while True:
            reused = conn.requests > 0
            try:
                opened = conn.opened()
            except ConnectError as exc:
                self.pool.release(conn)
                if isinstance(exc.cause, ssl.SSLCertVerificationError):
                    raise SourceError(
                        f"{url}: TLS certificate rejected ({exc.cause.verify_message}); "
                        "point SSL_CERT_FILE at the CA bundle"
                    ) from None
                raise TransientError(describe(exc.cause or exc, self.timeouts)) from exc
            try:
                opened.request(method, target, headers=sent)
                body = opened.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.reset()
                if reused and isinstance(exc, _STALE):
                    continue  # the server closed this idle keep-alive connection; resend on a fresh one
                self.pool.release(conn)
                raise TransientError(describe(exc, self.timeouts)) from exc
            conn.requests += 1
            self.stats.add(requests=1)
            return Response(method, url, body, conn, self.pool)


def timeouts_of(settings: NetSettings) -> Timeouts:
    """The ``preheat.http.client`` timeout policy for ``settings`` (``PREHEAT_HTTP_TIMEOUT``)."""
    return Timeouts(connect=settings.connect_timeout, read=settings.read_timeout)


origin_of = origin  # the origin comparison is preheat.http.client's (kept under this name for callers)
