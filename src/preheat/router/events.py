"""The KV-event poller behind policy ``kv``: asks each replica what its tiers hold (spec: docs/kv-events.md).

Pull, not push: a restarted router rebuilds its whole index on its first poll (a snapshot), a restarted replica is
noticed by its new epoch, and replicas need not know where the router is. A replica that answers 404 has no KV
tier: it is asked again only every ``idle_interval`` seconds and scores as "holds nothing".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import urlencode

from preheat.core.errors import AnswerTooLargeError, HTTPClientError, RouterError
from preheat.core.jsonsafe import loads_bounded
from preheat.http.client import Timeouts
from preheat.http.pool import Connection
from preheat.http.tls import client_context
from preheat.router.health import ReplicaLoop
from preheat.router.index import KVIndex, parse_update
from preheat.router.upstream import Replica

log = logging.getLogger("preheat.router")
EVENTS_PATH = "/v1/kv/events"
# A full snapshot (docs/kv-events.md: at most 2 x 100,000 keys of 32 hex digits) is about 7 MB; a longer answer is
# refused unread rather than held in memory.
MAX_ANSWER_BYTES = 16 * 1024 * 1024
MAX_ANSWER_CONTAINERS = 100_000  # an answer has at most 10,000 events (one object each) and a few other objects


class KVEventPoller(ReplicaLoop):
    """One polling thread per replica feeding ``index``; ``tick_all()`` once at start, then ``start()``/``stop()``."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        index: KVIndex,
        *,
        interval: float = 0.25,
        idle_interval: float = 5.0,
        timeout: float = 2.0,
        api_key: str | None = None,
    ) -> None:
        super().__init__(replicas, interval, timeout)
        self.index, self.idle_interval = index, idle_interval
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._conns: dict[str, Connection] = {}
        self._denied: set[str] = set()  # replicas that refused our key: said once, not every poll

    def tick(self, replica: Replica) -> float:
        if _left(replica):
            return self.idle_interval  # it left the fleet (remove() ends this thread): open no connection to it
        return self.interval if self.poll(replica) else self.idle_interval

    def poll(self, replica: Replica) -> bool:
        """Ask ``replica`` once and fold the answer into the index; False when it has no KV events to give."""
        cursor = self.index.cursor(replica.url)
        finished = replica.finished  # taken before asking: requests finishing later may still be in its load
        query = "" if cursor is None else "?" + urlencode({"epoch": cursor[0], "since": cursor[1]})
        conn = self._conns.get(replica.url)
        if conn is None:
            tls = client_context() if replica.address.scheme == "https" else None
            conn = Connection(replica.address.host, replica.address.port, Timeouts.within(self.timeout), tls=tls)
            self._conns[replica.url] = conn
        try:
            response = conn.request("GET", EVENTS_PATH + query, headers=self.headers, max_body=MAX_ANSWER_BYTES)
        except AnswerTooLargeError as exc:
            log.warning("%s%s: ignoring a malformed answer: %s", replica.url, EVENTS_PATH, exc)
            self.index.forget(replica.url)  # start over from a snapshot
            return True
        except HTTPClientError as exc:  # reconnects on the next poll; the health checker decides if it is down
            log.debug("%s%s: %s", replica.url, EVENTS_PATH, exc)
            return True
        if _left(replica):
            return True  # it left the fleet while we asked: its keys were dropped, and must stay so
        if response.status == 404:
            return False  # no KV tier there: ask again now and then, in case it restarts with one
        if response.status in (401, 403) and replica.url not in self._denied:
            self._denied.add(replica.url)
            why = f"answered {response.status}: pass the replicas' API key as --replica-api-key"
            log.warning("%s%s %s", replica.url, EVENTS_PATH, why)
        if response.status != 200:
            log.debug("%s%s answered %s", replica.url, EVENTS_PATH, response.status)  # e.g. 503 while loading
            return True
        try:
            payload = loads_bounded(response.body, max_bytes=MAX_ANSWER_BYTES, max_containers=MAX_ANSWER_CONTAINERS)
            self.index.apply(replica.url, parse_update(payload, replica.url), finished=finished)
            if _left(replica):  # it left while we applied: remove()'s forget may have run before our apply
                self.index.forget(replica.url)
        except (ValueError, RouterError) as exc:  # ValueError: a JSONInputError (too large, deep, not JSON)
            log.warning("%s%s: ignoring a malformed answer: %s", replica.url, EVENTS_PATH, exc)
            self.index.forget(replica.url)  # start over from a snapshot
        return True

    def remove(self, replica: Replica) -> None:
        """``replica`` left the fleet: no more polls, its connection closed, its keys out of the index."""
        super().remove(replica)
        self._denied.discard(replica.url)  # a later replica at the same address is warned about afresh
        conn = self._conns.pop(replica.url, None)
        if conn is not None:
            conn.close()
        self.index.forget(replica.url)

    def stop(self) -> None:
        super().stop()
        for conn in self._conns.values():
            conn.close()


def _left(replica: Replica) -> bool:
    """Whether ``replica`` left the fleet, read afresh: another thread (the router's discovery) retires it."""
    return replica.retired
