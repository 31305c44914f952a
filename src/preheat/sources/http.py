"""HTTP(S) origins: ``Range`` requests streamed straight into the loader's buffers, never through a temporary file.

``HTTPOrigin("https://host/models/llama")`` is a URL prefix holding a checkpoint; ``open(name)`` gives an
``HTTPFile`` whose ``readv(offset, buffers)`` sends ``Range: bytes=a-b`` on the calling thread's keep-alive connection
and reads the body with ``readinto`` directly into the caller's memoryviews.

Trust, but check: a 206 whose ``Content-Range`` is not exactly the range asked for (or whose total is not the size
the plan was made with) is refused with ``SourceError``; wrong bytes are never returned.

Servers that ignore ``Range`` (``python -m http.server`` does) answer 200 with the whole file. The first such answer
marks the origin (``HTTPOrigin.ignores_range``) and from then on its files are read as streams: a reader takes the
idle stream positioned closest before its offset (or opens a new one from byte 0), skips forward to its offset, reads
its bytes, and leaves the stream for the next reader. Reading a file front to back with N threads therefore costs
about one pass plus up to N restarts, instead of a whole-file download per request. It is correct, but slower than a
server that honours Range; a warning says so once per origin.

Versions: the request that learns a file's size also records its ``ETag`` (strong only) and ``Last-Modified``
(``HTTPFile.validator()``). After ``require(validator)`` every GET is conditional (``If-Match``, else
``If-Unmodified-Since``) and an answer naming another version, or 412, raises ``SourceChangedError``: a resumed pull
never mixes the bytes of two versions of a file.

Authentication: ``token=``, else ``PREHEAT_HTTP_TOKEN`` when ``PREHEAT_HTTP_TOKEN_HOSTS`` names the origin's host
(``preheat.sources.token``: never over plain http beyond loopback), is sent as ``Authorization: Bearer <token>``,
only to the origin's own host, and a redirect to another origin (scheme, host or port) drops it, and any
``Authorization`` or ``Cookie`` header, for the rest of that request's redirects (``preheat.http.client.Redirects``).

Connections, redirects and the mapping of network failures are ``preheat.http``'s: each origin has a
``preheat.http.pool.Pool`` (a connection per request in flight, kept alive between them); this module maps what
comes back to ``sources`` errors: 404/410 -> ``SourceNotFoundError``, 401/403 -> ``SourceAccessError``, a rejected
TLS certificate, a refused redirect or an impossible URL -> ``SourceError``, and 5xx/408/429 and every other
``HTTPClientError`` -> ``TransientError`` for the retry loop (``preheat.sources.net``: timeouts and retries).
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from preheat.core.errors import (
    ConfigError,
    ConnectError,
    ExchangeError,
    HTTPClientError,
    ResponseTimeoutError,
    SourceAccessError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    TransientError,
)
from preheat.http.client import Redirects, Timeouts, describe
from preheat.http.pool import Answer, Pool
from preheat.http.ranges import parse_content_range, range_header
from preheat.sources.base import Validator, check_name, strong_etag, too_large
from preheat.sources.net import NetSettings, retrying
from preheat.sources.remote import Cursor, RemoteFile
from preheat.sources.stats import TOTALS, TransferStats
from preheat.sources.token import origin_token, withheld_hint

log = logging.getLogger("preheat.sources.http")

_IDLE_STREAMS = 32  # streams kept open per file on a Range-ignoring server (about one per reader thread)
_SKIP_BUFFER = 1 << 20
MAX_REDIRECTS = 5
USER_AGENT = "preheat/0.1"


class _Client:
    """An origin's requests: its pool, its token and settings, counted in ``stats``; failures as ``sources``
    errors."""

    def __init__(
        self,
        *,
        token: str | None,
        token_netloc: str,
        settings: NetSettings,
        stats: TransferStats,
        hint: str | None = None,
    ) -> None:
        self.settings = settings
        self.timeouts = Timeouts(connect=settings.connect_timeout, read=settings.read_timeout)
        self.stats = stats
        self.pool = Pool(self.timeouts)
        self.redirects = Redirects(limit=min(settings.redirects, MAX_REDIRECTS))
        self._token = token or None  # "" means none (a peer origin passes it so PREHEAT_HTTP_TOKEN is not read)
        self._token_netloc = token_netloc
        self._withheld = hint  # why PREHEAT_HTTP_TOKEN was not sent here, for a 401/403

    def send(self, method: str, url: str, headers: Mapping[str, str] | None = None) -> Answer:
        """``method url`` with its redirects followed; the answer once its headers have arrived. Raises
        ``TransientError`` for network failures, ``SourceError`` for TLS failures and refused redirects."""
        sent = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **(headers or {})}
        if self._token is not None and urlsplit(url).netloc == self._token_netloc:
            sent["Authorization"] = f"Bearer {self._token}"  # dropped by the first redirect to another origin
        try:
            answer = self.pool.request(method, url, headers=sent, redirects=self.redirects)
        except ConnectError as exc:
            if isinstance(exc.cause, ssl.SSLCertVerificationError):
                raise SourceError(
                    f"{exc.url}: TLS certificate rejected ({exc.cause.verify_message}); "
                    "point SSL_CERT_FILE at the CA bundle"
                ) from None
            raise TransientError(describe(exc.cause or exc, self.timeouts)) from exc
        except (ResponseTimeoutError, ExchangeError) as exc:
            raise TransientError(describe(exc.__cause__ or exc, self.timeouts)) from exc
        except HTTPClientError as exc:  # a refused redirect, or a URL (a redirect's) that cannot be asked for
            raise SourceError(str(exc)) from None
        self.stats.add(requests=answer.hops)
        return answer

    def check(self, response: Answer, what: str) -> None:
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
        if self._withheld is not None:
            return self._withheld
        if self._token is None:
            return (
                "if the server needs a token, set PREHEAT_HTTP_TOKEN (sent as 'Authorization: Bearer <token>') "
                "or pass token= to HTTPOrigin"
            )
        return "a bearer token was sent (PREHEAT_HTTP_TOKEN or token=) and refused: check that it is valid here"


@dataclass
class _OriginState:
    """What an origin's files share: the client (connections, token), the settings and whether Range works."""

    uri: str
    client: _Client
    ignores_range: bool = False
    warned: bool = False

    def mark_ignores_range(self) -> None:
        self.ignores_range = True
        if not self.warned:
            self.warned = True
            log.warning(
                "%s: the server ignores Range requests; reading its files as streams from the start instead "
                "(correct, but slower than a server that honours Range)",
                self.uri,
            )


