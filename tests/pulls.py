"""Pulls cut short, as the resume and durability tests need them: stopped in-process from the progress callback
(``interrupt_at``), or a real ``preheat pull`` process SIGKILLed mid-way (``kill_pull_after``), each leaving its
partial files and journal behind as a crash would."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

CHUNK = 128 * 1024


class PullInterruptedError(Exception):
    """Raised from a pull's progress callback: the pull stops there, leaving its partial files and journal."""


def interrupt_at(fraction: float) -> Callable[[int, int], None]:
    """A progress callback that stops the pull (``PullInterruptedError``) once ``fraction`` of its bytes are in."""

    def progress(done: int, total: int) -> None:
        if done >= total * fraction:
            raise PullInterruptedError

    return progress


def _journal_bytes(cache_root: Path, chunk: int) -> int:
    journals = list((cache_root / "partial").glob("*/.journal"))
    if not journals:
        return 0
    return sum(1 for line in journals[0].read_text().splitlines() if '"pin"' not in line) * chunk


def kill_pull_after(url: str, cache_root: Path, nbytes: float, *, threads: int, chunk: int) -> None:
    """Run ``preheat pull URL`` in another process and SIGKILL it once its journal records ``nbytes`` (or after 60 s),
    leaving its partial files and journal as a crash would."""
    proc = spawn_pull(url, cache_root, threads=threads, chunk=str(chunk), quiet=True)
    deadline = time.monotonic() + 60
    while _journal_bytes(cache_root, chunk) < nbytes and time.monotonic() < deadline:
        assert proc.poll() is None, "the pull finished before it could be interrupted"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def spawn_pull(url: str, cache_root: Path, *, threads: int, chunk: str, quiet: bool = False) -> subprocess.Popen[str]:
    """``preheat pull URL --json`` as a separate process (output discarded when ``quiet``, else captured)."""
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "preheat.cli",
            "pull",
            url,
            "--cache-dir",
            str(cache_root),
            "--threads",
            str(threads),
            "--chunk-bytes",
            chunk,
            "--json",
        ],
        stdout=out,
        stderr=out,
        text=True,
    )
