"""The small HTTP client preheat's processes talk to each other with (the router to its replicas: requests, health
checks, KV-event polls): one timeout policy, one typed error tree, bounded answers.

Timeout policy (``Timeouts``): connecting gets ``connect`` seconds, so a dead or unplugged host fails fast; every
read and write after that gets ``read`` seconds, so a slow answer (a long generation) is not taken for a dead host.
``TCP_NODELAY`` is on: requests and answers are small, and Nagle's algorithm would hold a request's body back for
the server's delayed ACK of its headers.

Errors say what failed, by meaning: ``ConnectError`` (nothing was sent; ``refused`` when the host answered with a
reset: nothing listens there), ``ResponseTimeoutError`` (sent, no answer in time: the server may still be working on
it), ``ExchangeError`` (the connection broke or the answer was malformed), ``AnswerTooLargeError``,
``RedirectError``. All are ``HTTPClientError``, a ``PreheatError`` carrying the URL.

Besides whole answers (``request``, ``Connection``): ``stream`` reads an answer as it comes (a streamed chat), and
``get`` follows redirects under a ``Redirects`` policy with a byte cap and an overall deadline (artifacts from
peers). Ranged weight reads (``preheat.sources.httpclient``) keep their own pooled connections and read straight
into the caller's buffers, but open them with ``connect``, compare origins with ``origin``, drop credentials with
``without_credentials`` and describe failures with ``describe``, all from here.

>>> Timeouts.within(10.0), Timeouts.within(0.5)
(Timeouts(connect=2.0, read=10.0), Timeouts(connect=0.5, read=0.5))
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from preheat.core.errors import PreheatError
from preheat.http.ranges import parse_length

if TYPE_CHECKING:
    import ssl

CONNECT_SECONDS = 2.0  # a host on the same network accepts in milliseconds; two seconds is a dead one


class HTTPClientError(PreheatError):
    """A request to ``url`` failed before a whole answer came back."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class ConnectError(HTTPClientError):
    """No connection: nothing was sent. ``refused``: the host is up and nothing listens on the port."""

    def __init__(self, url: str, message: str, *, refused: bool, cause: OSError | None = None) -> None:
        super().__init__(url, message)
        self.refused = refused
        self.cause = cause  # the socket or TLS failure, for callers that tell a rejected certificate apart


class ResponseTimeoutError(HTTPClientError):
    """The request was sent and no answer came within the read timeout."""


class ExchangeError(HTTPClientError):
    """The connection broke during the exchange (reset, closed early) or the answer was not valid HTTP."""


class AnswerTooLargeError(HTTPClientError):
    """The answer's body is larger than the caller accepts (the connection was closed: the rest is unread)."""


class RedirectError(HTTPClientError):
    """A redirect the ``Redirects`` policy refuses to follow: too many, or to a scheme other than http(s)."""


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
    """Which redirects ``get`` follows: at most ``limit``, to http(s) only, and credentials (``CREDENTIAL_HEADERS``)
    are dropped as soon as the scheme, host or port change (a credential is for the server it was given for, never
    for wherever that server points; it is not restored if a later hop comes back).

    >>> Redirects().limit
    3
    """

    limit: int = 3

    def follow(self, url: str, location: str, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The next URL and the headers to send there, for a redirect from ``url`` to ``location``."""
        target = urljoin(url, location)
        if urlsplit(target).scheme not in ("http", "https"):
            raise RedirectError(url, f"redirect to {target!r} refused (http or https only)")
        if origin(target) != origin(url):
            headers = without_credentials(headers)
        return target, headers


REDIRECT_STATUSES = frozenset((301, 302, 303, 307, 308))
DEFAULT_PORTS = {"http": 80, "https": 443}
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})  # never carried to another origin


def origin(url: str) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of ``url``, lower-cased, the scheme's default port filled in: two URLs with equal
    tuples are one origin (RFC 6454), and credentials go to no other.

    >>> origin("HTTPS://Models.Example") == origin("https://models.example:443/llama")
    True
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a port out of range or not a number: an origin of its own
        port = -1
    return scheme, (parts.hostname or ""), DEFAULT_PORTS.get(scheme) if port is None else port


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
    HTTPS with ``tls``."""
    where = url or f"{'https' if tls else 'http'}://{host}:{port}"
    conn = (
        http.client.HTTPSConnection(host, port, timeout=timeouts.connect, context=tls)
        if tls is not None
        else http.client.HTTPConnection(host, port, timeout=timeouts.connect)
    )
    try:
        conn.connect()
    except ConnectionRefusedError as exc:
        raise ConnectError(where, f"connection refused ({exc.strerror})", refused=True, cause=exc) from None
    except TimeoutError as exc:
        raise ConnectError(where, f"no connection within {timeouts.connect:g} s", refused=False, cause=exc) from None
    except OSError as exc:  # ssl.SSLError included: a failed handshake is a failed connection
        raise ConnectError(where, f"cannot connect: {exc.strerror or exc}", refused=False, cause=exc) from None
    sock = conn.sock
    assert sock is not None  # connect() succeeded
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeouts.read)
    return conn


