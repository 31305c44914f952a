"""``preheat router``: settings, wiring, and the process's life (bind, check replicas, serve until SIGINT/SIGTERM).

``RouterSettings`` is the one source of truth: every flag has a ``PREHEAT_ROUTER_*`` variable; the flag wins, then
the variable, then the default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from preheat.config import resolve_settings
from preheat.errors import ConfigError, RouterError
from preheat.http.server import sigterm_interrupts
from preheat.peer.access import is_loopback
from preheat.router.events import KVEventPoller
from preheat.router.health import HealthChecker
from preheat.router.index import KVIndex
from preheat.router.policies import POLICIES, LoadGuard, make_policy
from preheat.router.prompts import PromptReader
from preheat.router.proxy import Router, RouterHTTPServer
from preheat.router.upstream import Replica, parse_url

log = logging.getLogger("preheat.router")
PREFIX = "PREHEAT_ROUTER_"
SECONDS = (
    "health_interval",
    "health_timeout",
    "kv_poll_interval",
    "index_ttl",
    "kv_snapshot_interval",
    "upstream_timeout",
)


@dataclass(frozen=True)
class RouterSettings:
    """Everything ``preheat router`` needs (docs/router.md has the table of flags and variables)."""

    replicas: tuple[str, ...]
    policy: str = "round-robin"
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None  # tokenizer source for prefix and kv
    chunk_tokens: int = 256  # prefix only: kv uses each replica's published chunk size
    health_interval: float = 1.0
    health_timeout: float = 2.0
    kv_poll_interval: float = 0.25
    guard_gap: int = 2
    hot_in_flight: int = 3
    index_keys: int = 100_000  # per replica: prefix's routed keys; kv's keys per tier
    index_ttl: float = 600.0
    kv_snapshot_interval: float = 60.0  # kv: a replica with an L2 is asked for a full snapshot this often
    upstream_timeout: float = 300.0
    api_key: str | None = None  # what clients must send (Authorization: Bearer); None: the router is open
    # What the router sends the replicas (their --api-key) in place of the client's Authorization, and on its
    # KV-event polls; None: the client's passes through, and polls carry api_key (one key for the whole fleet).
    replica_api_key: str | None = None

    @classmethod
    def resolve(cls, flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> RouterSettings:
        """Settings from ``flags`` (None = not given), else ``PREHEAT_ROUTER_<NAME>``, else the default.

        >>> RouterSettings.resolve({"replicas": None}, {"PREHEAT_ROUTER_REPLICAS": "http://a:1,http://b:2"}).replicas
        ('http://a:1', 'http://b:2')
        """
        values = resolve_settings(cls, flags, env, prefix=PREFIX, parse=_parse)
        if not values.get("replicas"):
            raise ConfigError(f"no replicas: pass --replica URL (repeat it) or set {PREFIX}REPLICAS=URL,URL")
        settings = cls(**values)  # type: ignore[arg-type]  # each value was parsed to its field's type above
        settings.check()
        return settings

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.policy in ("prefix", "kv") and not self.model:
            raise ConfigError(f"--policy {self.policy} tokenizes prompts: pass --model DIR (the replicas' model)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be 0-65535 (0 picks a free port)")
        for number in ("chunk_tokens", "index_keys", "guard_gap", "hot_in_flight"):
            if int(getattr(self, number)) < 1:
                raise ConfigError(f"--{number.replace('_', '-')} must be at least 1")
        for seconds in SECONDS:
            if float(getattr(self, seconds)) <= 0:
                raise ConfigError(f"--{seconds.replace('_', '-')} must be positive")
        for secret in ("api_key", "replica_api_key"):
            value = getattr(self, secret)
            if value is not None and not value.strip():
                raise ConfigError(f"--{secret.replace('_', '-')} is empty: give a key, or leave the flag out")
        for url in self.replicas:
            parse_url(url)
        if len({parse_url(u).url for u in self.replicas}) != len(self.replicas):
            raise ConfigError("the same replica is given twice")


def _parse(name: str, variable: str, raw: str) -> object:
    if name == "replicas":
        return tuple(u.strip() for u in raw.split(",") if u.strip())
    kind = next(f.type for f in fields(RouterSettings) if f.name == name)
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not a number") from None
    return raw


def prefix_fingerprint(model: str, chunk_tokens: int) -> str:
    """The seed of the prefix index's keys: any fixed value works, since only this router compares them."""
    from preheat.kv.keys import fingerprint

    return fingerprint(identity=os.path.realpath(model), layout={"index": "preheat-router"}, chunk_tokens=chunk_tokens)


class RouterService:
    """A router with its background checks: ``start()`` binds and checks, ``serve()`` blocks, ``close()`` ends all."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        replicas = [Replica(url, timeout=settings.upstream_timeout) for url in settings.replicas]
        self.kv_index = KVIndex(max_keys=settings.index_keys, snapshot_interval=settings.kv_snapshot_interval)
        guard = LoadGuard(gap=settings.guard_gap, hot=settings.hot_in_flight)
        needs_model = settings.policy in ("prefix", "kv")
        policy = make_policy(
            settings.policy,
            fingerprint=prefix_fingerprint(settings.model, settings.chunk_tokens) if settings.model else None,
            chunk_tokens=settings.chunk_tokens,
            kv_index=self.kv_index,
            guard=guard,
            index_keys=settings.index_keys,
            index_ttl=settings.index_ttl,
        )
        prompts = PromptReader.from_model(settings.model if needs_model else None)
        self.router = Router(
            replicas, policy, prompts, api_key=settings.api_key, replica_api_key=settings.replica_api_key
        )
        self.health = HealthChecker(
            replicas, self.router.set_health, interval=settings.health_interval, timeout=settings.health_timeout
        )
        self.poller = (
            KVEventPoller(
                replicas,
                self.kv_index,
                interval=settings.kv_poll_interval,
                api_key=settings.replica_api_key or settings.api_key,
            )
            if settings.policy == "kv"
            else None
        )
        try:
            self.httpd = RouterHTTPServer((settings.host, settings.port), self.router)
        except OSError as exc:
            raise RouterError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None

    @property
    def url(self) -> str:
        host, port = self.httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Learn who is up (and, for ``kv``, what their caches hold) before the first request, then keep checking."""
        self.health.tick_all()
        self.health.start()
        if self.poller is not None:
            self.poller.tick_all()
            self.poller.start()

    def serve(self) -> None:
        self.httpd.serve_forever(poll_interval=0.25)

    def close(self) -> None:
        self.health.stop()
        if self.poller is not None:
            self.poller.stop()
        self.httpd.server_close()
        for replica in self.router.replicas:
            replica.close_idle()


def run(flags: Mapping[str, object], announce: Callable[[str], None] | None = None) -> int:
    """Run the router with ``flags`` until SIGINT/SIGTERM; returns the exit code."""
    say = announce or (lambda line: print(line, flush=True))
    settings = RouterSettings.resolve(flags)
    service = RouterService(settings)
    try:
        with sigterm_interrupts():
            service.start()
            up = sum(r.healthy for r in service.router.replicas)
            say(
                f"preheat router: listening on {service.url} (policy {settings.policy}, "
                f"{up}/{len(settings.replicas)} replicas healthy)"
            )
            if not settings.api_key and not is_loopback(settings.host):
                say(f"preheat router: warning: {settings.host} is reachable from other hosts and no --api-key is set")
            service.serve()
    except KeyboardInterrupt:
        say("preheat router: shutting down")
    finally:
        service.close()
    return 0
