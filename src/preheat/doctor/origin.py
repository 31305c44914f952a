"""Origin and peer checks: can this node reach where the weights come from, how fast, and who else holds them.

The origin probe reads one file (the model's largest, joined to ``--origin`` when that ends in ``/``; else the URL
itself names the file) through preheat's own HTTP source, once on one connection and once on several, each bounded
in bytes (``probe_bytes``) and seconds. The gap between the two says whether the origin caps each connection (CDNs
and object stores do), which is why preheat pulls with 16 streams.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from preheat.core.config import format_bytes
from preheat.core.errors import CheckpointError, PreheatError, RegistryError
from preheat.doctor.check import Check, DoctorOptions
from preheat.doctor.findings import Finding
from preheat.sources.base import Origin, Source

MB = 1e6
PROBE_CHUNK = 4 * 1024 * 1024
PARALLEL_STREAMS = 8
SLOW_ORIGIN_MBPS = 125.0  # 1 Gbit/s: under it a multi-GB model takes minutes to download
MAX_PEERS_PROBED = 5


def checks(options: DoctorOptions) -> list[Check]:
    found = []
    if options.origin:
        found.append(Check("origin.reach", "origin", 3.0, check_reach))
        if options.io:
            found.append(Check("origin.throughput", "origin", 8.0, check_throughput))
    if options.registry:
        found.append(Check("peers.registry", "peers", 4.0, check_registry))
    return found


def probe_target(options: DoctorOptions) -> tuple[str, str]:
    """(origin prefix, file name) to probe."""
    assert options.origin is not None
    url = options.origin
    if url.endswith("/") and options.model:
        from preheat.doctor.node import model_files

        model = model_files(options.model)
        if model is not None and model.files:
            return url.rstrip("/"), os.path.relpath(model.files[0][0], model.root)
    base, _, name = url.rstrip("/").rpartition("/")
    return base, name


def _open(base: str, bound_s: float) -> Origin:
    if base.startswith(("http://", "https://")):
        from preheat.sources.http import HTTPOrigin
        from preheat.sources.net import NetSettings

        # One attempt, short timeouts: the doctor measures the origin, it does not ride out its hiccups.
        settings = NetSettings(connect_timeout=min(3.0, bound_s), read_timeout=min(5.0, bound_s), attempts=1)
        return HTTPOrigin(base, settings=settings)
    from preheat.sources.open import open_origin

    return open_origin(base)


def check_reach(options: DoctorOptions, bound_s: float) -> list[Finding]:
    base, name = probe_target(options)
    url = f"{base}/{name}"
    origin = _open(base, bound_s)
    latencies: list[float] = []
    try:
        source = origin.open(name)
        try:
            size = source.size()
            deadline = time.monotonic() + bound_s * 0.6
            one = bytearray(1)
            while len(latencies) < 5 and time.monotonic() < deadline:
                start = time.perf_counter()
                source.readv(0, [memoryview(one)])
                latencies.append(time.perf_counter() - start)
        finally:
            source.close()
    except PreheatError as exc:
        return [Finding("origin.unreachable", "origin", "fail", f"origin {url} cannot be read: {exc}",
                        evidence={"url": url, "error": type(exc).__name__, "message": str(exc)},
                        fix="Check the URL, the token (PREHEAT_HTTP_TOKEN) and the network path; without the origin a "
                        "node with no cached copy and no peer cannot start.")]
    latency_ms = statistics.median(latencies) * 1000 if latencies else None
    evidence = {"url": url, "file_bytes": size, "latency_ms": None if latency_ms is None else round(latency_ms, 2),
                "samples": len(latencies)}
    if latency_ms is not None and latency_ms > 100:
        return [Finding("origin.latency", "origin", "warn", f"origin answers in {latency_ms:.0f} ms per request",
                        evidence=evidence,
                        fix="Every ranged request pays this: pull once into the node cache (or from peers in the same "
                        "zone) instead of loading from the origin at each start.")]
    return [Finding("origin.reach", "origin", "ok", f"origin reachable, {latency_ms or 0:.1f} ms per request",
                    evidence=evidence)]


def _read_for(source: Source, offsets: list[int], size: int, deadline: float) -> int:
    buffer = bytearray(PROBE_CHUNK)
    done = 0
    for offset in offsets:
        if time.monotonic() > deadline:
            break
        length = min(PROBE_CHUNK, size - offset)
        source.readv(offset, [memoryview(buffer)[:length]])
        done += length
    return done


def measure(source: Source, size: int, max_bytes: int, seconds: float, streams: int) -> float:
    """Bytes per second reading up to ``max_bytes`` of ``source`` on ``streams`` connections for ``seconds``."""
    offsets = list(range(0, min(size, max_bytes), PROBE_CHUNK))
    start = time.monotonic()
    deadline = start + seconds
    with ThreadPoolExecutor(max_workers=streams) as pool:
        done = sum(pool.map(lambda i: _read_for(source, offsets[i::streams], size, deadline), range(streams)))
    return done / max(time.monotonic() - start, 1e-9)


def check_throughput(options: DoctorOptions, bound_s: float) -> list[Finding]:
    from preheat.doctor.node import model_files

    base, name = probe_target(options)
    url = f"{base}/{name}"
    origin = _open(base, bound_s)
    try:
        source = origin.open(name)
        try:
            size = source.size()
            # Each leg gets under half the bound: the slowest chunk in flight may finish just past the deadline.
            single = measure(source, size, options.probe_bytes, bound_s * 0.35, 1)
            parallel = measure(source, size, options.probe_bytes, bound_s * 0.35, PARALLEL_STREAMS)
        finally:
            source.close()
    except PreheatError as exc:
        return [Finding("origin.unreachable", "origin", "fail", f"origin {url} cannot be read: {exc}",
                        evidence={"url": url, "error": type(exc).__name__, "message": str(exc)},
                        fix="Check the URL, the token and the network path.")]
    model = model_files(options.model) if options.model else None
    best = max(single, parallel)
    seconds = model.nbytes / best if model is not None and best > 0 else None
    evidence = {"url": url, "single_stream_MBps": round(single / MB, 2), "parallel_MBps": round(parallel / MB, 2),
                "streams": PARALLEL_STREAMS, "speedup": round(parallel / single, 2) if single else None,
                "model_bytes": model.nbytes if model else None}
    title = (f"origin sends {single / MB:.1f} MB/s on one connection, {parallel / MB:.1f} MB/s on "
             f"{PARALLEL_STREAMS}")
    if best / MB < SLOW_ORIGIN_MBPS:
        download = f"; the model's {format_bytes(model.nbytes)} take {seconds:.0f} s" if model and seconds else ""
        return [Finding("origin.slow", "origin", "warn", title + download, seconds=seconds, evidence=evidence,
                        fix="Download once per node, not per start: `preheat pull` into the node cache (or a "
                        "DaemonSet pre-pull), and let peers serve the fleet (`--registry`).")]
    return [Finding("origin.throughput", "origin", "ok", title, seconds=seconds, evidence=evidence)]


# -- peers -----------------------------------------------------------------------------------------------------------


def wanted_name(options: DoctorOptions) -> str | None:
    """What peers announce: ``--name``, else the model's preheat.json identity, else the model directory's name."""
    if options.name:
        return options.name
    if not options.model:
        return None
    from preheat.checkpoint.jsonfile import read_json_object

    try:
        identity = read_json_object(os.path.join(options.model, "preheat.json")).get("identity")
    except CheckpointError:
        identity = None  # no readable manifest: peers may still announce the served name
    if isinstance(identity, str):
        return identity
    return os.path.basename(os.path.abspath(options.model))


def peer_info(address: str, timeout_s: float) -> dict[str, object]:
    """``GET /peer/v1/info`` of one peer: its answer time, or the error."""
    from preheat.core.errors import HTTPClientError
    from preheat.http.client import Timeouts, request

    start = time.perf_counter()
    try:
        # Any status counts as alive: 401/403 is a peer that wants the token.
        status = request(f"http://{address}/peer/v1/info", timeouts=Timeouts.within(timeout_s), max_body=16384).status
    except HTTPClientError as exc:
        return {"address": address, "reachable": False, "error": str(exc)}
    return {"address": address, "reachable": True, "status": status,
            "latency_ms": round((time.perf_counter() - start) * 1000, 2)}


def check_registry(options: DoctorOptions, bound_s: float) -> list[Finding]:
    from preheat.peer.registry import open_registry

    assert options.registry is not None
    wanted = wanted_name(options)
    start = time.perf_counter()
    try:
        registry = open_registry(options.registry)
        entries = registry.find(wanted or "")
    except (RegistryError, PreheatError) as exc:
        return [Finding("peers.registry_down", "peers", "fail", f"peer registry {options.registry} fails: {exc}",
                        evidence={"registry": options.registry, "error": type(exc).__name__, "message": str(exc)},
                        fix="Pulls fall back to the node cache and the origin: every node downloads on its own. "
                        "Check the Redis URL/password or the shared directory's mount.")]
    answer_ms = round((time.perf_counter() - start) * 1000, 2)
    found = [Finding("peers.registry", "peers", "ok", f"peer registry answers in {answer_ms:.0f} ms",
                     evidence={"registry": options.registry, "answer_ms": answer_ms})]
    if wanted is None:
        return found
    probes = [peer_info(entry.address, min(1.0, bound_s / 4)) for entry in entries[:MAX_PEERS_PROBED]]
    evidence = {"registry": options.registry, "wanted": wanted, "announcing": len(entries), "peers": probes}
    alive = [p for p in probes if p["reachable"]]
    if not entries:
        found.append(Finding("peers.none", "peers", "warn", f"no peer announces {wanted}", evidence=evidence,
                             fix="This node will download from the origin. Start one replica with `--registry` (or "
                             "`preheat peer serve`) so the rest of the fleet pulls from it; check --name matches "
                             "the served name."))
    elif not alive:
        found.append(Finding("peers.unreachable", "peers", "warn",
                             f"{len(entries)} peers announce {wanted}, none answers from here", evidence=evidence,
                             fix="Firewall or network policy between nodes: open the peer port, or check the "
                             "announced address is routable (--peer-host)."))
    else:
        found.append(Finding("peers.available", "peers", "ok",
                             f"{len(entries)} peers announce {wanted}, {len(alive)} of {len(probes)} probed answer",
                             evidence=evidence))
    return found
