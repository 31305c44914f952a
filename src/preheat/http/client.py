"""The small HTTP client preheat's processes talk to each other with (the router to its replicas: requests, health
checks, KV-event polls): one timeout policy, one typed error tree, bounded answers.

Timeout policy (``Timeouts``): connecting gets ``connect`` seconds, so a dead or unplugged host fails fast; every
read and write after that gets ``read`` seconds, so a slow answer (a long generation) is not taken for a dead host.
``TCP_NODELAY`` is on: requests and answers are small, and Nagle's algorithm would hold a request's body back for
the server's delayed ACK of its headers.

Errors say what failed, by meaning: ``ConnectError`` (nothing was sent; ``refused`` when the host answered with a
reset: nothing listens there), ``ResponseTimeoutError`` (sent, no answer in time: the server may still be working on
it), ``ExchangeError`` (the connection broke or the answer was malformed), ``AnswerTooLargeError``. All are
``HTTPClientError``, a ``PreheatError`` carrying the URL.

>>> Timeouts.within(10.0), Timeouts.within(0.5)
(Timeouts(connect=2.0, read=10.0), Timeouts(connect=0.5, read=0.5))
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preheat.errors import PreheatError

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

    def __init__(self, url: str, message: str, *, refused: bool) -> None:
        super().__init__(url, message)
        self.refused = refused


class ResponseTimeoutError(HTTPClientError):
    """The request was sent and no answer came within the read timeout."""


class ExchangeError(HTTPClientError):
    """The connection broke during the exchange (reset, closed early) or the answer was not valid HTTP."""


class AnswerTooLargeError(HTTPClientError):
    """The answer's body is larger than the caller accepts (the connection was closed: the rest is unread)."""


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
        raise ConnectError(where, f"connection refused ({exc.strerror})", refused=True) from None
    except TimeoutError:
        raise ConnectError(where, f"no connection within {timeouts.connect:g} s", refused=False) from None
    except OSError as exc:  # ssl.SSLError included: a failed handshake is a failed connection
        raise ConnectError(where, f"cannot connect: {exc.strerror or exc}", refused=False) from None
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
        if self._conn is None:
            self._conn = connect(self.host, self.port, self.timeouts, self.url, self.tls)
        conn = self._conn
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            answer = conn.getresponse()
            data = answer.read() if max_body is None else answer.read(max_body + 1)
        except TimeoutError:
            self.close()
            raise ResponseTimeoutError(url, f"no answer within {self.timeouts.read:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise ExchangeError(url, f"{type(exc).__name__}: {exc}") from None
        if max_body is not None and len(data) > max_body:
            self.close()  # the rest of the answer is still unread on this connection
            raise AnswerTooLargeError(url, f"answer over {max_body} bytes")
        if answer.will_close:
            self.close()
        return Response(answer.status, answer.headers, data)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


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
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HTTPClientError(url, "give an http(s)://host[:port]/path URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    tls = None
    if parts.scheme == "https":
        import ssl

        tls = ssl.create_default_context()
    conn = Connection(parts.hostname, parts.port or (443 if tls else 80), timeouts, tls=tls)
    try:
        return conn.request(method, path, body=body, headers=headers, max_body=max_body)
    finally:
        conn.close()
