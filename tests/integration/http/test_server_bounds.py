"""Every preheat server's bounds on connections (preheat.http.server): a cap on the connections that hold a thread
(one more is answered 503 and closed), and a deadline for a request's line and headers, so clients that open
connections and send half a request cannot pile up threads. The server is a real ``preheat router`` process (the
same base as ``preheat serve``, the peer and refit listeners and the file server) whose threads are counted in
/proc.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Iterator

from preheat.core.procs import Child
from routing import wait_until
from serving import Client

HALF_SENT = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: the headers never end
CAP = 100


@contextlib.contextmanager
def server(*flags: str) -> Iterator[tuple[int, str]]:
    """A ``preheat router`` process (in front of a replica that is not there): its pid and URL."""
    args = ["router", "--replica", "http://127.0.0.1:9", "--port", "0", *flags]
    with Child("preheat router", args, merge_stderr=True) as child:
        yield child.pid, child.wait_address(60.0)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_thousand_half_sent_requests_hold_no_more_threads_than_the_cap() -> None:
    with server("--max-connections", str(CAP), "--header-timeout", "5") as (pid, url):
        assert Client(url).get("/health").status in (200, 503)  # serving (no replica in rotation: 503)
        idle = threads(pid)
        most = idle
        clients: list[socket.socket] = []
        try:
            for _ in range(1000):
                sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=30)
                sock.sendall(HALF_SENT)
                clients.append(sock)
                most = max(most, threads(pid))
            # Each connection ends one way or the other: a 503 at once (over the cap), or closed at its header
            # deadline (a thread held meanwhile). Read them all, counting the server's threads as they go.
            answers: dict[socket.socket, bytes] = {}
            while len(answers) < len(clients):
                most = max(most, threads(pid))
                readable, _, _ = select.select([s for s in clients if s not in answers], [], [], 1.0)
                for sock in readable:
                    try:
                        answers[sock] = sock.recv(4096)
                    except ConnectionResetError:
                        answers[sock] = b""
            wait_until(lambda: threads(pid) <= idle, "the held threads to end")
            after = Client(url).get("/health").status
        finally:
            for sock in clients:
                sock.close()
    refused = sum(1 for a in answers.values() if a.startswith(b"HTTP/1.1 503"))
    assert most <= idle + CAP, f"{most - idle} threads for {len(clients)} half-sent requests"  # the old base: 1,000
    assert refused >= 1000 - 2 * CAP  # the rest held a thread until their deadline (some of it after others ended)
    assert all(a == b"" or a.startswith(b"HTTP/1.1 503") for a in answers.values())
    assert after in (200, 503)  # still serving


def test_headers_sent_a_byte_at_a_time_do_not_keep_a_connection_past_the_deadline() -> None:
    with server("--header-timeout", "2") as (_, url):
        sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=30)
        closed = False
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            for _ in range(300):  # a byte every 0.2 s: each wait is short, the headers never end
                time.sleep(0.2)
                try:
                    sock.sendall(b"X")
                    if select.select([sock], [], [], 0)[0] and not sock.recv(4096):
                        closed = True
                        break
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
        finally:
            sock.close()
    assert closed, "the server kept a connection whose headers never ended"  # the old base: a 60-300 s wait per byte


def test_a_keep_alive_connection_still_idles_for_the_idle_timeout() -> None:
    with server("--header-timeout", "1") as (_, url):
        sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=30)
        try:
            time.sleep(2)  # idle between requests is not the header deadline
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = sock.recv(4096)
        finally:
            sock.close()
    assert answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503"))
