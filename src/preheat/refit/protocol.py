"""The refit protocol, pure: version manifests, what a replica must fetch, and which holder serves which tensor.

A *version manifest* says: version ``N`` of the served name ``NAME`` is these tensors (name, dtype, shape, bytes,
``xxh3-128`` digest of the bytes), each marked ``changed`` when its digest differs from version ``N-1``'s. Its
``identity`` is the digest of its canonical JSON (name and version included), so two versions never share an
identity: it is the model identity a replica puts into its KV keys once it serves the version.

Manifests come from the network (a trainer, another replica): ``VersionManifest.from_json`` bounds and checks every
field, and a puller checks every tensor's bytes against the manifest it fetched before anything is swapped in.

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
from dataclasses import dataclass

from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.dtypes import is_known, itemsize
from preheat.checkpoint.manifest import canonical_json
from preheat.core.errors import JSONInputError, RefitError
from preheat.core.jsonsafe import loads_bounded

FORMAT = 1
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~150 bytes a tensor: far beyond any model's tensor count
MAX_TENSORS = 200_000
_DIGEST = re.compile(r"^xxh3-128:[0-9a-f]{32}$")
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


@dataclass(frozen=True)
class VersionManifest:
    """Version ``version`` of ``name``: its tensors, in a fixed order."""

    name: str
    version: int
    tensors: tuple[TensorEntry, ...]

    @property
    def identity(self) -> str:
        """``xxh3-128:...`` of the canonical JSON: the model identity of this version (KV keys, registry)."""
        return digest_bytes(canonical_json(self.to_dict()))

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
            "version": self.version,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def to_json(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> VersionManifest:
        """Parse and check a manifest from ``where`` (a URL); ``RefitError`` naming it for anything malformed."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise RefitError(f"{where}: version manifest over {MAX_MANIFEST_BYTES} bytes")
        try:
            doc = loads_bounded(data, max_bytes=MAX_MANIFEST_BYTES)
        except JSONInputError as exc:
            raise RefitError(f"{where}: version manifest refused ({exc})") from None
        try:
            return _parse(doc)
        except (ValueError, TypeError, KeyError) as exc:
            raise RefitError(f"{where}: not a version manifest: {exc}") from None


def _parse(doc: object) -> VersionManifest:
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"format {str(doc.get('format'))[:20]} (this preheat reads format {FORMAT})")
    name, version, raw = doc["name"], doc["version"], doc["tensors"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError("name is not a served name")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**62:
        raise ValueError("version is not a count")
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise ValueError(f"tensors is not a list of at most {MAX_TENSORS}")
    tensors = tuple(_tensor(item) for item in raw)
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("a tensor is listed twice")
    return VersionManifest(name, version, tensors)


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
