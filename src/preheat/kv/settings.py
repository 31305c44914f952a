"""``KVSettings``: the KV-tier part of ``preheat serve``'s settings, checked before anything is loaded.

Torch-free on purpose: the server validates its flags before it imports the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from preheat.core.config import parse_size
from preheat.core.errors import ConfigError
from preheat.kv.fileio import make_root
from preheat.kv.keys import DEFAULT_CHUNK_TOKENS
from preheat.kv.mac import read_secret_file

KV_DTYPES = ("auto", "int8", "fp8")  # auto: store the compute dtype's bytes exactly
DEFAULT_TTL_S = 24 * 3600  # Redis L2: seconds a chunk lives after its last hit
L2_SCHEMES = ("fs://", "redis://", "rediss://")
# What a redis(s):// L2 URL may say in its query (redis-py passes the rest to its connection, which would fail late).
REDIS_QUERY = (
    "db", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
)


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
            check_l2_url(self.l2)
        if self.secret_file is not None:
            if self.l2 is None:
                raise ConfigError("--kv-secret-file signs the chunks of a shared L2: give --kv-l2 too")
            read_secret_file(self.secret_file, warn=False)
        if self.l2_max_bytes is not None:
            if self.l2 is None or not self.l2.startswith("fs://"):
                raise ConfigError("--kv-l2-max-bytes is the quota of an fs:// L2 (Redis uses its own maxmemory)")
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
        if self.l2 is not None and self.l2.startswith("fs://"):  # last: nothing is made for settings refused
            make_l2_root(self.l2)


def check_l2_url(url: str) -> None:
    """Refuse an ``--kv-l2`` URL of no known scheme, a relative ``fs://`` path, or a Redis URL redis-py would refuse
    late. Messages never repeat a password."""
    if not url.startswith(L2_SCHEMES):
        shown = url.rsplit("@", maxsplit=1)[-1]  # never repeat a password
        raise ConfigError(f"--kv-l2 {shown!r}: use fs:///shared/dir, redis://host:port/db or rediss://...")
    if url.startswith("fs://") and not url[len("fs://") :].startswith("/"):
        raise ConfigError(f"--kv-l2 {url!r}: an fs:// URL takes an absolute path (fs:///shared/kv)")
    if url.startswith(("redis://", "rediss://")):
        check_redis_url(url)


def make_l2_root(url: str) -> None:
    """Make the directory of an ``fs://`` L2 that does not exist yet, or refuse naming it (``fileio.make_root``).

    Done while the settings are checked, before any model loads: a directory that cannot be made stops the start
    at once, instead of a replica serving with its L2 down (the tier itself is opened only after the load)."""
    try:
        make_root(os.path.abspath(url[len("fs://") :]))
    except ConfigError as exc:
        raise ConfigError(f"--kv-l2 {url}: {exc}") from None


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


def check_redis_url(url: str) -> None:
    """Refuse a ``redis://`` or ``rediss://`` L2 URL redis-py would only reject at its first command. Messages never
    repeat the password."""
    parts = urlsplit(url)
    shown = f"{parts.scheme}://{parts.hostname or ''}..."
    try:
        parts.port  # noqa: B018  # the property raises ValueError for a port that is not a number in range
    except ValueError:
        raise ConfigError(f"--kv-l2 {shown}: the port is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise ConfigError(f"--kv-l2 {shown}: no host (redis://[user:password@]host:port/db)")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"--kv-l2 {shown}: the database {db!r} is not a number (redis://host:port/0)")
    for name in parse_qs(parts.query):
        if name not in REDIS_QUERY:
            raise ConfigError(f"--kv-l2 {shown}: unknown option {name!r} (known: {', '.join(REDIS_QUERY)})")
        if name.startswith("ssl_") and parts.scheme != "rediss":
            raise ConfigError(f"--kv-l2 {shown}: {name} is a TLS option: use rediss://")
