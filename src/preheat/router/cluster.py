"""``preheat up``: N replicas and a router as child processes on loopback, stopped together.

Each child runs in its own process group (its own session), so that stopping it reaches anything it started, and
so that a Ctrl-C in the terminal reaches ``preheat up`` alone, which then stops the children in order: SIGTERM to
every group, then SIGKILL to any group still alive after a grace period. On Linux each child also gets SIGTERM if
``preheat up`` itself dies outright (``PR_SET_PDEATHSIG``): no orphans either way.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from preheat.core.errors import HTTPClientError, ProcessError
from preheat.core.jsonsafe import loads_bounded
from preheat.core.procs import Child
from preheat.dashboard.prom import by_label, parse
from preheat.http.client import Timeouts, request
from preheat.http.control import LOAD_ROUTE

ADDRESS_TIMEOUT = 120.0  # a child prints its address once its socket is bound (before any model loads)
GRACE_SECONDS = 10.0


HEALTH_TIMEOUT = 600.0


def healthy(url: str) -> bool:
    """Whether ``url`` (a ``/health`` route) answers 200 now; any other answer, or none (not accepting yet, still
    loading), is False."""
    try:
        return request(url, timeouts=Timeouts.within(5.0), max_body=65536).status == 200
    except HTTPClientError:
        return False


class ServerProcess(Child):
    """``preheat serve MODEL --port 0 EXTRA...`` as a child; a context manager that always stops it (the demo, the
    tests, the benchmarks).

    ``url`` is known once the constructor returns (the child printed its listening line); ``wait_ready()`` waits
    for ``/health``; ``lines`` collects the child's output; ``started`` is ``time.time()`` just before the spawn.
    """

    url: str

    def __init__(self, model: str, *extra: str, env: Mapping[str, str] | None = None) -> None:
        super().__init__("preheat serve", ["serve", model, "--port", "0", *extra], env=env)
        try:
            self.url = self.wait_address(HEALTH_TIMEOUT)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = HEALTH_TIMEOUT) -> None:
        """Poll ``/health`` until 200; ``ProcessError`` if the server exits or ``timeout`` passes."""
        self.wait_until(lambda url: healthy(url + "/health"), timeout)


@dataclass
class Cluster:
    """The children of one ``preheat up``; ``stop()`` is safe to call at any point, any number of times."""

    replicas: list[Child] = field(default_factory=list)
    router: Child | None = None
    standby: list[Child] = field(default_factory=list)

    @property
    def children(self) -> list[Child]:
        return [*self.replicas, *self.standby, *([self.router] if self.router is not None else [])]

    def stop(self, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM every process group (the router first: no new requests), SIGKILL what is left after ``grace``."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            if not child.reap(deadline - time.monotonic()):
                child.signal_group(signal.SIGKILL)
                child.reap(5.0)
            child.close()


def start_cluster(
    model: str,
    replicas: int,
    *,
    replica_args: Sequence[str],
    router_args: Sequence[str],
    echo: Callable[[str], None],
    env: Mapping[str, str] | None = None,
    standby: int = 0,
    engine: str = "preheat",
    admin_key: str | None = None,
) -> Cluster:
    """Start ``replicas`` replicas of ``model`` and ``standby`` standby replicas allowed to load it (and nothing
    else), then a router in front of them; stopped again on any failure. ``env``: the children's environment (None:
    this process's). ``engine="vllm"``: every child is a ``preheat vllm-standby`` (``replica_args`` are then vLLM's
    serve arguments) and each replica is one told at once to load ``model`` (with ``admin_key``): a replica starts
    as fast as an activated standby, its engine processes forked from a process that has imported vLLM."""
    cluster = Cluster()
    allowed = os.path.abspath(model) if "://" not in model else model
    vllm = engine == "vllm"
    try:
        for i in range(replicas):
            if vllm:
                args = ["vllm-standby", "--port", "0", "--allow-model", allowed, "--", *replica_args]
            else:
                args = ["serve", model, "--port", "0", *replica_args]
            cluster.replicas.append(_child(f"replica {i + 1}", args, echo, env))
        for i in range(standby):
            if vllm:
                args = ["vllm-standby", "--port", "0", "--allow-model", allowed, "--", *replica_args]
            else:
                args = ["serve", "--standby", "--allow-model", allowed, "--port", "0", *replica_args]
            cluster.standby.append(_child(f"standby {i + 1}", args, echo, env))
        urls = [child.wait_address() for child in cluster.replicas]
        waiting = [child.wait_address() for child in cluster.standby]
        if vllm:
            for url in urls:
                activate(url, allowed, admin_key)
        args = [
            "router",
            *(arg for url in urls for arg in ("--replica", url)),
            *(arg for url in waiting for arg in ("--standby", url)),
            *router_args,
        ]
        cluster.router = _child("router", args, echo, env)
        cluster.router.wait_address()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def activate(url: str, model: str, admin_key: str | None, timeout: float = 60.0) -> None:
    """Tell the standby at ``url`` to load ``model`` (``POST /v1/preheat/load``; it answers at once and loads
    behind its ``/health``); ``ProcessError`` with the standby's own reason when it refuses."""
    headers = {"Content-Type": "application/json"}
    if admin_key:
        headers["Authorization"] = f"Bearer {admin_key}"
    body = json.dumps({"model": model, "wait": False}).encode()
    try:
        answer = request(url + LOAD_ROUTE, "POST", body=body, headers=headers, timeouts=Timeouts.within(timeout),
                         max_body=1 << 20)  # fmt: skip
    except HTTPClientError as exc:
        raise ProcessError(f"{url}{LOAD_ROUTE}: {exc}") from None
    if answer.status not in (200, 202):
        raise ProcessError(f"{url}{LOAD_ROUTE} answered {answer.status}: {answer.body[:500].decode(errors='replace')}")


