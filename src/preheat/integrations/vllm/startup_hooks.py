"""The hooks that put vLLM's start on preheat's timeline: wrappers around well-known vLLM functions, installed by
``register()`` in every vLLM process (the general plugin runs in each), each feeding ``startup.Recorder``.

Robust to versions by construction: a vLLM outside ``SUPPORTED_VLLM`` gets no hooks (its stages are ``unknown``, with
the version named); inside it, each target is looked up by module and attribute, and one that is missing leaves its
stages ``unknown`` with the name that was not found. A wrapper calls vLLM's function exactly as before and records
around it; a failure of the recording is logged, never raised into vLLM. Only the first call of a span counts: it is
the start. Targets (vLLM 0.32 and 0.33 share them), by process:

- API server: ``ServeSubcommand.cmd`` (parsing done), ``EngineArgs.create_engine_config``, ``renderer_from_config``
  (tokenizer), ``EngineCoreClient.make_async_mp_client`` (engine core up), uvicorn's ``Server.startup`` (listening),
  ``build_app`` (adds ``/v1/preheat/timeline`` and the first request's arrival), ``AsyncLLM.generate`` (first token);
- engine core / workers: ``WorkerWrapperBase.init_device``, ``BaseModelLoader.create_model`` and ``load_model``,
  ``Executor.determine_available_memory`` / ``initialize_from_config`` / ``compile_or_warm_up_model``,
  ``GPUModelRunner.capture_model``, ``monitor_torch_compile`` (with vLLM's compilation counter: artifacts),
  ``EngineCoreProc.run_busy_loop`` (engine ready).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from preheat.http.control import TIMELINE_ROUTE
from preheat.integrations.vllm import startup
from preheat.integrations.vllm.options import SUPPORTED_VLLM
from preheat.timeline.fetch import records_in
from preheat.timeline.merge import merge

log = logging.getLogger("preheat.vllm")

Func = Callable[..., Any]  # Any: vLLM's functions, with vLLM's signatures; the wrappers pass everything through
_MARK = "__preheat_startup_hook__"
_warned: set[str] = set()


def _safely(what: str, record: Callable[[], None]) -> None:
    """Run a recording step; a failure is logged once per step and never reaches vLLM."""
    try:
        record()
    except Exception as exc:  # the timeline observes vLLM; whatever goes wrong in it must not stop a start
        if what not in _warned:
            _warned.add(what)
            log.warning("preheat: start-up timeline: recording %s failed (%s: %s)", what, type(exc).__name__, exc)


# -- the kinds of wrapper --------------------------------------------------------------------------------------------


# What a span records once its function returned: (recorder, the function's result, its start, its end).
Record = Callable[[startup.Recorder, Any, float, float], None]  # Any: the wrapped function's result


def _span(stage: str, record: Record | None = None) -> Callable[[Func], Func]:
    """Stage ``stage`` = the first call of the function, from entry to return (``record`` records it instead)."""

    def make(original: Func) -> Func:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments and result, passed through
            started = time.time()
            result = original(*args, **kwargs)
            recorder = startup.current()
            if recorder is not None:
                now = time.time()
                if record is None:
                    _safely(stage, lambda: recorder.stage(stage, started, now))
                else:
                    _safely(stage, lambda: record(recorder, result, started, now))
            return result

        return wrapper

    return make


def _argument_parsing(original: Func) -> Func:
    """``ServeSubcommand.cmd``'s entry ends ``argument_parsing`` (from the plugin's end)."""

    @functools.wraps(original)
    def cmd(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments and result, passed through
        recorder = startup.current()
        begun = recorder.noted("plugin_done") if recorder is not None else None
        if recorder is not None and begun is not None:
            now = time.time()
            _safely("argument_parsing", lambda: recorder.stage("argument_parsing", begun, now))
        return original(*args, **kwargs)

    return cmd


def _engine_client(original: Func) -> Func:
    """``make_async_mp_client`` returns once the engine core answered its handshake: ``api_server_setup`` begins."""

    @functools.wraps(original)
    def make(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments and client, passed through
        client = original(*args, **kwargs)
        recorder = startup.current()
        if recorder is not None:
            recorder.note("engine_client_ready")
        return client

    return make


def _listening(original: Func) -> Func:
    """uvicorn's ``Server.startup`` returns with the socket served: ``api_server_setup`` ends, ``ready``."""

    @functools.wraps(original)
    async def start(server: Any, *args: Any, **kwargs: Any) -> Any:  # Any: uvicorn's server, passed through
        result = await original(server, *args, **kwargs)
        recorder = startup.current()
        if recorder is not None and not getattr(server, "should_exit", False):
            _safely("api_server_setup", lambda: _ready(recorder))
        return result

    return start


