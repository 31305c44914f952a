"""The dashboard's state and its HTTP face, without a browser: what the page is fed, and who may see it.

The state is built from real Prometheus text (written by the same renderer the replicas use) and real timelines; the
HTTP tests run a real router in this process, in front of replicas that are down (the browser tests,
test_dashboard_browser.py, run a real fleet)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from preheat.core.timeline import Timeline
from preheat.dashboard.prom import parse, total
from preheat.dashboard.refresh import Refreshing
from preheat.dashboard.state import (
    SCHEMA,
    ReplicaRow,
    StateDocument,
    TokenRate,
    document,
    replica_entry,
    waterfall,
)
from preheat.dashboard.watch import ReplicaDashboard
from preheat.dashboard.web import ASSETS, asset
from preheat.http.metrics import Counter, Gauge, render
from preheat.router.app import RouterService
from routing import running_router, wait_until
from serving import Client, Reply

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens there


@contextlib.contextmanager
def router(
    api_key: str | None = None, findings: Callable[[], Mapping[str, Any] | None] | None = None
) -> Iterator[RouterService]:
    with running_router([DOWN], findings=findings, api_key=api_key) as service:
        yield service


def get(url: str, path: str, headers: dict[str, str] | None = None) -> Reply:
    return Client(url).request("GET", path, headers=headers)


def log_in(url: str, form: bytes) -> Reply:
    """What the login page's form sends: ``POST /dashboard`` with the key in the body."""
    return Client(url).request("POST", "/dashboard", form, {"Content-Type": "application/x-www-form-urlencoded"})


def replica_metrics(hits: dict[str, float], misses: dict[str, float], prompt: float, cached: float) -> str:
    """A replica's /metrics text, written by the renderer ``preheat serve`` uses."""
    hit, miss = Counter("preheat_kv_hits_total", "h"), Counter("preheat_kv_misses_total", "m")
    for tier, n in hits.items():
        hit.inc(n, tier=tier)
    for tier, n in misses.items():
        miss.inc(n, tier=tier)
    prompts, reused = Counter("preheat_prompt_tokens_total", "p"), Counter("preheat_prompt_tokens_cached_total", "c")
    prompts.inc(prompt)
    reused.inc(cached)
    queue = Gauge("preheat_queue_depth", "q", lambda: [({}, 3.0)])
    return render([hit, miss, prompts, reused, queue])


def test_metrics_are_read_back_as_the_replicas_write_them() -> None:
    counter = Counter("demo_total", "d")
    counter.inc(2, path='a "quoted"\\ value')
    counter.inc(1, path="plain")
    metrics = parse(render([counter]) + "not a sample line\n")
    assert total(metrics, "demo_total") == 3
    assert total(metrics, "demo_total", path='a "quoted"\\ value') == 2
    assert total(metrics, "absent_total") is None


def test_a_replica_shows_its_hit_rate_per_tier_and_its_cached_token_share() -> None:
    text = replica_metrics({"l1": 3, "l2": 1}, {"l1": 1, "l2": 3}, prompt=400, cached=100)
    entry = replica_entry(ReplicaRow("http://r:1", True, "ok"), parse(text), None, None)
    assert entry["kv"]["l1"]["hit_rate"] == 0.75
    assert entry["kv"]["l2"]["hit_rate"] == 0.25
    assert entry["cached_share"] == 0.25
    assert entry["queue"] == 3
    fresh = replica_entry(ReplicaRow("http://r:1", True), parse(replica_metrics({"l1": 0}, {}, 0, 0)), None, None)
    assert fresh["kv"]["l1"]["hit_rate"] is None  # no lookup yet: unknown, not 0%
    assert fresh["cached_share"] is None


def tier_metrics(**up: float) -> str:
    """A replica's /metrics with its KV tiers' up/down gauge, as ``preheat serve`` writes it."""
    gauge = Gauge("preheat_kv_tier_up", "u")
    for tier, value in up.items():
        gauge.set(value, tier=tier)
    return render([gauge])


