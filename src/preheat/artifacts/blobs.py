"""Compiled artifacts: torch.compile's caches packed under a key of everything that makes them valid, and installed
only when this node built them or a key its operator trusts signed them.

A cold ``torch.compile`` spends most of its time generating and compiling kernels (Inductor's C++/Triton code);
with the Inductor cache directory of a replica that compiled the same model already, the newcomer only traces. The
directory (``TORCHINDUCTOR_CACHE_DIR``: FX graphs, AOT autograd entries, compiled kernels) is packed into one blob
(spec: docs/peer.md):

    body = b"PREHEAT-ARTIFACT 2\\n" | u64 LE header length | header JSON {"key", "size", "sha256"} | tar payload
    blob = body [ | b"PREHEAT-SIGNATURE 1\\n" | 32-byte Ed25519 public key | 64-byte signature ]

The signature signs ``SIGNING_CONTEXT + SHA-256(body)``: the header (so the key it was built for) and the payload,
byte for byte. The header's ``sha256`` only tells corruption from tampering in messages; it is self-declared, so it
is never a reason to trust a blob. A blob is code (generated Python, shared objects, pickled graphs), hence:

- it is installed only when its header's key equals the local key field by field, and it was *built on this node*
  (the node cache's ``compiled/<key>.local`` names the SHA-256 of the body this node packed) or *signed by a trusted
  key* (``--trust-key``); anything else is refused, with a message saying how to enable signed artifacts;
- a node stores (and so re-serves to its peers) only blobs that passed those checks, and checks them again before
  serving each one, so a key no longer trusted stops both (``preheat.artifacts.store``: the cache and fetches);
- the tar payload may hold only regular files and directories with relative names inside the target directory.

Bounds: a blob is at most ``MAX_BLOB_BYTES`` (1 GiB; fetches stop reading there), its header ``MAX_HEADER_BYTES``
(64 KiB), its payload ``MAX_MEMBERS`` members (100,000). Checking a blob holds it, one copy of its payload and one
``TarInfo`` per member (each member takes at least 512 bytes of payload), so memory is a small multiple of its size.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import posixpath
import struct
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Protocol

import xxhash

from preheat.artifacts.signing import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    SigningKey,
    TrustedKeys,
    fingerprint,
    verify_signature,
)
from preheat.core.errors import ArtifactTrustError, JSONInputError, PeerError
from preheat.core.jsonsafe import loads_bounded

MAGIC = b"PREHEAT-ARTIFACT 2\n"
SIGNATURE_MAGIC = b"PREHEAT-SIGNATURE 1\n"
SIGNING_CONTEXT = b"preheat compiled-artifact signature 1\n"  # so a signature over a blob means nothing elsewhere
_LENGTH = struct.Struct("<Q")
_TRAILER = len(SIGNATURE_MAGIC) + PUBLIC_KEY_BYTES + SIGNATURE_BYTES
MAX_BLOB_BYTES = 1 << 30  # an Inductor cache for one model is tens of MB; this leaves room, and bounds memory
MAX_HEADER_BYTES = 64 * 1024
MAX_MEMBERS = 100_000
_MAX_NAME = 4096
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
BUILT_HERE = "built on this node"
HOW_TO_TRUST = (
    "compiled artifacts are code, so a replica installs another's only when a key it trusts signed them. "
    "To enable: `preheat artifacts keygen fleet.key` once; `preheat artifacts sign --key fleet.key` on the replica "
    "(or build job) that compiled them; `--trust-key fleet.key.pub` (PREHEAT_TRUST_KEY) on the replicas that "
    "install them (docs/peer.md)"
)
# CPU features that change the code Inductor generates (vector width, bf16/fp16 and matrix instructions).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "fma", "asimd")


class CompiledKey(Protocol):
    """A key of any kind of compiled artifact: its fields (a JSON object; ``format`` names the kind, so keys of two
    kinds never share a name) and its name, ``key_hex(fields())``. ``ArtifactKey`` is preheat's own engine's;
    ``preheat.artifacts.vllm.VllmCacheKey`` is vLLM's compile cache's."""

    @property
    def hex(self) -> str: ...

    def fields(self) -> dict[str, object]: ...


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
    # 2: signed blobs. Bumped so directories installed unverified by format 1 are never reused under a new key.
    format: str = "inductor-dir-2"

    @property
    def hex(self) -> str:
        """The key's name: xxh3-128 of its canonical JSON (32 hex digits), used in paths and URLs."""
        return key_hex(asdict(self))

    def fields(self) -> dict[str, object]:
        return asdict(self)


