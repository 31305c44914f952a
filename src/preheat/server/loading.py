"""Bring the engine up in the background while the socket already answers ``/health`` with 503.

Stages recorded on the timeline (docs/server.md): ``engine_imports`` (torch: the largest fixed cost) on a thread of
its own from the start, and beside it ``fetch`` (only for a URI: pulled through the node cache, ``detail.cache`` is
``hit`` or ``miss``), ``model_config``, ``tokenizer`` and ``page_in`` (``preheat.server.prepare``); then, once torch
is there, the engine's ``weight_load`` and ``model_build``, then ``warmup`` and the ``ready`` mark.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from preheat.core.config import LoaderSettings
from preheat.core.timeline import Timeline
from preheat.server.settings import ServeSettings
from preheat.server.state import Kept, Loaded

if TYPE_CHECKING:
    from preheat.io.premap import Premapped
    from preheat.server.prepare import EngineImports
    from preheat.store.cache import Lease
    from preheat.text.process import TokenizerProcess
    from preheat.text.tokenizer import TextTokenizer

log = logging.getLogger("preheat.server")


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


def load(
    settings: ServeSettings,
    timeline: Timeline,
    *,
    imports: EngineImports | None = None,
    keep: Kept | None = None,
    text: TokenizerProcess | None = None,
) -> Loaded:
    """Fetch and prepare while the engine imports, then load, build, warm up; mark ``ready``. Raises
    ``PreheatError`` for anything wrong.

    ``imports``: the engine's import, already started (a standby replica did it before any model was asked for);
    ``keep``: what a replica kept of its engine while asleep (a wake builds only the model);
    ``text``: the tokenizer process ``preheat serve`` started (``preheat.text.process``), if any.
    """
    from preheat.server.prepare import page_in, prepare, start_engine_imports, weight_files

    imports = imports if imports is not None else start_engine_imports(timeline)
    path, lease = fetch(settings, timeline)
    mapped: dict[str, Premapped] = {}
    try:
        tokenizer: TextTokenizer | Future[TextTokenizer]
        if keep is None:
            prepared = prepare(path, timeline, text, premap=_maps(settings))
            config, tokenizer, mapped = prepared.config, prepared.tokenizer, prepared.mapped
        else:  # a wake: the tokenizer was kept; only the weights come back (their pages asked for at once)
            page_in(weight_files(path), timeline)
            config, tokenizer, mapped = keep.config, keep.tokenizer, {}
        imports.wait()
        from preheat.engine import Engine
        from preheat.store.cache import ModelCache

        engine = Engine.from_checkpoint(
            path,
            device=settings.device,
            dtype=settings.engine_dtype,
            max_model_len=settings.max_model_len,
            timeline=timeline,
            load_mode=LoaderSettings.from_env().mode,  # PREHEAT_LOAD_MODE, named in the weight_load stage
            config=config,
            tokenizer=tokenizer,
            premapped=mapped,
            copies=ModelCache(settings.cache_dir),  # a converting CPU keeps the converted weights there
        )
        if settings.compile:  # compiles during one warm-up, with artifacts from the node cache or a peer
            from preheat.server.peering import compile_engine

            compile_engine(engine, settings, timeline)
        with timeline.stage("warmup"):
            engine.warmup()
        if keep is not None and keep.kv_tiers is not None:
            engine.attach_kv_tiers(keep.kv_tiers)  # the tiers outlive a sleep: same checkpoint, same keys
        else:
            from preheat.server import kvtier

            kvtier.attach(engine, settings, timeline)
    except BaseException:
        if lease is not None:
            lease.close()
        raise
    finally:
        for unused in mapped.values():  # files the load did not adopt (none, unless it mapped them itself)
            unused.close()
    timeline.mark("ready")
    return Loaded(engine, path, lease)


def _maps(settings: ServeSettings) -> bool:
    """Whether the load will map the weights (CPU, ``mmap`` or ``auto``): then they are mapped while torch imports."""
    return settings.device == "cpu" and LoaderSettings.from_env().mode in ("auto", "mmap")
