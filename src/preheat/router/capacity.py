"""Cold capacity, as pure rules: when the fleet needs another replica, and which cold one to bring up first.

A *cold* replica is one the router may turn into a serving one: a standby replica (``preheat serve --standby``,
given to the router with ``--standby``) by activating it (``POST /v1/preheat/load``), or a sleeping replica by
waking it (``POST /v1/preheat/wake``). The I/O that does it is ``activation.py``; this module only decides.

- **Not serving**: a replica whose ``/health`` says ``standby``, ``sleeping``, ``waking``, ``draining``,
  ``loading``, ``warming`` or ``failed`` (a 503 with that status), or whose answer to a request is a 503 with one of
  the matching error codes, has told the router it takes no requests: it leaves rotation at once, not after
  ``failures`` checks, and a request it refused so is retried elsewhere (it never started there).
- **Saturated**: every replica in rotation has ``limit`` or more requests in flight through this router
  (``--saturation``, default 3): a new request would only queue, so a cold replica is brought up beside them.
- **Which cold replica**: the one expected to serve soonest. A sleeping replica's cost is what its last wake took
  (the ``ready`` of its wake timeline, or the router's own measurement); a standby's is what activations took
  through this router. Unknown costs are the mean of the known ones of that kind, else a prior (wake 1 s,
  activation 3 s: only their order matters, a wake reuses the page cache and the process's state). A standby still
  importing (``prepared`` false) comes after the prepared ones; ties go in the order the replicas were given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# /health statuses of a replica that is up but takes no requests (preheat.server.lifecycle's phases).
NOT_SERVING = frozenset(("standby", "sleeping", "waking", "draining", "loading", "warming", "failed"))
# The error codes of a replica's 503 to a generation request while it is in one of those phases: it refused before
# admitting the request, so the request is retried elsewhere.
REFUSED_CODES = frozenset(("standby", "sleeping", "waking", "draining", "model_loading", "loading"))
STANDBY, SLEEPING = "standby", "sleeping"
PRIOR_SECONDS = {SLEEPING: 1.0, STANDBY: 3.0}
UNPREPARED_PENALTY = 10.0  # seconds: a standby still importing torch pays that first


@dataclass(frozen=True)
class Cold:
    """A replica that could be brought up: ``kind`` is ``standby`` (activate) or ``sleeping`` (wake);
    ``seconds`` what it is known to take (None: unknown); ``prepared``: a standby done with its imports."""

    name: str
    kind: str
    seconds: float | None = None
    prepared: bool = True


def saturated(in_flight: Iterable[int], limit: int) -> bool:
    """Whether every replica in rotation (their requests in flight through this router) is at ``limit`` or more.

    >>> saturated([3, 4], 3), saturated([3, 1], 3), saturated([], 3)
    (True, False, False)
    """
    loads = list(in_flight)
    return bool(loads) and all(n >= limit for n in loads)


def refused_code(status: int, body: Mapping[str, object] | None) -> str | None:
    """The code of a replica's answer that means "not serving now, nothing was done": a 503 whose
    ``error.code`` is one of ``REFUSED_CODES``; None for any other answer.

    >>> refused_code(503, {"error": {"code": "sleeping"}}), refused_code(503, {"error": {"code": "queue_full"}})
    ('sleeping', None)
    """
    if status != 503 or body is None:
        return None
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code in REFUSED_CODES else None


def expected_seconds(candidate: Cold, known: Mapping[str, Sequence[float]]) -> float:
    """What bringing ``candidate`` up should take: its own cost, else the mean of ``known[kind]``, else the prior;
    plus ``UNPREPARED_PENALTY`` for a standby still importing."""
    if candidate.seconds is not None:
        seconds = candidate.seconds
    else:
        measured = known.get(candidate.kind, ())
        seconds = sum(measured) / len(measured) if measured else PRIOR_SECONDS.get(candidate.kind, 3.0)
    return seconds + (0.0 if candidate.prepared else UNPREPARED_PENALTY)


def rank_cold(candidates: Sequence[Cold], known: Mapping[str, Sequence[float]] | None = None) -> list[Cold]:
    """``candidates`` from the first to bring up to the last (stable: ties keep their given order).

    >>> [c.name for c in rank_cold([Cold("a", STANDBY), Cold("b", SLEEPING, 0.2), Cold("c", STANDBY, 0.1)])]
    ['c', 'b', 'a']
    """
    costs = known or {}
    return sorted(candidates, key=lambda c: expected_seconds(c, costs))