def test_a_replica_whose_l2_is_down_keeps_the_header_from_saying_ok() -> None:
    def fleet(*replicas: tuple[ReplicaRow, str]) -> StateDocument:
        entries = [replica_entry(row, parse(text), None, None) for row, text in replicas]
        return document("router", entries, now=0.0, status="ok")

    a, b = ReplicaRow("http://a:1", True, "ok"), ReplicaRow("http://b:1", True, "ok")
    broken = fleet((a, tier_metrics(l1=1, l2=1)), (b, tier_metrics(l1=1, l2=0)))
    assert broken["status"] == "degraded"
    assert [t["text"] for t in broken["tiers"]] == ["L1 up", "L2 down on 1/2 replicas"]
    whole = fleet((a, tier_metrics(l1=1, l2=1)), (b, tier_metrics(l1=1, l2=1)))
    assert whole["status"] == "ok"
    assert [t["text"] for t in whole["tiers"]] == ["L1 up", "L2 up"]  # the header names every tier
    # A replica out of rotation keeps it from "ok" too; a standby replica, out by design, does not.
    assert fleet((a, tier_metrics(l1=1)), (ReplicaRow("http://b:1", False, "down"), ""))["status"] == "degraded"
    standby = ReplicaRow("http://s:1", False, "standby", standby=True)
    assert fleet((a, tier_metrics(l1=1)), (standby, ""))["status"] == "ok"
    # A replica's own page says the same of itself.
    own = ReplicaDashboard().state(b, tier_metrics(l1=1, l2=0), {})
    assert own["status"] == "degraded"
    assert [t["text"] for t in own["tiers"]] == ["L1 up", "L2 down"]


def test_tokens_per_second_is_measured_over_a_window_and_restarts_with_the_replica() -> None:
    rate = TokenRate()
    assert rate.observe(100.0, 0) is None
    assert rate.observe(100.5, 50) is None  # too short a window to say
    assert rate.observe(102.0, 200) == 100.0
    assert rate.observe(103.0, 10) is None  # the counter went down: the replica restarted


def test_the_waterfall_keeps_a_stage_under_way_open() -> None:
    timeline = Timeline(origin=1000.0)
    timeline.add("fetch", 0.0, 1.5)
    with timeline.stage("warmup"):  # still running while the page asks
        drawn = waterfall(timeline.to_dict())
    assert drawn is not None
    assert [s["name"] for s in drawn["stages"]] == ["fetch", "warmup"]
    assert drawn["stages"][0]["end"] == 1.5
    assert drawn["stages"][1]["end"] is None
    assert waterfall({"stages": "not a list"}) is None


def test_refreshing_never_waits_and_keeps_the_last_value_when_a_run_fails() -> None:
    outcomes: list[object] = [{"run": 1}, ValueError("the check broke")]

    def produce() -> object:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    findings = Refreshing(produce, every=0.01)
    assert findings() is None  # the first run is under way: the caller is not kept waiting
    assert findings.wait(10) == {"run": 1}
    time.sleep(0.02)
    findings()  # stale: a second run starts, and fails
    wait_until(lambda: findings.error is not None, "the failed run")
    assert findings() == {"run": 1}
    assert findings.error == "ValueError: the check broke"


def test_the_assets_ship_in_the_package_and_reach_nothing_elsewhere() -> None:
    for name in ("index.html", "login.html", *ASSETS):
        text = asset(name).decode()
        text = text.replace('"http://www.w3.org/2000/svg"', "")  # SVG's namespace: a name, never fetched
        remote = re.findall(r"(?:https?:)?//[\w.-]+", text)
        assert remote == [], (name, remote)


def test_an_open_router_shows_every_replica_it_knows() -> None:
    with router() as service:
        page = get(service.url, "/dashboard")
        script = get(service.url, "/dashboard/static/app.js")
        state = get(service.url, "/dashboard/api/state")
        missing = get(service.url, "/dashboard/static/../app.py")
    assert page.status == 200
    assert b"/dashboard/static/app.js" in page.body
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert script.status == 200
    assert script.headers["Content-Type"].startswith("text/javascript")
    assert missing.status == 404
    document = state.json()
    assert document["schema"] == SCHEMA
    assert document["kind"] == "router"
    assert document["status"] == "no_replica"
    [replica] = document["replicas"]
    assert replica["url"] == DOWN
    assert replica["healthy"] is False
    assert "refused" in replica["error"]
    assert document["decisions"] == []  # nothing routed yet
    assert document["findings"] is None
    assert document["doctor"] is False


