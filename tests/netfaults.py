"""A TCP proxy that cuts connections, for fault tests against servers that cannot misbehave on their own (moto).

``FaultProxy(upstream_port, cut_after=N, cuts=1)`` listens on a free 127.0.0.1 port and forwards each connection to
``127.0.0.1:upstream_port``; the first ``cuts`` connections whose answer bytes exceed ``N`` are cut right there
(both directions shut down), exactly as a reset load balancer would do mid-body.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

from typing_extensions import Self


class LoopbackProxy:
    """A TCP proxy on a free 127.0.0.1 port to ``127.0.0.1:upstream_port``; subclasses decide what happens to each
    accepted client in ``handle``. Every socket it registers is shut down and closed on exit."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._closed = True
        self.closing()
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)
            sock.close()
        self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def closing(self) -> None:
        """Called first on exit: release anything ``handle`` may be waiting on."""

    def register(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def connect_upstream(self) -> socket.socket:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        self.register(upstream)
        return upstream

    def handle(self, client: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        # Closing a listening socket does not wake a thread blocked in accept(): poll so that __exit__ can stop it.
        self._listener.settimeout(0.05)
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self.register(client)
            threading.Thread(target=self.handle, args=(client,), daemon=True).start()


class FaultProxy(LoopbackProxy):
    def __init__(self, upstream_port: int, *, cut_after: int | None = None, cuts: int = 1) -> None:
        super().__init__(upstream_port)
        self.cut_after = cut_after
        self.cuts = cuts
        self.cuts_done = 0

    def handle(self, client: socket.socket) -> None:
        upstream = self.connect_upstream()
        threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
        self._pump(upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        forwarded = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answers and self.cut_after is not None and forwarded + len(data) > self.cut_after:
                    with self._lock:
                        cut = self.cuts_done < self.cuts
                        if cut:
                            self.cuts_done += 1
                    if cut:
                        dst.sendall(data[: self.cut_after - forwarded])
                        break
                dst.sendall(data)
                forwarded += len(data)
        except OSError:
            pass  # the other side went away; shut both below
        _shut(src)
        _shut(dst)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
