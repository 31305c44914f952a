"""One start of a program that runs in several processes (vLLM: its API server, engine core and workers), recorded by
each process on its own, merged into one timeline whose stages add up to its wall clock.

Pure: records in, a timeline document out (``fetch`` reads them from a directory). A process record
(``ProcessRecord``, written by the process itself: integrations/vllm/startup.py) holds stages in epoch seconds, the
process's pid, parent pid, role and start, the catalogue of stages the program is expected to show, and which of them
this process could observe (``hooks``). ``merge``:

- picks one run: a root process (vLLM's API server) and its descendants by parent pid, the latest root by default
  (a main process started by a recorded one, such as torch's compile workers, is a helper of that run: its stages are
  listed as nested, outside the sum);
- takes the origin: ``t0`` when the platform gave one (``PREHEAT_T0``), else the root's process start;
- lays the top-level stages end to end from the origin to the end (the ``first_token`` mark, else the last thing
  recorded): time that no stage covers becomes a gap stage (named by the catalogue, e.g. ``engine_core_spawn``, else
  ``other``), and a stage that starts before the previous one ended is cut at that end (``detail.overlapped_s``), so
  the top-level durations add up to ``total`` exactly (``sum_of_stages``). Gaps under a millisecond are joined;
- lists nested stages (compile inside KV-cache profiling, CUDA graph capture inside warm-up) with ``detail.within``,
  outside that sum, and marks (``ready``, ``first_token``) as instants;
- lists each catalogued stage nobody observed under ``unknown``, with why: ``unknown`` when it could not be observed
  (no record from its process, a version outside the supported range, a hook target this version lacks, a hook that
  was never called) or ``not_run`` when it was observable and this start skipped it (CUDA graph capture under
  ``--enforce-eager``): never a number.

    document = merge(records)          # records: list of ProcessRecord, e.g. read by fetch.records_in(DIR)
    Waterfall.from_dict(document)      # what `preheat timeline DIR` prints
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from preheat.core.errors import PlanError
from preheat.core.timeline import FORMAT_VERSION, StageRecord, TimelineDocument

RECORD_KIND = "preheat.process-stages"
RECORD_VERSION = 1
END_MARK = "first_token"
GAP = "other"
JOIN_S = 0.001  # gaps shorter than this are joined to the next stage: clock reads, not work


class StageSpec(TypedDict):
    """A stage the program is expected to show: which process roles record it, whether it sits inside a top-level
    stage (``nested``: outside the sum), whether a start may skip it (``optional``: ``not_run`` rather than
    ``unknown``), what the gap right before it is called (``gap_before``, "" for ``other``), and what it covers."""

    name: str
    roles: list[str]
    nested: bool
    optional: bool
    gap_before: str
    help: str


class _ProcessStageRequired(TypedDict):
    name: str
    start: float  # epoch seconds
    end: float  # epoch seconds; equal to start for a mark
    detail: dict[str, Any]  # Any: JSON values chosen by the recording hook


class ProcessStage(_ProcessStageRequired, total=False):
    bytes: int


class ProcessRecord(TypedDict):
    """One process's stages, as the process writes them (``RECORD_KIND``)."""

    kind: str
    version: int
    program: str  # e.g. "vllm 0.32.0"
    pid: int
    ppid: int
    role: str
    command: str  # the process's command line, shortened (which helper a process is)
    root: bool  # the process the start is counted from (vLLM's API server)
    process_start: float  # epoch seconds
    start_resolution: float  # seconds: /proc counts a start in clock ticks, so it may read up to this much early
    t0: float | None  # the platform's clock (PREHEAT_T0), roots only
    hooks: dict[str, str]  # stage -> "installed" or why it cannot be observed here
    catalogue: list[StageSpec]
    stages: list[ProcessStage]


class UnknownStage(TypedDict):
    name: str
    status: str  # "unknown" | "not_run"
    why: str


class ProcessSummary(TypedDict):
    pid: int
    role: str
    start: float  # seconds from the origin


class MergedDocument(TimelineDocument):
    """A ``TimelineDocument`` (what ``preheat timeline`` reads) with what the merge adds."""

    program: str
    sum_of_stages: float
    unknown: list[UnknownStage]
    processes: list[ProcessSummary]


# -- reading records (outside JSON, checked field by field) ----------------------------------------------------------


def is_record(data: object) -> bool:
    return isinstance(data, dict) and data.get("kind") == RECORD_KIND


