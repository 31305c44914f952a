"""``RouterSettings``: the one source of truth for ``preheat router``: each field declares its flag and its
``PREHEAT_ROUTER_*`` variable (``core.config.option``; ``preheat.cli.flags`` makes the flags from them). The flag
wins, then the variable, then the default.

Cheap to import (the replica specs, policies and Kubernetes URLs are parsed by modules imported when a check needs
them): every ``preheat`` command line that builds the router's flags imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preheat.core import env
from preheat.core.config import option, parse_size, resolve_settings, settings
from preheat.core.errors import ConfigError

if TYPE_CHECKING:
    from preheat.http.tls import TLSFiles

POLICIES = ("round-robin", "least-load", "session", "prefix", "kv")
FROM_REPLICAS = "@replicas"  # --model @replicas: the tokenizer is asked of the replicas at start
MAX_WORKERS = 256  # --workers: a bound on processes started, far past any core count that helps
SECONDS = (
    "health_interval",
    "health_timeout",
    "kv_poll_interval",
    "index_ttl",
    "kv_snapshot_interval",
    "upstream_timeout",
    "activation_timeout",
    "header_timeout",
)


def _replica_specs(text: str) -> tuple[str, ...]:
    """``PREHEAT_ROUTER_REPLICAS``: comma-separated, an ``events=``/``replay=`` item belonging to the URL before it."""
    from preheat.router.upstream import join_replica_specs

    return join_replica_specs(text.split(","))


@settings(prefix="PREHEAT_ROUTER_", command="router")
@dataclass(frozen=True)
class RouterSettings:
    """Everything ``preheat router`` needs (docs/router.md has the table of flags and variables)."""

    # Each ``URL[,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT]]`` (upstream.parse_replica_spec): with events=, an
    # engine replica (vLLM, SGLang) whose ZMQ KV events feed policy kv.
    replicas: tuple[str, ...] = field(
        metadata=option(
            "http://host:port; an engine replica may carry its KV events: URL,events=tcp://H:P,replay=tcp://H:P",
            flag="--replica",
            metavar="URL",
            parse=_replica_specs,
            value="URL,URL",
        )
    )
    # k8s://NAMESPACE/SERVICE[?port=NAME]: the replicas are that Service's ready endpoints, followed as they change
    # (k8s/discovery.py); beside any --replica given.
    replicas_from: str | None = field(
        default=None,
        metadata=option(
            "the ready pods behind a Kubernetes Service are the replicas, followed as they come and go "
            "(its EndpointSlices; needs the k8s extra and list/watch on endpointslices)",
            metavar="k8s://NAMESPACE/SERVICE[?port=NAME]",
        ),
    )
    # What an EndpointSlice must be for its endpoints to become replicas (k8s/slices.py, SliceRules): the
    # controller's, IP literals, never loopback or link-local unless a pod CIDR that is such a range names them.
    pod_cidr: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "--replicas-from: only endpoints inside this network are replicas (repeatable; the cluster's pod CIDR, "
            "e.g. 10.244.0.0/16); loopback and link-local ones only where a CIDR inside that range names them",
            metavar="CIDR",
            default_text="any address but loopback, link-local, multicast and unspecified",
        ),
    )
    max_slice_endpoints: int = field(
        default=1000,
        metadata=option(
            "--replicas-from: an EndpointSlice with more endpoints is refused whole (the API server's own limit)",
            metavar="N",
        ),
    )
    max_discovered_replicas: int = field(
        default=1000,
        metadata=option(
            "--replicas-from: replicas followed at most; past it the known ones stay and new ones wait for room",
            metavar="N",
        ),
    )
    policy: str = field(default="round-robin", metadata=option("routing policy", choices=POLICIES))
    # Tokenizer source for kv (prefix reads prompts as text): a directory, or FROM_REPLICAS.
    model: str | None = field(
        default=None,
        metadata=option(
            f"the replicas' model directory, for its tokenizer; {FROM_REPLICAS}: ask the replicas for theirs",
            metavar="MODEL",
        ),
    )
    # prefix (C tokens' worth of text, 4 bytes a token) and kv's own keys of what it routed: kv reads each
    # replica's published chunk size for its events. The replicas' --kv-chunk-tokens: one name for one chunk size
    # (`up` gives the replicas the same value).
    kv_chunk_tokens: int = field(
        default=256,
        metadata=option(
            "prefix: tokens per chunk key (of text: 4 bytes a token)", metavar="C", renamed=("--chunk-tokens",)
        ),
    )
    # prefix, kv: a prompt is read only as far as routing can use it (no replica serves a longer one), with no
    # lock between requests (router/prompts.py). None: the model's context window (config.json), else 131072.
    max_prompt_tokens: int | None = field(
        default=None,
        metadata=option(
            "prefix, kv: route on at most a prompt's first N tokens (a longer prompt is read no further)",
            metavar="N",
            default_text="kv: the model's context window (its config.json), else 131072; prefix: 131072",
        ),
    )
    guard_gap: int = field(default=2, metadata=option("in-flight gap that forces least-load"))
    hot_in_flight: int = field(default=3, metadata=option("in flight that spreads a hot prefix"))
    # kv before a replica that generates one sequence at a time (router/hold.py): its requests past that wait at the
    # router and go cheapest first (by response ratio); off, each goes at once and the replica serves them in order.
    hold: bool = field(
        default=True,
        metadata=option(
            "kv: send every request at once, first come first served at the replica (PREHEAT_ROUTER_HOLD=0)",
            flag="--no-hold",
            default_text="hold what a replica cannot start yet, cheapest first",
        ),
    )
    # kv's held requests: a replica fallen idle takes the one held elsewhere that gains most by moving (hold.py).
    steal: bool = field(
        default=True,
        metadata=option(
            "kv: a held request stays at the replica it was routed to (PREHEAT_ROUTER_STEAL=0)",
            flag="--no-steal",
            default_text="an idle replica takes a held request that gains by moving",
        ),
    )
    # Per replica: prefix's routed keys; kv's keys per tier.
    index_keys: int = field(default=100_000, metadata=option("keys kept per replica (prefix), per tier (kv)"))
    index_ttl: float = field(default=600.0, metadata=option("prefix: seconds a key is remembered"))
    health_interval: float = field(default=1.0, metadata=option("seconds between health checks"))
    health_timeout: float = field(default=2.0, metadata=option("seconds a health check may take"))
    kv_poll_interval: float = field(default=0.25, metadata=option("kv: seconds between event polls"))
    # kv: a replica with an L2 is asked for a full snapshot this often.
    kv_snapshot_interval: float = field(default=60.0, metadata=option("kv: seconds between full snapshots of an L2"))
    upstream_timeout: float = field(default=300.0, metadata=option("seconds to wait on a replica"))
    # What a replica may make the router hold (router/proxy.py): over it, the request ends with a clear error,
    # counted in preheat_router_errors_total (answer_too_large, event_too_large).
    max_answer_bytes: str = field(
        default="64MiB", metadata=option("a non-streaming answer longer than this is a 502", metavar="SIZE")
    )
    max_event_bytes: str = field(
        default="16MiB", metadata=option("a server-sent event longer than this ends its stream", metavar="SIZE")
    )
    # Every server's bounds (preheat.http.server): connections, and time for a request's headers.
    # An idle connection on the router's event loop (aioproxy.py) costs a socket and a few KiB, not a thread.
    max_connections: int = field(
        default=16384, metadata=option("open client connections at most; one more is answered 503", metavar="N")
    )
    header_timeout: float = field(
        default=10.0, metadata=option("seconds a request's line and headers may take to arrive", metavar="S")
    )
    host: str = field(default="127.0.0.1", metadata=option("address to bind; any other than loopback needs --api-key"))
    port: int = field(default=8080, metadata=option("port; 0 picks a free one"))
    # Router processes on the one port (router/workers.py): the kernel spreads new connections across them
    # (SO_REUSEPORT), each process its own event loop on its own core.
    workers: int = field(
        default=1,
        metadata=option(
            "router processes sharing the port, each on its own event loop: one per core the router may use; each "
            "keeps its own view of load and learnt prefixes unless --shared-state shares one",
            metavar="N",
        ),
    )
    # TLS (docs/security.md, *TLS*): the router's listener serves https with its certificate; https replicas are
    # verified with the system's CAs and ssl_ca_certs (the fleet's CA), and offered the certificate if they ask.
    ssl_certfile: str | None = field(
        default=None, metadata=option("serve https with this PEM certificate chain", metavar="FILE")
    )
    ssl_keyfile: str | None = field(
        default=None, metadata=option("the certificate's private key (PEM)", metavar="FILE")
    )
    ssl_ca_certs: str | None = field(
        default=None,
        metadata=option("the CA (PEM) of https replicas' certificates, trusted beside the system's", metavar="FILE"),
    )
    dashboard_session_ttl: int = field(
        default=12 * 3600,
        metadata=option("seconds a /dashboard login lasts", metavar="S", default_text="43200: 12 h"),
    )
    # What clients must send (Authorization: Bearer); None: the router is open.
    api_key: str | None = field(
        default=None,
        metadata=option("require 'Authorization: Bearer KEY'", metavar="KEY", variable=env.ROUTER_API_KEY),
    )
    # What the router sends the replicas (their --api-key) in place of the client's Authorization, and on its
    # KV-event polls; None: the client's passes through, and polls carry api_key (one key for the whole fleet).
    replica_api_key: str | None = field(
        default=None,
        metadata=option(
            "the replicas' --api-key, sent to them in place of the client's (prefer the variable: a command line "
            "is visible to all)",
            metavar="KEY",
        ),
    )
    # What the router sends the replicas (their --admin-key) on its own activations and wakes, and only there: the
    # router forwards no control route (preheat.http.control), so no client ever borrows it.
    replica_admin_key: str | None = field(
        default=None,
        metadata=option(
            "the replicas' --admin-key, sent only when the router itself activates a --standby or wakes a sleeping "
            "replica (prefer the variable)",
            metavar="KEY",
            default_text="none: the replicas' control routes must be open to this host (no key on them)",
        ),
    )
    # Cold capacity (docs/router.md, *Standby and sleeping replicas*): standby replicas the router may activate with
    # standby_model (served as served_model_name), sleeping replicas it may wake (wake), when no replica is in
    # rotation or every one has saturation requests in flight; a cold start may take activation_timeout seconds.
    standby: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "a `preheat serve --standby` replica the router may activate when it needs capacity (repeat it)",
            metavar="URL",
        ),
    )
    standby_model: str | None = field(
        default=None,
        metadata=option(
            "what a standby is told to load: a directory or URI its --allow-model allows",
            metavar="MODEL",
            default_text="--model DIR",
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=option(
            "the name an activated standby serves the model under",
            metavar="NAME",
            default_text="MODEL's last path part",
        ),
    )
    saturation: int = field(
        default=3,
        metadata=option(
            "a replica with N or more requests in flight through the router is saturated; all saturated: bring up "
            "a standby or sleeping replica",
            metavar="N",
        ),
    )
    activation_timeout: float = field(
        default=300.0,
        metadata=option(
            "seconds an activation or a wake may take; a request with no replica waits as long", metavar="S"
        ),
    )
    wake: bool = field(
        default=True,
        metadata=option(
            "never wake a sleeping replica (PREHEAT_ROUTER_WAKE=0)",
            flag="--no-wake",
            default_text="wake one when capacity is needed",
        ),
    )
    # Idle replicas put to sleep (router/sleeping.py): preheat's and vLLM's (dev mode; CUDA frees memory), woken
    # again as cold capacity; sleep_keep replicas always stay in rotation.
    sleep_idle: float | None = field(
        default=None,
        metadata=option(
            "put a replica that had no request for S seconds to sleep (preheat: POST /v1/preheat/sleep; vLLM: "
            "POST /sleep, its dev mode); it is woken again when capacity is needed",
            metavar="S",
            default_text="never",
        ),
    )
    sleep_level: int = field(
        default=1,
        metadata=option(
            "--sleep-idle's level: 1 keeps the weights in host memory, 2 drops them (vLLM: reloaded from the "
            "checkpoint on wake)",
            metavar="1|2",
        ),
    )
    sleep_keep: int = field(
        default=1,
        metadata=option("--sleep-idle never leaves fewer than N replicas in rotation", metavar="N"),
    )
    # Live weight updates (docs/refit.md): send requests only to the replicas on the newest weights version their
    # /health reports (replicas started with --follow), so no client sees an older version once one has the new.
    newest_version: bool = field(
        default=False,
        metadata=option("route only to replicas on the newest weights version (--follow replicas; docs/refit.md)"),
    )

    # Several routers, one view (docs/router.md, *Several routers*): learnt prefixes, in-flight counts and ejections
    # shared through one Redis stream per fleet (router/shared_redis.py); None: this router's view is its own.
    shared_state: str | None = field(
        default=None,
        metadata=option(
            "share what this router learns (prompts' prefixes, load, ejections) with the other routers of the fleet "
            "through this Redis: redis://[:PASSWORD@]HOST:PORT/DB or rediss://... (prefer the variable when it "
            "carries a password)",
            metavar="URL",
            default_text="none: this router's view is its own",
        ),
    )
    shared_fleet: str = field(
        default="default",
        metadata=option(
            "--shared-state: the fleet's name; routers with the same Redis and name share one view", metavar="NAME"
        ),
    )

    @classmethod
    def resolve(cls, flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> RouterSettings:
        """Settings from ``flags`` (None = not given), else ``PREHEAT_ROUTER_<NAME>`` in ``env`` (default: this
        process's environment), else the default; then ``check()``.

        >>> RouterSettings.resolve({"replicas": None}, {"PREHEAT_ROUTER_REPLICAS": "http://a:1,http://b:2"}).replicas
        ('http://a:1', 'http://b:2')
        """
        values = resolve_settings(cls, flags, env)
        if not values.get("replicas") and not values.get("standby") and not values.get("replicas_from"):
            raise ConfigError(
                "no replicas: pass --replica URL (repeat it) or set PREHEAT_ROUTER_REPLICAS=URL,URL "
                "(or give standby replicas: --standby URL --standby-model MODEL, "
                "or a Kubernetes Service: --replicas-from k8s://NAMESPACE/SERVICE)"
            )
        values.setdefault("replicas", ())
        resolved = cls(**values)  # type: ignore[arg-type]  # each value was parsed to its field's type above
        resolved.check()
        return resolved

    def check(self) -> None:
        from preheat.http.control import is_loopback
        from preheat.k8s.slices import parse_k8s_url
        from preheat.router.upstream import parse_replica_spec, parse_url

        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.policy == "kv" and not self.model:
            raise ConfigError(
                "--policy kv tokenizes prompts: pass --model DIR (the replicas' model), "
                f"or --model {FROM_REPLICAS} to ask the replicas for their tokenizer"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be 0-65535 (0 picks a free port)")
        for number in ("kv_chunk_tokens", "index_keys", "guard_gap", "hot_in_flight", "saturation"):
            if int(getattr(self, number)) < 1:
                raise ConfigError(f"--{number.replace('_', '-')} must be at least 1")
        for seconds in SECONDS:
            if float(getattr(self, seconds)) <= 0:
                raise ConfigError(f"--{seconds.replace('_', '-')} must be positive")
        self.check_bounds()
        self.check_listeners()
        if not self.api_key and not is_loopback(self.host):
            raise ConfigError(
                f"--host {self.host or '*'} without a key would let anyone who reaches the router use the replicas: "
                "set PREHEAT_ROUTER_API_KEY (or --api-key) to a secret its clients send as 'Authorization: Bearer "
                "KEY', or bind to loopback (--host 127.0.0.1)"
            )
        for secret in ("api_key", "replica_api_key", "replica_admin_key"):
            value = getattr(self, secret)
            if value is not None and not value.strip():
                raise ConfigError(f"--{secret.replace('_', '-')} is empty: give a key, or leave the flag out")
        urls = [parse_replica_spec(spec).url for spec in self.replicas] + [parse_url(u).url for u in self.standby]
        if len(set(urls)) != len(urls):
            raise ConfigError("the same replica is given twice")
        self._check_discovery()
        if self.replicas_from is not None:
            parse_k8s_url(self.replicas_from)
            if self.model == FROM_REPLICAS and not self.replicas:
                raise ConfigError(
                    f"--model {FROM_REPLICAS} asks the --replica URLs for their tokenizer at start, and "
                    "--replicas-from finds its replicas later: pass --model DIR (the model's directory)"
                )
        self.check_sleep()
        self.check_shared()
        if self.standby and not self.activation_model:
            raise ConfigError(
                "--standby replicas need the model to activate them with: pass --standby-model MODEL (a directory or "
                "URI each standby's --allow-model allows), or --model DIR"
            )

    def check_sleep(self) -> None:
        """--sleep-idle positive when given, a level vLLM and preheat both have, a keep that is a count."""
        if self.sleep_idle is not None and self.sleep_idle <= 0:
            raise ConfigError(f"--sleep-idle {self.sleep_idle}: must be positive (leave it out to never sleep)")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"--sleep-level {self.sleep_level}: must be 1 or 2")
        if self.sleep_keep < 0:
            raise ConfigError(f"--sleep-keep {self.sleep_keep}: must be at least 0")

    def check_shared(self) -> None:
        """--shared-state a redis:// or rediss:// URL its client would take, --shared-fleet a plain name."""
        import re

        from preheat.kv.backends import check_url

        shared = self.shared_state
        if shared is not None and check_url(shared, "--shared-state").scheme not in ("redis", "rediss"):
            raise ConfigError("--shared-state: give a Redis URL (redis://HOST:PORT/DB or rediss://...)")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.shared_fleet):
            raise ConfigError(f"--shared-fleet {self.shared_fleet!r}: 1-64 letters, digits, '.', '_' or '-'")

    def check_listeners(self) -> None:
        """TLS files that load (a CA alone verifies https replicas), and a dashboard login that lasts."""
        self.tls.check(ca_alone=True)
        if self.dashboard_session_ttl < 1:
            raise ConfigError(f"--dashboard-session-ttl {self.dashboard_session_ttl}: at least 1 second")

    def check_bounds(self) -> None:
        """The bounds on what clients and replicas make the router hold: each at least 1, sizes that parse."""
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections {self.max_connections}: must be at least 1")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"--workers {self.workers}: 1-{MAX_WORKERS} (more than one per core does not help)")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens {self.max_prompt_tokens}: must be at least 1")
        for size in ("max_answer_bytes", "max_event_bytes"):
            if parse_size(getattr(self, size)) < 1:  # a ConfigError naming the text when it is not a size
                raise ConfigError(f"--{size.replace('_', '-')} must be at least 1 byte")

    @property
    def tls(self) -> TLSFiles:
        """The router's TLS files: its listener's certificate, and the CA its https replicas are verified with."""
        from preheat.http.tls import TLSFiles  # standard library only

        return TLSFiles(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)

    def _check_discovery(self) -> None:
        """The EndpointSlice rules (k8s/slices.py, ``SliceRules``) make sense."""
        from preheat.k8s.slices import parse_cidr

        for number in ("max_slice_endpoints", "max_discovered_replicas"):
            if int(getattr(self, number)) < 1:
                raise ConfigError(f"--{number.replace('_', '-')} must be at least 1")
        for cidr in self.pod_cidr:
            parse_cidr(cidr)

    @property
    def activation_model(self) -> str | None:
        """What a standby is told to load: ``standby_model``, else ``model`` when it is a directory."""
        if self.standby_model:
            return self.standby_model
        return self.model if self.model and self.model != FROM_REPLICAS else None
