"""Pull the tensors a replica lacks for one version, striped across every holder of it, each checked on arrival.

Holders are the trainer and the replicas already on the version (``preheat.refit.server``). One thread per holder
takes the next waiting tensor, so a fast holder serves more of them (striping that rebalances itself). A holder
that fails (refused, timed out, 404: it moved on) is dropped for this pull and its tensor goes back in line; a holder
whose bytes do not match the manifest's digest is dropped for good and reported (``on_lie``). While tensors wait,
``rediscover()`` is asked every ``poll_s`` for holders (a replica that has just finished the version: the pull
resumes from it when the trainer dies) and for the newest version (when one newer than this pull appears, the pull
is abandoned). What ``rediscover()`` returns is the follower's to vouch for: only versions whose manifests verified,
so a holder that merely announces a huge version cannot abandon every pull.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from preheat.checkpoint.digest import digest_bytes
from preheat.core.errors import PreheatError, RefitError, SupersededError, VerificationError
from preheat.http.client import Timeouts, describe, request
from preheat.http.tls import fleet_url
from preheat.refit.protocol import TensorEntry, VersionKey, VersionManifest, stripe
from preheat.refit.server import tensor_route

log = logging.getLogger("preheat.refit")
TIMEOUTS = Timeouts(connect=2.0, read=30.0)


@dataclass
class PullResult:
    """The verified bytes of every tensor fetched, and where they came from."""

    data: dict[str, bytearray]
    sources: dict[str, int] = field(default_factory=dict)  # holder address -> bytes it served
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.data.values())


@dataclass
class Discovery:
    """What the registry and the holders say now: the versions (``(epoch, version)``) each holder serves."""

    holders: dict[str, list[VersionKey]]  # address -> versions it serves

    @property
    def newest(self) -> VersionKey | None:
        return max((v for vs in self.holders.values() for v in vs), default=None)

    def holding(self, key: VersionKey) -> list[str]:
        return sorted(a for a, vs in self.holders.items() if key in vs)


class Pull:
    """One version's pull; ``run()`` returns the verified bytes or raises ``RefitError`` (``SupersededError``)."""

    def __init__(
        self,
        manifest: VersionManifest,
        entries: Sequence[TensorEntry],
        rediscover: Callable[[], Discovery],
        *,
        headers: Mapping[str, str],
        poll_s: float = 0.5,
        deadline_s: float = 120.0,
        cancel: threading.Event | None = None,
        on_lie: Callable[[str, str], None] | None = None,
    ) -> None:
        self.manifest, self.rediscover, self.headers = manifest, rediscover, dict(headers)
        self.on_lie = on_lie  # (holder, why): told from the pulling threads when a holder's bytes do not match
        self.poll_s, self.deadline_s = poll_s, deadline_s
        self.entries = list(entries)
        self._waiting: deque[TensorEntry] = deque()
        self._data: dict[str, bytearray] = {}
        self._sources: dict[str, int] = {}
        self._lied: dict[str, str] = {}  # holder -> why it was dropped for good (bytes not matching the digest)
        self._busy: set[str] = set()  # holders with a thread pulling now
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._abandon = threading.Event()
        self._cancel = cancel or threading.Event()  # set by the follower's stop(): give up at the next look

    def run(self, holders: Sequence[str]) -> PullResult:
        began = time.monotonic()
        deadline = began + self.deadline_s
        version, key = self.manifest.version, self.manifest.key
        plan = stripe(self.entries, list(holders)) if holders and self.entries else {}
        # The plan's order first (largest tensors spread over holders), then anything left, one shared line.
        first = [e for group in itertools.zip_longest(*plan.values()) for e in group if e is not None]
        seen = {e.name for e in first}
        self._waiting.extend(first + [e for e in self.entries if e.name not in seen])
        for address in holders:
            self._start(address)
        next_look = time.monotonic() + self.poll_s
        with self._lock:
            while len(self._data) < len(self.entries):
                self._changed.wait(timeout=max(0.0, min(next_look, deadline) - time.monotonic()))
                if len(self._data) >= len(self.entries):
                    break
                now = time.monotonic()
                if self._cancel.is_set():
                    self._abandon.set()
                    raise RefitError(f"the pull of version {version} was stopped")
                if now >= deadline:
                    self._abandon.set()
                    raise RefitError(self._stuck(f"version {version} not complete after {self.deadline_s:g} s"))
                if now < next_look:
                    continue
                next_look = now + self.poll_s
                self._lock.release()
                try:
                    found = self.rediscover()
                finally:
                    self._lock.acquire()
                if found.newest is not None and found.newest > key:
                    self._abandon.set()
                    raise SupersededError(f"version {found.newest[1]} was published while {version} was pulled")
                fresh = [a for a in found.holding(key) if a not in self._busy and a not in self._lied]
                if not fresh and not self._busy and self._lied:  # every holder left sent bytes that did not match
                    self._abandon.set()
                    raise RefitError(self._stuck(f"version {version} failed verification from every holder"))
                for address in fresh:
                    self._start_locked(address)
        return PullResult(self._data, self._sources, time.monotonic() - began)

    def _stuck(self, what: str) -> str:
        lies = "; ".join(f"{a}: {why}" for a, why in self._lied.items())
        return f"{what} ({len(self._data)} of {len(self.entries)} tensors verified){'; ' + lies if lies else ''}"

    def _start(self, address: str) -> None:
        with self._lock:
            self._start_locked(address)

    def _start_locked(self, address: str) -> None:
        if address in self._busy or address in self._lied:
            return
        self._busy.add(address)
        threading.Thread(target=self._serve_from, args=(address,), name="preheat-refit-pull", daemon=True).start()

    def _serve_from(self, address: str) -> None:
        try:
            while not self._abandon.is_set():
                with self._lock:
                    if not self._waiting:
                        return
                    entry = self._waiting.popleft()
                try:
                    data = self._fetch(address, entry)
                except RefitError as exc:
                    with self._lock:
                        self._waiting.appendleft(entry)
                        if isinstance(exc, VerificationError):
                            self._lied[address] = str(exc)
                    if isinstance(exc, VerificationError) and self.on_lie is not None:
                        self.on_lie(address, str(exc))
                    else:
                        log.warning("refit: %s", exc)
                    return
                with self._lock:
                    self._data[entry.name] = data
                    self._sources[address] = self._sources.get(address, 0) + len(data)
                    self._changed.notify_all()
        finally:
            with self._lock:
                self._busy.discard(address)
                self._changed.notify_all()

    def _fetch(self, address: str, entry: TensorEntry) -> bytearray:
        url = f"{fleet_url(address)}{tensor_route(self.manifest.key, entry.name)}"
        try:
            answer = request(url, timeouts=TIMEOUTS, headers=self.headers, max_body=entry.nbytes)
        except PreheatError as exc:
            raise RefitError(f"{url}: {describe(exc, TIMEOUTS)}") from None
        if answer.status != 200:
            raise RefitError(f"{url}: HTTP {answer.status}")
        if len(answer.body) < entry.nbytes and answer.headers.get("Content-Length") == str(entry.nbytes):
            # The holder promised the right length and the connection ended early (it died mid-tensor): not a lie,
            # so it is not dropped for good; its tensor goes to another holder.
            raise RefitError(f"{url}: the answer ended after {len(answer.body)} of {entry.nbytes} bytes")
        if len(answer.body) != entry.nbytes:
            raise VerificationError(f"{url}: {len(answer.body)} bytes, the manifest says {entry.nbytes}")
        got = digest_bytes(answer.body)
        if got != entry.digest:
            raise VerificationError(f"{url}: digest {got} does not match the manifest's {entry.digest}")
        return bytearray(answer.body)
