"""TLS for preheat's listeners and for the connections preheat makes to them: the PEM files of one process
(``TLSFiles``), the server context a listener wraps its connections in (``TLSFiles.server_context``), and the
client context of every https connection the one client opens (``client_context``).

A fleet speaks TLS or it does not: a process started with ``--ssl-certfile`` serves https on every listener it
opens (the API or the router, the peer server, the refit server), and dials its fleet's addresses (peers, refit
holders; ``fleet_url``) over https. Its ``--ssl-ca-certs`` is the fleet's CA: trusted for https beside the system's
CAs (never instead of them, so origins such as Hugging Face still verify), and, on the listeners that serve weights
to other replicas (peer, refit), the CA whose certificate a client must present (mutual TLS). The process's own
certificate is what it presents when a listener asks for one, so one certificate per node (usable for both server
and client authentication) serves both ends.

``use_fleet`` sets the process's files once, at a command's start (``preheat serve``, ``preheat router``,
``python -m preheat.peer``), as the standard library's default context is set by ``SSL_CERT_FILE``: every https
connection of the process then verifies with the fleet's CA and offers the fleet's certificate when asked, without
each of the many callers (health checks, KV-event polls, peer and refit pulls) carrying a context of its own.

Standard library only; ``ssl`` is imported when a context is made (a plain-http client never loads OpenSSL).

>>> TLSFiles().enabled, TLSFiles(certfile="node.pem").enabled
(False, True)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preheat.core.errors import ConfigError

if TYPE_CHECKING:
    import ssl


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: ``certfile`` (the certificate chain, with the key unless ``keyfile`` holds it), ``keyfile`` and
    ``ca_certs`` (the fleet's CA). ``flags`` names the options they came from, in errors."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    flags: str = "--ssl-certfile/--ssl-keyfile/--ssl-ca-certs"

    @property
    def enabled(self) -> bool:
        """Whether the listeners serve https (a certificate is given)."""
        return self.certfile is not None

    def check(self, *, ca_alone: bool = False) -> None:
        """``ConfigError`` for files that cannot work, before a socket is bound: a key or a CA without a
        certificate (``ca_alone``: a CA may come alone, a client that only verifies), or a file that does not load."""
        if self.keyfile is not None and self.certfile is None:
            raise ConfigError(f"{self.flags}: --ssl-keyfile without --ssl-certfile; give the certificate too")
        if self.ca_certs is not None and self.certfile is None and not ca_alone:
            raise ConfigError(
                f"{self.flags}: --ssl-ca-certs asks peers for certificates signed by it, and this server offers none "
                "itself: give --ssl-certfile (and --ssl-keyfile) too"
            )
        if self.enabled:
            self.server_context(mutual=self.ca_certs is not None)
        elif self.ca_certs is not None:
            self.client_context()

    def server_context(self, *, mutual: bool = False) -> ssl.SSLContext:
        """The context a listener wraps its connections in; ``mutual``: clients must present a certificate signed
        by ``ca_certs`` (the handshake of one that does not fails, and no request of it is read)."""
        import ssl

        if self.certfile is None:
            raise ConfigError(f"{self.flags}: a TLS listener needs --ssl-certfile")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(context)
        if mutual:
            if self.ca_certs is None:
                raise ConfigError(f"{self.flags}: mutual TLS needs --ssl-ca-certs (the CA clients' certificates have)")
            self._load_ca(context)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def listener(self, *, peers: bool = False) -> ssl.SSLContext | None:
        """The context of a listener, None without a certificate (plain http). ``peers``: a listener that serves
        other replicas (peer, refit), which requires client certificates when a CA is given."""
        if not self.enabled:
            return None
        return self.server_context(mutual=peers and self.ca_certs is not None)

    def client_context(self) -> ssl.SSLContext:
        """The context of an https connection: the system's CAs and ``ca_certs``, ``certfile`` offered to a
        listener that asks for a client certificate."""
        import ssl

        context = ssl.create_default_context()
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca_certs is not None:
            self._load_ca(context)
        if self.certfile is not None:
            self._load_chain(context)
        return context

    def _load_chain(self, context: ssl.SSLContext) -> None:
        import ssl

        assert self.certfile is not None  # callers check
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:  # a missing file, a key that does not match, not PEM
            what = f"{self.certfile}" + (f" with key {self.keyfile}" if self.keyfile else "")
            raise ConfigError(
                f"{self.flags}: cannot load the certificate {what}: {exc.strerror or exc}; give a PEM certificate "
                "chain and its private key (--ssl-keyfile, unless the certificate file holds it)"
            ) from None

    def _load_ca(self, context: ssl.SSLContext) -> None:
        import ssl

        assert self.ca_certs is not None  # callers check
        try:
            context.load_verify_locations(cafile=self.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"{self.flags}: cannot load the CA certificates {self.ca_certs}: {exc.strerror or exc}; give a PEM "
                "file of the CA that signed the fleet's certificates"
            ) from None


class _Fleet:
    """The process's fleet files and their client context, made once (a context is safe to share between threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: TLSFiles | None = None
        self.context: ssl.SSLContext | None = None


_FLEET = _Fleet()


def use_fleet(files: TLSFiles | None) -> None:
    """Make ``files`` this process's fleet TLS (None: none again): the fleet's addresses are dialled over https
    when it has a certificate, and every https connection verifies with its CA and offers its certificate."""
    context = None
    if files is not None and (files.certfile is not None or files.ca_certs is not None):
        context = files.client_context()  # ConfigError now, at the start, rather than on the first connection
    with _FLEET.lock:
        _FLEET.files, _FLEET.context = (files, context) if context is not None else (None, None)


def fleet() -> TLSFiles | None:
    """This process's fleet TLS files, or None."""
    return _FLEET.files


def fleet_url(address: str) -> str:
    """``scheme://address`` for a fleet member's ``host:port`` (a peer, a refit holder): https when this process
    serves its own listeners over TLS (a fleet speaks TLS or it does not), else http."""
    files = _FLEET.files
    return f"{'https' if files is not None and files.enabled else 'http'}://{address}"


def fleet_client() -> ssl.SSLContext | None:
    """The client context for a connection to a fleet member's ``host:port`` (``fleet_url``'s https), else None."""
    files = _FLEET.files
    return _FLEET.context if files is not None and files.enabled else None


def client_context() -> ssl.SSLContext:
    """The context of a new https connection: the fleet's when one is set (``use_fleet``), else the standard
    library's default, made now so that ``SSL_CERT_FILE`` is read when the connection is opened."""
    context = _FLEET.context
    if context is not None:
        return context
    import ssl

    return ssl.create_default_context()
