"""Where peers announce what they hold: Redis (``redis://host:port/db``) or a shared directory (``file:///dir``).

An entry says: this checkpoint (identity, and the name it is served as), this tensor-parallel rank of this world size,
is served at this address, with this load, and came from this origin. Entries expire: a peer re-announces itself
every ``ttl / 3`` seconds (``Heartbeat``), so a peer whose process died disappears within ``ttl`` seconds without
anyone cleaning up after it. Readers also skip expired entries themselves (a file registry has no server to expire
them), and a pull treats any entry as a hint: a peer that does not answer is dropped within seconds.

Layout: Redis keys ``preheat:peer:<identity>:<address>`` (a JSON value, ``EX ttl``); a directory holds
``<identity-as-dirname>/<address>.json`` files written atomically, with an ``expires`` field.

Entries are outside input: whoever can write the registry writes them. A reader takes at most ``MAX_ENTRY_BYTES`` of
each (a regular file, never a FIFO or device) and at most ``MAX_ENTRIES`` per lookup, and an entry parses only if
every field has its type and range (``PeerEntry.from_json``); anything else is skipped. What an entry can make a
puller do is bounded too (docs/peer.md, "Trust"): dial ``address`` for files it then verifies, never adopt its
``origin``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Protocol
from urllib.parse import unquote, urlsplit

from preheat.core import durable
from preheat.core.errors import ConfigError, JSONInputError, RegistryError
from preheat.core.jsonsafe import loads_bounded
from preheat.sources.peer_uri import IDENTITY

log = logging.getLogger("preheat.peer")
DEFAULT_TTL = 10.0
MAX_ENTRY_BYTES = 16 * 1024  # an entry is ~300 bytes; anything past this is not one, and is not read further
MAX_ENTRIES = 4096  # entries looked at per lookup (a registry holds a few hundred)
_REDIS_PREFIX = "preheat:peer:"
# host:port, the host a DNS name, an IPv4 address or a bracketed IPv6 one: nothing that changes the URL around it.
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}))[:]([0-9]{1,5})$")
_MAX_NAME = 1024
_MAX_ORIGIN = 4096
Clock = Callable[[], float]  # epoch seconds: time.time, or a test's clock


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
        """Parse an entry; ``RegistryError`` naming ``where`` if it is not one: more than ``MAX_ENTRY_BYTES``, not
        JSON (or nested too deep), not an object, or a field of the wrong type or out of range. Unknown fields are
        ignored (a newer peer's).

        >>> raw = json.dumps({"identity": "xxh3-128:" + 32 * "0", "address": "10.0.0.7:41231", "load": 2})
        >>> PeerEntry.from_json(raw, where="redis key ...").load
        2
        """
        if len(raw) > MAX_ENTRY_BYTES:
            raise RegistryError(f"{where}: not a peer entry (over {MAX_ENTRY_BYTES} bytes)")
        try:
            # One flat object; a newer peer's unknown fields may nest a little.
            doc = loads_bounded(raw, max_bytes=MAX_ENTRY_BYTES, max_depth=8)
        except JSONInputError as exc:
            raise RegistryError(f"{where}: not a peer entry (not JSON: {exc})") from None
        if not isinstance(doc, dict):
            raise RegistryError(f"{where}: not a peer entry (a JSON {type(doc).__name__}, not an object)")
        try:
            entry = cls(
                identity=_text(doc, "identity", None, 64),
                address=_text(doc, "address", None, 300),
                name=_text(doc, "name", "", _MAX_NAME),
                rank=_count(doc, "rank", 0),
                world_size=_count(doc, "world_size", 1),
                load=_count(doc, "load", 0),
                origin=None if doc.get("origin") is None else _text(doc, "origin", None, _MAX_ORIGIN),
                expires=_seconds(doc, "expires"),
            )
            entry.check()
        except ValueError as exc:
            raise RegistryError(f"{where}: not a peer entry ({exc})") from None
        return entry

    def check(self) -> None:
        """``ValueError`` unless the fields make sense: an identity, a ``host:port``, a rank inside the world."""
        if IDENTITY.match(self.identity) is None:
            raise ValueError(f"identity {self.identity[:80]!r} is not xxh3-128:<32 hex>")
        if not valid_address(self.address):
            raise ValueError(f"address {self.address[:80]!r} is not host:port")
        if not (1 <= self.world_size <= 65536 and 0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} of world size {self.world_size}")

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


def valid_address(address: str) -> bool:
    """Whether ``address`` is ``host:port`` with a port of 1-65535 (and nothing a URL would read as more)."""
    match = _ADDRESS.match(address)
    return match is not None and 1 <= int(match.group(1)) <= 65535


def _text(doc: dict[str, object], key: str, default: str | None, limit: int) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"{key} is {'missing' if value is None else type(value).__name__}, not a string")
    if len(value) > limit or not value.isprintable():
        raise ValueError(f"{key} is not a printable string of at most {limit} characters")
    return value


def _count(doc: dict[str, object], key: str, default: int) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise ValueError(f"{key} {str(value)[:40]} is not a count")
    return value


def _seconds(doc: dict[str, object], key: str) -> float:
    value = doc.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} {str(value)[:40]} is not epoch seconds")
    return float(value)


def _read_entry(path: str) -> tuple[bytes, int]:
    """At most ``MAX_ENTRY_BYTES + 1`` bytes of the regular file ``path``, and its inode (OSError for anything else:
    a planted FIFO would otherwise block the reader, a device or a huge file fill its memory)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path}: not a regular file")
        chunks: list[bytes] = []
        left = MAX_ENTRY_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), info.st_ino
    finally:
        os.close(fd)


