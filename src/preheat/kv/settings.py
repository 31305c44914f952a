"""``KVSettings``: the KV-tier part of ``preheat serve``'s settings, checked before anything is loaded.

Torch-free on purpose: the server validates its flags before it imports the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from preheat.config import parse_size
from preheat.errors import ConfigError
from preheat.kv.keys import DEFAULT_CHUNK_TOKENS

KV_DTYPES = ("auto", "int8", "fp8")  # auto: store the compute dtype's bytes exactly
DEFAULT_TTL_S = 24 * 3600  # Redis L2: seconds a chunk lives after its last hit
L2_SCHEMES = ("fs://", "redis://", "rediss://")



@dataclass(frozen=True)
class KVSettings:
    """The KV-tier part of ``preheat serve``'s settings. ``l1``: bytes or a percentage of RAM (``20%``), None = off."""

    l1: str | None = None
    l2: str | None = None
    l2_max_bytes: str | None = None
    l2_ttl_s: int = DEFAULT_TTL_S
    kv_dtype: str = "auto"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @property
    def enabled(self) -> bool:
        return self.l1 is not None or self.l2 is not None

    def check(self) -> None:
        """Refuse values that cannot work, before any model is loaded."""
        if self.l1 is not None:
            l1_bytes(self.l1)
        if self.l2 is not None and not self.l2.startswith(L2_SCHEMES):
            raise ConfigError(f"--kv-l2 {self.l2!r}: use fs:///shared/dir or redis://host:port/db")
        if self.l2 is not None and self.l2.startswith("fs://") and not self.l2[len("fs://") :].startswith("/"):
            raise ConfigError(f"--kv-l2 {self.l2!r}: an fs:// URL takes an absolute path (fs:///shared/kv)")
        if self.l2_max_bytes is not None:
            if self.l2 is None or not self.l2.startswith("fs://"):
                raise ConfigError("--kv-l2-max-bytes is the quota of an fs:// L2 (Redis uses its own maxmemory)")
            parse_size(self.l2_max_bytes)
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {self.kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        if self.chunk_tokens < 16 or self.chunk_tokens % 16:
            raise ConfigError(f"--kv-chunk-tokens {self.chunk_tokens}: use a multiple of 16 (the KV block size)")
        if self.l2_ttl_s < 1:
            raise ConfigError(f"--kv-l2-ttl {self.l2_ttl_s}: must be at least 1 second")


def l1_bytes(spec: str) -> int:
    """``--kv-l1`` in bytes: ``8GiB``, or ``20%`` of this machine's RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = parse_size(spec, total=total)
    if spec.strip().endswith("%") and not 0 < float(spec.strip()[:-1]) <= 90:
        raise ConfigError(f"--kv-l1 {spec!r}: a share of RAM must be above 0% and at most 90%")
    return size
