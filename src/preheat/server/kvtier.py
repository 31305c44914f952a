"""The server's side of the KV tiers: build them after warm-up, render their metrics, answer ``/v1/kv/events``.

docs/kv-cache.md has the tiers; docs/kv-events.md the events protocol the router polls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from preheat.core.timeline import Timeline
from preheat.http.metrics import Family
from preheat.http.ranges import parse_length
from preheat.server.settings import ServeSettings
from preheat.server.worker import SLOTS

if TYPE_CHECKING:
    from preheat.engine import Engine
    from preheat.kv.settings import KVSettings
    from preheat.kv.tiered import TieredKV

log = logging.getLogger("preheat.kv")
SNAPSHOT_LIMIT = 100_000  # keys per tier in a snapshot (docs/kv-events.md)


def attach(engine: Engine, settings: ServeSettings, timeline: Timeline) -> None:
    """Build the KV tiers ``settings`` ask for and attach them to ``engine`` (stage ``kv_tiers``)."""
    kv = settings.kv
    if not kv.enabled:
        return
    spec = engine.kv_spec()
    if spec is None:
        log.warning("KV tiers are off: this model runs on the transformers fallback, which cannot export KV chunks")
        return
    from preheat.kv.build import build_tiers

    with timeline.stage("kv_tiers") as stage:
        tiers = build_tiers(spec, kv)
        engine.attach_kv_tiers(tiers)
        if tiers is not None:
            stage.detail.update(
                fingerprint=tiers.fingerprint,
                l1=tiers.l1.capacity if tiers.l1 is not None else None,
                l2=tiers.l2.describe() if tiers.l2 is not None else None,
                l2_up=tiers.l2.up if tiers.l2 is not None else None,
                l2_mac=tiers.keyed,
                kv_dtype=kv.kv_dtype,
                chunk_tokens=kv.chunk_tokens,
            )
    if tiers is not None and kv.warm is not None:
        warm(tiers, kv, timeline)


def warm(tiers: TieredKV, kv: KVSettings, timeline: Timeline) -> None:
    """``--kv-warm``: L2's hottest chunks into L1 before ``ready`` (stage ``kv_warm``: ``/health`` says warming)."""
    from preheat.kv.settings import warm_bytes
    from preheat.kv.warm import warm_tiers

    with timeline.stage("kv_warm") as stage:
        report = warm_tiers(tiers, max_bytes=warm_bytes(kv))
        stage.nbytes = report.bytes
        stage.detail.update(report.to_dict())
    log.info("KV warm-up: %d chunks (%d bytes) from L2 into L1 in %.2f s", report.loaded, report.bytes, report.seconds)


def summary(tiers: TieredKV, *, l2_asked: bool = False) -> str:
    """One line for the console: each tier, its size or place, and its state: ``up``, or ``DOWN (why)``; an L2 that
    was asked for (``l2_asked``) but not built is ``OFF`` (the warning before this line says why)."""
    from preheat.core.config import format_bytes

    parts = []
    if tiers.l1 is not None:
        parts.append(f"L1 {format_bytes(tiers.l1.capacity)} host memory up")  # memory: never down
    if tiers.l2 is not None:
        health = getattr(tiers.l2, "health", None)
        state = "up" if tiers.l2.up else f"DOWN ({health.reason if health is not None else 'unreachable'})"
        parts.append(f"L2 {tiers.l2.describe()} {state}{', chunks signed (MAC)' if tiers.keyed else ''}")
    elif l2_asked:
        parts.append("L2 OFF (see the warning above)")
    return f"KV tiers: {', '.join(parts) or 'none'}; chunks of {tiers.chunk_tokens} tokens, stored {tiers.kv_dtype}"


def metric_families(tiers: TieredKV | None) -> list[Family]:
    """Prometheus series for every tier: hits, misses, bytes, read seconds, stores, evictions, corrupt chunks, MAC
    failures, errors, up/down; plus L2 writes dropped under pressure."""
    if tiers is None:
        return []
    counters = [
        ("hits", "Chunk lookups answered by this tier."),
        ("misses", "Chunk lookups this tier could not answer (absent, corrupt, or tier down)."),
        ("bytes_read", "Bytes of chunks read from this tier."),
        ("read_seconds", "Seconds spent reading hits from this tier."),
        ("stores", "Chunks stored in this tier."),
        ("bytes_written", "Bytes of chunks written to this tier."),
        ("evictions", "Chunks removed to stay under capacity (L1) or quota (fs L2)."),
        ("corrupt", "Chunks that failed their checks (the MAC included): treated as misses and removed."),
        ("mac_failures", "Of the corrupt chunks, those refused by the keyed MAC (--kv-secret-file)."),
        ("errors", "Failed reads and writes (I/O errors, unreachable server)."),
        ("refused", "Chunks a tier would not store: larger than the whole fs:// quota."),
    ]
    snapshots = {tier.name: tier.stats.snapshot() for tier in tiers.tiers}
    families = [
        Family(
            f"preheat_kv_{field}_total",
            help_text,
            "counter",
            [({"tier": tier}, float(snap[field])) for tier, snap in snapshots.items()],
        )
        for field, help_text in counters
    ]
    up = [({"tier": t.name}, float(t.up)) for t in tiers.tiers]
    return [
        *families,
        Family(
            "preheat_kv_tier_up", "1 when the tier is usable, 0 while it is down (requests recompute).", "gauge", up
        ),
        Family(
            "preheat_kv_l2_writes_dropped_total",
            "Chunks not written to L2 because its write queue was full.",
            "counter",
            [({}, float(tiers.dropped))],
        ),
    ]


def events_payload(tiers: TieredKV, query: str, load: Callable[[], tuple[int, int]]) -> dict[str, object]:
    """The ``GET /v1/kv/events`` answer (docs/kv-events.md) for the URL query string ``query``."""
    params = parse_qs(query)
    epoch = params.get("epoch", [None])[0]
    since_text = params.get("since", [None])[0]
    since = parse_length(since_text)  # ASCII digits only, bounded: '²' or 5,000 digits mean 'from the start'
    latest, events = tiers.events.since(epoch, since)
    waiting, running = load()
    payload: dict[str, object] = {
        "epoch": tiers.events.epoch,
        "fingerprint": tiers.fingerprint,
        "chunk_tokens": tiers.chunk_tokens,
        "seq": latest,
        "reset": events is None,
        "l2_id": tiers.l2.describe() if tiers.l2 is not None else None,
        "costs": tiers.costs.to_dict(),
        "load": {"running": running, "waiting": waiting, "slots": SLOTS},
    }
    if events is None:
        payload["l1"] = tiers.l1.keys(SNAPSHOT_LIMIT) if tiers.l1 is not None else []
        payload["l2"] = tiers.l2.keys(SNAPSHOT_LIMIT) if tiers.l2 is not None else []
    else:
        payload["events"] = [e.to_dict() for e in events]
    return payload
