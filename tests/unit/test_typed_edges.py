"""No ``Any`` without a reason (issue 27): where a value's shape is known, it has a type that says it: a TypedDict for
a JSON document preheat writes (timeline, doctor, dashboard, simulate's records, the deploy overlay), a Protocol
naming the attributes preheat uses of an engine's object (vLLM, SGLang, LMCache, nixl, boto3). Where ``Any`` stays
(JSON values of many types, argparse's and torch's own signatures, packages without types imported lazily), the line
says why in a ``# Any: ...`` comment. This walks src/preheat and fails on an ``Any`` without one; then checks that each
TypedDict names exactly the keys its writer writes, since mypy cannot see a key added at run time."""

from __future__ import annotations

import dataclasses
import io
import json
import tokenize
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from preheat.core.timeline import Stage, StageRecord, Timeline, TimelineDocument
from preheat.dashboard.prom import Metrics
from preheat.dashboard.state import (
    Bar,
    DecisionRow,
    ReplicaEntry,
    ReplicaRow,
    StateDocument,
    TierState,
    Waterfall,
    decisions,
    document,
    replica_entry,
    tier_states,
)
from preheat.doctor.findings import DoctorDocument, Finding, FindingRecord, Report
from preheat.k8s.render import CopyOp, Kustomization, Patch, PatchOp, kustomization
from preheat.plan.simulate import Policy, PolicyRecord, PolicySettings, SimResult

SRC = Path(__file__).resolve().parents[2] / "src" / "preheat"
REASON = "# Any:"


def bare_any(source: str) -> list[int]:
    """The lines of ``source`` that use ``Any`` (as ``Any`` or ``typing.Any``, outside imports, strings and comments)
    without a ``# Any: why`` comment on the same line."""
    lines = source.splitlines()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found: set[int] = set()
    importing = False
    for i, token in enumerate(tokens):
        starts_statement = i == 0 or tokens[i - 1].type in (
            tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT
        )  # fmt: skip
        if token.type == tokenize.NAME and token.string in ("import", "from") and starts_statement:
            importing = True
        elif token.type == tokenize.NEWLINE:
            importing = False
        elif token.type == tokenize.NAME and token.string == "Any" and not importing:
            row = token.start[0]
            if REASON not in lines[row - 1]:
                found.add(row)
    return sorted(found)


def test_every_any_in_src_says_why() -> None:
    bare = {}
    for path in sorted(SRC.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        rows = bare_any(source)
        if rows:
            lines = source.splitlines()
            bare[path.relative_to(SRC).as_posix()] = [f"{row}: {lines[row - 1].strip()}" for row in rows]
    assert not bare, (
        "Any without a reason: give the value its type (a TypedDict for a JSON shape preheat defines, a Protocol "
        f"naming what preheat uses of a foreign object, object for a value only passed on), or say why on the same "
        f"line with '{REASON} ...': {bare}"
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from typing import Any\nx: Any = 1\n", [2]),
        ("from typing import Any\nx: Any = 1  # Any: a JSON value\n", []),
        ("import typing\ndef f(x: typing.Any) -> None: ...\n", [2]),
        ("from typing import (\n    Any,\n    Protocol,\n)\n", []),  # an import only
        ("def f(\n    x: dict[str, Any],  # Any: JSON\n    y: Any,\n) -> None: ...\n", [3]),  # each line says it
        ("x = 'Any'  # a string\n# Any old comment\n", []),
        ("def f(*args: Any, **kwargs: Any) -> Any: ...  # Any: argparse's own\n", []),
    ],
)
def test_the_walk_finds_every_any_without_its_reason(source: str, expected: list[int]) -> None:
    assert bare_any(source) == expected


# -- each TypedDict is its writer's keys: a key written but not declared (or the reverse) fails here -----------------
def keys(kind: type) -> set[str]:
    return set(kind.__required_keys__) | set(kind.__optional_keys__)  # type: ignore[attr-defined]


def assert_shape(written: Mapping[str, object], kind: type) -> None:
    assert set(written) <= keys(kind), f"{kind.__name__} lacks {sorted(set(written) - keys(kind))}"
    missing = set(kind.__required_keys__) - set(written)  # type: ignore[attr-defined]
    assert not missing, f"{kind.__name__} requires {sorted(missing)}, not written"


def test_timeline_documents_are_their_typed_dicts() -> None:
    timeline = Timeline(origin=100.0)
    timeline.add("fetch", 0.0, 1.0, nbytes=10, cache="miss")
    timeline.mark("ready")
    served = timeline.to_dict()
    assert_shape(served, TimelineDocument)
    for record in served["stages"]:
        assert_shape(record, StageRecord)
    assert keys(StageRecord) == set(Stage("x", 0.0, 1.0, nbytes=1).to_dict())


def test_doctor_documents_are_their_typed_dicts() -> None:
    report = Report.build([Finding("node.thp", "node", "warn", "THP", seconds=1.0, evidence={"mode": "never"})], 0.1)
    written = report.to_json()
    assert_shape(written, DoctorDocument)
    assert_shape(written["findings"][0], FindingRecord)


def test_dashboard_documents_are_their_typed_dicts() -> None:
    timeline = Timeline(origin=0.0)
    timeline.add("load", 0.0, 1.0)
    metrics: Metrics = {"preheat_kv_tier_up": [({"tier": "l1"}, 1.0)]}  # as prom.parse reads a /metrics
    entry = replica_entry(ReplicaRow("http://r:1", True), metrics, timeline.to_dict(), 2.0)
    assert_shape(entry, ReplicaEntry)
    assert entry["waterfall"] is not None
    assert_shape(entry["waterfall"], Waterfall)
    assert_shape(entry["waterfall"]["stages"][0], Bar)
    rows = decisions([({"policy": "kv", "reason": "hit"}, 3.0)])
    assert_shape(rows[0], DecisionRow)
    assert_shape(tier_states([entry])[0], TierState)
    assert_shape(document("router", [entry], now=0.0, status="ok", decision_rows=rows), StateDocument)


def test_simulate_records_are_their_typed_dicts() -> None:
    policy = Policy("warm", min_replicas=1)
    result = SimResult(policy, {"new_node": 30.0}, np.array([0.5, 1.5]), np.ones(2), 60.0, 1.0, 0.5, 2.0, 1.0, 1, 1, 0)
    written = result.to_dict()
    assert_shape(written, PolicyRecord)
    assert_shape(written["settings"], PolicySettings)
    # The switches are vars(Policy) less its name: a field added to Policy must be added to PolicySettings.
    assert keys(PolicySettings) == {f.name for f in dataclasses.fields(Policy)} - {"name"}


def test_the_deploy_overlay_is_its_typed_dicts() -> None:
    values = {"namespace": "llm", "image": {"repository": "r/preheat", "tag": "1"}, "device": "cpu",
              "model": {"uri": "s3://m/x", "extraCached": ["s3://m/y"]}, "replicas": {"min": 1, "max": 4},
              "autoscaler": "hpa", "router": {}, "l2": {"backend": "fs", "size": "10Gi"},
              "resources": {"replica": {"cpu": "4", "memory": "16Gi"}}, "compile": {"enabled": True}}  # fmt: skip
    overlay = kustomization(values, "../kustomize")
    assert_shape(overlay, Kustomization)
    for patch in overlay["patches"]:
        assert_shape(patch, Patch)
        for op in json.loads(patch["patch"]):
            assert_shape(op, CopyOp if op["op"] == "copy" else PatchOp)
