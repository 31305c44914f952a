"""A small, real HTTP file server with Range support: the origin for tests, benchmarks and a laptop.

It serves the files under one directory (never a byte outside it, and never a dot-file or anything inside a
dot-directory: ``GET /.env`` is 404, as is a link to one) over HTTP/1.1 keep-alive: ``GET`` and ``HEAD``,
single ``Range: bytes=a-b`` requests answered with 206 and ``Content-Range`` (416 past the end; several ranges get the
whole file, which RFC 9110 allows), an optional bearer token (401 without one, 403 for a wrong one), an optional
per-connection throttle (object stores cap each connection, e.g. at 50 MB/s, so bandwidth comes from parallel
streams), validators (``ETag`` from inode, mtime and size; ``Last-Modified``) with ``If-Match`` and
``If-Unmodified-Since`` (412 when they fail) and ``If-Range`` (the whole file when it fails), and fault injection for
tests (``Faults``: ignore Range, cut connections mid-body, flip bytes, answer a shifted range, fail with a status,
never answer, send no validators, or resolve ``..`` as a lenient origin does). ``stats`` also keeps the request
targets it was sent (the last 10,000), so a test sees which paths a client asked for.

>>> with FileServer("/srv/models", throttle_bps=50_000_000) as server:      # doctest: +SKIP
...     weights = preheat.load(server.url_for("tiny"))          # checked against tiny/preheat.json
...     server.stats.snapshot().bytes_sent

Command line (Ctrl-C stops it)::

    python -m preheat.testing.fileserver DIR [--host 127.0.0.1] [--port 8000] [--token T] [--throttle 50MB]

Binds 127.0.0.1 unless told otherwise. Meant for tests and trusted networks: HTTPS only when given a context
(``tls=``), and nothing limits clients beyond the throttle.
"""

from __future__ import annotations

import argparse
import email.message
import email.utils
import logging
import os
import posixpath
import socket
import ssl
import stat
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from preheat.core import env
from preheat.core.config import parse_size
from preheat.core.errors import ConfigError, ForbiddenPathError, UnsatisfiableRangeError
from preheat.http.ranges import content_range, parse_range
from preheat.http.server import BackgroundServer, TrackedHandler, TrackedServer

log = logging.getLogger("preheat.fileserver")

_BLOCK = 256 * 1024  # bytes per write when the body is paced, cut or altered (otherwise sendfile does it all)
TARGETS_KEPT = 10_000  # request targets ServerStats remembers: a benchmark's millions of ranges must not pile up


@dataclass
class Faults:
    """Misbehaviour to inject, for tests. Fields may be changed while the server runs.

    - ``ignore_range``: answer every GET with 200 and the whole file, like ``python -m http.server``.
    - ``drop_after_bytes``: close the connection after sending this many body bytes of a response (only responses
      longer than that), ``drop_times`` times (None: every such response).
    - ``corrupt_offsets``: file offsets whose byte is sent inverted (XOR 0xFF) in every response that covers them.
    - ``shift_range``: answer a Range request with the range moved by this many bytes, and say so in Content-Range
      (a broken cache or proxy): a careful client must refuse it.
    - ``fail_status``: answer the next ``fail_times`` requests (None: all) with this status, e.g. 503.
    - ``stall``: read requests but never answer (until the server stops): a client must time out.
    - ``omit_validators``: send no ``ETag``/``Last-Modified`` and ignore conditional headers (a bare server).
    - ``resolve_dot_segments``: decode the path and resolve ``..`` segments (never above the root) instead of
      refusing them with 403, as many origins and proxies do: ``/public/%2e%2e/private/x`` is ``/private/x``. The
      origin a URL allow-list must be checked against.
    """

    ignore_range: bool = False
    drop_after_bytes: int | None = None
    drop_times: int | None = 1
    corrupt_offsets: frozenset[int] = frozenset()
    shift_range: int = 0
    fail_status: int | None = None
    fail_times: int | None = 1
    stall: bool = False
    omit_validators: bool = False
    resolve_dot_segments: bool = False


