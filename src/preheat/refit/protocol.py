"""The refit protocol, pure: version manifests, what a replica must fetch, and which holder serves which tensor.

A *version manifest* says: version ``N`` of the served name ``NAME``, published in the publisher's ``epoch``, is
these tensors (name, dtype, shape, bytes, ``xxh3-128`` digest of the bytes), each marked ``changed`` when its digest
differs from version ``N-1``'s. Versions are ordered by ``(epoch, version)`` (``key``): a trainer that restarts
picks a new, later epoch, so its version 1 comes after everything it published before. The ``identity`` is the
digest of the canonical JSON (name, epoch and version included), so two versions never share an identity: it is
the model identity a replica puts into its KV keys once it serves the version.

On the wire a manifest travels with its ``signature`` (the publisher's Ed25519 key and its signature of the
canonical JSON, ``preheat.refit.trust``), or with none when the publisher has no key. Manifests come from the
network (a trainer, another replica): ``VersionManifest.from_json`` bounds and checks every field, ``trust`` checks
the signature against the keys the replica trusts, and a puller checks every tensor's bytes against the manifest
before anything is swapped in.

>>> t = TensorEntry("w", "F32", (2,), 8, "xxh3-128:" + 32 * "0", changed=True)
>>> m = VersionManifest("tiny", 3, (t,))
>>> VersionManifest.from_json(m.to_json(), where="test") == m
True
>>> [e.name for e in to_fetch({"w": t.digest}, m)], [e.name for e in to_fetch({}, m)]
([], ['w'])
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.dtypes import is_known, itemsize
from preheat.checkpoint.manifest import canonical_json
from preheat.core.errors import JSONInputError, RefitError
from preheat.core.jsonsafe import loads_bounded

FORMAT = 2  # 2: the publisher's epoch, and the manifest inside a (possibly signed) envelope
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~150 bytes a tensor: far beyond any model's tensor count
MAX_TENSORS = 200_000
MAX_COUNT = 2**62  # versions and epochs: counts, below any JSON number's loss of precision in other languages' parsers
_DIGEST = re.compile(r"^xxh3-128:[0-9a-f]{32}$")
_SIGNER = re.compile(r"^[0-9a-f]{64}$")  # a raw Ed25519 public key, hex
_SIGNATURE = re.compile(r"^[0-9a-f]{128}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")  # a served name: also a registry and URL path part
# Tensor names travel in URL paths: dotted identifiers, nothing a path or a query would read as more.
_TENSOR = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,511}$")


def head_name(name: str) -> str:
    """The registry name every holder of ``NAME``'s versions (trainer and replicas) announces itself under."""
    return f"refit:{name}"


def head_identity(name: str) -> str:
    """The registry identity of ``NAME``'s holders: fixed per name, so each holder has one entry per address."""
    return digest_bytes(f"preheat-refit-head\0{name}".encode())


def check_name(name: str) -> str:
    """``name`` if it can name a refit model (``RefitError`` otherwise)."""
    if not _NAME.match(name):
        raise RefitError(f"refit name {name[:80]!r}: use letters, digits and ._/- (at most 200 characters)")
    return name


def check_tensor_name(name: str, where: str) -> str:
    """``name`` if it can travel in a URL path (``RefitError`` naming ``where`` otherwise)."""
    if not _TENSOR.match(name):
        raise RefitError(f"{where}: tensor name {name[:80]!r} is not a dotted identifier (letters, digits, _.:-)")
    return name


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: safetensors dtype name, shape, byte length, digest of the bytes, and whether the
    bytes differ from the previous version's."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str
    changed: bool = True

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "digest": self.digest,
            "changed": self.changed,
        }


VersionKey = tuple[int, int]  # (epoch, version): the order of versions


