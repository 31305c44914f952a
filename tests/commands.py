"""preheat's commands run as a user runs them: a child ``python -m preheat.cli ...``, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``preheat ARGS`` in a child process with this environment plus ``env``; never raises on a failed exit."""
    return subprocess.run(
        [sys.executable, "-m", "preheat.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