def _sorted(entries: list[PeerEntry]) -> list[PeerEntry]:
    return sorted(entries, key=lambda e: (e.load, e.address))


class FileRegistry:
    """Entries as small JSON files in a directory every replica can see (one node, or NFS)."""

    def __init__(self, root: str, *, clock: Clock = time.time) -> None:
        if not root:
            raise ConfigError("file registry: write file:///absolute/dir")
        self.root = root
        self.clock = clock

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    def _path(self, entry: PeerEntry) -> str:
        return os.path.join(self.root, entry.identity.replace(":", "-"), entry.address.replace(":", "_") + ".json")

    def announce(self, entry: PeerEntry, ttl: float) -> None:
        path = self._path(entry)
        stamped = replace(entry, expires=self.clock() + ttl)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # Readers see the old entry or the new one, never half of one; a failed write leaves no temporary file.
            durable.write_file(path, stamped.to_json().encode())
        except OSError as exc:
            raise RegistryError(f"registry {self.url}: cannot write {path}: {exc.strerror}") from None

    def withdraw(self, entry: PeerEntry) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(entry))

    def find(self, wanted: str) -> list[PeerEntry]:
        now = self.clock()
        found: list[PeerEntry] = []
        try:
            groups = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise RegistryError(f"registry {self.url}: cannot list: {exc.strerror}") from None
        for path in itertools.islice(self._entry_paths(groups), MAX_ENTRIES):
            try:
                raw, inode = _read_entry(path)
                entry = PeerEntry.from_json(raw, where=path)
            except (OSError, RegistryError) as exc:
                log.debug("registry: skipping %s: %s", path, exc)
                continue
            if entry.expires < now:
                with contextlib.suppress(OSError):  # the peer stopped heartbeating: tidy up for it
                    if os.stat(path, follow_symlinks=False).st_ino == inode:  # not a beat that replaced it since
                        os.unlink(path)
                continue
            if entry.matches(wanted):
                found.append(entry)
        return _sorted(found)

    def _entry_paths(self, groups: list[str]) -> Iterator[str]:
        for group in groups:
            directory = os.path.join(self.root, group)
            try:
                names = os.listdir(directory)
            except OSError:  # a group removed while we look (or a planted non-directory): nothing in it
                continue
            yield from (os.path.join(directory, name) for name in names if name.endswith(".json"))


class RedisRegistry:
    """Entries as Redis keys with a TTL (``SET ... EX``): Redis itself forgets a peer whose heartbeat stopped."""

    def __init__(self, url: str, *, timeout: float = 2.0, clock: Clock = time.time) -> None:
        import redis

        self._url = url
        self.clock = clock
        # Short timeouts: a registry that is down must cost a pull seconds, not the client's default of forever.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    @property
    def url(self) -> str:
        return self._url

    def _fail(self, what: str, exc: Exception) -> RegistryError:
        return RegistryError(f"registry {self._url}: {what} failed: {exc}")

    def announce(self, entry: PeerEntry, ttl: float) -> None:
        import redis

        stamped = replace(entry, expires=self.clock() + ttl)
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
        now = self.clock()
        try:
            keys = list(itertools.islice(self._client.scan_iter(match=pattern, count=500), MAX_ENTRIES))
            pipe = self._client.pipeline(transaction=False)
            for key in keys:  # GETRANGE, not GET: at most MAX_ENTRY_BYTES + 1 of a value however large it is
                pipe.getrange(key, 0, MAX_ENTRY_BYTES)
            # raise_on_error=False: a key of another type (WRONGTYPE) is that entry's problem, not the lookup's.
            values = pipe.execute(raise_on_error=False) if keys else []
        except redis.RedisError as exc:
            raise self._fail("lookup", exc) from None
        for key, raw in zip(keys, values, strict=True):
            if not isinstance(raw, bytes | str) or not raw:  # an error, or expired between SCAN and GETRANGE
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


def _file_registry(url: str) -> Registry:
    return FileRegistry(unquote(urlsplit(url).path))


# scheme -> the registry of its URLs: the one place that knows every kind (as kv/backends.py and sources/open.py);
# a new kind of registry is one entry here. unix:///path/redis.sock is a Redis on a local socket.
REGISTRIES: dict[str, Callable[[str], Registry]] = {
    "redis": RedisRegistry,
    "rediss": RedisRegistry,
    "unix": RedisRegistry,
    "file": _file_registry,
}


def check_registry(url: str, flag: str = "--registry") -> Callable[[str], Registry]:
    """What opens ``url``'s kind of registry; ``ConfigError`` naming ``flag`` for a URL of no known scheme (checked
    before anything is loaded, as ``preheat serve`` does)."""
    scheme, sep, _ = url.partition("://")
    opener = REGISTRIES.get(scheme) if sep else None
    if opener is None:
        raise ConfigError(f"{flag} {url!r}: use redis://host:port[/db] or file:///shared/dir")
    return opener


def open_registry(url: str) -> Registry:
    """The registry at ``redis://...`` (``rediss://``, ``unix://``) or ``file:///shared/dir``; ``ConfigError`` for
    anything else."""
    return check_registry(url)(url)


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