def key_hex(fields: dict[str, object]) -> str:
    """The name of a key given as its fields (a blob header's ``key``), as ``ArtifactKey.hex`` computes it."""
    return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True).encode())


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


# -- the format (pure) -------------------------------------------------------------------------------------------


def pack(key: CompiledKey, directory: str) -> bytes:
    """The unsigned blob of ``directory`` (an Inductor cache dir) for ``key``: its entries at the payload's top."""
    return pack_trees(key, [(name, os.path.join(directory, name)) for name in sorted(os.listdir(directory))])


def pack_trees(key: CompiledKey, trees: Iterable[tuple[str, str]]) -> bytes:
    """The unsigned blob of several paths for ``key``, each ``(name in the payload, path)``. Locks (``locks``
    directories, ``*.lock`` files: Inductor's, valid only in the process that took them) are left out; so are
    symlinks and anything but files and directories, which the payload may not hold."""
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for arcname, path in trees:
            if not _is_lock(arcname, os.path.isdir(path)):
                tar.add(path, arcname=arcname, filter=_packable)
    return encode(key, payload.getvalue())


def _is_lock(name: str, is_dir: bool) -> bool:
    base = posixpath.basename(name)
    return (is_dir and base == "locks") or (not is_dir and base.endswith(".lock"))


