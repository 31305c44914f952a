"""Run the doctor's checks inside one time budget and rank what they found.

Every check has its own bound (seconds) and runs on a daemon thread that the runner stops waiting for when the bound
or the remaining budget runs out, so a hung NFS ``statvfs`` or a silent origin costs a ``doctor.timeout`` finding,
never the whole run. A check that is not even started because the budget is spent says so (``doctor.skipped``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from preheat.doctor import gpu, node, origin, reads, replica
from preheat.doctor.check import Check, DoctorOptions
from preheat.doctor.findings import Finding, Report

# Kept back from the budget for ranking and printing the report.
RESERVE_S = 0.5


class Budget:
    """Seconds left of the run, on an injectable clock so the budget logic is tested without waiting."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s = total_s
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def remaining(self) -> float:
        return max(0.0, self.total_s - RESERVE_S - self.elapsed())

    def allot(self, bound_s: float) -> float | None:
        """The seconds a check may take now (its bound, cut to what is left), or None when too little is left to
        start it (under a tenth of its bound, and under 0.2 s)."""
        left = self.remaining()
        if left < min(0.2, bound_s * 0.1) or left <= 0.0:
            return None
        return min(bound_s, left)


_HUNG: set[str] = set()  # ids of checks whose thread is still running (this process)
_HUNG_LOCK = threading.Lock()


def run_check(check: Check, options: DoctorOptions, allotted_s: float) -> list[Finding]:
    """Run one check on a daemon thread and give up waiting after ``allotted_s``. The check itself is told 90% of
    it, so one that honours its bound answers in time and the run never waits past what the budget allotted.

    A check that raises becomes a ``doctor.error`` finding naming the check: the doctor reports what it could not
    examine instead of dying, because the rest of the report is still worth having.
    """
    with _HUNG_LOCK:
        if check.id in _HUNG:
            # A thread cannot be killed: a check still stuck since an earlier run (the router and serve run the doctor
            # every minute) is not started again, or a hung mount would gain a thread per run.
            return [
                Finding(
                    "doctor.timeout",
                    check.area,
                    "warn",
                    f"check {check.id} is still running from an earlier run",
                    evidence={"check": check.id, "bound_s": round(allotted_s, 3), "still_running": True},
                    fix="The resource it probes is hanging (a stale NFS mount, an origin that accepts and stalls); "
                    "see docs/operations.md#doctortimeout.",
                )
            ]
        _HUNG.add(check.id)  # until the thread ends; removed at once when it answers in time
    results: queue.Queue[list[Finding] | BaseException] = queue.Queue(maxsize=1)

    def target() -> None:
        try:
            results.put(check.fn(options, allotted_s * 0.9))
        except Exception as exc:  # any failure of one check is reported as that check's finding
            results.put(exc)
        finally:
            with _HUNG_LOCK:
                _HUNG.discard(check.id)

    thread = threading.Thread(target=target, name=f"doctor-{check.id}", daemon=True)
    thread.start()
    try:
        outcome = results.get(timeout=allotted_s)
    except queue.Empty:
        return [
            Finding(
                "doctor.timeout",
                check.area,
                "warn",
                f"check {check.id} did not finish within {allotted_s:.1f} s",
                evidence={"check": check.id, "bound_s": round(allotted_s, 3)},
                fix="The resource it probes is hanging (a stale NFS mount, an origin that accepts and stalls); "
                "see docs/operations.md#doctortimeout.",
            )
        ]
    if isinstance(outcome, BaseException):
        return [
            Finding(
                "doctor.error",
                check.area,
                "warn",
                f"check {check.id} failed: {outcome}",
                evidence={"check": check.id, "error": type(outcome).__name__, "message": str(outcome)},
                fix=None,
            )
        ]
    return outcome


def checks_for(options: DoctorOptions) -> list[Check]:
    """The checks this run needs, shortest bound first: the budget is spent in this order, so when it runs out it
    is the long probes (read speed, bandwidth, CUDA start-up) that are skipped, never the cheap checks."""
    selected = node.checks(options) + reads.checks(options) + replica.checks(options) + origin.checks(options)
    selected += gpu.checks(options) if options.gpu else []
    return sorted(selected, key=lambda check: check.bound_s)


def run_checks(checks: list[Check], options: DoctorOptions, budget: Budget) -> list[Finding]:
    findings: list[Finding] = []
    for check in checks:
        allotted = budget.allot(check.bound_s)
        if allotted is None:
            findings.append(
                Finding(
                    "doctor.skipped",
                    check.area,
                    "info",
                    f"check {check.id} skipped: the {budget.total_s:g} s budget is spent",
                    evidence={"check": check.id, "budget_s": budget.total_s},
                    fix="Raise --budget-s to run every check.",
                )
            )
            continue
        findings.extend(run_check(check, options, allotted))
    return findings


def run_doctor(options: DoctorOptions, *, clock: Callable[[], float] = time.monotonic) -> Report:
    """Check the node (and the replica, timeline, origin and registry when given) and rank the findings.

    >>> report = run_doctor(DoctorOptions(io=False, gpu=False))
    >>> report.to_json()["schema"]
    'preheat.doctor/1'
    """
    budget = Budget(options.budget_s, clock)
    findings = run_checks(checks_for(options), options, budget)
    return Report.build(findings, budget.elapsed())
