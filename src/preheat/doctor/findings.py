"""The doctor's verdicts as values: ``Finding``, the ranked ``Report``, its JSON (``preheat.doctor/1``) and exit code.

Pure: checks elsewhere build findings; this module only orders and serialises them. The JSON shape is stable and
documented in docs/doctor.schema.json (the tests validate against it); add keys, never rename or retype them.

    report = Report.build([Finding("node.thp", "node", "info", "THP is madvise", evidence={"mode": "madvise"})], 0.4)
    report.exit_code  # 0 ok, 1 warnings, 2 failures
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

SCHEMA = "preheat.doctor/1"

Area = Literal["node", "gpu", "origin", "peers", "replica", "timeline", "kv"]
Severity = Literal["ok", "info", "warn", "fail"]
Status = Literal["ok", "warn", "fail"]

AREAS: tuple[str, ...] = ("node", "gpu", "origin", "peers", "replica", "timeline", "kv")
SEVERITIES: tuple[str, ...] = ("ok", "info", "warn", "fail")
_RANK = {"fail": 3, "warn": 2, "info": 1, "ok": 0}


class FindingRecord(TypedDict):
    """One finding in the ``preheat.doctor/1`` document, as ``Finding.to_json`` writes it."""

    id: str
    area: Area
    severity: Severity
    title: str
    seconds: float | None
    evidence: dict[str, Any]  # Any: JSON values chosen by each check
    fix: str | None


class DoctorDocument(TypedDict):
    """The ``preheat.doctor/1`` document (docs/doctor.schema.json), as ``Report.to_json`` writes it."""

    schema: str
    status: Status
    exit_code: int
    elapsed_s: float
    findings: list[FindingRecord]


@dataclass(frozen=True)
class Finding:
    """One check's verdict.

    ``seconds`` is what the condition costs per cold start (None when it cannot be priced in time, e.g. a locked
    memory limit); ``evidence`` holds the measured values (JSON scalars, lists or objects); ``fix`` says what to do,
    None when there is nothing to do.
    """

    id: str
    area: Area
    severity: Severity
    title: str
    seconds: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)  # Any: JSON values chosen by each check
    fix: str | None = None

    def to_json(self) -> FindingRecord:
        return {
            "id": self.id,
            "area": self.area,
            "severity": self.severity,
            "title": self.title,
            "seconds": None if self.seconds is None else round(float(self.seconds), 3),
            "evidence": self.evidence,
            "fix": self.fix,
        }


def rank(findings: Iterable[Finding]) -> list[Finding]:
    """Most seconds first (unpriced after priced), then the worse severity, then the id for a stable order."""
    return sorted(
        findings,
        key=lambda f: (f.seconds is None, -(f.seconds or 0.0), -_RANK[f.severity], f.id),
    )


def status_of(findings: Iterable[Finding]) -> Status:
    """``fail`` if any finding failed, else ``warn`` if any warned, else ``ok`` (info counts as ok)."""
    worst = max((_RANK[f.severity] for f in findings), default=0)
    return "fail" if worst >= _RANK["fail"] else "warn" if worst >= _RANK["warn"] else "ok"


EXIT_CODES: dict[Status, int] = {"ok": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class Report:
    """Findings ranked by the seconds they cost, with the overall status and the process exit code."""

    findings: list[Finding]
    elapsed_s: float
    status: Status = "ok"

    @classmethod
    def build(cls, findings: Iterable[Finding], elapsed_s: float) -> Report:
        ranked = rank(findings)
        return cls(ranked, elapsed_s, status_of(ranked))

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_json(self) -> DoctorDocument:
        """The stable ``preheat.doctor/1`` document (docs/doctor.schema.json)."""
        return {
            "schema": SCHEMA,
            "status": self.status,
            "exit_code": self.exit_code,
            "elapsed_s": round(self.elapsed_s, 3),
            "findings": [f.to_json() for f in self.findings],
        }
