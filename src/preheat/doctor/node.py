"""Node checks: where the model and the cache live, how much room and memory they have, and how fast they read.

Read-only: statvfs, /proc and /sys, and this process's limits. The probes that read or write files are in
``doctor.reads``.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from preheat.core import env
from preheat.core.config import format_bytes
from preheat.doctor.check import Check, DoctorOptions
from preheat.doctor.findings import Finding
from preheat.io.files import mount_of
from preheat.io.tuning import is_network_fs

OVERLAY_FILESYSTEMS = frozenset({"overlay", "overlayfs", "aufs"})
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def checks(options: DoctorOptions) -> list[Check]:
    return [
        Check("node.filesystem", "node", 2.0, check_filesystems),
        Check("node.disk_space", "node", 2.0, check_disk_space),
        Check("node.page_cache", "node", 1.0, check_page_cache),
        Check("node.thp", "node", 1.0, check_thp),
        Check("node.numa", "node", 1.0, check_numa),
        Check("node.memlock", "node", 1.0, check_memlock),
        Check("node.cpu_threads", "node", 2.0, check_threads),
    ]


# -- what is being checked -----------------------------------------------------------------------------------------


def cache_dir(options: DoctorOptions) -> str:
    if options.cache_dir:
        return options.cache_dir
    from preheat.store.cache import default_cache_dir

    return default_cache_dir()


def existing_parent(path: str) -> str:
    """The path itself or its nearest existing ancestor (a cache directory may not exist yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


@dataclass(frozen=True)
class ModelFiles:
    root: str
    files: list[tuple[str, int]]  # (path, bytes), largest first

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


def model_files(path: str, limit: int = 10_000) -> ModelFiles | None:
    """The model's regular files (a directory walked, at most ``limit`` files; or one file), None if absent."""
    if os.path.isfile(path):
        return ModelFiles(os.path.dirname(os.path.abspath(path)), [(path, os.path.getsize(path))])
    if not os.path.isdir(path):
        return None
    files: list[tuple[str, int]] = []
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                files.append((full, os.path.getsize(full)))
            if len(files) >= limit:
                break
    files.sort(key=lambda item: -item[1])
    return ModelFiles(os.path.abspath(path), files)


def model_of(options: DoctorOptions) -> ModelFiles | None:
    return model_files(options.model) if options.model else None


def missing(options: DoctorOptions) -> Finding:
    return Finding(
        "node.model_missing", "node", "fail", f"model path {options.model} does not exist",
        evidence={"path": options.model}, fix="Pass the model's directory (or `preheat pull` it into the cache first).",
    )


# -- the checks ----------------------------------------------------------------------------------------------------


def classify_fs(fstype: str) -> str:
    """``local``, ``memory``, ``overlay``, ``network`` (NFS, Lustre, FUSE, ...) or ``unknown``."""
    if fstype in OVERLAY_FILESYSTEMS:
        return "overlay"
    if fstype in MEMORY_FILESYSTEMS:
        return "memory"
    if is_network_fs(fstype):
        return "network"
    return "local" if fstype else "unknown"


def filesystem_finding(role: str, path: str) -> Finding:
    mount = mount_of(existing_parent(path))
    kind = classify_fs(mount.fstype)
    evidence = {"path": path, "fstype": mount.fstype or "unknown", "kind": kind, "mountpoint": mount.mountpoint,
                "device": mount.device}
    if kind == "overlay":
        return Finding(
            "node.fs_overlay", "node", "warn", f"{role} {path} is on the container's overlay filesystem",
            evidence=evidence,
            fix="Mount a hostPath/local NVMe volume there: the overlay's upper layer is slow to write, is lost with "
            "the container, so every start downloads again.",
        )
    if kind == "network":
        return Finding(
            "node.fs_network", "node", "warn", f"{role} {path} is on a network filesystem ({mount.fstype})",
            evidence=evidence,
            fix="Reads pay a round trip each and share the network with the fleet: keep a node-local copy "
            "(`preheat pull` into a cache on local NVMe) or pull from peers; load with 16+ threads if it must stay.",
        )
    if kind == "memory":
        return Finding(
            "node.fs_memory", "node", "info", f"{role} {path} is in memory ({mount.fstype})",
            evidence=evidence, fix="Fast, but it counts against the node's memory and is lost at reboot.",
        )
    return Finding("node.fs_local", "node", "ok", f"{role} {path} is on a local filesystem ({mount.fstype})",
                   evidence=evidence)


def check_filesystems(options: DoctorOptions, bound_s: float) -> list[Finding]:
    found = []
    if options.model:
        if not os.path.exists(options.model):
            return [missing(options)]
        found.append(filesystem_finding("model", options.model))
    found.append(filesystem_finding("cache", cache_dir(options)))
    return found


def check_disk_space(options: DoctorOptions, bound_s: float) -> list[Finding]:
    where = existing_parent(cache_dir(options))
    stat = os.statvfs(where)
    free = stat.f_bavail * stat.f_frsize
    model = model_of(options)
    need = model.nbytes if model is not None else 0
    evidence: dict[str, object] = {"path": where, "free_bytes": free, "model_bytes": need or None}
    if need and free < need:
        return [Finding("node.disk_space", "node", "fail",
                        f"cache has {format_bytes(free)} free, the model needs {format_bytes(need)}",
                        evidence=evidence,
                        fix="Free space or point PREHEAT_CACHE_DIR at a larger volume: the model cannot be cached, "
                        "so every start downloads it again.")]
    if need and free < need * 1.2:
        return [Finding("node.disk_space", "node", "warn",
                        f"cache has {format_bytes(free)} free, little room beyond the model's {format_bytes(need)}",
                        evidence=evidence,
                        fix="A second model or a new revision will evict this one (`preheat cache gc`); give the cache "
                        "room for at least two revisions.")]
    return [Finding("node.disk_space", "node", "ok", f"cache has {format_bytes(free)} free", evidence=evidence)]


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return values


def check_page_cache(options: DoctorOptions, bound_s: float) -> list[Finding]:
    info = meminfo()
    available, cached, total = info.get("MemAvailable", 0), info.get("Cached", 0), info.get("MemTotal", 0)
    model = model_of(options)
    evidence: dict[str, object] = {"mem_total_bytes": total, "mem_available_bytes": available,
                                   "page_cache_bytes": cached, "model_bytes": model.nbytes if model else None}
    if model is not None and available < model.nbytes:
        return [Finding("node.page_cache", "node", "warn",
                        f"{format_bytes(available)} of memory available, less than the model's "
                        f"{format_bytes(model.nbytes)}: a restart cannot be served from the page cache",
                        evidence=evidence,
                        fix="Give the node (or the pod's memory limit) room for the model, or expect every restart to "
                        "read from storage at its cold speed.")]
    title = f"{format_bytes(available)} of memory available for the page cache"
    return [Finding("node.page_cache", "node", "ok", title, evidence=evidence)]


def bracketed(text: str) -> str:
    """The selected value of a sysfs choice list: ``always [madvise] never`` -> ``madvise``."""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


def check_thp(options: DoctorOptions, bound_s: float) -> list[Finding]:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(path, encoding="ascii") as handle:
            mode = bracketed(handle.read())
    except OSError:
        return [Finding("node.thp", "node", "info", "transparent huge pages: unknown (no sysfs entry)",
                        evidence={"path": path})]
    evidence = {"enabled": mode, "path": path}
    if mode == "never":
        return [Finding("node.thp", "node", "warn", "transparent huge pages are off", evidence=evidence,
                        fix="preheat madvises its read buffers to huge pages (fewer page faults, faster copies): "
                        "`echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` on the host.")]
    return [Finding("node.thp", "node", "ok", f"transparent huge pages: {mode}", evidence=evidence)]


def check_numa(options: DoctorOptions, bound_s: float) -> list[Finding]:
    base = "/sys/devices/system/node"
    try:
        nodes = sorted(name for name in os.listdir(base) if name.startswith("node") and name[4:].isdigit())
    except OSError:
        nodes = []
    cpus: dict[str, str] = {}
    for name in nodes:
        try:
            with open(os.path.join(base, name, "cpulist"), encoding="ascii") as handle:
                cpus[name] = handle.read().strip()
        except OSError:
            cpus[name] = "?"
    evidence = {"nodes": len(nodes) or 1, "cpulists": cpus}
    if len(nodes) > 1:
        return [Finding("node.numa", "node", "info", f"{len(nodes)} NUMA nodes", evidence=evidence,
                        fix="Pin each replica to the NUMA node of its GPU and NIC (`numactl --cpunodebind=N "
                        "--membind=N`, or the kubelet's topology manager) so pinned buffers are local.")]
    return [Finding("node.numa", "node", "ok", "one NUMA node", evidence=evidence)]


def check_memlock(options: DoctorOptions, bound_s: float) -> list[Finding]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    evidence = {"soft_bytes": None if soft == unlimited else soft, "hard_bytes": None if hard == unlimited else hard}
    if soft == unlimited:
        return [Finding("node.memlock", "node", "ok", "locked memory is unlimited", evidence=evidence)]
    if soft < 64 * 1024 * 1024:
        return [Finding("node.memlock", "node", "warn", f"locked memory is limited to {format_bytes(soft)}",
                        evidence=evidence,
                        fix="Pinned staging buffers, RDMA (NIXL/UCX) and GDS register memory: run with "
                        "`ulimit -l unlimited` (docker: --ulimit memlock=-1; Kubernetes: the runtime's default).")]
    return [Finding("node.memlock", "node", "info", f"locked memory is limited to {format_bytes(soft)}",
                    evidence=evidence,
                    fix="Enough for staging buffers; RDMA transfers may need `ulimit -l unlimited`.")]


def cgroup_cpus() -> float | None:
    """The cgroup v2 CPU quota in cores (``cpu.max``), None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as handle:
            quota, period = handle.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def check_threads(options: DoctorOptions, bound_s: float) -> list[Finding]:
    from preheat.io.tuning import cpu_cores, tune

    affinity = cpu_cores()
    quota = cgroup_cpus()
    usable = min(float(affinity), quota) if quota else float(affinity)
    where = options.model if options.model and os.path.exists(options.model) else existing_parent(cache_dir(options))
    configured = options.threads or env.get(env.THREADS)  # a bad value: ConfigError naming the variable
    tuning = tune(where, 1 << 30, threads=configured)
    network = is_network_fs(mount_of(where).fstype)
    evidence = {"cpus": affinity, "cgroup_cpus": quota, "threads": tuning.threads,
                "threads_set": configured is not None, "reason": tuning.reason}
    # Network reads wait on round trips, so many threads per core is right there; local copies are CPU-bound.
    if not network and tuning.threads > 2 * usable:
        return [Finding("node.cpu_threads", "node", "warn",
                        f"{tuning.threads} reader threads on {usable:g} usable CPUs", evidence=evidence,
                        fix="Oversubscribed readers fight the engine's own threads: unset PREHEAT_THREADS (tuned "
                        "default) or raise the pod's CPU limit.")]
    if quota is not None and quota < affinity:
        return [Finding("node.cpu_threads", "node", "info",
                        f"the cgroup allows {quota:g} CPUs of the {affinity} visible", evidence=evidence,
                        fix="Thread pools sized from the visible CPUs oversubscribe the quota; set PREHEAT_THREADS.")]
    return [Finding("node.cpu_threads", "node", "ok", f"{tuning.threads} reader threads on {usable:g} CPUs",
                    evidence=evidence)]
