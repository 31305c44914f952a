"""preheat's HTTP client: one timeout policy, one redirect and credential policy, one mapping of socket, TLS and
``http.client`` failures onto one typed error tree, and requests on a connection of their own (``request``,
``stream``, ``get``: health checks, scrapes, artifacts from peers). Kept-alive connections pooled by origin (the
router to its replicas, ranged weight reads, KV-event polls) are ``preheat.http.pool``'s, on the same policy.

Timeout policy (``Timeouts``): connecting gets ``connect`` seconds, so a dead or unplugged host fails fast; every
read and write after that gets ``read`` seconds, so a slow answer (a long generation) is not taken for a dead host.
``TCP_NODELAY`` is on: requests and answers are small, and Nagle's algorithm would hold a request's body back for
the server's delayed ACK of its headers.

Errors say what failed, by meaning (``map_exception``, the one place a low-level failure becomes one of them; all in
``core.errors``, all ``HTTPClientError``, a ``PreheatError`` carrying the URL):

=====================================================  ==============================================================
what happened                                          error
=====================================================  ==============================================================
nothing listens on the port (refused)                  ``ConnectError``, ``refused=True``: nothing was sent
no connection in ``connect`` s, unknown host, TLS      ``ConnectError``, ``refused=False`` (``cause``: the failure)
no answer within ``read`` s (or a body stalled)        ``ResponseTimeoutError``: the server may still be working on it
reset, closed before answering or mid-body, bad HTTP   ``ExchangeError``
a body over the caller's limit                         ``AnswerTooLargeError`` (the rest is left unread)
a redirect refused (too many, not http(s))             ``RedirectError``
=====================================================  ==============================================================

TLS: an https connection verifies the server with ``preheat.http.tls.client_context()``: the system's CAs, and the
fleet's CA with the fleet's certificate offered when the process has one (``preheat.http.tls.use_fleet``).

Credentials (``Redirects``, ``without_credentials``): ``Authorization``, ``Cookie`` and ``Proxy-Authorization`` go
to the origin they were given for (scheme, host, port: ``origin``) and are dropped for good at the first redirect
elsewhere.

>>> Timeouts.within(10.0), Timeouts.within(0.5)
(Timeouts(connect=2.0, read=10.0), Timeouts(connect=0.5, read=0.5))
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urljoin, urlsplit

from preheat.core.errors import (
    AnswerTooLargeError,
    ConnectError,
    ExchangeError,
    HTTPClientError,
    RedirectError,
    ResponseTimeoutError,
)
from preheat.http.ranges import parse_length
from preheat.http.tls import client_context

if TYPE_CHECKING:
    import ssl

CONNECT_SECONDS = 2.0  # a host on the same network accepts in milliseconds; two seconds is a dead one


@dataclass(frozen=True)
class Timeouts:
    """Seconds to connect, and for each read or write after that."""

    connect: float = CONNECT_SECONDS
    read: float = 30.0

    @classmethod
    def within(cls, seconds: float) -> Timeouts:
        """Reads may take ``seconds``; connecting at most that too, and no more than ``CONNECT_SECONDS``."""
        return cls(connect=min(CONNECT_SECONDS, seconds), read=seconds)


@dataclass(frozen=True)
class Redirects:
    """Which redirects are followed: at most ``limit``, to http(s) only, and credentials (``CREDENTIAL_HEADERS``)
    are dropped as soon as the scheme, host or port change (a credential is for the server it was given for, never
    for wherever that server points; it is not restored if a later hop comes back).

    >>> Redirects().limit
    3
    """

    limit: int = 3

    def follow(self, url: str, location: str, headers: dict[str, str], hop: int = 1) -> tuple[str, dict[str, str]]:
        """The next URL and the headers to send there, for the ``hop``-th redirect, from ``url`` to ``location``."""
        if hop > self.limit:
            if not self.limit:
                raise RedirectError(url, f"answered a redirect to {location[:200]!r}, and this client follows none")
            raise RedirectError(url, f"more than {self.limit} redirects")
        target = urljoin(url, location)
        if urlsplit(target).scheme not in ("http", "https"):
            raise RedirectError(url, f"redirect to {target!r} refused (http or https only)")
        if origin(target) != origin(url):
            headers = without_credentials(headers)
        return target, headers


REDIRECT_STATUSES = frozenset((301, 302, 303, 307, 308))
DEFAULT_PORTS = {"http": 80, "https": 443}
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})  # never carried to another origin


class Origin(NamedTuple):
    """Scheme, host and port: where credentials belong (RFC 6454) and what connections are pooled by. ``port`` is
    None for a scheme without a default port, -1 for a port that is not one (each an origin of its own)."""

    scheme: str
    host: str
    port: int | None

    @property
    def url(self) -> str:
        """``scheme://host:port``, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def origin(url: str) -> Origin:
    """The origin of ``url``, lower-cased, the scheme's default port filled in: two URLs with equal origins are one
    origin, and credentials go to no other.

    >>> origin("HTTPS://Models.Example") == origin("https://models.example:443/llama")
    True
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a port out of range or not a number: an origin of its own
        port = -1
    return Origin(scheme, (parts.hostname or ""), DEFAULT_PORTS.get(scheme) if port is None else port)


def target_of(url: str) -> tuple[Origin, str]:
    """The origin to connect to for ``url`` (``http(s)://host[:port]/path``) and the path and query to ask for;
    ``HTTPClientError`` when it cannot be asked for.

    >>> target_of("http://[::1]:8000/v1/models?x=1")
    (Origin(scheme='http', host='::1', port=8000), '/v1/models?x=1')
    """
    where = origin(url)
    if where.scheme not in ("http", "https") or not where.host:
        raise HTTPClientError(url, "give an http(s)://host[:port]/path URL")
    if where.port is None or where.port < 0:
        raise HTTPClientError(url, "the port is not a number from 0 to 65535")
    parts = urlsplit(url)
    return where, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def without_credentials(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` less any credential (``Authorization``, ``Cookie``, ``Proxy-Authorization``), for another origin."""
    return {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}


def describe(exc: BaseException, timeouts: Timeouts) -> str:
    """A short human description of a socket or protocol failure."""
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"timed out (connect {timeouts.connect:g} s, read {timeouts.read:g} s)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror})"
    if isinstance(exc, http.client.IncompleteRead):
        return f"connection closed after {len(exc.partial)} bytes of the body"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def map_exception(
    exc: OSError | http.client.HTTPException, url: str, timeouts: Timeouts, *, connecting: bool = False
) -> HTTPClientError:
    """The client error that a socket, TLS or ``http.client`` failure at ``url`` means (the table above):
    ``connecting``: while the connection was being made, when nothing was sent yet.

    >>> map_exception(TimeoutError(), "http://h:1/x", Timeouts(read=5.0))
    ResponseTimeoutError('http://h:1/x: no answer within 5 s')
    """
    if connecting:
        cause = exc if isinstance(exc, OSError) else None
        if isinstance(exc, ConnectionRefusedError):
            return ConnectError(url, f"connection refused ({exc.strerror})", refused=True, cause=cause)
        if isinstance(exc, TimeoutError):
            return ConnectError(url, f"no connection within {timeouts.connect:g} s", refused=False, cause=cause)
        # ssl.SSLError included: a failed handshake is a failed connection
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return ConnectError(url, f"cannot connect: {text}", refused=False, cause=cause)
    if isinstance(exc, TimeoutError):
        return ResponseTimeoutError(url, f"no answer within {timeouts.read:g} s")
    return ExchangeError(url, describe(exc, timeouts))


@contextlib.contextmanager
def map_exceptions(url: str, timeouts: Timeouts, *, connecting: bool = False) -> Iterator[None]:
    """Socket, TLS and ``http.client`` failures inside the block raised as ``map_exception`` maps them (the original
    is the new error's ``__cause__``)."""
    try:
        yield
    except (OSError, http.client.HTTPException) as exc:
        raise map_exception(exc, url, timeouts, connecting=connecting) from exc


@dataclass(frozen=True)
class Response:
    """A whole answer: status, headers (names as sent; look up without regard to case) and body."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes


def connect(
    host: str, port: int, timeouts: Timeouts, url: str | None = None, tls: ssl.SSLContext | None = None
) -> http.client.HTTPConnection:
    """An open connection to ``host:port`` under ``timeouts`` (``url`` names it in errors), with TCP_NODELAY;
    HTTPS with ``tls``. Raises ``ConnectError``."""
    where = url or Origin("https" if tls else "http", host, port).url
    conn = (
        http.client.HTTPSConnection(host, port, timeout=timeouts.connect, context=tls)
        if tls is not None
        else http.client.HTTPConnection(host, port, timeout=timeouts.connect)
    )
    with map_exceptions(where, timeouts, connecting=True):
        conn.connect()
    sock = conn.sock
    assert sock is not None  # connect() succeeded
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeouts.read)
    return conn


def read_whole(answer: http.client.HTTPResponse, url: str, timeouts: Timeouts, max_body: int | None = None) -> bytes:
    """``answer``'s whole body (``AnswerTooLargeError`` past ``max_body`` bytes, when given: the rest is left unread,
    so close its connection); a body cut short is an ``ExchangeError``, never a shorter body."""
    with map_exceptions(url, timeouts):
        data = answer.read() if max_body is None else answer.read(max_body + 1)
    if max_body is not None and len(data) > max_body:
        raise AnswerTooLargeError(url, f"answer over {max_body} bytes")
    if answer.length:  # read(n) returns what came before the connection closed; the length still says what did not
        raise ExchangeError(url, f"connection closed after {len(data)} bytes of the body")
    return data


def _opened(url: str, timeouts: Timeouts) -> tuple[http.client.HTTPConnection, str]:
    """A connection of its own for ``url``, open, and the path to ask for."""
    where, path = target_of(url)
    tls = client_context() if where.scheme == "https" else None
    assert where.port is not None  # target_of refuses a URL without one
    return connect(where.host, where.port, timeouts, url, tls), path


def request(
    url: str,
    method: str = "GET",
    *,
    timeouts: Timeouts,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    max_body: int | None = None,
) -> Response:
    """One request on a connection of its own to ``url`` (``http(s)://host[:port]/path``) and its whole answer (at
    most ``max_body`` bytes of body, when given)."""
    conn, path = _opened(url, timeouts)
    try:
        with map_exceptions(url, timeouts):
            conn.request(method, path, body=body, headers=dict(headers or {}))
            answer = conn.getresponse()
        return Response(answer.status, answer.headers, read_whole(answer, url, timeouts, max_body))
    finally:
        conn.close()


class Streamed:
    """An answer as it comes (from ``stream``): ``status`` and ``headers`` now, the body by ``lines()`` or
    ``read()``; failures while reading are the client's typed errors, a body cut short included."""

    def __init__(self, url: str, answer: http.client.HTTPResponse, timeouts: Timeouts) -> None:
        self.url, self.timeouts = url, timeouts
        self.status, self.headers = answer.status, answer.headers
        self._answer = answer

    def lines(self) -> Iterator[bytes]:
        """The body line by line, each as soon as it has arrived (ending ``\\n`` included)."""
        while True:
            with map_exceptions(self.url, self.timeouts):
                line = self._answer.readline()
            if not line:
                self._check_whole()
                return
            yield line

    def read(self, max_body: int, deadline_s: float | None = None) -> bytes:
        """The whole body, refused (``AnswerTooLargeError``) past ``max_body`` bytes, announced or sent, and
        (``ResponseTimeoutError``) when it has not all come ``deadline_s`` seconds after this call."""
        declared = parse_length(self.headers.get("Content-Length"))
        if declared is not None and declared > max_body:
            raise AnswerTooLargeError(self.url, f"answer of {declared} bytes announced, over {max_body}")
        started = time.monotonic()
        chunks: list[bytes] = []
        received = 0
        while True:
            with map_exceptions(self.url, self.timeouts):
                chunk = self._answer.read1(min(1 << 20, max_body + 1 - received))
            if not chunk:
                self._check_whole()
                return b"".join(chunks)
            chunks.append(chunk)
            received += len(chunk)
            if received > max_body:
                raise AnswerTooLargeError(self.url, f"answer over {max_body} bytes")
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise ResponseTimeoutError(self.url, f"answer not complete within {deadline_s:g} s")

    def _check_whole(self) -> None:
        """At the end of the body: refuse one whose connection closed before its announced length."""
        if self._answer.length:
            raise ExchangeError(self.url, f"connection closed {self._answer.length} bytes before the end of the body")


