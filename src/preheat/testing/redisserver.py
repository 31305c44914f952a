"""A real ``redis-server`` child on a free loopback port, for the KV L2 (and peer registry) tests and the KV store
benchmark.

``RedisServer`` can be stopped and started again on the same port (to test a Redis that dies and comes back), and
can require a password (``AUTH``) or speak only TLS (a self-signed certificate for 127.0.0.1, from
``preheat.testing.certs``).
Tests that need one skip when ``redis-server`` is not installed (CI installs it: .ci/run); a benchmark gets a
``ConfigError`` (``preheat.testing.needs``).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from urllib.parse import quote

from preheat.testing.certs import self_signed_certificate
from preheat.testing.needs import unavailable
from preheat.testing.ports import free_port


class RedisServer:
    """``redis-server`` without persistence, bound to 127.0.0.1 on ``port``. ``password``: clients must ``AUTH``
    (``--requirepass``). ``tls``: the port speaks TLS only, with a self-signed certificate (``ca`` is its path)."""

    def __init__(self, port: int | None = None, *, password: str | None = None, tls: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="preheat-redis-")
        self.ca: str | None = None
        self._tls_args: list[str] = []
        if tls:
            self.ca, key = self_signed_certificate(self.dir)
            self._tls_args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.ca,
                              "--tls-key-file", key, "--tls-ca-cert-file", self.ca, "--tls-auth-clients", "no"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """The URL a client uses: with the password, and for TLS ``rediss://`` trusting this server's certificate."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.ca is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(self.ca)}"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, *self._tls_args]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with self._connect() as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # NOAUTH: up, and wants the password
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        if self.ca is None:
            return sock
        return ssl.create_default_context(cafile=self.ca).wrap_socket(sock, server_hostname="127.0.0.1")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
