"""Progress bars for the command line: one rich bar per stage of a long job, drawn on a terminal only.

Every long job the CLI runs (load, verify, convert, pull, the demo's first conversion) reports ``(done, total)``
bytes, or ``(stage, done, total)`` when it has stages, to one ``ProgressBars``. Nothing is drawn unless ``enabled``
(stderr is a terminal and no ``--json``), and a bar appears only after ``delay`` seconds, so quick jobs stay quiet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class ProgressBars:
    """Byte progress on stderr: ``update(done, total)`` for one job, ``stage(name, done, total)`` for a job with
    stages (one bar each); a total of 0 means unknown. Safe to call from reader threads.

    ``transient``: the bars vanish when the job ends (the command prints its own summary). ``say``: when not
    ``enabled``, announce each stage once through it instead (logs, CI), prefixed by ``indent``.

    >>> with ProgressBars(enabled=False, label="loading model") as bars:
    ...     bars.update(512, 1024)
    """

    def __init__(
        self,
        *,
        enabled: bool,
        label: str = "",
        delay: float = 0.0,
        transient: bool = False,
        say: Callable[[str], None] | None = None,
        indent: str = "",
    ) -> None:
        self.enabled, self.label, self.delay, self.transient = enabled, label, delay, transient
        self.say, self.indent = say, indent
        self.start = time.monotonic()
        self._bar: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._announced: set[str] = set()
        self._lock = threading.Lock()  # reader threads report concurrently: one bar, one task per stage

    def __enter__(self) -> ProgressBars:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    @property
    def drawn(self) -> tuple[str, ...]:
        """The stages that have a bar on screen (none before ``delay`` or when not ``enabled``)."""
        return tuple(self._tasks)

    def update(self, done: int, total: int) -> None:
        """Report ``done`` of ``total`` bytes of the job named ``label``."""
        self.stage(self.label, done, total)

    def stage(self, name: str, done: int, total: int) -> None:
        """Report ``done`` of ``total`` bytes of stage ``name`` (its bar is added on its first report)."""
        if not self.enabled:
            if self.say is not None and name not in self._announced:
                self._announced.add(name)
                self.say(f"{self.indent}{name} ...")
            return
        with self._lock:
            bar = self._bar
            if bar is None:
                if time.monotonic() - self.start < self.delay:
                    return
                bar = self._bar = self._new_bar()
            task = self._tasks.get(name)
            if task is None:
                task = self._tasks[name] = bar.add_task(name, total=total or None)
        bar.update(task, completed=done, total=total or None)

    def _new_bar(self) -> Progress:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        bar = Progress(
            f"{self.indent}[progress.description]{{task.description}}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(elapsed_when_finished=True),
            transient=self.transient,
        )
        bar.start()
        return bar
