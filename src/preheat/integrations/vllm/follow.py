"""A vLLM replica that follows a refit name (docs/integrations.md, *vLLM: live weight updates from a Publisher*):
``preheat serve --follow``'s following (``preheat.refit.follow``: verified versions, striped pulls, liars,
failures) with vLLM's own interfaces doing the install.

For each version the follower (in the API server, or beside an offline ``LLM``) pulls the tensors whose digest it
does not hold, once per replica, each checked on arrival; stages the install set (``follow_plan.install_set``: the
changed tensors and their unfused unit-mates) in one file in shared memory; pauses the engine's scheduling with
in-flight requests finishing on the old weights (``pause_generation(mode="wait")``: new requests wait, none fails);
has every worker check and load the staged tensors (``collective_rpc`` to the worker extension,
``follow_worker.RefitWorker``: vLLM's ``reload_weights``); resets the prefix cache, so no KV computed under version
N-1 serves version N; and resumes. Tensor-parallel ranks read the same staged file, each keeping its shard.

The replica keeps the checkpoint-format bytes of the version it serves (the loaded checkpoint's files, mapped, and
the tensors pulled since) and serves them to other replicas as any holder does: replicas pull from each other.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.layout import open_checkpoint, read_manifest
from preheat.checkpoint.torch_dtypes import from_torch
from preheat.core.errors import CheckpointError, RefitError
from preheat.integrations.vllm.follow_plan import INSTALL_METHOD, LAYOUT_METHOD, WORKER_EXTENSION, install_set, layout
from preheat.peer.registry import Registry
from preheat.refit.follow import FollowOptions, VersionFollower
from preheat.refit.protocol import TensorEntry, VersionManifest
from preheat.refit.publisher import tensor_view
from preheat.refit.swap import SwapReport

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11; only the annotations use it

log = logging.getLogger("preheat.vllm")
R = TypeVar("R")
Item = tuple[str, str, tuple[int, ...], memoryview, str]  # a staged tensor: name, dtype, shape, bytes, digest
RPC_TIMEOUT_S = 600.0  # a reload of a large model's changed layers; the engine runs it between two steps


class EngineHandle(Protocol):
    """What the follower needs of a vLLM engine: the API server's ``AsyncLLM`` (``AsyncHandle``) or an offline
    ``LLM`` (``OfflineHandle``)."""

    def rpc(self, method: str, args: tuple[object, ...]) -> list[object]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def reset_prefix_cache(self) -> bool: ...


class AsyncHandle:
    """``AsyncLLM`` (the API server's engine client), driven from the follower's thread on the server's loop."""

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop) -> None:  # Any: vLLM's EngineClient
        self.client, self.loop = client, loop

    def _run(self, coro: Coroutine[Any, Any, R], timeout: float = RPC_TIMEOUT_S) -> R:  # Any: vLLM's coroutines
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def rpc(self, method: str, args: tuple[object, ...]) -> list[object]:
        return list(self._run(self.client.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)))

    def pause(self) -> None:
        # "wait": requests in flight finish on the old weights, new ones wait for resume; none is aborted.
        self._run(self.client.pause_generation(mode="wait", clear_cache=False))

    def resume(self) -> None:
        self._run(self.client.resume_generation())

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.client.reset_prefix_cache()))


class OfflineHandle:
    """An offline ``LLM``: the caller runs the follower's ``step()`` between two ``generate`` calls (nothing runs
    meanwhile, so there is nothing to pause)."""

    def __init__(self, llm: Any) -> None:  # Any: vllm.LLM
        self.llm = llm

    def rpc(self, method: str, args: tuple[object, ...]) -> list[object]:
        return list(self.llm.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args))

    def pause(self) -> None:
        return None

    def resume(self) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())


