"""One generation worker thread in front of the engine, with a bounded waiting line.

The engine is not thread-safe, so every generation runs on this one thread, one request after another; request
threads only tokenize, enqueue, and relay the steps this thread produces. ``max_queue`` bounds the requests waiting
behind the one being generated: one more is refused at once (the server answers 429) instead of piling up latency
that no client will wait for. A job whose client went away is cancelled: the engine's ``should_stop`` sees it
between tokens, and a job cancelled while still waiting is skipped without touching the engine.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, Union

from preheat.core.errors import PreheatError, QueueFullError, WorkerPausedError

if TYPE_CHECKING:  # the engine imports torch: never at module level on the cold-start path
    from preheat.engine import Engine, GenerationStep, SamplingParams
    from preheat.server.metrics import ServerMetrics

log = logging.getLogger("preheat.server")
T = TypeVar("T")

# What a job's consumer receives: a step, an error raised by the engine, or None once the generation is over.
Event = Union["GenerationStep", BaseException, None]


@dataclass
class Job:
    """One generation request on its way through the worker."""

    prompt_ids: list[int]
    params: SamplingParams
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue)
    first_token_at: float | None = None  # monotonic, set by the worker when the engine yields the first step
    last_token_at: float | None = None
    generated: int = 0
    finish: str | None = None  # "stop", "length", "abort" (client went away) or "error"
    version: int | None = None  # the weights version it ran on (--follow: docs/refit.md), set as it starts

    def cancel(self) -> None:
        """Stop this generation at the next token (or skip it if it has not started)."""
        self.cancelled.set()


SLOTS = 1  # sequences the worker generates at once (one after another): the KV events' ``load.slots``


class Worker:
    """Runs jobs one at a time on a daemon thread; ``submit`` refuses when ``max_queue`` jobs already wait."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_queue: int) -> None:
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._waiting: deque[Job] = deque()
        self._running = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._paused = False
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="preheat-generate", daemon=True)
        # Calls to run on this thread between two jobs (a live weight swap: the engine is not thread-safe, and a
        # request that started on one version finishes on it), and the weights version jobs then run on.
        self._between: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self.version: int | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Let the current token finish, cancel everything, and wait up to ``timeout`` seconds for the thread to end.

        The wait matters: a daemon thread still inside torch while the interpreter shuts down makes the C++ runtime
        abort ("terminate called without an active exception", exit -6), so SIGTERM under load would look like a
        crash. Cancelling the running job ends it at its next token.
        """
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job.cancel()
            if self._current is not None:
                self._current.cancel()
            while self._between:  # a swap waiting for this thread: its caller must not wait forever
                self._between.popleft()[1].set_exception(WorkerPausedError("the worker stopped"))
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def load(self) -> tuple[int, int]:
        """(jobs waiting, jobs generating): the queue-depth gauges."""
        with self._cond:
            return len(self._waiting), self._running

    def drain(self, timeout: float) -> bool:
        """Take no new jobs and wait up to ``timeout`` seconds for the running and waiting ones to finish. True when
        the worker is idle (it stays closed to new jobs: ``stop`` it); False after the timeout, the worker then
        takes jobs again as before (sleep's rule: docs/server.md, *Sleep and wake*)."""
        with self._cond:
            self._paused = True
            idle = self._cond.wait_for(lambda: not self._waiting and not self._running, timeout)
            if not idle:
                self._paused = False
            return idle

    def submit(self, job: Job) -> None:
        """Put ``job`` in line, or raise ``QueueFullError`` when ``max_queue`` jobs already wait
        (``WorkerPausedError`` while draining for a sleep)."""
        with self._cond:
            if self._paused:
                raise WorkerPausedError("the replica is going to sleep and takes no new requests")
            if len(self._waiting) >= self.max_queue and (self._running or self._waiting):
                raise QueueFullError(
                    f"{len(self._waiting)} request(s) already wait for the engine (--max-queue {self.max_queue})"
                )
            self._waiting.append(job)
            self._cond.notify()

    def call_between(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the generation thread between two jobs (at once when idle) and return its result; its
        exception is raised here."""
        future: Future[object] = Future()
        with self._cond:
            if self._stopping:
                raise WorkerPausedError("the worker is stopping")
            self._between.append((fn, future))
            self._cond.notify()
        return future.result()  # type: ignore[return-value]  # the future holds fn's own result

    @staticmethod
    def _run_between(calls: list[tuple[Callable[[], object], Future[object]]]) -> None:
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who decides; the worker carries on
                future.set_exception(exc)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping and not self._between:
                    self._cond.wait()
                if self._stopping:
                    return
                calls = list(self._between)
                self._between.clear()
            if calls:  # outside the lock: requests keep queueing while a swap runs
                self._run_between(calls)
                continue
            with self._cond:
                if not self._waiting:
                    continue
                job = self._waiting.popleft()
                job.version = self.version
                self._running = 1
                self._current = job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = 0
                    self._current = None
                    self._cond.notify_all()  # drain() waits for the worker to be idle
                job.events.put(None)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.finish = "abort"
            self.metrics.finished.inc(reason="abort")
            return
        try:
            steps = self.engine.generate(job.prompt_ids, job.params, should_stop=job.cancelled.is_set)
            # closing(): a cancelled job leaves the loop early, and closing the iterator frees its KV blocks now.
            with contextlib.closing(steps):
                self._relay(job, steps)
        # The engine raises PreheatError for requests it refuses; anything else is a bug that must reach the client
        # as a 500 (and the log) without killing the only generation thread.
        except Exception as exc:  # relayed to the request thread; logged unless it is a refusal
            if not isinstance(exc, PreheatError):
                log.exception("generation failed")
            job.finish = "error"
            self.metrics.finished.inc(reason="error")
            job.events.put(exc)
            return
        if job.cancelled.is_set():
            job.finish = "abort"
        self.metrics.finished.inc(reason=job.finish or "stop")

    def _relay(self, job: Job, steps: Iterator[GenerationStep]) -> None:
        for step in steps:
            now = time.monotonic()
            if job.first_token_at is None:
                job.first_token_at = now
            job.last_token_at = now
            job.generated += 1
            job.finish = step.finish_reason
            self.metrics.generated_tokens.inc()
            job.events.put(step)
            if job.cancelled.is_set():
                return  # don't wait for the engine's own check: the next token would be wasted work
