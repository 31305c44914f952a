"""``preheat serve``'s peer side (docs/peer.md): pull ``preheat://`` models from peers, compile with artifacts from
them, and serve this replica's weights and artifacts to the next ones once it is loaded.

Three entry points, each one call from the server: ``peer_options`` (for the ``fetch`` stage), ``compile_engine``
(the ``compile`` stage, with ``--compile``) and ``start_peer``/``stop_peer`` (with ``--peer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from preheat.core import env
from preheat.core.errors import ConfigError, PeerError, PreheatError
from preheat.core.timeline import Timeline
from preheat.http.metrics import Family, Samples
from preheat.server.settings import ServeSettings
from preheat.sources.peer_uri import is_peer_uri

if TYPE_CHECKING:
    from preheat.artifacts.blobs import ArtifactKey, Verified
    from preheat.artifacts.signing import TrustedKeys
    from preheat.artifacts.store import ArtifactStore
    from preheat.engine import Engine
    from preheat.peer.nixl import NixlExport
    from preheat.peer.node import Peering
    from preheat.peer.pull import PeerOptions
    from preheat.server.state import Loaded, ServerState

log = logging.getLogger("preheat.server")
_RUNNING: dict[int, Peering] = {}  # id(ServerState) -> its peer server, until shutdown


def peer_options(settings: ServeSettings) -> PeerOptions | None:
    """How the ``fetch`` stage finds peers for a ``preheat://`` model (None for other models)."""
    if not is_peer_uri(settings.model):
        return None
    from preheat.peer.pull import PeerOptions

    # device: a replica loading onto CUDA may read tensors from GPU peers over NIXL (preheat.peer.nixl).
    return PeerOptions.from_env(
        registry=settings.registry, origin=settings.origin, token=settings.peer_token, device=settings.device
    )


def _cache_root(settings: ServeSettings) -> str:
    from preheat.store.cache import ModelCache

    return str(ModelCache(settings.cache_dir).root)


def trusted_keys(settings: ServeSettings) -> TrustedKeys:
    """The ``--trust-key`` public keys: whose signatures make another replica's compiled artifacts installable."""
    from preheat.artifacts.signing import TrustedKeys

    return TrustedKeys.from_files(settings.trust_key)


def find_artifacts(
    key: ArtifactKey, store: ArtifactStore, *, registry: str | None, identity: str, token: str | None
) -> tuple[Verified | None, str, list[str]]:
    """Artifacts for ``key`` this node may install: its own node cache's, else the first peer's (in the registry, for
    ``identity``) that verifies against ``store.trusted`` (``preheat.artifacts.store.find``). Returns them (or
    None), where they came from, and why each refused candidate was refused."""
    from preheat.artifacts.store import find

    found = find(key, store, registry=registry, identity=identity, token=token)
    return found.verified, found.source, found.refused


def compile_engine(engine: Engine, settings: ServeSettings, timeline: Timeline) -> None:
    """The ``compile`` stage: install artifacts this node built or a trusted key signed (node cache, else a peer),
    ``torch.compile`` the model and run one warm-up under it (which is when compiling happens); store new artifacts
    for the next replica."""
    import torch

    from preheat.artifacts import blobs as artifacts
    from preheat.artifacts.store import ArtifactStore

    if engine.model is None:
        raise ConfigError("--compile needs the built-in engine (this architecture runs through transformers)")
    model = engine.model
    if engine.identity is None:  # no identity, no key: artifacts could never be matched safely
        log.warning("compile: the checkpoint has no preheat.json identity; compiling without shared artifacts")
        with timeline.stage("compile", artifacts="none (no checkpoint identity)"):
            model.forward = torch.compile(model.forward, dynamic=True)  # type: ignore[method-assign]
            engine.warmup()
        return
    key = artifacts.artifact_key(
        identity=engine.identity,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        max_model_len=engine.max_model_len,
    )
    store = ArtifactStore(_cache_root(settings), trusted_keys(settings))
    directory = env.get(env.TORCHINDUCTOR_CACHE_DIR) or store.inductor_dir(key)
    env.put(env.TORCHINDUCTOR_CACHE_DIR, directory)  # read by Inductor when it first compiles, below
    with timeline.stage("compile", key=key.hex, device=key.device, arch=key.arch) as stage:
        found, source, refused = find_artifacts(
            key, store, registry=settings.registry, identity=engine.identity, token=settings.peer_token
        )
        for reason in refused:
            log.warning("compile: %s", reason)
        installed = None
        if found is not None:
            try:
                artifacts.install(found, directory, where=source)
                installed = f"{source} ({found.provenance})"
                if source != "node cache":
                    store.put(found)  # verified, so this node may serve it to the next replica
            except PeerError as exc:
                log.warning("compile: %s", exc)
                refused.append(str(exc))
        if refused:
            stage.detail["refused"] = "; ".join(refused)
        stage.detail["artifacts"] = installed or "none (cold compile)"
        model.forward = torch.compile(model.forward, dynamic=True)  # type: ignore[method-assign]
        engine.warmup()
    if installed is None:
        try:
            store.put(artifacts.built_here(key, artifacts.pack(key, directory)))
        except (PeerError, OSError) as exc:  # the replica compiled and serves; only sharing the artifacts failed
            log.warning("compile: artifacts not stored for peers: %s", exc)
            return
        log.info("compile: artifacts stored for peers (%s)", key.hex)