class Connection:
    """One kept-alive connection to ``host:port``, opened on first use and again after any failure. Not
    thread-safe: one per thread, or one per polled server."""

    def __init__(self, host: str, port: int, timeouts: Timeouts, *, tls: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.timeouts, self.tls = host, port, timeouts, tls
        self.url = f"{'https' if tls else 'http'}://{host}:{port}"
        self._conn: http.client.HTTPConnection | None = None

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
        url = self.url + path
        conn = self.opened()
        with _mapped(url, self.timeouts, self.close):
            conn.request(method, path, body=body, headers=dict(headers or {}))
            answer = conn.getresponse()
            data = answer.read() if max_body is None else answer.read(max_body + 1)
        if max_body is not None and len(data) > max_body:
            self.close()  # the rest of the answer is still unread on this connection
            raise AnswerTooLargeError(url, f"answer over {max_body} bytes")
        if answer.will_close:
            self.close()
        return Response(answer.status, answer.headers, data)

    def opened(self) -> http.client.HTTPConnection:
        """The underlying connection, connected now if it is not open."""
        if self._conn is None:
            self._conn = connect(self.host, self.port, self.timeouts, self.url, self.tls)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@contextlib.contextmanager
def _mapped(url: str, timeouts: Timeouts, on_error: Callable[[], None]) -> Iterator[None]:
    """Socket and protocol failures during an exchange as the client's typed errors (``on_error()`` first)."""
    try:
        yield
    except TimeoutError:
        on_error()
        raise ResponseTimeoutError(url, f"no answer within {timeouts.read:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        on_error()
        raise ExchangeError(url, f"{type(exc).__name__}: {exc}") from None


def _connection(url: str, timeouts: Timeouts) -> tuple[Connection, str]:
    """A connection for ``url`` (``http(s)://host[:port]/path``), not opened yet, and the path to ask for."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HTTPClientError(url, "give an http(s)://host[:port]/path URL")
    try:
        port = parts.port
    except ValueError:
        raise HTTPClientError(url, "the port is not a number from 0 to 65535") from None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    tls = None
    if parts.scheme == "https":
        import ssl

        tls = ssl.create_default_context()
    return Connection(parts.hostname, port or (443 if tls else 80), timeouts, tls=tls), path


def request(
    url: str,
    method: str = "GET",
    *,
    timeouts: Timeouts,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    max_body: int | None = None,
) -> Response:
    """One request on a connection of its own to ``url`` (``http(s)://host[:port]/path``); see
    ``Connection.request``."""
    conn, path = _connection(url, timeouts)
    try:
        return conn.request(method, path, body=body, headers=headers, max_body=max_body)
    finally:
        conn.close()


class Streamed:
    """An answer as it comes (from ``stream``): ``status`` and ``headers`` now, the body by ``lines()`` or
    ``read()``; failures while reading are the client's typed errors."""

    def __init__(self, url: str, answer: http.client.HTTPResponse, timeouts: Timeouts) -> None:
        self.url, self.timeouts = url, timeouts
        self.status, self.headers = answer.status, answer.headers
        self._answer = answer

    def lines(self) -> Iterator[bytes]:
        """The body line by line, each as soon as it has arrived (ending ``\\n`` included)."""
        while True:
            with _mapped(self.url, self.timeouts, _nothing):
                line = self._answer.readline()
            if not line:
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
            with _mapped(self.url, self.timeouts, _nothing):
                chunk = self._answer.read1(min(1 << 20, max_body + 1 - received))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            received += len(chunk)
            if received > max_body:
                raise AnswerTooLargeError(self.url, f"answer over {max_body} bytes")
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise ResponseTimeoutError(self.url, f"answer not complete within {deadline_s:g} s")


def _nothing() -> None:
    """No cleanup: the stream's connection is closed when its ``with`` block ends."""


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
    conn, path = _connection(url, timeouts)
    try:
        opened = conn.opened()
        with _mapped(url, timeouts, conn.close):
            opened.request(method, path, body=body, headers=dict(headers or {}))
            answer = opened.getresponse()
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
        if hops > redirects.limit:
            raise RedirectError(url, f"more than {redirects.limit} redirects")
        url, sent = redirects.follow(url, location, sent)
