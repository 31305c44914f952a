"""Compiled artifacts at the edges: the node cache's ``compiled/`` directory, fetching blobs from peers, and
``find``, the one search (node cache, then peers) behind ``preheat serve --compile`` and ``preheat artifacts pull``.

The format and the trust rules are in ``preheat.artifacts.blobs`` (pure); this module stores only what passed them,
re-checks before serving, and fetches with bounds: at most ``MAX_BLOB_BYTES`` read from a peer, at most 3 redirects,
and the peer token never sent to another scheme, host or port than the one the registry named. It holds blobs of
every kind of key (``CompiledKey``: preheat's engine, vLLM's compile cache) side by side: the kind is a field of the
key, so it is part of the blob's name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from preheat.artifacts.blobs import HOW_TO_TRUST, MAX_BLOB_BYTES, ArtifactKey, CompiledKey, Verified, verify
from preheat.artifacts.signing import TrustedKeys, trust_key_files
from preheat.core import durable
from preheat.core.errors import AnswerTooLargeError, HTTPClientError, PeerError, RegistryError, ResponseTimeoutError
from preheat.http.client import Redirects, Timeouts, get
from preheat.http.tls import fleet_url
from preheat.peer.registry import open_registry
from preheat.peer.server import ARTIFACTS_ROUTE
from preheat.store.cache import ModelCache

log = logging.getLogger("preheat.peer")
_KEY = re.compile(r"[0-9a-f]{32}")  # fullmatch: a CompiledKey.hex


class ArtifactStore:
    """Blobs in the node cache: ``<cache>/compiled/<key>.blob``, ``<key>.local`` beside a blob this node built (the
    SHA-256 of its body), and each key's Inductor directory ``<key>/inductor``.

    Only ``Verified`` blobs are stored, and ``load``/``lookup`` verify again against ``trusted`` (so a revoked key
    stops installs and re-serving at once); a blob that appeared there any other way is neither installed nor served.
    """

    def __init__(self, cache_root: str, trusted: TrustedKeys | None = None) -> None:
        self.root = os.path.join(cache_root, "compiled")
        self.trusted = trusted or TrustedKeys()
        # hex -> (stat of the blob + its built-here record, verdict) of the last check for serving
        self._served: dict[str, tuple[tuple[object, ...], bool]] = {}
        self._lock = threading.Lock()

    def blob_path(self, hex_key: str) -> str:
        if not _KEY.fullmatch(hex_key):  # names from URLs and directory listings: never a path of their own
            raise PeerError(f"artifact key {hex_key[:80]!r} is not 32 hex digits")
        return os.path.join(self.root, f"{hex_key}.blob")

    def marker_path(self, hex_key: str) -> str:
        return self.blob_path(hex_key).removesuffix(".blob") + ".local"

    def inductor_dir(self, key: ArtifactKey) -> str:
        return os.path.join(self.root, key.hex, "inductor")

    def _marker(self, hex_key: str) -> str | None:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(self.marker_path(hex_key), encoding="ascii") as f:
            return f.read(200).strip().removeprefix("sha256:")
        return None

    def _read(self, hex_key: str) -> tuple[bytes, tuple[int, ...]] | None:
        path = self.blob_path(hex_key)
        try:
            with open(path, "rb") as handle:
                st = os.fstat(handle.fileno())
                if st.st_size > MAX_BLOB_BYTES:
                    raise PeerError(f"{path}: {st.st_size} bytes, larger than {MAX_BLOB_BYTES}; refused")
                return handle.read(MAX_BLOB_BYTES + 1), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise PeerError(f"{path}: cannot read ({exc.strerror})") from None

    def load(self, key: CompiledKey | str) -> Verified | None:
        """The stored blob for ``key``, verified; None when there is none; ``PeerError`` when it is refused."""
        hex_key = key if isinstance(key, str) else key.hex
        found = self._read(hex_key)
        if found is None:
            return None
        return verify(found[0], key, self.trusted, where=self.blob_path(hex_key), built_here=self._marker(hex_key))

    def lookup(self, hex_key: str) -> str | None:
        """The blob's path if this node has it *and* it verifies (what the peer server serves), else None. The
        verdict is kept per file version (device, inode, size, mtime, built-here record), so a blob is read and
        checked once, not on every request."""
        if not _KEY.fullmatch(hex_key):
            return None
        path = self.blob_path(hex_key)
        try:
            st = os.stat(path)
        except OSError:
            return None
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, self._marker(hex_key))
        with self._lock:
            verdict = self._served.get(hex_key)
        if verdict is None or verdict[0] != stamp:
            verdict = (stamp, self._servable(hex_key, stamp))
            with self._lock:
                self._served[hex_key] = verdict
        # Replaced between the check and the send? Only this node writes here, by rename, and it writes only
        # verified blobs; a stranger with write access to the cache is out of this model (docs/peer.md).
        return path if verdict[1] else None

    def _servable(self, hex_key: str, stamp: tuple[object, ...]) -> bool:
        try:
            found = self._read(hex_key)
            if found is None or found[1] != stamp[:4]:
                return False  # replaced while we looked: the next request sees a new stamp and checks again
            built_here = stamp[4] if isinstance(stamp[4], str) else None
            verify(found[0], hex_key, self.trusted, where=self.blob_path(hex_key), built_here=built_here)
        except PeerError as exc:
            log.warning("peer: not serving artifacts %s: %s", hex_key, exc)
            return False
        return True

    def put(self, verified: Verified) -> str:
        """Store a verified blob atomically (and, when it was built here, the marker that says so); its path."""
        os.makedirs(self.root, exist_ok=True)
        path = self.blob_path(verified.hex)
        durable.write_file(path, verified.blob)
        marker = self.marker_path(verified.hex)
        if verified.local:
            durable.write_file(marker, f"sha256:{verified.body_sha256}\n".encode())
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)
        return path

    def discard(self, hex_key: str) -> None:
        """Remove a key's blob, its built-here record and its Inductor directory (a blob this node no longer trusts:
        what was installed from it must not be reused either)."""
        for path in (self.blob_path(hex_key), self.marker_path(hex_key)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(self.blob_path(hex_key).removesuffix(".blob"), ignore_errors=True)
        with self._lock:
            self._served.pop(hex_key, None)

    def hex_keys(self) -> list[str]:
        """The keys of the blobs stored here (verified or not)."""
        with contextlib.suppress(FileNotFoundError):
            names = (n.removesuffix(".blob") for n in os.listdir(self.root) if n.endswith(".blob"))
            return sorted(n for n in names if _KEY.fullmatch(n))
        return []


def node_store(cache_dir: str | None, trust: Sequence[str] | None = None) -> ArtifactStore:
    """The node cache's store (``cache_dir``; None: ``PREHEAT_CACHE_DIR`` or ~/.cache/preheat), trusting the public
    key files ``trust`` (None: ``PREHEAT_TRUST_KEY``, as ``preheat serve`` reads them). Its ``lookup`` is what a seed
    peer serves (``python -m preheat.peer --artifacts``)."""
    return ArtifactStore(ModelCache(cache_dir).root, TrustedKeys.from_files(trust_key_files(trust)))


# -- fetching from peers -------------------------------------------------------------------------------------------


def fetch(
    address: str,
    key: CompiledKey,
    *,
    token: str | None,
    timeout: float = 5.0,
    max_bytes: int = MAX_BLOB_BYTES,
    deadline_s: float = 300.0,
) -> bytes | None:
    """The blob for ``key`` from the peer at ``address`` (unverified: pass it to ``verify``), or None when it has
    none, cannot be reached, sends more than ``max_bytes``, or takes longer than ``deadline_s`` in all."""
    url = f"{fleet_url(address)}{ARTIFACTS_ROUTE}{key.hex}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = get(
            url,
            timeouts=Timeouts.within(timeout),
            headers=headers,
            max_body=max_bytes,
            deadline_s=deadline_s,
            redirects=Redirects(limit=3),  # the token never follows to another scheme, host or port
        )
    except AnswerTooLargeError:
        log.warning("compile: peer %s offers more than %d bytes of artifacts; dropped", address, max_bytes)
        return None
    except ResponseTimeoutError as exc:
        log.warning("compile: peer %s too slow sending artifacts (%s); dropped", address, exc)
        return None
    except HTTPClientError as exc:  # unreachable, broken, or a redirect we refuse to follow
        log.warning("compile: peer %s unreachable for artifacts: %s", address, exc)
        return None
    if answer.status != 200:
        if answer.status != 404:
            log.warning("compile: peer %s refused artifacts: HTTP %d", address, answer.status)
        return None
    return answer.body


@dataclass
class Found:
    """What ``find`` found: a blob this node may install (or None), where it came from (``node cache``,
    ``peer HOST:PORT``), and why each refused candidate was refused."""

    verified: Verified | None
    source: str = ""
    refused: list[str] = field(default_factory=list)


def find(
    key: CompiledKey,
    store: ArtifactStore,
    *,
    peers: Sequence[str] = (),
    registry: str | None = None,
    identity: str | None = None,
    token: str | None = None,
) -> Found:
    """Artifacts for ``key`` this node may install: its own node cache's, else the first that verifies against
    ``store.trusted`` from ``peers`` (``host:port``) and then the registry's peers for ``identity``.

    A node-cache blob that no longer verifies is discarded, with what was installed from it; peers are not asked at
    all when no key is trusted (nothing they sent would be installed). A registry that cannot be read is a refusal
    noted, not an error: explicit peers are still asked. The caller stores a peer's blob (``store.put``) once it
    installed it, so this node serves it next."""
    found = Found(None)
    try:
        found.verified = store.load(key)
    except PeerError as exc:  # e.g. signed by a key no longer trusted: drop it and what it installed, start afresh
        found.refused.append(str(exc))
        store.discard(key.hex)
    if found.verified is not None:
        found.source = "node cache"
        return found
    if not peers and not registry:
        return found
    if not store.trusted:
        found.refused.append(f"peers not asked for artifacts: no --trust-key given. {HOW_TO_TRUST}")
        return found
    addresses = list(dict.fromkeys(peers))
    if registry and identity:
        try:
            addresses += [e.address for e in open_registry(registry).find(identity) if e.address not in addresses]
        except RegistryError as exc:
            found.refused.append(str(exc))
    for address in addresses:
        source = f"peer {address}"
        raw = fetch(address, key, token=token)
        if raw is None:
            continue
        try:
            found.verified, found.source = verify(raw, key, store.trusted, where=source), source
            return found
        except PeerError as exc:  # another peer may hold artifacts someone trusted signed
            found.refused.append(str(exc))
    return found
