"""``VllmStandbySettings``: the one source of truth for ``preheat vllm-standby`` (flags and ``PREHEAT_VLLM_STANDBY_*``
variables are generated from its fields). Cheap to import: no vLLM, no torch; checked before the socket is bound.

The user's own ``vllm serve`` arguments are not settings of preheat's: they follow ``--`` on the command line and
are parsed by vLLM's own parser (``standby_control.serve_argv``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from preheat.core import env
from preheat.core.config import option, resolve_settings, settings
from preheat.core.errors import ConfigError


@settings(prefix="PREHEAT_VLLM_STANDBY_", command="vllm-standby")
@dataclass(frozen=True)
class VllmStandbySettings:
    """Where the standby listens, what it may be told to load, and who may tell it."""

    host: str = field(
        default="127.0.0.1",
        metadata=option("address to bind (the vLLM server it becomes keeps it); the default is this machine only"),
    )
    port: int = field(default=8000, metadata=option("port; 0 picks a free one"))
    # Glob patterns of the models POST /v1/preheat/load may name (preheat.server.allow): required, as a standby has
    # no MODEL of its own to default to.
    allow_model: tuple[str, ...] = field(
        default=(),
        metadata=option("models POST /v1/preheat/load may load, e.g. '/models/*' (repeatable)", metavar="GLOB"),
    )
    admin_key: str | None = field(
        default=None,
        metadata=option(
            "require 'Authorization: Bearer KEY' on POST /v1/preheat/load; prefer the variable",
            metavar="KEY",
            variable=env.ADMIN_KEY,
            default_text="none: control from this host to a loopback-bound standby only",
        ),
    )
    # A standby told to load at start (a replica of `preheat up --engine vllm` or a Kubernetes vLLM replica): the
    # same activation as a load request's, queued before any request can arrive, so nothing has to race the bind.
    load: str | None = field(
        default=None,
        metadata=option(
            "load this model at once, as POST /v1/preheat/load would (it is then the allowed model unless "
            "--allow-model is given)",
            metavar="MODEL",
            default_text="none: wait for a load request",
        ),
    )

    @classmethod
    def resolve(cls, flags: Mapping[str, object], environ: Mapping[str, str] | None = None) -> VllmStandbySettings:
        """The settings from ``flags`` (None: not given), the variables, the defaults; checked."""
        resolved = cls(**resolve_settings(cls, flags, environ))  # type: ignore[arg-type]  # values of the fields' types
        if resolved.load and not resolved.allow_model:
            # As preheat serve's rule: with no --allow-model, the model the operator named is the one allowed.
            resolved = replace(resolved, allow_model=(resolved.load,))
        resolved.check()
        return resolved

    def check(self) -> None:
        """``ConfigError`` for a standby that could never be activated, or that anyone could activate."""
        from preheat.http.control import is_loopback  # torch-free

        if not self.allow_model:
            raise ConfigError(
                "preheat vllm-standby loads nothing unless told what it may load: pass --allow-model PATTERN (a glob, "
                "e.g. '/models/*' or 's3://models/*'; repeatable) or PREHEAT_VLLM_STANDBY_ALLOW_MODEL"
            )
        if self.admin_key is not None and not self.admin_key.strip():
            raise ConfigError("--admin-key is empty: give a key, or leave the flag out")
        # Told what to load and given no key, its load route is closed beyond loopback (preheat.http.control): safe.
        if not self.admin_key and not is_loopback(self.host) and not self.load:
            raise ConfigError(
                f"a vLLM standby on {self.host or '*'} would let anyone who reaches it choose the model it loads: set "
                "PREHEAT_ADMIN_KEY (or --admin-key), or bind to loopback (--host 127.0.0.1)"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: a port is 0-65535")
