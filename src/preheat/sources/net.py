"""Timeouts and the retry policy shared by the HTTP(S) and S3 sources.

A dead or stalled server must never hang a load for minutes: connecting gives up after ``connect_timeout`` seconds,
a read that receives nothing for ``read_timeout`` seconds fails, and a failure worth retrying (a dropped connection,
a timeout, HTTP 5xx/429) is retried a few times with short exponential backoff (0.2 s, 0.4 s, 0.8 s, ...). A retry of a
ranged read asks only for the bytes not received yet, and an attempt that made progress is resumed at once, so a
connection that keeps dropping mid-body still finishes as long as each attempt moves forward.

Environment: ``PREHEAT_HTTP_TIMEOUT`` (``READ`` or ``CONNECT,READ`` seconds; one value also caps the connect timeout),
``PREHEAT_HTTP_RETRIES`` (attempts per request, at least 1). Both apply to HTTP(S) and S3.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from preheat.core.errors import ConfigError, SourceError
from preheat.sources.base import READ_BYTES_LIMIT
from preheat.sources.stats import TransferStats

T = TypeVar("T")


class TransientError(Exception):
    """A failure worth retrying (network error, timeout, 5xx). Internal: callers see ``SourceError`` at the end."""


@dataclass(frozen=True)
class NetSettings:
    """Network timeouts (seconds) and retry policy for remote sources."""

    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    attempts: int = 4
    backoff: float = 0.2  # first retry delay; doubles per consecutive failure
    max_backoff: float = 5.0
    whole_file_limit: int = READ_BYTES_LIMIT  # bytes ``read_bytes`` may hold (configs, manifests); more is refused
    # Redirects one request may follow. Peers get 0: a peer serves its own checkpoint's files or nothing, and a
    # redirect from one would steer the puller to any URL the peer chose.
    redirects: int = 5

    @classmethod
    def from_env(cls) -> NetSettings:
        """Read ``PREHEAT_HTTP_TIMEOUT`` and ``PREHEAT_HTTP_RETRIES`` (unset: the defaults above)."""
        base = cls()
        connect, read = base.connect_timeout, base.read_timeout
        raw = os.environ.get("PREHEAT_HTTP_TIMEOUT", "").strip()
        if raw:
            try:
                values = [float(part) for part in raw.split(",")]
            except ValueError:
                values = []
            if len(values) not in (1, 2) or any(v <= 0 for v in values):
                raise ConfigError(
                    f"PREHEAT_HTTP_TIMEOUT={raw!r}: write seconds as READ or CONNECT,READ (e.g. '30' or '5,30')"
                )
            connect, read = (min(connect, values[0]), values[0]) if len(values) == 1 else (values[0], values[1])
        attempts = base.attempts
        raw = os.environ.get("PREHEAT_HTTP_RETRIES", "").strip()
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                raise ConfigError(f"PREHEAT_HTTP_RETRIES={raw!r}: write the number of attempts, at least 1")
            attempts = int(raw)
        return cls(connect_timeout=connect, read_timeout=read, attempts=attempts)

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures, with up to 25% jitter so that the threads of a
        load (or the replicas of a deployment) that failed together do not all retry in the same instant."""
        base = min(self.max_backoff, self.backoff * float(2 ** (failures - 1)))
        return base * (1 + random.random() / 4)


def retrying(
    attempt: Callable[[], T],
    *,
    settings: NetSettings,
    what: str,
    stats: TransferStats,
    progress: Callable[[], int] = lambda: 0,
) -> T:
    """Call ``attempt`` until it returns, retrying on ``TransientError`` with backoff.

    ``progress()`` tells how many bytes the attempts have delivered so far; an attempt that delivered some is resumed
    at once and resets the failure count. After ``settings.attempts`` consecutive failures that delivered nothing,
    raises ``SourceError`` naming ``what``. Every retry is counted in ``stats``.
    """
    failures = 0
    while True:
        before = progress()
        try:
            return attempt()
        except TransientError as exc:
            # An attempt that delivered bytes before failing is resumed at once: it cannot loop forever, since every
            # such attempt moves forward.
            failures = 0 if progress() > before else failures + 1
            if failures >= settings.attempts:
                raise SourceError(
                    f"{what}: {exc} (gave up after {failures} attempt{'s' if failures > 1 else ''}; "
                    "PREHEAT_HTTP_RETRIES and PREHEAT_HTTP_TIMEOUT tune this)"
                ) from exc
            stats.add(retries=1)
            if failures:
                time.sleep(settings.delay(failures))
