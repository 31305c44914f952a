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


class FaultProxy:
    def __init__(self, upstream_port: int, *, cut_after: int | None = None, cuts: int = 1) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.cuts = cuts
        self.cuts_done = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)
            sock.close()
        self._thread.join()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

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