class Holdings:
    """The checkpoint-format bytes of the version a replica serves: the loaded checkpoint's files (mapped) and the
    tensors pulled since (in memory), by name; ``digests`` of the checkpoint's tensors, as published."""

    def __init__(self, checkpoint: str | None) -> None:
        self.pulled: dict[str, torch.Tensor] = {}
        self.base: dict[str, memoryview] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self._maps: list[mmap.mmap] = []
        if checkpoint is None or not os.path.isdir(checkpoint):
            return  # a hub name or a remote source: the first version brings every tensor
        try:
            opened = open_checkpoint(checkpoint)
        except CheckpointError as exc:
            log.warning("preheat: refit: the loaded checkpoint %s is not read (%s): the first version brings every "
                        "tensor", checkpoint, exc)  # fmt: skip
            return
        if opened.presharded:
            return
        for file in opened.files:
            with open(file.path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
            self._maps.append(mapped)
            view = memoryview(mapped)
            for entry in file.header.tensors:
                self.base[entry.name] = view[entry.start : entry.end]
                self.shapes[entry.name] = entry.shape
                self.dtypes[entry.name] = entry.dtype
        manifest = read_manifest(checkpoint)
        listed = {t.name: t.digest for t in manifest.tensors} if manifest is not None else {}
        # Without a preheat.json the checkpoint's tensors are digested here (xxh3: ~10 GB/s), so only what a version
        # changes is pulled.
        self.digests = {n: listed.get(n) or digest_bytes(v) for n, v in self.base.items()}

    def describe(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """The safetensors dtype and shape of the bytes held for ``name``."""
        pulled = self.pulled.get(name)
        if pulled is not None:
            return from_torch(pulled.dtype), tuple(pulled.shape)
        if name in self.base:
            return self.dtypes[name], self.shapes[name]
        return None

    def bytes_of(self, name: str) -> memoryview | None:
        pulled = self.pulled.get(name)
        if pulled is not None:
            return tensor_view(pulled)
        return self.base.get(name)


class VllmFollower(VersionFollower):
    """Follows ``name``'s versions for the vLLM engine behind ``handle``; ``checkpoint``: the directory it loaded
    (its tensors are not pulled again while unchanged). Other arguments as ``VersionFollower``'s; ``staging``: where
    the install file is written (default: /dev/shm when present)."""

    def __init__(
        self,
        name: str,
        handle: EngineHandle,
        *,
        checkpoint: str | None,
        registry: str | Registry,
        staging: str | None = None,
        **options: Unpack[FollowOptions],
    ) -> None:
        self.handle = handle
        self.holdings = Holdings(checkpoint)
        # Shared memory: the staged bytes never reach a disk. mkstemp makes each file private (0600, O_EXCL).
        shm = "/dev/shm"  # noqa: S108 - only the directory; the file is made by mkstemp
        self.staging = staging or (shm if os.path.isdir(shm) else tempfile.gettempdir())
        self.swapping = False  # between pause and resume: requests arriving now run on the new version
        self._packed: dict[str, list[str]] | None = None
        # The bytes held and the version they are of change together: a replica pulling from this one never gets
        # version N's bytes under version N-1's digest (it would take this replica for a liar).
        self._holding = threading.Lock()
        super().__init__(name, registry=registry, base_digests=self.holdings.digests, **options)

    def check_engine(self) -> None:
        """``RefitError`` unless the workers carry the extension (``--worker-extension-cls``)."""
        try:
            self._layout()
        except RefitError:
            raise
        except Exception as exc:  # vLLM's error for an unknown worker method, whatever its class in this version
            raise RefitError(
                f"the vLLM workers cannot install refit versions ({type(exc).__name__}: {str(exc)[:300]}): start "
                f"vLLM with --worker-extension-cls {WORKER_EXTENSION}"
            ) from None

    # -- Holder: the bytes of the version served, to other replicas ------------------------------------------------
    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        with self._holding:
            manifest = self.manifest(version)
            entry = manifest.entry(tensor) if manifest is not None else None
            if entry is None or self.have.get(tensor) != entry.digest:
                return None
            data = self.holdings.bytes_of(tensor)
        return data if data is not None and len(data) == entry.nbytes else None

    def _servable(self) -> bool:
        return True

    # -- installing ------------------------------------------------------------------------------------------------
    def _needed(self, lacking: list[TensorEntry]) -> list[TensorEntry]:
        shapes = self.holdings.shapes
        for entry in lacking:  # a manifest of another model costs one refusal, not its tensors in memory
            known = shapes.get(entry.name)
            if shapes and known is None:
                raise RefitError(f"version tensor {entry.name!r} is not a tensor of the loaded checkpoint")
            if known is not None and known != entry.shape:
                raise RefitError(f"version tensor {entry.name} has shape {entry.shape}, the model's is {known}")
        return lacking

    def _layout(self) -> dict[str, list[str]]:
        if self._packed is None:
            answers = self.handle.rpc(LAYOUT_METHOD, ())
            first = answers[0] if answers else {}
            self._packed = {str(k): list(v) for k, v in dict(first).items()} if isinstance(first, Mapping) else {}
        return self._packed

    def _install(self, manifest: VersionManifest, tensors: dict[str, torch.Tensor]) -> SwapReport:
        names = install_set(tensors, [t.name for t in manifest.tensors], self._layout())
        items = []
        for name in names:
            entry = manifest.entry(name)
            assert entry is not None  # install_set takes names of the manifest
            pulled = tensors.get(name)
            data = tensor_view(pulled) if pulled is not None else self.holdings.bytes_of(name)
            if data is None:
                raise RefitError(f"version {manifest.version}: tensor {name} is needed with a changed one and not held")
            items.append((name, entry.dtype, entry.shape, data, entry.digest))
        path, index = self._write(items)
        try:
            self.swapping = True
            self._engine(self.handle.pause, "pausing the engine")
            try:
                self._load(path, index, names, manifest.version)
                # Before any request runs on the new weights: no KV computed under version N-1 serves version N.
                self._engine(self.handle.reset_prefix_cache, "resetting the prefix cache")
                with self._holding:
                    self.holdings.pulled.update(tensors)
                    self._installed(manifest)
            finally:
                self._engine(self.handle.resume, "resuming the engine")
        finally:
            self.swapping = False
            os.unlink(path)
        return SwapReport(len(names), sum(len(i[3]) for i in items), "vllm_reload")

    @staticmethod
    def _engine(call: Callable[[], object], what: str) -> None:
        """One call to the engine; its failure (vLLM's errors, a timeout) as a ``RefitError``: the follower goes on."""
        try:
            call()
        except Exception as exc:  # whatever vLLM raises, in the classes of this version
            raise RefitError(f"{what} failed: {type(exc).__name__}: {str(exc)[:300]}") from None

    def _load(self, path: str, index: list[list[object]], names: Sequence[str], version: int) -> None:
        try:
            self.handle.rpc(INSTALL_METHOD, (path, index))
        except Exception as exc:  # a worker's error arrives as vLLM raises it: the old bytes go back in
            self._roll_back(names, version)
            raise RefitError(f"version {version}: the vLLM workers refused the install: {str(exc)[:400]}") from None

    def _roll_back(self, names: Sequence[str], version: int) -> None:
        """Load the served version's bytes of ``names`` again: vLLM's reload is not all-or-nothing."""
        items = []
        for name in names:
            data, kind = self.holdings.bytes_of(name), self.holdings.describe(name)
            if data is None or kind is None:
                log.error("preheat: refit: version %d failed half-installed; %s cannot be restored", version, name)
                return
            items.append((name, kind[0], kind[1], data, digest_bytes(data)))
        try:
            path, index = self._write(items)
            try:
                self.handle.rpc(INSTALL_METHOD, (path, index))
            finally:
                os.unlink(path)
        except Exception as exc:  # reported: the replica's weights may be mixed
            log.error("preheat: refit: restoring the weights version %d replaced failed: %s", version, exc)

    def _write(self, items: Sequence[Item]) -> tuple[str, list[list[object]]]:
        """One staging file of ``items`` (name, dtype, shape, bytes, digest); its path and wire index."""
        staged = layout([(name, dtype, shape, len(data), digest) for name, dtype, shape, data, digest in items])
        fd, path = tempfile.mkstemp(prefix="preheat-refit-", suffix=".bin", dir=self.staging)
        with os.fdopen(fd, "wb") as out:
            for entry, item in zip(staged, items, strict=True):
                out.seek(entry.offset)
                out.write(item[3])
        return path, [entry.to_wire() for entry in staged]


def wait_served(follower: VersionFollower, version: int, timeout: float) -> bool:
    """Whether ``follower`` serves ``version`` within ``timeout`` seconds (an offline loop's ``step()`` loop)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        follower.step()
        if follower.version is not None and follower.version >= version:
            return True
        time.sleep(follower.poll_s)
    return False
