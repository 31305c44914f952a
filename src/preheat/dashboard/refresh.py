"""A slow provider's value kept fresh off the caller's thread: the doctor's findings for the dashboards.

Its own module, importing only the standard library: ``preheat serve`` builds one at start (its cold-start path),
and the doctor itself runs only when a page first asks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from preheat.core.errors import PreheatError

log = logging.getLogger("preheat.dashboard")
T = TypeVar("T")


class Refreshing(Generic[T]):
    """A slow provider's last value, recomputed in a background thread at most every ``every`` seconds.

    Calling it never waits: the first call starts the first run and returns None; later calls return the last value
    (starting a new run when it is older than ``every``). A run that raised leaves the last value and sets ``error``.
    """

    def __init__(self, produce: Callable[[], T], every: float = 60.0) -> None:
        self.produce, self.every = produce, every
        self.error: str | None = None
        self._value: T | None = None
        self._at: float | None = None
        self._running = False
        self._lock = threading.Lock()

    def __call__(self) -> T | None:
        with self._lock:
            stale = self._at is None or time.monotonic() - self._at >= self.every
            if stale and not self._running:
                self._running = True
                threading.Thread(target=self._run, name="preheat-dashboard-refresh", daemon=True).start()
            return self._value

    def wait(self, timeout: float) -> T | None:
        """The value once the first run has ended (or None after ``timeout`` seconds): for tests and a first page."""
        end = time.monotonic() + timeout
        self()
        while time.monotonic() < end:
            with self._lock:
                if self._at is not None:
                    return self._value
            time.sleep(0.05)
        return None

    def _run(self) -> None:
        value, error = self._value, None
        try:
            value = self.produce()
        except PreheatError as exc:
            error = str(exc)
        except Exception as exc:  # a failing check must not take the dashboard down: its error is shown there
            log.warning("dashboard: findings provider failed", exc_info=True)
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._value, self.error, self._at, self._running = value, error, time.monotonic(), False
