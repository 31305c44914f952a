"""Kept-alive connections, pooled by origin, and the requests sent on them: the router to its replicas, ranged
weight reads (``sources.http``), KV-event polls and NIXL adverts.

A request takes an idle connection to its origin (scheme, host, port) or opens one (``client.connect``: the timeout
policy, TCP_NODELAY, TLS), and its connection goes back to the pool only once its answer was read to its end
(``Pool.release``): a connection carries one request at a time, so two threads never interleave on one socket, and
an answer being read may move from thread to thread. At most ``idle`` connections per origin wait in the pool, the
most recently used taken first (the least likely to have been closed by the server's idle timeout meanwhile).

A server may close a kept-alive connection while it waits there; the next request on it then fails before any
answer (reset, broken pipe, closed without a status line). ``Pool.send`` resends such a request once, on a fresh
connection: the server never saw it. Every other failure is one of the ``HTTPClientError`` family, mapped in one
place (``client.map_exception``): ``ConnectError`` (nothing was sent), ``ResponseTimeoutError``, ``ExchangeError``.

Three ways in: ``Pool.send`` (an origin and a path, the answer's body left on the wire: the router's hot path, which
relays it chunk by chunk), ``Pool.request`` (a URL, redirects followed under a ``Redirects`` policy, an ``Answer``
whose body the caller reads into its own buffers), ``Connection`` (one kept-alive connection reading whole answers).
"""

from __future__ import annotations

import http.client
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preheat.core.errors import HTTPClientError
from preheat.http.client import (
    REDIRECT_STATUSES,
    Origin,
    Redirects,
    Response,
    Timeouts,
    connect,
    map_exception,
    read_whole,
    target_of,
)
from preheat.http.ranges import parse_length
from preheat.http.tls import client_context

if TYPE_CHECKING:
    import ssl

IDLE_PER_ORIGIN = 32  # idle connections kept per origin; more concurrent requests open (then close) extra ones
DRAIN_LIMIT = 64 * 1024  # an unwanted body this small is read to keep its connection; a larger one closes it
# What a request on a connection the server closed while it was idle fails with: safe to resend on a fresh one.
STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.BadStatusLine)


class Pool:
    """Kept-alive connections by origin, under one ``Timeouts``; thread-safe. HTTPS connections verify certificates
    with ``tls()``'s context (default: ``preheat.http.tls.client_context()``: the fleet's, else the standard
    library's made per connection so that ``SSL_CERT_FILE`` is read when the connection is opened). Idle
    connections close when the pool is collected."""

    def __init__(
        self, timeouts: Timeouts, *, idle: int = IDLE_PER_ORIGIN, tls: Callable[[], ssl.SSLContext] | None = None
    ) -> None:
        self.timeouts = timeouts
        self.idle = idle
        self._tls = tls
        self._idle: dict[Origin, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_idle, self._idle)

    def send(
        self,
        where: Origin,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str],
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send ``method target`` to ``where`` and wait for the answer's status line and headers. Its body is the
        caller's to read; then ``release`` the connection (or close it). Raises ``ConnectError`` (nothing was
        sent), ``ResponseTimeoutError`` (no answer within the read timeout) or ``ExchangeError``."""
        with self._lock:
            idle = self._idle.get(where)
            conn = idle.pop() if idle else None
        if conn is not None:
            try:
                conn.request(method, target, body=body, headers=headers)
                return conn, conn.getresponse()
            except STALE:
                conn.close()  # closed by the server while idle: it never saw this request, which goes out again below
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise map_exception(exc, where.url + target, self.timeouts) from exc
        conn = self.open(where, target)
        try:
            conn.request(method, target, body=body, headers=headers)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise map_exception(exc, where.url + target, self.timeouts) from exc

    def open(self, where: Origin, target: str = "") -> http.client.HTTPConnection:
        """A new connection to ``where`` (``target`` names the request in errors), not pooled until released."""
        if where.scheme not in ("http", "https") or where.port is None or where.port < 0:
            raise HTTPClientError(where.url + target, "give an http(s)://host[:port] URL with a port from 0 to 65535")
        tls = None
        if where.scheme == "https":
            tls = client_context() if self._tls is None else self._tls()
        return connect(where.host, where.port, self.timeouts, where.url + target, tls)

    def release(self, where: Origin, conn: http.client.HTTPConnection, answer: http.client.HTTPResponse) -> None:
        """Give ``conn`` back to the pool of ``where`` once ``answer`` was read to its end. It is closed instead when
        either side asked to close, when the answer was not read to its end (the rest would be taken for the next
        request's answer), or when ``idle`` connections already wait there."""
        if answer.will_close or not answer.isclosed():
            conn.close()
            return
        with self._lock:
            idle = self._idle.get(where)
            if idle is None:
                idle = self._idle[where] = []
            if len(idle) < self.idle:
                idle.append(conn)
                return
        conn.close()

    def close_idle(self, where: Origin | None = None) -> None:
        """Close the idle connections to ``where`` (None: to every origin); those in use close or come back as their
        answers end, and new ones are opened as needed."""
        with self._lock:
            if where is None:
                closing = [conn for idle in self._idle.values() for conn in idle]
                self._idle.clear()
            else:
                closing = self._idle.pop(where, [])
        for conn in closing:
            conn.close()

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        redirects: Redirects | None = None,
    ) -> Answer:
        """Send ``method url`` and return the answer once its headers are in, its body still to read; redirects are
        followed under ``redirects`` (None: a 3xx is the answer). Raises ``send``'s errors, ``RedirectError``, and
        ``HTTPClientError`` for a URL that cannot be asked for (not http(s), no host, a bad port)."""
        sent = dict(headers or {})
        hops = 0
        while True:
            where, target = target_of(url)
            conn, response = self.send(where, method, target, headers=sent)
            hops += 1
            answer = Answer(method, url, where, conn, response, self, hops)
            location = response.getheader("Location")
            if redirects is None or response.status not in REDIRECT_STATUSES or not location:
                return answer
            answer.drain()
            url, sent = redirects.follow(url, location, sent, hop=hops)


