"""Bring the engine up in the background while the socket already answers ``/health`` with 503.

Stages recorded on the timeline, in order (docs/server.md): ``fetch`` (only for a URI: pulled through the node cache,
``detail.cache`` is ``hit`` or ``miss``), ``engine_imports`` (torch, tokenizers: the largest fixed cost), then the
engine's own ``weight_load``, ``model_build`` and ``tokenizer``, then ``warmup`` and the ``ready`` mark.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preheat.config import LoaderSettings
from preheat.server.settings import ServeSettings
from preheat.timeline import Timeline

if TYPE_CHECKING:
    from preheat.engine import Engine
    from preheat.store.cache import Lease

log = logging.getLogger("preheat.server")


@dataclass
class Loaded:
    """The ready engine, and the cache lease that keeps a pulled checkpoint from being garbage-collected under it."""

    engine: Engine
    path: str
    lease: Lease | None = None


def fetch(settings: ServeSettings, timeline: Timeline) -> tuple[str, Lease | None]:
    """The local directory to load: MODEL itself, or its node-cache entry (pulled now on a miss)."""
    if not settings.is_remote:
        return settings.model, None
    from preheat.server.peering import peer_options
    from preheat.store.cache import ModelCache
    from preheat.store.pull import pull

    cache = ModelCache(settings.cache_dir)
    options = peer_options(settings)  # None unless MODEL is a preheat:// name
    with timeline.stage("fetch", uri=settings.model) as stage:
        if options is None:
            result = pull(settings.model, cache)
        else:
            from preheat.peer.pull import pull_from_peers  # only for preheat:// names: peers stay off the path

            result = pull_from_peers(settings.model, cache, options)
        stage.nbytes = result.bytes_fetched
        stage.detail.update(
            cache="hit" if result.hit else "miss", key=result.key, path=result.path, total_bytes=result.bytes_total
        )
        if result.sources:  # which source (origin, each peer) served how many bytes
            stage.detail.update(sources=result.sources, notes=result.notes)
    log.info("fetch: %s %s (%d bytes fetched)", settings.model, "hit" if result.hit else "miss", result.bytes_fetched)
    return result.path, cache.lease(result.key)


def load(settings: ServeSettings, timeline: Timeline) -> Loaded:
    """Fetch, import the engine, load, warm up; mark ``ready``. Raises ``PreheatError`` for anything wrong."""
    path, lease = fetch(settings, timeline)
    try:
        with timeline.stage("engine_imports"):
            from preheat.engine import Engine
        engine = Engine.from_checkpoint(
            path,
            device=settings.device,
            dtype=settings.engine_dtype,
            max_model_len=settings.max_model_len,
            timeline=timeline,
            load_mode=LoaderSettings.from_env().mode,  # PREHEAT_LOAD_MODE, named in the weight_load stage
        )
        if settings.compile:  # compiles during one warm-up, with artifacts from the node cache or a peer
            from preheat.server.peering import compile_engine

            compile_engine(engine, settings, timeline)
        with timeline.stage("warmup"):
            engine.warmup()
        from preheat.server import kvtier

        kvtier.attach(engine, settings, timeline)
    except BaseException:
        if lease is not None:
            lease.close()
        raise
    timeline.mark("ready")
    return Loaded(engine, path, lease)
