"""Where peers announce what they hold: Redis (``redis://host:port/db``) or a shared directory (``file:///dir``).

An entry says: this checkpoint (identity, and the name it is served as), this tensor-parallel rank of this world size,
is served at this address, with this load, and came from this origin. Entries expire: a peer re-announces itself
every ``ttl / 3`` seconds (``Heartbeat``), so a peer whose process died disappears within ``ttl`` seconds without
anyone cleaning up after it. Readers also skip expired entries themselves (a file registry has no server to expire
them), and a pull treats any entry as a hint: a peer that does not answer is dropped within seconds.

Layout: Redis keys ``preheat:peer:<identity>:<address>`` (a JSON value, ``EX ttl``); a directory holds
``<identity-as-dirname>/<address>.json`` files written atomically, with an ``expires`` field.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Protocol
from urllib.parse import unquote, urlsplit

from preheat.errors import ConfigError, RegistryError

log = logging.getLogger("preheat.peer")
DEFAULT_TTL = 10.0
_REDIS_PREFIX = "preheat:peer:"


@dataclass(frozen=True)
class PeerEntry:
    """One peer holding one checkpoint. ``address`` is ``host:port`` of its peer server; ``load`` is how many
    pulls it is serving now (pullers prefer idle peers); ``origin`` is the URI it loaded from, if remote (a
    newcomer's fallback); ``expires`` is epoch seconds, set by the registry."""

    identity: str
    address: str
    name: str = ""
    rank: int = 0
    world_size: int = 1
    load: int = 0
    origin: str | None = None
    expires: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes, *, where: str) -> PeerEntry:
        """Parse an entry; ``RegistryError`` naming ``where`` if it is not one."""
        try:
            doc = json.loads(raw)
            return cls(
                identity=str(doc["identity"]),
                address=str(doc["address"]),
                name=str(doc.get("name", "")),
                rank=int(doc.get("rank", 0)),
                world_size=int(doc.get("world_size", 1)),
                load=int(doc.get("load", 0)),
                origin=None if doc.get("origin") is None else str(doc["origin"]),
                expires=float(doc.get("expires", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RegistryError(f"{where}: not a peer entry ({exc})") from None

    def matches(self, wanted: str) -> bool:
        """Whether this entry holds ``wanted``: a checkpoint identity or a served name."""
        return wanted in (self.identity, self.name)


class Registry(Protocol):
    """Announce, withdraw and find peers. Every method raises ``RegistryError`` when the registry is unreachable."""

    @property
    def url(self) -> str: ...

    def announce(self, entry: PeerEntry, ttl: float) -> None:
        """Publish (or refresh) ``entry`` for ``ttl`` seconds."""
        ...

    def withdraw(self, entry: PeerEntry) -> None:
        """Remove ``entry`` now (a clean shutdown); missing is fine."""
        ...

    def find(self, wanted: str) -> list[PeerEntry]:
        """Live entries holding ``wanted`` (identity or name), least loaded first."""
        ...


def open_registry(url: str) -> Registry:
    """``redis://...`` (or ``rediss://``) or ``file:///shared/dir``; ``ConfigError`` for anything else."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisRegistry(url)
    if url.startswith("file://"):
        return FileRegistry(unquote(urlsplit(url).path))
    raise ConfigError(f"--registry {url!r}: use redis://host:port[/db] or file:///shared/dir")


def _sorted(entries: list[PeerEntry]) -> list[PeerEntry]:
    return sorted(entries, key=lambda e: (e.load, e.address))


class FileRegistry:
    """Entries as small JSON files in a directory every replica can see (one node, or NFS)."""

    def __init__(self, root: str) -> None:
        if not root:
            raise ConfigError("file registry: write file:///absolute/dir")
        self.root = root

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    def _path(self, entry: PeerEntry) -> str:
        return os.path.join(self.root, entry.identity.replace(":", "-"), entry.address.replace(":", "_") + ".json")

    def announce(self, entry: PeerEntry, ttl: float) -> None:
        path = self._path(entry)
        stamped = replace(entry, expires=time.time() + ttl)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(stamped.to_json())
            os.replace(tmp, path)  # readers see the old entry or the new one, never half of one
        except OSError as exc:
            raise RegistryError(f"registry {self.url}: cannot write {path}: {exc.strerror}") from None

    def withdraw(self, entry: PeerEntry) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(entry))

    def find(self, wanted: str) -> list[PeerEntry]:
        now = time.time()
        found: list[PeerEntry] = []
        try:
            groups = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise RegistryError(f"registry {self.url}: cannot list: {exc.strerror}") from None
        for group in groups:
            directory = os.path.join(self.root, group)
            with contextlib.suppress(OSError):  # a group removed while we look: nothing in it
                for name in os.listdir(directory):
                    if not name.endswith(".json"):
                        continue
                    path = os.path.join(directory, name)
                    try:
                        with open(path, encoding="utf-8") as handle:
                            entry = PeerEntry.from_json(handle.read(), where=path)
                    except (OSError, RegistryError) as exc:
                        log.debug("registry: skipping %s: %s", path, exc)
                        continue
                    if entry.expires < now:
                        with contextlib.suppress(OSError):  # the peer stopped heartbeating: tidy up for it
                            os.unlink(path)
                        continue
                    if entry.matches(wanted):
                        found.append(entry)
        return _sorted(found)


class RedisRegistry:
    """Entries as Redis keys with a TTL (``SET ... EX``): Redis itself forgets a peer whose heartbeat stopped."""

    def __init__(self, url: str, *, timeout: float = 2.0) -> None:
        import redis

        self._url = url
        # Short timeouts: a registry that is down must cost a pull seconds, not the client's default of forever.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    @property
    def url(self) -> str:
        return self._url

    def _fail(self, what: str, exc: Exception) -> RegistryError:
        return RegistryError(f"registry {self._url}: {what} failed: {exc}")

    def announce(self, entry: PeerEntry, ttl: float) -> None:
        import redis

        stamped = replace(entry, expires=time.time() + ttl)
        try:
            self._client.set(_REDIS_PREFIX + f"{entry.identity}:{entry.address}", stamped.to_json(), px=int(ttl * 1000))
        except redis.RedisError as exc:
            raise self._fail("announce", exc) from None

    def withdraw(self, entry: PeerEntry) -> None:
        import redis

        try:
            self._client.delete(_REDIS_PREFIX + f"{entry.identity}:{entry.address}")
        except redis.RedisError as exc:
            raise self._fail("withdraw", exc) from None

    def find(self, wanted: str) -> list[PeerEntry]:
        import redis

        # An identity names its keys directly; a served name needs a scan (registries hold a few hundred keys).
        pattern = _REDIS_PREFIX + (f"{wanted}:*" if wanted.startswith("xxh3-128:") else "*")
        found: list[PeerEntry] = []
        now = time.time()
        try:
            keys = list(self._client.scan_iter(match=pattern, count=500))
            values = self._client.mget(keys) if keys else []
        except redis.RedisError as exc:
            raise self._fail("lookup", exc) from None
        for key, raw in zip(keys, values, strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                entry = PeerEntry.from_json(raw, where=f"{self._url} key {key!r}")
            except RegistryError as exc:
                log.debug("registry: skipping %s", exc)
                continue
            if entry.matches(wanted) and entry.expires >= now:
                found.append(entry)
        return _sorted(found)

    def close(self) -> None:
        self._client.close()


class Heartbeat:
    """Announce ``entry()`` now and every ``ttl / 3`` seconds from a daemon thread, until ``stop()`` withdraws it.

    ``entry`` is called each time, so the load it reports stays current. A registry that is down is logged (once
    per outage) and retried on the next beat: the replica keeps serving its own clients either way.
    """

    def __init__(self, registry: Registry, entry: Callable[[], PeerEntry], ttl: float = DEFAULT_TTL) -> None:
        if ttl <= 0:
            raise ConfigError(f"registry ttl must be positive, got {ttl}")
        self.registry, self.entry, self.ttl = registry, entry, ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failing = False

    def beat(self) -> None:
        """Announce once; record (and log) a failure instead of raising."""
        try:
            self.registry.announce(self.entry(), self.ttl)
        except RegistryError as exc:
            if not self.failing:
                log.warning("peer heartbeat: %s (retrying every %.1f s)", exc, self.ttl / 3)
            self.failing = True
            return
        if self.failing:
            log.warning("peer heartbeat: registry %s reachable again", self.registry.url)
        self.failing = False

    def start(self) -> Heartbeat:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="preheat-peer-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self.beat()

    def stop(self) -> None:
        """Stop beating and withdraw the entry (best effort: an unreachable registry lets it expire)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.registry.withdraw(self.entry())
        except RegistryError as exc:
            log.debug("peer heartbeat: withdraw failed, the entry will expire: %s", exc)
