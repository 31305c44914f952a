"""The peer server: a warm replica's checkpoint files, as byte ranges, to replicas that are starting.

Routes (HTTP/1.1 keep-alive, one thread per connection):

- ``GET|HEAD /peer/v1/files/<name>``: a file named in the manifest (``preheat.json`` itself included), with single
  ``Range: bytes=a-b`` requests answered 206. Any other name, a path outside the checkpoint included, gets 403 and
  nothing is opened: the set of servable files is fixed from the manifest when the server starts, each name resolved
  then to a real path inside the checkpoint directory (a manifest file that is a symlink leading outside it is not
  served), and opened without following a symlink planted there since.
- ``GET /peer/v1/artifacts/<key>``: a packed compiled-artifact blob from the node cache (404 when absent).
- ``GET /peer/v1/info``: identity, name and current load, as JSON.
- ``GET /peer/v1/nixl``: the NIXL advert (``preheat.peer.nixl``) when this replica offers its GPU tensors over
  NIXL; 404 otherwise (no nixl, or weights not on GPU), so pullers use the file routes.

With a token every route needs ``Authorization: Bearer TOKEN`` (401 without, 403 when wrong; compared in constant
time). A token is required to bind anything but a loopback address (``preheat.peer.access``): a server that would
hand every weight file to whoever reaches the port refuses to start instead (``ConfigError``).

``max_bps`` caps the server's *total* outbound body bytes (one token bucket shared by every connection), so serving
peers never starves the replica's own clients of network or page cache.

Bytes come from the files (the page cache, or the mapping the engine already faulted in on CPU): the files the
replica loaded are the files it serves, and the puller checks every tensor against the manifest anyway.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import unquote, urlsplit

from preheat.checkpoint import manifest as mf
from preheat.core.errors import ConfigError, UnsatisfiableRangeError
from preheat.http.ranges import content_range, parse_range
from preheat.http.server import BackgroundServer, TrackedHandler, TrackedServer
from preheat.peer.access import require_token
from preheat.peer.nixl import NIXL_ROUTE, NixlExport

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("preheat.peer")
FILES_ROUTE = "/peer/v1/files/"
ARTIFACTS_ROUTE = "/peer/v1/artifacts/"
INFO_ROUTE = "/peer/v1/info"
_BLOCK = 256 * 1024  # bytes per write when the body is paced by the bandwidth cap
ARTIFACT_KEY = re.compile(r"^[0-9a-f]{32}$")


class TokenBucket:
    """A rate limit shared by many threads: ``take(n)`` blocks until ``n`` bytes may be sent at ``rate`` bytes/s.

    The bucket holds at most 50 ms of tokens (one block at least), so an idle server cannot burst above its cap.
    """

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ConfigError(f"bandwidth cap must be positive, got {rate}")
        self.rate = rate
        self.capacity = max(rate / 20, float(_BLOCK))
        self._tokens = self.capacity
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            # Reserve now and sleep off the debt outside the lock: waiters are served in arrival order.
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            debt = -self._tokens
        if debt > 0:
            time.sleep(debt / self.rate)


ArtifactLookup = Callable[[str], "str | None"]  # artifact key -> path of its packed blob


class _Server(TrackedServer):
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], peer: PeerServer) -> None:
        super().__init__(address, _Handler)
        self.peer = peer


class _Handler(TrackedHandler):
    server_version = "preheat-peer/1"
    server: _Server

    def do_HEAD(self) -> None:  # noqa: N802 - http.server dispatches on this name
        self._route(body=False)

    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        self._route(body=True)

    def _route(self, *, body: bool) -> None:
        peer = self.server.peer
        if not self.bearer_ok(peer.token, "peer token (--peer-token)"):
            return
        path = unquote(urlsplit(self.path).path)
        with peer.serving():
            if path.startswith(FILES_ROUTE):
                self._file(path[len(FILES_ROUTE) :], body=body)
            elif path.startswith(ARTIFACTS_ROUTE):
                self._artifact(path[len(ARTIFACTS_ROUTE) :], body=body)
            elif path == INFO_ROUTE:
                self._json(json.dumps(peer.info()).encode(), body=body)
            elif path == NIXL_ROUTE:
                if peer.nixl is None:
                    self.plain(404, "no GPU transport here: use the file routes\n")
                else:
                    self._json(peer.nixl.advert(), body=body)
            else:
                self.plain(404, f"no route {path}\n")

    def _file(self, name: str, *, body: bool) -> None:
        peer = self.server.peer
        if name == mf.MANIFEST_NAME:
            self._json(peer.manifest_bytes, body=body)
            return
        servable = peer.files.get(name)
        if servable is None:  # also every "../", absolute or symlinked path: only manifest names are ever opened
            self.plain(403, "forbidden: not a file of the served checkpoint\n")
            return
        path, size = servable
        try:
            # O_NOFOLLOW: the path had no symlink at start; one planted since is not followed. O_NONBLOCK: a FIFO
            # planted in its place opens at once (and is refused below) instead of hanging this thread.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.plain(404, "not found\n")
            return
        with open(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self.plain(403, "forbidden: not a regular file\n")
                return
            self._send(handle, size, body=body)

    def _artifact(self, key: str, *, body: bool) -> None:
        lookup = self.server.peer.artifacts
        path = lookup(key) if lookup is not None and ARTIFACT_KEY.match(key) else None
        if path is None:
            self.plain(404, "no such artifact\n")
            return
        try:
            with open(path, "rb") as handle:
                self._send(handle, os.fstat(handle.fileno()).st_size, body=body)
        except OSError:
            self.plain(404, "no such artifact\n")

    def _json(self, data: bytes, *, body: bool) -> None:
        self.head(200, {"Content-Type": "application/json", "Content-Length": str(len(data))})
        if body:
            self.wfile.write(data)

    def _send(self, handle: BinaryIO, size: int, *, body: bool) -> None:
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        try:
            span = parse_range(self.headers.get("Range"), size)
        except UnsatisfiableRangeError:
            self.plain(416, "", {"Content-Range": f"bytes */{size}"})
            return
        first, length, status = 0, size, 200
        if span is not None:
            first, length, status = span[0], span[1] - span[0] + 1, 206
            headers["Content-Range"] = content_range(span[0], span[1], size)
        headers["Content-Length"] = str(length)
        self.head(status, headers)
        if body and length:
            try:
                self._body(handle, first, length)
            except OSError:  # the puller went away (or gave up on us): nothing to tell it
                self.close_connection = True

    def _body(self, handle: BinaryIO, first: int, length: int) -> None:
        peer = self.server.peer
        bucket = peer.bucket
        if bucket is None:
            sent = self.connection.sendfile(handle, first, length)
            peer.count(sent)
            if sent < length:
                self.close_connection = True
            return
        done = 0
        while done < length:
            n = min(_BLOCK, length - done)
            bucket.take(n)
            block = os.pread(handle.fileno(), n, first + done)
            if not block:
                self.close_connection = True
                return
            self.wfile.write(block)
            done += len(block)
            peer.count(len(block))


def servable_files(root: str, manifest: mf.Manifest) -> dict[str, tuple[str, int]]:
    """Manifest name -> (real path, size) for every file of ``manifest`` whose real path lies inside ``root`` (a real
    path itself); a file that resolves outside it (a symlink, or a name that climbs out) is left out, with a warning."""
    files: dict[str, tuple[str, int]] = {}
    for record in (*manifest.files, *manifest.extra_files):
        real = os.path.realpath(os.path.join(root, record.name))
        if os.path.commonpath((root, real)) != root or real == root:
            log.warning("peer: not serving %s: it resolves to %s, outside the checkpoint %s", record.name, real, root)
            continue
        files[record.name] = (real, record.size)
    return files


class PeerServer(BackgroundServer):
    """Serve checkpoint ``root`` (described by ``manifest``) to other replicas on ``host:port`` (0: a free port).

    ``token``: require this bearer token (required unless ``host`` is loopback: ``ConfigError`` otherwise).
    ``max_bps``: total outbound cap in bytes per second. ``artifacts``: a
    function from an artifact key to the path of its packed blob (or None), for ``/peer/v1/artifacts/<key>``.
    ``nixl``: this replica's GPU tensors registered with NIXL, advertised on ``/peer/v1/nixl`` (closed on ``stop``).
    ``tls``: serve https with this server-side context (``preheat.http.tls.TLSFiles.server_context``; mutual TLS
    when it requires client certificates).

    >>> with PeerServer("/cache/models/xxh3-128-...", manifest) as peer:    # doctest: +SKIP
    ...     print(peer.address)
    """

    thread_name = "preheat-peer"
    poll_interval = 0.1

    def __init__(
        self,
        root: str | os.PathLike[str],
        manifest: mf.Manifest,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_bps: float | None = None,
        name: str = "",
        artifacts: ArtifactLookup | None = None,
        nixl: NixlExport | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        require_token(host, token)
        self.root = os.path.realpath(os.fspath(root))
        self.manifest = manifest
        self.manifest_bytes = manifest.to_json()
        self.files = servable_files(self.root, manifest)
        super().__init__(host, port, tls=tls)
        self.token = token or None
        self.bucket = TokenBucket(max_bps) if max_bps else None
        self.name = name
        self.artifacts = artifacts
        self.nixl = nixl
        self._lock = threading.Lock()
        self._load = 0
        self._sent = 0

    @property
    def identity(self) -> str:
        return self.manifest.identity

    @property
    def address(self) -> str:
        """``host:port`` to announce (the bound port)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def load(self) -> int:
        """Requests being served right now."""
        with self._lock:
            return self._load

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self._sent

    def count(self, n: int) -> None:
        with self._lock:
            self._sent += n

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        with self._lock:
            self._load += 1
        try:
            yield
        finally:
            with self._lock:
                self._load -= 1

    def info(self) -> dict[str, object]:
        return {
            "identity": self.identity,
            "name": self.name,
            "load": self.load,
            "bytes_sent": self.bytes_sent,
            "nixl": self.nixl is not None,
        }

    def make_server(self) -> _Server:
        return _Server((self.host, self._port), self)

    def start(self) -> PeerServer:
        started = self._server is None
        super().start()
        if started:
            log.info("peer: serving %s (%s) on %s", self.root, self.identity, self.address)
        return self

    def stop(self) -> None:
        """Stop accepting and cut every open connection (pullers move our pieces elsewhere)."""
        super().stop()
        if self.nixl is not None:  # after the last connection: no advert outlives the registered memory
            self.nixl.close()
            self.nixl = None
