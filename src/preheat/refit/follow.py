"""Following a name's versions, whatever the engine: look for verified versions, pull what changed, check each
tensor, and hand the install to the engine's follower (``Follower`` for the built-in engine, ``VllmFollower`` in
``preheat.integrations.vllm.follow`` for vLLM).

A ``VersionFollower`` watches the registry for holders of ``NAME`` (``refit:NAME``: the trainer and replicas) and asks
each which versions it serves. Those are claims: a version counts only once its manifest, fetched from a holder that
claims it, verifies (``preheat.refit.lookout``): the name, epoch and version asked for, and, with trusted keys, a
signature by one of them (``preheat.refit.trust``). Only verified versions move ``newest``, ``behind`` and the
staleness limit, and a verified version more than ``max_jump`` past the one served is refused. A holder whose
manifest or bytes do not verify, or that announces a version it then does not serve, is reported (``liars()``, a
log line) and not asked again for ``shun_s`` seconds. Without trusted keys only holders on this machine are asked.

When a verified version newer than its own appears, the follower works out the tensors whose digests it does not
hold (``protocol.to_fetch``: unchanged tensors are never moved; ``_needed`` lets the engine refuse or skip some),
pulls them striped across every holder of that version (``preheat.refit.pull``), checks each against its digest, and
hands ``_install`` to ``run_between`` (between two requests or engine steps). ``_install`` ends with ``_installed``,
which makes the version the one served, offered to the replicas still pulling it.

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
from typing import TypedDict, TypeVar

import torch

from preheat.artifacts.signing import TrustedKeys
from preheat.checkpoint.torch_dtypes import to_torch
from preheat.core.errors import ConfigError, PreheatError, RefitError, SupersededError
from preheat.http.tls import TLSFiles
from preheat.peer.registry import DEFAULT_TTL, Heartbeat, PeerEntry, Registry, open_registry
from preheat.refit.lookout import Lookout
from preheat.refit.protocol import (
    TensorEntry,
    VersionKey,
    VersionManifest,
    check_name,
    head_identity,
    head_name,
    to_fetch,
)
from preheat.refit.pull import Discovery, Pull
from preheat.refit.server import RefitServer
from preheat.refit.swap import SwapReport
from preheat.refit.trust import DEFAULT_MAX_JUMP, behind

log = logging.getLogger("preheat.refit")
T = TypeVar("T")
Runner = Callable[[Callable[[], T]], T]
F = TypeVar("F", bound="VersionFollower")


def run_now(fn: Callable[[], T]) -> T:
    """A ``run_between`` for an engine no other thread uses (tests, benchmarks): run the install at once."""
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


class FollowOptions(TypedDict, total=False):
    """``VersionFollower``'s keyword arguments that an engine's follower passes through as they are (documented on
    ``VersionFollower``): one list, so the engines' followers do not repeat it."""

    token: str | None
    serve: bool
    host: str
    port: int
    poll_s: float
    deadline_s: float
    ttl: float
    tls: TLSFiles | None
    trusted: TrustedKeys | None
    max_jump: int
    shun_s: float


