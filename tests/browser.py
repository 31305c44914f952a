"""Headless Chromium for the dashboard's tests: Debian's ``/usr/bin/chromium`` driven by Playwright (never a
downloaded browser: ``playwright install`` is not needed). Tests skip, saying why, where either is missing; CI
installs both (.ci/run)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
# No network beyond the page under test, no first-run work: the browser must not reach anything but 127.0.0.1.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SCREENSHOTS = "PREHEAT_DASHBOARD_SCREENSHOTS"  # a directory: the tests save their screenshots there (docs/img)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:  # Any: playwright's Browser (imported only when the browser is there)
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is absent: apt-get install chromium chromium-driver (CI does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[test]'")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Console:
    """Every console error and uncaught exception of a page, and every request it made to another origin."""

    def __init__(self, page: Any, origin: str) -> None:  # Any: playwright's Page
        self.errors: list[str] = []
        self.elsewhere: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith((origin, "data:")) else self.elsewhere.append(r.url))


def screenshot(page: Any, name: str) -> None:  # Any: playwright's Page
    """Save ``dashboard-<name>.png`` of the whole page where $PREHEAT_DASHBOARD_SCREENSHOTS says (docs/img)."""
    target = os.environ.get(SCREENSHOTS)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / f"dashboard-{name}.png"), full_page=True)