def _ready(recorder: startup.Recorder) -> None:
    now = time.time()
    begun = recorder.noted("engine_client_ready")
    if begun is not None:
        recorder.stage("api_server_setup", begun, now)
    recorder.mark("ready", now)


def _build_app(original: Func) -> Func:
    """The API server's app gets ``/v1/preheat/timeline`` and the ASGI middleware that notes the first request."""

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments and FastAPI app, passed through
        app = original(*args, **kwargs)
        _safely("the timeline route", lambda: _serve_timeline(app))
        _follow(app)  # not _safely: a replica told to follow a name must not serve without following it
        return app

    return build


def _follow(app: Any) -> None:  # Any: a FastAPI app
    """``PREHEAT_VLLM_FOLLOW``: the API server follows a refit name (``preheat.integrations.vllm.follow_app``)."""
    from preheat.core import env

    if env.get(env.VLLM_FOLLOW):
        from preheat.integrations.vllm.follow_app import install as follow

        follow(app)


def install_follow() -> str:
    """The ``build_app`` hook alone, when ``PREHEAT_VLLM_FOLLOW`` is set and the start-up timeline is off (which
    installs it otherwise): ``installed``, or why not."""
    from preheat.core import env

    if not env.get(env.VLLM_FOLLOW):
        return "not following"
    return _apply(next(h for h in HOOKS if h.wrap is _build_app))


def _serve_timeline(app: Any) -> None:  # Any: a FastAPI app (FastAPI is vLLM's dependency, not preheat's)
    app.add_api_route(TIMELINE_ROUTE, timeline_document, methods=["GET"], response_model=None, include_in_schema=False)
    app.add_middleware(FirstRequest)


def timeline_document() -> dict[str, object]:
    """The merged start of this API server and its engine processes, as ``preheat timeline`` reads it."""
    recorder = startup.current()
    if recorder is None or recorder.directory is None:
        return {"version": 1, "origin": 0.0, "origin_source": "process start", "total": 0.0, "stages": []}
    return dict(merge(records_in(recorder.directory), member=os.getpid()))


class FirstRequest:
    """ASGI middleware: notes when the first POST arrives (``first_request`` runs from there to its first token)."""

    def __init__(self, app: Any) -> None:  # Any: the ASGI app below, called as it is
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # Any: ASGI's scope and channels
        if scope.get("type") == "http" and scope.get("method") == "POST":
            recorder = startup.current()
            if recorder is not None:
                recorder.note("request_arrived")
        await self.app(scope, receive, send)


def _first_token(original: Func) -> Func:
    """``AsyncLLM.generate``: the first output of the first request ends ``first_request``; later requests get vLLM's
    own generator, unwrapped."""

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments and async generator, passed through
        stream = original(*args, **kwargs)
        recorder = startup.current()
        if recorder is None or recorder.has("first_request"):
            return stream
        return _watch_first(stream, recorder, time.time())

    return generate


async def _watch_first(
    stream: AsyncIterator[object], recorder: startup.Recorder, called: float
) -> AsyncIterator[object]:
    first = True
    try:
        async for output in stream:  # vLLM's RequestOutputs, passed on
            if first:
                first = False
                _safely("first_request", lambda: _first(recorder, called))
            yield output
    finally:
        closing = getattr(stream, "aclose", None)
        if closing is not None:
            await closing()


def _first(recorder: startup.Recorder, called: float) -> None:
    now = time.time()
    arrived = recorder.noted("request_arrived") or called
    recorder.stage("first_request", arrived, now, detail={"ttft": round(now - arrived, 6)})
    recorder.mark("first_request_ttft", now, ttft=round(now - arrived, 6))
    recorder.mark("first_token", now)


