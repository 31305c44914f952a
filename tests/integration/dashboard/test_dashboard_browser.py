"""The fleet dashboard in a real headless Chromium, against a real ``preheat up --replicas 2`` with an L1 and an L2:
what an operator sees load, fill in, and turn red.

Screenshots of each view land in $PREHEAT_DASHBOARD_SCREENSHOTS when it is set (docs/img was made so)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from browser import Console, chromium, screenshot
from routing import NAME, running_router, start_up
from serving import Client

# Over 256 tokens (one KV chunk at the default chunk size; the tiny model's tokenizer reads bytes): its second
# reading finds its first chunk in a KV tier.
STORY = "Once upon a time, in a kingdom by the sea, there lived a keeper of lighthouses and old maps. " * 4


class Fleet:
    def __init__(self, up: subprocess.Popen[str], router: str, pids: list[int], replicas: list[str]) -> None:
        self.up, self.router, self.pids, self.replicas = up, router, pids, replicas


@pytest.fixture(scope="module")
def fleet(kv_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    l2 = tmp_path_factory.mktemp("dashboard-l2")
    extra = ("--max-model-len", "512", "--kv-l1", "16MiB", "--kv-l2", f"fs://{l2}", "--policy", "kv")
    up, router, pids, replicas = start_up(kv_model, *extra)
    try:
        yield Fleet(up, router, pids, replicas)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:  # Any: playwright's Browser
    with chromium() as started:
        yield started


def open_dashboard(browser: Any, url: str) -> tuple[Any, Console]:  # Any: playwright's Page
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    console = Console(page, url)
    page.goto(url + "/dashboard")
    page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
    return page, console


def test_the_page_shows_both_replicas_and_their_cold_starts(fleet: Fleet, browser: Any) -> None:
    page, console = open_dashboard(browser, fleet.router)
    for url in fleet.replicas:
        row = page.locator(f'#replicas tr[data-replica="{url}"]')
        assert row.get_attribute("data-health") == "healthy"
        assert row.locator(".tier[data-tier=l1]").count() == 1
        assert row.locator(".tier[data-tier=l2]").count() == 1
        waterfall = page.locator(f'.waterfall[data-replica="{url}"]')
        assert waterfall.locator("[data-stage=ready]").count() == 1  # the bars run up to the replica's ready
        assert waterfall.locator("[data-stage=weight_load] rect").count() == 1
    assert page.locator("#status").inner_text() == "ok · L1 up · L2 up · 2/2 healthy"  # every tier's state
    # The router's own doctor (preheat router runs it in the background) has reported.
    page.wait_for_function("() => document.getElementById('doctor-status').textContent !== ''", timeout=30_000)
    screenshot(page, "fleet")
    assert console.errors == []
    assert console.elsewhere == []  # offline: nothing from a CDN or anywhere else


def test_hit_rates_fill_in_as_requests_are_sent(fleet: Fleet, browser: Any) -> None:
    page, console = open_dashboard(browser, fleet.router)
    before = page.locator(".tier[data-tier=l1]").evaluate_all("nodes => nodes.map(n => n.dataset.hitRate)")
    for _ in range(3):
        reply = Client(fleet.router).post("/v1/completions", {"model": NAME, "prompt": STORY, "max_tokens": 4})
        assert reply.status == 200, reply.body
    # The router sends the story where its KV is; that replica's L1 now answers most of its lookups.
    page.wait_for_function(
        "() => [...document.querySelectorAll('.tier[data-tier=l1]')].some(n => Number(n.dataset.hitRate) > 0.5)",
        timeout=20_000,
    )
    # The first request's token is marked on the waterfall of the replica that answered it.
    page.wait_for_selector(".waterfall [data-stage=first_request_ttft]", timeout=20_000)
    shares = page.locator("[data-testid=cached-share]").all_inner_texts()
    assert any("%" in share for share in shares), shares
    assert page.locator("#decisions tr[data-policy=kv]").count() >= 1
    screenshot(page, "hits")
    assert all(rate == "" for rate in before), before  # nothing looked up before the requests
    assert console.errors == []


def test_one_replica_serves_its_own_dashboard(fleet: Fleet, browser: Any) -> None:
    page, console = open_dashboard(browser, fleet.replicas[0])
    assert page.locator("#kind").inner_text() == "replica"
    assert page.locator("#replicas tbody tr").count() == 1
    assert page.locator("#decisions-section").is_hidden()  # no router here
    assert page.locator(".waterfall [data-stage=ready]").count() == 1
    # The replica's own doctor ran when the page first asked (never during its cold start).
    page.wait_for_function("() => document.getElementById('doctor-status').textContent !== ''", timeout=30_000)
    screenshot(page, "replica")
    assert console.errors == []


def test_a_killed_replica_turns_unhealthy_on_the_page(fleet: Fleet, browser: Any) -> None:
    """Last in this module: it kills a replica of the shared fleet."""
    page, console = open_dashboard(browser, fleet.router)
    victim = fleet.replicas[1]
    os.kill(fleet.pids[1], signal.SIGKILL)
    row = page.locator(f'#replicas tr[data-replica="{victim}"]')
    page.wait_for_selector(f'#replicas tr[data-replica="{victim}"][data-health=unhealthy]', timeout=20_000)
    assert "refused" in row.locator(".error").inner_text()
    assert "1/2 healthy" in page.locator("#status").inner_text()
    # Its last cold start stays on the page, marked: what it was is what the next start will be compared with.
    assert page.locator(f'.waterfall[data-replica="{victim}"] .pill.bad').inner_text() == "unhealthy"
    screenshot(page, "unhealthy")
    assert console.errors == []


def test_with_an_api_key_the_page_asks_for_it_once(browser: Any) -> None:
    # No replica answers here: the login is the router's own, and the page shows them down.
    with running_router(["http://127.0.0.1:9"], api_key="sesame") as service:
        page = browser.new_page(viewport={"width": 1280, "height": 700})
        page.goto(service.url + "/dashboard")
        assert page.locator("form[data-testid=login]").is_visible()
        screenshot(page, "login")
        page.fill("#key", "wrong")
        page.click("button[type=submit]")
        assert "wrong key" in page.locator(".problem").inner_text()
        page.fill("#key", "sesame")
        page.click("button[type=submit]")
        page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
        assert page.url == service.url + "/dashboard"  # the key went in the form's body, never in a URL
        assert page.locator('#replicas tr[data-replica="http://127.0.0.1:9"]').get_attribute("data-health") == (
            "unhealthy"
        )
        page.reload()  # the cookie keeps the browser in
        page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