def parse_record(data: object, *, where: str) -> ProcessRecord:
    """``data`` (parsed JSON) as a ``ProcessRecord``; ``PlanError`` naming ``where`` and the field otherwise."""
    if not is_record(data):
        raise PlanError(f"{where}: not a preheat process record (kind {RECORD_KIND!r})")
    assert isinstance(data, dict)  # is_record checked it; narrows for mypy
    try:
        if int(data["version"]) > RECORD_VERSION:
            raise PlanError(f"{where}: process record version {data['version']} is newer than this preheat reads")
        t0 = data.get("t0")
        record: ProcessRecord = {
            "kind": RECORD_KIND,
            "version": int(data["version"]),
            "program": str(data.get("program", "")),
            "pid": int(data["pid"]),
            "ppid": int(data["ppid"]),
            "role": str(data["role"]),
            "command": str(data.get("command", "")),
            "root": bool(data.get("root", False)),
            "process_start": float(data["process_start"]),
            "start_resolution": float(data.get("start_resolution") or 0.0),
            "t0": None if t0 is None else float(t0),
            "hooks": {str(k): str(v) for k, v in dict(data.get("hooks") or {}).items()},
            "catalogue": [_spec(s) for s in list(data.get("catalogue") or [])],
            "stages": [_stage(s) for s in list(data.get("stages") or [])],
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{where}: malformed process record ({type(exc).__name__}: {exc})") from None
    return record


def _spec(data: object) -> StageSpec:
    if not isinstance(data, dict):
        raise TypeError(f"a catalogue entry is an object, not {type(data).__name__}")
    return {
        "name": str(data["name"]),
        "roles": [str(r) for r in list(data.get("roles") or [])],
        "nested": bool(data.get("nested", False)),
        "optional": bool(data.get("optional", False)),
        "gap_before": str(data.get("gap_before") or ""),
        "help": str(data.get("help") or ""),
    }


def _stage(data: object) -> ProcessStage:
    if not isinstance(data, dict):
        raise TypeError(f"a stage is an object, not {type(data).__name__}")
    stage: ProcessStage = {
        "name": str(data["name"]),
        "start": float(data["start"]),
        "end": float(data["end"]),
        "detail": dict(data.get("detail") or {}),
    }
    if data.get("bytes") is not None:
        stage["bytes"] = int(data["bytes"])
    return stage


# -- the merge -------------------------------------------------------------------------------------------------------


def run_of(records: Sequence[ProcessRecord], *, member: int | None = None) -> list[ProcessRecord]:
    """The records of one run, root first: the run holding pid ``member``, else the latest root's. A process belongs
    to a run when its parent chain reaches the root and each parent started no later than its child (a pid reused by
    a later start is not mistaken for an ancestor). ``PlanError`` when there is no record to merge."""
    if not records:
        raise PlanError("no process records to merge")
    by_pid: dict[int, ProcessRecord] = {}
    for record in sorted(records, key=lambda r: r["process_start"]):
        by_pid[record["pid"]] = record  # a reused pid: the latest start wins

    def root_of(record: ProcessRecord) -> ProcessRecord:
        """The earliest ancestor on record: a main process started by a recorded one (a helper such as torch's
        compile workers, which loads vLLM's plugins too) is a member of that run, not a run of its own."""
        seen = {record["pid"]}
        while True:
            parent = by_pid.get(record["ppid"])
            if parent is None or parent["pid"] in seen or parent["process_start"] > record["process_start"]:
                return record
            seen.add(parent["pid"])
            record = parent

    if member is not None and member in by_pid:
        root = root_of(by_pid[member])
    else:
        tops = [r for r in by_pid.values() if root_of(r) is r]
        root = max([r for r in tops if r["root"]] or tops, key=lambda r: r["process_start"])
    members = [r for r in by_pid.values() if r is not root and root_of(r) is root]
    return [root, *sorted(members, key=lambda r: r["process_start"])]


def merge(records: Sequence[ProcessRecord], *, member: int | None = None) -> MergedDocument:
    """The timeline of one run (``run_of``), laid out as the module docstring says."""
    run = run_of(records, member=member)
    root = run[0]
    origin = root["t0"] if root["t0"] is not None else root["process_start"]
    specs = _catalogue(run)
    observed: list[tuple[ProcessStage, ProcessRecord]] = []
    for record in run:
        observed.extend((stage, record) for stage in record["stages"])

    end_marks = [s["start"] for s, _ in observed if s["name"] == END_MARK]
    ends = [s["end"] for s, _ in observed]
    end = (min(end_marks) if end_marks else max(ends, default=origin)) - origin

    top: list[StageRecord] = []
    nested: list[StageRecord] = []
    marks: list[StageRecord] = []
    late: dict[int, float] = {}  # id(row) -> how much later it may have begun than its start says
    for stage, record in observed:
        row = _row(stage, record, origin)
        spec = specs.get(stage["name"])
        if stage["end"] <= stage["start"]:
            marks.append(row)
        elif record["root"] and record is not root:  # a helper's own start runs beside the start, not in it
            if stage["name"] != "platform":  # the platform's clock is the run's, not the helper's
                row["detail"]["helper"] = record["command"] or True
                nested.append(row)
        elif spec is not None and spec["nested"]:
            nested.append(row)
        else:
            top.append(row)
            if not record["root"] and stage["start"] == record["process_start"]:
                # A child's start read from /proc in whole clock ticks may precede the short stage of its parent
                # that spawned it: it is laid out after a stage beginning within that tick, not before.
                late[id(row)] = record["start_resolution"]

    rows = _lay_out(_join_ranks(top), specs, end, nested, late)
    for row in nested:
        holder = next((r for r in rows if r["start"] <= row["start"] < (r["end"] or r["start"])), None)
        if holder is not None and "within" not in row["detail"]:
            row["detail"]["within"] = holder["name"]
    extra = [r for r in nested + marks if r["start"] <= end]
    stages = sorted(rows + extra, key=lambda r: (r["start"], r["end"] is not None and r["end"] == r["start"]))
    laid = sum((r["end"] or r["start"]) - r["start"] for r in rows)
    return {
        "version": FORMAT_VERSION,
        "origin": origin,
        "origin_source": "PREHEAT_T0" if root["t0"] is not None else "process start",
        "total": end,
        "stages": stages,
        "program": root["program"],
        "sum_of_stages": laid,
        "unknown": _unknown(run, specs, {s["name"] for s, _ in observed}),
        "processes": [{"pid": r["pid"], "role": r["role"], "start": r["process_start"] - origin} for r in run],
    }


def _catalogue(run: Sequence[ProcessRecord]) -> dict[str, StageSpec]:
    """Every catalogued stage by name, in the order the root lists them (then the others' additions)."""
    specs: dict[str, StageSpec] = {}
    for record in run:
        for spec in record["catalogue"]:
            specs.setdefault(spec["name"], spec)
    return specs


def _row(stage: ProcessStage, record: ProcessRecord, origin: float) -> StageRecord:
    detail = {**stage["detail"], "process": record["role"], "pid": record["pid"]}
    row: StageRecord = {
        "name": stage["name"],
        "start": stage["start"] - origin,
        "end": stage["end"] - origin,
        "detail": detail,
    }
    if "bytes" in stage:
        row["bytes"] = stage["bytes"]
    return row


def _join_ranks(top: list[StageRecord]) -> list[StageRecord]:
    """Stages of one name from several processes that overlap (the TP ranks' model builds) become one stage from
    the first start to the last end, the processes listed; the first token waits for the slowest rank."""
    joined: list[StageRecord] = []
    for row in sorted(top, key=lambda r: r["start"]):
        same = next((j for j in joined if j["name"] == row["name"] and row["start"] < (j["end"] or 0.0)), None)
        if same is None:
            joined.append(row)
            continue
        same["end"] = max(same["end"] or 0.0, row["end"] or 0.0)
        pids = same["detail"].setdefault("pids", [same["detail"].get("pid")])
        pids.append(row["detail"].get("pid"))
        if "bytes" in row:
            same["bytes"] = same.get("bytes", 0) + row["bytes"]
    return joined


def _lay_out(
    top: list[StageRecord],
    specs: dict[str, StageSpec],
    end: float,
    nested: list[StageRecord],
    late: dict[int, float],
) -> list[StageRecord]:
    """The top-level stages end to end over [0, end], in the order they began (``late``: how much later than its
    start a stage may have begun), gaps named, overlaps cut (a stage wholly inside the one before it moves to
    ``nested``, marked ``overlapped``)."""
    rows: list[StageRecord] = []
    cursor, previous = 0.0, ""
    for row in sorted(top, key=lambda r: (r["start"] + late.get(id(r), 0.0), r["end"] or 0.0)):
        start, stop = row["start"], min(row["end"] or row["start"], end)
        if start >= end:
            continue
        if stop <= cursor:  # wholly inside what is already laid: shown, not counted twice
            row["detail"]["overlapped"] = True
            nested.append(row)
            continue
        if start < cursor:
            row["detail"]["overlapped_s"] = round(cursor - start, 6)
            start = cursor
        if start - cursor >= JOIN_S:
            spec = specs.get(row["name"])
            rows.append(_gap((spec["gap_before"] if spec else "") or GAP, cursor, start, previous, row["name"]))
        row["start"], row["end"] = cursor if start - cursor < JOIN_S else start, stop
        rows.append(row)
        cursor, previous = stop, row["name"]
    if end - cursor > 0:
        rows.append(_gap(GAP, cursor, end, previous, END_MARK))
    return rows


def _gap(name: str, start: float, end: float, after: str, before: str) -> StageRecord:
    return {"name": name, "start": start, "end": end, "detail": {"gap": True, "after": after, "before": before}}


def _unknown(run: Sequence[ProcessRecord], specs: dict[str, StageSpec], seen: set[str]) -> list[UnknownStage]:
    unknown: list[UnknownStage] = []
    for name, spec in specs.items():
        if name in seen:
            continue
        statuses = [r["hooks"][name] for r in run if name in r["hooks"]]
        if not statuses:
            roles = " or ".join(spec["roles"]) or "its"
            unknown.append({"name": name, "status": "unknown", "why": f"no record from the {roles} process"})
        elif "installed" not in statuses:
            unknown.append({"name": name, "status": "unknown", "why": statuses[0]})
        elif spec["optional"]:
            unknown.append({"name": name, "status": "not_run", "why": "observable, and this start did not run it"})
        else:
            why = "its hook was installed and never called: this version takes another path"
            unknown.append({"name": name, "status": "unknown", "why": why})
    return unknown