def start_peer(state: ServerState, loaded: Loaded, say: Callable[[str], None]) -> None:
    """With ``--peer``: serve the loaded checkpoint (and compiled artifacts) to peers and announce it."""
    settings = state.settings
    if not settings.peer:
        return
    from preheat.artifacts.store import ArtifactStore
    from preheat.peer.node import start_peering

    store = ArtifactStore(_cache_root(settings), trusted_keys(settings))  # serves only what verifies
    nixl = _nixl_export(loaded)
    remote = settings.model if "://" in settings.model and not is_peer_uri(settings.model) else None
    try:
        peering = start_peering(
            loaded.path,
            host=settings.peer_bind_host,
            port=settings.peer_port,
            token=settings.peer_token,
            max_bps=settings.peer_max_mbps * 1e6 if settings.peer_max_mbps else None,
            registry=settings.registry,
            name=settings.model_name,
            origin=settings.origin or remote,
            artifacts=store.lookup,
            nixl=nixl,
            tls=settings.tls,
        )
    except (PeerError, ConfigError, OSError) as exc:  # the replica still serves its own clients
        log.warning("peer: not serving peers: %s", exc)
        say(f"preheat serve: peer serving failed: {exc}")
        return
    _RUNNING[id(state)] = peering
    state.metrics.extra.append(lambda: metric_families(peering))
    where = f", announced in {settings.registry}" if settings.registry else ""
    say(f"preheat serve: peer serving {peering.server.identity} on {peering.address}{where}")


def metric_families(peering: Peering) -> list[Family]:
    """Prometheus series for the peer server: bytes served, pulls being served, and whether the registry answers."""
    families = [
        Family(
            "preheat_peer_bytes_sent_total",
            "Checkpoint and artifact bytes sent to other replicas.",
            "counter",
            [({}, float(peering.server.bytes_sent))],
        ),
        Family(
            "preheat_peer_requests_active",
            "Peer requests being served now (the load announced to the registry).",
            "gauge",
            [({}, float(peering.server.load))],
        ),
    ]
    if peering.heartbeat is not None:
        registry_up: Samples = [({}, float(not peering.heartbeat.failing))]
        help_text = "1 while the last heartbeat reached the registry, else 0."
        families.append(Family("preheat_peer_registry_up", help_text, "gauge", registry_up))
    return families


def stop_peer(state: ServerState) -> None:
    """Withdraw the registry entry and stop the peer server (at shutdown)."""
    peering = _RUNNING.pop(id(state), None)
    if peering is not None:
        peering.stop()


def _nixl_export(loaded: Loaded) -> NixlExport | None:
    """The replica's GPU tensors offered over NIXL, when they are the checkpoint's own bytes (zero-copy on CUDA) and
    nixl is installed; None otherwise (peers then read the files over TCP)."""
    weights = loaded.engine.loaded_weights
    if weights is None:
        return None
    from preheat.peer.nixl import export_weights
    from preheat.peer.node import read_manifest

    try:
        return export_weights(weights, read_manifest(loaded.path))
    except (PreheatError, OSError) as exc:
        log.warning("peer: not offering NIXL: %s", exc)
        return None
