"""A fake Kubernetes API server that speaks the real list/watch protocol, for the discovery and pod-timeline tests.

It serves, from objects the test puts in (recorded shapes, tests/data/k8s/):

- ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=K=V``: an ``EndpointSliceList`` with
  ``metadata.resourceVersion``; with ``watch=true&resourceVersion=RV``, a chunked ``application/json`` stream of
  one ``{"type": ..., "object": ...}`` line per change after RV (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``
  when asked for), ended after ``timeoutSeconds``; a version older than the history kept (``compact()``) gets the
  ``ERROR`` event with a 410 ``Status``, exactly as the API server sends it;
- ``GET /api/v1/namespaces/NS/pods/NAME`` and ``GET /api/v1/namespaces/NS/events?fieldSelector=...``.

Requests need ``Authorization: Bearer TOKEN``; ``forbid`` makes a resource answer 403 (a service account without
that RBAC rule). ``restart()`` drops every connection and listens again on the same port, state kept (etcd).
``kubeconfig(path)`` writes the file that points the official client here.
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import ssl
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from preheat.testing.certs import self_signed_certificate

DATA = Path(__file__).parent / "data" / "k8s"
TOKEN = "fake-service-account-token"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/"
CORE = "/api/v1/namespaces/"


def fixture(name: str) -> Any:  # Any: JSON as the API server sends it
    return json.loads((DATA / name).read_text())


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``Status`` object, the API server's error body (and a watch ``ERROR`` event's object)."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


class FakeAPIServer:
    """State: objects by (resource, namespace, name), a resourceVersion counter and the change history."""

    def __init__(self, *, tls: bool = False) -> None:
        # tls: HTTPS with a self-signed certificate for 127.0.0.1 (``ca_pem``), as a pod's service account sees it.
        self.ca_pem: bytes | None = None
        self._tls: ssl.SSLContext | None = _tls_context(self) if tls else None
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object)
        self.version = 1000
        self.compacted = 0  # a watch from a version below this gets 410 Gone
        self.bookmarked = 0  # the version of the last bookmark() (sent to watches that asked for bookmarks)
        self.forbid: set[str] = set()  # resources answering 403: "endpointslices", "pods", "events"
        self.requests: list[str] = []  # "LIST endpointslices", "WATCH endpointslices rv=..."...
        self.cond = threading.Condition()
        self.generation = 0  # bumped by restart(): open watches of an older generation end
        self.port = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.start()

    # -- the test's side ------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self.port}"

    def put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace (ADDED or MODIFIED) an object; returns it with its new resourceVersion."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (resource, meta["namespace"], meta["name"])
        with self.cond:
            self.version += 1
            meta["resourceVersion"] = str(self.version)
            kind = "MODIFIED" if key in self.objects else "ADDED"
            self.objects[key] = obj
            self.history.append((self.version, kind, obj))
            self.cond.notify_all()
        return obj

    def delete(self, resource: str, namespace: str, name: str) -> None:
        with self.cond:
            obj = copy.deepcopy(self.objects.pop((resource, namespace, name)))
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, "DELETED", obj))
            self.cond.notify_all()

    def bookmark(self) -> None:
        """A BOOKMARK to every open watch that allows them: nothing of theirs changed, the version moved on."""
        with self.cond:
            self.version += 1
            self.bookmarked = self.version
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history (etcd compaction): a watch resumed from any version seen so far gets 410 Gone, and
        the open watches end (as they do when the API server's watch cache is reset)."""
        with self.cond:
            self.version += 1
            self.compacted = self.version
            self.history.clear()
            self.generation += 1
            self.cond.notify_all()

    def restart(self) -> None:
        """Drop every connection and listen again on the same port; the objects stay."""
        self.stop()
        with self.cond:
            self.generation += 1
            self.cond.notify_all()
        self.start(self.port)

    def count(self, what: str) -> int:
        return sum(r.startswith(what) for r in self.requests)

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "sa", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "sa", "namespace": "llm"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))  # JSON is YAML: the client's loader reads it
        return path

    # -- serving --------------------------------------------------------------------------------------------------
    def start(self, port: int = 0) -> None:
        owner = self

        class Handler(_Handler):
            api = owner

        httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        httpd.daemon_threads = True
        if self._tls is not None:
            httpd.socket = self._tls.wrap_socket(httpd.socket, server_side=True)
        self._httpd, self.port = httpd, int(httpd.server_address[1])
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        with self.cond:
            self.generation += 1  # the open watch streams end, their sockets closed
            self.cond.notify_all()
        for conn in list(_Handler.open):
            if getattr(conn, "api", None) is self:
                with contextlib.suppress(OSError):
                    conn.connection.shutdown(socket.SHUT_RDWR)
        self._httpd = None

    def items(self, resource: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return [o for (r, ns, _), o in sorted(self.objects.items()) if r == resource and ns == namespace
                and all(o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]  # fmt: skip


def _tls_context(api: FakeAPIServer) -> ssl.SSLContext:
    """A server context with a fresh self-signed certificate for 127.0.0.1; its PEM goes to ``api.ca_pem``."""
    cert, key = self_signed_certificate(tempfile.mkdtemp(prefix="fake-apiserver-"))
    api.ca_pem = Path(cert).read_bytes()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def _selector(raw: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in raw.split(",") if "=" in part)


class _Handler(BaseHTTPRequestHandler):
    api: FakeAPIServer
    protocol_version = "HTTP/1.1"
    open: set[_Handler] = set()  # noqa: RUF012 - the handlers with a stream open, for stop()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or token != TOKEN:  # the in-cluster loader sends "bearer", kubeconfig "Bearer"
            self.reply(401, status(401, "Unauthorized", "Unauthorized"))
            return
        path = parts.path.split("/")
        if parts.path.startswith(SLICES) and len(path) == 7 and path[6] == "endpointslices":
            self.collection("endpointslices", path[5], query, "EndpointSliceList", "discovery.k8s.io/v1")
        elif parts.path.startswith(CORE) and len(path) == 7 and path[5] == "pods":
            self.pod(path[4], path[6])
        elif parts.path.startswith(CORE) and len(path) == 6 and path[5] == "events":
            self.events(path[4], query)
        else:
            self.reply(404, status(404, "NotFound", f"the server could not find the requested resource {parts.path}"))

    def forbidden(self, resource: str, namespace: str, verb: str) -> bool:
        if resource not in self.api.forbid:
            return False
        user = "system:serviceaccount:llm:default"
        message = f'{resource} is forbidden: User "{user}" cannot {verb} resource "{resource}" in the namespace ' \
                  f'"{namespace}"'  # fmt: skip
        self.reply(403, status(403, "Forbidden", message))
        return True

    def collection(self, resource: str, namespace: str, query: dict[str, str], kind: str, api_version: str) -> None:
        watching = query.get("watch", "").lower() in ("true", "1")
        if self.forbidden(resource, namespace, "watch" if watching else "list"):
            return
        selector = _selector(query.get("labelSelector", ""))
        if not watching:
            self.api.requests.append(f"LIST {resource}")
            with self.api.cond:
                items = self.api.items(resource, namespace, selector)
                body = {"kind": kind, "apiVersion": api_version,
                        "metadata": {"resourceVersion": str(self.api.version)}, "items": items}  # fmt: skip
            self.reply(200, body)
            return
        since = int(query.get("resourceVersion") or 0)
        self.api.requests.append(f"WATCH {resource} rv={since}")
        self.watch(resource, namespace, selector, since, query)

    def watch(self, resource: str, namespace: str, selector: dict[str, str], since: int, query: dict[str, str]) -> None:
        api = self.api
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        _Handler.open.add(self)
        try:
            with api.cond:
                generation = api.generation
                if since < api.compacted:
                    gone = status(410, "Expired", f"too old resource version: {since} ({api.compacted})")
                    self.chunk({"type": "ERROR", "object": gone})
                    self.chunk(None)
                    return
                while api.generation == generation and time.monotonic() < deadline:
                    for version, kind, obj in api.history:
                        if (
                            version > since
                            and obj["metadata"]["namespace"] == namespace
                            and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
                        ):
                            self.chunk({"type": kind, "object": obj})
                    if bookmarks and api.bookmarked > since:
                        mark = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                "metadata": {"resourceVersion": str(api.bookmarked)}}  # fmt: skip
                        self.chunk({"type": "BOOKMARK", "object": mark})
                    since = max(since, api.version)
                    api.cond.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))
                if api.generation == generation:
                    self.chunk(None)  # the server's timeoutSeconds: a clean end of the stream
        except OSError:
            pass
        finally:
            _Handler.open.discard(self)
            self.close_connection = True

    def pod(self, namespace: str, name: str) -> None:
        if self.forbidden("pods", namespace, "get"):
            return
        self.api.requests.append("GET pods")
        obj = self.api.objects.get(("pods", namespace, name))
        if obj is None:
            self.reply(404, status(404, "NotFound", f'pods "{name}" not found'))
            return
        self.reply(200, obj)

    def events(self, namespace: str, query: dict[str, str]) -> None:
        if self.forbidden("events", namespace, "list"):
            return
        self.api.requests.append("LIST events")
        fields = _selector(query.get("fieldSelector", ""))
        items = []
        for (resource, ns, _), obj in sorted(self.api.objects.items()):
            involved = obj.get("involvedObject", {})
            wanted = {"involvedObject.name": involved.get("name"), "involvedObject.kind": involved.get("kind"),
                      "involvedObject.uid": involved.get("uid")}  # fmt: skip
            if resource == "events" and ns == namespace and all(wanted.get(k) == v for k, v in fields.items()):
                items.append(obj)
        self.reply(200, {"kind": "EventList", "apiVersion": "v1",
                         "metadata": {"resourceVersion": str(self.api.version)}, "items": items})  # fmt: skip

    def reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def chunk(self, event: dict[str, Any] | None) -> None:
        """One watch event as its own chunk (None: the last, empty chunk)."""
        data = b"" if event is None else json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
