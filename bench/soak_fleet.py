"""The soak's fleet and the faults done to it: Redis, the replicas, the router, and the two fault schedulers.

Every process runs on 127.0.0.1 in its own process group (``preheat.router.cluster.Child`` for ``preheat``
commands), is started from one long-lived thread (``Spawner``) and is SIGKILLed as a group by ``Fleet.close()``.
Used by ``bench/soak.py`` (its docstring describes the fleet and the faults).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from preheat.core.errors import PreheatError
from preheat.core.procs import Child, pdeathsig
from soak_attacks import MAX_EVENT_BYTES, HostileReplica, Trainer
from soak_clients import Fault

T = TypeVar("T")
HOST = "127.0.0.1"
REPLICA_KINDS = ("replica_kill", "replica_stop", "hostile_replica")
STORAGE_KINDS = ("redis_kill", "l2_truncate", "l2_corrupt", "l2_forge")
PUBLISHER_KINDS = ("rogue_publisher",)
FAULT_KINDS = REPLICA_KINDS + STORAGE_KINDS + PUBLISHER_KINDS
# Every kind but l2_forge, an attack that only a fleet secret (--mac) stops, by design; the hostile replica and the
# rogue publisher are stopped by what every fleet has (the router's bounds, --refit-trust-key).
DEFAULT_KINDS = tuple(k for k in FAULT_KINDS if k != "l2_forge")
NAME = "soak"  # the served model name, and the name the trainer publishes versions under
_PREFIX = struct.Struct("<8sII")  # a KV chunk's magic, version, header length (docs/kv-cache.md)
_TAG_BYTES = 32  # the keyed tag after the payload of a version-2 chunk
START_TIMEOUT = 180.0  # a replica's start on a busy machine: a hang bound, not a speed target


# -- small HTTP helpers -------------------------------------------------------------------------------------------
def get_json(url: str, timeout: float = 5.0) -> Any:  # Any: whatever JSON the server sent
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        with exc:
            return json.load(exc)


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {series: value}; empty when the process does not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[series] = float(value)
    return out


def kv_counters(url: str) -> dict[str, float]:
    """The replica's KV hits, corrupt chunks and errors per tier, and the refit holders it caught lying (zeros when
    it does not answer)."""
    m = metrics(url)
    out = {
        f"{name}_{tier}": m.get(f'preheat_kv_{name}_total{{tier="{tier}"}}', 0.0)
        for name in ("hits", "corrupt", "errors")
        for tier in ("l1", "l2")
    }
    out["refit_lies"] = sum(v for k, v in m.items() if k.startswith("preheat_refit_lies_total"))
    return out


def served_version(url: str) -> int | None:
    """The weights version the replica serves (``/health``), None before its first or when it does not answer."""
    try:
        version = get_json(url + "/health").get("version")
    except (OSError, ValueError):
        return None
    return version if isinstance(version, int) else None


def wait_until(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if condition():
                return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_healthy(url: str) -> None:
    """Until the replica at ``url`` has loaded its model (``/health`` 200)."""
    wait_until(lambda: get_json(url + "/health").get("status") == "ok", f"{url}/health", START_TIMEOUT)


# -- processes ----------------------------------------------------------------------------------------------------
class Spawner:
    """Starts every child of the soak from one thread that lives as long as the fleet.

    ``PR_SET_PDEATHSIG`` (which ``Child`` and ``Redis`` arm) fires when the *thread* that forked the child exits, not
    its process: a replica restarted from a fault scheduler's thread got SIGTERM as soon as that thread finished.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="soak spawner")

    def run(self, start: Callable[[], T]) -> T:
        return self._pool.submit(start).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Redis:
    """``redis-server`` without persistence in its own process group, restartable on the same port."""

    def __init__(self, binary: str, workdir: Path, spawner: Spawner, pids: list[int]) -> None:
        self.binary, self.workdir, self.spawner, self.pids = binary, workdir, spawner, pids
        with socket.socket() as sock:  # redis-server cannot pick a free port itself (--port 0 disables TCP)
            sock.bind((HOST, 0))
            self.port = int(sock.getsockname()[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # guards proc and _closed
        self._closed = False

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no"]

        def launch() -> None:  # under the lock: close() sees every start, and none happens after it
            with self._lock:
                if self._closed:
                    raise RuntimeError("not starting redis-server: the soak is shutting down")
                self.proc = subprocess.Popen(
                    [*command, "--dir", str(self.workdir)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
                )
                self.pids.append(self.proc.pid)

        self.spawner.run(launch)
        wait_until(self._pong, f"redis-server on port {self.port}", 30)

    def _pong(self) -> bool:
        with socket.create_connection((HOST, self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    def kill(self, *, last: bool = False) -> None:
        """SIGKILL redis-server (``last``: and never start it again)."""
        with self._lock:
            self._closed = self._closed or last
            proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Replica:
    """One soak replica: its arguments, its URL (its port is kept across restarts) and its current process."""

    name: str
    args: list[str]
    child: Child | None = None
    url: str = ""
    counters: list[dict[str, float]] = field(default_factory=list)  # KV counters of each killed incarnation


@dataclass(frozen=True)
class FleetConfig:
    model: str
    policy: str  # the router's --policy
    kv_l1: str  # each replica's --kv-l1
    chunk_tokens: int
    max_model_len: int
    mac: bool = False  # give the replicas a fleet secret (--kv-secret-file): they load only chunks signed with it
    seed: int = 0  # the hostile replica's choices


class Fleet:
    """Redis, a reference replica with no KV tier, 3 replicas (1 and 2 on the ``fs://`` L2, 3 on Redis) and the
    router; ``close()`` SIGKILLs every one of them (idempotent, safe at any point, and no start after it)."""

    def __init__(self, workdir: Path, config: FleetConfig) -> None:
        self.workdir, self.config = workdir, config
        self.pids: list[int] = []  # of every process ever started
        self.log = (workdir / "children.log").open("a", encoding="utf-8")
        self._lock = threading.Lock()  # guards the log, _live and _closed
        self._live: set[Child] = set()  # started and not killed yet
        self._closed = False
        self.l2_dir = workdir / "l2"
        self.l2_dir.mkdir()
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.spawner = Spawner()
        self.redis = Redis(binary, workdir, self.spawner, self.pids)
        self.replicas: list[Replica] = []
        self.reference: Child | None = None
        self.router: Child | None = None
        self.registry = f"file://{workdir / 'registry'}"  # where the replicas find the trainer's versions
        self.trainer: Trainer | None = None
        self.hostile = HostileReplica(config.seed)  # listed by the router from the start, out of rotation

    def echo(self, line: str) -> None:
        with self._lock:
            if not self.log.closed:
                self.log.write(f"{time.monotonic():.3f} {line}\n")
                self.log.flush()

    def spawn(self, name: str, args: list[str]) -> Child:
        def start() -> Child:  # registered under the lock: close() sees every child, and none starts after it
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"not starting {name}: the soak is shutting down")
                child = Child(name, args, echo=self.echo, own_group=True, merge_stderr=True)
                self.pids.append(child.pid)
                self._live.add(child)
                return child

        return self.spawner.run(start)

    def kill_child(self, child: Child) -> None:
        """SIGKILL the child's whole process group (a stopped group too) and reap it."""
        with self._lock:
            self._live.discard(child)
        child.signal_group(signal.SIGKILL)
        child.reap(10)
        child.close()

    def start(self) -> None:
        """Start Redis, the reference replica and the 3 replicas (their loads overlap); wait until all answer."""
        c = self.config
        self.redis.start()
        common = ["serve", c.model, "--host", HOST, "--served-model-name", NAME, "--max-model-len",
                  str(c.max_model_len)]  # fmt: skip
        self.trainer = Trainer(NAME, c.model, self.registry, self.workdir)
        follow = ["--registry", self.registry, "--follow", "--refit-trust-key", self.trainer.public_key]
        tiers = [*follow, "--kv-l1", c.kv_l1, "--kv-chunk-tokens", str(c.chunk_tokens)]
        if c.mac:
            secret = self.workdir / "kv-secret"
            secret.write_text(os.urandom(32).hex() + "\n")
            secret.chmod(0o600)
            tiers += ["--kv-secret-file", str(secret)]
        self.reference = self.spawn("reference", [*common, "--port", "0"])
        for i, l2 in enumerate([f"fs://{self.l2_dir}", f"fs://{self.l2_dir}", self.redis.url]):
            replica = Replica(f"replica {i + 1}", [*common, *tiers, "--kv-l2", l2])
            replica.child = self.spawn(replica.name, [*replica.args, "--port", "0"])
            self.replicas.append(replica)
        for replica in self.replicas:
            assert replica.child is not None
            replica.url = replica.child.wait_address(START_TIMEOUT)
            replica.args += ["--port", replica.url.rsplit(":", 1)[1]]  # a restart comes back at the same URL
        for url in [self.reference.wait_address(START_TIMEOUT), *(r.url for r in self.replicas)]:
            wait_healthy(url)
        self.hostile.twin = self.replicas[0].url

    def start_router(self) -> str:
        c = self.config
        replicas = [x for r in self.replicas for x in ("--replica", r.url)] + ["--replica", self.hostile.url]
        args = ["router", *replicas, "--policy", c.policy, "--model", c.model, "--kv-chunk-tokens", str(c.chunk_tokens),
                "--max-event-bytes", str(MAX_EVENT_BYTES), "--host", HOST, "--port", "0"]  # fmt: skip
        self.router = self.spawn("router", args)
        url = self.router.wait_address(START_TIMEOUT)
        self.wait_in_rotation(url, [r.url for r in self.replicas])
        return url

    def wait_in_rotation(self, router: str, urls: Sequence[str], timeout: float = 60.0) -> None:
        def ready() -> bool:
            healthy = {r["url"] for r in get_json(router + "/health", timeout=2)["replicas"] if r["healthy"]}
            return set(urls) <= healthy

        wait_until(ready, f"the router to have {', '.join(urls)} in rotation", timeout)

    def wait_out_of_rotation(self, router: str, url: str, timeout: float = 60.0) -> None:
        def out() -> bool:
            return not any(
                r["url"] == url and r["healthy"] for r in get_json(router + "/health", timeout=2)["replicas"]
            )

        wait_until(out, f"the router to take {url} out of rotation", timeout)

    def wait_for_version(self, version: int, timeout: float = START_TIMEOUT) -> None:
        """Until every replica serves ``version`` (a replica restarted meanwhile loads and follows it again)."""
        wait_until(lambda: all(served_version(r.url) == version for r in self.replicas),
                   f"every replica to serve version {version}", timeout)  # fmt: skip

    def stop_reference(self) -> None:
        if self.reference is not None:
            self.kill_child(self.reference)
            self.reference = None

    def signal(self, replica: Replica, signum: int) -> None:
        assert replica.child is not None
        replica.child.signal_group(signum)

    def kill(self, replica: Replica) -> float:
        """SIGKILL ``replica`` (after reading what this incarnation counted); returns ``time.monotonic()`` just
        before the signal: a stream the router opened while the counters were read is still open then."""
        replica.counters.append(kv_counters(replica.url))
        assert replica.child is not None
        at = time.monotonic()
        self.kill_child(replica.child)
        replica.child = None
        return at

    def restart(self, replica: Replica) -> None:
        """Start ``replica`` again on its port and wait until it loaded; a failed start is tried again (5 at most)."""
        for attempt in range(5):
            replica.child = self.spawn(f"{replica.name} (restart)", replica.args)
            try:
                replica.child.wait_address(START_TIMEOUT)
                break
            except PreheatError:  # it exited before listening (say, its port was not free yet)
                self.kill_child(replica.child)
                replica.child = None
                if attempt == 4:
                    raise
                time.sleep(1.0)
        wait_healthy(replica.url)

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a fault scheduler still running cannot start anything after this
            live = list(self._live)
        for child in live:
            self.kill_child(child)
        self.router, self.reference = None, None
        for replica in self.replicas:
            replica.child = None
        self.redis.kill(last=True)
        self.hostile.close()
        if self.trainer is not None:
            self.trainer.close()
        self.spawner.close()  # last: its thread's exit sends PDEATHSIG, which must find nothing alive
        with self._lock:
            self.log.close()


# -- faults -------------------------------------------------------------------------------------------------------
class Scheduler:
    """Three seeded fault tracks in threads, one fault at a time each: replicas (``REPLICA_KINDS``), storage
    (``STORAGE_KINDS``) and publishers (``PUBLISHER_KINDS``). Each runs its kinds in a shuffled order, cycle after
    cycle, a 0.5-2 s gap before each.

    After ``phase_over`` a track stops once it injected each of its kinds at least once; ``hard_stop`` stops it
    whatever it did. A fault in progress always finishes its recovery first (restart, SIGCONT, Redis back).
    """

    def __init__(self, fleet: Fleet, router: str, seed: int, kinds: Sequence[str] = DEFAULT_KINDS) -> None:
        self.fleet, self.router, self.seed, self.kinds = fleet, router, seed, tuple(kinds)
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.phase_over, self.hard_stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._inject: dict[str, Callable[[random.Random], bool]] = {
            "replica_kill": self.replica_kill,
            "replica_stop": self.replica_stop,
            "redis_kill": self.redis_kill,
            "l2_truncate": lambda rng: self.damage_l2(rng, "l2_truncate"),
            "l2_corrupt": lambda rng: self.damage_l2(rng, "l2_corrupt"),
            "l2_forge": lambda rng: self.damage_l2(rng, "l2_forge"),
            "hostile_replica": self.hostile_replica,
            "rogue_publisher": self.rogue_publisher,
        }
        tracks = [(name, [k for k in kinds if k in self.kinds]) for name, kinds in
                  (("replicas", REPLICA_KINDS), ("storage", STORAGE_KINDS),
                   ("publishers", PUBLISHER_KINDS))]  # fmt: skip
        self._threads = [
            threading.Thread(target=self._track, args=(name, kinds), name=f"faults {name}", daemon=True)
            for name, kinds in tracks
            if kinds
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def injected(self) -> dict[str, int]:
        with self._lock:
            return {kind: sum(f.kind == kind for f in self.faults) for kind in self.kinds}

    def _record(self, fault: Fault) -> int:
        with self._lock:
            self.faults.append(fault)
            return len(self.faults) - 1

    def _lasted(self, index: int, seconds: float) -> None:
        with self._lock:
            self.faults[index] = replace(self.faults[index], seconds=seconds)

    def _track(self, name: str, kinds: Sequence[str]) -> None:
        rng = random.Random(f"{self.seed}:faults:{name}")
        done: set[str] = set()
        try:
            while not self.hard_stop.is_set():
                order = list(kinds)
                rng.shuffle(order)
                for kind in order:
                    if self.hard_stop.wait(rng.uniform(0.5, 2.0)):
                        return
                    if self.phase_over.is_set() and done >= set(kinds):
                        return
                    if self._inject[kind](rng):
                        done.add(kind)
        except Exception as exc:  # reported in the results: a fault the fleet did not recover from
            self.errors.append(f"{name} track: {type(exc).__name__}: {exc}")

    def replica_kill(self, rng: random.Random) -> bool:
        replica = rng.choice(self.fleet.replicas)
        at = self.fleet.kill(replica)  # the kill's own instant: reading the counters first took a while (a CI flake)
        index = self._record(Fault("replica_kill", replica.url, at))
        time.sleep(rng.uniform(0.1, 1.0))
        self.fleet.restart(replica)
        self.fleet.wait_in_rotation(self.router, [replica.url])
        self._lasted(index, time.monotonic() - at)
        return True

    def replica_stop(self, rng: random.Random) -> bool:
        replica = rng.choice(self.fleet.replicas)
        at, pause = time.monotonic(), rng.uniform(1.0, 5.0)
        self.fleet.signal(replica, signal.SIGSTOP)
        self._record(Fault("replica_stop", replica.url, at, pause))
        try:
            time.sleep(pause)
        finally:
            self.fleet.signal(replica, signal.SIGCONT)
        self.fleet.wait_in_rotation(self.router, [replica.url])
        return True

    def hostile_replica(self, rng: random.Random) -> bool:
        """The hostile replica says it is healthy for 2-5 s (longer, up to 30 s, until the router sent it a request):
        every request it gets is answered with something the router must refuse and retry elsewhere. False when the
        router sent it nothing."""
        hostile, at = self.fleet.hostile, time.monotonic()
        before = hostile.total()
        hostile.hostile.set()
        try:
            hold, most = at + rng.uniform(2.0, 5.0), at + 30.0
            while time.monotonic() < most and not self.hard_stop.is_set():
                if time.monotonic() >= hold and hostile.total() > before:
                    break
                time.sleep(0.1)
        finally:
            hostile.hostile.clear()
        self.fleet.wait_out_of_rotation(self.router, hostile.url)
        answered = hostile.total() - before
        if answered:
            self._record(Fault("hostile_replica", f"{hostile.url} ({answered} answers)", at, time.monotonic() - at))
        return answered > 0

    def rogue_publisher(self, rng: random.Random) -> bool:
        """Rogues publish a far version with a zeroed q_proj (one signed by another key, one unsigned), the trainer
        its next version; waits until every replica serves the trainer's, then the rogues go."""
        trainer, at = self.fleet.trainer, time.monotonic()
        assert trainer is not None
        try:
            rogue, honest = trainer.rogue_then_honest()
            index = self._record(Fault("rogue_publisher", f"versions {rogue}, {rogue + 1}; trainer {honest}", at))
            self.fleet.wait_for_version(honest)
            self._lasted(index, time.monotonic() - at)
        finally:
            trainer.close_rogues()
        return True

    def redis_kill(self, rng: random.Random) -> bool:
        at = time.monotonic()
        self.fleet.redis.kill()
        index = self._record(Fault("redis_kill", self.fleet.redis.url, at))
        time.sleep(rng.uniform(0.5, 3.0))
        self.fleet.redis.start()
        self._lasted(index, time.monotonic() - at)
        return True

    def damage_l2(self, rng: random.Random, kind: str) -> bool:
        """Truncate, flip one byte of, or forge 1-3 chunk files of the ``fs://`` L2 in place (no rename: as a failing
        disk, a torn copy or an attacker would). False when the L2 holds no chunk file yet."""
        files = sorted(self.fleet.l2_dir.rglob("*.kvc"))
        touched = []
        for path in rng.sample(files, min(len(files), rng.randint(1, 3))):
            with contextlib.suppress(FileNotFoundError):  # replaced or removed by a replica meanwhile
                size = path.stat().st_size
                if size == 0:
                    continue
                if kind == "l2_truncate":
                    os.truncate(path, rng.randrange(size))
                elif kind == "l2_forge":
                    forged = forge(path.read_bytes())
                    if forged is None:
                        continue
                    with path.open("r+b") as handle:
                        handle.write(forged)
                else:
                    offset = rng.randrange(size)
                    with path.open("r+b") as handle:
                        handle.seek(offset)
                        byte = handle.read(1)
                        handle.seek(offset)
                        handle.write(bytes([byte[0] ^ 0xFF]))
                touched.append(path.name)
        if touched:
            self._record(Fault(kind, ",".join(touched), time.monotonic()))
        return bool(touched)


def forge(blob: bytes) -> bytes | None:
    """``blob`` (a KV chunk file) with every K/V value negated and its checksum made right again: a well-formed chunk
    with wrong K/V, as anyone who can write the store but has no fleet secret could plant it (a keyed chunk keeps its
    old tag, which no longer matches). None for a chunk that is not whole, exact K/V (quantized, truncated)."""
    try:
        magic, version, header_len = _PREFIX.unpack_from(blob)
        if magic != b"PHKVCHNK":
            return None
        head_end = _PREFIX.size + header_len
        header = json.loads(blob[_PREFIX.size : head_end])
        end = len(blob) - (_TAG_BYTES if version == 2 else 0)
        payload = bytearray(blob[head_end:end])
        width = len(payload) // math.prod(header["shape"])
        if header["kind"] != "exact" or len(payload) != header["payload_bytes"] or width not in (2, 4):
            return None
    except (struct.error, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    payload[width - 1 :: width] = bytes(b ^ 0x80 for b in payload[width - 1 :: width])  # sign bits, little-endian
    header["checksum"] = xxhash.xxh3_128_hexdigest(bytes(payload))
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("ascii")
    if len(raw) > header_len:
        return None
    return bytes(blob[: _PREFIX.size]) + raw.ljust(header_len) + bytes(payload) + bytes(blob[end:])
