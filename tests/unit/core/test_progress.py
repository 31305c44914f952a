"""``ProgressBars``: the one progress display behind load, verify, convert, pull and the demo."""

from __future__ import annotations

import threading

from preheat.core.progress import ProgressBars


class Clock:
    """A clock the test moves: stage lines depend on how long a stage ran, never on this machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_each_stage_is_announced_once_and_ends_with_its_bytes_and_seconds() -> None:
    said: list[str] = []
    clock = Clock()
    with ProgressBars(enabled=False, say=said.append, indent="  ", clock=clock) as bars:
        for done in (0, 50_000_000, 100_000_000):
            bars.stage("read", done, 100_000_000)
            clock.now += 1.5
        bars.stage("write", 10, 0)  # unknown total: it ends when the job does
        clock.now += 2.0
    assert said == ["  read ...", "  read: 100.0 MB in 3.0 s", "  write ...", "  write: 10 bytes in 2.0 s"]
    assert bars.drawn == ()


def test_without_a_terminal_a_stage_quicker_than_the_delay_says_nothing() -> None:
    said: list[str] = []
    clock = Clock()
    with ProgressBars(enabled=False, say=said.append, delay=2.0, clock=clock) as bars:
        bars.stage("plan", 0, 10)
        clock.now += 0.5
        bars.stage("plan", 10, 10)  # 0.5 s: quiet
        bars.stage("dequantize", 0, 1000)
        clock.now += 2.5
        bars.stage("dequantize", 500, 1000)  # 2.5 s in: announced
        clock.now += 2.5
        bars.stage("dequantize", 999, 1000)  # a later stage ends it
        bars.stage("write", 1, 1)
    assert said == ["dequantize ...", "dequantize: 999 bytes in 5.0 s"]


def test_a_job_that_fails_does_not_report_its_stage_as_done() -> None:
    said: list[str] = []
    clock = Clock()
    try:
        with ProgressBars(enabled=False, say=said.append, clock=clock) as bars:
            bars.stage("read", 10, 0)
            raise OSError("disk gone")
    except OSError:
        pass
    assert said == ["read ..."]


def test_a_quick_job_draws_nothing_before_the_delay() -> None:
    with ProgressBars(enabled=True, label="loading", delay=3600.0) as bars:
        bars.update(1, 2)
    assert bars.drawn == ()


def test_reader_threads_share_one_bar_and_one_task_per_stage() -> None:
    with ProgressBars(enabled=True, label="loading", transient=True) as bars:
        threads = [threading.Thread(target=bars.update, args=(i, 64)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        bars.stage("verify", 1, 0)  # a total of 0: unknown
    assert bars.drawn == ("loading", "verify")