def _child(name: str, args: Sequence[str], echo: Callable[[str], None], env: Mapping[str, str] | None) -> Child:
    return Child(name, args, echo=echo, env=env, own_group=True, merge_stderr=True)


def wait_healthy(router_url: str, replicas: int, timeout: float, alive: Callable[[], bool], standby: int = 0) -> None:
    """Poll the router's ``/health`` until all ``replicas`` are in rotation and the router has seen all ``standby``
    replicas waiting (or serving already); ``ProcessError`` on timeout or if a child exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise ProcessError("a child process exited while the cluster was starting; its output is above")
        serving, waiting = _replicas_healthy(router_url + "/health")
        if serving >= replicas and waiting >= standby:
            return
        time.sleep(0.2)
    raise ProcessError(f"the replicas were not all healthy after {timeout:.0f} s")


def _replicas_healthy(url: str) -> tuple[int, int]:
    """How many replicas the router's ``/health`` (200 or 503, JSON either way) says are in rotation (given with
    ``--replica``), and how many standby replicas are waiting or serving; (0, 0) while it does not answer."""
    try:
        status = loads_bounded(request(url, timeouts=Timeouts.within(5.0), max_body=1 << 20).body, max_bytes=1 << 20)
    except (HTTPClientError, ValueError):  # ValueError: jsonsafe's JSONInputError
        return 0, 0
    replicas = status.get("replicas", []) if isinstance(status, dict) else []
    listed = [r for r in replicas if isinstance(r, dict)]
    serving = sum(bool(r.get("healthy")) for r in listed if not r.get("standby"))
    waiting = sum(bool(r.get("healthy")) or r.get("state") == "standby" for r in listed if r.get("standby"))
    return serving, waiting


# -- the KV tiers of the replicas, once they are ready: a tier that is down is never silent ------------------------
TierStates = dict[str, float]  # a replica's preheat_kv_tier_up per tier: 1 up, 0 down


def replica_tiers(url: str, timeout: float = 5.0) -> TierStates | None:
    """The ``preheat_kv_tier_up`` gauge of each tier the replica at ``url`` has, from its ``/metrics`` (the series
    the dashboard reads too: one channel for a tier's state); None when it did not answer."""
    try:
        answer = request(url + "/metrics", timeouts=Timeouts.within(timeout), max_body=4 << 20)
    except HTTPClientError:
        return None
    if answer.status != 200:
        return None
    return by_label(parse(answer.body.decode("utf-8", "replace")), "preheat_kv_tier_up", "tier")


def tier_report(asked: Mapping[str, str], replicas: Sequence[tuple[str, TierStates | None]]) -> tuple[str, list[str]]:
    """``preheat up``'s line for the KV tiers (``KV: L1 2GiB up on 2/2 replicas, L2 fs:///tmp/kv up on 2/2
    replicas``) and a warning for each tier that is not up on every replica: down, not built (a checkpoint
    without an identity gets no L2), or not known (its ``/metrics`` did not answer). ``asked``: the tiers the
    command line asked for (``{"l2": "fs:///tmp/kv"}``, shown without credentials); ``replicas``: each replica's
    name and ``replica_tiers``. Pure. ``("", [])`` when no tier was asked for or reported.

    >>> tier_report({"l2": "fs:///kv"}, [("replica 1", {"l2": 1.0}), ("replica 2", {"l2": 0.0})])[1]
    ['KV L2 fs:///kv is DOWN on replica 2: requests there recompute what it would hold (its log above says why)']
    """
    reported = {tier for _, states in replicas for tier in states or {}}
    parts, warnings = [], []
    for tier in sorted(set(asked) | reported):
        name = " ".join(filter(None, (tier.upper(), asked.get(tier))))
        down, absent, unknown = [], [], []
        for replica, states in replicas:
            if states is None:
                unknown.append(replica)
            elif tier not in states:
                absent.append(replica)
            elif not states[tier]:
                down.append(replica)
        bad = len(down) + len(absent) + len(unknown)
        up = len(replicas) - bad
        parts.append(f"{name} up on {up}/{len(replicas)} replicas" if not bad else
                     f"{name} DOWN on {bad}/{len(replicas)} replicas")  # fmt: skip
        for who, what, why in (
            (down, "is DOWN", "log above says why"),
            (absent, "is not running", "log above says why"),
            (unknown, "is in an unknown state", "/metrics did not answer"),
        ):
            if who:
                whose = "its" if len(who) == 1 else "their"
                warnings.append(f"KV {name} {what} on {', '.join(who)}: requests there recompute what it would hold "
                                f"({whose} {why})")  # fmt: skip
    return (f"KV: {', '.join(parts)}" if parts else ""), warnings


def kv_report(cluster: Cluster, kv_l1: str | None, kv_l2: str | None) -> tuple[str, list[str]]:
    """``tier_report`` of the cluster's serving replicas, asked now (once they are healthy); standby replicas have
    no tiers before they load."""
    replicas = [(child.name, replica_tiers(child.url)) for child in cluster.replicas if child.url is not None]
    return tier_report(asked_tiers(kv_l1, kv_l2), replicas) if replicas else ("", [])


def asked_tiers(kv_l1: str | None, kv_l2: str | None) -> dict[str, str]:
    """``tier_report``'s ``asked`` from ``preheat up``'s ``--kv-l1`` and ``--kv-l2``."""
    asked = {}
    if kv_l1 is not None:
        asked["l1"] = f"{kv_l1} of RAM" if kv_l1.strip().endswith("%") else kv_l1
    if kv_l2 is not None:
        asked["l2"] = shown_url(kv_l2)
    return asked


def shown_url(url: str) -> str:
    """An L2 URL as ``preheat up`` prints it: without a password or query (``redis://host:6379/0``)."""
    parts = urlsplit(url)
    if not parts.netloc:
        return url
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))