def _close_idle(idle: dict[Origin, list[http.client.HTTPConnection]]) -> None:
    for conns in idle.values():
        for conn in conns:
            conn.close()


@dataclass(eq=False)
class Answer:
    """An answer from ``Pool.request``: status and headers in, the body still on its connection (``body``: read it
    with ``read``/``readinto``). End it with ``finish()`` once the body was read to its end (the connection goes
    back to the pool), ``drain()`` (the rest is not wanted) or ``abandon()``. Each acts once: an answer ended is
    never ended again, so it cannot close a connection that another request took from the pool meanwhile."""

    method: str
    url: str  # after redirects
    where: Origin
    conn: http.client.HTTPConnection
    body: http.client.HTTPResponse
    pool: Pool = field(repr=False)
    hops: int = 1  # requests it took: 1 + the redirects followed
    _open: bool = field(default=True, repr=False)

    @property
    def status(self) -> int:
        return self.body.status

    def header(self, name: str) -> str | None:
        return self.body.getheader(name)

    def int_header(self, name: str) -> int | None:
        """A length header's value: ASCII digits only, at most 19 of them; anything else is None."""
        return parse_length(self.header(name))

    def finish(self) -> None:
        """The body was read: the connection goes back to the pool (or is closed when its body is not at its end)."""
        if self._open:
            self._open = False
            self.pool.release(self.where, self.conn, self.body)

    def drain(self) -> None:
        """Discard a small rest of the body to keep the connection; close it for a large or unknown one."""
        if not self._open:
            return
        remaining = self.body.length
        if self.method == "HEAD" or (remaining is not None and remaining <= DRAIN_LIMIT):
            try:
                self.body.read()
            except (OSError, http.client.HTTPException):
                self.abandon()
                return
            self.finish()
        else:
            self.abandon()

    def abandon(self) -> None:
        """Close the connection, dropping whatever the server still has to send."""
        if self._open:
            self._open = False
            self.body.close()
            self.conn.close()


class Connection:
    """One kept-alive connection to ``host:port`` (HTTPS with ``tls``) that reads whole answers: a ``Pool`` of one,
    so a connection the server closed while idle is reopened and its request resent. One thread at a time."""

    def __init__(self, host: str, port: int, timeouts: Timeouts, *, tls: ssl.SSLContext | None = None) -> None:
        self.where = Origin("https" if tls is not None else "http", host, port)
        self.url = self.where.url
        self.timeouts = timeouts
        self._pool = Pool(timeouts, idle=1, tls=None if tls is None else lambda: tls)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_body: int | None = None,
    ) -> Response:
        """Send one request and read its whole answer (at most ``max_body`` bytes of body, when given)."""
        conn, answer = self._pool.send(self.where, method, path, body=body, headers=dict(headers or {}))
        try:
            data = read_whole(answer, self.url + path, self.timeouts, max_body)
        except HTTPClientError:
            conn.close()
            raise
        self._pool.release(self.where, conn, answer)
        return Response(answer.status, answer.headers, data)

    def close(self) -> None:
        self._pool.close_idle()
