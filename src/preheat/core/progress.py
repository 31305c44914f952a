"""Progress for the command line: one rich bar per stage of a long job on a terminal, a line per stage elsewhere.

Every long job the CLI runs (load, verify, convert, pull, the demo's first conversion) reports ``(done, total)``
bytes, or ``(stage, done, total)`` when it has stages, to one ``ProgressBars``. On a terminal (``enabled``: stderr
is one and no ``--json``) each stage gets a bar with its bytes, speed and time left, once the job has run ``delay``
seconds, so quick jobs stay quiet. Elsewhere (logs, CI) a stage that runs ``delay`` seconds or more is announced
through ``say`` and, when it ends, reported with its bytes and seconds: a log shows where a slow start spent them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


@dataclass
class _Stage:
    started: float
    done: int = 0
    total: int = 0
    announced: bool = False
    ended: bool = False


class ProgressBars:
    """Byte progress on stderr: ``update(done, total)`` for one job, ``stage(name, done, total)`` for a job with
    stages (one bar each); a total of 0 means unknown. Safe to call from reader threads.

    A stage ends when it reports ``done >= total > 0``, when a later stage first reports (a job's stages run one
    after another), or when the job leaves the ``with`` block without an error.

    ``transient``: the bars vanish when the job ends (the command prints its own summary). ``say``: when not
    ``enabled``, where the stage lines go (``"  read ..."`` once the stage has run ``delay`` seconds, then
    ``"  read: 96.6 MB in 4.1 s"``), each prefixed by ``indent``.

    >>> with ProgressBars(enabled=False, label="loading model", say=print, clock=lambda: 0.0) as bars:
    ...     bars.update(512, 1024)
    ...     bars.update(1024, 1024)
    loading model ...
    loading model: 1.0 kB in 0.0 s
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled, self.label, self.delay, self.transient = enabled, label, delay, transient
        self.say, self.indent, self.clock = say, indent, clock
        self.start = clock()
        self._bar: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._stages: dict[str, _Stage] = {}
        self._lock = threading.Lock()  # reader threads report concurrently: one bar, one task per stage

    def __enter__(self) -> ProgressBars:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:  # a failed job's error says what happened; its stages' seconds would read as done
            with self._lock:
                now = self.clock()
                for name, stage in self._stages.items():
                    self._end(name, stage, now)
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
        with self._lock:
            now = self.clock()
            stage = self._stages.get(name)
            if stage is None:
                for earlier, before in self._stages.items():
                    self._end(earlier, before, now)
                stage = self._stages[name] = _Stage(now)
            if stage.ended:  # a reader thread's report that arrived after the stage's last one
                return
            stage.done, stage.total = done, total
            if not self.enabled:
                if not stage.announced and now - stage.started >= self.delay:
                    stage.announced = True
                    self._say(f"{name} ...")
                if 0 < total <= done:
                    self._end(name, stage, now)
                return
            bar = self._bar
            if bar is None:
                if now - self.start < self.delay:
                    return
                bar = self._bar = self._new_bar()
            task = self._tasks.get(name)
            if task is None:
                task = self._tasks[name] = bar.add_task(name, total=total or None)
        bar.update(task, completed=done, total=total or None)

    def _end(self, name: str, stage: _Stage, now: float) -> None:
        """Mark ``stage`` over; without bars, say its bytes and seconds when it ran long enough to be announced."""
        if stage.ended:
            return
        stage.ended = True
        seconds = now - stage.started
        if self.enabled or not (stage.announced or seconds >= self.delay):
            return
        from rich.filesize import decimal  # the units the bars' byte column uses

        amount = f"{decimal(stage.done)} in " if stage.done > 1 else ""  # 1: a stage that reports only "done"
        self._say(f"{name}: {amount}{seconds:.1f} s")

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(f"{self.indent}{line}")

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