@dataclass(frozen=True)
class Signature:
    """Who signed a manifest (a raw 32-byte Ed25519 public key) and the 64-byte signature (``preheat.refit.trust``)."""

    signer: bytes
    value: bytes

    def to_dict(self) -> dict[str, str]:
        return {"signer": self.signer.hex(), "value": self.value.hex()}


@dataclass(frozen=True)
class VersionManifest:
    """Version ``version`` of ``name`` in the publisher's ``epoch``: its tensors, in a fixed order; ``signature``:
    the publisher's, when it has a key (not part of what is signed, nor of the identity)."""

    name: str
    version: int
    tensors: tuple[TensorEntry, ...]
    epoch: int = 0
    signature: Signature | None = None

    @property
    def key(self) -> VersionKey:
        """``(epoch, version)``: a larger key is a later version."""
        return (self.epoch, self.version)

    @property
    def identity(self) -> str:
        """``xxh3-128:...`` of the canonical JSON: the model identity of this version (KV keys, registry)."""
        return digest_bytes(self.signed_bytes())

    def signed_bytes(self) -> bytes:
        """The canonical JSON of everything but the signature: what the publisher signs and the identity digests.
        Made again from the parsed values on every check, so a signature covers exactly what the replica uses."""
        return canonical_json(self.to_dict())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def changed_bytes(self) -> int:
        """Bytes of the tensors that differ from the previous version."""
        return sum(t.nbytes for t in self.tensors if t.changed)

    def digests(self) -> dict[str, str]:
        return {t.name: t.digest for t in self.tensors}

    def entry(self, tensor: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == tensor), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "name": self.name,
            "epoch": self.epoch,
            "version": self.version,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def to_json(self) -> bytes:
        """The wire form (``GET /refit/v1/epochs/E/versions/N``): ``{"manifest": {...}, "signature": {"signer":
        hex, "value": hex} | null}``."""
        signature = self.signature.to_dict() if self.signature is not None else None
        return canonical_json({"manifest": self.to_dict(), "signature": signature})

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> VersionManifest:
        """Parse and check a manifest from ``where`` (a URL); ``RefitError`` naming it for anything malformed. The
        signature is parsed, not checked: ``preheat.refit.trust.check_signature`` does that."""
        if len(data) > MAX_DOCUMENT_BYTES:
            raise RefitError(f"{where}: version manifest over {MAX_DOCUMENT_BYTES} bytes")
        try:
            doc = loads_bounded(data, max_bytes=MAX_DOCUMENT_BYTES, max_depth=8)
        except JSONInputError as exc:
            raise RefitError(f"{where}: version manifest refused ({exc})") from None
        try:
            return _envelope(doc)
        except (ValueError, TypeError, KeyError) as exc:
            raise RefitError(f"{where}: not a version manifest: {str(exc)[:300]}") from None


MAX_DOCUMENT_BYTES = MAX_MANIFEST_BYTES + 1024  # the envelope and the signature around a manifest


def _envelope(doc: object) -> VersionManifest:
    if not isinstance(doc, dict) or set(doc) != {"manifest", "signature"}:
        raise ValueError("not an object of a manifest and its signature")
    manifest, raw = _parse(doc["manifest"]), doc["signature"]
    if raw is None:
        return manifest
    if not isinstance(raw, dict) or set(raw) != {"signer", "value"}:
        raise ValueError("signature is not an object of signer and value")
    signer, value = raw["signer"], raw["value"]
    if not isinstance(signer, str) or not _SIGNER.match(signer):
        raise ValueError("signature signer is not 64 lowercase hex digits (an Ed25519 public key)")
    if not isinstance(value, str) or not _SIGNATURE.match(value):
        raise ValueError("signature value is not 128 lowercase hex digits (an Ed25519 signature)")
    return replace(manifest, signature=Signature(bytes.fromhex(signer), bytes.fromhex(value)))


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{what} is not a count")
    return value


