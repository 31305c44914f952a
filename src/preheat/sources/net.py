"""Timeouts and the retry policy shared by the HTTP(S) and S3 sources.

A dead or stalled server must never hang a load for minutes: connecting gives up after ``connect_timeout`` seconds,
a read that receives nothing for ``read_timeout`` seconds fails, and a failure worth retrying (a dropped connection,
a timeout, HTTP 5xx/429) is retried a few times with short jittered exponential backoff (a random wait under 0.2 s,
0.4 s, 0.8 s, ...: ``core.backoff``). A retry of a ranged read asks only for the bytes not received yet, and an
attempt that made progress is resumed at once, so a connection that keeps dropping mid-body still finishes as long as
each attempt moves forward.

Environment: ``PREHEAT_HTTP_TIMEOUT`` (``READ`` or ``CONNECT,READ`` seconds; one value also caps the connect timeout),
``PREHEAT_HTTP_RETRIES`` (attempts per request, at least 1). Both apply to HTTP(S) and S3.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from preheat.core import env
from preheat.core.backoff import Backoff
from preheat.core.errors import SourceError, TransientError
from preheat.sources.base import READ_BYTES_LIMIT
from preheat.sources.stats import TransferStats

T = TypeVar("T")


@dataclass(frozen=True)
class NetSettings:
    """Network timeouts (seconds) and retry policy for remote sources."""

    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    attempts: int = 4
    backoff: float = 0.2  # the first retry waits up to this; the ceiling doubles per consecutive failure
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
        timeouts = env.get(env.HTTP_TIMEOUT)  # READ or CONNECT,READ: checked there (ConfigError naming it)
        if timeouts is not None:
            connect, read = (min(connect, timeouts[0]), timeouts[0]) if len(timeouts) == 1 else timeouts[:2]
        attempts = env.get(env.HTTP_RETRIES) or base.attempts
        return cls(connect_timeout=connect, read_timeout=read, attempts=attempts)

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` (>= 1) consecutive failures: a random wait under a ceiling that starts
        at ``backoff`` and doubles up to ``max_backoff`` (``core.backoff``, full jitter), so that the threads of a
        load (or the replicas of a deployment) that failed together do not all retry in the same instant."""
        return Backoff(self.backoff, self.max_backoff).delay(failures - 1)


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