def _built(recorder: startup.Recorder, model: Any, started: float, now: float) -> None:  # Any: a torch module
    """``model_build``, and where ``weight_load`` begins. The bytes the weights will fill are counted here, before the
    load: post-processing may repack parameters (oneDNN on a CPU, quantized kernels) into non-parameters."""
    recorder.note("model_built", now)
    if recorder.counted("model_bytes") == 0:  # the first model is the start's (as for every stage)
        recorder.count("model_bytes", sum(p.numel() * p.element_size() for p in model.parameters()))
    recorder.stage("model_build", started, now)


def _weight_load(original: Func) -> Func:
    """``BaseModelLoader.load_model``: from the model built to the weights loaded and post-processed."""

    @functools.wraps(original)
    def load(loader: Any, *args: Any, **kwargs: Any) -> Any:  # Any: vLLM's loader, arguments and model
        started = time.time()
        model = original(loader, *args, **kwargs)
        recorder = startup.current()
        if recorder is not None:
            config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
            _safely("weight_load", lambda: _weights(recorder, loader, model, config, started))
        return model

    return load


def _weights(
    recorder: startup.Recorder,
    loader: object,  # vLLM's loader and ModelConfig: read by getattr only
    model: Any,  # Any: a torch module built by vLLM, whose parameters are counted
    config: object,
    called: float,
) -> None:
    built = recorder.noted("model_built")
    start = built if built is not None and built >= called else called
    nbytes = recorder.counted("model_bytes") or sum(p.numel() * p.element_size() for p in model.parameters())
    detail: dict[str, object] = {
        "load_format": str(getattr(getattr(loader, "load_config", None), "load_format", "")),
        "model": str(getattr(config, "model", "")),
    }
    if built is None or built < called:
        detail["includes"] = "model_build (this loader builds its model itself)"
    recorder.stage("weight_load", start, time.time(), nbytes=nbytes, detail=detail)


def _compile(original: Func) -> Func:
    """``monitor_torch_compile``, the context manager vLLM times its compiles (and its loads of AOT-compiled code)
    with: ``compile`` nests inside the stage it ran in; its detail is what vLLM's own compilation counter says about
    artifacts (loaded from the cache, or compiled and saved)."""

    @contextlib.contextmanager
    def monitor(*args: Any, **kwargs: Any) -> Iterator[None]:  # Any: vLLM's arguments, passed through
        started = time.time()
        with original(*args, **kwargs):
            yield
        recorder = startup.current()
        if recorder is not None:
            _safely("compile", lambda: recorder.stage("compile", started, time.time(), detail=_compile_counts()))

    return monitor


# vLLM's ``compilation_counter`` fields the ``compile`` stage reports (those this vLLM has), under shorter names.
COUNTERS = {
    "num_aot_artifacts_loaded": "aot_artifacts_loaded",
    "num_compiled_artifacts_loaded": "compiled_artifacts_loaded",
    "num_aot_compiles": "aot_compiles",
    "num_inductor_compiles": "inductor_compiles",
    "num_compiled_artifacts_saved": "compiled_artifacts_saved",
}


def _compile_counts() -> dict[str, object]:
    counter = getattr(sys.modules.get("vllm.compilation.counter"), "compilation_counter", None)
    return {name: getattr(counter, field) for field, name in COUNTERS.items() if hasattr(counter, field)}


