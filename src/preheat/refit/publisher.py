"""The trainer's side: publish versions of a state dict from memory, for replicas to pull while training goes on.

``publish(state_dict, version)`` snapshots the tensors (cast to the serving dtype if asked, e.g. fp32 master weights
to bf16), digests each, marks those whose digest equals the previous version's as unchanged (they share the previous
snapshot's memory: no second copy), and from then on serves the version over HTTP (``preheat.refit.server``). No
checkpoint is written to disk. The last ``keep`` versions stay servable, so a replica that is one version behind
still finds its tensors here while the next one is published.

The publisher announces itself in the peer registry under ``refit:NAME`` (``protocol.head_name``), with a heartbeat:
a trainer that dies disappears from the registry within the TTL, and replicas then pull from each other.

Every version carries the publisher's ``epoch`` (its start time in milliseconds unless given), and with a
``signing_key`` (``preheat artifacts keygen``) its manifest is signed (``preheat.refit.trust``): replicas started
with ``--refit-trust-key`` apply only signed versions, and a trainer that restarts and counts from 1 again still moves
them forward.

>>> with Publisher("tiny", registry="file:///tmp/reg", signing_key="trainer.key") as pub:   # doctest: +SKIP
...     pub.publish(model.state_dict(), version=1, dtype=torch.bfloat16)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

import torch

from preheat.artifacts.signing import SigningKey
from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.torch_dtypes import from_torch
from preheat.core.errors import ConfigError, RefitError
from preheat.http.tls import TLSFiles
from preheat.peer.registry import DEFAULT_TTL, Heartbeat, PeerEntry, Registry, open_registry
from preheat.refit.lookout import holder_claims
from preheat.refit.protocol import (
    MAX_COUNT,
    TensorEntry,
    VersionManifest,
    check_name,
    check_tensor_name,
    head_identity,
    head_name,
    mark_changes,
)
from preheat.refit.server import RefitServer
from preheat.refit.trust import new_epoch, sign

log = logging.getLogger("preheat.refit")


@dataclass(frozen=True)
class _Version:
    manifest: VersionManifest
    data: dict[str, torch.Tensor]  # name -> contiguous CPU tensor holding the published bytes


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    return flat.numpy().data.cast("B")


def snapshot(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor`` (cast to ``dtype`` when it is a float tensor) that the trainer's next
    optimizer step cannot change."""
    out = tensor.detach()
    if dtype is not None and out.is_floating_point() and out.dtype != dtype:
        out = out.to(dtype)
    out = out.to("cpu").contiguous()
    if out.data_ptr() == tensor.data_ptr() or out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        out = out.clone()  # no conversion made a copy: this would be the trainer's own memory
    return out


def full_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every sharded tensor (a ``DTensor``: FSDP2, tensor parallel) gathered whole. A collective:
    every rank of the tensors' mesh calls it with its own state dict; one rank then publishes the result.

    >>> full = full_state_dict(model.state_dict())   # doctest: +SKIP  (on every rank)
    >>> if rank == 0:                                 # doctest: +SKIP
    ...     publisher.publish(full)
    """
    return {name: _gathered(tensor) for name, tensor in state_dict.items()}


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # DTensor's: torch.distributed.tensor is not imported for others
    return full() if callable(full) else tensor


def _whole(name: str, tensor: torch.Tensor, where: str) -> torch.Tensor:
    """``tensor`` whole: a DTensor of a one-rank mesh is gathered here; one sharded over several ranks must be
    gathered by every rank (``full_state_dict``), or this rank alone would wait for the others forever."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None or not callable(getattr(tensor, "full_tensor", None)):
        return tensor
    if mesh.size() > 1:
        raise RefitError(
            f"{where}: tensor {name} is a DTensor over {mesh.size()} ranks: gather it on every rank with "
            "preheat.refit.publisher.full_state_dict(state_dict), then publish the result on one rank"
        )
    return _gathered(tensor)


