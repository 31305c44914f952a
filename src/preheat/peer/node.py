"""A replica as a peer: its checkpoint served (``PeerServer``) and announced (``Heartbeat``), as one unit.

Used by ``preheat serve --peer`` once the model is loaded, and by ``python -m preheat.peer DIR`` (a seed peer that
serves a checkpoint directory without an engine: a node that has the files but no accelerator, or a test).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from preheat.checkpoint import layout
from preheat.checkpoint import manifest as mf
from preheat.core import env
from preheat.core.errors import CheckpointError, ConfigError, PreheatError
from preheat.http.tls import TLSFiles, use_fleet
from preheat.peer.access import require_token
from preheat.peer.nixl import NixlExport
from preheat.peer.registry import DEFAULT_TTL, Heartbeat, PeerEntry, Registry, open_registry, valid_address
from preheat.peer.server import ArtifactLookup, PeerServer
from preheat.sources.peer_uri import is_peer_uri

# The node cache directory (None: the default) -> its compiled artifacts, as the peer server looks them up.
ArtifactSource = Callable[[str | None], ArtifactLookup]

log = logging.getLogger("preheat.peer")


def read_manifest(root: str) -> mf.Manifest:
    """The checkpoint's ``preheat.json``, or one built now for a directory without one (every file hashed once)."""
    manifest = layout.read_manifest(root)
    if manifest is not None:
        return manifest
    try:
        return mf.build_manifest(root)
    except PreheatError as exc:
        raise CheckpointError(f"{root}: cannot serve it to peers without a manifest: {exc}", path=root) from None


def advertised_host(host: str) -> str:
    """The host other replicas should dial: ``PREHEAT_PEER_ADVERTISE``, else the bind address unless it is a
    wildcard, else this machine's name resolved."""
    given = env.get(env.PEER_ADVERTISE)
    if given:
        return given
    if host not in ("0.0.0.0", "::", ""):  # noqa: S104 - recognises a wildcard, binds nothing
        return host
    import socket

    return socket.gethostbyname(socket.gethostname())


def announceable(origin: str | None) -> str | None:
    """``origin`` as a registry entry may show it: a remote URI without userinfo, query or fragment (whoever reads
    the registry must not learn a credential from it), else None. Pullers never use it as their origin."""
    if not origin or "://" not in origin or is_peer_uri(origin):
        return None
    parts = urlsplit(origin)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass
class Peering:
    """A running peer: its server and, with a registry, its heartbeat."""

    server: PeerServer
    heartbeat: Heartbeat | None
    address: str

    def stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.server.stop()


def start_peering(
    root: str,
    *,
    manifest: mf.Manifest | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_bps: float | None = None,
    registry: str | Registry | None = None,
    name: str = "",
    origin: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    artifacts: ArtifactLookup | None = None,
    ttl: float = DEFAULT_TTL,
    nixl: NixlExport | None = None,
    tls: TLSFiles | None = None,
) -> Peering:
    """Serve checkpoint ``root`` to peers and, with ``registry``, announce it until ``stop()``; with ``nixl``
    (``preheat.peer.nixl.export_weights``), offer its GPU tensors over NIXL too; with ``tls`` (a certificate), over
    https, requiring client certificates signed by its CA when it has one (mutual TLS)."""
    manifest = manifest or read_manifest(root)
    context = tls.listener(peers=True) if tls is not None else None
    server = PeerServer(
        root,
        manifest,
        host=host,
        port=port,
        token=token,
        max_bps=max_bps,
        name=name,
        artifacts=artifacts,
        nixl=nixl,
        tls=context,
    ).start()
    advertised = advertised_host(host)
    if ":" in advertised and not advertised.startswith("["):  # IPv6: bracketed, or host:port would be ambiguous
        advertised = f"[{advertised}]"
    address = f"{advertised}:{server.port}"
    if not valid_address(address):  # readers would skip the entry: say so now rather than serve unseen
        server.stop()
        raise ConfigError(f"PREHEAT_PEER_ADVERTISE / bind host gives {address!r}, not host:port that peers can dial")
    heartbeat = None
    if registry is not None:
        reg = open_registry(registry) if isinstance(registry, str) else registry
        remote_origin = announceable(origin)

        def entry() -> PeerEntry:
            return PeerEntry(
                identity=manifest.identity,
                address=address,
                name=name,
                rank=rank,
                world_size=world_size,
                load=server.load,
                origin=remote_origin,
            )

        heartbeat = Heartbeat(reg, entry, ttl).start()
    return Peering(server, heartbeat, address)


