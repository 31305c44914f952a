"""Sizes as people write them: ``8GiB``, ``512MiB``, ``64M``, ``1.5GB`` or ``20%`` (of a total the caller supplies,
e.g. host RAM), parsed into byte counts, and byte counts printed back.

Pure and at the bottom of ``core``: the settings (``config``) and the environment variables (``env``) both parse
sizes, and ``env`` sits below ``config``.
"""

from __future__ import annotations

import re

from preheat.core.errors import ConfigError

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
