"""The cold-start timeline: recording (``preheat.core.timeline``), and reading it back with ``preheat timeline``
(waterfall table, idle accelerator cost, HTML/PNG plots), from a saved file or from a server."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hostile import DEEP_JSON, ScriptedServer, always
from preheat.cli.main import main
from preheat.core.errors import ConfigError
from preheat.core.timeline import Stage, Timeline
from preheat.server.app import record_imports
from preheat.timeline.waterfall import Waterfall, render_text

# A cold start as a server records it (seconds from process start); ready at 3.6 s.
SAMPLE = {
    "version": 1,
    "origin": 1767225600.0,
    "origin_source": "process start",
    "total": 4.0,
    "stages": [
        {"name": "imports", "start": 0.0, "end": 0.3, "detail": {}},
        {"name": "config", "start": 0.3, "end": 0.31, "detail": {}},
        {"name": "fetch", "start": 0.31, "end": 1.31, "bytes": 2_000_000_000, "detail": {"cache": "miss"}},
        {"name": "engine_imports", "start": 1.31, "end": 2.31, "detail": {}},
        {"name": "weight_load", "start": 2.31, "end": 2.81, "bytes": 1_000_000_000, "detail": {"mode": "mmap"}},
        {"name": "model_build", "start": 2.81, "end": 2.9, "detail": {}},
        {"name": "tokenizer", "start": 2.9, "end": 3.0, "detail": {}},
        {"name": "warmup", "start": 3.0, "end": 3.6, "detail": {}},
        {"name": "ready", "start": 3.6, "end": 3.6, "detail": {}},
        {"name": "first_request_ttft", "start": 4.0, "end": 4.0, "detail": {"ttft": 0.05}},
    ],
}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(SAMPLE), encoding="utf-8")
    return path


# -- recording -------------------------------------------------------------------------------------------------------
def test_stages_are_relative_to_the_origin_and_ordered() -> None:
    timeline = Timeline(origin=100.0)
    timeline.add("b", 2.0, 3.0)
    timeline.add("a", 1.0, 2.0, nbytes=10, cache="hit")
    timeline.add("c", 3.0, 3.0)
    data = timeline.to_dict()
    assert [s["name"] for s in data["stages"]] == ["a", "b", "c"]
    assert data["stages"][0] == {"name": "a", "start": 1.0, "end": 2.0, "bytes": 10, "detail": {"cache": "hit"}}
    assert data["total"] == 3.0


def test_served_json_keeps_its_keys_and_their_order() -> None:
    """Dashboards and saved files read this JSON: a stage is ``name, start, end, detail`` then ``bytes`` if set."""
    timeline = Timeline(origin=100.0, origin_source="PREHEAT_T0")
    timeline.add("imports", 0.0, 0.25)
    with timeline.stage("fetch", uri="hf://m") as stage:
        stage.nbytes = 7
        stage.detail["cache"] = "miss"
        running = json.dumps(timeline.to_dict())
    timeline.mark("ready", note="up")
    data = timeline.to_dict()
    data["stages"][1]["end"] = data["stages"][2]["start"] = data["total"] = 1.5  # the clock, pinned
    assert json.dumps(data) == (
        '{"version": 1, "origin": 100.0, "origin_source": "PREHEAT_T0", "total": 1.5, "stages": ['
        '{"name": "imports", "start": 0.0, "end": 0.25, "detail": {}}, '
        '{"name": "fetch", "start": ' + json.dumps(data["stages"][1]["start"]) + ', "end": 1.5, '
        '"detail": {"uri": "hf://m", "cache": "miss"}, "bytes": 7}, '
        '{"name": "ready", "start": 1.5, "end": ' + json.dumps(data["stages"][2]["end"]) + ", "
        '"detail": {"note": "up"}}]}'
    )
    assert '"end": null' in running, "a stage still running is served with a null end"


def test_saved_stage_records_read_back_as_the_same_stages() -> None:
    stages = [Stage.from_dict(record) for record in SAMPLE["stages"]]  # type: ignore[attr-defined]
    assert [s.to_dict() for s in stages] == SAMPLE["stages"]
    assert stages[2] == Stage("fetch", 0.31, 1.31, 2_000_000_000, {"cache": "miss"})
    running = Stage.from_dict({"name": "compile", "start": 3, "end": None})  # bytes and detail are optional
    assert running == Stage("compile", 3.0)
    loading = {**SAMPLE, "stages": [*SAMPLE["stages"], running.to_dict()]}
    (compiling,) = [r for r in Waterfall.from_dict(loading).rows if r.name == "compile"]
    assert (compiling.start, compiling.end) == (3.0, 3.0), "a stage still running is an instant so far in the report"


def test_preheat_t0_moves_the_origin_back_and_adds_a_platform_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    from preheat.core.timeline import process_start_time

    monkeypatch.setenv("PREHEAT_T0", str(process_start_time() - 42.0))
    timeline = Timeline.from_env()
    assert timeline.origin_source == "PREHEAT_T0"
    record_imports(timeline)
    platform, imports = timeline.stages()
    assert platform.name == "platform"
    assert platform.start == 0.0
    assert platform.end == pytest.approx(42.0, abs=0.05)
    assert imports.name == "imports"
    assert imports.start == platform.end


def test_a_malformed_preheat_t0_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_T0", "yesterday")
    with pytest.raises(ConfigError, match="PREHEAT_T0"):
        Timeline.from_env()


# -- reading it back -------------------------------------------------------------------------------------------------
def test_idle_accelerator_time_runs_from_the_origin_to_ready() -> None:
    waterfall = Waterfall.from_dict(SAMPLE)
    assert waterfall.ready == 3.6
    assert waterfall.idle_seconds == 3.6
    assert waterfall.idle_cost(32.0) == pytest.approx(3.6 / 3600 * 32)
    assert waterfall.ttft == 0.05
    never = {**SAMPLE, "stages": [s for s in SAMPLE["stages"] if s["name"] != "ready"]}  # type: ignore[attr-defined]
    assert Waterfall.from_dict(never).idle_seconds == 4.0, "never ready: the whole timeline was idle"


def test_table_lists_every_stage_with_rates_and_bars() -> None:
    text = render_text(Waterfall.from_dict(SAMPLE), gpu_cost_per_hour=32)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["stage", "start", "s", "end", "s", "dur"]
    fetch = next(line for line in lines if line.startswith("fetch"))
    assert "1.000" in fetch
    assert "2.00" in fetch  # GB/s: 2 GB in 1 s
    assert "cache=miss" in fetch
    assert "█" in fetch
    ready = next(line for line in lines if line.startswith("ready "))
    assert "│" in ready
    assert "idle accelerator 3.600 s = $0.0320 at $32/h" in text
    assert "first token      0.050 s" in text


def test_cli_prints_the_waterfall_from_a_file(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", str(saved), "--gpu-cost-per-hour", "4"]) == 0
    out = capsys.readouterr().out
    for name in ("imports", "engine_imports", "weight_load", "warmup", "ready", "first_request_ttft"):
        assert name in out
    assert "idle accelerator 3.600 s = $0.0040 at $4/h" in out


def test_cli_json_has_the_cost_arithmetic(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", str(saved), "--json", "--gpu-cost-per-hour", "10"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["idle_seconds"] == 3.6
    assert data["idle_cost"] == pytest.approx(0.01)
    weight_load = next(s for s in data["stages"] if s["name"] == "weight_load")
    assert weight_load["duration"] == pytest.approx(0.5)
    assert weight_load["gbps"] == pytest.approx(2.0)


def test_html_plot_is_one_self_contained_page(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "waterfall.html"
    assert main(["timeline", str(saved), "--plot", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>")
    assert "<script" not in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', ""), "no external resources"
    svg = page[page.index("<svg") : page.index("</svg>") + len("</svg>")]
    root = ET.fromstring(svg)  # well-formed XML
    labels = {el.text for el in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"imports", "weight_load", "warmup", "ready"} <= labels
    assert "idle accelerator 3.60 s = $0.0320 at $32/h" in labels


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_png_plot_is_a_png(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "waterfall.png"
    assert main(["timeline", str(saved), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_to_use_html(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules makes the import fail
    assert main(["timeline", str(saved), "--plot", str(tmp_path / "w.png")]) == 1
    err = capsys.readouterr().err
    assert "matplotlib" in err
    assert ".html" in err
    assert not (tmp_path / "w.png").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"stages": 3}', "not a preheat timeline"),
        ('{"stages": [{"start": 1}]}', "stage 0"),
    ],
)
def test_bad_files_are_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    assert main(["timeline", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err
    assert message in err


def test_unknown_plot_format_is_refused(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", str(saved), "--plot", "out.svgz"]) == 1
    assert ".html" in capsys.readouterr().err


# -- from a server ---------------------------------------------------------------------------------------------------
class _TimelineHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps(SAMPLE).encode() if self.path == "/v1/preheat/timeline" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def timeline_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TimelineHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_timeline_url_answering_deep_json_is_a_clear_error() -> None:
    """``preheat timeline URL`` once died in a RecursionError traceback on 64 KiB of "[" (issue 27)."""
    with ScriptedServer(always(DEEP_JSON)) as server:
        done = subprocess.run([sys.executable, "-m", "preheat", "timeline", server.url],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    url = server.url + "/v1/preheat/timeline"
    assert f"preheat: error: {url}: cannot fetch the timeline (nested deeper than 64 levels)" in done.stderr


def test_cli_fetches_the_timeline_from_a_server(timeline_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", timeline_server, "--api-key", "k", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] == 3.6
    assert main(["timeline", timeline_server]) == 1
    assert "HTTP 401" in capsys.readouterr().err
