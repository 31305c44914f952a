"""A real ``redis-server`` child on a free loopback port, for the KV L2 (and peer registry) tests.

``RedisServer`` can be stopped and started again on the same port (to test a Redis that dies and comes back), and
can require a password (``AUTH``) or speak only TLS (a self-signed certificate for 127.0.0.1, made here).
Tests that need one skip when ``redis-server`` is not installed (CI installs it: .ci/run).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from urllib.parse import quote

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """``redis-server`` without persistence, bound to 127.0.0.1 on ``port``. ``password``: clients must ``AUTH``
    (``--requirepass``). ``tls``: the port speaks TLS only, with a self-signed certificate (``ca`` is its path)."""

    def __init__(self, port: int | None = None, *, password: str | None = None, tls: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
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


def self_signed_certificate(directory: str) -> tuple[str, str]:
    """(certificate, key) PEM files for 127.0.0.1 in ``directory``: the certificate is its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, "redis.crt"), os.path.join(directory, "redis.key")
    with open(cert_path, "wb") as handle:
        handle.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return cert_path, key_path
