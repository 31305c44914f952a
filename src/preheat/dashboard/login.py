"""Who is logged in to a dashboard: random sessions held by the server (signed ones where several processes serve
it: ``SignedSessions``), and a brake on guessing the key.

- **Sessions** (``Sessions``): a login that gives the right key gets a random session id (256 bits) for its cookie.
  The server keeps the ids (their SHA-256, so a lookup's timing says nothing about a stored id) with an expiry
  (``--dashboard-session-ttl``, 12 h by default), at most ``max_sessions`` of them (the oldest go first). The
  cookie is worth nothing once expired, nor after a restart, and never tells anything about the key.
- **Throttling** (``Throttle``): a token bucket per client address. Each wrong key takes a token; with none left,
  logins from that address are refused (429, ``Retry-After``) until one has grown back. ``burst`` wrong keys in a
  row are allowed, then one per ``refill_s`` seconds: guessing a key by the login form is hopeless, and the owner
  who mistyped waits a minute. At most ``max_clients`` addresses are remembered (a full bucket is forgotten first).

Pure logic over a clock (``time.monotonic`` unless a test gives another), used by ``preheat.dashboard.web``.

>>> clock = [0.0]
>>> sessions = Sessions(ttl_s=60, clock=lambda: clock[0])
>>> sid = sessions.new()
>>> sessions.valid(sid), sessions.valid("guess")
(True, False)
>>> clock[0] = 61.0
>>> sessions.valid(sid)
False
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

SESSION_TTL_S = 12 * 3600
MAX_SESSIONS = 1024
BURST = 5  # wrong keys in a row before an address is slowed down
REFILL_S = 60.0  # then one more try per minute
MAX_CLIENTS = 4096
Clock = Callable[[], float]


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8", "replace")).digest()


class Sessions:
    """Live session ids, each until its expiry; thread-safe."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS, clock: Clock = time.monotonic):
        self.ttl_s, self.max_sessions, self.clock = ttl_s, max_sessions, clock
        self._expiry: OrderedDict[bytes, float] = OrderedDict()  # by creation: the oldest first
        self._lock = threading.Lock()

    def new(self) -> str:
        """A fresh session id (URL- and cookie-safe), valid for ``ttl_s`` seconds."""
        session_id = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._expire(now)
            while len(self._expiry) >= self.max_sessions:
                self._expiry.popitem(last=False)
            self._expiry[_digest(session_id)] = now + self.ttl_s
        return session_id

    def valid(self, session_id: str) -> bool:
        """Whether ``session_id`` is a live session."""
        now = self.clock()
        with self._lock:
            expiry = self._expiry.get(_digest(session_id))
            if expiry is None:
                return False
            if expiry <= now:
                del self._expiry[_digest(session_id)]
                return False
            return True

    def __len__(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._expiry)

    def _expire(self, now: float) -> None:
        # Creation order is expiry order (one TTL for all): the expired are at the front.
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)


class SignedSessions:
    """Sessions several processes of one server honour alike (``preheat router --workers N``): an id is an expiry
    and a random nonce signed with ``key`` (HMAC-SHA256), which every process of the server holds and nothing else
    does (made at start, handed to the processes over their start pipe, never written anywhere). Nothing is stored:
    a cookie is worth nothing once expired or after a restart (a new key), as with ``Sessions``.

    >>> clock = [100.0]
    >>> a, b = SignedSessions(b"k" * 32, 60, lambda: clock[0]), SignedSessions(b"k" * 32, 60, lambda: clock[0])
    >>> sid = a.new()
    >>> b.valid(sid), SignedSessions(b"x" * 32, 60).valid(sid), b.valid(sid[:-1] + "A")
    (True, False, False)
    >>> clock[0] = 161.0
    >>> b.valid(sid)
    False
    """

    def __init__(self, key: bytes, ttl_s: float = SESSION_TTL_S, clock: Clock = time.time) -> None:
        # time.time, not monotonic: the processes compare expiries they did not write themselves.
        self.key, self.ttl_s, self.clock = key, ttl_s, clock

    def _mac(self, payload: str) -> str:
        return hmac.new(self.key, payload.encode("ascii"), hashlib.sha256).hexdigest()

    def new(self) -> str:
        payload = f"{int(self.clock() + self.ttl_s)}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._mac(payload)}"

    def valid(self, session_id: str) -> bool:
        payload, _, mac = session_id.rpartition(".")
        expiry, _, _nonce = payload.partition(".")
        if not payload.isascii() or not expiry.isdigit() or len(session_id) > 200:
            return False
        return hmac.compare_digest(mac, self._mac(payload)) and int(expiry) > self.clock()


@dataclass
class _Bucket:
    tokens: float
    stamp: float


@dataclass
class Throttle:
    """Wrong keys per client address, as token buckets (see the module docstring); thread-safe."""

    burst: int = BURST
    refill_s: float = REFILL_S
    max_clients: int = MAX_CLIENTS
    clock: Clock = time.monotonic
    _buckets: OrderedDict[str, _Bucket] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self, client: str) -> float | None:
        """Seconds ``client`` must wait before its next login is heard, or None when it may try now."""
        with self._lock:
            bucket = self._refilled(client, self.clock())
            if bucket is None or bucket.tokens >= 1:
                return None
            return (1 - bucket.tokens) * self.refill_s

    def failed(self, client: str) -> None:
        """``client`` gave a wrong key: one token less."""
        now = self.clock()
        with self._lock:
            bucket = self._refilled(client, now)
            if bucket is None:
                self._forget_one()
                bucket = self._buckets[client] = _Bucket(float(self.burst), now)
            bucket.tokens = max(bucket.tokens - 1, 0.0)
            self._buckets.move_to_end(client)

    def _refilled(self, client: str, now: float) -> _Bucket | None:
        bucket = self._buckets.get(client)
        if bucket is not None:
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) / self.refill_s)
            bucket.stamp = now
        return bucket

    def _forget_one(self) -> None:
        """Room for one more address: a full bucket (it says nothing) or else the least recently failed."""
        if len(self._buckets) < self.max_clients:
            return
        now = self.clock()
        for client in list(self._buckets):
            bucket = self._refilled(client, now)
            if bucket is not None and bucket.tokens >= self.burst:
                del self._buckets[client]
                return
        self._buckets.popitem(last=False)


@dataclass
class Login:
    """A dashboard's sessions and its login throttle: one per server."""

    sessions: Sessions | SignedSessions = field(default_factory=Sessions)
    throttle: Throttle = field(default_factory=Throttle)

    @classmethod
    def lasting(cls, ttl_s: float, key: bytes | None = None) -> Login:
        """Sessions that last ``ttl_s`` seconds (signed with ``key``, shared by a server's processes, when given),
        the default throttle."""
        return cls(SignedSessions(key, ttl_s) if key is not None else Sessions(ttl_s))
