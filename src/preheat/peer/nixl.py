"""The GPU transport: a peer's tensors read device-to-device over NIXL, chosen per peer, TCP otherwise.

Chosen only when all three hold (``choose_transport``): ``nixl`` imports here, this replica loads onto CUDA, and the
peer answers ``GET /peer/v1/nixl`` with an advert (it holds weights on GPU and has nixl itself). Anything else, and
any NIXL error later, means HTTP over TCP: a failed NIXL read is retried over the same peer's HTTP connection with a
warning, so NIXL can make a pull faster but never make it fail.

The advert is JSON: the peer's agent name, its agent metadata (``nixl_agent.get_agent_metadata()``, base64) and, per
manifest tensor it registered, ``(file, offset, nbytes, addr, device_id)``: where the tensor's bytes are in its file
and in the peer's GPU memory. Plain JSON rather than nixl's pickled ``get_serialized_descs``: a puller never unpickles
what a network peer sent.

The puller keeps the pull's contract: pieces still land in node-cache files and every tensor is checked against its
manifest digest on host. So a NIXL read goes peer GPU -> local GPU staging buffer (registered once, grown as needed)
-> host, and bytes no advertised tensor covers (safetensors headers, extra files) come over HTTP. Correctness first:
the device-to-host hop costs PCIe bandwidth, and reads through one reader are serialized (one staging buffer).

Written against ``nixl._api`` (ai-dynamo/nixl, ``src/api/python/_api.py``); run only where nixl and a GPU exist.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import importlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from preheat.checkpoint import manifest as mf
from preheat.core.errors import HTTPClientError, NixlError, PeerError
from preheat.core.jsonsafe import load_object
from preheat.http.client import Timeouts
from preheat.http.pool import Connection
from preheat.http.tls import fleet_client
from preheat.sources.base import Origin, Source

if TYPE_CHECKING:
    import torch

log = logging.getLogger("preheat.peer")
NIXL_ROUTE = "/peer/v1/nixl"
# An advert is ~100 bytes per tensor plus the agent's metadata: far under this for any checkpoint; a longer answer is
# refused unread.
MAX_ADVERT_BYTES = 64 * 1024 * 1024
_TIMEOUT_S = 30.0  # one READ of one piece (16 MiB by default); far above any healthy device-to-device transfer
_names = itertools.count()


class NixlAgent(Protocol):
    """nixl's ``nixl_agent`` (nixl ships no type stubs), as much of it as this module calls. Registration lists,
    descriptor lists and transfer handles are opaque here: they only go back to the agent."""

    def register_memory(self, memory: torch.Tensor | list[torch.Tensor]) -> object: ...

    def deregister_memory(self, registered: object) -> None: ...

    def get_agent_metadata(self) -> bytes: ...

    def add_remote_agent(self, metadata: bytes) -> str: ...

    def remove_remote_agent(self, name: str) -> None: ...

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> object: ...  # (addr, n, device)

    def initialize_xfer(self, operation: str, local: object, remote: object, remote_agent: str) -> object: ...

    def transfer(self, handle: object) -> str: ...  # "PROC", "DONE" or "ERR"

    def check_xfer_state(self, handle: object) -> str: ...

    def release_xfer_handle(self, handle: object) -> None: ...


def nixl_api() -> ModuleType | None:
    """``nixl._api``, or None where nixl is not installed or its native libraries (UCX, CUDA) do not load."""
    try:
        api = importlib.import_module("nixl._api")
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but a shared library is not
        log.debug("nixl unavailable: %s", exc)
        return None
    return api


def _new_agent(api: ModuleType, name: str) -> NixlAgent:
    """A NIXL agent with the UCX backend. nixl_agent prints its progress to stdout; it goes to stderr here, because
    stdout is a protocol for our CLIs (the seed peer's address line, ``--json``)."""
    with contextlib.redirect_stdout(sys.stderr):
        agent: NixlAgent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    return agent


def choose_transport(*, nixl_importable: bool, device: str, advertised: bool) -> str:
    """``"nixl"`` when this side can use NIXL (importable, loading onto CUDA) and the peer offers it, else ``"tcp"``.

    >>> choose_transport(nixl_importable=True, device="cuda:0", advertised=True)
    'nixl'
    """
    on_cuda = device.split(":", 1)[0] == "cuda"
    return "nixl" if nixl_importable and on_cuda and advertised else "tcp"


@dataclass(frozen=True)
class RemoteTensor:
    """One registered tensor of a peer: its bytes are ``file[offset:offset+nbytes]`` and GPU ``addr`` on ``device``."""

    file: str
    offset: int
    nbytes: int
    addr: int
    device: int


@dataclass(frozen=True)
class Advert:
    """What ``GET /peer/v1/nixl`` answers: enough for a puller to add the peer's agent and READ its tensors."""

    agent: str
    metadata: bytes
    tensors: tuple[RemoteTensor, ...]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "agent": self.agent,
                "metadata": base64.b64encode(self.metadata).decode(),
                "tensors": [[t.file, t.offset, t.nbytes, t.addr, t.device] for t in self.tensors],
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Advert:
        try:
            # Bounded: 64 KiB of "[" from a peer raised RecursionError here, which failed the pull instead of
            # falling back to TCP. JSONInputError is a ValueError.
            doc = load_object(data, max_bytes=MAX_ADVERT_BYTES, max_depth=8)
            tensors = tuple(RemoteTensor(str(f), int(o), int(n), int(a), int(d)) for f, o, n, a, d in doc["tensors"])
            return cls(str(doc["agent"]), base64.b64decode(doc["metadata"], validate=True), tensors)
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise NixlError(f"{where}: malformed NIXL advert: {exc}") from None


def cut_spans(tensors: Sequence[RemoteTensor], offset: int, length: int) -> list[tuple[int, int, RemoteTensor | None]]:
    """``[offset, offset+length)`` of one file cut into ``(start, length, tensor or None)`` runs, in file order:
    a run inside an advertised tensor can go over NIXL, a run outside (None) must go over HTTP.

    >>> t = RemoteTensor("a.safetensors", 100, 50, 0x7F0000, 0)
    >>> [(start, n, tensor is not None) for start, n, tensor in cut_spans([t], 90, 100)]
    [(90, 10, False), (100, 50, True), (150, 40, False)]
    """
    out: list[tuple[int, int, RemoteTensor | None]] = []
    at, end = offset, offset + length
    for tensor in sorted(tensors, key=lambda t: t.offset):
        lo, hi = max(at, tensor.offset), min(end, tensor.offset + tensor.nbytes)
        if lo >= hi:
            continue
        if lo > at:
            out.append((at, lo - at, None))
        out.append((lo, hi - lo, tensor))
        at = hi
    if at < end:
        out.append((at, end - at, None))
    return out


class NixlExport:
    """The serving side: a replica's GPU tensors registered with a NIXL agent, described by ``advert()``.

    Only tensors named in ``manifest`` that are CUDA, contiguous and exactly the record's shape and byte count are
    registered: those are the ones whose memory can hold the file's bytes (a converted or fused tensor would not, and
    the puller's digest check would only catch it after the transfer). Raises ``NixlError`` when nixl is missing or
    no tensor qualifies.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], manifest: mf.Manifest, *, name: str | None = None) -> None:
        api = nixl_api()
        if api is None:
            raise NixlError("nixl is not installed")
        records = {r.name: r for r in manifest.tensors}
        chosen: list[tuple[mf.TensorRecord, torch.Tensor]] = []
        for tensor_name, tensor in weights.items():
            record = records.get(tensor_name)
            if (
                record is not None
                and tensor.is_cuda
                and tensor.is_contiguous()
                and tuple(tensor.shape) == tuple(record.shape)
                and _dtype_name(tensor) == record.dtype
                and tensor.numel() * tensor.element_size() == record.nbytes
                and record.nbytes > 0
            ):
                chosen.append((record, tensor))
        if chosen:  # one registration list holds one device's memory (nixl refuses a mixed tensor list)
            first = chosen[0][1].device
            chosen = [(r, t) for r, t in chosen if t.device == first]
        if not chosen:
            raise NixlError("no CUDA tensor matches the manifest byte for byte; nothing to offer over NIXL")
        self.name = name or f"preheat-peer-{os.getpid()}-{next(_names)}"
        try:
            self._agent = _new_agent(api, self.name)
            self._registered = self._agent.register_memory([t for _, t in chosen])
            metadata = bytes(self._agent.get_agent_metadata())
        except Exception as exc:  # nixl raises its own binding exceptions (nixlBackendError, ...), no common base
            raise NixlError(f"NIXL setup failed: {type(exc).__name__}: {exc}") from None
        self._tensors = [t for _, t in chosen]  # kept alive: the peer's reads target this memory
        described = (RemoteTensor(r.file, r.offset, r.nbytes, t.data_ptr(), t.get_device()) for r, t in chosen)
        self._advert = Advert(self.name, metadata, tuple(described)).to_json()

    def advert(self) -> bytes:
        return self._advert

    def close(self) -> None:
        """Deregister the memory (the tensors themselves stay the engine's)."""
        try:
            self._agent.deregister_memory(self._registered)
        except Exception as exc:  # shutting down: a failed deregistration is worth a line, not an error
            log.warning("nixl: deregistering %s failed: %s", self.name, exc)


def export_weights(weights: Mapping[str, torch.Tensor], manifest: mf.Manifest) -> NixlExport | None:
    """A ``NixlExport`` of ``weights``, or None (with a log line) when nixl is absent or the weights are not on GPU;
    the peer server then serves files over TCP only."""
    if nixl_api() is None or not any(t.is_cuda for t in weights.values()):
        return None
    try:
        return NixlExport(weights, manifest)
    except NixlError as exc:
        log.warning("peer: not offering NIXL: %s", exc)
        return None


def fetch_advert(address: str, token: str | None, timeout: float = 2.0) -> Advert | None:
    """The peer's advert, or None when it offers none (404, an error, a refused token: the pull's TCP path will
    report a token problem on its own requests)."""
    host, _, port = address.rpartition(":")
    connection = Connection(host.strip("[]"), int(port), Timeouts.within(timeout), tls=fleet_client())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = connection.request("GET", NIXL_ROUTE, headers=headers, max_body=MAX_ADVERT_BYTES)
    except HTTPClientError as exc:
        log.debug("nixl: no advert from %s: %s", address, exc)
        return None
    finally:
        connection.close()
    if response.status != 200:
        return None
    try:
        return Advert.from_json(response.body, where=f"peer {address}")
    except NixlError as exc:
        log.warning("nixl: %s; using TCP", exc)
        return None


class NixlReader:
    """Reads byte ranges of one peer's advertised tensors into host memory, through a registered GPU staging buffer.

    ``nixl_bytes``/``tcp_bytes`` count what this peer's source delivered each way (TCP: gaps and fallbacks).
    """

    def __init__(self, advert: Advert, device: str, *, where: str) -> None:
        import torch

        api = nixl_api()
        if api is None:
            raise NixlError("nixl is not installed")
        self.where = where
        self.device = torch.device(device)
        self.by_file: dict[str, list[RemoteTensor]] = {}
        for tensor in advert.tensors:
            self.by_file.setdefault(tensor.file, []).append(tensor)
        self.lock = threading.Lock()  # one staging buffer: reads through this reader take turns
        self._counts = threading.Lock()  # the counters are bumped by every stream of the peer
        self.nixl_bytes = 0
        self.tcp_bytes = 0
        self.broken: str | None = None  # set on the first NIXL failure: the rest of the pull goes over TCP
        self._staging: torch.Tensor | None = None
        self._staging_reg: object | None = None  # the staging buffer's nixl registration
        try:
            self._agent = _new_agent(api, f"preheat-pull-{os.getpid()}-{next(_names)}")
            self.remote: str = self._agent.add_remote_agent(advert.metadata)
        except Exception as exc:  # nixl's binding exceptions have no common base
            raise NixlError(f"{where}: NIXL setup failed: {type(exc).__name__}: {exc}") from None

    def count(self, *, nixl: int = 0, tcp: int = 0) -> None:
        with self._counts:
            self.nixl_bytes += nixl
            self.tcp_bytes += tcp

    def spans(self, file: str, offset: int, length: int) -> list[tuple[int, int, RemoteTensor | None]]:
        return cut_spans(self.by_file.get(file, []), offset, length)

    def read(self, tensor: RemoteTensor, start: int, target: memoryview) -> None:
        """Fill ``target`` with ``tensor``'s file bytes from ``start``: a NIXL READ into staging, then to host."""
        import torch

        n = len(target)
        with self.lock:
            staging = self._stage(n)
            try:
                local = self._agent.get_xfer_descs([(staging.data_ptr(), n, staging.get_device())], "VRAM")
                remote = self._agent.get_xfer_descs([(tensor.addr + (start - tensor.offset), n, tensor.device)], "VRAM")
                handle = self._agent.initialize_xfer("READ", local, remote, self.remote)
            except Exception as exc:  # nixl's binding exceptions have no common base
                raise NixlError(f"{self.where}: NIXL READ setup failed: {type(exc).__name__}: {exc}") from None
            try:
                state = self._agent.transfer(handle)
                deadline = time.monotonic() + _TIMEOUT_S
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise NixlError(f"{self.where}: NIXL READ of {n} bytes did not finish in {_TIMEOUT_S:.0f} s")
                    time.sleep(0.0002)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlError(f"{self.where}: NIXL READ of {n} bytes ended in state {state}")
            except NixlError:
                raise
            except Exception as exc:  # nixl's binding exceptions have no common base
                raise NixlError(f"{self.where}: NIXL READ failed: {type(exc).__name__}: {exc}") from None
            finally:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception as exc:  # a leaked handle costs memory, not correctness
                    log.debug("nixl: releasing a transfer handle failed: %s", exc)
            host = torch.frombuffer(target, dtype=torch.uint8)
            host.copy_(staging[:n])  # synchronous device-to-host copy: the bytes are in target when it returns

    def _stage(self, n: int) -> torch.Tensor:
        """A registered CUDA buffer of at least ``n`` bytes (re-registered when it must grow)."""
        import torch

        if self._staging is not None and self._staging.numel() >= n:
            return self._staging
        try:
            if self._staging_reg is not None:
                self._agent.deregister_memory(self._staging_reg)
                self._staging_reg = None
            self._staging = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._staging_reg = self._agent.register_memory(self._staging)
        except Exception as exc:  # nixl's binding exceptions (and CUDA OOM) have no common base
            self._staging = None
            raise NixlError(f"{self.where}: registering a {n}-byte staging buffer failed: {exc}") from None
        return self._staging

    def close(self) -> None:
        try:
            if self._staging_reg is not None:
                self._agent.deregister_memory(self._staging_reg)
            self._agent.remove_remote_agent(self.remote)
        except Exception as exc:  # shutting down: worth a line, not an error
            log.debug("nixl: closing the reader for %s failed: %s", self.where, exc)
        self._staging_reg = self._staging = None


class NixlOrigin:
    """A peer's files (an ``Origin``) whose advertised tensor bytes come over NIXL and the rest over ``http``."""

    def __init__(self, http: Origin, reader: NixlReader) -> None:
        self.http, self.reader = http, reader

    @property
    def uri(self) -> str:
        return self.http.uri

    def join(self, name: str) -> str:
        return self.http.join(name)

    def exists(self, name: str) -> bool:
        return self.http.exists(name)

    def read_bytes(self, name: str) -> bytes:
        return self.http.read_bytes(name)

    def open(self, name: str) -> Source:
        return _NixlSource(name, self.http.open(name), self.reader)

    def note(self) -> str:
        """One line for the pull's notes: how many bytes came which way."""
        why = f"; NIXL failed, rest over TCP: {self.reader.broken}" if self.reader.broken else ""
        return f"{self.reader.where}: {self.reader.nixl_bytes} bytes over NIXL, {self.reader.tcp_bytes} over TCP{why}"

    def close(self) -> None:
        self.reader.close()
        close = getattr(self.http, "close", None)
        if close is not None:
            close()


class _NixlSource:
    """One file of a NIXL peer: ``readv`` splits the range into advertised tensors (NIXL) and gaps (HTTP)."""

    def __init__(self, file: str, http: Source, reader: NixlReader) -> None:
        self.file, self.http, self.reader = file, http, reader

    @property
    def name(self) -> str:
        return self.http.name

    def size(self) -> int:
        return self.http.size()

    def readv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        total = sum(len(b) for b in buffers)
        size = self.size()
        total = max(0, min(total, size - offset))
        if total == 0:
            return 0
        flat = memoryview(bytearray(total))  # one contiguous range to cut at tensor boundaries; copied out below
        for start, length, tensor in self.reader.spans(self.file, offset, total):
            part = flat[start - offset : start - offset + length]
            if tensor is not None and self.reader.broken is None:
                try:
                    self.reader.read(tensor, start, part)
                    self.reader.count(nixl=length)
                    continue
                except NixlError as exc:
                    if self.reader.broken is None:
                        log.warning("pull: %s; falling back to TCP for this peer", exc)
                        self.reader.broken = str(exc)
            self._http_read(start, part)
            self.reader.count(tcp=length)
        done = 0
        for buffer in buffers:
            n = min(len(buffer), total - done)
            buffer[:n] = flat[done : done + n]
            done += n
        return total

    def _http_read(self, start: int, target: memoryview) -> None:
        done = 0
        while done < len(target):
            got = self.http.readv(start + done, [target[done:]])
            if got == 0:
                raise PeerError(f"{self.name}: ended at byte {start + done}, {len(target) - done} bytes short")
            done += got

    def close(self) -> None:
        self.http.close()


def peer_source_origin(address: str, http: Origin, *, device: str, token: str | None) -> Origin:
    """The origin to pull ``address``'s pieces through: a ``NixlOrigin`` when ``choose_transport`` says NIXL (and
    the reader sets up), else ``http`` unchanged."""
    api = nixl_api()
    if choose_transport(nixl_importable=api is not None, device=device, advertised=True) != "nixl":
        return http  # no request made: a CPU puller never asks peers for adverts
    advert = fetch_advert(address, token)
    if advert is None:
        return http
    try:
        return NixlOrigin(http, NixlReader(advert, device, where=f"peer {address}"))
    except NixlError as exc:
        log.warning("pull: %s; using TCP", exc)
        return http


def _dtype_name(tensor: torch.Tensor) -> str | None:
    """The safetensors name of the tensor's dtype (None for one safetensors cannot store): a bf16 tensor never stands
    in for an fp16 record of the same size."""
    from preheat.checkpoint import torch_dtypes

    try:
        return torch_dtypes.from_torch(tensor.dtype)
    except KeyError:
        return None
