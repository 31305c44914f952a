"""``ServeSettings``: the one source of truth for ``preheat serve``: each field declares its flag and its
``PREHEAT_*`` variable (``core.config.option``; ``preheat.cli.flags`` makes the flags from them).

Precedence: a flag given on the command line, then its environment variable, then the default. Values are checked
here, before the socket is bound, so a typo fails in milliseconds instead of after a model load. Cheap to import
(the node cache and the KV tiers are imported when a check needs them): every ``preheat`` command line that builds
serve's flags imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from preheat.core import env
from preheat.core.config import option, resolve_settings, settings
from preheat.core.errors import ConfigError
from preheat.kv.keys import KV_DTYPES  # pure and torch-free (xxhash only): cheap before the bind
from preheat.sources.base import REMOTE_SCHEMES as SOURCE_SCHEMES
from preheat.sources.peer_uri import SCHEME as PEER_SCHEME
from preheat.sources.peer_uri import peer_name

if TYPE_CHECKING:
    from preheat.http.tls import TLSFiles
    from preheat.kv.settings import KVSettings

DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32")
REMOTE_SCHEMES = (*SOURCE_SCHEMES, PEER_SCHEME)  # pulled into the node cache first: sources, and names peers hold
KV = "KV tiers (docs/kv-cache.md; off unless --kv-l1 or --kv-l2 is given)"
PEERS = "peers (docs/peer.md)"
STANDBY = "standby, sleep and wake (docs/server.md, *Standby replicas*)"
REFIT = "live weight updates (docs/refit.md)"
TLS = "TLS (docs/security.md, *TLS*)"


@settings(prefix="PREHEAT_", command="serve")
@dataclass(frozen=True)
class ServeSettings:
    """Everything ``preheat serve`` needs to start. ``None`` means "ask the checkpoint" (dtype, context length)."""

    model: str = field(
        metadata=option("checkpoint directory, node-cache entry name, or http(s)://, s3:// URI", flag="", value="MODEL")
    )
    host: str = field(default="127.0.0.1", metadata=option("address to bind; the default is this machine only"))
    port: int = field(default=8000, metadata=option("port; 0 picks a free one"))
    device: str = field(default="cpu", metadata=option("cpu or cuda[:N]"))
    dtype: str | None = field(
        default=None, metadata=option("compute dtype: auto, bf16, fp16 or fp32", metavar="DTYPE", default_text="auto")
    )
    max_model_len: int | None = field(default=None, metadata=option("context length", default_text="the model's"))
    served_model_name: str | None = field(
        default=None,
        metadata=option(
            "name in 'model'",
            metavar="NAME",
            default_text="a node-cache entry's name, with its key as an alias; else MODEL's last part",
        ),
    )
    max_queue: int = field(default=16, metadata=option("requests waiting before 429"))
    # Every server's bounds (preheat.http.server): threads for connections, and time for a request's headers.
    max_connections: int = field(
        default=512, metadata=option("open client connections at most; one more is answered 503", metavar="N")
    )
    header_timeout: float = field(
        default=10.0, metadata=option("seconds a request's line and headers may take to arrive", metavar="S")
    )
    api_key: str | None = field(
        default=None,
        metadata=option(
            "require 'Authorization: Bearer KEY' on /v1/* but the control routes", metavar="KEY", variable=env.API_KEY
        ),
    )
    # The control routes' own key (load, sleep, wake, refit: preheat.http.control); the API key never grants them.
    admin_key: str | None = field(
        default=None,
        metadata=option(
            "require 'Authorization: Bearer KEY' on the control routes (load, sleep, wake, refit); prefer the variable",
            metavar="KEY",
            variable=env.ADMIN_KEY,
            default_text="none: control only from this host, bound to loopback, without --api-key",
        ),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=option("node cache for URIs", metavar="DIR", default_text="~/.cache/preheat", variable=env.CACHE_DIR),
    )
    # TLS on every listener of the replica (API, peer, refit: one certificate per node); with the fleet's CA, the
    # peer and refit listeners require client certificates signed by it, and pulls from peers are https.
    ssl_certfile: str | None = field(
        default=None,
        metadata=option(
            "serve https on every listener with this PEM certificate chain",
            metavar="FILE",
            group=TLS,
            variable=env.SSL_CERTFILE,
        ),
    )
    ssl_keyfile: str | None = field(
        default=None,
        metadata=option("the certificate's private key (PEM)", metavar="FILE", group=TLS, variable=env.SSL_KEYFILE),
    )
    ssl_ca_certs: str | None = field(
        default=None,
        metadata=option(
            "the fleet's CA (PEM): peer and refit listeners require client certificates it signed (mutual TLS)",
            metavar="FILE",
            group=TLS,
            variable=env.SSL_CA_CERTS,
        ),
    )
    # How long a dashboard login lasts (docs/dashboard.md): the session id is the server's, forgotten at a restart.
    dashboard_session_ttl: int = field(
        default=12 * 3600,
        metadata=option("seconds a /dashboard login lasts", metavar="S", default_text="43200: 12 h"),
    )
    # KV tiers (docs/kv-cache.md): L1 host memory (bytes or % of RAM), L2 fs:///dir or redis://host:port/db.
    kv_l1: str | None = field(
        default=None, metadata=option("host-memory tier: 8GiB or 20% of RAM", metavar="SIZE", group=KV)
    )
    kv_l2: str | None = field(
        default=None, metadata=option("shared tier: fs:///dir or redis://host:port/db", metavar="URL", group=KV)
    )
    kv_l2_max_bytes: str | None = field(
        default=None, metadata=option("fs:// L2 quota, LRU across processes", metavar="SIZE", group=KV)
    )
    kv_l2_ttl: int = field(
        default=24 * 3600,
        metadata=option("redis:// L2 expiry after a hit, seconds", metavar="S", group=KV, default_text="86400: a day"),
    )
    kv_dtype: str = field(default="auto", metadata=option("how chunks are stored", choices=KV_DTYPES, group=KV))
    kv_chunk_tokens: int = field(default=256, metadata=option("tokens per chunk", metavar="C", group=KV))
    # The fleet's MAC secret: replicas load only L2 chunks signed with it.
    kv_secret_file: str | None = field(
        default=None,
        metadata=option("fleet secret: load only L2 chunks signed with it (MAC)", metavar="FILE", group=KV),
    )
    # Before /health says ok: L2's hottest chunks into L1 (a size, or all).
    kv_warm: str | None = field(
        default=None,
        metadata=option("load L2's hottest chunks (SIZE or all) into L1 before ready", metavar="SIZE", group=KV),
    )
    # Peers (docs/peer.md): serve the loaded checkpoint to new replicas, find peers for preheat:// models, and ship
    # torch.compile artifacts between them.
    peer: bool = field(default=False, metadata=option("serve the weights to new replicas once loaded", group=PEERS))
    peer_port: int = field(default=0, metadata=option("peer server port; 0 picks a free one", metavar="N", group=PEERS))
    # None: the API's --host; beyond loopback the peer server needs peer_token.
    peer_host: str | None = field(
        default=None,
        metadata=option(
            "peer server address; beyond loopback it needs PREHEAT_PEER_TOKEN",
            metavar="ADDR",
            group=PEERS,
            default_text="--host",
        ),
    )
    peer_token: str | None = field(
        default=None,
        metadata=option(
            "shared token peers require (prefer the variable: `ps` shows command lines to everyone)",
            metavar="TOKEN",
            group=PEERS,
            variable=env.PEER_TOKEN,
        ),
    )
    peer_max_mbps: float | None = field(
        default=None, metadata=option("total outbound cap, MB/s", metavar="MBPS", group=PEERS)
    )
    registry: str | None = field(
        default=None,
        metadata=option(
            "redis://host:port[/db] or file:///shared/dir", metavar="URL", group=PEERS, variable=env.REGISTRY
        ),
    )
    origin: str | None = field(
        default=None,
        metadata=option("where a preheat:// model falls back to", metavar="URI", group=PEERS, variable=env.ORIGIN),
    )
    compile: bool = field(default=False, metadata=option("torch.compile, with artifacts from peers", group=PEERS))
    # Public keys whose signatures make peers' compiled artifacts installable (compiled artifacts are code).
    trust_key: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "install peers' compiled artifacts signed by this public key (repeatable; `preheat artifacts keygen`)",
            metavar="FILE",
            group=PEERS,
            variable=env.TRUST_KEY,
        ),
    )
    # Standby (docs/server.md, *Standby replicas*): start without a model, load one on POST /v1/preheat/load.
    standby: bool = field(
        default=False,
        metadata=option(
            "start without a model: imports, thread pools and listener ready; POST /v1/preheat/load to serve one",
            group=STANDBY,
        ),
    )
    # Glob patterns of the models the control routes may load (preheat.server.allow); () = MODEL only.
    allow_model: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "models the control routes may load, e.g. 's3://models/*' (repeatable)",
            metavar="GLOB",
            group=STANDBY,
            default_text="MODEL only",
        ),
    )
    # Live weight updates (docs/refit.md): follow the versions a trainer publishes under the served name; refuse
    # requests while more than max_staleness versions behind.
    follow: bool = field(
        default=False,
        metadata=option(
            "follow the versions a trainer publishes (`preheat.refit.Publisher`) via --registry; swap them in live",
            group=REFIT,
        ),
    )
    max_staleness: int | None = field(
        default=None,
        metadata=option(
            "with --follow: refuse requests (503) while more than K published versions behind", metavar="K", group=REFIT
        ),
    )
    # Seconds a version's pull may take before the replica gives it up.
    refit_deadline: float = field(
        default=120.0,
        metadata=option(
            "with --follow: give up a version's pull after S seconds, stay on the one served", metavar="S", group=REFIT
        ),
    )
    # Public keys whose signatures make a version applicable (preheat.refit.trust); none: unsigned versions, from
    # holders on this machine only, and --follow with a registry or refit server beyond loopback refuses to start.
    refit_trust_key: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "with --follow: apply only versions signed by this public key (repeatable; `preheat artifacts keygen`)",
            metavar="FILE",
            group=REFIT,
            default_text="none: unsigned versions from this machine only",
        ),
    )
    # A signed version this far past the one served is refused: one mistyped number would pin every follower.
    refit_max_jump: int = field(
        default=1_000_000,
        metadata=option("with --follow: refuse a version more than N past the one served", metavar="N", group=REFIT),
    )

    @classmethod
    def resolve(cls, flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> ServeSettings:
        """Settings from ``flags`` (missing, ``None`` or ``[]`` = not given), else ``PREHEAT_<NAME>`` in ``env``
        (default: this process's environment; ``PREHEAT_CACHE_DIR`` is shared with ``preheat pull`` and the cache),
        else the defaults; then ``check()``.

        >>> ServeSettings.resolve({"model": "/tmp", "port": None}, {"PREHEAT_PORT": "9000"}).port
        9000
        """
        values = resolve_settings(cls, flags, env)
        if "model" not in values and values.get("standby"):
            values["model"] = ""  # a standby replica learns its model from POST /v1/preheat/load
        if "model" not in values:
            raise ConfigError(
                "no model: pass MODEL (a checkpoint directory, the name of a node-cache entry, or an http(s)://, "
                "s3:// URI) or set PREHEAT_MODEL (or start a standby replica: --standby --allow-model PATTERN)"
            )
        from preheat.store.cache import resolve_model

        cache_dir = values.get("cache_dir")
        # A name such as smollm2-135m-instruct, when no such path exists: the node-cache entry of that name.
        values["model"] = resolve_model(str(values["model"]), cache_dir if isinstance(cache_dir, str) else None)
        settings = cls(**values)  # type: ignore[arg-type]  # each value was parsed to its field's type above
        settings.check()
        return settings

    def check(self) -> None:
        """Refuse settings that cannot work, naming the flag and what to write instead."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be 0-65535 (0 picks a free port)")
        if self.device.split(":", 1)[0] not in DEVICES:
            raise ConfigError(f"--device {self.device!r}: use cpu or cuda[:N]")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len {self.max_model_len}: must be at least 2 tokens")
        if self.max_queue < 0:
            raise ConfigError(f"--max-queue {self.max_queue}: must be 0 or more (0 admits only the running request)")
        if self.max_connections < 1 or self.header_timeout <= 0:
            raise ConfigError("--max-connections must be at least 1, and --header-timeout positive")
        self.kv.check()
        self.check_keys()
        self.check_listeners()
        if not 0 <= self.peer_port <= 65535:
            raise ConfigError(f"--peer-port {self.peer_port}: must be 0-65535 (0 picks a free port)")
        if self.peer:  # before the bind: a replica must not load a model only to refuse to share it
            from preheat.peer.access import require_token  # torch-free: this runs before the bind

            require_token(self.peer_bind_host, self.peer_token)
        if self.peer_max_mbps is not None and self.peer_max_mbps <= 0:
            raise ConfigError(f"--peer-max-mbps {self.peer_max_mbps}: must be a positive number of MB/s")
        if self.registry is not None:
            from preheat.peer.registry import check_registry  # redis is imported only to open one

            check_registry(self.registry)
        if self.trust_key:
            from preheat.artifacts.signing import read_public_key  # pure: no crypto library before the bind

            for path in self.trust_key:
                read_public_key(path)  # ConfigError naming the file and what to pass instead
        self.check_follow()
        if self.standby:
            self.check_standby()
        elif not self.is_remote and not os.path.isdir(self.model):
            from preheat.store.cache import default_cache_dir

            raise ConfigError(
                f"model {self.model!r} is not a directory, nor the name of an entry of the node cache in "
                f"{self.cache_dir or default_cache_dir()} (`preheat cache ls` lists them): pass a preheat or Hugging "
                "Face checkpoint directory, or an http(s):// or s3:// URI to pull through the node cache"
            )

    def check_listeners(self) -> None:
        """TLS files that load (before the bind, not at the first handshake), and a dashboard login that lasts."""
        self.tls.check()
        if self.dashboard_session_ttl < 1:
            raise ConfigError(f"--dashboard-session-ttl {self.dashboard_session_ttl}: at least 1 second")

    def check_keys(self) -> None:
        """No empty key (it would quietly mean "no key"), and an admin key that is not the API key."""
        for secret in ("api_key", "admin_key"):
            value = getattr(self, secret)
            if value is not None and not value.strip():
                raise ConfigError(f"--{secret.replace('_', '-')} is empty: give a key, or leave the flag out")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ConfigError(
                "--admin-key is the --api-key: give the control routes a key of their own (PREHEAT_ADMIN_KEY), so "
                "that whoever may ask for completions cannot also put the replica to sleep or choose what it loads"
            )

    def check_follow(self) -> None:
        """``--follow`` needs a registry to find the trainer in; ``--max-staleness`` needs ``--follow``."""
        if self.follow and self.registry is None:
            raise ConfigError("--follow finds the trainer in the peer registry: pass --registry redis://... or file://")
        if self.max_staleness is not None and (self.max_staleness < 0 or not self.follow):
            raise ConfigError(f"--max-staleness {self.max_staleness}: needs --follow and a count of 0 or more")
        if not self.refit_deadline > 0:
            raise ConfigError(f"--refit-deadline {self.refit_deadline}: a number of seconds above 0")
        if self.follow and (self.compile or self.standby):
            raise ConfigError("--follow swaps weights in a live model: not with --compile or --standby (docs/refit.md)")
        if self.refit_max_jump < 1:
            raise ConfigError(f"--refit-max-jump {self.refit_max_jump}: a count of 1 or more")
        if self.follow:  # its refit server offers the live weights on the peer host: refused here, before the bind
            from preheat.artifacts.signing import read_public_key  # pure: no crypto library before the bind
            from preheat.peer.access import require_token  # torch-free
            from preheat.refit.trust import require_trust  # torch-free

            require_token(self.peer_bind_host, self.peer_token)
            for path in self.refit_trust_key:
                read_public_key(path)  # ConfigError naming the file and what to pass instead
            require_trust(self.registry, self.peer_bind_host, self.refit_trust_key)

    def check_standby(self) -> None:
        """A standby replica must be told what it may load, and must not take orders from the network unguarded."""
        if not self.allow_model:
            raise ConfigError(
                "--standby without MODEL loads nothing unless told what it may load: pass --allow-model PATTERN "
                "(a glob, e.g. 's3://models/*' or '/models/*'; repeatable) or PREHEAT_ALLOW_MODEL"
            )
        from preheat.http.control import is_loopback  # torch-free

        if not self.admin_key and not is_loopback(self.host):
            raise ConfigError(
                f"--standby on {self.host or '*'} would let anyone who reaches it choose the model it loads: set "
                "PREHEAT_ADMIN_KEY (or --admin-key), or bind to loopback (--host 127.0.0.1)"
            )
        if not self.admin_key and self.api_key:
            raise ConfigError(
                "--standby with --api-key and no --admin-key could never be activated: the control routes take "
                "the admin key only; set PREHEAT_ADMIN_KEY (or --admin-key)"
            )
        if self.model:
            raise ConfigError(
                f"--standby with MODEL {self.model!r}: a standby replica starts without a model; allow it with "
                "--allow-model and load it with POST /v1/preheat/load (or `preheat activate`)"
            )

    @property
    def allowed_models(self) -> tuple[str, ...]:
        """The patterns of ``--allow-model``; without any, the one MODEL the operator named (or nothing)."""
        if self.allow_model:
            return self.allow_model
        return (self.model,) if self.model else ()

    @property
    def tls(self) -> TLSFiles:
        """The TLS files of the replica's listeners (none given: plain http)."""
        from preheat.http.tls import TLSFiles  # standard library only

        return TLSFiles(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)

    @property
    def peer_bind_host(self) -> str:
        """Where the peer server listens: ``--peer-host``, else the API's ``--host``."""
        return self.host if self.peer_host is None else self.peer_host

    @property
    def is_remote(self) -> bool:
        """Whether MODEL is a URI to pull through the node cache rather than a local directory."""
        return self.model.startswith(REMOTE_SCHEMES)

    @property
    def model_name(self) -> str:
        """The name clients put in ``"model"``, the one ``GET /v1/models`` lists: the first of ``served_names``."""
        return self.served_names[0]

    @cached_property  # reads the entry's record once, not per request (a frozen dataclass still has a __dict__)
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's ``"model"`` may give: ``--served-model-name`` alone; else, for a node-cache entry,
        its name (``smollm2-135m-instruct``) and, as an alias, its directory's name (the cache key: what this
        server answered to before entries had names); else the last part of MODEL."""
        if self.served_model_name:
            return (self.served_model_name,)
        from preheat.store.cache import EntryMeta

        last = os.path.basename(self.model.rstrip("/")) or self.model
        meta = EntryMeta.read(self.model) if self.model and not self.is_remote else None
        if meta is None:
            return (last,)
        return tuple(dict.fromkeys((meta.name, last)))

    @property
    def refit_name(self) -> str:
        """The name whose versions ``--follow`` follows: NAME of ``preheat://NAME``, else the served model name."""
        name = peer_name(self.model)
        return self.model_name if name is None else name

    @property
    def kv(self) -> KVSettings:
        """The KV-tier settings (off unless ``--kv-l1`` or ``--kv-l2`` is given)."""
        from preheat.kv.settings import KVSettings

        return KVSettings(
            l1=self.kv_l1,
            l2=self.kv_l2,
            l2_max_bytes=self.kv_l2_max_bytes,
            l2_ttl_s=self.kv_l2_ttl,
            kv_dtype=self.kv_dtype,
            chunk_tokens=self.kv_chunk_tokens,
            secret_file=self.kv_secret_file,
            warm=self.kv_warm,
        )

    @property
    def engine_dtype(self) -> str | None:
        """The dtype handed to the engine (``auto`` means the checkpoint's own)."""
        return None if self.dtype in (None, "auto") else self.dtype