def _parse(doc: object) -> VersionManifest:
    if not isinstance(doc, dict):
        raise ValueError("manifest is not an object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"format {str(doc.get('format'))[:20]} (this preheat reads format {FORMAT})")
    name, raw = doc["name"], doc["tensors"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError("name is not a served name")
    version, epoch = _count(doc["version"], "version"), _count(doc["epoch"], "epoch")
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise ValueError(f"tensors is not a list of at most {MAX_TENSORS}")
    tensors = tuple(_tensor(item) for item in raw)
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("a tensor is listed twice")
    return VersionManifest(name, version, tensors, epoch)


def _tensor(item: object) -> TensorEntry:
    if not isinstance(item, dict):
        raise ValueError("a tensor is not an object")
    name, dtype, shape, nbytes, digest = (item[k] for k in ("name", "dtype", "shape", "nbytes", "digest"))
    changed = item.get("changed", True)
    if not isinstance(name, str) or not _TENSOR.match(name):
        raise ValueError(f"tensor name {str(name)[:80]!r} is not a dotted identifier")
    if not isinstance(dtype, str) or not is_known(dtype):
        raise ValueError(f"tensor {name}: dtype {str(dtype)[:20]!r} is not a safetensors dtype")
    if not isinstance(shape, list) or len(shape) > 8:
        raise ValueError(f"tensor {name}: shape is not a list of at most 8 sizes")
    if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 2**40 for d in shape):
        raise ValueError(f"tensor {name}: shape {shape} is not sizes")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ValueError(f"tensor {name}: digest is not xxh3-128:<32 hex>")
    if not isinstance(changed, bool):
        raise ValueError(f"tensor {name}: changed is not true/false")
    if isinstance(nbytes, bool) or nbytes != math.prod(shape) * itemsize(dtype):
        raise ValueError(f"tensor {name}: nbytes {str(nbytes)[:20]} is not shape x itemsize")
    return TensorEntry(name, dtype, tuple(shape), nbytes, digest, changed)


def mark_changes(tensors: Sequence[TensorEntry], previous: Mapping[str, str] | None) -> tuple[TensorEntry, ...]:
    """``tensors`` with ``changed`` set against ``previous`` (name -> digest of version N-1; None: all changed)."""
    return tuple(
        TensorEntry(t.name, t.dtype, t.shape, t.nbytes, t.digest, previous is None or previous.get(t.name) != t.digest)
        for t in tensors
    )


def to_fetch(have: Mapping[str, str], manifest: VersionManifest) -> list[TensorEntry]:
    """The tensors of ``manifest`` a replica holding ``have`` (name -> digest) must fetch: those whose digest it does
    not hold. Judged on the replica's own digests, not on ``changed``, so a replica two versions behind still gets
    every tensor that differs from what it serves."""
    return [t for t in manifest.tensors if have.get(t.name) != t.digest]


def stripe(entries: Sequence[TensorEntry], sources: Sequence[str]) -> dict[str, list[TensorEntry]]:
    """A first assignment of ``entries`` to ``sources``: largest tensor first to the source with the fewest bytes so
    far, so each source serves about the same bytes. Pullers rebalance as they go (a free source takes any waiting
    tensor), so this only decides who starts with what.

    >>> e = [TensorEntry(n, "U8", (s,), s, "xxh3-128:" + 32 * "0") for n, s in (("a", 8), ("b", 5), ("c", 4))]
    >>> {k: [t.name for t in v] for k, v in stripe(e, ["x", "y"]).items()}
    {'x': ['a'], 'y': ['b', 'c']}
    """
    if not sources:
        raise RefitError("no source holds the version: nothing to pull from")
    plan: dict[str, list[TensorEntry]] = {s: [] for s in sources}
    load = dict.fromkeys(sources, 0)
    for entry in sorted(entries, key=lambda t: (-t.nbytes, t.name)):
        source = min(sources, key=lambda s: (load[s], sources.index(s)))
        plan[source].append(entry)
        load[source] += entry.nbytes
    return plan
