"""preheat's blob store as LMCache's remote storage and SGLang HiCache's storage backend, against each engine's own
built-in store on the same disk (and Redis).

    .venv-engines/lmcache/bin/python bench/kvstore.py [--sizes 1,4,16] [--mib-per-size 256] [--rounds 3]
                                                      [--dir .bench/kvstore] [--json out.json]
    .venv-engines/sglang/bin/python bench/kvstore.py --engine sglang [same options]

Runs in the LMCache 0.5.6 venv. For each value size (an LMCache chunk of 1, 4 or 16 MiB: 1, 4 or 16 layers of
256 tokens x 8 KV heads x 128 head dim in bf16), every store is driven through LMCache's own ``RemoteConnector``
interface (``put``/``get`` coroutines on LMCache's event loop, as its ``RemoteBackend`` calls them), one value at a
time: LMCache's ``fs://`` connector and preheat's ``fs://`` on directories of the same filesystem, LMCache's
``redis://`` connector and preheat's ``redis://`` on one ``redis-server``. In a round, value ``i`` goes into every
store before value ``i+1`` (the stores' order rotating), then every store's value ``i`` is got back the same way:
whatever else the (shared) machine runs meanwhile slows all stores alike. Each round starts after an
``os.sync()`` (not timed); no store syncs its own writes (LMCache's ``fs://``, SGLang's ``file`` and preheat all
write a temporary file and rename it, no fsync). Prints put and get GB/s (bytes over the sum of per-value
latencies) and p50/p99 latency, the median over ``--rounds`` rounds, and preheat's ratio to the built-in store:
*paired*, the median over every value of the built-in store's time over preheat's for that value (two calls one
right after the other: what load disturbs least), and in brackets the median and range of the rounds' throughput
ratios. Then the cost of the XXH3-128 checksum alone on a value of that size.

``preheat-fs-nosum`` is preheat's ``fs://`` store run with its checksum replaced by a constant (patched into
``preheat.kv.chunkfile`` by this benchmark for that store's calls only; preheat itself has no such mode): the
same run's difference between it and ``preheat-fs`` is what the checksum costs, like for like.

Restart: after a round, a fresh connector (and a fresh LMCache local disk backend, which keeps its index in memory)
is built on the same directory, as a restarted process would, and counts the values it still finds (``exists``)
and can read (``get``, verified by preheat).

``--engine sglang`` (in the SGLang 0.5.23 venv): SGLang's own ``file`` backend (``HiCacheFile``) and preheat's
HiCache backend, both built by SGLang's ``StorageBackendFactory`` on directories of one filesystem (calls
interleaved as above, ``preheat-fs-nosum`` beside them), driven as HiCache's cache
controller drives them without zero-copy (``batch_set`` of host-pool pages, ``batch_get`` into the flat page tensor
the host pool hands out), one page of 1, 4 or 16 MiB per call, or ``--batch N`` pages per call, each into a
target of its own (HiCache's controller passes up to 128; preheat spreads a batch over its ``io_threads``,
``--io-threads`` sets them). The CPU seconds of every thread are summed per store and printed as ratios. Restart: a
fresh backend on the directory counts the pages ``batch_exists`` finds and those ``batch_get`` returns with the
bytes stored; then one stored file of each store gets a flipped byte, and the table says whether the next ``get``
returns wrong bytes or misses.

Every round builds its stores afresh on empty directories, untimed: preheat's ``fs://`` makes its 256 shard
directories then (as it does whenever it opens a directory that lacks them), SGLang's and LMCache's their one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import xxhash

from preheat.testing.redisserver import RedisServer

T = TypeVar("T")
MODEL = "bench/model"
NO_CHECKSUM = "-nosum"  # the suffix of a preheat store measured without its checksum (see the module's docstring)


class _ConstantHasher:
    def update(self, data: object) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 32


class _NoChecksum:
    """Stands in for ``xxhash`` inside ``preheat.kv.chunkfile`` while a ``-nosum`` store runs: every checksum is
    the same constant, so a put writes it and a get accepts it (``xxh3_128`` and ``xxh3_128_hexdigest`` are all
    the chunk format calls)."""

    def xxh3_128(self) -> _ConstantHasher:
        return _ConstantHasher()

    def xxh3_128_hexdigest(self, data: object) -> str:
        return "0" * 32


@contextlib.contextmanager
def checksum_for(name: str) -> Iterator[None]:
    """The checksum as preheat computes it, or (for a ``-nosum`` store) a constant, while ``name`` runs."""
    if not name.endswith(NO_CHECKSUM):
        yield
        return
    from preheat.kv import chunkfile

    names = vars(chunkfile)  # the module's own binding of xxhash, which its functions look up on every call
    real = names["xxhash"]
    names["xxhash"] = _NoChecksum()
    try:
        yield
    finally:
        names["xxhash"] = real


def settle() -> None:
    """Before a store's round: write back what earlier rounds left dirty, so this round's puts do not wait for it."""
    gc.collect()
    os.sync()


@dataclass
class Result:
    store: str
    size_mib: int
    put_gbs: list[float] = field(default_factory=list)
    get_gbs: list[float] = field(default_factory=list)
    put_p50: list[float] = field(default_factory=list)
    put_p99: list[float] = field(default_factory=list)
    get_p50: list[float] = field(default_factory=list)
    get_p99: list[float] = field(default_factory=list)
    put_calls: list[float] = field(default_factory=list)  # every call's seconds, rounds one after the other
    get_calls: list[float] = field(default_factory=list)
    put_cpu: list[float] = field(default_factory=list)  # CPU seconds (every thread's) per GB, one per round
    get_cpu: list[float] = field(default_factory=list)

    def record(self, nbytes: int, count: int, puts: list[float], gets: list[float],
               cpu: tuple[float, float] | None = None) -> None:
        """One round: ``count`` calls of ``nbytes`` each, put then got, with each call's seconds, and (when
        measured) the CPU seconds the puts and the gets took in all."""
        if cpu is not None:
            self.put_cpu.append(cpu[0] / (nbytes * count / 1e9))
            self.get_cpu.append(cpu[1] / (nbytes * count / 1e9))
        self.put_gbs.append(nbytes * count / sum(puts) / 1e9)
        self.get_gbs.append(nbytes * count / sum(gets) / 1e9)
        self.put_p50.append(p(puts, 0.5))
        self.put_p99.append(p(puts, 0.99))
        self.get_p50.append(p(gets, 0.5))
        self.get_p99.append(p(gets, 0.99))
        self.put_calls.extend(puts)
        self.get_calls.extend(gets)

    def summary(self, peer: Result | None = None) -> dict[str, float | str]:
        """Medians over the rounds; with ``peer`` (the built-in store, run in the same rounds), the median and the
        range of the rounds' put and get ratios (each round's two runs were back to back), and the median of the
        ratios of the calls that were made one right after the other (``*_paired``: the same value's put or get by
        both stores; the statistic a noisy machine disturbs least)."""
        med = statistics.median
        row: dict[str, float | str] = {
            "store": self.store, "size_mib": self.size_mib, "put_gbs": med(self.put_gbs),
            "get_gbs": med(self.get_gbs), "put_p50_ms": med(self.put_p50) * 1e3,
            "put_p99_ms": med(self.put_p99) * 1e3, "get_p50_ms": med(self.get_p50) * 1e3,
            "get_p99_ms": med(self.get_p99) * 1e3}
        if peer is not None:
            for way, ours, theirs in (("put", self.put_gbs, peer.put_gbs), ("get", self.get_gbs, peer.get_gbs)):
                ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
                row[f"{way}_x"], row[f"{way}_x_min"], row[f"{way}_x_max"] = med(ratios), min(ratios), max(ratios)
            for way, mine, peers in (("put", self.put_calls, peer.put_calls), ("get", self.get_calls, peer.get_calls)):
                row[f"{way}_paired"] = med([b / a for a, b in zip(mine, peers, strict=True)])
            for way, used, peer_used in (("put", self.put_cpu, peer.put_cpu), ("get", self.get_cpu, peer.get_cpu)):
                if used and peer_used:
                    row[f"{way}_cpu_x"] = med(used) / med(peer_used)
        return row


class Engine:
    """LMCache's config, metadata, CPU backend and event loop for a model whose chunk is ``layers`` MiB."""

    def __init__(self, layers: int, extra: dict[str, Any], *, local_disk: str | None = None) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.kv_shape = (layers, 2, 256, 8, 128)
        more = {"local_disk": local_disk, "max_local_disk_size": 8.0} if local_disk else {}
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=False, max_local_cpu_size=(3 * layers + 8) / 1024, extra_config=extra,
            remote_storage_plugins=["preheat"] if "remote_storage_plugin.preheat.url" in extra else None, **more)
        self.metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=self.kv_shape,
                                        chunk_size=256)
        self.backend = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def connector(self, url: str) -> Any:  # Any: LMCache's RemoteConnector
        from lmcache.v1.storage_backend.connector import ConnectorManager

        return ConnectorManager(url, self.loop, self.backend, self.config, self.metadata).create_connector()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def memory_obj(self, seed: int) -> Any:  # Any: LMCache's MemoryObj
        obj = self.backend.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes())
        obj.tensor.view(torch.int16).fill_(seed)
        obj.tensor.view(torch.int16).view(-1)[:8].copy_(torch.arange(8) + seed)
        return obj

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def key(i: int) -> Any:  # Any: LMCache's CacheEngineKey
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=0x5EED0000 + i,
                          dtype=torch.bfloat16)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def checksum_cost(nbytes: int, repeat: int = 20) -> float:
    """Seconds of XXH3-128 over one value of ``nbytes`` (median of ``repeat``)."""
    data = bytearray(os.urandom(1024)) * (nbytes // 1024)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        xxhash.xxh3_128_hexdigest(data)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def restart_counts(make: Callable[[], Any], engine: Engine, count: int) -> tuple[int, int]:
    """(values a fresh connector says exist, values it returns) after a restart on the same storage."""
    connector = make()
    exists = sum(bool(engine.run(connector.exists(key(i)))) for i in range(count))
    read = 0
    for i in range(count):
        got = engine.run(connector.get(key(i)))
        if got is not None:
            read += 1
            got.ref_count_down()
    return exists, read


def local_disk_restart(directory: str, layers: int, count: int) -> tuple[int, int]:
    """LMCache's local disk backend: store ``count`` values, build a fresh backend on the directory, count hits."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    os.makedirs(directory, exist_ok=True)
    engine = Engine(layers, {}, local_disk=directory)
    disk = LocalDiskBackend(engine.config, engine.loop, engine.backend, "cpu", None, engine.metadata)
    obj = engine.memory_obj(3)
    for i in range(count):
        disk.submit_put_task(key(i), obj)
    deadline = time.monotonic() + 120
    while sum(disk.contains(key(i)) for i in range(count)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    stored = sum(disk.contains(key(i)) for i in range(count))
    files = sum(len(f) for _, _, f in os.walk(directory))
    disk.close()
    fresh = LocalDiskBackend(engine.config, engine.loop, engine.backend, "cpu", None, engine.metadata)
    found = sum(fresh.contains(key(i)) for i in range(count))
    fresh.close()
    engine.close()
    print(f"  local disk backend: {stored} stored, {files} files on disk, {found} found after a restart",
          file=sys.stderr)
    return stored, found


def lmcache_connector(name: str, where: str, size: int) -> tuple[Engine, Any, str]:  # Any: LMCache's connector
    """A fresh engine (LMCache's config, CPU backend, event loop) and the connector of store ``name`` on ``where``
    (a directory or a Redis URL), and the URL it was built from (a restarted process builds it again)."""
    extra: dict[str, Any] = {"save_chunk_meta": False} if name == "lmcache-redis" else {}
    is_fs = where.startswith("/")
    url = f"fs://localhost:0{where}" if is_fs else where  # LMCache's fs:// URL wants a host:port
    if name.startswith("preheat"):
        extra = {"remote_storage_plugin.preheat.module_path": "preheat.integrations.lmcache",
                 "remote_storage_plugin.preheat.class_name": "PreheatConnector",
                 "remote_storage_plugin.preheat.url": f"fs://{where}" if is_fs else where}
        url = "plugin://preheat"
    engine = Engine(size, extra)
    return engine, engine.connector(url), url


def lmcache_round(stores: dict[str, str], size: int, redis: RedisServer | None, results: dict[str, Result], *,
                  count: int, restart: bool) -> dict[str, str]:
    """One round: ``count`` values put into every store (``stores``: name -> directory or Redis URL), then got
    back, one value per call, the stores' calls interleaved value by value (their order rotating), so that whatever
    else the machine runs meanwhile slows them alike. With ``restart``, what a fresh connector of each store on the
    same storage finds afterwards."""
    for where in stores.values():
        if where.startswith("/"):
            shutil.rmtree(where, ignore_errors=True)
            os.makedirs(where)
    if redis is not None:
        import redis as redis_py

        redis_py.Redis.from_url(redis.url).flushdb()
    settle()
    opened = {name: lmcache_connector(name, where, size) for name, where in stores.items()}
    objs = {name: engine.memory_obj(1) for name, (engine, _, _) in opened.items()}
    names = list(stores)
    puts: dict[str, list[float]] = {name: [] for name in names}
    gets: dict[str, list[float]] = {name: [] for name in names}
    for i in range(count):
        for name in rotated(names, i):
            engine, connector, _ = opened[name]
            with checksum_for(name):
                start = time.perf_counter()
                engine.run(connector.put(key(i), objs[name]))
                puts[name].append(time.perf_counter() - start)
    for i in range(count):
        for name in rotated(names, i):
            engine, connector, _ = opened[name]
            with checksum_for(name):
                start = time.perf_counter()
                got = engine.run(connector.get(key(i)))
                gets[name].append(time.perf_counter() - start)
            if got is None:
                raise SystemExit(f"{name}: value {i} not found")
            got.ref_count_down()
    texts: dict[str, str] = {}
    for name, (engine, connector, url) in opened.items():
        objs[name].ref_count_down()
        results[name].record(size << 20, count, puts[name], gets[name])
        if restart and NO_CHECKSUM not in name:
            exists, read = restart_counts(functools.partial(engine.connector, url), engine, count)
            texts[name] = f"{exists}/{count} exist, {read}/{count} read"
        try:
            engine.run(connector.close(), timeout=10)
        except TimeoutError:
            print(f"  {name}: close() did not return in 10 s", file=sys.stderr)
        engine.close()
        print(f"  {name} {size} MiB: put {results[name].put_gbs[-1]:.2f} GB/s, "
              f"get {results[name].get_gbs[-1]:.2f} GB/s", file=sys.stderr)
    return texts


# -- SGLang HiCache ------------------------------------------------------------------------------------------------


def sglang_backend(name: str, directory: str, io_threads: int | None = None) -> Any:  # Any: SGLang's HiCacheStorage
    """SGLang's ``file`` backend or preheat's (``dynamic``) on ``directory``, built by SGLang's own factory."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra: dict[str, Any] = {"file_storage_path": directory}
    if name.startswith("preheat"):
        extra = {"backend_name": "preheat", "module_path": "preheat.integrations.sglang",
                 "class_name": "PreheatHiCacheStorage", "url": f"fs://{directory}"}
        if io_threads is not None:
            extra["io_threads"] = io_threads
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=MODEL, extra_config=extra)
    return StorageBackendFactory.create_backend("dynamic" if name.startswith("preheat") else "file", config, None)


def sglang_key(i: int) -> str:
    import hashlib

    return hashlib.sha256(f"bench-page-{i}".encode()).hexdigest()


def sglang_page(size: int, seed: int) -> torch.Tensor:
    """A flat bf16 host-pool page of ``size`` MiB."""
    page = torch.full(((size << 20) // 2,), float(seed % 100), dtype=torch.bfloat16)
    page.view(torch.int16)[:8].copy_(torch.arange(8) + seed)
    return page


def sglang_round(stores: Sequence[str], base: str, size: int, count: int, results: dict[str, Result], *,
                 restart: bool, batch: int = 1, io_threads: int | None = None) -> dict[str, str]:
    """One round: ``count`` pages put into every store, then got back, ``batch`` pages per call (each into a
    target of its own), the stores' calls interleaved call by call (their order rotating), so that whatever else
    the machine runs meanwhile slows them alike. Each store has its own directory under ``base`` (one filesystem).
    The CPU time of every thread of the process is summed over each store's calls. With ``restart``, what a fresh
    backend of each store finds, and what a flipped byte in one stored file gives."""
    shutil.rmtree(base, ignore_errors=True)
    directories = {name: os.path.join(base, name) for name in stores}
    for directory in directories.values():
        os.makedirs(directory)
    settle()
    backends = {name: sglang_backend(name, directories[name], io_threads) for name in stores}
    page = sglang_page(size, 1)
    targets = [torch.empty_like(page).fill_(0) for _ in range(batch)]  # written once: no store pays their faults
    calls = [[sglang_key(i) for i in range(start, min(count, start + batch))] for start in range(0, count, batch)]
    puts: dict[str, list[float]] = {name: [] for name in stores}
    gets: dict[str, list[float]] = {name: [] for name in stores}
    cpu = {name: [0.0, 0.0] for name in stores}
    for i, keys in enumerate(calls):
        for name in rotated(stores, i):
            with checksum_for(name):
                used, start = time.process_time(), time.perf_counter()
                ok = backends[name].batch_set(keys, [page] * len(keys))
                puts[name].append(time.perf_counter() - start)
                cpu[name][0] += time.process_time() - used
            if not ok:
                raise SystemExit(f"{name}: pages {keys} not stored")
    for i, keys in enumerate(calls):
        for name in rotated(stores, i):
            with checksum_for(name):
                used, start = time.process_time(), time.perf_counter()
                got = backends[name].batch_get(keys, targets[: len(keys)])
                gets[name].append(time.perf_counter() - start)
                cpu[name][1] += time.process_time() - used
            if any(g is None for g in got):
                raise SystemExit(f"{name}: pages {keys} not found")
    for name in stores:
        results[name].record((size << 20) * batch, len(calls), puts[name], gets[name],
                             (cpu[name][0], cpu[name][1]))
        close(backends[name])
        print(f"  {name} {size} MiB: put {results[name].put_gbs[-1]:.2f} GB/s, "
              f"get {results[name].get_gbs[-1]:.2f} GB/s", file=sys.stderr)
    return {name: sglang_restart(name, directories[name], page, count) for name in stores
            if restart and NO_CHECKSUM not in name}


def rotated(stores: Sequence[str], i: int) -> list[str]:
    """The stores in the order of call ``i``: each goes first as often as the others."""
    return [*stores[i % len(stores):], *stores[: i % len(stores)]]


def sglang_restart(name: str, directory: str, page: torch.Tensor, count: int) -> str:
    """What a fresh backend on ``directory`` (a restarted process) finds and reads back of the ``count`` pages
    stored there, and what it returns for a page whose file then gets a flipped byte."""
    fresh = sglang_backend(name, directory)
    keys = [sglang_key(i) for i in range(count)]
    found = fresh.batch_exists(keys)
    read = sum(got is not None and torch.equal(got.view(torch.int16), page.view(torch.int16))
               for got in fresh.batch_get(keys, [torch.empty_like(page) for _ in keys]))
    victim = sglang_file(fresh, name, directory, keys[0])
    with open(victim, "r+b") as handle:
        handle.seek(os.path.getsize(victim) - 4096)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    got = fresh.batch_get([keys[0]], [torch.empty_like(page)])[0]
    if got is None:
        flipped = "a miss"
    elif torch.equal(got.view(torch.int16), page.view(torch.int16)):
        flipped = "the stored bytes"
    else:
        flipped = "WRONG BYTES"
    close(fresh)
    return f"{found}/{count} exist, {read}/{count} read back identical; a flipped byte gives {flipped}"


def close(backend: Any) -> None:  # Any: SGLang's HiCacheStorage (its file backend has no close)
    if hasattr(backend, "close"):
        backend.close()


def sglang_file(backend: Any, name: str, directory: str, key: str) -> str:  # Any: SGLang's HiCacheStorage
    if name.startswith("preheat"):
        from preheat.kv.store import storage_name

        return str(backend.store.storage.path(storage_name(key)))
    return os.path.join(directory, f"{backend._get_suffixed_key(key)}.bin")


def main_sglang(args: argparse.Namespace) -> int:
    logging.getLogger("sglang").setLevel(logging.ERROR)
    base = os.path.join(os.path.abspath(args.dir), "sglang")  # a directory per store, on one filesystem
    rows: list[dict[str, float | str]] = []
    restart: dict[str, str] = {}
    checksum: dict[int, float] = {}
    stores = ("sglang-file", "preheat-fs", f"preheat-fs{NO_CHECKSUM}")
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            count = max(16, args.mib_per_size // size)
            count -= count % args.batch  # whole batches only: every call moves the same bytes
            checksum[size] = checksum_cost(size << 20)
            results = {name: Result(name, size) for name in stores}
            for r in range(args.rounds):
                restart.update(sglang_round(stores, base, size, count, results, batch=args.batch,
                                            io_threads=args.io_threads,
                                            restart=r == args.rounds - 1 and size == 4))
            rows.extend(results[name].summary(results["sglang-file"] if name != "sglang-file" else None)
                        for name in stores)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(rows, checksum, restart)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "checksum_s": checksum, "restart": restart}, handle, indent=1)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("lmcache", "sglang"), default="lmcache",
                        help="whose built-in store preheat is measured against (run in that engine's venv)")
    parser.add_argument("--sizes", default="1,4,16", help="value sizes in MiB")
    parser.add_argument("--mib-per-size", type=int, default=256, help="MiB written per store, size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=".bench/kvstore")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--io-threads", type=int, default=None,
                        help="--engine sglang: preheat's io_threads (default: its own, min(4, cores))")
    parser.add_argument("--batch", type=int, default=1,
                        help="--engine sglang: pages per batch_set/batch_get call (HiCache's controller passes up "
                             "to 128; preheat spreads a batch over its io threads)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.engine == "sglang":
        return main_sglang(args)
    logging.getLogger("lmcache").setLevel(logging.ERROR)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    base = os.path.abspath(args.dir)
    redis = None if args.no_redis else RedisServer()
    rows: list[dict[str, float | str]] = []
    restart: dict[str, str] = {}
    checksum: dict[int, float] = {}
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            count = max(16, args.mib_per_size // size)
            checksum[size] = checksum_cost(size << 20)
            stores: dict[str, str] = {name: f"{base}/{name}-{size}"
                                      for name in ("lmcache-fs", "preheat-fs", f"preheat-fs{NO_CHECKSUM}")}
            if redis is not None:
                stores["lmcache-redis"] = redis.url.replace("/0", "")
                stores["preheat-redis"] = redis.url
            results = {name: Result(name, size) for name in stores}
            for r in range(args.rounds):
                restart.update(lmcache_round(stores, size, redis, results, count=count,
                                             restart=r == args.rounds - 1 and size == 4))
                gc.collect()  # the stores' CPU backend buffers go before the next round's are made
            rows.extend(results[name].summary(results[peer_of(name)] if name.startswith("preheat") else None)
                        for name in stores)
        stored, found = local_disk_restart(f"{base}/lmcache-local-disk", 4, 16)
        restart["lmcache-local-disk"] = f"{found}/{stored} found (index kept in memory)"
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(base, ignore_errors=True)
    print_table(rows, checksum, restart)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "checksum_s": checksum, "restart": restart}, handle, indent=1)
    return 0


def peer_of(name: str) -> str:
    """The built-in LMCache store a preheat store is measured against."""
    return name.replace("preheat", "lmcache").removesuffix(NO_CHECKSUM)


def print_table(rows: list[dict[str, float | str]], checksum: dict[int, float], restart: dict[str, str]) -> None:
    """The table: each preheat row's ratios to its built-in peer are the median of the rounds' (min-max after)."""
    print(f"{'store':<19}{'MiB':>4}{'put GB/s':>10}{'p50 ms':>8}{'p99 ms':>8}{'get GB/s':>10}{'p50 ms':>8}"
          f"{'p99 ms':>8}{'put x (range)':>19}{'get x (range)':>19}{'paired put/get x':>18}")
    for r in rows:
        ratios = [f"{float(r[f'{way}_x']):.2f} ({float(r[f'{way}_x_min']):.2f}-{float(r[f'{way}_x_max']):.2f})"
                  if f"{way}_x" in r else "" for way in ("put", "get")]
        paired = f"{float(r['put_paired']):.2f} / {float(r['get_paired']):.2f}" if "put_paired" in r else ""
        print(f"{r['store']:<19}{r['size_mib']:>4}{float(r['put_gbs']):>10.2f}{float(r['put_p50_ms']):>8.1f}"
              f"{float(r['put_p99_ms']):>8.1f}{float(r['get_gbs']):>10.2f}{float(r['get_p50_ms']):>8.1f}"
              f"{float(r['get_p99_ms']):>8.1f}{ratios[0]:>19}{ratios[1]:>19}{paired:>18}")
    print()
    for r in rows:
        if "get_cpu_x" in r:
            print(f"{r['store']} {r['size_mib']} MiB: CPU seconds per GB (all threads) {float(r['put_cpu_x']):.2f}x "
                  f"the built-in store's on puts, {float(r['get_cpu_x']):.2f}x on gets")
    print()
    for size, seconds in checksum.items():
        print(f"checksum (XXH3-128) of one {size} MiB value: {seconds * 1e3:.2f} ms "
              f"({(size << 20) / seconds / 1e9:.1f} GB/s), paid once per put and once per get")
    print()
    for name, text in restart.items():
        print(f"after a restart, {name}: {text}")

if __name__ == "__main__":
    sys.exit(main())