def _packable(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if _is_lock(info.name, info.isdir()):
        return None
    return info if info.isdir() or info.type in _FILE_TYPES else None


def encode(key: CompiledKey, payload: bytes) -> bytes:
    """The unsigned blob of a tar ``payload`` for ``key``."""
    header = {"key": key.fields(), "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    data = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(data)) + data + payload


@dataclass(frozen=True, eq=False)
class Parsed:
    """A blob's parts, its structure checked (not its trust). ``payload`` is a view into the blob."""

    key: dict[str, object]  # the header's key fields, as sent
    key_hex: str
    payload: memoryview
    body_end: int  # the signed part is blob[:body_end]
    body_sha256: str
    signer: bytes | None
    signature: bytes | None


def parse(raw: bytes, *, where: str) -> Parsed:
    """Split a blob into header, payload and signature; ``PeerError`` naming ``where`` for anything malformed."""
    if len(raw) > MAX_BLOB_BYTES:
        raise PeerError(f"{where}: artifact blob of {len(raw)} bytes is larger than {MAX_BLOB_BYTES}; refused")
    if not raw.startswith(MAGIC):
        if raw.startswith(MAGIC[:17]):
            raise PeerError(f"{where}: artifact blob of another format version (this build reads 2); refused")
        raise PeerError(f"{where}: not a preheat artifact blob")
    start = len(MAGIC) + _LENGTH.size
    if len(raw) < start:
        raise PeerError(f"{where}: artifact blob truncated in its header")
    (length,) = _LENGTH.unpack_from(raw, len(MAGIC))
    if length > MAX_HEADER_BYTES or start + length > len(raw):
        raise PeerError(f"{where}: artifact header length {length} is impossible (truncated or not a blob)")
    view = memoryview(raw)
    try:
        header = loads_bounded(view[start : start + length], max_bytes=MAX_HEADER_BYTES)
    except JSONInputError as exc:  # not UTF-8, not JSON, or nested too deep
        raise PeerError(f"{where}: artifact header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PeerError(f"{where}: artifact header is not a JSON object")
    key, size, checksum = header.get("key"), header.get("size"), header.get("sha256")
    if not isinstance(key, dict) or type(size) is not int or size < 0 or not isinstance(checksum, str):
        raise PeerError(f"{where}: artifact header lacks key, size or sha256")
    try:
        name = key_hex(key)
    except (ValueError, RecursionError):
        raise PeerError(f"{where}: artifact key cannot be encoded") from None
    payload_start = start + length
    body_end = payload_start + size
    if body_end > len(raw):
        raise PeerError(f"{where}: artifact payload truncated ({len(raw) - payload_start} of {size} bytes)")
    payload = view[payload_start:body_end]
    if hashlib.sha256(payload).hexdigest() != checksum:
        raise PeerError(f"{where}: artifact checksum mismatch (corrupt or altered); refused")
    trailer = bytes(view[body_end:])
    signer = signature = None
    if trailer:
        if len(trailer) != _TRAILER or not trailer.startswith(SIGNATURE_MAGIC):
            raise PeerError(f"{where}: {len(trailer)} unexpected bytes after the artifact payload; refused")
        signer = trailer[len(SIGNATURE_MAGIC) : len(SIGNATURE_MAGIC) + PUBLIC_KEY_BYTES]
        signature = trailer[len(SIGNATURE_MAGIC) + PUBLIC_KEY_BYTES :]
    body_sha256 = hashlib.sha256(view[:body_end]).hexdigest()
    return Parsed(key, name, payload, body_end, body_sha256, signer, signature)


def signed_message(body_sha256: str) -> bytes:
    """What a signature signs: the context string and the SHA-256 of the blob's body (header and payload)."""
    return SIGNING_CONTEXT + bytes.fromhex(body_sha256)


def sign(raw: bytes, key: SigningKey, *, where: str) -> bytes:
    """``raw`` (a well-formed blob, signed or not) signed by ``key``; a previous signature is replaced."""
    parsed = parse(raw, where=where)
    signature = key.sign(signed_message(parsed.body_sha256))
    return raw[: parsed.body_end] + SIGNATURE_MAGIC + key.public + signature


@contextlib.contextmanager
def _checked_tar(payload: memoryview | bytes, *, where: str) -> Iterator[tuple[tarfile.TarFile, list[tarfile.TarInfo]]]:
    """The payload's tar and its members, each checked: a regular file or a directory, a relative name with no
    ``..``, inside the payload's bytes, not twice, not under a file. ``PeerError`` for anything else."""
    size = len(payload)
    members: list[tarfile.TarInfo] = []
    seen: dict[str, str] = {}  # normalized name -> "file", "dir", or "implied" (a directory a member is under)
    try:
        with tarfile.open(fileobj=io.BytesIO(payload), mode="r:") as tar:  # "r:": never decompress (no bombs)
            for info in tar:
                if len(members) >= MAX_MEMBERS:
                    raise PeerError(f"{where}: artifact payload has more than {MAX_MEMBERS} members; refused")
                _check_member(info, size, seen, where=where)
                members.append(info)
            yield tar, members
    except (tarfile.TarError, ValueError, OverflowError, EOFError) as exc:  # ValueError: e.g. GNU sparse pax fields
        raise PeerError(f"{where}: artifact payload refused: {exc}") from None


def _check_member(info: tarfile.TarInfo, size: int, seen: dict[str, str], *, where: str) -> None:
    name = info.name
    norm = posixpath.normpath(name)
    kind = "dir" if info.isdir() else "file"
    refuse = ""
    if info.issparse() or not (info.isdir() or info.type in _FILE_TYPES):
        refuse = "is not a regular file or directory (links and devices are refused)"
    elif not name or len(name) > _MAX_NAME or name.startswith("/") or ".." in name.split("/") or "\\" in name:
        refuse = "is not a relative name inside the directory"
    elif norm == ".":
        refuse = "names the directory itself"
    elif info.size < 0 or info.offset_data + info.size > size:
        refuse = "runs past the end of the payload"
    elif seen.get(norm) in ("file", "dir"):
        refuse = "appears twice"
    elif seen.get(norm) == "implied" and kind == "file":
        refuse = "is a file where other members need a directory"
    else:
        ancestors = [posixpath.dirname(norm)]
        while ancestors[-1]:
            ancestors.append(posixpath.dirname(ancestors[-1]))
        if any(seen.get(a) == "file" for a in ancestors):
            refuse = "is under a file"
        seen.update((a, seen.get(a, "implied")) for a in ancestors if a)
        seen[norm] = kind
    if refuse:
        raise PeerError(f"{where}: artifact payload member {name[:200]!r} {refuse}; refused")


def check_payload(payload: memoryview | bytes, *, where: str) -> int:
    """Check every member of a tar payload (see ``_checked_tar``); returns how many there are."""
    with _checked_tar(payload, where=where) as (_, members):
        return len(members)


def payload_names(payload: memoryview | bytes, *, where: str) -> list[str]:
    """The normalized names of a tar payload's members (each checked, see ``_checked_tar``), in payload order: what
    a kind of artifact checks its layout against before installing."""
    with _checked_tar(payload, where=where) as (_, members):
        return [posixpath.normpath(info.name) for info in members]


# -- trust ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Verified:
    """A blob this node may install, store and re-serve: built here, or signed by a trusted key, for the key it
    names, with a safe payload. Made only by ``verify`` and ``built_here``: holding one means the checks ran."""

    hex: str
    blob: bytes
    payload: memoryview
    body_sha256: str
    provenance: str  # BUILT_HERE, or "signed by ed25519:..."

    @property
    def local(self) -> bool:
        return self.provenance == BUILT_HERE


def _check_key(parsed: Parsed, key: CompiledKey, *, where: str) -> None:
    if parsed.key_hex != key.hex:
        theirs, ours = parsed.key, key.fields()
        if theirs.get("format") != ours.get("format"):
            kind = str(theirs.get("format"))[:80]
            raise PeerError(f"{where}: artifacts are of another kind ({kind!r}, not {ours.get('format')!r}); refused")
        differ = sorted(k for k, v in ours.items() if theirs.get(k) != v or type(theirs.get(k)) is not type(v))
        raise PeerError(
            f"{where}: artifacts were compiled for another key (differs in {', '.join(differ) or 'extra fields'}); "
            "refused"
        )


def _authorize(parsed: Parsed, trusted: TrustedKeys, *, built_here: str | None, where: str) -> str:
    """The blob's provenance, or ``ArtifactTrustError`` saying why it is not trusted and how to trust it."""
    if built_here is not None and built_here == parsed.body_sha256:
        return BUILT_HERE
    if parsed.signer is None or parsed.signature is None:
        raise ArtifactTrustError(f"{where}: artifacts are not signed; refused. {HOW_TO_TRUST}")
    who = fingerprint(parsed.signer)
    if parsed.signer not in trusted:
        raise ArtifactTrustError(
            f"{where}: artifacts are signed by {who}, which is not a trusted key (trusted: {trusted.describe()}); "
            f"refused. {HOW_TO_TRUST}"
        )
    if not verify_signature(parsed.signer, parsed.signature, signed_message(parsed.body_sha256)):
        raise ArtifactTrustError(f"{where}: artifact signature by {who} does not match its contents (altered); refused")
    return f"signed by {who}"


def verify(
    raw: bytes, key: CompiledKey | str, trusted: TrustedKeys, *, where: str, built_here: str | None = None
) -> Verified:
    """Check ``raw`` for ``key`` (a key of any kind, or just its hex name): structure, key, trust, payload.

    ``built_here`` is the body SHA-256 this node recorded when it packed the blob (the node cache's marker): such a
    blob needs no signature. Raises ``PeerError`` (``ArtifactTrustError`` when only trust is missing)."""
    return _verify_parsed(parse(raw, where=where), raw, key, trusted, where=where, built_here=built_here)


def _verify_parsed(
    parsed: Parsed, raw: bytes, key: CompiledKey | str, trusted: TrustedKeys, *, where: str, built_here: str | None
) -> Verified:
    """``verify`` of a blob already parsed (parsing hashes the whole blob: once is enough)."""
    if not isinstance(key, str):
        _check_key(parsed, key, where=where)
    elif parsed.key_hex != key:
        raise PeerError(f"{where}: artifact blob names key {parsed.key_hex}, not {key}; refused")
    provenance = _authorize(parsed, trusted, built_here=built_here, where=where)
    check_payload(parsed.payload, where=where)
    return Verified(parsed.key_hex, raw, parsed.payload, parsed.body_sha256, provenance)


def built_here(key: CompiledKey, raw: bytes) -> Verified:
    """The blob this process just packed (``pack``), as a ``Verified`` of local provenance."""
    where = "artifacts packed here"
    parsed = parse(raw, where=where)
    return _verify_parsed(parsed, raw, key, TrustedKeys(), where=where, built_here=parsed.body_sha256)


def install(verified: Verified, directory: str, *, where: str) -> None:
    """Extract a verified blob's payload into ``directory`` (its members were checked; the ``data`` filter too)."""
    if not hasattr(tarfile, "data_filter"):  # Python < 3.10.12 / 3.11.4: no filter, so no owner/mode clean-up
        raise PeerError(f"{where}: this Python lacks tarfile's data filter (3.10.12+, 3.11.4+); not installed")
    os.makedirs(directory, exist_ok=True)
    try:
        with _checked_tar(verified.payload, where=where) as (tar, members):
            tar.extractall(directory, members=members, filter="data")
    except OSError as exc:
        raise PeerError(f"{where}: artifact payload cannot be installed in {directory}: {exc}") from None
