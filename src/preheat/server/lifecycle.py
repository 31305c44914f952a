"""A replica's life after start-up: standby, activation, sleep and wake (docs/server.md, *Standby replicas*).

Phases, each what ``/health`` says (only ``ready`` answers 200, so a router or a readiness probe never sends traffic
to a replica in any other):

    loading ──► ready ◄──► sleeping          (sleep / wake: POST /v1/preheat/sleep, /v1/preheat/wake)
       ▲          ▲
    standby ──────┘                           (activation: POST /v1/preheat/load {"model": URI})

- ``standby``: imports done, thread pools and kernels warm, listener bound, no model. An activation loads the model
  on the loading thread with a fresh timeline whose origin is the load request; if it fails (bad checksum, peer
  unreachable, model refused by the checkpoint), the replica goes back to ``standby`` with ``last_error`` set.
- ``sleeping``: the weights and the KV pool are released (host memory on CPU: the mapped files are unmapped and the
  pool freed; on CUDA device memory, level 1 keeping a pinned host copy of the weights); the config, tokenizer,
  KV tiers, worker thread and listener stay. Level 2 also lets go of the node-cache entry (its lease), so the cache
  may evict it; a wake then pulls it again.
- A sleep waits for the requests already admitted (running and queued) up to ``timeout`` seconds while refusing new
  ones with 503; if they are not done by then, the sleep is refused with 409 and the replica serves on.

One transition at a time: a second one while one runs gets 409. The phase and that transition are ``Lifecycle``, a
part of ``ServerState`` (``preheat.server.state``); this module moves them. Who may ask for a transition (the
admin key, JSON only, no web page) is ``preheat.http.control``'s rule, checked by the handler before any body is read.
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from preheat.core.errors import APIError, JSONInputError, PreheatError
from preheat.core.jsonsafe import loads_bounded
from preheat.core.timeline import Timeline
from preheat.server.state import LOADING, READY, SLEEPING, STANDBY, WAKING, Asleep, Host, Kept, Loaded, ServerState

if TYPE_CHECKING:
    from preheat.engine import Engine
    from preheat.server.settings import ServeSettings

log = logging.getLogger("preheat.server")

DEFAULT_SLEEP_TIMEOUT = 30.0  # seconds a sleep waits for admitted requests before it is refused
TRANSITION_WAIT_S = 5.0  # at most, for the thread that loaded the engine to return (``Lifecycle.transition``)
MAX_CONTROL_BODY = 64 * 1024
# What an activation imports besides the engine: a standby replica imports them while it waits.
ACTIVATION_MODULES = (
    "jinja2.sandbox",
    "jinja2.ext",
    "preheat.server.generation",
    "preheat.server.kvtier",
    "preheat.server.peering",
    "preheat.server.worker",
    "preheat.sources.http",
    "preheat.store.pull",
    "preheat.text.tokenizer",
)


class ControlResponder(Protocol):
    """Where a control route's answer goes (the HTTP handler)."""

    def send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None: ...

    def send_error_json(self, error: APIError, headers: dict[str, str] | None = None) -> None: ...


def conflict(phase: str, action: str) -> APIError:
    """409 for a transition asked for in the wrong phase."""
    return APIError(409, f"cannot {action}: the replica is {phase}", type="invalid_request_error", code=f"is_{phase}")


