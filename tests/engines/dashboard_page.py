"""What the fleet dashboard shows, read from a real headless Chromium, printed as one JSON line: for the engine tests,
whose venv has no Playwright. Run from tests/ with the project's own venv:
``.venv/bin/python -m engines.dashboard_page ROUTER_URL N_REPLICAS``.

It waits (up to 60 s) until every replica's row has a filled prefix-cache hit rate and its waterfall a ``ready`` bar,
then prints each row's engine, tiers and hit rates, cached share, TTFT and KV usage, the waterfall's stage names, and
the page's console errors and requests to other origins."""

from __future__ import annotations

import json
import sys

from browser import CHROMIUM, Console, screenshot

FILLED = """n => {
  const rows = [...document.querySelectorAll('#replicas tbody tr[data-replica]')];
  return rows.length >= n && rows.every(r => r.querySelector('.tier[data-tier=gpu]')?.dataset.hitRate)
    && document.querySelectorAll('.waterfall [data-stage=ready]').length >= n;
}"""
READ = """() => [...document.querySelectorAll('#replicas tbody tr[data-replica]')].map(r => ({
  url: r.dataset.replica, engine: r.dataset.engine, health: r.dataset.health,
  tiers: Object.fromEntries([...r.querySelectorAll('.tier[data-tier]')].map(t => [t.dataset.tier, t.dataset.hitRate])),
  cached: r.querySelector('[data-testid=cached-share]').textContent,
  ttft: r.querySelector('[data-testid=ttft]').textContent,
  kv_usage: r.querySelector('[data-testid=kv-usage]') !== null,
  engine_pill: r.querySelector('[data-testid=engine]')?.textContent ?? null,
  stages: [...document.querySelectorAll(`.waterfall[data-replica="${r.dataset.replica}"] [data-stage]`)]
    .map(s => s.dataset.stage),
}))"""


def main(url: str, replicas: int) -> None:
    from playwright.sync_api import sync_playwright

    from browser import ARGS

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            console = Console(page, url)
            page.goto(url + "/dashboard")
            page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
            page.wait_for_function(FILLED, arg=replicas, timeout=60_000)
            rows = page.evaluate(READ)
            screenshot(page, "vllm")
            print(json.dumps({"rows": rows, "errors": console.errors, "elsewhere": console.elsewhere}), flush=True)
        finally:
            browser.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
