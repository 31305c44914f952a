"""``preheat doctor`` beyond the node: a throttled origin, peer registries with and without peers, recorded timelines
dominated by each stage, and a real ``preheat serve`` replica (healthy, with KV tiers, then killed)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from peers import write_peer_checkpoint
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.cli.main import main
from preheat.doctor import DoctorOptions, Finding, Report, run_doctor
from preheat.doctor.coldstart import analyze_timeline
from preheat.doctor.kvtiers import analyze_kv, parse_metrics
from preheat.peer.registry import FileRegistry, PeerEntry, RedisRegistry
from preheat.peer.server import PeerServer
from preheat.router.cluster import ServerProcess
from preheat.testing.fileserver import FileServer
from preheat.testing.redisserver import RedisServer
from serving import Client

SCHEMA = json.loads((Path(__file__).parents[3] / "docs" / "doctor.schema.json").read_text(encoding="utf-8"))


def by_id(report: Report) -> dict[str, Finding]:
    return {f.id: f for f in report.findings}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- origin ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    (root / "model.safetensors").write_bytes(bytes(range(256)) * (64 * 1024))  # 16 MiB
    (root / "config.json").write_text("{}", encoding="utf-8")
    return root


def test_a_throttled_origin_is_slow_and_much_faster_in_parallel(model_dir: Path) -> None:
    with FileServer(model_dir, throttle_bps=2_000_000) as server:
        options = DoctorOptions(model=str(model_dir), origin=f"http://127.0.0.1:{server.port}/", gpu=False)
        report = run_doctor(options)
    found = by_id(report)
    assert found["origin.reach"].evidence["url"].endswith("/model.safetensors")
    slow = found["origin.slow"]
    assert slow.severity == "warn"
    # The FileServer caps each connection: several streams get several times one stream's bytes.
    assert slow.evidence["parallel_MBps"] > 2 * slow.evidence["single_stream_MBps"]
    assert slow.seconds is not None
    assert slow.seconds > 0
    assert "preheat pull" in (slow.fix or "")
    jsonschema.validate(report.to_json(), SCHEMA)


def test_an_origin_url_naming_a_file_is_probed_without_a_model(model_dir: Path) -> None:
    with FileServer(model_dir) as server:
        url = f"http://127.0.0.1:{server.port}/config.json"
        found = by_id(run_doctor(DoctorOptions(origin=url, io=False, gpu=False)))
    assert found["origin.reach"].severity == "ok"
    assert found["origin.reach"].evidence["file_bytes"] == 2


def test_an_unreachable_origin_fails_the_run() -> None:
    options = DoctorOptions(origin=f"http://127.0.0.1:{closed_port()}/m/model.safetensors", gpu=False)
    report = run_doctor(options)
    assert by_id(report)["origin.unreachable"].severity == "fail"
    assert report.exit_code == 2


# -- peers -------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_peer_checkpoint(tmp_path_factory.mktemp("peer") / "ckpt")


def test_a_registry_without_peers_warns_that_every_node_downloads(peer_model: Path, tmp_path: Path) -> None:
    options = DoctorOptions(model=str(peer_model), registry=f"file://{tmp_path}/reg", io=False, gpu=False)
    found = by_id(run_doctor(options))
    assert found["peers.registry"].severity == "ok"
    none = found["peers.none"]
    assert none.severity == "warn"
    assert none.evidence["wanted"].startswith("xxh3-128:")


def test_a_registry_with_a_live_peer_finds_it_and_reaches_it(peer_model: Path, tmp_path: Path) -> None:
    manifest = Manifest.from_json((peer_model / MANIFEST_NAME).read_bytes(), where=str(peer_model))
    registry = FileRegistry(str(tmp_path / "reg"))
    with PeerServer(peer_model, manifest) as peer:
        registry.announce(PeerEntry(identity=manifest.identity, address=peer.address), ttl=60)
        registry.announce(PeerEntry(identity=manifest.identity, address=f"127.0.0.1:{closed_port()}", load=5), 60)
        options = DoctorOptions(model=str(peer_model), registry=f"file://{tmp_path}/reg", io=False, gpu=False)
        found = by_id(run_doctor(options))
    available = found["peers.available"]
    assert available.evidence["announcing"] == 2
    assert [p["reachable"] for p in available.evidence["peers"]] == [True, False]  # least loaded first


def test_peers_that_announce_but_do_not_answer_are_a_warning(tmp_path: Path) -> None:
    registry = FileRegistry(str(tmp_path / "reg"))
    registry.announce(PeerEntry(identity="xxh3-128:" + "0" * 32, address=f"127.0.0.1:{closed_port()}",
                                name="llama"), ttl=60)
    options = DoctorOptions(name="llama", registry=f"file://{tmp_path}/reg", io=False, gpu=False)
    assert by_id(run_doctor(options))["peers.unreachable"].severity == "warn"


def test_a_redis_registry_answers_and_a_dead_one_fails(redis_server: RedisServer, own_redis: RedisServer) -> None:
    RedisRegistry(redis_server.url).announce(
        PeerEntry(identity="xxh3-128:" + "1" * 32, address=f"127.0.0.1:{closed_port()}", name="m"), ttl=60)
    found = by_id(run_doctor(DoctorOptions(name="m", registry=redis_server.url, io=False, gpu=False)))
    assert found["peers.registry"].severity == "ok"
    assert found["peers.unreachable"].evidence["announcing"] == 1
    own_redis.stop()
    report = run_doctor(DoctorOptions(name="m", registry=own_redis.url, io=False, gpu=False))
    assert by_id(report)["peers.registry_down"].severity == "fail"
    assert report.exit_code == 2


# -- timelines ---------------------------------------------------------------------------------------------------------
def timeline(stages: list[tuple[str, float, dict[str, Any]]], *, ready: bool = True, nbytes: int = 0) -> dict[str, Any]:
    """Stages back to back from 0 (name, seconds, detail); weight_load moves ``nbytes``."""
    records, at = [], 0.0
    for name, seconds, detail in stages:
        record: dict[str, Any] = {"name": name, "start": at, "end": at + seconds, "detail": detail}
        if name == "weight_load" and nbytes:
            record["bytes"] = nbytes
        records.append(record)
        at += seconds
    if ready:
        records.append({"name": "ready", "start": at, "end": at, "detail": {}})
    return {"version": 1, "origin": 1767225600.0, "origin_source": "PREHEAT_T0", "total": at, "stages": records}


BASE: list[tuple[str, float, dict[str, Any]]] = [
    ("platform", 1.0, {}), ("imports", 1.0, {}), ("fetch", 1.0, {}), ("weight_load", 1.0, {}),
    ("compile", 1.0, {}), ("tokenizer", 0.5, {}),
]


def dominated_by(stage: str, seconds: float = 40.0, detail: dict[str, Any] | None = None) -> list[Any]:
    return [(name, seconds, detail or {}) if name == stage else (name, s, d) for name, s, d in BASE]


@pytest.mark.parametrize(("stage", "group", "pattern", "nbytes", "detail"), [
    ("platform", "image", "standby replicas", 0, None),
    ("imports", "start", "standby replicas", 0, None),
    ("fetch", "download", "node cache and peers", 0, None),
    ("weight_load", "load", "node cache on local NVMe", 4_000_000_000, None),  # 0.1 GB/s: storage-bound
    ("weight_load", "load", "pre-sharded checkpoint", 400_000_000_000, {"world_size": 4}),
    ("weight_load", "load", "quantized checkpoint", 400_000_000_000, None),  # 10 GB/s: bound by the bytes
    ("compile", "compile", "compiled artifacts", 0, None),
])
def test_the_dominant_stage_is_named_with_the_pattern_that_removes_it(
    tmp_path: Path, stage: str, group: str, pattern: str, *, nbytes: int, detail: dict[str, Any] | None
) -> None:
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(timeline(dominated_by(stage, detail=detail), nbytes=nbytes)), encoding="utf-8")
    report = run_doctor(DoctorOptions(timeline=str(path), gpu_cost_per_hour=36.0, io=False, gpu=False))
    top = next(f for f in report.findings if f.area == "timeline")
    assert (top.id, top.severity) == (f"timeline.{group}", "warn")
    assert top.seconds == pytest.approx(40.0)
    assert top.evidence["pattern"] == pattern
    assert top.evidence["usd_per_start"] == pytest.approx(0.4)  # 40 s at $36/h
    assert by_id(report)["timeline.ready"].severity == "ok"
    jsonschema.validate(report.to_json(), SCHEMA)


def test_overlapped_stages_cost_only_their_critical_path() -> None:
    data = timeline([("engine_imports", 10.0, {})])
    data["stages"].insert(0, {"name": "fetch", "start": 0.0, "end": 8.0, "detail": {}})  # hidden behind imports
    groups = {f.id: f.seconds for f in analyze_timeline(data, where="t")}
    assert groups["timeline.start"] == pytest.approx(10.0)
    assert "timeline.download" not in groups


def test_a_short_balanced_start_has_no_warning() -> None:
    findings = analyze_timeline(timeline(BASE), where="t")
    assert all(f.severity in ("info", "ok") for f in findings)


def test_a_failed_start_fails_and_a_bad_file_is_reported(tmp_path: Path) -> None:
    data = timeline(BASE, ready=False)
    data["stages"].append({"name": "failed", "start": 5.5, "end": 5.5, "detail": {"error": "CUDA OOM"}})
    assert by_id(Report.build(analyze_timeline(data, where="t"), 0))["timeline.failed"].evidence["error"] == "CUDA OOM"
    bad = tmp_path / "bad.json"
    bad.write_text('{"stages": 3}', encoding="utf-8")
    report = run_doctor(DoctorOptions(timeline=str(bad), io=False, gpu=False))
    assert by_id(report)["timeline.invalid"].severity == "fail"
    assert report.exit_code == 2


def test_cli_takes_a_timeline_file_and_prices_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "start.json"
    path.write_text(json.dumps(timeline(dominated_by("fetch"))), encoding="utf-8")
    code = main(["doctor", str(path), "--json", "--no-io", "--gpu-cost-per-hour", "36"])
    document = json.loads(capsys.readouterr().out)
    assert code == document["exit_code"] >= 1
    assert any(f["id"] == "timeline.download" and f["evidence"]["usd_per_start"] for f in document["findings"])


# -- KV tiers ----------------------------------------------------------------------------------------------------------
def metrics(l1: tuple[int, int], l2: tuple[int, int] | None, *, l2_bytes: float = 0, l2_seconds: float = 0) -> str:
    lines = ["# TYPE preheat_kv_hits_total counter", f'preheat_kv_hits_total{{tier="l1"}} {l1[0]}',
             f'preheat_kv_misses_total{{tier="l1"}} {l1[1]}', "preheat_prompt_tokens_total 10000",
             "preheat_prompt_tokens_cached_total 1000"]
    if l2 is not None:
        lines += [f'preheat_kv_hits_total{{tier="l2"}} {l2[0]}', f'preheat_kv_misses_total{{tier="l2"}} {l2[1]}',
                  f'preheat_kv_bytes_read_total{{tier="l2"}} {l2_bytes}',
                  f'preheat_kv_read_seconds_total{{tier="l2"}} {l2_seconds}', 'preheat_kv_tier_up{tier="l2"} 1']
    return "\n".join(lines) + "\n"


def test_an_l2_that_answers_almost_nothing_is_not_worth_it() -> None:
    found = {f.id: f for f in analyze_kv(parse_metrics(metrics((50, 50), (1, 99), l2_bytes=1e9, l2_seconds=0.1)),
                                          where="m")}
    assert found["kv.hit_rates"].evidence["hit_rates"] == {"l1": 0.5, "l2": 0.01}
    assert found["kv.l2_idle"].severity == "warn"


def test_an_l2_slower_than_recomputing_is_a_warning_and_a_busy_fast_one_is_worth_it() -> None:
    slow_l2 = parse_metrics(metrics((50, 50), (40, 60), l2_bytes=1e8, l2_seconds=1.0))  # 0.1 GB/s
    fast_l2 = parse_metrics(metrics((50, 50), (40, 60), l2_bytes=1e10, l2_seconds=1.0))  # 10 GB/s
    slow = {f.id for f in analyze_kv(slow_l2, where="m")}
    fast = {f.id for f in analyze_kv(fast_l2, where="m")}
    assert "kv.l2_slow" in slow
    assert "kv.l2_worth" in fast


# -- a real replica ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_replica_is_examined_then_reported_gone_when_killed(kv_model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "kv"
    shared.mkdir()
    with ServerProcess(str(kv_model), "--kv-l1", "64MiB", "--kv-l2", f"fs://{shared}") as replica:
        replica.wait_ready()
        client = Client(replica.url)
        for _ in range(2):
            reply = client.post("/v1/completions", {"prompt": "alpha beta " * 200, "max_tokens": 2, "temperature": 0})
            assert reply.status == 200
        report = run_doctor(DoctorOptions(url=replica.url, gpu_cost_per_hour=4.0, io=False, gpu=False))
        found = by_id(report)
        jsonschema.validate(report.to_json(), SCHEMA)
        assert found["replica.healthy"].severity == "ok"
        assert found["timeline.ready"].evidence["ready_s"] > 0
        timeline_groups = [f for f in report.findings if f.area == "timeline" and f.seconds]
        assert timeline_groups
        assert timeline_groups[0].evidence["dominant"] is True
        rates = found["kv.hit_rates"].evidence["hit_rates"]
        assert set(rates) == {"l1", "l2"}
        assert rates["l1"] > 0
        replica.stop()
        gone = run_doctor(DoctorOptions(url=replica.url, io=False, gpu=False))
    assert by_id(gone)["replica.unreachable"].severity == "fail"
    assert gone.exit_code == 2