def test_with_an_api_key_the_dashboard_needs_it_once_then_a_cookie() -> None:
    with router(api_key="sesame") as service:
        url = service.url
        login = get(url, "/dashboard")
        anonymous = get(url, "/dashboard/api/state")
        wrong = log_in(url, b"key=nope")
        empty = log_in(url, b"other=1")
        in_url = get(url, "/dashboard?key=sesame")  # a key in a URL would end up in access logs: not taken
        right = log_in(url, b"key=sesame")
        cookie = right.headers["Set-Cookie"].split(";", 1)[0]
        with_cookie = get(url, "/dashboard/api/state", {"Cookie": cookie})
        page = get(url, "/dashboard", {"Cookie": cookie})
        bearer = get(url, "/dashboard/api/state", {"Authorization": "Bearer sesame"})
        forged = get(url, "/dashboard/api/state", {"Cookie": "preheat_dashboard_session=sesame"})
        style = get(url, "/dashboard/static/style.css")  # the package's own file: the login page needs it
    assert login.status == 401
    assert b'name="key"' in login.body
    assert anonymous.status == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert wrong.status == 401
    assert b"wrong key" in wrong.body
    assert empty.status == 401
    assert b"no key was sent" in empty.body
    assert in_url.status == 401
    assert "Set-Cookie" not in in_url.headers
    assert right.status == 303
    assert right.headers["Location"] == "/dashboard"
    assert "HttpOnly" in right.headers["Set-Cookie"]
    assert "SameSite=Strict" in right.headers["Set-Cookie"]
    assert "sesame" not in right.headers["Set-Cookie"]  # the browser keeps a token, not the key
    assert with_cookie.status == 200
    assert with_cookie.json()["schema"] == SCHEMA
    assert page.status == 200
    assert b"app.js" in page.body
    assert bearer.status == 200
    assert forged.status == 401
    assert style.status == 200


def test_the_doctors_findings_reach_the_page_without_slowing_it() -> None:
    from preheat.doctor import DoctorOptions, run_doctor

    findings = Refreshing(lambda: run_doctor(DoctorOptions(io=False, gpu=False, budget_s=5)).to_json(), every=60)
    assert findings.wait(30) is not None
    with router(findings=findings) as service:
        document = get(service.url, "/dashboard/api/state").json()
    assert document["doctor"] is True
    assert document["findings"]["schema"] == "preheat.doctor/1"
    assert {"id", "area", "severity", "title", "seconds", "evidence", "fix"} <= set(document["findings"]["findings"][0])
    assert json.dumps(document)  # one JSON document, as the page reads it


@contextlib.contextmanager
def odd_replica(metrics: bytes, timeline: bytes) -> Iterator[str]:
    """A server that is not a preheat replica but sits in the fleet: it answers /metrics and the timeline route
    with what it is given (garbage, huge numbers), as a misconfigured or foreign server would."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Odd(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics if self.path == "/metrics" else timeline
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a scrape thread that died
def test_a_replica_answering_garbage_does_not_break_the_page() -> None:
    huge = "1" + "0" * 400  # a JSON integer no float holds
    stages = [
        '{"name": ["unhashable"], "start": 0.5, "end": 1}',
        '{"name": "load", "start": HUGE, "end": HUGE}',
        '{"name": "weights", "start": 1e999}',  # Python reads it as inf
        '{"name": "ready", "start": 2, "end": 2}',
    ]
    timeline = ('{"total": HUGE, "origin": {"x": [1]}, "stages": [' + ", ".join(stages) + "]}").replace("HUGE", huge)
    timeline_bytes = timeline.encode()
    metrics = b'\x00\xff garbage\npreheat_queue_depth 1e999\npreheat_kv_hits_total{tier="l1"} nan\n{}{}\n'
    with odd_replica(metrics, timeline_bytes) as odd, running_router([odd]) as service:
        first = get(service.url, "/dashboard/api/state")
        time.sleep(0.6)  # past the scrape's max_age: the second poll scrapes again, with the timeline in hand
        second = get(service.url, "/dashboard/api/state")
    for answer in (first, second):
        assert answer.status == 200
        [replica] = json.loads(answer.body, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["replicas"]
        assert replica["queue"] is None  # an infinite gauge is no reading
        assert replica["waterfall"]["total"] == 0.0
        assert [s["name"] for s in replica["waterfall"]["stages"]] == ["['unhashable']", "ready"]
    assert replica["error"] is None


def test_a_replica_that_drips_its_answer_holds_one_scrape_not_one_per_poll() -> None:
    import socket
    import threading

    from preheat.dashboard.watch import FleetWatcher

    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # answers every connection with headers, then one byte of the body now and then
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    def drip(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.wait(0.05):
                conn.sendall(b"#")

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    watcher = FleetWatcher(timeout=0.2, max_age=0.0)
    try:
        states = [watcher.state([ReplicaRow(url, True)], status="ok", policy="p", decision_samples=[])
                  for _ in range(4)]  # fmt: skip
        assert len(connections) == 1
        assert "still reading its last answer" in (states[-1]["replicas"][0]["error"] or "")
    finally:
        stop.set()
        listener.close()
        for conn in connections:
            conn.close()