def parse_body(body: bytes) -> dict[str, object]:
    """The JSON object of a control request (empty body = ``{}``); ``APIError`` 400 otherwise."""
    if not body.strip():
        return {}
    try:
        value = loads_bounded(body, max_bytes=MAX_CONTROL_BODY, max_depth=4)
    except (JSONInputError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_type")
    return value


def _field(body: dict[str, object], name: str, kinds: tuple[type, ...], default: object) -> object:
    value = body.get(name, default)
    wrong = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
    if value is not default and wrong:
        what = " or ".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{name}' must be a {what}", param=name, code="invalid_type")
    return value


# -- standby ---------------------------------------------------------------------------------------------------------
def prepare_standby(httpd: Host, say: Callable[[str], None]) -> None:
    """Do everything that does not depend on a model, then wait in ``standby``: the engine's imports (torch), the
    kernels' lazy initialisation and thread pool (``engine_warm``), and the modules an activation would import
    (node cache, HTTP and peer pulls, KV tiers, jinja2), each on the standby's own timeline."""
    from preheat.server.prepare import start_engine_imports

    state = httpd.state
    timeline = state.timeline
    imports = start_engine_imports(timeline)
    state.life.imports = imports
    try:
        with timeline.stage("standby_imports"):
            _import_activation_modules()
        imports.wait()
        with timeline.stage("engine_warm"):
            from preheat.engine.engine import warm_kernels

            warm_kernels()
    except Exception as exc:  # a replica that cannot import its engine can never serve: exit 1, as a failed load
        if not isinstance(exc, PreheatError):
            log.exception("standby preparation failed")
        state.load_error = str(exc) if isinstance(exc, PreheatError) else f"{type(exc).__name__}: {exc}"
        httpd.shutdown()
        return
    timeline.mark("standby")
    state.life.prepared = True
    resume_gc()
    say(
        f"preheat serve: standby ({timeline.now():.2f} s after {timeline.origin_source}); allowed models: "
        f"{', '.join(state.settings.allowed_models)}"
    )


def resume_gc() -> None:
    """Once the start is done (``ready``, or a standby replica prepared): freeze what the start created and collect
    again. ``preheat serve`` runs its start with the cyclic collector off: torch's import alone creates ~1M objects,
    and the collections that scanned them again and again took ~0.25 s of a 1.2-1.4 s import here. Frozen, they are
    never scanned again either, so the collections the first requests trigger stay cheap; a sleep unfreezes them
    before it collects what it released."""
    gc.freeze()
    gc.enable()


def _import_activation_modules() -> None:
    for name in ACTIVATION_MODULES:  # each import here is paid now, not during an activation
        importlib.import_module(name)


# -- activation ------------------------------------------------------------------------------------------------------
def handle_load(responder: ControlResponder, state: ServerState, body: bytes, say: Callable[[str], None]) -> None:
    """``POST /v1/preheat/load {"model": URI, "served_model_name"?: str, "wait"?: bool}``."""
    from preheat.server.allow import normalize, refusal

    arrived = time.time()
    request = parse_body(body)
    model = _field(request, "model", (str,), None)
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: a checkpoint directory or URI", param="model", code="missing")
    name = _field(request, "served_model_name", (str,), None)
    wait = bool(_field(request, "wait", (bool,), False))
    why = refusal(model, state.settings.allowed_models)
    if why is not None:
        raise APIError(403, why, type="permission_error", param="model", code="model_not_allowed")
    # What was matched is what is loaded: the normal form, never the string sent (an origin that decodes %2e%2e
    # and resolves it would otherwise serve another path than the one allowed).
    model = normalize(model)
    life = state.life
    blocking = life.begin((STANDBY,), LOADING)
    if blocking is not None:
        raise conflict(blocking, "load a model")
    # A body that names no served name keeps the one the replica was started with (--served-model-name).
    served = name if isinstance(name, str) else state.settings.served_model_name
    settings = replace(state.settings, model=model, served_model_name=served)
    timeline = Timeline(arrived, origin_source="load request")
    timeline.add("load_request", 0.0, 0.0, model=model)
    state.set_timeline(timeline)
    thread = threading.Thread(target=_activate, args=(state, settings, say), name="preheat-load", daemon=True)
    life.transition = thread
    thread.start()
    _answer(responder, state, wait, accepted={"status": LOADING, "model": model})


def _activate(state: ServerState, settings: ServeSettings, say: Callable[[str], None]) -> None:
    from preheat.server.loading import load

    life = state.life
    try:
        loaded = load(settings, state.timeline, imports=life.imports)
    except Exception as exc:  # any failure leaves the replica in standby, able to take the next activation
        _failed(state, STANDBY, exc, f"activation of {settings.model}")
        return
    state.settings = settings
    install(state, loaded, say)


def _failed(state: ServerState, back_to: str, exc: BaseException, what: str) -> None:
    if not isinstance(exc, PreheatError):
        log.exception("%s failed", what)
    message = str(exc) if isinstance(exc, PreheatError) else f"{type(exc).__name__}: {exc}"
    state.timeline.mark("failed", error=message)
    with state.life.lock:
        state.life.phase = back_to
        state.life.last_error = message
    gc.collect()  # whatever the failed load mapped or allocated goes now, not at the next collection
    state.life.done.set()


def install(state: ServerState, loaded: Loaded, say: Callable[[str], None], *, fresh_tiers: bool = True) -> None:
    """Put a loaded engine into service: metrics for its KV tiers, a worker, ``ready``; the peer server once."""
    from preheat.server.worker import Worker

    if loaded.engine.kv_tiers is not None and fresh_tiers:
        from preheat.server.kvtier import metric_families, summary

        tiers = loaded.engine.kv_tiers
        state.metrics.extra.append(lambda: metric_families(tiers))
        say(f"preheat serve: {summary(tiers, l2_asked=state.settings.kv.l2 is not None)}")
    worker = Worker(loaded.engine, state.metrics, max_queue=state.settings.max_queue)
    worker.start()
    state.loaded, state.worker = loaded, worker
    with state.life.lock:
        state.life.phase = READY
    state.ready.set()
    state.life.done.set()
    ready = next((s.start for s in state.timeline.stages() if s.name == "ready"), state.timeline.now())
    say(f"preheat serve: ready ({loaded.engine.model_name}, {ready:.2f} s after {state.timeline.origin_source})")
    if state.settings.peer and not state.life.peer_started:  # the replica becomes a peer once loaded (docs/peer.md)
        from preheat.server.peering import start_peer

        state.life.peer_started = True
        start_peer(state, loaded, say)


def _answer(responder: ControlResponder, state: ServerState, wait: bool, *, accepted: dict[str, object]) -> None:
    """202 at once, or (``wait``) the transition's outcome: 200 with the ready time, 500 with the error."""
    if not wait:
        responder.send_json(202, accepted)
        return
    state.life.done.wait()
    life = state.life
    if life.phase == READY:
        ready = next((s.start for s in state.timeline.stages() if s.name == "ready"), None)
        responder.send_json(200, {"status": "ok", "model": state.settings.model_name, "ready": ready})
    else:
        error = APIError(500, f"failed: {life.last_error}; the replica is {life.phase}", type="server_error")
        responder.send_error_json(error)


# -- sleep and wake --------------------------------------------------------------------------------------------------
def handle_sleep(responder: ControlResponder, state: ServerState, body: bytes) -> None:
    """``POST /v1/preheat/sleep {"level"?: 1|2, "timeout"?: seconds}``: synchronous; 200 once asleep."""
    request = parse_body(body)
    level = _field(request, "level", (int,), 1)
    if level not in (1, 2):
        raise APIError(400, "'level' is 1 (keep a host copy) or 2 (release everything)", param="level")
    timeout = _field(request, "timeout", (int, float), DEFAULT_SLEEP_TIMEOUT)
    assert isinstance(level, int)
    assert isinstance(timeout, (int, float))
    if not 0 <= timeout <= 3600:
        raise APIError(400, "'timeout' is 0-3600 seconds", param="timeout")
    life = state.life
    blocking = life.begin((READY,), "draining")
    if blocking is not None:
        raise conflict(blocking, "sleep")
    loaded, worker = state.loaded, state.worker
    assert loaded is not None
    assert worker is not None
    began = state.timeline.now()
    if not worker.drain(float(timeout)):
        with life.lock:
            life.phase = READY
        life.done.set()
        busy = APIError(
            409,
            f"requests still running after {timeout:g} s; the replica serves on (retry, or give a longer timeout)",
            code="busy",
        )
        responder.send_error_json(busy)
        return
    state.ready.clear()
    if life.transition is not None:
        life.transition.join(TRANSITION_WAIT_S)
    rss_before = resident_bytes()
    weights = _weight_bytes(loaded.engine)
    asleep = _release(state, loaded, level)
    worker.stop()
    state.loaded, state.worker = None, None
    del loaded, worker
    gc.unfreeze()  # the engine was created during the start (resume_gc): its cycles are collectable only unfrozen
    gc.collect()
    rss_after = resident_bytes()
    state.timeline.add("sleep", began, state.timeline.now(), level=level)
    with life.lock:
        life.asleep, life.phase = asleep, SLEEPING
    life.done.set()
    responder.send_json(
        200,
        {
            "status": SLEEPING,
            "level": level,
            "weight_bytes": weights,
            "rss_before": rss_before,
            "rss_after": rss_after,
            "released_bytes": max(rss_before - rss_after, 0),
        },
    )


def _release(state: ServerState, loaded: Loaded, level: int) -> Asleep:
    engine = loaded.engine
    kept = Kept.of(engine)
    offloaded = None
    if level == 1 and engine.device.type == "cuda" and engine.model is not None:
        engine.offload()  # weights to pinned host memory, KV pool dropped: device memory free
        offloaded = engine
    lease, loaded.lease = loaded.lease, None
    copy_lease, engine.copy_lease = engine.copy_lease, None
    if level == 2:
        for held in (lease, copy_lease):
            if held is not None:
                held.close()  # the node cache may now evict the entry (and the copy); a wake pulls (converts) again
        lease = copy_lease = None
    return Asleep(level, kept, loaded.path, offloaded, lease, copy_lease)


def handle_wake(responder: ControlResponder, state: ServerState, body: bytes, say: Callable[[str], None]) -> None:
    """``POST /v1/preheat/wake {"wait"?: bool}``: the weights back from the host copy, the node cache or a peer."""
    arrived = time.time()
    request = parse_body(body)
    wait = bool(_field(request, "wait", (bool,), False))
    life = state.life
    blocking = life.begin((SLEEPING,), WAKING)
    if blocking is not None:
        raise conflict(blocking, "wake")
    timeline = Timeline(arrived, origin_source="wake request")
    state.set_timeline(timeline)
    thread = threading.Thread(target=_wake, args=(state, say), name="preheat-wake", daemon=True)
    life.transition = thread
    thread.start()
    _answer(responder, state, wait, accepted={"status": WAKING})


def _wake(state: ServerState, say: Callable[[str], None]) -> None:
    from preheat.server.loading import load

    life = state.life
    asleep = life.asleep
    assert asleep is not None
    try:
        if asleep.offloaded is not None:
            engine = asleep.offloaded
            with state.timeline.stage("restore", device=str(engine.device)) as stage:
                stage.nbytes = engine.restore()
            state.timeline.mark("ready")
            loaded, asleep.lease = Loaded(engine, asleep.path, asleep.lease), None
        else:
            loaded = load(state.settings, state.timeline, imports=life.imports, keep=asleep.kept)
    except Exception as exc:  # the replica stays asleep; the next wake tries again
        _failed(state, SLEEPING, exc, "wake")
        return
    for lease in (asleep.lease, asleep.copy_lease):
        if lease is not None:
            lease.close()  # the load took its own lease on the same entry
    life.asleep = None
    install(state, loaded, say, fresh_tiers=False)


# -- memory ----------------------------------------------------------------------------------------------------------
def resident_bytes() -> int:
    """This process's resident set (``VmRSS``), in bytes; 0 where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            lines = [line for line in status if line.startswith("VmRSS:")]
        return int(lines[0].split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # not Linux: the answer then says 0, which no one mistakes for a size
        return 0


def _weight_bytes(engine: Engine) -> int:
    model = engine.model
    if model is None:
        return 0
    tensors = [model.embed, model.norm, *(t for layer in model.layers for t in vars(layer).values() if t is not None)]
    if model.lm_head is not model.embed:
        tensors.append(model.lm_head)
    return sum(int(t.numel() * t.element_size()) for t in tensors)
