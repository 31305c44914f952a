"""Merging the stage records of a multi-process start (vLLM's API server, engine core, workers) into one timeline:
the stages tile the origin -> first token, gaps are named, overlaps are not counted twice, and what nobody observed is
``unknown`` or ``not_run``, never a number."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from preheat.core.errors import PlanError
from preheat.timeline.merge import RECORD_KIND, ProcessRecord, StageSpec, merge, parse_record, run_of
from preheat.timeline.waterfall import Waterfall, render_text

T = 1_000_000.0  # epoch seconds of the API server's start


def spec(name: str, roles: list[str], **kw: Any) -> StageSpec:  # Any: StageSpec's optional fields
    return {"name": name, "roles": roles, "nested": kw.get("nested", False), "optional": kw.get("optional", False),
            "gap_before": kw.get("gap_before", ""), "help": ""}  # fmt: skip


CATALOGUE = [
    spec("imports", ["api_server"]),
    spec("tokenizer", ["api_server"]),
    spec("engine_core_imports", ["engine_core"], gap_before="engine_core_spawn"),
    spec("model_build", ["engine_core", "worker"]),
    spec("compile", ["engine_core"], nested=True, optional=True),
    spec("cuda_graph_capture", ["engine_core"], nested=True, optional=True),
    spec("kv_cache_profile", ["engine_core"]),
    spec("first_request", ["api_server"], optional=True, gap_before="waiting_for_request"),
]


def record(
    pid: int, ppid: int, role: str, start: float, stages: list[tuple[str, float, float]], **kw: Any
) -> ProcessRecord:
    # Any: the record's other fields, as a test sets them
    return {
        "kind": RECORD_KIND, "version": 1, "program": "vllm 0.32.0", "pid": pid, "ppid": ppid, "role": role,
        "command": "vllm serve", "root": role == "api_server", "process_start": start, "start_resolution": 0.01,
        "t0": kw.get("t0"),
        "hooks": kw.get("hooks", {s["name"]: "installed" for s in CATALOGUE if role in s["roles"]}),
        "catalogue": CATALOGUE,
        "stages": [{"name": n, "start": s, "end": e, "detail": {}} for n, s, e in stages],
    }  # fmt: skip


def a_start(**kw: Any) -> list[ProcessRecord]:  # Any: record()'s keywords for the API server
    api = record(100, 1, "api_server", T, [
        ("imports", T, T + 5.0), ("tokenizer", T + 5.2, T + 5.3),
        ("first_request", T + 20.5, T + 20.6), ("ready", T + 20.0, T + 20.0), ("first_token", T + 20.6, T + 20.6),
    ], **kw)  # fmt: skip
    core = record(101, 100, "engine_core", T + 5.5, [
        ("engine_core_imports", T + 5.5, T + 12.0), ("model_build", T + 12.0, T + 13.0),
        ("compile", T + 13.5, T + 14.0), ("kv_cache_profile", T + 13.0, T + 15.0),
    ])  # fmt: skip
    return [api, core]


def rows(document: Any) -> list[tuple[str, float, float]]:  # Any: the merged JSON
    return [(r["name"], r["start"], r["end"]) for r in document["stages"] if "within" not in r["detail"]
            and r["end"] > r["start"]]  # fmt: skip


def test_stages_tile_the_start_and_gaps_are_named_by_what_follows() -> None:
    merged = merge(a_start())
    laid = rows(merged)
    assert [name for name, _, _ in laid] == [
        "imports", "other", "tokenizer", "engine_core_spawn", "engine_core_imports", "model_build",
        "kv_cache_profile", "waiting_for_request", "first_request",
    ]  # fmt: skip
    assert laid[0][1] == 0.0
    assert all(a[2] == pytest.approx(b[1]) for a, b in itertools.pairwise(laid))
    assert merged["total"] == pytest.approx(20.6) == pytest.approx(merged["sum_of_stages"])
    assert merged["origin"] == T
    assert merged["origin_source"] == "process start"


def test_nested_stages_sit_inside_their_stage_and_outside_the_sum() -> None:
    merged = merge(a_start())
    compile_ = next(r for r in merged["stages"] if r["name"] == "compile")
    assert compile_["detail"]["within"] == "kv_cache_profile"
    assert compile_["detail"]["process"] == "engine_core"


def test_what_nobody_observed_is_unknown_or_not_run_with_the_reason() -> None:
    api, core = a_start()
    core["hooks"]["kv_cache_profile"] = "not observable in this vLLM: vllm.v1.executor.abstract has no Executor"
    core["stages"] = [s for s in core["stages"] if s["name"] != "kv_cache_profile"]
    unknown = {u["name"]: (u["status"], u["why"]) for u in merge([api, core])["unknown"]}
    assert unknown == {
        "kv_cache_profile": ("unknown", "not observable in this vLLM: vllm.v1.executor.abstract has no Executor"),
        "cuda_graph_capture": ("not_run", "observable, and this start did not run it"),
    }
    alone = {u["name"]: u["status"] for u in merge([api])["unknown"]}  # no record from the engine core at all
    assert alone["model_build"] == "unknown"
    assert alone["engine_core_imports"] == "unknown"


def test_a_stage_starting_inside_the_previous_one_is_cut_not_counted_twice() -> None:
    api, core = a_start()
    core["process_start"] = T + 5.25  # /proc's start is in clock ticks: it may precede the stage before it
    core["stages"][0]["start"] = T + 5.25
    merged = merge([api, core])
    imports = next(r for r in merged["stages"] if r["name"] == "engine_core_imports")
    assert imports["start"] == pytest.approx(5.3)
    assert imports["detail"]["overlapped_s"] == pytest.approx(0.05)
    assert merged["sum_of_stages"] == pytest.approx(merged["total"])


def test_a_child_read_from_proc_a_tick_early_still_follows_the_stage_that_spawned_it() -> None:
    api, core = a_start()
    api["stages"][1] = {"name": "tokenizer", "start": T + 5.200, "end": T + 5.207, "detail": {}}
    core["process_start"] = core["stages"][0]["start"] = T + 5.195  # /proc: whole ticks of 10 ms
    laid = [name for name, _, _ in rows(merge([api, core]))]
    assert laid[2:4] == ["tokenizer", "engine_core_imports"]


def test_the_platform_clock_starts_the_timeline_when_given() -> None:
    merged = merge(a_start(t0=T - 2.0))
    assert merged["origin_source"] == "PREHEAT_T0"
    assert merged["total"] == pytest.approx(22.6)
    assert rows(merged)[0] == ("other", 0.0, 2.0)  # no `platform` stage recorded: the gap is still counted


def test_tensor_parallel_ranks_of_one_stage_count_once_until_the_slowest() -> None:
    api, core = a_start()
    rank0 = record(102, 101, "worker", T + 12.0, [("model_build", T + 12.0, T + 13.0)])
    rank1 = record(103, 101, "worker", T + 12.0, [("model_build", T + 12.1, T + 13.4)])
    core["stages"] = [s for s in core["stages"] if s["name"] != "model_build"]
    merged = merge([api, core, rank0, rank1])
    build = next(r for r in merged["stages"] if r["name"] == "model_build")
    assert build["start"] == pytest.approx(12.0)
    assert build["end"] == pytest.approx(13.4)
    assert build["detail"]["pids"] == [102, 103]


def test_the_latest_start_is_merged_and_a_member_picks_its_own() -> None:
    old = a_start()
    new = [record(200, 1, "api_server", T + 100, [("imports", T + 100, T + 104)]),
           record(201, 200, "engine_core", T + 104.5, [("model_build", T + 105, T + 106)])]  # fmt: skip
    everything = old + new
    assert [r["pid"] for r in run_of(everything)] == [200, 201]
    assert [r["pid"] for r in run_of(everything, member=101)] == [100, 101]
    reused = record(101, 200, "engine_core", T + 99, [])  # pid 101 reused, but before its "parent" 200 started
    assert [r["pid"] for r in run_of([*new, reused])] == [200, 201]


def test_a_main_process_started_by_the_start_is_its_helper_not_a_run_of_its_own() -> None:
    api, core = a_start()
    helper = record(104, 100, "frontend", T + 5.25, [("imports", T + 5.25, T + 9.0), ("plugin", T + 9.0, T + 9.5)])
    helper["root"], helper["command"] = True, "python -m some.compile_worker"  # a later "root": the latest start
    merged = merge([api, core, helper])
    assert merged["processes"][0]["pid"] == 100
    helpers = [r for r in merged["stages"] if r["detail"].get("helper")]
    assert [r["name"] for r in helpers] == ["imports", "plugin"]
    assert helpers[0]["detail"]["helper"] == "python -m some.compile_worker"
    assert merged["sum_of_stages"] == pytest.approx(merged["total"]) == pytest.approx(20.6)


def test_the_merged_document_renders_with_its_unknown_stages() -> None:
    api, core = a_start()
    core["hooks"] = {}
    core["stages"] = []
    waterfall = Waterfall.from_dict(merge([api, core]))
    text = render_text(waterfall)
    assert "unknown          model_build: no record from the engine_core or worker process" in text
    assert "model_build" not in {r.name for r in waterfall.rows}  # nothing observed, nothing drawn


def test_a_malformed_record_is_refused_naming_the_file() -> None:
    with pytest.raises(PlanError, match=r"r\.json: malformed process record \(KeyError"):
        parse_record({"kind": RECORD_KIND, "version": 1}, where="r.json")
    with pytest.raises(PlanError, match="not a preheat process record"):
        parse_record({"stages": []}, where="r.json")
    with pytest.raises(PlanError, match="no process records"):
        merge([])
