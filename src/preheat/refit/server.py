"""The refit HTTP server: a holder's versions (a trainer's memory, or a replica's live weights) to pulling replicas.

Routes (HTTP/1.1 keep-alive, one thread per connection, optional bearer token as the peer server's):

- ``GET /refit/v1/info``: ``{"name", "epoch", "versions": [...], "latest"}``: the versions this holder can serve
  now, all of one epoch (a trainer's, or the one of the version a replica serves). Claims only: a follower believes
  a version once its manifest verifies (``preheat.refit.trust``).
- ``GET /refit/v1/epochs/<E>/versions/<N>``: version ``N`` of epoch ``E``: its manifest with the publisher's
  signature (``preheat.refit.protocol``); 404 when not held.
- ``GET /refit/v1/epochs/<E>/versions/<N>/tensors/<tensor>``: the tensor's bytes as published; 404 when this
  holder no longer holds them (a replica that moved on to ``N+1``, a trainer that dropped ``N``). Pullers check
  every tensor against the manifest's digest, so a holder that changed under a read costs a retry elsewhere, never
  a bad weight.

A server that would hand every weight to whoever reaches the port beyond loopback refuses to start without a token
(``preheat.peer.access.require_token``), as the peer server does.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

from preheat.core import env
from preheat.http.server import BackgroundServer, TrackedHandler, TrackedServer
from preheat.peer.access import require_token
from preheat.refit.protocol import VersionKey, VersionManifest

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("preheat.refit")
INFO_ROUTE = "/refit/v1/info"
_BLOCK = 1024 * 1024  # bytes per write: big writes, without one huge copy of a tensor
_VERSION_PATH = re.compile(r"^/refit/v1/epochs/([0-9]{1,19})/versions/([0-9]{1,19})(?:/tensors/([^/]{1,512}))?$")


def manifest_route(key: VersionKey) -> str:
    """The path of version ``key``'s (signed) manifest."""
    return f"/refit/v1/epochs/{key[0]}/versions/{key[1]}"


def tensor_route(key: VersionKey, tensor: str) -> str:
    """The path of one tensor's bytes in version ``key``."""
    return f"{manifest_route(key)}/tensors/{tensor}"


class Holder(Protocol):
    """What a refit server serves: versions of one name and their tensors' bytes."""

    @property
    def name(self) -> str: ...

    def versions(self) -> list[int]:
        """The versions this holder can serve now, oldest first, all of one epoch (their manifests')."""
        ...

    def manifest(self, version: int) -> VersionManifest | None: ...

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        """The bytes of ``tensor`` as version ``version`` published them, or None when not held (any more)."""
        ...


class RefitServer(BackgroundServer):
    """Serves ``holder`` on ``host:port`` (0: a free port), over https with ``tls`` (a server-side context; mutual TLS
    when it requires client certificates). ``bytes_served`` counts tensor bytes sent."""

    thread_name = "preheat-refit"

    def __init__(
        self,
        holder: Holder,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        require_token(host, token)
        super().__init__(host, port, tls=tls)
        self.holder, self.token = holder, token
        self.bytes_served = 0
        self.tensors_served = 0
        self._lock = threading.Lock()

    def make_server(self) -> TrackedServer:
        return _Server((self.host, self._port), self)

    @property
    def address(self) -> str:
        """``host:port`` as announced in the registry: ``PREHEAT_PEER_ADVERTISE`` as the host when set (a server
        bound to ``0.0.0.0`` is dialled at the node's address), else the bind host."""
        host = env.get(env.PEER_ADVERTISE) or self.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def served(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_served += nbytes
            self.tensors_served += 1


class _Server(TrackedServer):
    def __init__(self, address: tuple[str, int], refit: RefitServer) -> None:
        super().__init__(address, _Handler)
        self.refit = refit


class _Handler(TrackedHandler):
    server_version = "preheat-refit/1"
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        refit = self.server.refit
        if not self.bearer_ok(refit.token, "refit token"):
            return
        path = unquote(urlsplit(self.path).path)
        holder = refit.holder
        if path == INFO_ROUTE:
            versions = holder.versions()
            latest = holder.manifest(versions[-1]) if versions else None
            info = {
                "name": holder.name,
                "epoch": latest.epoch if latest is not None else None,
                "versions": versions,
                "latest": versions[-1] if versions else None,
            }
            self.send_body(200, json.dumps(info).encode(), "application/json")
            return
        match = _VERSION_PATH.match(path)
        if match is None:
            self.plain(404, f"no route {path[:200]}\n")
            return
        epoch, version, tensor = int(match.group(1)), int(match.group(2)), match.group(3)
        # The epoch is checked on every route: a holder that moved to another epoch's version N answers 404, never
        # that version's bytes for this one's (which the puller would take for a lie).
        manifest = holder.manifest(version)
        if manifest is None or manifest.epoch != epoch:
            self.plain(404, f"version {version} of epoch {epoch} of {holder.name} is not held here\n")
            return
        if tensor is None:
            self.send_body(200, manifest.to_json(), "application/json")
            return
        data = holder.tensor_bytes(version, tensor)
        if data is None:
            self.plain(404, f"tensor {tensor[:200]} of version {version} is not held here\n")
            return
        self.head(200, {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))})
        for start in range(0, len(data), _BLOCK):
            self.wfile.write(data[start : start + _BLOCK])
        refit.served(len(data))