def _as_served(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether ``tensor``'s own bytes are the bytes it would be served as (CPU, contiguous, no cast to make)."""
    cast = dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype
    return not cast and tensor.device.type == "cpu" and tensor.is_contiguous()


def _unless_unchanged(
    tensor: torch.Tensor, dtype: torch.dtype | None, kept: torch.Tensor | None, old: str | None
) -> tuple[torch.Tensor, str]:
    """The snapshot of ``tensor`` to serve and its digest: ``kept`` (the previous version's, digest ``old``) when the
    bytes did not change, so unchanged tensors share one copy."""
    # The trainer's own bytes are hashed first when they are the served bytes: an unchanged tensor is never copied.
    served = kept is not None and old is not None and _as_served(tensor, dtype)
    if kept is not None and served and digest_bytes(tensor_view(tensor.detach())) == old:
        return kept, old
    copy = snapshot(tensor, dtype)
    digest = digest_bytes(tensor_view(copy))
    return (kept, digest) if kept is not None and digest == old else (copy, digest)


class Publisher:
    """Publishes versions of ``name`` from this process's memory; see the module docstring.

    ``registry``: ``redis://...``, ``file:///dir`` or a ``Registry``; ``host``/``port``/``token``: where the refit
    server listens (loopback by default; beyond it a token is required); ``keep``: versions kept servable;
    ``tls``: serve https with its certificate, requiring client certificates signed by its CA when it has one;
    ``signing_key``: a ``SigningKey`` or the path of its PEM file, to sign every version's manifest; ``epoch``: the
    epoch of every version published here (default: now, in milliseconds; a later publisher must have a larger one).
    """

    def __init__(
        self,
        name: str,
        *,
        registry: str | Registry,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        keep: int = 2,
        ttl: float = DEFAULT_TTL,
        tls: TLSFiles | None = None,
        signing_key: SigningKey | str | None = None,
        epoch: int | None = None,
    ) -> None:
        if keep < 1:
            raise ConfigError(f"keep={keep}: a publisher must keep at least the latest version")
        if epoch is not None and not 0 <= epoch < MAX_COUNT:
            raise ConfigError(f"epoch={epoch}: a count below 2**62")
        self._name = check_name(name)
        self.signer = SigningKey.read(signing_key) if isinstance(signing_key, str) else signing_key
        self.epoch = new_epoch() if epoch is None else epoch
        self.keep = keep
        self.registry = open_registry(registry) if isinstance(registry, str) else registry
        context = tls.listener(peers=True) if tls is not None else None
        self.server = RefitServer(self, host=host, port=port, token=token, tls=context)
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._lock = threading.Lock()
        self._heartbeat = Heartbeat(self.registry, self._entry, ttl)  # checks ttl before the server starts
        self.server.start()
        self._heartbeat.start()

    # -- Holder (preheat.refit.server) -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    def manifest(self, version: int) -> VersionManifest | None:
        with self._lock:
            held = self._versions.get(version)
        return None if held is None else held.manifest

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        with self._lock:
            held = self._versions.get(version)
        data = None if held is None else held.data.get(tensor)
        return None if data is None else tensor_view(data)

    # -- publishing ------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{'https' if self.server.tls is not None else 'http'}://{self.server.address}"

    @property
    def latest(self) -> VersionManifest | None:
        with self._lock:
            return next(reversed(self._versions.values())).manifest if self._versions else None

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None = None, *, dtype: torch.dtype | None = None
    ) -> VersionManifest:
        """Snapshot ``state_dict`` as ``version`` (default: the latest + 1) and serve it; returns its manifest.

        ``dtype``: cast floating tensors to it (fp32 master weights served as bf16). A version must be newer than
        the latest one published (``RefitError`` otherwise): replicas only ever move forward. Tensors may live on
        CUDA (copied to host memory here); sharded ones (``DTensor``) are gathered first (``full_state_dict``).
        Returns once the version is announced: holders answer for it from then on, and followers find it at
        their next look (``wait`` blocks until replicas serve it).
        """
        latest = self.latest
        if version is None:
            version = 1 if latest is None else latest.version + 1
        if latest is not None and version <= latest.version:
            raise RefitError(f"{self.url}: version {version} of {self._name} is not newer than {latest.version}")
        previous = self._versions[latest.version] if latest is not None else None
        entries: list[TensorEntry] = []
        data: dict[str, torch.Tensor] = {}
        before = previous.manifest.digests() if previous is not None else {}
        for tensor_name, given in state_dict.items():
            check_tensor_name(tensor_name, self.url)
            tensor = _whole(tensor_name, given, self.url)
            old = before.get(tensor_name)
            kept = previous.data.get(tensor_name) if previous is not None and old is not None else None
            copy, digest = _unless_unchanged(tensor, dtype, kept, old)
            entries.append(TensorEntry(tensor_name, from_torch(copy.dtype), tuple(copy.shape), copy.nbytes, digest))
            data[tensor_name] = copy
        manifest = VersionManifest(
            self._name, version, mark_changes(entries, previous.manifest.digests() if previous else None), self.epoch
        )
        if self.signer is not None:
            manifest = sign(manifest, self.signer)
        with self._lock:
            self._versions[version] = _Version(manifest, data)
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        changed = sum(t.changed for t in manifest.tensors)
        log.info(
            "refit: published %s version %d (%d of %d tensors changed, %d of %d bytes)",
            self._name, version, changed, len(manifest.tensors), manifest.changed_bytes, manifest.total_bytes,
        )  # fmt: skip
        return manifest

    def holders(self, version: int) -> list[str]:
        """The other holders of this name (replicas) that serve ``version`` of this publisher's epoch, or a newer one:
        what they announce in the registry and answer on ``/refit/v1/info`` (a replica announces a version once it
        serves it, after verifying every tensor)."""
        target = (self.epoch, version)
        headers = {"Authorization": f"Bearer {self.server.token}"} if self.server.token else {}
        own, found = self.server.address, []
        for entry in self.registry.find(head_name(self._name)):
            if entry.address == own or entry.identity != head_identity(self._name):
                continue
            claims = holder_claims(entry.address, headers)
            if claims and max(claims) >= target:
                found.append(entry.address)
        return sorted(set(found))

    def wait(self, version: int, *, replicas: int, timeout: float = 300.0, poll_s: float = 0.2) -> list[str]:
        """Block until ``replicas`` replicas serve ``version`` (or newer) of this publisher's epoch; their holder
        addresses. ``RefitError`` after ``timeout`` seconds, saying how many do. What a synchronous RL step calls
        between ``publish`` and the next rollout:

        >>> manifest = publisher.publish(model.state_dict())          # doctest: +SKIP
        >>> publisher.wait(manifest.version, replicas=8, timeout=120)  # doctest: +SKIP
        """
        if replicas < 1:
            raise ConfigError(f"replicas={replicas}: wait for at least one replica")
        deadline = time.monotonic() + timeout
        while True:
            serving = self.holders(version)
            if len(serving) >= replicas:
                return serving
            if time.monotonic() >= deadline:
                raise RefitError(
                    f"version {version} of {self._name}: {len(serving)} of {replicas} replicas serve it after "
                    f"{timeout:g} s ({', '.join(serving) or 'none'})"
                )
            time.sleep(poll_s)

    def _entry(self) -> PeerEntry:
        return PeerEntry(head_identity(self._name), self.server.address, name=head_name(self._name))

    def close(self) -> None:
        """Withdraw from the registry and stop serving."""
        self._heartbeat.stop()
        self.server.stop()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
