"""The replica's side: follow the versions of ``NAME``, pull what changed, verify, swap between two requests.

A ``Follower`` watches the registry for holders of ``NAME`` (``refit:NAME``: the trainer and replicas), asks each
which versions it serves, and when a newer one than its own appears: fetches the manifest, works out the tensors
whose digests it does not hold (``protocol.to_fetch``: unchanged tensors are never moved), pulls them striped
across every holder of that version (``preheat.refit.pull``), checks each against its digest, and hands the swap to
``run_between`` (the server's generation worker runs it between two requests; ``preheat.refit.swap``). Then it
bumps the engine's identity to the version's, so KV chunks computed under the old weights are never looked up
under the new ones, and serves the version itself to the replicas still pulling it.

Failures leave the replica on the version it serves: a version that cannot be pulled or verified is reported
(``status()["error"]``) and not retried until a newer one appears or ``request(N)`` asks again; a version superseded
mid-pull is abandoned for the newer one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from preheat.checkpoint.torch_dtypes import to_torch
from preheat.core.errors import PreheatError, RefitError, SupersededError
from preheat.core.jsonsafe import load_object
from preheat.http.client import Timeouts, request
from preheat.peer.registry import DEFAULT_TTL, Heartbeat, PeerEntry, Registry, open_registry
from preheat.refit.protocol import VersionManifest, check_name, head_identity, head_name, to_fetch
from preheat.refit.publisher import tensor_view
from preheat.refit.pull import Discovery, Pull, fetch_manifest
from preheat.refit.server import INFO_ROUTE, RefitServer
from preheat.refit.swap import ModelSlots, SwapReport, check_shapes, swap

if TYPE_CHECKING:
    from preheat.engine import Engine

log = logging.getLogger("preheat.refit")
T = TypeVar("T")
Runner = Callable[[Callable[[], T]], T]
INFO_TIMEOUTS = Timeouts(connect=1.0, read=5.0)
INFO_BYTES = 65536  # a holder's info lists the versions it serves: a few dozen bytes


def run_now(fn: Callable[[], T]) -> T:
    """A ``run_between`` for an engine no other thread uses (tests, benchmarks): run the swap at once."""
    return fn()


@dataclass
class RefitStats:
    """The last applied version's pull: bytes moved (and of how many in the model), per holder, seconds."""

    version: int
    tensors: int
    nbytes: int
    model_bytes: int
    sources: dict[str, int]
    pull_s: float
    swap_s: float
    mode: str

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class Follower:
    """Follows ``name``'s versions for ``engine`` (the built-in model only). ``start()`` runs it on a thread.

    ``base_digests``: name -> digest of the tensors the engine holds now, as published (from the checkpoint's
    ``preheat.json``); tensors not listed are pulled at the first version. ``serve``: offer the versions this replica
    holds to other replicas on a refit server at ``host:port`` (only when the engine computes in the dtype the
    tensors are published in: its live tensors are then those bytes).
    """

    def __init__(
        self,
        name: str,
        engine: Engine,
        *,
        registry: str | Registry,
        base_digests: Mapping[str, str] | None = None,
        run_between: Runner[SwapReport] = run_now,
        token: str | None = None,
        serve: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        poll_s: float = 0.5,
        deadline_s: float = 120.0,
        inplace: bool = False,
        ttl: float = DEFAULT_TTL,
        on_version: Callable[[int], None] | None = None,
    ) -> None:
        if engine.model is None:
            raise RefitError("--follow needs the built-in engine: this model runs on the transformers fallback")
        self.model = engine.model
        self._name = check_name(name)
        self.engine, self.run_between, self.on_version = engine, run_between, on_version
        self.registry = open_registry(registry) if isinstance(registry, str) else registry
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.poll_s, self.deadline_s, self.inplace = poll_s, deadline_s, inplace
        self.version: int | None = None
        self.current: VersionManifest | None = None  # the manifest of the version served
        self.have: dict[str, str] = dict(base_digests or {})
        self.owned: set[str] = set()
        self.newest_seen: int | None = None
        self.failed: int | None = None  # a version that could not be applied: not retried until asked or superseded
        self.error: str | None = None
        self.pulling: int | None = None
        self.abandoned = 0
        self.last: RefitStats | None = None
        self._wanted: int | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._applied = threading.Condition()
        self._thread: threading.Thread | None = None
        # The heartbeat first: a bad ttl is refused before a server thread and socket exist to leak.
        self._heartbeat = Heartbeat(self.registry, self._entry, ttl) if serve else None
        self.server = RefitServer(self, host=host, port=port, token=token).start() if serve else None

    # -- Holder: what this replica serves to others ----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    def versions(self) -> list[int]:
        return [self.version] if self.version is not None and self._servable() else []

    def manifest(self, version: int) -> VersionManifest | None:
        current = self.current
        return current if current is not None and current.version == version else None

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        manifest = self.manifest(version)
        entry = manifest.entry(tensor) if manifest is not None else None
        if entry is None or self.have.get(tensor) != entry.digest or not self._servable():
            return None
        live = ModelSlots(self.model).get(tensor)
        if live is None or live.dtype != to_torch(entry.dtype):
            return None
        return tensor_view(live.detach().to("cpu").contiguous())

    def _servable(self) -> bool:
        manifest = self.current
        if manifest is None:
            return False
        return all(to_torch(t.dtype) == self.engine.dtype for t in manifest.tensors if t.dtype.startswith(("F", "B")))

    def _entry(self) -> PeerEntry:
        assert self.server is not None
        return PeerEntry(head_identity(self._name), self.server.address, name=head_name(self._name))

    # -- following -------------------------------------------------------------------------------------------------
    def start(self) -> Follower:
        if self._heartbeat is not None:
            self._heartbeat.start()
        self._thread = threading.Thread(target=self._run, name="preheat-refit-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.server is not None:
            self.server.stop()

    def request(self, version: int | None = None) -> None:
        """Look for ``version`` (None: the newest) now, and try it even if it failed before."""
        self._wanted = version
        self.failed = None if version is None or version == self.failed else self.failed
        self._wake.set()

    def wait_for(self, version: int, timeout: float) -> bool:
        """Whether this replica serves ``version`` (or newer) within ``timeout`` seconds; False at once when that
        version failed."""
        with self._applied:
            self._applied.wait_for(lambda: (self.version or 0) >= version or self.failed == version, timeout)
            return (self.version or 0) >= version

    def status(self) -> dict[str, object]:
        """What ``/health`` reports: the version served, the newest seen, a pull under way, the last error."""
        return {
            "name": self._name,
            "version": self.version,
            "newest": self.newest_seen,
            "behind": self.behind,
            "pulling": self.pulling,
            "failed": self.failed,
            "error": self.error,
            "abandoned": self.abandoned,
            "last": self.last.to_dict() if self.last is not None else None,
        }

    @property
    def behind(self) -> int:
        """Versions published that this replica does not serve yet."""
        return max(0, (self.newest_seen or 0) - (self.version or 0))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except PreheatError as exc:  # registry down, a holder gone: logged, retried on the next look
                log.warning("refit: %s", exc)
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def discover(self) -> Discovery:
        """Every holder of ``name`` the registry knows (this replica aside) and the versions each serves."""
        own = self.server.address if self.server is not None else None
        holders: dict[str, list[int]] = {}
        for entry in self.registry.find(head_name(self._name)):
            if entry.address == own or entry.identity != head_identity(self._name):
                continue
            try:
                answer = request(
                    f"http://{entry.address}{INFO_ROUTE}",
                    timeouts=INFO_TIMEOUTS,
                    headers=self.headers,
                    max_body=INFO_BYTES,
                )
                # Bounded: a holder is any address in the registry, and 64 KiB of "[" would otherwise raise a
                # RecursionError here, which ended this thread. A JSONInputError is a PreheatError: holder skipped.
                info = load_object(answer.body, max_bytes=INFO_BYTES, max_depth=8) if answer.status == 200 else {}
            except PreheatError as exc:
                log.debug("refit: holder %s skipped (no answer, or not a list of versions): %s", entry.address, exc)
                continue
            versions = info.get("versions")
            if isinstance(versions, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
                holders[entry.address] = versions
        found = Discovery(holders)
        if found.newest is not None and (self.newest_seen is None or found.newest > self.newest_seen):
            self.newest_seen = found.newest
        return found

    def step(self) -> bool:
        """Look once; pull and apply the newest version when it is newer than ours. True when one was applied."""
        found = self.discover()
        wanted, served = self._wanted, self.version or 0
        # A version asked for that is served already, or that no holder serves while a newer one is out, is dropped:
        # kept, it would pin every later look to it and the replica would stop following.
        if wanted is not None and (wanted <= served or (not found.holding(wanted) and (found.newest or 0) > wanted)):
            self._wanted = wanted = None
        target = wanted if wanted is not None else found.newest
        if target is not None and not found.holding(target):
            return False  # asked for a version not published yet: looked for again at the next poll, not failed
        while target is not None and target > (self.version or 0) and target != self.failed:
            self._wanted = None
            try:
                self.apply(target, found)
                return True
            except SupersededError as exc:
                self.abandoned += 1
                log.info("refit: %s; pulling the newer one", exc)
                found = self.discover()
                target = found.newest
            except RefitError as exc:
                with self._applied:
                    if target > (self.version or 0):  # not one a newer version superseded meanwhile
                        self.failed, self.error = target, str(exc)
                    self._applied.notify_all()
                log.warning("refit: staying on version %s: %s", self.version, exc)
                return False
        return False

    def apply(self, version: int, found: Discovery) -> None:
        """Pull ``version`` from its holders, verify, swap it in; ``RefitError`` leaves the engine as it was."""
        self.pulling = version
        try:
            manifest = fetch_manifest(found.holding(version), version, self.headers)
            if manifest.name != self._name:
                raise RefitError(f"version {version} is of {manifest.name!r}, not {self._name!r}")
            slots = ModelSlots(self.model)
            # Names and shapes come from a holder: checked against the model before a byte is pulled (a manifest of
            # another model costs one refusal, not its tensors in memory). A tied model's lm_head is not pulled: the
            # model computes with the embedding, and replicas could not serve it to each other.
            lacking = to_fetch(self.have, manifest)
            check_shapes(slots, {e.name: e.shape for e in lacking})
            needed = [e for e in lacking if slots.get(e.name) is not None]
            pull = Pull(
                manifest,
                needed,
                self.discover,
                headers=self.headers,
                poll_s=self.poll_s,
                deadline_s=self.deadline_s,
                cancel=self._stop,
            )
            result = pull.run(found.holding(version))
            tensors = {
                e.name: torch.frombuffer(result.data[e.name], dtype=to_torch(e.dtype)).reshape(e.shape)
                if e.nbytes
                else torch.empty(e.shape, dtype=to_torch(e.dtype))
                for e in needed
            }
            tensors = self._converted(tensors)
            began = time.monotonic()
            try:
                report = self.run_between(lambda: self._swap_in(manifest, tensors))
            except (RuntimeError, MemoryError) as exc:  # torch's (OutOfMemoryError too): the swap rolled back
                raise RefitError(f"version {version}: the swap failed and was rolled back: {exc}") from exc
            swap_s = time.monotonic() - began
        finally:
            self.pulling = None
        self.last = RefitStats(
            version, len(needed), result.nbytes, manifest.total_bytes, result.sources, result.seconds, swap_s,
            report.mode,
        )  # fmt: skip
        log.info(
            "refit: serving version %d of %s (%d tensors, %d of %d bytes pulled in %.2f s, swapped in %.3f s)",
            version, self._name, len(needed), result.nbytes, manifest.total_bytes, result.seconds, swap_s,
        )  # fmt: skip

    def _converted(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors in the engine's dtype and device, made here rather than on the generation thread (the swap
        then only rebinds); as pulled when they do not fit (the swap then goes in place)."""
        if self.inplace:
            return tensors
        model = self.model
        try:
            return {
                n: t if t.dtype == model.dtype and t.device == model.device else t.to(model.device, model.dtype)
                for n, t in tensors.items()
            }
        except torch.OutOfMemoryError:
            return tensors

    def _swap_in(self, manifest: VersionManifest, tensors: dict[str, torch.Tensor]) -> SwapReport:
        """On the generation thread, between two requests: swap, then switch identity and version together."""
        engine = self.engine
        report = swap(self.model, tensors, inplace=self.inplace, owned=self.owned)
        # The model no longer computes with the checkpoint's own bytes: nothing may offer them as such (NIXL), and
        # the old tensors a double buffer replaced must not be kept alive here.
        engine.loaded_weights = None
        engine.identity = manifest.identity
        tiers = engine.kv_tiers
        spec = engine.kv_spec()
        if tiers is not None and spec is not None:
            from preheat.kv.build import spec_fingerprint
            from preheat.kv.settings import KVSettings

            kv = KVSettings(kv_dtype=tiers.kv_dtype, chunk_tokens=tiers.chunk_tokens)
            tiers.fingerprint = spec_fingerprint(spec, kv, manifest.identity)  # keys of the old weights never match
        self.have.update(manifest.digests())
        with self._applied:
            self.current, self.version = manifest, manifest.version
            self.error = None
            if self.failed is not None and self.failed <= manifest.version:  # superseded: no longer reported
                self.failed = None
            self._applied.notify_all()
        if self.on_version is not None:
            self.on_version(manifest.version)
        return report
