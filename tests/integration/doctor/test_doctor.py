"""``preheat doctor``: the report's shape and ranking, the time budget, and the node checks against real conditions
(a tmpfs and an overlay mounted here, a real model directory, this process's limits)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from preheat.cli.main import main
from preheat.doctor import DoctorOptions, Finding, Report, run_doctor
from preheat.doctor.check import Check
from preheat.doctor.findings import rank
from preheat.doctor.node import bracketed, classify_fs
from preheat.doctor.run import RESERVE_S, Budget, checks_for, run_check, run_checks

DOCS = Path(__file__).resolve().parents[3] / "docs"
SCHEMA = json.loads((DOCS / "doctor.schema.json").read_text(encoding="utf-8"))


def by_id(report: Report) -> dict[str, Finding]:
    return {f.id: f for f in report.findings}


def write_model(root: Path, nbytes: int = 8 * 1024 * 1024) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(os.urandom(nbytes))
    (root / "config.json").write_text("{}", encoding="utf-8")
    return root


# -- the report --------------------------------------------------------------------------------------------------------
def test_findings_are_ranked_by_seconds_then_severity() -> None:
    found = rank([
        Finding("a.ok", "node", "ok", "fast", seconds=1.0),
        Finding("b.warn", "node", "warn", "no price"),
        Finding("c.info", "node", "info", "slow", seconds=30.0),
        Finding("d.fail", "node", "fail", "no price, failed"),
        Finding("e.warn", "node", "warn", "same seconds, worse", seconds=1.0),
    ])
    assert [f.id for f in found] == ["c.info", "e.warn", "a.ok", "d.fail", "b.warn"]


@pytest.mark.parametrize(("severities", "status", "code"), [
    ([], "ok", 0), (["ok", "info"], "ok", 0), (["ok", "warn", "info"], "warn", 1), (["warn", "fail"], "fail", 2),
])
def test_status_and_exit_code_follow_the_worst_finding(severities: list[str], status: str, code: int) -> None:
    report = Report.build([Finding(f"x.f{i}", "node", s, "t") for i, s in enumerate(severities)], 0.1)  # type: ignore[arg-type]
    assert (report.status, report.exit_code) == (status, code)
    assert report.to_json()["exit_code"] == code


def test_the_json_of_a_real_run_validates_against_the_documented_schema(tmp_path: Path) -> None:
    document = run_doctor(DoctorOptions(model=str(write_model(tmp_path / "m")), gpu=False)).to_json()
    jsonschema.validate(document, SCHEMA)
    assert document["schema"] == "preheat.doctor/1"
    ids = {f["id"] for f in document["findings"]}
    assert {"node.disk_space", "node.page_cache", "node.thp", "node.memlock", "node.cpu_threads"} <= ids
    assert ids & {"node.read_speed", "node.read_slow"}
    json.dumps(document)  # plain JSON all the way down


def test_the_schema_rejects_a_finding_without_its_fields() -> None:
    bad = {"schema": "preheat.doctor/1", "status": "ok", "exit_code": 0, "elapsed_s": 0.1,
           "findings": [{"id": "node.x", "area": "node", "severity": "ok", "title": "t"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_every_finding_id_the_code_can_emit_is_explained_in_docs_operations() -> None:
    from preheat.doctor.coldstart import GROUP_OF

    source = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS.parent / "src" / "preheat" / "doctor").glob("*.py"))
    ids = set(re.findall(r'Finding\(\s*"([a-z0-9_]+\.[a-z0-9_]+)"', source))
    ids |= set(re.findall(r'_no_cuda\("([a-z0-9_.]+)"', source))
    ids |= {f"timeline.{group}" for group in [*GROUP_OF.values(), "other"]}
    assert len(ids) > 40  # the scan finds them at all
    operations = (DOCS / "operations.md").read_text(encoding="utf-8")
    missing = sorted(i for i in ids if f"`{i}`" not in operations)
    assert not missing, f"docs/operations.md does not explain {missing}"


# -- the budget --------------------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_cuts_a_check_to_what_is_left_and_skips_when_spent() -> None:
    clock = FakeClock()
    budget = Budget(10.0, clock)
    assert budget.allot(3.0) == 3.0
    clock.now = 7.0
    assert budget.allot(8.0) == pytest.approx(10.0 - RESERVE_S - 7.0)
    clock.now = 9.45
    assert budget.allot(8.0) is None


def test_even_if_every_check_uses_its_whole_bound_the_run_stays_within_budget(tmp_path: Path) -> None:
    clock = FakeClock()
    options = DoctorOptions(model=str(tmp_path), url="http://127.0.0.1:9", timeline=str(tmp_path / "t.json"),
                            origin="http://127.0.0.1:9/m/", registry=f"file://{tmp_path}/reg")
    checks = checks_for(options)
    assert checks
    assert all(0 < c.bound_s <= 10 for c in checks)

    def spend_all(options: DoctorOptions, bound_s: float) -> list[Finding]:
        clock.now += bound_s / 0.9  # the whole allotment: the check is told 90% of it
        return []

    worst = [Check(c.id, c.area, c.bound_s, spend_all) for c in checks]
    budget = Budget(options.budget_s, clock)
    findings = run_checks(worst, options, budget)
    assert clock.now <= options.budget_s
    assert options.budget_s == 30.0
    skipped = [f.evidence["check"] for f in findings if f.id == "doctor.skipped"]
    assert skipped, "the default run has more bounded work than 30 s: the longest probes are skipped"
    assert skipped[-1] == checks[-1].id  # longest-bound checks are the ones skipped
    assert checks[0].bound_s <= checks[-1].bound_s


def test_a_check_that_hangs_costs_its_bound_and_becomes_a_timeout_finding() -> None:
    release = threading.Event()

    def hang(options: DoctorOptions, bound_s: float) -> list[Finding]:
        release.wait(30)
        return []

    try:
        found = run_check(Check("node.hangs", "node", 0.3, hang), DoctorOptions(), 0.3)
    finally:
        release.set()
    assert [(f.id, f.severity, f.evidence["check"]) for f in found] == [("doctor.timeout", "warn", "node.hangs")]


def test_a_check_still_hung_from_an_earlier_run_is_not_started_again() -> None:
    release, started = threading.Event(), []

    def hang(options: DoctorOptions, bound_s: float) -> list[Finding]:
        started.append(threading.current_thread().name)
        release.wait(30)
        return []

    check = Check("node.stuck", "node", 0.2, hang)
    try:
        run_check(check, DoctorOptions(), 0.2)
        [again] = run_check(check, DoctorOptions(), 0.2)  # the router's next minute: the first thread still hangs
        assert again.id == "doctor.timeout"
        assert again.evidence["still_running"] is True
        assert len(started) == 1
    finally:
        release.set()
    for _ in range(100):  # once the stuck thread ends, the check runs again
        found = run_check(check, DoctorOptions(), 0.2)
        if not any(f.evidence.get("still_running") for f in found):
            break
        time.sleep(0.05)
    assert len(started) == 2


def test_a_check_that_raises_is_reported_not_fatal() -> None:
    def broken(options: DoctorOptions, bound_s: float) -> list[Finding]:
        raise OSError("disk on fire")

    [found] = run_check(Check("node.broken", "node", 1.0, broken), DoctorOptions(), 1.0)
    assert found.id == "doctor.error"
    assert "disk on fire" in found.title


# -- node checks -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fstype", "kind"), [
    ("ext4", "local"), ("xfs", "local"), ("nfs4", "network"), ("lustre", "network"), ("fuse.s3fs", "network"),
    ("overlay", "overlay"), ("tmpfs", "memory"), ("", "unknown"),
])
def test_filesystems_are_classified_by_what_they_cost(fstype: str, kind: str) -> None:
    assert classify_fs(fstype) == kind


def test_sysfs_choices_read_the_selected_value() -> None:
    assert bracketed("always [madvise] never\n") == "madvise"
    assert bracketed("[never]") == "never"


def _mount(args: list[str]) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True, check=False).returncode == 0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "tmpfs"
    target.mkdir()
    if not _mount(["-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)]):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield target
    subprocess.run(["umount", str(target)], check=False)


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[Path]:
    for name in ("lower", "upper", "work", "merged"):
        (tmp_path / name).mkdir()
    options = f"lowerdir={tmp_path}/lower,upperdir={tmp_path}/upper,workdir={tmp_path}/work"
    if not _mount(["-t", "overlay", "overlay", "-o", options, str(tmp_path / "merged")]):
        pytest.skip("cannot mount an overlay here (needs root)")
    yield tmp_path / "merged"
    subprocess.run(["umount", str(tmp_path / "merged")], check=False)


def test_a_model_on_tmpfs_is_in_memory_and_the_cold_probe_uses_what_it_supports(tmpfs: Path) -> None:
    model = write_model(tmpfs / "m", 4 * 1024 * 1024)
    found = by_id(run_doctor(DoctorOptions(model=str(model), cache_dir=str(tmpfs / "cache"), gpu=False)))
    assert found["node.fs_memory"].evidence["fstype"] == "tmpfs"
    direct = found["node.o_direct"]
    # tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: the probe asks the kernel, not a table.
    assert direct.severity == ("ok" if direct.evidence["supported"] else "info")
    speed = found.get("node.read_speed") or found["node.read_slow"]
    assert speed.evidence["cold_method"] == ("O_DIRECT" if direct.evidence["supported"] else "fadvise(DONTNEED)")
    assert speed.evidence["probed_bytes"] == speed.evidence["model_bytes"]  # all of it: under probe_bytes


def test_a_cache_on_the_containers_overlay_is_a_warning(overlay: Path) -> None:
    report = run_doctor(DoctorOptions(cache_dir=str(overlay / "cache"), io=False, gpu=False))
    overlay_finding = by_id(report)["node.fs_overlay"]
    assert overlay_finding.severity == "warn"
    assert overlay_finding.evidence["fstype"] == "overlay"
    assert "hostPath" in (overlay_finding.fix or "")
    assert report.exit_code >= 1


def test_a_full_tmpfs_cannot_cache_the_model(tmpfs: Path, tmp_path: Path) -> None:
    model = write_model(tmp_path / "big", 80 * 1024 * 1024)  # larger than the 64 MiB tmpfs
    report = run_doctor(DoctorOptions(model=str(model), cache_dir=str(tmpfs), io=False, gpu=False))
    space = by_id(report)["node.disk_space"]
    assert space.severity == "fail"
    assert space.evidence["model_bytes"] >= 80 * 1024 * 1024
    assert report.exit_code == 2


def test_read_speed_is_measured_cold_and_warm_within_the_probe_bytes(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", 12 * 1024 * 1024)
    options = DoctorOptions(model=str(model), probe_bytes=4 * 1024 * 1024, gpu=False)
    found = by_id(run_doctor(options))
    speed = found.get("node.read_speed") or found["node.read_slow"]
    assert speed.evidence["probed_bytes"] == 4 * 1024 * 1024  # bounded by probe_bytes, not the model's 12 MiB
    assert speed.evidence["cold_gbps"] > 0
    assert speed.evidence["warm_gbps"] > 0
    assert speed.seconds is not None
    assert speed.seconds > 0


def test_no_io_runs_no_read_probe(tmp_path: Path) -> None:
    found = by_id(run_doctor(DoctorOptions(model=str(write_model(tmp_path / "m")), io=False, gpu=False)))
    assert "node.read_speed" not in found
    assert "node.read_slow" not in found


def test_a_missing_model_fails(tmp_path: Path) -> None:
    report = run_doctor(DoctorOptions(model=str(tmp_path / "nope"), io=False, gpu=False))
    assert by_id(report)["node.model_missing"].severity == "fail"
    assert report.exit_code == 2


def test_the_locked_memory_limit_of_the_process_is_read() -> None:
    script = ("import json, resource; resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536)); "
              "from preheat.doctor import DoctorOptions, run_doctor; "
              "r = run_doctor(DoctorOptions(io=False, gpu=False)); "
              "print(json.dumps([f.to_json() for f in r.findings if f.id == 'node.memlock']))")
    [finding] = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                          check=True).stdout)
    assert finding["severity"] == "warn"
    assert finding["evidence"]["soft_bytes"] == 65536


def test_too_many_threads_on_a_local_disk_is_a_warning(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    found = by_id(run_doctor(DoctorOptions(model=str(write_model(tmp_path / "m")), threads=cpus * 4 + 1, io=False,
                                           gpu=False)))
    assert found["node.cpu_threads"].severity == "warn"
    assert found["node.cpu_threads"].evidence["threads"] == cpus * 4 + 1


@pytest.mark.gpu
def test_on_cuda_the_gpu_is_described_and_host_to_device_bandwidth_measured(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = write_model(tmp_path / "m", 64 * 1024 * 1024)
    report = run_doctor(DoctorOptions(model=str(model), probe_bytes=64 * 1024 * 1024))
    found = by_id(report)
    cuda = found["gpu.cuda"]
    assert cuda.evidence["count"] == torch.cuda.device_count()
    assert cuda.evidence["devices"][0]["memory_bytes"] > 0
    h2d = found.get("gpu.h2d") or found["gpu.h2d_slow"]
    assert h2d.evidence["gbps"] > 0
    assert h2d.evidence["copies"] >= 1
    assert {"gpu.nixl"} <= set(found)
    assert found.keys() & {"gpu.gds", "gpu.gds_compat"}
    jsonschema.validate(report.to_json(), SCHEMA)


def test_without_cuda_the_gpu_checks_say_so_as_info() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/unit/io/test_gpu.py covers it")
    report = run_doctor(DoctorOptions(io=True))
    gpu = [f for f in report.findings if f.area == "gpu"]
    assert {f.id for f in gpu} >= {"gpu.none", "gpu.h2d", "gpu.gds", "gpu.nixl"}
    assert all(f.severity == "info" for f in gpu)


# -- the command -------------------------------------------------------------------------------------------------------
def test_cli_json_output_and_exit_code_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", str(write_model(tmp_path / "m")), "--json", "--no-io", "--budget-s", "20"])
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, SCHEMA)
    assert code == document["exit_code"]


def test_cli_exits_2_on_a_failure_and_prints_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", str(tmp_path / "missing"), "--no-io"])
    out = capsys.readouterr().out
    assert code == 2
    assert "node.model_missing" in out
    assert "preheat pull" in out


def test_cli_prints_paths_with_brackets_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per cell: the path is not wrapped
    missing = tmp_path / "[/models]" / "[bold]m"  # the table is rich markup: these must not be read as its tags
    code = main(["doctor", str(missing), "--no-io"])
    out = capsys.readouterr().out
    assert code == 2
    assert "[/models]" in out
    assert "[bold]m" in out


def test_cli_is_compact_by_default_and_prints_every_check_with_v(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(write_model(tmp_path / "m"))
    main(["doctor", model, "--no-io", "--json"])
    document = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("COLUMNS", "80")
    main(["doctor", model, "--no-io"])
    compact = capsys.readouterr().out.splitlines()
    assert len(compact) <= 25, "\n".join(compact)  # it was ~75 lines: a table row per check, ok ones included
    assert all(len(line) <= 80 for line in compact)
    assert compact[0].startswith(f"preheat doctor: {document['status']}, {len(document['findings'])} checks in ")
    for finding in document["findings"]:
        if finding["severity"] in ("fail", "warn"):  # every problem, with its fix
            assert any(f"({finding['id']})" in line for line in compact), finding["id"]
    for area in {finding["area"] for finding in document["findings"]}:  # one line per area, with its counts
        assert sum(line.startswith(f"{area} ") for line in compact) == 1, area
    assert "preheat doctor -v" in compact[-1]
    main(["doctor", model, "--no-io", "-v"])
    every = capsys.readouterr().out
    assert len(every.splitlines()) > len(compact)
    monkeypatch.setenv("COLUMNS", "400")  # one line per cell: each id whole
    main(["doctor", model, "--no-io", "--verbose"])
    every = capsys.readouterr().out
    assert all(f"({finding['id']})" in every for finding in document["findings"])


@pytest.mark.parametrize("budget", ["0", "-3", "nan"])
def test_cli_refuses_a_budget_too_short_to_examine_anything(budget: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # a gate must not pass ("ok", 0) on a run that checked nothing
        main(["doctor", "/nonexistent/model", "--budget-s", budget])
    assert exited.value.code == 2
    assert "--budget-s" in capsys.readouterr().err



def _resident_pages(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache: mincore(2) over a private mapping nothing has touched."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with path.open("rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        anchor = ctypes.c_char.from_buffer(mapped)  # the mapping's address; copy-on-write, so nothing is written
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        del anchor
    assert failed == 0, os.strerror(ctypes.get_errno())
    return [bool(page & 1) for page in vector]


def test_the_page_cache_probe_evicts_only_the_bytes_it_reads(tmp_path: Path) -> None:
    """Without O_DIRECT the cold probe evicts its own ranges first; the rest of a live node's model stays warm."""
    from preheat.doctor.reads import drop_page_range

    model = tmp_path / "weights.bin"
    with model.open("wb") as file:
        file.write(os.urandom(8 * 1024 * 1024))
        file.flush()
        os.fsync(file.fileno())  # clean pages: only those can be evicted
    model.read_bytes()  # every page cached
    if not all(_resident_pages(model)):
        pytest.skip("this filesystem does not keep the file in the page cache")
    drop_page_range(str(model), 0, 4 * 1024 * 1024)
    resident = _resident_pages(model)
    half = len(resident) // 2
    assert all(resident[half:])  # the bytes the probe does not read stay warm
    assert not all(resident[:half])  # the probed range was given back (clean pages)
