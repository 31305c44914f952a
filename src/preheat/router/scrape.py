"""The engine replicas' own ``/metrics``, read for the ``kv`` policy: their queue, in their own words.

A preheat replica reports its ``(running, waiting)`` with its KV events (``GET /v1/kv/events``); a vLLM or SGLang
replica's events carry blocks only, so this poller asks its ``/metrics`` every ``interval`` seconds and reads it
with the dashboard's reader (``preheat.dashboard.signals``: one reading for every engine kind). What it learns is
set on the ``Replica`` (``engine``, ``load``, ``load_finished``) and a policy sees it in its ``Candidate``. A
replica that does not answer, or exports no queue, keeps ``load`` None: the policy counts this router's requests in
flight there instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from preheat.core.errors import HTTPClientError
from preheat.dashboard.prom import parse
from preheat.dashboard.signals import Signals, read
from preheat.http.client import Timeouts, request
from preheat.router.health import ReplicaLoop
from preheat.router.upstream import Replica

log = logging.getLogger("preheat.router")
MAX_METRICS = 4 * 1024 * 1024  # vLLM's /metrics is ~50 KiB per engine; a bound on what a replica makes us hold


def scrape(url: str, timeout: float, headers: dict[str, str] | None = None) -> Signals | None:
    """``url``'s ``/metrics`` read as ``Signals``; None when it does not answer 200."""
    try:
        answer = request(url + "/metrics", timeouts=Timeouts.within(timeout), headers=headers, max_body=MAX_METRICS)
    except HTTPClientError as exc:
        log.debug("%s/metrics: %s", url, exc)
        return None
    if answer.status != 200:
        return None
    return read(parse(answer.body.decode("utf-8", "replace")))


class MetricsPoller(ReplicaLoop):
    """Scrapes each replica's ``/metrics`` every ``interval`` seconds (``start``/``stop``; ``tick_all`` once)."""

    def __init__(self, replicas: Sequence[Replica], *, interval: float = 0.5, timeout: float = 2.0) -> None:
        super().__init__(replicas, interval, timeout)

    def tick(self, replica: Replica) -> float:
        if replica.retired or not replica.healthy:
            replica.load = None  # what it said before it left rotation is stale
            return self.interval
        finished = replica.finished  # before asking: requests that end meanwhile may already be out of its count
        signals = scrape(replica.url, self.timeout)
        if signals is None:
            replica.load = None
            return self.interval
        replica.engine = signals.engine
        replica.load, replica.load_finished = signals.load, finished
        return self.interval
