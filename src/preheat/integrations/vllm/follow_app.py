"""``vllm serve`` following a refit name: the API server's side, installed by the plugin's ``build_app`` hook when
``PREHEAT_VLLM_FOLLOW=NAME`` is set (docs/integrations.md, *vLLM: live weight updates from a Publisher*).

    PREHEAT_VLLM_FOLLOW=policy PREHEAT_REGISTRY=redis://reg:6379 PREHEAT_VLLM_REFIT_TRUST_KEY=trainer.key.pub \\
        vllm serve ./policy-base --worker-extension-cls preheat.integrations.vllm.follow_worker.RefitWorker

Once vLLM has made its engine client, a ``follow.VllmFollower`` starts on a thread of the API server and drives the
engine on the server's event loop. The replica reports its version as preheat replicas do, so ``preheat router
--newest-version`` routes over vLLM replicas too: ``/health`` answers ``{"status": "ok", "version", "epoch",
"refit": {...}}`` (vLLM's own answer is an empty 200), each model of ``/v1/models`` has a ``"version"``, every answer
carries ``X-Preheat-Version``, and ``/metrics`` has the ``preheat_refit_*`` families of ``preheat serve --follow``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from preheat.artifacts.signing import TrustedKeys
from preheat.core import env
from preheat.core.errors import ConfigError, JSONInputError, PreheatError
from preheat.core.jsonsafe import loads_bounded
from preheat.http.metrics import Family
from preheat.refit.trust import require_trust

log = logging.getLogger("preheat.vllm")
VERSION_HEADER = b"x-preheat-version"
REWRITTEN = ("/health", "/v1/models")
MAX_REWRITE_BYTES = 1 << 22  # /v1/models lists a few models: anything larger passes through as vLLM wrote it
ENGINE_WAIT_S = 600.0  # vLLM sets app.state.engine_client right after build_app: seconds, not minutes


class Following:
    """The API server's follower, once started (None before: the app answers as vLLM does)."""

    def __init__(self) -> None:
        self.follower: Any = None  # Any: follow.VllmFollower, imported with torch only once following starts
        self.error: str | None = None


def install(app: Any) -> Following | None:  # Any: vLLM's FastAPI app
    """Follow ``PREHEAT_VLLM_FOLLOW`` in this API server (nothing when unset): the middleware and metrics now, the
    follower once the engine client exists. ``ConfigError`` for a name without a registry, or a registry beyond
    loopback without a trust key."""
    name = env.get(env.VLLM_FOLLOW)
    if not name:
        return None
    registry = env.get(env.REGISTRY)
    if not registry:
        raise ConfigError(f"PREHEAT_VLLM_FOLLOW={name} needs PREHEAT_REGISTRY: where the trainer announces versions")
    keys = env.get(env.VLLM_REFIT_TRUST_KEY)
    require_trust(registry, "127.0.0.1", keys)
    trusted = TrustedKeys.from_files(keys)
    _keep_warnings()
    state = Following()
    if getattr(app, "middleware_stack", None) is None:
        app.add_middleware(VersionMiddleware, state=state)
    else:  # built already (vLLM's SageMaker bootstrap builds it): wrapped from outside, Starlette's own way of calling
        app.middleware_stack = VersionMiddleware(app.middleware_stack, state=state)
    _register_metrics(state)
    loop = asyncio.get_running_loop()  # build_app runs on the server's loop
    start = {"loop": loop, "name": name, "registry": registry, "trusted": trusted}
    threading.Thread(target=_start, args=(app, state), kwargs=start, name="preheat-vllm-follow", daemon=True).start()
    return state


def _keep_warnings() -> None:
    """preheat's warnings in the replica's log: a version that failed, a holder that lied or died mid-pull, the
    follower's start. vLLM's API server imports its SageMaker standards package (``model_hosting_container_standards``),
    which sets the root logger to ERROR unless ``LOG_LEVEL`` or ``SAGEMAKER_CONTAINER_LOG_LEVEL`` says otherwise, and
    preheat's loggers took the root's level: every one of those warnings was dropped unseen. The ``preheat`` logger
    gets a level of its own (WARNING) when none is set; with no handler configured, Python's last-resort handler
    writes them to stderr, beside vLLM's own lines."""
    logger = logging.getLogger("preheat")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def _start(
    app: Any,  # Any: vLLM's FastAPI app, whose state gets the engine client
    state: Following,
    *,
    loop: asyncio.AbstractEventLoop,
    name: str,
    registry: str,
    trusted: TrustedKeys,
) -> None:
    from preheat.integrations.vllm.follow import AsyncHandle, VllmFollower

    end = time.monotonic() + ENGINE_WAIT_S
    client = None
    while client is None and time.monotonic() < end:
        client = getattr(app.state, "engine_client", None)
        if client is None:
            time.sleep(0.05)
    if client is None:
        state.error = "vLLM's engine client never appeared: not following"
        log.error("preheat: %s", state.error)
        return
    checkpoint = str(getattr(client.model_config, "model", "")) or None
    try:
        follower = VllmFollower(
            name, AsyncHandle(client, loop), checkpoint=checkpoint, registry=registry,
            token=env.get(env.PEER_TOKEN), trusted=trusted,
        )  # fmt: skip
        follower.check_engine()
    except PreheatError as exc:
        state.error = str(exc)
        log.error("preheat: not following %s: %s", name, exc)
        return
    state.follower = follower.start()
    where = follower.server.address if follower.server is not None else "not served"
    signed = f"signed by {trusted.describe()}" if trusted else "unsigned, from this machine only"
    log.warning("preheat: following versions of %s via %s (%s; refit server %s)", name, registry, signed, where)


