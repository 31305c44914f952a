"""``KVSettings``: the KV-tier part of ``preheat serve``'s settings, checked before anything is loaded.

Torch-free on purpose: the server validates its flags before it imports the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from preheat.core.config import parse_size
from preheat.core.errors import ConfigError
from preheat.kv import backends
from preheat.kv.keys import DEFAULT_CHUNK_TOKENS, KV_DTYPES
from preheat.kv.mac import read_secret_file

DEFAULT_TTL_S = 24 * 3600  # Redis L2: seconds a chunk lives after its last hit


@dataclass(frozen=True)
class KVSettings:
    """The KV-tier part of ``preheat serve``'s settings. ``l1``: bytes or a percentage of RAM (``20%``), None = off."""

    l1: str | None = None
    l2: str | None = None
    l2_max_bytes: str | None = None
    l2_ttl_s: int = DEFAULT_TTL_S
    kv_dtype: str = "auto"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    secret_file: str | None = None  # the fleet's MAC secret for L2 chunks (``kv/mac.py``)
    warm: str | None = None  # before ready, load this much of L2's hottest chunks into L1 (a size, or "all")

    @property
    def enabled(self) -> bool:
        return self.l1 is not None or self.l2 is not None

    def check(self) -> None:
        """Refuse values that cannot work, before any model is loaded; make a missing ``fs://`` L2 directory
        (``fileio.make_root``)."""
        if self.l1 is not None:
            l1_bytes(self.l1)
        if self.l2 is not None:
            backends.check_url(self.l2, "--kv-l2")  # the scheme's own rules: kv/backends.py
        if self.secret_file is not None:
            if self.l2 is None:
                raise ConfigError("--kv-secret-file signs the chunks of a shared L2: give --kv-l2 too")
            read_secret_file(self.secret_file, warn=False)
        if self.l2_max_bytes is not None:
            refused = "no --kv-l2 is given" if self.l2 is None else backends.quota_refusal(self.l2)
            if refused is not None:
                raise ConfigError(f"--kv-l2-max-bytes is the quota of an {backends.quota_schemes()} L2 ({refused})")
            parse_size(self.l2_max_bytes)
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {self.kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        if self.chunk_tokens < 16 or self.chunk_tokens % 16:
            raise ConfigError(f"--kv-chunk-tokens {self.chunk_tokens}: use a multiple of 16 (the KV block size)")
        if self.warm is not None:
            if self.l1 is None or self.l2 is None:
                raise ConfigError("--kv-warm loads L2's hottest chunks into L1: give --kv-l1 and --kv-l2 too")
            if self.warm.strip().lower() != "all":
                parse_size(self.warm)
        if self.l2_ttl_s < 1:
            raise ConfigError(f"--kv-l2-ttl {self.l2_ttl_s}: must be at least 1 second")
        if self.l2 is not None:  # last: nothing is made for settings refused (an fs:// L2's missing directory)
            backends.prepare(self.l2, "--kv-l2")


def warm_bytes(settings: KVSettings) -> int | None:
    """``--kv-warm`` in bytes; None for ``all`` (as much as L1 takes) or when off."""
    if settings.warm is None or settings.warm.strip().lower() == "all":
        return None
    return parse_size(settings.warm)


def l1_bytes(spec: str) -> int:
    """``--kv-l1`` in bytes: ``8GiB``, or ``20%`` of this machine's RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = parse_size(spec, total=total)
    if spec.strip().endswith("%") and not 0 < float(spec.strip()[:-1]) <= 90:
        raise ConfigError(f"--kv-l1 {spec!r}: a share of RAM must be above 0% and at most 90%")
    return size
