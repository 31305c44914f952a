"""Build the ``TieredKV`` for an engine's ``KVSpec`` from the server's KV settings (``--kv-l1``, ``--kv-l2``,
``--kv-dtype`` ...). The spec is a value the engine builds (``Engine.kv_spec``): nothing here imports the engine.

Failures here never stop a server: an L2 that cannot be reached is built anyway and marked down (with a warning and a
metric) and retried later; a checkpoint without a ``preheat.json`` identity gets L1 only, because without an
identity two different checkpoints of the same shape would share keys. A ``--kv-secret-file`` that cannot be read
any more (it was checked at start-up) turns L2 off rather than letting it run unkeyed.
"""

from __future__ import annotations

import logging
import secrets

from preheat.core.config import parse_size
from preheat.core.errors import ConfigError
from preheat.kv import backends, chunkfile, mac
from preheat.kv.chunk import expect_for, stored_dtype
from preheat.kv.events import EventLog
from preheat.kv.keys import fingerprint
from preheat.kv.memory import MemoryTier
from preheat.kv.settings import KVSettings, l1_bytes
from preheat.kv.spec import KVSpec
from preheat.kv.tier import EvictHook, Tier
from preheat.kv.tiered import TieredKV

log = logging.getLogger("preheat.kv")


def spec_fingerprint(spec: KVSpec, settings: KVSettings, identity: str) -> str:
    """The KV fingerprint of an engine described by ``spec`` (docs/kv-keys.md)."""
    return fingerprint(
        identity=identity,
        layout=spec.layout.to_dict(),
        chunk_tokens=settings.chunk_tokens,
        rope=spec.rope,
        kv_dtype=None if settings.kv_dtype == "auto" else settings.kv_dtype,
    )


def build_tiers(spec: KVSpec, settings: KVSettings) -> TieredKV | None:
    """The tiers ``settings`` ask for, holding chunks of the engine ``spec`` describes; None when KV tiers are off."""
    if not settings.enabled:
        return None
    identity = spec.identity
    l2_url = settings.l2
    if identity is None:
        identity = "process-" + secrets.token_hex(16)  # L1 only: these keys are valid inside this process alone
        if l2_url is not None:
            log.warning(
                "KV L2 is off: the checkpoint has no preheat.json identity, so its chunks could not be told apart "
                "from another checkpoint's; run `preheat convert` to give it one"
            )
            l2_url = None
    mac_key = None
    if l2_url is not None and settings.secret_file is not None:
        try:
            mac_key = mac.derive_key(mac.read_secret_file(settings.secret_file))
        except ConfigError as exc:  # checked at start-up, so the file changed since: never fall back to unkeyed
            log.error("KV L2 is off: %s", exc)
            l2_url = None
    fp = spec_fingerprint(spec, settings, identity)
    layout = spec.layout
    expect = expect_for(
        fp,
        stored_dtype(settings.kv_dtype, layout.dtype),
        layout.chunk_shape(settings.chunk_tokens),
        mac_key=mac_key,
    )
    events = EventLog()

    def evicted(tier: str, key: str) -> None:
        events.emit("evict", tier, key)

    l1 = MemoryTier(l1_bytes(settings.l1), on_evict=evicted) if settings.l1 is not None else None
    l2 = open_l2(l2_url, expect, settings, evicted) if l2_url is not None else None
    return TieredKV(
        fingerprint=fp,
        chunk_tokens=settings.chunk_tokens,
        events=events,
        l1=l1,
        l2=l2,
        kv_dtype=settings.kv_dtype,
        pin=spec.pin,
        keyed=l2 is not None and mac_key is not None,
    )


def open_l2(url: str, expect: chunkfile.Expect, settings: KVSettings, hook: EvictHook | None = None) -> Tier:
    """The L2 tier for ``url`` (``fs:///path`` or ``redis://...``, by ``kv/backends.py``); unreachable ones come
    back marked down."""
    quota = parse_size(settings.l2_max_bytes) if settings.l2_max_bytes is not None else None
    return backends.open_l2(url, expect, max_bytes=quota, ttl_s=settings.l2_ttl_s, on_evict=hook)
