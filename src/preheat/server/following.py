"""``preheat serve --follow``: the server's side of live weight updates (``preheat.refit``, docs/refit.md).

Starts a ``Follower`` once the model is loaded, with swaps run by the generation worker between two requests (a
request that started on version N-1 finishes on N-1: its answer's ``X-Preheat-Version`` says so); reports the
version in ``/health``, ``/v1/models`` and the ``preheat_refit_*`` metrics; answers ``POST /v1/preheat/refit``;
refuses generation requests while more than ``--max-staleness`` versions behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from preheat.core.errors import APIError
from preheat.http.metrics import Family

if TYPE_CHECKING:
    from preheat.refit.follow import VersionFollower
    from preheat.refit.swap import SwapReport
    from preheat.server.lifecycle import ControlResponder
    from preheat.server.state import Loaded, ServerState

log = logging.getLogger("preheat.server")
REFIT_ROUTE = "/v1/preheat/refit"
VERSION_HEADER = "X-Preheat-Version"


def base_digests(path: str) -> dict[str, str]:
    """Per-tensor digests of the loaded checkpoint (its ``preheat.json``); {} without one: the first version then
    brings every tensor."""
    from preheat.checkpoint.layout import read_manifest

    manifest = read_manifest(path)
    if manifest is None or manifest.tp_world_size != 1:
        return {}
    return {t.name: t.digest for t in manifest.tensors}


def prepare_follow(state: ServerState, loaded: Loaded) -> None:
    """Make the ``Follower`` (``--follow``) before the replica turns ready, so ``/health`` and every answer carry the
    version from the first; ``start_follow`` starts it once the worker runs."""
    from preheat.artifacts.signing import TrustedKeys
    from preheat.refit.follower import Follower

    settings = state.settings
    assert settings.registry is not None  # ServeSettings.check_follow

    def run_between(fn: Callable[[], SwapReport]) -> SwapReport:
        assert state.worker is not None  # the follower starts after install()
        return state.worker.call_between(fn)

    def on_version(version: int) -> None:
        if state.worker is not None:  # on the worker thread, between two jobs: the next job runs on it
            state.worker.version = version

    follower = Follower(
        settings.refit_name,
        loaded.engine,
        registry=settings.registry,
        base_digests=base_digests(loaded.path),
        run_between=run_between,
        token=settings.peer_token,
        host=settings.peer_bind_host,
        tls=settings.tls,
        on_version=on_version,
        deadline_s=settings.refit_deadline,
        trusted=TrustedKeys.from_files(settings.refit_trust_key),
        max_jump=settings.refit_max_jump,
    )
    state.refit = follower
    state.metrics.extra.append(lambda: metric_families(follower))


def start_follow(state: ServerState, say: Callable[[str], None]) -> None:
    """Start following ``settings.refit_name``'s versions (after ``prepare_follow`` and the worker's start)."""
    follower, settings = state.refit, state.settings
    assert follower is not None  # prepare_follow
    follower.start()
    where = follower.server.address if follower.server is not None else "not served"
    signed = f"signed by {follower.trusted.describe()}" if follower.trusted else "unsigned, from this machine only"
    say(f"preheat serve: following versions of {settings.refit_name} via {settings.registry} ({signed}; refit "
        f"server {where})")  # fmt: skip


def metric_families(follower: VersionFollower) -> list[Family]:
    """The per-replica version gauge and the refit counters, for ``/metrics``."""
    last = follower.last
    return [
        Family("preheat_refit_version", "weights version served (0: the loaded checkpoint)", "gauge",
               [({}, float(follower.version or 0))]),
        Family("preheat_refit_newest_version", "newest version seen published", "gauge",
               [({}, float(follower.newest_seen or 0))]),
        Family("preheat_refit_behind", "published versions not served yet", "gauge", [({}, float(follower.behind))]),
        Family("preheat_refit_epoch", "epoch of the version served (the publisher's start, ms; 0: the checkpoint)",
               "gauge", [({}, float(follower.epoch or 0))]),
        Family("preheat_refit_abandoned_total", "pulls abandoned for a newer version", "counter",
               [({}, float(follower.abandoned))]),
        Family("preheat_refit_lies_total", "manifests or bytes from a holder that did not verify, by holder", "counter",
               [({"holder": h}, float(n)) for h, n in sorted(follower.liars().items())]),
        Family("preheat_refit_last_pull_bytes", "bytes pulled for the version served", "gauge",
               [({}, float(last.nbytes if last is not None else 0))]),
    ]  # fmt: skip


def stale_refusal(state: ServerState) -> APIError | None:
    """503 while the replica is more than ``--max-staleness`` versions behind the newest published."""
    follower, limit = state.refit, state.settings.max_staleness
    if follower is None or limit is None or follower.behind <= limit:
        return None
    return APIError(
        503,
        f"this replica serves version {follower.version or 0} of {follower.name}, {follower.behind} behind the newest "
        f"({follower.newest_seen}); more than --max-staleness {limit}: retry shortly or on another replica",
        type="service_unavailable",
        code="stale_weights",
    )


def _count_param(doc: dict[str, object], name: str) -> int | None:
    value = doc.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62):
        raise APIError(400, f"{name} must be a count", code=f"invalid_{name}", param=name)
    return value


def handle_refit(responder: ControlResponder, state: ServerState, body: bytes) -> None:
    """``POST /v1/preheat/refit {"version": N, "wait": false, "timeout": 60}``: look for version N (default: the
    newest) now; 202 with the status, or with ``wait`` 200 once served (504 when not within ``timeout``)."""
    from preheat.server.lifecycle import parse_body

    follower = state.refit
    if follower is None:
        raise APIError(404, "this replica does not follow versions (start it with --follow)", code="not_following")
    doc = parse_body(body)
    wait, timeout = doc.get("wait", False), doc.get("timeout", 60)
    # epoch: of the version asked for (the publisher's); default: the newest epoch seen
    version, epoch = _count_param(doc, "version"), _count_param(doc, "epoch")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 <= timeout <= 3600:
        raise APIError(400, "timeout must be seconds (0-3600)", code="invalid_timeout", param="timeout")
    follower.request(version)
    if not wait:
        responder.send_json(202, follower.status())
        return
    target = version if version is not None else (follower.newest_seen or 0)
    if follower.wait_for(target, float(timeout), epoch=epoch):
        responder.send_json(200, follower.status())
    else:
        responder.send_json(504, follower.status())
