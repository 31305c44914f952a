"""Compiled artifacts: torch.compile's caches packed under a key of everything that makes them valid.

A cold ``torch.compile`` spends most of its time generating and compiling kernels (Inductor's C++/Triton code);
with the Inductor cache directory of a replica that compiled the same model already, the newcomer only traces. The
directory (``TORCHINDUCTOR_CACHE_DIR``: FX graphs, AOT autograd entries, compiled kernels) is packed into one blob:

    b"PREHEAT-ARTIFACT 1\\n" | 8-byte little-endian header length | header JSON | tar payload

The header holds the ``ArtifactKey`` fields and the payload's xxh3-128 checksum. Blobs live in the node cache at
``compiled/<key>.blob`` and peers serve them at ``/peer/v1/artifacts/<key>``. A blob is installed only when its
header's key equals the local key field by field (torch, triton and preheat versions, device kind and architecture,
checkpoint identity, engine dtype and context length) and its checksum matches: anything else is refused, never
"probably compatible".
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import platform
import struct
import tarfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

import xxhash

from preheat.checkpoint import digest
from preheat.errors import PeerError
from preheat.peer.server import ARTIFACTS_ROUTE

log = logging.getLogger("preheat.peer")
MAGIC = b"PREHEAT-ARTIFACT 1\n"
_LENGTH = struct.Struct("<Q")
# CPU features that change the code Inductor generates (vector width, bf16/fp16 and matrix instructions).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "fma", "asimd")


@dataclass(frozen=True)
class ArtifactKey:
    """What compiled code depends on. Two replicas share artifacts only when every field is equal."""

    torch: str
    triton: str | None
    preheat: str
    device: str  # "cpu" or "cuda"
    arch: str  # CPU: machine + vector features; CUDA: compute capability and device name
    identity: str  # the checkpoint's preheat.json identity
    dtype: str
    max_model_len: int
    format: str = "inductor-dir-1"

    @property
    def hex(self) -> str:
        """The key's name: xxh3-128 of its canonical JSON (32 hex digits), used in paths and URLs."""
        return xxhash.xxh3_128_hexdigest(json.dumps(asdict(self), sort_keys=True).encode())


def cpu_arch() -> str:
    """``x86_64+avx2,avx512f,...``: the machine and the vector features Inductor's CPU code depends on."""
    flags: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    return f"{platform.machine()}+{','.join(f for f in _CPU_FLAGS if f in flags)}"


def device_arch(device: str) -> tuple[str, str]:
    """``(kind, arch)`` of a torch device string."""
    kind = device.split(":", 1)[0]
    if kind != "cuda":
        return kind, cpu_arch()
    import torch

    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    return kind, f"sm_{major}{minor} {torch.cuda.get_device_name(index)}"


def artifact_key(*, identity: str, device: str, dtype: str, max_model_len: int) -> ArtifactKey:
    """The key for compiling this checkpoint with these engine settings in this process's environment."""
    import torch

    from preheat import __version__

    try:
        import triton  # type: ignore[import-not-found]  # optional: absent on CPU-only installs

        triton_version: str | None = str(triton.__version__)
    except ImportError:
        triton_version = None
    kind, arch = device_arch(device)
    return ArtifactKey(
        torch=str(torch.__version__),
        triton=triton_version,
        preheat=__version__,
        device=kind,
        arch=arch,
        identity=identity,
        dtype=dtype,
        max_model_len=max_model_len,
    )


def pack(key: ArtifactKey, directory: str) -> bytes:
    """The blob of ``directory`` (an Inductor cache dir) for ``key``. Lock files are left out."""
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        for name in sorted(os.listdir(directory)):
            if name != "locks":
                tar.add(os.path.join(directory, name), arcname=name)
    data = payload.getvalue()
    header = json.dumps({"key": asdict(key), "checksum": digest.digest_bytes(data), "size": len(data)}).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + data


def unpack(blob: bytes, key: ArtifactKey, *, where: str) -> bytes:
    """The tar payload of ``blob`` if it was made for exactly ``key`` and is intact; ``PeerError`` otherwise."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _LENGTH.size:
        raise PeerError(f"{where}: not a preheat artifact blob")
    (length,) = _LENGTH.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    try:
        header = json.loads(blob[start : start + length])
    except ValueError:
        raise PeerError(f"{where}: artifact header is not JSON") from None
    data = blob[start + length :]
    if not isinstance(header, dict) or header.get("key") != asdict(key):
        theirs = header.get("key") if isinstance(header, dict) else None
        differ = sorted(k for k, v in asdict(key).items() if not isinstance(theirs, dict) or theirs.get(k) != v)
        raise PeerError(f"{where}: artifacts were compiled for another key (differs in {', '.join(differ)}); refused")
    if header.get("size") != len(data) or header.get("checksum") != digest.digest_bytes(data):
        raise PeerError(f"{where}: artifact checksum mismatch (corrupt or truncated); refused")
    return data


def install(blob: bytes, key: ArtifactKey, directory: str, *, where: str) -> None:
    """Check ``blob`` against ``key`` and extract it into ``directory`` (members outside it are refused)."""
    data = unpack(blob, key, where=where)
    os.makedirs(directory, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        try:
            tar.extractall(directory, filter="data")  # refuses absolute paths, "..", links leaving the directory
        except tarfile.TarError as exc:
            raise PeerError(f"{where}: artifact payload refused: {exc}") from None


class ArtifactStore:
    """Blobs in the node cache: ``<cache>/compiled/<key>.blob``, and each key's Inductor directory beside it."""

    def __init__(self, cache_root: str) -> None:
        self.root = os.path.join(cache_root, "compiled")

    def blob_path(self, hex_key: str) -> str:
        return os.path.join(self.root, f"{hex_key}.blob")

    def inductor_dir(self, key: ArtifactKey) -> str:
        return os.path.join(self.root, key.hex, "inductor")

    def lookup(self, hex_key: str) -> str | None:
        """The blob's path if this node has it (what the peer server serves)."""
        path = self.blob_path(hex_key)
        return path if os.path.isfile(path) else None

    def get(self, key: ArtifactKey) -> bytes | None:
        path = self.lookup(key.hex)
        if path is None:
            return None
        with open(path, "rb") as handle:
            return handle.read()

    def put(self, key: ArtifactKey, blob: bytes) -> str:
        """Store ``blob`` atomically (checked first: a bad blob is never kept); returns its path."""
        unpack(blob, key, where="artifact to store")
        os.makedirs(self.root, exist_ok=True)
        path = self.blob_path(key.hex)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(blob)
        os.replace(tmp, path)
        return path


def fetch(address: str, key: ArtifactKey, *, token: str | None, timeout: float = 5.0) -> bytes | None:
    """The blob for ``key`` from the peer at ``address``, or None when it has none (or cannot be reached)."""
    request = urllib.request.Request(f"http://{address}{ARTIFACTS_ROUTE}{key.hex}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code != 404:
            log.warning("compile: peer %s refused artifacts: HTTP %d", address, exc.code)
        return None
    except OSError as exc:
        log.warning("compile: peer %s unreachable for artifacts: %s", address, exc)
        return None