@contextlib.contextmanager
def stream(
    url: str,
    method: str = "GET",
    *,
    timeouts: Timeouts,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> Iterator[Streamed]:
    """One request on a connection of its own to ``url``; the answer is read as it comes within the block, and the
    connection closed when it ends.

    >>> with stream(url, "POST", body=b"{}", timeouts=Timeouts.within(300)) as answer:  # doctest: +SKIP
    ...     for line in answer.lines():
    ...         print(line)
    """
    conn, path = _opened(url, timeouts)
    try:
        with map_exceptions(url, timeouts):
            conn.request(method, path, body=body, headers=dict(headers or {}))
            answer = conn.getresponse()
        yield Streamed(url, answer, timeouts)
    finally:
        conn.close()


def get(
    url: str,
    *,
    timeouts: Timeouts,
    headers: Mapping[str, str] | None = None,
    max_body: int,
    deadline_s: float | None = None,
    redirects: Redirects | None = None,
) -> Response:
    """GET ``url`` and read its whole body within ``max_body`` bytes and ``deadline_s`` seconds in all (redirects
    included); redirects are followed under ``redirects`` (None: a 3xx is returned as it is)."""
    started = time.monotonic()
    sent = dict(headers or {})
    hops = 0
    while True:
        left = None if deadline_s is None else deadline_s - (time.monotonic() - started)
        if left is not None and left <= 0:
            raise ResponseTimeoutError(url, f"answer not complete within {deadline_s:g} s")
        with stream(url, timeouts=timeouts, headers=sent) as answer:
            location = answer.headers.get("Location")
            if redirects is None or answer.status not in REDIRECT_STATUSES or not location:
                return Response(answer.status, answer.headers, answer.read(max_body, left))
        hops += 1
        url, sent = redirects.follow(url, location, sent, hop=hops)
