"""What a follower may believe: which holders serve which versions, each version counted only once its manifest
verifies, and the holders that lied.

Holders (``refit:NAME`` in the registry: the trainer, replicas, or anyone who can write the registry) answer
``/refit/v1/info`` with the versions they serve: claims. ``Lookout.look`` verifies the newest claims newer than the
version served by fetching their manifests from a claimant (``preheat.refit.trust``: the name, epoch and version
asked for; with trusted keys, a signature by one of them; within the jump bound), and returns only the holders of
versions that verified. A holder whose manifest does not verify, or that announces a version it then does not serve,
or whose bytes do not match a verified manifest (``lie``, from the pull), is counted by address, logged, and not
asked again for ``shun_s`` seconds. Without trusted keys only holders on this machine are asked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from preheat.artifacts.signing import TrustedKeys
from preheat.core.errors import PreheatError, RefitError, VerificationError
from preheat.core.jsonsafe import load_object
from preheat.http.client import Timeouts, describe, request
from preheat.http.tls import fleet_url
from preheat.peer.registry import Registry
from preheat.refit.protocol import MAX_COUNT, MAX_DOCUMENT_BYTES, VersionKey, VersionManifest, head_identity, head_name
from preheat.refit.pull import TIMEOUTS, Discovery
from preheat.refit.server import INFO_ROUTE, manifest_route
from preheat.refit.trust import HOW_TO_SIGN, check_signature, holder_allowed, new_epoch, refusal

log = logging.getLogger("preheat.refit")
INFO_TIMEOUTS = Timeouts(connect=1.0, read=5.0)
INFO_BYTES = 65536  # a holder's info lists the versions it serves: a few dozen bytes
MAX_LIARS = 64  # holders counted by address (a metrics label); the rest together as OTHER_HOLDERS
OTHER_HOLDERS = "other"
MAX_MANIFEST_FETCHES = 8  # manifests fetched per look: a registry full of liars costs a bounded time each poll
MAX_REFUSED = 1024


def _count(value: object) -> bool:
    """Whether ``value`` is a version or epoch number (a JSON integer, not a boolean, in range)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def holder_claims(address: str, headers: Mapping[str, str]) -> list[VersionKey] | None:
    """The versions (``(epoch, version)``) the holder at ``address`` says it serves; None when it does not answer as
    a holder. Claims only: nothing here is verified."""
    try:
        answer = request(f"{fleet_url(address)}{INFO_ROUTE}", timeouts=INFO_TIMEOUTS, headers=dict(headers),
                         max_body=INFO_BYTES)  # fmt: skip
        # Bounded: a holder is any address in the registry, and 64 KiB of "[" would otherwise raise a
        # RecursionError here, which ended the follower's thread. A JSONInputError is a PreheatError: skipped.
        info = load_object(answer.body, max_bytes=INFO_BYTES, max_depth=8) if answer.status == 200 else {}
    except PreheatError as exc:
        log.debug("refit: holder %s skipped (no answer, or not a list of versions): %s", address, exc)
        return None
    epoch, versions = info.get("epoch"), info.get("versions")
    if not isinstance(versions, list) or not all(_count(v) for v in versions):
        return None
    if not versions:
        return []
    if not isinstance(epoch, int) or not _count(epoch):
        return None
    return [(epoch, v) for v in versions]


