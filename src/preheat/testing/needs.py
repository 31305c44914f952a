"""What a double needs from the machine (a binary, an optional package, the embedded model) and does not find.

Under pytest the test that asked is skipped, with the reason and the fix, as for any test whose tool is missing (the
suite runs where Redis or the GGUF extras are not installed); anywhere else (a benchmark, a script) it is a
``ConfigError`` saying the same.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from preheat.core.errors import ConfigError


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test (under pytest) or raise ``ConfigError(reason)``; ``reason`` names what to install."""
    if "pytest" in sys.modules:  # imported by the test session that runs us; never imported here otherwise
        import pytest

        pytest.skip(reason)
    raise ConfigError(reason)