def _engine_ready(original: Func) -> Func:
    @functools.wraps(original)
    def loop(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments, passed through
        recorder = startup.current()
        if recorder is not None:
            _safely("engine_core_ready", lambda: recorder.mark("engine_core_ready"))
        return original(*args, **kwargs)

    return loop


# -- the table -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hook:
    """``module``'s ``attribute`` (``Class.method`` or a function) wrapped by ``wrap`` in processes of ``roles``;
    the stages it feeds are unknown where it cannot be installed."""

    stages: tuple[str, ...]
    roles: tuple[str, ...]
    module: str
    attribute: str
    wrap: Callable[[Func], Func]


API, CORE, MODEL = ("api_server",), tuple(startup.CORE), tuple(startup.MODEL)
HOOKS: tuple[Hook, ...] = (
    Hook(("argument_parsing",), API, "vllm.entrypoints.cli.serve", "ServeSubcommand.cmd", _argument_parsing),
    Hook(("config",), (*API, "frontend"), "vllm.engine.arg_utils", "EngineArgs.create_engine_config", _span("config")),
    Hook(("tokenizer",), API, "vllm.v1.engine.async_llm", "renderer_from_config", _span("tokenizer")),
    Hook(("api_server_setup",), API, "vllm.v1.engine.core_client", "EngineCoreClient.make_async_mp_client",
         _engine_client),
    Hook(("api_server_setup",), API, "uvicorn.server", "Server.startup", _listening),
    Hook(("first_request",), API, "vllm.entrypoints.launchers.api_server.entry", "build_app", _build_app),
    Hook(("first_request",), API, "vllm.v1.engine.async_llm", "AsyncLLM.generate", _first_token),
    Hook(("device_init",), MODEL, "vllm.v1.worker.worker_base", "WorkerWrapperBase.init_device",
         _span("device_init")),
    Hook(("model_build",), MODEL, "vllm.model_executor.model_loader.base_loader", "BaseModelLoader.create_model",
         _span("model_build", _built)),
    Hook(("weight_load",), MODEL, "vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_model",
         _weight_load),
    Hook(("kv_cache_profile",), CORE, "vllm.v1.executor.abstract", "Executor.determine_available_memory",
         _span("kv_cache_profile")),
    Hook(("kv_cache_alloc",), CORE, "vllm.v1.executor.abstract", "Executor.initialize_from_config",
         _span("kv_cache_alloc")),
    Hook(("warmup",), CORE, "vllm.v1.executor.abstract", "Executor.compile_or_warm_up_model", _span("warmup")),
    Hook(("cuda_graph_capture",), MODEL, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.capture_model",
         _span("cuda_graph_capture")),
    Hook(("compile",), MODEL, "vllm.compilation.decorators", "monitor_torch_compile", _compile),
    Hook((), CORE, "vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", _engine_ready),
)  # fmt: skip
# Recorded by preheat's own loader (loader.py), so observable wherever the model is loaded.
LOADER_STAGES = ("weights_fetch", "weights_read", "weights_handoff")


def supported(version: str) -> bool:
    """>>> supported("0.32.0"), supported("0.31.2"), supported("unknown")
    (True, False, False)"""
    return ".".join(version.split(".")[:2]) in SUPPORTED_VLLM


def install(version: str, *, entered: float, role: str | None = None) -> startup.Recorder | None:
    """Begin this process's record and install the hooks of its role (once per process; forked children inherit
    them). A vLLM outside ``SUPPORTED_VLLM`` gets none: every stage they feed is ``unknown``, naming the version."""
    recorder = startup.begin(program=f"vllm {version}", entered=entered, role=role)
    if recorder is None:
        return None
    ok = supported(version)
    ranges = " and ".join(f"{v}.x" for v in SUPPORTED_VLLM)
    for hook in HOOKS:
        if recorder.role not in hook.roles:
            continue
        status = _apply(hook) if ok else f"vLLM {version} is outside the versions observed ({ranges})"
        for stage in hook.stages:
            recorder.hook(stage, status)
    if recorder.role in MODEL:
        for stage in LOADER_STAGES:
            recorder.hook(stage, "installed" if ok else f"vLLM {version} is outside the versions observed ({ranges})")
    startup.plugin_done(recorder, entered)
    return recorder


def apply(hook: Hook) -> str:
    """Install ``hook`` alone, whatever its roles (the vLLM standby's own hooks): ``installed``, or why not."""
    return _apply(hook)


def _apply(hook: Hook) -> str:
    """Wrap the hook's target: ``installed``, or why it cannot be (the module or attribute this vLLM lacks)."""
    try:
        owner: Any = importlib.import_module(hook.module)  # Any: a module, then maybe a class of it
    except ImportError as exc:
        return f"not observable in this vLLM: cannot import {hook.module} ({exc})"
    *path, name = hook.attribute.split(".")
    try:
        for part in path:
            owner = getattr(owner, part)
        raw = inspect.getattr_static(owner, name)
    except AttributeError:
        return f"not observable in this vLLM: {hook.module} has no {hook.attribute}"
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if not callable(function):
        return f"not observable in this vLLM: {hook.module}.{hook.attribute} is not a function"
    if getattr(function, _MARK, False):
        return "installed"  # a second register() in this process, or hooks inherited through fork
    wrapped = hook.wrap(function)
    setattr(wrapped, _MARK, True)
    if isinstance(raw, staticmethod):
        setattr(owner, name, staticmethod(wrapped))
    elif isinstance(raw, classmethod):
        setattr(owner, name, classmethod(wrapped))
    else:
        setattr(owner, name, wrapped)
    return "installed"