class Lookout:
    """Claims and verified versions of ``name`` for one follower. ``own``: this follower's own holder address (never
    asked); ``on_believed``: called with each manifest that verifies and is within the bound; ``on_refused``: with a
    version that verified but is too far ahead, and why."""

    def __init__(
        self,
        name: str,
        registry: Registry,
        *,
        headers: Mapping[str, str],
        trusted: TrustedKeys,
        max_jump: int,
        shun_s: float,
        own: Callable[[], str | None],
        on_believed: Callable[[VersionManifest], None],
        on_refused: Callable[[VersionKey, str], None],
    ) -> None:
        self.name, self.registry, self.headers = name, registry, dict(headers)
        self.trusted, self.max_jump, self.shun_s = trusted, max_jump, shun_s
        self.own, self.on_believed, self.on_refused = own, on_believed, on_refused
        self.verified: dict[VersionKey, VersionManifest] = {}  # manifests that verified, newer than the one served
        self._refused: set[VersionKey] = set()  # verified but too far ahead (``trust.refusal``): not fetched again
        self._lies: dict[str, int] = {}  # holder address -> times it lied
        self._shunned: dict[str, float] = {}  # holder -> monotonic time until which it is not asked
        self._beyond: set[str] = set()  # holders beyond this machine already reported as skipped (no trusted keys)
        self._lock = threading.Lock()  # lies and shunned: the pull's threads report lies too

    def liars(self) -> dict[str, int]:
        """Holder address -> how many times it lied (``OTHER_HOLDERS`` past ``MAX_LIARS`` addresses)."""
        with self._lock:
            return dict(self._lies)

    def lie(self, address: str, why: str) -> None:
        """Count a lie by ``address`` (``preheat_refit_lies_total``), log it, and stop asking it for a while."""
        with self._lock:
            label = address if address in self._lies or len(self._lies) < MAX_LIARS else OTHER_HOLDERS
            self._lies[label] = self._lies.get(label, 0) + 1
            self._shunned[address] = time.monotonic() + self.shun_s
        log.warning("refit: holder %s lied, not asked for %g s: %s", address, self.shun_s, why)

    def served(self, key: VersionKey) -> None:
        """The follower now serves ``key``: manifests up to it are no longer needed, and versions refused against
        the previous one are judged again."""
        for old in [k for k in self.verified if k <= key]:
            self.verified.pop(old, None)
        self._refused.clear()

    def discover(self) -> Discovery:
        """Claims: every holder of the name the registry knows and the versions each says it serves (this follower,
        holders shunned for lying, and without trusted keys holders beyond this machine, aside)."""
        own = self.own()
        now = time.monotonic()
        with self._lock:
            self._shunned = {a: t for a, t in self._shunned.items() if t > now}
            shunned = set(self._shunned)
        holders: dict[str, list[VersionKey]] = {}
        for entry in self.registry.find(head_name(self.name)):
            address = entry.address
            if address == own or entry.identity != head_identity(self.name) or address in shunned:
                continue
            if not holder_allowed(address, self.trusted):
                if address not in self._beyond and len(self._beyond) < MAX_LIARS:
                    self._beyond.add(address)
                    log.warning("refit: holder %s is beyond this machine and no --refit-trust-key is given: not "
                                "asked (%s)", address, HOW_TO_SIGN)  # fmt: skip
                continue
            claims = self.claims(address)
            if claims is not None:
                holders[address] = claims
        return Discovery(holders)

    def claims(self, address: str) -> list[VersionKey] | None:
        """The versions ``address`` says it serves; None when it does not answer as a holder."""
        return holder_claims(address, self.headers)

    def look(self, served: VersionKey | None) -> Discovery:
        """The holders of the versions the follower may believe: claims of versions whose manifest verified. The
        newest claims newer than ``served`` are verified first (a manifest fetched from a claimant), so a holder that
        only announces a version, or announces one it cannot sign, moves nothing; it is reported."""
        claims = self.discover()
        newer = sorted({k for ks in claims.holders.values() for k in ks if served is None or k > served}, reverse=True)
        fetches = 0
        for key in newer:
            if key in self.verified:
                break  # the newest believable claim: older ones are not needed
            if key in self._refused:
                continue
            for address in claims.holding(key):
                if fetches >= MAX_MANIFEST_FETCHES:  # a registry full of liars costs a bounded time per look
                    break
                fetches += 1
                manifest = self._verify_claim(address, key)
                if manifest is not None:
                    self._believe(manifest, served)
                    break
            if key in self.verified or fetches >= MAX_MANIFEST_FETCHES:
                break
        verified = {a: [k for k in ks if k in self.verified] for a, ks in claims.holders.items()}
        return Discovery({a: ks for a, ks in verified.items() if ks})

    def _believe(self, manifest: VersionManifest, served: VersionKey | None) -> None:
        """A manifest that verified: believed, unless too far ahead of ``served`` (``trust.refusal``)."""
        key = manifest.key
        why = refusal(served, key, max_jump=self.max_jump, now_ms=new_epoch())
        if why is not None:
            if len(self._refused) >= MAX_REFUSED:
                self._refused.clear()
            self._refused.add(key)
            log.warning("refit: version %d of %s (epoch %d) refused: %s", key[1], self.name, key[0], why)
            self.on_refused(key, why)
            return
        self.verified[key] = manifest
        self.on_believed(manifest)

    def _verify_claim(self, address: str, key: VersionKey) -> VersionManifest | None:
        """Version ``key``'s manifest from ``address`` if it verifies; None otherwise (a lie is reported)."""
        url = f"{fleet_url(address)}{manifest_route(key)}"
        try:
            answer = request(url, timeouts=TIMEOUTS, headers=self.headers, max_body=MAX_DOCUMENT_BYTES)
        except PreheatError as exc:  # gone or slow: not a lie, asked again at the next look
            log.debug("refit: %s", describe(exc, TIMEOUTS))
            return None
        if answer.status == 404:
            # Announced, then not served: a lie, unless it moved on between its answer and this request.
            if key in (self.claims(address) or []):
                self.lie(address, f"{url}: announces version {key[1]} (epoch {key[0]}) but does not serve it")
            return None
        if answer.status != 200:
            log.debug("refit: %s: HTTP %d", url, answer.status)
            return None
        try:
            manifest = VersionManifest.from_json(answer.body, where=url)
            if (manifest.name, manifest.key) != (self.name, key):
                raise VerificationError(
                    f"{url}: answered version {manifest.version} (epoch {manifest.epoch}) of {manifest.name!r}"
                )
            check_signature(manifest, self.trusted, where=url)
        except RefitError as exc:  # malformed, another version, not signed by a trusted key: a lie
            self.lie(address, str(exc))
            return None
        return manifest