def _version(state: Following) -> tuple[int | None, int | None]:
    follower = state.follower
    return (None, None) if follower is None else (follower.version, follower.epoch)


class VersionMiddleware:
    """ASGI middleware: ``X-Preheat-Version`` on every answer, the version in ``/health`` and ``/v1/models``.

    The header is the version a request ran on: the one served when it arrived, or, for one that arrived during a
    swap (its scheduling waited for the swap's end), the one served when its answer starts."""

    def __init__(self, app: Any, state: Following) -> None:  # Any: the ASGI app below, called as it is
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # Any: ASGI's scope and channels
        follower = self.state.follower
        if scope.get("type") != "http" or follower is None:
            if scope.get("type") == "http" and scope.get("path") == "/health":
                # Told to follow and cannot (yet): out of rotation, saying why, rather than serving the checkpoint
                # without a version (the follower starts once vLLM's engine client exists, after its /health would
                # first answer 200).
                error = self.state.error
                doc = {"status": "not_following", "error": error} if error else {"status": "loading", "stage": "follow"}
                body = json.dumps(doc).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await self.app(scope, receive, send)
            return
        arrived = None if follower.swapping else follower.version
        rewrite = scope.get("method") == "GET" and scope.get("path") in REWRITTEN
        held: list[dict[str, Any]] = []  # Any: ASGI messages

        async def sending(message: dict[str, Any]) -> None:  # Any: an ASGI message
            if message.get("type") == "http.response.start":
                served = arrived if arrived is not None else follower.version
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != VERSION_HEADER]
                headers.append((VERSION_HEADER, str(served or 0).encode()))
                message = {**message, "headers": headers}
                if rewrite:
                    held.append(message)
                    return
            elif rewrite and message.get("type") == "http.response.body":
                held.append(message)
                if message.get("more_body"):
                    return
                for out in _rewritten(scope.get("path", ""), held, follower):
                    await send(out)
                return
            await send(message)

        await self.app(scope, receive, sending)


def _rewritten(path: str, held: list[dict[str, Any]], follower: Any) -> list[dict[str, Any]]:  # Any: ASGI, follower
    """``/health`` or ``/v1/models`` with the version in its body; as vLLM wrote it when it cannot be read."""
    start, bodies = held[0], held[1:]
    body = b"".join(m.get("body", b"") for m in bodies)
    if start.get("status") != 200 or len(body) > MAX_REWRITE_BYTES:
        return held
    if path == "/health":
        doc: object = {"status": "ok", "version": follower.version, "epoch": follower.epoch, "refit": follower.status()}
    else:
        try:
            doc = loads_bounded(body, max_bytes=MAX_REWRITE_BYTES, max_depth=16)
        except (JSONInputError, UnicodeDecodeError):
            return held
        models = doc.get("data") if isinstance(doc, dict) else None
        for model in models if isinstance(models, list) else []:
            if isinstance(model, dict):
                model["version"] = follower.version
    new = json.dumps(doc).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-length", str(len(new)).encode()), (b"content-type", b"application/json")]
    return [{**start, "headers": headers}, {"type": "http.response.body", "body": new, "more_body": False}]


def _register_metrics(state: Following) -> None:
    """The ``preheat_refit_*`` families in vLLM's ``/metrics`` (prometheus_client's default registry, which vLLM's
    single API server exposes)."""
    try:
        from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
    except ImportError:  # vLLM depends on prometheus_client; without it there is no /metrics to add to
        return

    class RefitCollector:
        def collect(self) -> Any:  # Any: prometheus_client's metric families
            follower = state.follower
            if follower is None:
                return
            from preheat.server.following import metric_families

            for family in metric_families(follower):
                yield _prometheus(family, CounterMetricFamily, GaugeMetricFamily)

    try:
        REGISTRY.register(RefitCollector())  # a collector is anything with collect()
    except ValueError as exc:  # registered already in this process (a second app): the first one reports
        log.warning("preheat: the preheat_refit_* metrics are not added again: %s", exc)


def _prometheus(family: Family, counter: Any, gauge: Any) -> Any:  # Any: prometheus_client's classes and family
    labels = sorted({k for labels, _ in family.samples for k in labels})
    if family.kind == "counter":
        out = counter(family.name.removesuffix("_total"), family.help, labels=labels)
    else:
        out = gauge(family.name, family.help, labels=labels)
    for sample_labels, value in family.samples:
        out.add_metric([sample_labels.get(k, "") for k in labels], value)
    return out
