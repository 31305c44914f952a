"""``ProgressBars``: the one progress display behind load, verify, convert, pull and the demo."""

from __future__ import annotations

import threading

from preheat.progress import ProgressBars


def test_without_a_terminal_each_stage_is_announced_once() -> None:
    said: list[str] = []
    with ProgressBars(enabled=False, say=said.append, indent="  ") as bars:
        for done in (0, 50, 100):
            bars.stage("read", done, 100)
        bars.stage("write", 10, 0)
    assert said == ["  read ...", "  write ..."]
    assert bars.drawn == ()


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
