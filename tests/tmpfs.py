"""A real tmpfs mounted for one test: a disk that fills after a few writes, or a read-only one (it needs root;
elsewhere the test skips, saying so)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str, *, fstype: str = "tmpfs") -> Iterator[Path]:
    """A tmpfs mounted at ``path`` with mount ``options`` (``size=1m``, ``ro,size=1m``), lazily unmounted afterwards.
    ``fstype="ramfs"``: a ramfs instead, memory that refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here (needs root): {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
