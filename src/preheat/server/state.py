"""What a replica's request threads share: ``ServerState``, and the parts of it every server module reads.

``ServerState`` (settings, timeline, metrics, the loaded engine and its worker), ``Lifecycle`` (the phase and the one
transition that may run: ``preheat.server.lifecycle`` drives it), ``Loaded``/``Kept`` (what ``preheat.server.loading``
brings up and what a sleep keeps of it), and ``Host``, the HTTP server as a start's thread sees it. Every other
server module (app, lifecycle, loading, following, peering, generation) imports these from here, and this module
imports none of them: that is what keeps ``preheat.server`` free of import cycles (tests/unit/test_architecture.py).
Cheap to import: it is on the cold-start path, before the socket is bound.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from preheat.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from preheat.core.timeline import Timeline
    from preheat.dashboard.watch import Findings, ReplicaDashboard
    from preheat.engine import Engine
    from preheat.engine.config import ModelConfig
    from preheat.kv.tiered import TieredKV
    from preheat.refit.follower import Follower
    from preheat.server.prepare import EngineImports
    from preheat.server.settings import ServeSettings
    from preheat.server.worker import Worker
    from preheat.store.cache import Lease
    from preheat.text.process import TokenizerProcess
    from preheat.text.tokenizer import TextTokenizer

T = TypeVar("T")

# The phases of ``Lifecycle`` (``preheat.server.lifecycle`` draws how one leads to another).
STANDBY, LOADING, READY, SLEEPING, WAKING = "standby", "loading", "ready", "sleeping", "waking"


@dataclass
class Kept:
    """What a sleeping replica keeps of its engine: everything but the weights and the KV pool."""

    config: ModelConfig
    tokenizer: TextTokenizer
    kv_tiers: TieredKV | None

    @classmethod
    def of(cls, engine: Engine) -> Kept:
        return cls(engine.config, engine.tokenizer, engine.kv_tiers)


@dataclass
class Loaded:
    """The ready engine, and the cache lease that keeps a pulled checkpoint from being garbage-collected under it."""

    engine: Engine
    path: str
    lease: Lease | None = None


@dataclass
class Asleep:
    """What a sleeping replica holds: its kept engine parts, the level, and (CUDA level 1) the offloaded engine."""

    level: int
    kept: Kept
    path: str
    offloaded: Engine | None  # CUDA level 1: the engine with its weights in pinned host memory
    lease: Lease | None  # level 1 keeps the node-cache entry from being evicted; level 2 lets it go
    copy_lease: Lease | None = None  # the same for the converted copy the model mapped (preheat.engine.copies)


class Lifecycle:
    """The replica's phase and the one transition that may run at a time; shared by every request thread."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.lock = threading.Lock()  # guards phase changes (taken briefly: never held during a load)
        self.last_error: str | None = None
        self.imports: EngineImports | None = None  # a standby replica's engine import, started at once
        self.asleep: Asleep | None = None
        self.done = threading.Event()  # set when the running transition ends (``wait`` requests)
        self.peer_started = False
        self.prepared = False  # standby: imports and kernels done, an activation now pays only for its model
        # The thread of the last start, activation or wake. It answers (``done``) before it has returned, and until
        # it returns its frames hold the engine: a sleep waits for it, or what it frees would be freed after the
        # sleep had measured (a sleep right after a wake, on a busy machine, reported 0 bytes released).
        self.transition: threading.Thread | None = None

    def begin(self, allowed_from: tuple[str, ...], to: str) -> str | None:
        """Move to ``to`` if the phase is one of ``allowed_from``; otherwise the phase that stands in the way."""
        with self.lock:
            if self.phase not in allowed_from:
                return self.phase
            self.phase = to
            self.last_error = None
            self.done.clear()
            return None

    def close(self) -> None:
        """At shutdown: a sleeping replica's KV tiers (queued L2 writes) and node-cache lease."""
        asleep, self.asleep = self.asleep, None
        if asleep is None:
            return
        if asleep.kept.kv_tiers is not None:
            asleep.kept.kv_tiers.close()
        for lease in (asleep.lease, asleep.copy_lease):
            if lease is not None:
                lease.close()

    def health(self) -> dict[str, object]:
        """``/health``'s body for a phase other than ``ready`` and ``loading`` (the app answers those itself)."""
        body: dict[str, object] = {"status": self.phase}
        if self.phase == STANDBY:
            body["prepared"] = self.prepared
        if self.phase == SLEEPING and self.asleep is not None:
            body["level"] = self.asleep.level
        if self.last_error is not None:
            body["last_error"] = self.last_error
        return body


class ServerState:
    """What every request thread shares: settings, timeline, metrics, and (once ready) the engine and worker."""

    def __init__(self, settings: ServeSettings, timeline: Timeline) -> None:
        self.settings, self.timeline = settings, timeline
        self.created = int(time.time())
        self.loaded: Loaded | None = None
        self.worker: Worker | None = None
        self.refit: Follower | None = None  # --follow: the weights version served (server/following.py)
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.tokenize_lock = threading.Lock()  # tokenizer objects are not documented as thread-safe; encoding is cheap
        self._first_token_lock = threading.Lock()
        self._first_token_seen = False
        # A lambda, not the bound method: an activation or a wake replaces the timeline (set_timeline).
        self.metrics = ServerMetrics(lambda: self.timeline.stages(), self._load)  # noqa: PLW0108
        # standby / loading / ready / sleeping ...: preheat.server.lifecycle
        self.life = Lifecycle(STANDBY if settings.standby else LOADING)
        self.dashboard: ReplicaDashboard | None = None  # GET /dashboard's, made on the first visit (cold-start path)
        self.findings: Findings | None = None  # the doctor's, for the dashboard (run() is given them)
        self.text: TokenizerProcess | None = None  # the tokenizer process started at the start (run())

    def from_loaded(self, read: Callable[[Loaded], T]) -> T | None:
        """``read(loaded)`` while a model is loaded, else None: how a request thread takes one fact of the engine.

        Handlers keep what they read, never ``Loaded`` itself: a sleep gives the weights back only once the last
        reference to them goes, and a handler still writing its answer to a slow client would keep them."""
        loaded = self.loaded
        return read(loaded) if loaded is not None else None

    def set_timeline(self, timeline: Timeline) -> None:
        """Start a new timeline (an activation's or a wake's, from its request): its first token is marked anew."""
        with self._first_token_lock:
            self.timeline, self._first_token_seen = timeline, False

    def _load(self) -> tuple[int, int]:
        return self.worker.load() if self.worker is not None else (0, 0)

    def first_token(self, ttft: float) -> None:
        """Mark the first request's first token on the timeline, once per timeline."""
        with self._first_token_lock:
            if self._first_token_seen:
                return
            self._first_token_seen = True
        self.timeline.mark("first_request_ttft", ttft=ttft)

    def loading_stage(self) -> str:
        """The stage the loader is in now (a stage without an end yet), for ``/health`` while loading."""
        open_stages = [s.name for s in self.timeline.stages() if s.end is None]
        return str(open_stages[-1]) if open_stages else "starting"


class Host(Protocol):
    """The HTTP server that carries the state (``preheat.server.app.PreheatHTTPServer``), as the thread that loads
    the model or prepares a standby replica sees it: ``shutdown`` when the replica can never serve."""

    @property
    def state(self) -> ServerState: ...

    def shutdown(self) -> None: ...