def main(argv: Sequence[str] | None = None, *, artifacts: ArtifactSource | None = None) -> int:
    """``python -m preheat.peer DIR``: serve a checkpoint directory to peers until Ctrl-C or SIGTERM.

    ``artifacts``: for ``--artifacts``, the node cache's compiled artifacts as the peer server looks them up, from
    the cache directory. ``preheat.peer.__main__`` passes ``preheat.artifacts``' store: that package fetches from
    peers (it imports this one), so this package never imports it back.
    """
    parser = argparse.ArgumentParser(
        prog="python -m preheat.peer",
        description="Serve a checkpoint directory to replicas pulling preheat://NAME (a seed peer, no engine).",
    )
    parser.add_argument("root", help="checkpoint directory (with preheat.json, or one is built)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; any other needs PREHEAT_PEER_TOKEN)"
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: 0, a free one; printed)")
    parser.add_argument("--name", default="", help="name to announce (pullers may ask for preheat://NAME)")
    parser.add_argument("--registry", default=env.get(env.REGISTRY), help="redis://... or file:///dir")
    parser.add_argument(
        "--origin",
        default=env.get(env.ORIGIN),
        help="origin URI to announce (informational: pullers use only their own --origin)",
    )
    parser.add_argument("--max-mbps", default=None, help="total outbound cap in MB/s (default: none)")
    parser.add_argument("--ttl", type=float, default=DEFAULT_TTL, help="registry entry lifetime in seconds")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cuda[:N]: also hold the weights on that GPU and offer them over NIXL when nixl is installed",
    )
    parser.add_argument(
        "--artifacts",
        action="store_true",
        help="also serve the node cache's compiled artifacts (`preheat artifacts pack|push`): those built on this "
        "node or signed by a PREHEAT_TRUST_KEY key, checked again before each is served",
    )
    parser.add_argument("--cache-dir", default=None, help="node cache (default: PREHEAT_CACHE_DIR or ~/.cache/preheat)")
    parser.add_argument(
        "--ssl-certfile",
        default=env.get(env.SSL_CERTFILE),
        metavar="FILE",
        help="serve https with this PEM certificate",
    )
    parser.add_argument("--ssl-keyfile", default=env.get(env.SSL_KEYFILE), metavar="FILE", help="its private key")
    parser.add_argument(
        "--ssl-ca-certs",
        default=env.get(env.SSL_CA_CERTS),
        metavar="FILE",
        help="require client certificates signed by this CA (mutual TLS)",
    )
    args = parser.parse_args(argv)
    token = env.get(env.PEER_TOKEN)  # never on the command line: `ps` shows it to everyone
    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        require_token(args.host, token, token_flag="PREHEAT_PEER_TOKEN", host_flag="--host")  # noqa: S106 - a name
        tls = TLSFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
        tls.check()
        use_fleet(tls)
        max_bps = float(args.max_mbps) * 1e6 if args.max_mbps else None
        root = os.path.realpath(args.root)
        manifest = read_manifest(root)
        nixl = _gpu_export(root, manifest, args.device) if args.device != "cpu" else None
        lookup = _artifact_lookup(artifacts, args.cache_dir) if args.artifacts else None
        peering = start_peering(
            root,
            manifest=manifest,
            host=args.host,
            port=args.port,
            token=token,
            max_bps=max_bps,
            registry=args.registry or None,
            name=args.name,
            origin=args.origin,
            ttl=args.ttl,
            nixl=nixl,
            artifacts=lookup,
            tls=tls,
        )
    except (PreheatError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"peer: serving {peering.server.identity} at {peering.address}", flush=True)
    try:
        # Wake up now and then: a signal delivered to another thread does not interrupt a wait without a timeout.
        while not stop.wait(0.25):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        peering.stop()
    return 0


def _artifact_lookup(artifacts: ArtifactSource | None, cache_dir: str | None) -> ArtifactLookup:
    if artifacts is None:
        raise ConfigError("--artifacts: this entry point was given no artifact store (run python -m preheat.peer)")
    return artifacts(cache_dir)


def _gpu_export(root: str, manifest: mf.Manifest, device: str) -> NixlExport | None:
    """The checkpoint loaded onto ``device`` and registered with NIXL (None, logged, when nixl is absent)."""
    from preheat.loader.load import load
    from preheat.peer.nixl import export_weights

    weights = load(root, device)
    return export_weights(weights, manifest)