@dataclass(frozen=True)
class ServedCounts:
    """A snapshot of ``ServerStats``: requests answered, body bytes sent, statuses, and faults injected."""

    requests: int = 0
    bytes_sent: int = 0
    drops: int = 0
    failures: int = 0
    stalls: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    targets: tuple[str, ...] = ()  # the request targets, oldest first (the last TARGETS_KEPT)


class ServerStats:
    """Thread-safe counters of what the server did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = self._bytes = self._drops = self._failures = self._stalls = 0
        self._statuses: Counter[int] = Counter()
        self._targets: deque[str] = deque(maxlen=TARGETS_KEPT)

    def snapshot(self) -> ServedCounts:
        with self._lock:
            return ServedCounts(
                self._requests,
                self._bytes,
                self._drops,
                self._failures,
                self._stalls,
                dict(self._statuses),
                tuple(self._targets),
            )

    def asked(self, target: str) -> None:
        with self._lock:
            self._targets.append(target)

    def answered(self, status: int) -> None:
        with self._lock:
            self._requests += 1
            self._statuses[status] += 1

    def sent(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    def take_fault(self, kind: str, limit: int | None) -> bool:
        """Count one injection of fault ``kind`` unless ``limit`` injections were made already."""
        with self._lock:
            done = {"drop": self._drops, "failure": self._failures, "stall": self._stalls}[kind]
            if limit is not None and done >= limit:
                return False
            if kind == "drop":
                self._drops += 1
            elif kind == "failure":
                self._failures += 1
            else:
                self._stalls += 1
            return True


def resolve_path(root: str, request_target: str) -> str:
    """The real path of the file ``request_target`` names under ``root`` (which must itself be a real path).

    Raises ``ForbiddenPathError`` for anything that is or leads outside ``root``: ``..`` segments (also
    percent-encoded), backslashes, NUL bytes, and symlinks whose target is outside. Absolute-looking targets
    (``//etc/passwd``) are taken relative to the root. Existence is the caller's business.
    """
    path = unquote(urlsplit(request_target).path)
    if "\x00" in path or "\\" in path:
        raise ForbiddenPathError(request_target)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ForbiddenPathError(request_target)
    real = os.path.realpath(os.path.join(root, *parts))
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise ForbiddenPathError(request_target)
    return real


def lenient_path(root: str, request_target: str) -> str:
    """What a lenient origin serves for ``request_target``: the path decoded, then its ``..`` segments resolved
    (never above the root), then ``resolve_path``'s checks. ``Faults.resolve_dot_segments`` serves this."""
    # One leading "/" only: normpath keeps "//", which urlsplit would then read as a host.
    path = posixpath.normpath("/" + unquote(urlsplit(request_target).path).lstrip("/"))
    return resolve_path(root, path.replace("%", "%25"))  # decoded once already: resolve_path must not decode again


def is_hidden(root: str, request_target: str, real: str) -> bool:
    """Whether the request names a dot-file or a dot-directory, or ``real`` (its real path under ``root``) is one or
    lies inside one: never served (an ``.env``, a ``.git``, the node cache's ``.journal`` files), whatever name the
    request used to reach it."""
    asked = unquote(urlsplit(request_target).path).split("/")
    relative = os.path.relpath(real, root)
    named = [part for part in asked if part not in ("", ".", "..")]
    reached = [] if relative == "." else relative.split(os.sep)
    return any(part.startswith(".") for part in (*named, *reached))


class _Server(TrackedServer):
    def __init__(
        self,
        address: tuple[str, int],
        *,
        root: str,
        token: str | None,
        throttle_bps: int | None,
        faults: Faults,
        stats: ServerStats,
    ) -> None:
        super().__init__(address, _Handler)
        self.root = root
        self.token = token
        self.throttle_bps = throttle_bps
        self.faults = faults
        self.stats = stats
        self.stopping = threading.Event()


class _Handler(TrackedHandler):
    server_version = "preheat-fileserver/0.1"
    server: _Server

    def answered(self, status: int) -> None:
        self.server.stats.answered(status)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server dispatches on this name
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        self._serve(body=True)

    # -- request handling --------------------------------------------------------------------------------------------

    def _serve(self, *, body: bool) -> None:
        server, faults = self.server, self.server.faults
        if faults.stall and server.stats.take_fault("stall", None):
            server.stopping.wait()
            self.close_connection = True
            return
        server.stats.asked(self.path)
        if not self.bearer_ok(server.token):
            return
        if faults.fail_status is not None and server.stats.take_fault("failure", faults.fail_times):
            self.plain(faults.fail_status, "injected failure\n")
            return
        path = self._servable_path()
        if path is None:
            return
        try:
            handle = open(path, "rb")  # noqa: SIM115 - closed below, after the body is sent
        except OSError:
            self.plain(404, "not found\n")
            return
        with handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                self.plain(404, "not found\n")
                return
            self._send_file(handle, info, body=body)

    def _servable_path(self) -> str | None:
        """The real path the request names, or None once it was answered 403 (outside the root) or 404 (hidden)."""
        server = self.server
        try:
            resolve = lenient_path if server.faults.resolve_dot_segments else resolve_path
            path = resolve(server.root, self.path)
        except ForbiddenPathError:
            self.plain(403, "forbidden: outside the served directory\n")
            return None
        if is_hidden(server.root, self.path, path):  # 404, not 403: whether such a file exists is nobody's business
            self.plain(404, "not found\n")
            return None
        return path

    def _send_file(self, handle: BinaryIO, info: os.stat_result, *, body: bool) -> None:
        faults, size = self.server.faults, info.st_size
        headers = {"Content-Type": "application/octet-stream"}
        use_range = True
        if not faults.omit_validators:
            etag = f'"{info.st_ino:x}-{info.st_mtime_ns:x}-{size:x}"'
            headers["ETag"] = etag
            headers["Last-Modified"] = email.utils.formatdate(info.st_mtime, usegmt=True)
            if not _preconditions_hold(self.headers, etag, int(info.st_mtime)):
                self.plain(412, "precondition failed: the file changed\n", {"ETag": etag})
                return
            if_range = self.headers.get("If-Range")
            use_range = if_range is None or if_range.strip() in (etag, headers["Last-Modified"])
        span = None
        if not faults.ignore_range:
            headers["Accept-Ranges"] = "bytes"
            try:
                span = parse_range(self.headers.get("Range"), size) if use_range else None
            except UnsatisfiableRangeError:
                self.plain(416, "", {"Content-Range": f"bytes */{size}"})
                return
        if span is None:
            first, length, status = 0, size, 200
        else:
            first = min(max(0, span[0] + faults.shift_range), max(0, size - 1))
            last = min(max(first, span[1] + faults.shift_range), size - 1)
            length, status = last - first + 1, 206
            headers["Content-Range"] = content_range(first, last, size)
        headers["Content-Length"] = str(length)
        self.head(status, headers)
        if body:
            self._send_body(handle, first, length)

    def _send_body(self, handle: BinaryIO, first: int, length: int) -> None:
        server, faults = self.server, self.server.faults
        cut = faults.drop_after_bytes
        if cut is not None and (length <= cut or not server.stats.take_fault("drop", faults.drop_times)):
            cut = None
        corrupt = [o - first for o in faults.corrupt_offsets if first <= o < first + length]
        try:
            if cut is None and not corrupt and server.throttle_bps is None:
                sent = self.connection.sendfile(handle, first, length)
                server.stats.sent(sent)
                if sent < length:
                    self.close_connection = True
                return
            self._paced(handle, first, length, cut=cut, corrupt=corrupt)
        except OSError:  # the client went away (or timed out): nothing to tell it
            self.close_connection = True

    def _paced(self, handle: BinaryIO, first: int, length: int, *, cut: int | None, corrupt: list[int]) -> None:
        """Send in blocks: throttled to ``throttle_bps``, with bytes flipped, and cut after ``cut`` bytes if set."""
        limit = length if cut is None else cut
        rate = self.server.throttle_bps
        started = time.monotonic()
        done = 0
        while done < limit:
            block = bytearray(os.pread(handle.fileno(), min(_BLOCK, limit - done), first + done))
            if not block:
                break
            for at in corrupt:
                if done <= at < done + len(block):
                    block[at - done] ^= 0xFF
            self.wfile.write(block)
            done += len(block)
            self.server.stats.sent(len(block))
            if rate:
                ahead = done / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        if cut is not None:
            # Cut the connection mid-body, as a crashed proxy or a reset load balancer would.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


def _preconditions_hold(headers: email.message.Message, etag: str, mtime: int) -> bool:
    """RFC 9110 ``If-Match`` (strong comparison) and, without it, ``If-Unmodified-Since``."""
    if_match = headers.get("If-Match")
    if if_match is not None:
        tags = [t.strip() for t in if_match.split(",")]
        return "*" in tags or etag in tags
    since = headers.get("If-Unmodified-Since")
    if since is not None:
        try:
            date = email.utils.parsedate_to_datetime(since)
        except (TypeError, ValueError):
            return True  # an unparseable date is ignored, as RFC 9110 says
        return mtime <= date.timestamp()
    return True


class FileServer(BackgroundServer):
    """Serve ``root`` over HTTP on ``host:port`` (port 0: a free one) from a background thread.

    ``token``: require ``Authorization: Bearer <token>``. ``throttle_bps``: cap each connection at this many bytes
    per second. ``faults``: misbehaviour for tests (see ``Faults``; change ``server.faults`` fields at any time).
    ``tls``: serve HTTPS with this server-side ``ssl.SSLContext`` (certificate loaded).
    ``stats`` counts requests, statuses, body bytes sent and faults injected.
    """

    thread_name = "preheat-fileserver"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        throttle_bps: int | None = None,
        faults: Faults | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise ConfigError(f"{root}: not a directory, nothing to serve")
        if throttle_bps is not None and throttle_bps < 1:
            raise ConfigError(f"throttle_bps must be at least 1, got {throttle_bps}")
        super().__init__(host, port, tls=tls)
        self.token, self.throttle_bps = token, throttle_bps
        self.faults = faults if faults is not None else Faults()
        self.stats = ServerStats()

    @property
    def url(self) -> str:
        """``http(s)://host:port`` of the running server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def url_for(self, name: str) -> str:
        """The URL of ``name`` (a path relative to the root)."""
        return f"{self.url}/{name.lstrip('/')}"

    def make_server(self) -> _Server:
        return _Server(
            (self.host, self._port),
            root=self.root,
            token=self.token,
            throttle_bps=self.throttle_bps,
            faults=self.faults,
            stats=self.stats,
        )

    def before_stop(self, server: TrackedServer) -> None:
        assert isinstance(server, _Server)
        server.stopping.set()  # release requests stalled by fault injection


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m preheat.testing.fileserver",
        description="Serve a directory over HTTP with Range support (a checkpoint origin for preheat.load/pull).",
    )
    parser.add_argument("root", help="directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default 8000)")
    parser.add_argument(
        "--token",
        default=env.get(env.FILESERVER_TOKEN),
        help="require 'Authorization: Bearer TOKEN' (default $PREHEAT_FILESERVER_TOKEN; clients: PREHEAT_HTTP_TOKEN)",
    )
    parser.add_argument("--throttle", help="cap each connection, e.g. 50MB (per second)")
    parser.add_argument("--ignore-range", action="store_true", help="answer every GET with the whole file (testing)")
    args = parser.parse_args(argv)
    try:
        throttle = parse_size(args.throttle.removesuffix("/s")) if args.throttle else None
        server = FileServer(
            args.root,
            host=args.host,
            port=args.port,
            token=args.token or None,
            throttle_bps=throttle,
            faults=Faults(ignore_range=args.ignore_range),
        )
        server.start()
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"serving {server.root} at {server.url} (Ctrl-C to stop)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
