"""``preheat://NAME``: find warm peers holding a checkpoint and pull it from them into the node cache.

The order: the node cache (a published entry is a hit), then the peers the registry knows (up to ``max_peers`` at
once, striped), then the origin, which also takes over whatever the peers cannot deliver. The checkpoint's identity
is the end-to-end check: with ``preheat://xxh3-128:...`` every manifest received must hash to it; with a served name,
the identity the registry announces is the one required. Every tensor is then checked against the manifest as it
lands, and every file before publishing.

Where the origin comes from: ``PeerOptions.origin`` (``--origin``, ``PREHEAT_ORIGIN``) and nowhere else. A registry
entry's ``origin`` (the URI that peer loaded from) is never adopted: whoever can write the registry could otherwise
point every newcomer, with the node's origin credentials (``PREHEAT_HTTP_TOKEN``, its S3 role), at a server of their
choosing, or at a local path. An announced origin that differs from the operator's is only mentioned, in the log
and the pull's notes (and so in the error when no origin is left), for the operator to adopt if they trust it.

Credentials: the peer token (``PeerOptions.token``) is sent only to peers, the origin's own credentials only to the
origin (and never across a redirect to another scheme, host or port: ``preheat.http.client.Redirects``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from preheat.checkpoint import manifest as mf
from preheat.core import env as envs
from preheat.core.errors import CheckpointError, ConfigError, RegistryError, SourceError, SourceNotFoundError
from preheat.http.tls import fleet_url
from preheat.peer import nixl
from preheat.peer.plan import plan_pieces
from preheat.peer.registry import PeerEntry, open_registry, valid_address
from preheat.peer.server import FILES_ROUTE
from preheat.sources.http import HTTPOrigin
from preheat.sources.net import NetSettings
from preheat.sources.open import open_origin
from preheat.sources.peer_uri import parse_peer_uri
from preheat.store import locks
from preheat.store.cache import ModelCache
from preheat.store.fetch import PieceSource, Progress
from preheat.store.pull import PullResult, download, origin_key, pull

log = logging.getLogger("preheat.peer")
# What ``PeerOptions.from_env`` reads, by field (core/env.py declares each).
_VARIABLES: dict[str, envs.Variable[object]] = {
    "registry": envs.REGISTRY,
    "peers": envs.PEERS,
    "origin": envs.ORIGIN,
    "token": envs.PEER_TOKEN,
    "stall_timeout": envs.PEER_STALL_TIMEOUT,
    "max_peers": envs.PEER_MAX_PEERS,
}
MiB = 1024 * 1024


@dataclass(frozen=True)
class PeerOptions:
    """How to find peers and what to fall back to. Every field has a ``PREHEAT_*`` variable (``from_env``).

    ``registry``: ``redis://...`` or ``file:///dir``. ``peers``: addresses (``host:port``) to use besides the
    registry's. ``origin``: the URI to fall back to, the only one used (never a registry entry's). ``token``: the
    peers' ``--peer-token``, sent to peers only. ``max_peers``: peers
    pulled from at once. ``streams``: connections per peer. ``stall_timeout``: seconds without a byte before a peer
    is dropped as stalled (a dead one is dropped at once). ``chunk_bytes``: piece size (None: the caller's).
    ``device``: where this replica loads (``cuda...`` lets peers that offer it send tensors over NIXL; docs/peer.md).
    """

    registry: str | None = None
    peers: tuple[str, ...] = ()
    origin: str | None = None
    token: str | None = None
    max_peers: int = 4
    streams: int = 4
    origin_streams: int = 8
    stall_timeout: float = 2.0
    chunk_bytes: int | None = None
    connect_timeout: float = field(default=2.0)
    device: str = "cpu"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given: object) -> PeerOptions:
        """Options from ``given`` (None values ignored), else ``PREHEAT_REGISTRY``, ``PREHEAT_PEERS`` (comma
        separated), ``PREHEAT_ORIGIN``, ``PREHEAT_PEER_TOKEN``, ``PREHEAT_PEER_STALL_TIMEOUT``,
        ``PREHEAT_PEER_MAX_PEERS`` in ``env`` (default: this process's environment), else the defaults."""
        values: dict[str, object] = {k: v for k, v in given.items() if v is not None}
        for key, variable in _VARIABLES.items():
            if key not in values and envs.raw(variable, env) is not None:
                values[key] = envs.get(variable, env)
        options = cls(**values)  # type: ignore[arg-type]  # keys are this class's fields, values parsed above
        options.check()
        return options

    def check(self) -> None:
        bad = [a for a in self.peers if not valid_address(a)]
        if bad:
            raise ConfigError(f"PREHEAT_PEERS {bad[0]!r}: write peers as host:port (IPv6 as [addr]:port)")
        if self.max_peers < 1 or self.streams < 1 or self.origin_streams < 1:
            raise ConfigError("peer pulls need max_peers, streams and origin_streams of at least 1")
        if self.stall_timeout <= 0:
            raise ConfigError(f"PREHEAT_PEER_STALL_TIMEOUT {self.stall_timeout}: must be positive seconds")


def peer_origin(address: str, options: PeerOptions) -> HTTPOrigin:
    """The files of the peer at ``address`` as an origin: one attempt per read, and no byte for ``stall_timeout``
    seconds fails it, so a frozen peer costs seconds, never the origin's 30 s timeout and retries; no redirects."""
    settings = NetSettings(
        connect_timeout=options.connect_timeout,
        read_timeout=options.stall_timeout,
        attempts=1,
        backoff=0.05,
        redirects=0,  # a peer serves its own files: a redirect is a lie, and the peer is dropped for it
    )
    url = f"{fleet_url(address)}{FILES_ROUTE.rstrip('/')}"  # https when this replica's own listeners are
    return HTTPOrigin(url, token=options.token or "", settings=settings)


def find_peers(wanted: str, options: PeerOptions, notes: list[str]) -> list[PeerEntry]:
    """Registry entries for ``wanted`` plus the explicit ``options.peers``; a registry that is down is a warning."""
    entries: list[PeerEntry] = []
    if options.registry:
        try:
            entries = open_registry(options.registry).find(wanted)
        except RegistryError as exc:
            log.warning("pull: %s; falling back to the node cache and the origin", exc)
            notes.append(f"registry unavailable: {exc}")
    entries += [PeerEntry(identity="", address=a) for a in options.peers]
    seen: set[str] = set()
    unique = []
    for entry in entries:
        if entry.address not in seen:
            seen.add(entry.address)
            unique.append(entry)
    return unique


def pull_from_peers(
    uri: str,
    cache: ModelCache | None = None,
    options: PeerOptions | None = None,
    *,
    chunk_bytes: int = 16 * MiB,
    progress: Progress | None = None,
) -> PullResult:
    """Make ``preheat://NAME`` a verified entry of ``cache``, from peers first, then the origin.

    >>> pull_from_peers("preheat://llama-3-8b", options=PeerOptions(registry="redis://reg:6379"))  # doctest: +SKIP
    """
    target = parse_peer_uri(uri)
    cache = cache or ModelCache()
    options = options or PeerOptions.from_env()
    cache.ensure_dirs()
    started = time.perf_counter()
    notes: list[str] = []

    def hit(key: str, path: str) -> PullResult:
        cache.touch(key)
        return PullResult(key, path, uri, hit=True, seconds=time.perf_counter() - started, notes=notes)

    if target.is_identity and (path := cache.lookup(target.name)) is not None:
        return hit(target.name, path)
    entries = find_peers(target.name, options, notes)
    identity = target.name if target.is_identity else _announced_identity(entries)
    if identity is not None and (path := cache.lookup(identity)) is not None:
        return hit(identity, path)
    origin_uri = options.origin
    _note_announced_origins(entries, origin_uri, notes)
    candidates = [e for e in entries if not e.identity or identity is None or e.identity == identity]
    manifest, peers = _manifest_from_peers(candidates, identity, options, notes)
    if manifest is None:
        if origin_uri is None:
            raise SourceNotFoundError(
                f"{uri}: no live peer holds it ({'; '.join(notes) or 'none announced'}) and no origin to fall back "
                "to: pass --origin URI (or PREHEAT_ORIGIN); an origin a registry entry names is never used by itself"
            )
        origin = open_origin(origin_uri)
        _, manifest = origin_key(origin)
        if manifest is None:  # a plain Hugging Face origin: no identity to check peers against, pull it directly
            result = pull(origin_uri, cache, chunk_bytes=chunk_bytes, progress=progress)
            result.notes = notes + result.notes
            return result
    if identity is not None and manifest.identity != identity:
        raise CheckpointError(
            f"{uri}: the origin {origin_uri} holds {manifest.identity}, not the wanted {identity}", path=origin_uri
        )
    key = manifest.identity
    if (path := cache.lookup(key)) is not None:
        return hit(key, path)
    with locks.exclusive(cache.lock_path(key, "pull")):
        if (path := cache.lookup(key)) is not None:
            notes.append("downloaded by another process; shared")
            return hit(key, path)
        sources = [_peer_source(e.address, options) for e in peers[: options.max_peers]]
        if origin_uri is not None:
            sources.append(
                PieceSource("origin", open_origin(origin_uri), streams=options.origin_streams, fallback=True)
            )
        streams = sum(s.streams for s in sources if not s.fallback) or options.origin_streams
        piece = options.chunk_bytes or piece_bytes(manifest, chunk_bytes, streams)
        result = _download(uri, cache, manifest, sources, chunk_bytes=piece, progress=progress)
    result.notes = notes + result.notes
    result.seconds = time.perf_counter() - started
    return result


def _peer_source(address: str, options: PeerOptions) -> PieceSource:
    """The stripe source for one peer: over NIXL when both ends can (labelled ``peer ADDRESS (nixl)``), else TCP."""
    http = peer_origin(address, options)
    origin = nixl.peer_source_origin(address, http, device=options.device, token=options.token)
    label = f"peer {address} (nixl)" if isinstance(origin, nixl.NixlOrigin) else f"peer {address}"
    return PieceSource(label, origin, streams=options.streams)


def piece_bytes(manifest: mf.Manifest, chunk_bytes: int, streams: int) -> int:
    """``chunk_bytes``, or less for a small checkpoint: every stream should get several pieces, or the first peer's
    connections take them all and the others idle (a 40 MB model in 16 MiB pieces is three pieces)."""
    total = manifest.total_bytes + sum(f.size for f in manifest.extra_files)
    return max(min(chunk_bytes, -(-total // (4 * max(1, streams)))), 256 * 1024)


def _note_announced_origins(entries: list[PeerEntry], origin: str | None, notes: list[str]) -> None:
    """Say (once per pull) that origins named by registry entries are ignored, when one differs from ``origin``."""
    announced = sorted({e.origin for e in entries if e.origin and e.origin != origin})
    if not announced:
        return
    shown = ", ".join(repr(o[:200]) for o in announced[:3]) + (" ..." if len(announced) > 3 else "")
    note = f"ignored the origin peers announce ({shown}): only --origin/PREHEAT_ORIGIN is used as an origin"
    log.info("pull: %s", note)
    notes.append(note)


def _announced_identity(entries: list[PeerEntry]) -> str | None:
    """The identity most registry entries announce for a name (None when no entry says)."""
    counts = Counter(e.identity for e in entries if e.identity)
    return counts.most_common(1)[0][0] if counts else None


def _manifest_from_peers(
    entries: list[PeerEntry], identity: str | None, options: PeerOptions, notes: list[str]
) -> tuple[mf.Manifest | None, list[PeerEntry]]:
    """The manifest, from the first peer that answers with one hashing to ``identity``; and the peers that answered
    with it (a peer that does not answer, or answers with another checkpoint, is left out)."""
    manifest: mf.Manifest | None = None
    good: list[PeerEntry] = []
    for entry in entries:
        if len(good) >= options.max_peers:
            break
        origin = peer_origin(entry.address, options)
        try:
            got = mf.Manifest.from_json(origin.read_bytes(mf.MANIFEST_NAME), where=f"peer {entry.address}")
        except (SourceError, CheckpointError) as exc:
            notes.append(f"skipped peer {entry.address}: {exc}")
            log.warning("pull: skipping peer %s: %s", entry.address, exc)
            continue
        finally:
            origin.close()
        wanted = identity or (manifest.identity if manifest is not None else got.identity)
        if got.identity != wanted:
            notes.append(f"skipped peer {entry.address}: it holds {got.identity}, not {wanted}")
            continue
        manifest = manifest or got
        good.append(entry)
    return manifest, good


def _download(
    uri: str,
    cache: ModelCache,
    manifest: mf.Manifest,
    sources: list[PieceSource],
    *,
    chunk_bytes: int,
    progress: Progress | None,
) -> PullResult:
    """The store's one download path, with pieces cut at tensors so each is checked as it lands."""
    try:
        result = download(
            cache,
            manifest.identity,
            uri,
            plan_pieces(manifest, chunk_bytes),
            sources,
            manifest=manifest,
            check_pieces=True,
            progress=progress,
        )
        result.notes += [s.origin.note() for s in sources if isinstance(s.origin, nixl.NixlOrigin)]
        return result
    finally:
        for source in sources:
            close = getattr(source.origin, "close", None)
            if close is not None:
                close()