class VersionFollower:
    """Follows ``name``'s versions; an engine's follower says what to pull (``_needed``), how to install it
    (``_install``, ending with ``_installed``) and which bytes it can serve to others (``tensor_bytes``).
    ``start()`` runs it on a thread.

    ``base_digests``: name -> digest of the tensors the engine holds now, as published; tensors not listed are
    pulled at the first version. ``serve``: offer the version this replica holds to other replicas on a refit server
    at ``host:port``, over https with ``tls`` (mutual when it has a CA). ``trusted``: the keys whose signatures make
    a version applicable (none: unsigned versions, from holders on this machine only); ``max_jump``: the most a
    version may be past the one served; ``shun_s``: how long a holder that lied is not asked.
    """

    def __init__(
        self,
        name: str,
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
        ttl: float = DEFAULT_TTL,
        tls: TLSFiles | None = None,
        on_version: Callable[[int], None] | None = None,
        trusted: TrustedKeys | None = None,
        max_jump: int = DEFAULT_MAX_JUMP,
        shun_s: float = 60.0,
    ) -> None:
        if max_jump < 1:
            raise ConfigError(f"--refit-max-jump {max_jump}: must be 1 or more")
        self._name = check_name(name)
        self.run_between, self.on_version = run_between, on_version
        self.registry = open_registry(registry) if isinstance(registry, str) else registry
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.poll_s, self.deadline_s = poll_s, deadline_s
        self.trusted = trusted if trusted is not None else TrustedKeys()
        self.version: int | None = None
        self.current: VersionManifest | None = None  # the manifest of the version served
        self.have: dict[str, str] = dict(base_digests or {})
        self.newest: VersionKey | None = None  # the newest version whose manifest verified: never a mere claim
        self.failed: VersionKey | None = None  # could not be applied: not retried until asked or superseded
        self.error: str | None = None
        self.pulling: int | None = None
        self.abandoned = 0
        self.last: RefitStats | None = None
        self._pending: RefitStats | None = None  # the pull of the version being installed
        self._wanted: int | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._applied = threading.Condition()
        self._thread: threading.Thread | None = None
        # The heartbeat first: a bad ttl is refused before a server thread and socket exist to leak.
        self._heartbeat = Heartbeat(self.registry, self._entry, ttl) if serve else None
        context = tls.listener(peers=True) if tls is not None and serve else None
        self.server = RefitServer(self, host=host, port=port, token=token, tls=context).start() if serve else None
        self.lookout = Lookout(
            self._name, self.registry, headers=self.headers, trusted=self.trusted, max_jump=max_jump, shun_s=shun_s,
            own=lambda: self.server.address if self.server is not None else None,
            on_believed=self._believed, on_refused=self._refused,
        )  # fmt: skip

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
        """The bytes of ``tensor`` as version ``version`` published them, when this replica can serve them."""
        return None

    def _servable(self) -> bool:
        """Whether the version served can be offered to other replicas (the engine's follower says)."""
        return False

    def _entry(self) -> PeerEntry:
        assert self.server is not None
        return PeerEntry(head_identity(self._name), self.server.address, name=head_name(self._name))

    # -- following -------------------------------------------------------------------------------------------------
    def start(self: F) -> F:
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

    @property
    def served(self) -> VersionKey | None:
        """``(epoch, version)`` of the version served; None: the loaded checkpoint."""
        current = self.current
        return current.key if current is not None else None

    @property
    def epoch(self) -> int | None:
        """The epoch of the version served (None: the loaded checkpoint)."""
        current = self.current
        return current.epoch if current is not None else None

    @property
    def newest_seen(self) -> int | None:
        """The number of the newest version that verified."""
        return self.newest[1] if self.newest is not None else None

    def request(self, version: int | None = None) -> None:
        """Look for ``version`` (None: the newest) now, and try it even if it failed before."""
        self._wanted = version
        failed = self.failed
        if failed is not None and (version is None or version == failed[1]):
            self.failed = None
        self._wake.set()

    def target_of(self, version: int, epoch: int | None = None) -> VersionKey:
        """What asking for ``version`` means: of ``epoch`` when given, else of the newest epoch that verified."""
        if epoch is None:
            known = self.newest or self.served
            epoch = known[0] if known is not None else 0
        return (epoch, version)

    def wait_for(self, version: int, timeout: float, *, epoch: int | None = None) -> bool:
        """Whether this replica serves ``version`` (or newer) within ``timeout`` seconds; False at once when that
        version failed. ``version`` is of ``epoch`` when given, else of the newest epoch seen (``target_of``)."""

        def reached() -> bool:
            served = self.served
            if served is None:
                return version == 0  # the loaded checkpoint is version 0
            return served >= self.target_of(version, epoch)

        with self._applied:
            self._applied.wait_for(lambda: reached() or self.failed == self.target_of(version, epoch), timeout)
            return reached()

    def liars(self) -> dict[str, int]:
        """Holder address -> how many times it lied (``lookout.OTHER_HOLDERS`` past ``MAX_LIARS`` addresses)."""
        return self.lookout.liars()

    def status(self) -> dict[str, object]:
        """What ``/health`` reports: the version served, the newest verified, a pull under way, the last error, and
        the holders that lied."""
        lies = self.liars()
        return {
            "name": self._name,
            "version": self.version,
            "epoch": self.epoch,
            "newest": self.newest_seen,
            "newest_epoch": self.newest[0] if self.newest is not None else None,
            "behind": self.behind,
            "pulling": self.pulling,
            "failed": self.failed[1] if self.failed is not None else None,
            "error": self.error,
            "abandoned": self.abandoned,
            "signed": bool(self.trusted),
            "lies": lies,
            "last": self.last.to_dict() if self.last is not None else None,
        }

    @property
    def behind(self) -> int:
        """Verified versions published that this replica does not serve yet."""
        return behind(self.served, self.newest)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except PreheatError as exc:  # registry down, a holder gone: logged, retried on the next look
                log.warning("refit: %s", exc)
            self._wake.wait(self.poll_s)
            self._wake.clear()

    # -- looking: claims, then what verifies (preheat.refit.lookout) ----------------------------------------------
    def discover(self) -> Discovery:
        """Claims: every holder of ``name`` the registry knows and the versions each says it serves."""
        return self.lookout.discover()

    def look(self) -> Discovery:
        """The holders of the versions this replica may believe (``Lookout.look``)."""
        return self.lookout.look(self.served)

    def _believed(self, manifest: VersionManifest) -> None:
        with self._applied:
            if self.newest is None or manifest.key > self.newest:
                self.newest = manifest.key
            self._applied.notify_all()  # a waiter's target may be of this epoch

    def _refused(self, key: VersionKey, why: str) -> None:
        with self._applied:
            self.error = f"version {key[1]} (epoch {key[0]}) refused: {why}"

    def step(self) -> bool:
        """Look once; pull and apply the newest version when it is newer than ours. True when one was applied."""
        found = self.look()
        wanted, served = self._wanted, self.served
        target = found.newest
        if wanted is not None:
            held = [k for vs in found.holders.values() for k in vs]
            asked = [k for k in held if k[1] == wanted and (served is None or k > served)]
            if asked:
                target = max(asked)
            elif (served is not None and served[1] >= wanted) or (target is not None and target[1] > wanted):
                # Served already, or passed by a newer one: dropped, or it would pin every later look to it.
                self._wanted = wanted = None
            else:
                return False  # asked for a version not published yet: looked for again at the next poll, not failed
        while target is not None and (served is None or target > served) and target != self.failed:
            self._wanted = None
            try:
                self.apply(self.lookout.verified[target], found)
                return True
            except SupersededError as exc:
                self.abandoned += 1
                log.info("refit: %s; pulling the newer one", exc)
                found = self.look()
                target = found.newest
            except RefitError as exc:
                with self._applied:
                    if self.served is None or target > self.served:  # not one a newer version superseded meanwhile
                        self.failed, self.error = target, str(exc)
                    self._applied.notify_all()
                log.warning("refit: staying on version %s: %s", self.version, exc)
                return False
        return False

    def apply(self, manifest: VersionManifest, found: Discovery) -> None:
        """Pull the version of ``manifest`` (verified: ``look``) from its holders in ``found``, check every tensor,
        install it; ``RefitError`` leaves the engine as it was."""
        version = manifest.version
        self.pulling = version
        try:
            needed = self._needed(to_fetch(self.have, manifest))
            pull = Pull(
                manifest,
                needed,
                self.look,
                headers=self.headers,
                poll_s=self.poll_s,
                deadline_s=self.deadline_s,
                cancel=self._stop,
                on_lie=self.lookout.lie,
            )
            result = pull.run(found.holding(manifest.key))
            tensors = {
                e.name: torch.frombuffer(result.data[e.name], dtype=to_torch(e.dtype)).reshape(e.shape)
                if e.nbytes
                else torch.empty(e.shape, dtype=to_torch(e.dtype))
                for e in needed
            }
            tensors = self._prepared(tensors)
            # Made the last pull's stats by _installed, with the version: whoever sees version N served sees its pull.
            stats = RefitStats(
                version, len(needed), result.nbytes, manifest.total_bytes, result.sources, result.seconds, 0.0, "",
            )  # fmt: skip
            self._pending = stats
            began = time.monotonic()
            try:
                report = self.run_between(lambda: self._install(manifest, tensors))
            except (RuntimeError, MemoryError) as exc:  # torch's (OutOfMemoryError too): the swap rolled back
                raise RefitError(f"version {version}: the swap failed and was rolled back: {exc}") from exc
            finally:
                self._pending = None
            swap_s = time.monotonic() - began
        finally:
            self.pulling = None
        stats.swap_s, stats.mode = swap_s, report.mode
        log.info(
            "refit: serving version %d of %s (%d tensors, %d of %d bytes pulled in %.2f s, swapped in %.3f s)",
            version, self._name, len(needed), result.nbytes, manifest.total_bytes, result.seconds, swap_s,
        )  # fmt: skip

    # -- the engine's part -----------------------------------------------------------------------------------------
    def _needed(self, lacking: list[TensorEntry]) -> list[TensorEntry]:
        """Of the tensors this replica lacks, those to pull (``RefitError`` refuses the version before a byte moves)."""
        return lacking

    def _prepared(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pulled tensors made ready off the generation thread (converted, staged), so the install is short."""
        return tensors

    def _install(self, manifest: VersionManifest, tensors: dict[str, torch.Tensor]) -> SwapReport:
        """Put ``tensors`` into the engine, between two requests (``run_between``); ends with ``_installed``."""
        raise NotImplementedError

    def _installed(self, manifest: VersionManifest) -> None:
        """The engine computes with ``manifest``'s version now: it is the one served, reported and offered."""
        self.have.update(manifest.digests())
        with self._applied:
            self.current, self.version = manifest, manifest.version
            if self._pending is not None:
                self.last = self._pending
            self.error = None
            if self.failed is not None and self.failed <= manifest.key:  # superseded: no longer reported
                self.failed = None
            if self.newest is None or self.newest < manifest.key:
                self.newest = manifest.key
            # On the generation thread, while the follower's thread waits for this install: the lookout is idle.
            self.lookout.served(manifest.key)
            self._applied.notify_all()
        if self.on_version is not None:
            self.on_version(manifest.version)