class HTTPOrigin:
    """A URL prefix (``http://host[:port]/path``) holding a checkpoint's files.

    >>> origin = HTTPOrigin("http://127.0.0.1:8000/models/tiny")          # doctest: +SKIP
    >>> origin.read_bytes("config.json")                                   # doctest: +SKIP
    """

    def __init__(self, url: str, *, token: str | None = None, settings: NetSettings | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{url}: not an http(s) URL (expected http://host[:port]/path)")
        if parts.query or parts.fragment:
            raise ConfigError(f"{url}: a checkpoint URL prefix cannot carry a query or fragment")
        self._base = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        hint = None
        if token is None:
            token = origin_token(url)  # ConfigError: a token with no hosts named, or plain http beyond loopback
            hint = None if token is not None else withheld_hint(url)
        self.settings = settings if settings is not None else NetSettings.from_env()
        self.stats = TransferStats(parent=TOTALS)
        client = _Client(token=token, token_netloc=parts.netloc, settings=self.settings, stats=self.stats, hint=hint)
        self._state = _OriginState(self._base, client)

    @property
    def uri(self) -> str:
        return self._base

    @property
    def ignores_range(self) -> bool:
        """True once the server has answered a Range request with the whole file."""
        return self._state.ignores_range

    def join(self, name: str) -> str:
        return f"{self._base}/{quote(check_name(name))}"

    def exists(self, name: str) -> bool:
        """HEAD (or a one-byte GET where HEAD is refused): 404/410 mean False; 401/403 raise ``SourceAccessError``."""
        url = self.join(name)
        client = self._state.client

        def attempt() -> bool:
            response = client.send("HEAD", url)
            if response.status in (405, 501):
                response.drain()
                response = client.send("GET", url, {"Range": range_header(0, 0)})
            try:
                client.check(response, f"HEAD {url}")
            except SourceNotFoundError:
                return False
            response.drain()
            return True

        return retrying(attempt, settings=self.settings, what=f"HEAD {url}", stats=self.stats)

    def read_bytes(self, name: str) -> bytes:
        """GET a small file (config, manifest, index) whole: at most ``settings.whole_file_limit`` bytes, announced
        or sent (``SourceError`` beyond, without reading the rest)."""
        url = self.join(name)
        client = self._state.client
        limit = self.settings.whole_file_limit

        def attempt() -> bytes:
            response = client.send("GET", url)
            client.check(response, f"GET {url}")
            if response.status != 200:
                response.drain()
                raise SourceError(f"GET {url}: expected HTTP 200, got {response.status}")
            announced = response.body.length  # Content-Length as http.client will honour it; None when chunked
            if announced is not None and announced > limit:
                response.abandon()
                raise too_large(f"GET {url}", announced, limit)
            pieces: list[bytes] = []
            received = 0
            try:
                # In pieces: one read(limit + 1) would allocate the whole limit up front on some responses.
                while received <= limit and (piece := response.body.read(min(_SKIP_BUFFER, limit + 1 - received))):
                    pieces.append(piece)
                    received += len(piece)
            except (OSError, http.client.HTTPException) as exc:
                response.abandon()
                raise TransientError(describe(exc, client.timeouts)) from exc
            finally:
                self.stats.add(nbytes=received)
            if received > limit:  # no Content-Length (chunked), and more than the limit
                response.abandon()
                raise too_large(f"GET {url}", None, limit)
            if announced is not None and received != announced:
                response.abandon()
                raise TransientError(f"connection closed after {received} of {announced} bytes")
            response.finish()
            return b"".join(pieces)

        return retrying(attempt, settings=self.settings, what=f"GET {url}", stats=self.stats)

    def open(self, name: str) -> HTTPFile:
        return HTTPFile(self._state, self.join(name))

    def close(self) -> None:
        """Close the kept-alive connections (new ones open if the origin is used again)."""
        self._state.client.pool.close_idle()

    def __enter__(self) -> HTTPOrigin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HTTPFile(RemoteFile):
    """One file behind an HTTP(S) URL; ``readv`` is safe from many threads (each uses its own connection)."""

    def __init__(self, state: _OriginState, url: str) -> None:
        super().__init__(url, settings=state.client.settings, stats=state.client.stats)
        self._state = state
        self._client = state.client
        self._target = url  # where redirects lead; learnt from the first request and reused
        self._streams = _Streams()
        self._scratch = threading.local()

    def _conditions(self) -> dict[str, str]:
        pinned = self._pinned
        if pinned is None:
            return {}
        if pinned.etag is not None:
            return {"If-Match": pinned.etag}
        return {"If-Unmodified-Since": pinned.modified} if pinned.modified is not None else {}

    def _check_version(self, response: Answer, what: str) -> None:
        """Refuse an answer for another version than the pinned one (412, or its own ETag/Last-Modified differ)."""
        pinned = self._pinned
        if pinned is None:
            return
        etag, modified = strong_etag(response.header("ETag")), response.header("Last-Modified")
        if (
            response.status == 412
            or (pinned.etag is not None and etag is not None and etag != pinned.etag)
            or (pinned.modified is not None and modified is not None and modified != pinned.modified)
        ):
            response.drain()
            raise SourceChangedError(
                f"{what}: the file changed on the server (HTTP {response.status}, ETag {etag}, Last-Modified "
                f"{modified}; was {pinned.etag}, {pinned.modified})"
            )

    def close(self) -> None:
        self._streams.close()

    # -- one attempt -------------------------------------------------------------------------------------------------

    def _attempt(self, offset: int, cursor: Cursor, size: int) -> None:
        if self._state.ignores_range:
            self._from_stream(offset, cursor, size, None)
            return
        first, last = offset + cursor.done, offset + cursor.total - 1
        what = f"GET {self._url} bytes {first}-{last}"
        response = self._client.send("GET", self._target, {"Range": range_header(first, last), **self._conditions()})
        self._check_version(response, what)
        if response.status == 206:
            self._check_partial(response, first, last, size, what)
            self._fill(response, cursor, last - first + 1, to_end=True)
        elif response.status == 200:
            self._state.mark_ignores_range()
            self._from_stream(offset, cursor, size, self._adopt(response, size))
        elif response.status == 416:
            answer = response.header("Content-Range")
            response.drain()
            raise SourceChangedError(
                f"{what}: the server says this is past the end ({answer}); the file changed on the server"
            )
        else:
            self._client.check(response, what)
            response.drain()
            raise SourceError(f"{what}: expected HTTP 206, got {response.status}")

    def _check_partial(self, response: Answer, first: int, last: int, size: int, what: str) -> None:
        header = response.header("Content-Range")
        got = parse_content_range(header)
        length = response.int_header("Content-Length")
        if got is None or (got.first, got.last) != (first, last) or length not in (None, last - first + 1):
            response.abandon()
            raise SourceError(
                f"{what}: the server answered Content-Range {header!r} (Content-Length {length}); refusing bytes "
                "that may not be the ones asked for (a proxy or server that rewrites ranges?)"
            )
        if got.total is not None and got.total != size:
            response.abandon()
            raise SourceChangedError(f"{what}: the file is now {got.total} bytes, was {size}; it changed on the server")

    def _fill(self, response: Answer, cursor: Cursor, n: int, *, to_end: bool) -> None:
        """Read exactly ``n`` body bytes into ``cursor``; ``to_end``: they are the whole body (keep the connection)."""
        received = 0
        try:
            while received < n:
                got = response.body.readinto(cursor.next_view(n - received))
                if got == 0:
                    raise TransientError(f"connection closed after {received} of {n} bytes")
                cursor.advance(got)
                received += got
        except (OSError, http.client.HTTPException) as exc:
            response.abandon()
            raise TransientError(f"{describe(exc, self._client.timeouts)} after {received} of {n} bytes") from exc
        except TransientError:
            response.abandon()
            raise
        finally:
            self._client.stats.add(nbytes=received)
        if to_end and not response.body.isclosed():
            # Chunked bodies end with an empty chunk still unread; anything more means the server sent extra bytes.
            try:
                extra = response.body.read(1)
            except (OSError, http.client.HTTPException):
                extra = b""
                response.abandon()
            if extra:
                response.abandon()
                raise SourceError(f"GET {self._url}: the server sent more than the {n} bytes it announced")
        if to_end:
            response.finish()  # read to its end: the connection serves the next read

    # -- Range-ignoring servers: shared streams ----------------------------------------------------------------------

    def _adopt(self, response: Answer, size: int) -> _Stream:
        """Keep a 200 answer to a Range request as a stream at byte 0 (its connection stays with it)."""
        length = response.int_header("Content-Length")
        if length is not None and length != size:
            response.abandon()
            raise SourceChangedError(
                f"GET {self._url}: the file is now {length} bytes, was {size}; it changed on the server"
            )
        return _Stream(response, 0)

    def _open_stream(self, size: int) -> _Stream:
        response = self._client.send("GET", self._target, self._conditions())
        self._check_version(response, f"GET {self._url}")
        if response.status != 200:
            self._client.check(response, f"GET {self._url}")
            response.abandon()
            raise SourceError(f"GET {self._url}: expected HTTP 200, got {response.status}")
        return self._adopt(response, size)

    def _from_stream(self, offset: int, cursor: Cursor, size: int, stream: _Stream | None) -> None:
        target = offset + cursor.done
        if stream is None:
            stream = self._streams.take(target) or self._open_stream(size)
        try:
            self._skip(stream, target)
            n = cursor.total - cursor.done
            self._fill(stream.response, cursor, n, to_end=False)
            stream.pos += n
        except BaseException:
            stream.response.abandon()
            raise
        if stream.pos >= size:
            stream.response.drain()
        elif not self._streams.give(stream):
            stream.response.abandon()

    def _skip(self, stream: _Stream, target: int) -> None:
        scratch: memoryview | None = getattr(self._scratch, "view", None)
        if scratch is None:
            scratch = self._scratch.view = memoryview(bytearray(_SKIP_BUFFER))
        skipped = 0
        try:
            while stream.pos < target:
                got = stream.response.body.readinto(scratch[: min(len(scratch), target - stream.pos)])
                if got == 0:
                    raise TransientError(f"connection closed at byte {stream.pos} while skipping to {target}")
                stream.pos += got
                skipped += got
        except (OSError, http.client.HTTPException) as exc:
            raise TransientError(f"{describe(exc, self._client.timeouts)} at byte {stream.pos}") from exc
        finally:
            self._client.stats.add(nbytes=skipped, skipped=skipped)

    # -- size --------------------------------------------------------------------------------------------------------

    def _probe_size(self) -> int:
        """HEAD's Content-Length, else the total of a one-byte ranged GET's Content-Range."""
        what = f"HEAD {self._url}"
        response = self._client.send("HEAD", self._target)
        self._target = response.url
        if response.status == 200:
            response.drain()
            if (response.header("Accept-Ranges") or "").strip().lower() == "none":
                self._state.mark_ignores_range()
            length = response.int_header("Content-Length")
            if length is not None:
                self._seen = _validator_of(response, length)
                return length
        elif response.status not in (405, 501):
            self._client.check(response, what)
            response.drain()
        what = f"GET {self._url} bytes 0-0"
        response = self._client.send("GET", self._target, {"Range": range_header(0, 0)})
        if response.status in (206, 416):
            got = parse_content_range(response.header("Content-Range"))
            response.drain()
            if got is not None and got.total is not None:
                self._seen = _validator_of(response, got.total)
                return got.total
            raise SourceError(f"{what}: the server did not say the file's size (Content-Range {got})")
        self._client.check(response, what)
        length = response.int_header("Content-Length")
        response.abandon()
        if response.status == 200 and length is not None:
            self._state.mark_ignores_range()
            self._seen = _validator_of(response, length)
            return length
        raise SourceError(f"{what}: the server sends neither Content-Length nor Content-Range, so the size is unknown")


def _validator_of(response: Answer, size: int) -> Validator:
    return Validator(size, etag=strong_etag(response.header("ETag")), modified=response.header("Last-Modified"))


@dataclass(eq=False)
class _Stream:
    """A 200 response being read front to back; ``pos`` is the file offset of its next byte."""

    response: Answer
    pos: int


class _Streams:
    """Idle streams of one file, for servers that ignore Range."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Stream] = []
        self._closed = False

    def take(self, offset: int) -> _Stream | None:
        """The idle stream closest before ``offset`` (least to skip), or None."""
        with self._lock:
            usable = [s for s in self._idle if s.pos <= offset]
            if not usable:
                return None
            best = max(usable, key=lambda s: s.pos)
            self._idle.remove(best)
            return best

    def give(self, stream: _Stream) -> bool:
        """Keep ``stream`` for the next reader; False when it should be closed instead."""
        with self._lock:
            if self._closed or len(self._idle) >= _IDLE_STREAMS:
                return False
            self._idle.append(stream)
            return True

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for stream in idle:
            stream.response.abandon()
