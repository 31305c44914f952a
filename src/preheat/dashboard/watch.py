"""The dashboard's I/O: scraping the replicas (``/metrics``, ``/v1/preheat/timeline``; preheat, vLLM and SGLang
replicas alike, read by ``signals``) when a page asks, and
passing the doctor's findings through (``refresh.Refreshing`` keeps them fresh off the request thread).

Nothing runs while nobody watches: a scrape happens on a page's poll, at most once per ``max_age`` seconds however
many pages poll, each replica asked in parallel within ``timeout`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from preheat.core.errors import HTTPClientError, JSONInputError
from preheat.core.jsonsafe import loads_bounded
from preheat.dashboard.prom import Metrics, parse, total
from preheat.dashboard.signals import read
from preheat.dashboard.state import (
    FleetView,
    ReplicaRow,
    StateDocument,
    TokenRate,
    decisions,
    document,
    replica_entry,
)
from preheat.http.client import Timeouts, request
from preheat.http.control import TIMELINE_ROUTE

MAX_METRICS = 4 * 1024 * 1024  # a replica's /metrics is tens of KiB
MAX_TIMELINE = 1024 * 1024  # a timeline is a few KiB
TIMELINE_EVERY = 10.0  # seconds between fetches of a replica's finished cold start
FIRST_REQUEST = frozenset(("first_request_ttft", "first_request"))  # preheat's, vLLM's (its plugin's) last stage
# The doctor's JSON document (preheat.doctor/1), passed through as it is (the dashboard cannot import the doctor).
Findings = Callable[[], Mapping[str, object] | None]


@dataclass
class Scrape:
    """What one replica said last: its metrics and timeline (kept from the last good answer), and why the last
    scrape failed (None when it did not)."""

    metrics: Metrics | None = None
    timeline: dict[str, object] | None = None  # the replica's timeline JSON, checked where it is read
    timeline_at: float | None = None  # when the timeline was fetched (monotonic)
    error: str | None = None

    def timeline_stale(self, now: float) -> bool:
        """A start under way is fetched on every scrape; a finished one (ready, and its first request marked:
        ``first_request_ttft`` for preheat, ``first_request`` for vLLM) every ``TIMELINE_EVERY`` seconds: it changes
        again only when the replica starts again."""
        if self.timeline is None or self.timeline_at is None:
            return True
        stages = self.timeline.get("stages")
        names = {s.get("name") for s in stages if isinstance(s, dict) and isinstance(s.get("name"), str)} \
            if isinstance(stages, list) else set()  # fmt: skip
        finished = "ready" in names and bool(names & FIRST_REQUEST)
        return not finished or now - self.timeline_at >= TIMELINE_EVERY


class FleetWatcher:
    """The router's side: ``state(rows, ...)`` builds the state document, scraping the replicas when the last scrape
    is older than ``max_age`` seconds. ``api_key``: what the replicas' ``/v1/preheat/timeline`` requires."""

    def __init__(self, api_key: str | None = None, *, timeout: float = 1.0, max_age: float = 0.5) -> None:
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout, self.max_age = timeout, max_age
        self._lock = threading.Lock()  # one scrape at a time; pages polling meanwhile get its result
        self._scraped_at: float | None = None
        self._scrapes: dict[str, Scrape] = {}
        self._rates: dict[str, TokenRate] = {}
        self._busy: dict[str, threading.Thread] = {}  # each replica's last scrape thread
        self.shared: Callable[[], FleetView] | None = None  # the fleet's shared view (the router sets it)

    def state(
        self,
        rows: Sequence[ReplicaRow],
        *,
        status: str,
        policy: str,
        decision_samples: Sequence[tuple[Mapping[str, str], float]],
        findings: Findings | None = None,
    ) -> StateDocument:
        with self._lock:
            now = time.monotonic()
            if self._scraped_at is None or now - self._scraped_at >= self.max_age:
                urls = {r.url for r in rows}
                for gone in set(self._scrapes) - urls:  # it left the fleet (--replicas-from): forget it
                    self._scrapes.pop(gone, None)
                    self._rates.pop(gone, None)
                    self._busy.pop(gone, None)
                self._scrape(sorted(urls), now)
                self._scraped_at = now
            entries = []
            for row in rows:
                got = self._scrapes.get(row.url, Scrape())
                rate = self._rates[row.url].rate if row.url in self._rates else None
                entries.append(replica_entry(row, got.metrics, got.timeline, rate, got.error))
        value, error = read_findings(findings)
        return document(
            "router",
            entries,
            now=time.time(),
            status=status,
            policy=policy,
            decision_rows=decisions(decision_samples),
            findings=value,
            findings_error=error,
            doctor=findings is not None,
            shared=self.shared() if self.shared is not None else None,
        )

    def _scrape(self, urls: Sequence[str], now: float) -> None:
        threads = []
        for url in urls:
            # The timeouts bound each read, not a whole answer: a replica that drips its /metrics keeps a scrape
            # reading past the join below. It gets no second one meanwhile (one thread and socket per replica).
            if url in self._busy and self._busy[url].is_alive():
                self._scrapes.setdefault(url, Scrape()).error = f"{url}: still reading its last answer"
                continue
            self._busy[url] = threading.Thread(target=self._scrape_one, args=(url, now), daemon=True)
            threads.append(self._busy[url])
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout * 2 + 1)  # each of its two requests is bounded by timeout

    def _scrape_one(self, url: str, now: float) -> None:
        got = self._scrapes.setdefault(url, Scrape())
        timeouts = Timeouts.within(self.timeout)
        try:
            answer = request(url + "/metrics", timeouts=timeouts, max_body=MAX_METRICS)
            if answer.status != 200:
                raise HTTPClientError(url + "/metrics", f"answered {answer.status}")
            got.metrics = parse(answer.body.decode("utf-8", "replace"))
            rate = self._rates.setdefault(url, TokenRate())
            rate.observe(now, read(got.metrics).generated_tokens)
            if got.timeline_stale(now):
                answer = request(url + TIMELINE_ROUTE, timeouts=timeouts, headers=self.headers, max_body=MAX_TIMELINE)
                if answer.status == 200:
                    timeline = loads_bounded(answer.body, max_bytes=MAX_TIMELINE, max_depth=16)
                    got.timeline = timeline if isinstance(timeline, dict) else got.timeline
                    got.timeline_at = now
            got.error = None
        except (HTTPClientError, JSONInputError, UnicodeDecodeError) as exc:
            got.error = str(exc)  # the last good metrics and waterfall stay on the page, marked with this


class ReplicaDashboard:
    """``preheat serve``'s side: the state document of one replica from its own metrics text and timeline."""

    def __init__(self) -> None:
        self._rate = TokenRate()
        self._lock = threading.Lock()

    def state(
        self,
        row: ReplicaRow,
        metrics_text: str,
        timeline: Mapping[str, object],  # its own Timeline.to_dict()
        findings: Findings | None = None,
    ) -> StateDocument:
        metrics = parse(metrics_text)
        with self._lock:
            rate = self._rate.observe(time.monotonic(), total(metrics, "preheat_generated_tokens_total"))
        value, error = read_findings(findings)
        finished = total(metrics, "preheat_generations_finished_total")  # no router counts them here
        entry = replica_entry(replace(row, finished=int(finished or 0)), metrics, timeline, rate)
        status = "ok" if row.healthy else row.phase
        return document(
            "replica",
            [entry],
            now=time.time(),
            status=status,
            findings=value,
            findings_error=error,
            doctor=findings is not None,
        )


def read_findings(findings: Findings | None) -> tuple[Mapping[str, object] | None, str | None]:
    """The provider's findings (None while the first run is under way) and why its last run failed."""
    if findings is None:
        return None, None
    return findings(), getattr(findings, "error", None)
