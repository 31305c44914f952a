"""Settings: the loader's tunables (``LoaderSettings``: ``PREHEAT_THREADS``, ``PREHEAT_CHUNK_BYTES``,
``PREHEAT_LOAD_MODE``) and the one flag-then-variable-then-default rule (``resolve_settings``) behind
``preheat serve``'s and the router's settings. Other layers read their own variables (the HTTP sources, the peer
options, the node cache's directory): docs/architecture.md, *Environment variables*, lists who reads which.

Sizes are written like people write them: ``8GiB``, ``512MiB``, ``64M``, ``1.5GB`` or ``20%`` (of a total the caller
supplies, e.g. host RAM).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from preheat.core.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*$")


def parse_size(text: str | int, *, total: int | None = None) -> int:
    """Parse ``"8GiB"``, ``"64M"``, ``"1048576"`` or ``"20%"`` (of ``total``) into a byte count.

    >>> parse_size("1.5KiB")
    1536
    >>> parse_size("20%", total=1000)
    200
    """
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ConfigError(f"cannot parse size {text!r}: write it like '8GiB', '512MiB', '64M' or '20%'")
    digits, unit = match.group(1), match.group(2).lower()
    # Integers stay exact (float would round sizes above 2**53); fractions like "1.5GiB" go through float.
    number: float = int(digits) if digits.isdigit() else float(digits)
    if unit == "%":
        if total is None:
            raise ConfigError(f"size {text!r} is a percentage, but there is no total to take it of here")
        return int(total * number / 100)
    if unit not in _UNITS:
        raise ConfigError(
            f"unknown size unit {match.group(2)!r} in {text!r}: use B, KiB, MiB, GiB, TiB, KB, MB, GB or %"
        )
    return int(number * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ConfigError(f"{name}={raw!r} must be at least 1")
    return value


def _env_size(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return parse_size(raw)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


@dataclass(frozen=True)
class LoaderSettings:
    """Loader tunables. ``None`` means "tune automatically for this storage" (see ``preheat.io.tuning``)."""

    threads: int | None = None
    chunk_bytes: int | None = None
    mode: str = "auto"

    @classmethod
    def from_env(cls) -> LoaderSettings:
        """Read ``PREHEAT_THREADS``, ``PREHEAT_CHUNK_BYTES`` and ``PREHEAT_LOAD_MODE``."""
        return cls(
            threads=_env_int("PREHEAT_THREADS"),
            chunk_bytes=_env_size("PREHEAT_CHUNK_BYTES"),
            mode=os.environ.get("PREHEAT_LOAD_MODE", "auto") or "auto",
        )


def resolve_settings(
    settings: type[DataclassInstance],
    flags: Mapping[str, object],
    env: Mapping[str, str] | None,
    *,
    prefix: str,
    parse: Callable[[str, str, str], object],
) -> dict[str, object]:
    """The values given for the fields of a settings dataclass: each field's flag, else its ``<prefix><NAME>``
    environment variable (``env``, default ``os.environ``), else nothing (the field's default applies).

    A flag that is missing, ``None`` or an empty list was not given; a list (a repeatable flag) becomes a tuple, so
    settings stay hashable. A variable that is empty or blank was not set; otherwise ``parse(name, variable, raw)``
    turns its stripped text into the field's type (raising ``ConfigError`` naming the variable).

    >>> @dataclass(frozen=True)
    ... class Demo:
    ...     port: int = 80
    >>> resolve_settings(Demo, {"port": None}, {"DEMO_PORT": " 81 "}, prefix="DEMO_", parse=lambda n, v, r: int(r))
    {'port': 81}
    """
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field in fields(settings):
        given = flags.get(field.name)
        if given is not None and given != []:
            values[field.name] = tuple(given) if isinstance(given, list) else given
            continue
        variable = prefix + field.name.upper()
        raw = env.get(variable, "").strip()
        if raw:
            values[field.name] = parse(field.name, variable, raw)
    return values
