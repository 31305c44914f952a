"""vLLM's whole start on preheat's timeline, the recording side: each vLLM process (API server, engine core, workers)
keeps the stages it runs and writes them to ``DIR/vllm-ROLE-PID.json`` (``PREHEAT_VLLM_STARTUP``); ``preheat timeline
DIR`` and the replica's ``/v1/preheat/timeline`` merge them (``preheat.timeline.merge``) from the API server's spawn,
or ``PREHEAT_T0``, to the first token.

vLLM-free: ``startup_hooks`` wraps vLLM's functions and calls the recorder; ``CATALOGUE`` names every stage the merged
timeline is expected to show, which process records it and what it covers, so a stage nobody observed is listed as
``unknown`` (or ``not_run``) instead of being missing. Stages are recorded in epoch seconds (``time.time()``, one
clock for every process of the machine); a process's own start comes from /proc. Recording observes vLLM and never
fails it: a write that fails is logged once and recording goes on in memory.

    recorder = begin(program="vllm 0.32.0", entered=time.time())   # in register(), once per process
    recorder.stage("model_build", start, end)                       # from a hook
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

from preheat.core import durable, env
from preheat.core.timeline import process_start_time
from preheat.timeline.merge import RECORD_KIND, RECORD_VERSION, ProcessRecord, ProcessStage, StageSpec

log = logging.getLogger("preheat.vllm")

OFF = ("off", "0", "false", "no")
PRUNE_AFTER_S = 7 * 24 * 3600  # records of starts older than a week are removed from the default directory
ROOT_ROLES = ("api_server", "frontend")
COMMAND_CHARS = 200  # of a process's command line in its record: enough to tell which helper it is
API = ["api_server"]
ROOT = list(ROOT_ROLES)
CORE = ["engine_core", "frontend"]  # the engine core: its own process, or an offline LLM's in-process engine
MODEL = ["engine_core", "worker", "frontend"]  # model work: the engine core, or its workers under TP/PP


def _spec(
    name: str, roles: list[str], help: str, *, nested: bool = False, optional: bool = False, gap_before: str = ""
) -> StageSpec:
    return {"name": name, "roles": roles, "nested": nested, "optional": optional, "gap_before": gap_before,
            "help": help}  # fmt: skip


# Every stage of `vllm serve` from spawn to the first token, in the order they run (docs/integrations.md). Gaps between
# recorded stages are named by the stage after them (``gap_before``), else ``other``.
CATALOGUE: tuple[StageSpec, ...] = (
    _spec("platform", ROOT, "PREHEAT_T0 (e.g. the pod's creation) to the API server's process start", optional=True),
    _spec("imports", ROOT, "interpreter start, vLLM's CLI and its imports, until preheat's plugin loads"),
    _spec("plugin", ROOT, "preheat's plugin: its loader registered, these hooks installed (and the vLLM modules "
          "they patch imported, which vLLM imports later anyway)"),
    _spec("argument_parsing", API, "the rest of vLLM's argument parser built and the command line parsed"),
    _spec("config", [*API, "frontend"], "EngineArgs.create_engine_config: config.json, platform, every config"),
    _spec("tokenizer", API, "the renderer and its tokenizer loaded (AsyncLLM)"),
    _spec("engine_core_imports", ["engine_core"], "the engine core's process: interpreter start, vLLM's imports, "
          "the start-up handshake, until preheat's plugin loads", gap_before="engine_core_spawn"),
    _spec("engine_core_plugin", ["engine_core"], "preheat's plugin in the engine core"),
    _spec("worker_imports", ["worker"], "a worker's process (TP/PP): interpreter start and imports",
          optional=True, gap_before="worker_spawn"),
    _spec("worker_plugin", ["worker"], "preheat's plugin in a worker", optional=True),
    _spec("device_init", MODEL, "the worker's device: distributed environment, model runner"),
    _spec("model_build", MODEL, "the model's modules built on the device (BaseModelLoader.create_model)"),
    _spec("weight_load", MODEL, "the load format's weights into the model, and their post-processing; bytes: the "
          "model's parameters"),
    _spec("weights_fetch", MODEL, "--load-format preheat: a remote source pulled into the node cache",
          nested=True, optional=True),
    _spec("weights_read", MODEL, "--load-format preheat: the checkpoint mapped or read, and checked",
          nested=True, optional=True),
    _spec("weights_handoff", MODEL, "--load-format preheat: vLLM copying the tensors into its parameters",
          nested=True, optional=True),
    _spec("kv_cache_profile", CORE, "KV-cache sizing: the profiling run (on CPU the warm-up) and free memory"),
    _spec("compile", MODEL, "torch.compile of the model, or vLLM loading its AOT-compiled code (detail: vLLM's "
          "counts of artifacts loaded from the cache, compiled and saved)",
          nested=True, optional=True),
    _spec("kv_cache_alloc", CORE, "the KV cache allocated (Executor.initialize_from_config)"),
    _spec("warmup", CORE, "compile_or_warm_up_model: warm-up runs and CUDA graph capture"),
    _spec("cuda_graph_capture", MODEL, "CUDA graphs captured (none under --enforce-eager or on a CPU)",
          nested=True, optional=True),
    _spec("api_server_setup", API, "the engine client ready, the FastAPI app built, uvicorn listening",
          gap_before="engine_core_handshake"),
    _spec("first_request", API, "the first request's arrival to its first token", optional=True,
          gap_before="waiting_for_request"),
)  # fmt: skip

# The stages a process observes by itself, by role: its imports (from its /proc start to the plugin) and the plugin's
# own time. The root also has ``platform`` (PREHEAT_T0 to its start).
_OWN = {
    "api_server": ("imports", "plugin"),
    "frontend": ("imports", "plugin"),
    "engine_core": ("engine_core_imports", "engine_core_plugin"),
    "worker": ("worker_imports", "worker_plugin"),
}


def directory() -> str | None:
    """Where records go: ``PREHEAT_VLLM_STARTUP``, else a private directory under the temp dir; None when off."""
    value = env.get(env.VLLM_STARTUP)
    if value is not None and value.lower() in OFF:
        return None
    return value or os.path.join(tempfile.gettempdir(), f"preheat-vllm-startup-{os.getuid()}")


def process_role(process_name: str | None = None) -> str:
    """This process's part in a vLLM start: ``engine_core``, ``worker`` (a process vLLM's executor started), or the
    main process: ``api_server`` under ``vllm serve``, ``frontend`` for an offline ``LLM``."""
    name = process_name if process_name is not None else multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine_core"
    if name != "MainProcess":
        return "worker"
    serving = any(
        m in sys.modules for m in ("vllm.entrypoints.cli.serve", "vllm.entrypoints.launchers.api_server.entry")
    )
    return "api_server" if serving else "frontend"


class Recorder:
    """One process's record (``merge.ProcessRecord``), written whole after each stage. Thread-safe. The first stage of
    a name wins (a span's later calls, a second request, are not the start)."""

    def __init__(
        self,
        where: str | None,
        *,
        role: str,
        program: str,
        t0: float | None = None,
        process_start: float | None = None,
    ) -> None:
        self.directory = where
        self.record: ProcessRecord = {
            "kind": RECORD_KIND,
            "version": RECORD_VERSION,
            "program": program,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "role": role,
            "command": " ".join(sys.argv)[:COMMAND_CHARS],
            "root": role in ROOT_ROLES,
            "process_start": process_start if process_start is not None else process_start_time(),
            "start_resolution": 1.0 / os.sysconf("SC_CLK_TCK"),
            "t0": t0,
            "hooks": {},
            "catalogue": list(CATALOGUE),
            "stages": [],
        }
        self._notes: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._failed = False

    @property
    def role(self) -> str:
        return self.record["role"]

    @property
    def path(self) -> str | None:
        if self.directory is None:
            return None
        return os.path.join(self.directory, f"vllm-{self.role}-{self.record['pid']}.json")

    def has(self, name: str) -> bool:
        with self._lock:
            return any(s["name"] == name for s in self.record["stages"])

    def stage(
        self,
        name: str,
        start: float,
        end: float,
        *,
        nbytes: int | None = None,
        detail: Mapping[str, object] | None = None,
    ) -> None:
        """Record stage ``name`` from ``start`` to ``end`` (epoch seconds), unless one was recorded already."""
        entry: ProcessStage = {"name": name, "start": start, "end": max(end, start), "detail": dict(detail or {})}
        if nbytes is not None:
            entry["bytes"] = nbytes
        self._add(entry)

    def mark(self, name: str, at: float | None = None, **detail: object) -> None:
        """An instant (``ready``, ``first_token``)."""
        at = time.time() if at is None else at
        self._add({"name": name, "start": at, "end": at, "detail": dict(detail)})

    def _add(self, entry: ProcessStage) -> None:
        name = entry["name"]
        with self._lock:
            if any(s["name"] == name for s in self.record["stages"]):
                return
            self.record["stages"].append(entry)
        self.write()

    def note(self, name: str, at: float | None = None) -> None:
        """Remember an instant another hook ends a stage with (first one wins; not written)."""
        with self._lock:
            self._notes.setdefault(name, time.time() if at is None else at)

    def noted(self, name: str) -> float | None:
        with self._lock:
            return self._notes.get(name)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def counted(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def hook(self, stage: str, status: str) -> None:
        """Whether ``stage`` can be observed in this process: ``installed``, or why not. A failure is not overwritten
        by a later success (a stage fed by two hooks needs both)."""
        with self._lock:
            if self.record["hooks"].get(stage, "installed") == "installed":
                self.record["hooks"][stage] = status

    def write(self) -> None:
        path = self.path
        if path is None or self._failed:
            return
        with self._lock:
            data = json.dumps(self.record).encode()
        try:
            durable.write_file(path, data)
        except OSError as exc:  # the timeline observes vLLM; it never stops it
            self._failed = True
            log.warning("preheat: cannot write vLLM's start-up stages to %s (%s); keeping them in memory", path, exc)


# This process's recorder under "current" (a holder, not a global statement); replaced in a forked child.
_process: dict[str, Recorder] = {}
_process_lock = threading.Lock()


def current() -> Recorder | None:
    """This process's recorder (None before ``begin`` or when recording is off). In a process forked from a recording
    one (vLLM's fork start method), a fresh record for the child: its pid, role and start, the hooks it inherited."""
    parent = _process.get("current")
    if parent is None or parent.record["pid"] == os.getpid():
        return parent
    with _process_lock:
        if _process.get("current") is parent:
            child = Recorder(parent.directory, role=process_role(), program=parent.record["program"])
            inherited = {k: v for k, v in parent.record["hooks"].items() if k not in _OWN.get(parent.role, ())}
            child.record["hooks"].update(inherited)
            if child.role in _OWN:
                child.record["hooks"][_OWN[child.role][0]] = "forked: its imports were inherited, not run"
            _process["current"] = child
    return _process.get("current")


def begin(*, program: str, entered: float, role: str | None = None) -> Recorder | None:
    """Start this process's record when the plugin loads (``entered``: epoch seconds of ``register()``'s call): the
    stages before the plugin (``platform``, ``imports``) from /proc and ``PREHEAT_T0``. Once per process; None when
    recording is off."""
    existing = _process.get("current")
    if existing is not None and existing.record["pid"] == os.getpid():
        return existing
    where = directory()
    if where is None:
        return None
    role = role or process_role()
    t0 = env.get(env.T0) if role in ROOT_ROLES else None
    recorder = Recorder(where, role=role, program=program, t0=t0)
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
    except OSError as exc:
        log.warning("preheat: cannot create %s for vLLM's start-up stages (%s); not recording them", where, exc)
        recorder.directory = None
    if recorder.record["root"] and recorder.directory is not None and env.get(env.VLLM_STARTUP) is None:
        _prune(recorder.directory)
    started = recorder.record["process_start"]
    if recorder.record["root"]:
        recorder.hook("platform", "installed")
        if t0 is not None:  # /proc reads a start up to a tick early: a start within a tick of T0 is an instant
            recorder.stage("platform", t0, max(t0, started))
    if role in _OWN:
        imports, plugin = _OWN[role]
        recorder.hook(imports, "installed")
        recorder.hook(plugin, "installed")
        recorder.stage(imports, started, entered)
    _process["current"] = recorder
    return recorder


def plugin_done(recorder: Recorder, entered: float) -> None:
    """The plugin's own stage, from ``register()``'s call to now (after the hooks are installed)."""
    now = time.time()
    recorder.note("plugin_done", now)
    if recorder.role in _OWN:
        recorder.stage(_OWN[recorder.role][1], entered, now)
    else:
        recorder.write()


def _prune(where: str) -> None:
    """Remove records of starts older than ``PRUNE_AFTER_S`` from the default directory (each start adds a few kB)."""
    cutoff = time.time() - PRUNE_AFTER_S
    with contextlib.suppress(OSError), os.scandir(where) as entries:  # tidying up never stops a start
        for entry in entries:
            if entry.name.startswith("vllm-") and entry.name.endswith(".json") and entry.stat().st_mtime < cutoff:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
