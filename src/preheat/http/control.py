"""Who may call a control route: the rule every preheat server applies the same way (``control_refusal`` of
``request_of(handler)``), and the paths a router never forwards.

Control routes (``POST /v1/preheat/load``, ``/sleep``, ``/wake``, ``/refit``) change what a replica runs, so they
are kept apart from inference:

- **Their own key.** With an admin key (``--admin-key``) they need ``Authorization: Bearer ADMIN_KEY`` (401 without,
  403 when wrong; compared in constant time) and nothing else: the inference key (``--api-key``) never grants
  control. A server with an inference key but no admin key refuses every control request (403): whoever holds the
  key clients hold could otherwise put the replica to sleep or choose what it loads.
- **No key at all** (a laptop, a test): a server bound to loopback only serves a request whose ``Host`` names it (a
  loopback name, or the address it is bound to); one bound beyond loopback serves none (a program elsewhere can
  write any ``Host``). The client's address is never a reason to trust it: a proxy on the same host (the router was
  one) makes every client loopback, and a web page the user opens can make the browser send to ``127.0.0.1`` under
  an attacker's name (DNS rebinding), which the ``Host`` check refuses.
- **Never from a web page**: a request whose ``Origin`` is not the server's own (403), or whose ``Content-Type`` is
  not ``application/json`` (415). A page can send a ``text/plain`` or form POST anywhere without asking (no CORS
  preflight); ``application/json`` it cannot, and the browser names the page's origin.

Pure functions over header values, so the rule is tested without a server, and every server shares it.

>>> control_refusal(ControlRequest(None, None, "127.0.0.1:8000", "application/json"), admin_key=None) is None
True
>>> control_refusal(ControlRequest(None, None, "evil.example:8000", "application/json"), admin_key=None).code
'host_not_allowed'
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from preheat.http.server import check_bearer

# preheat's own routes on every replica, named here once (servers, the router, the doctor and the dashboard).
LOAD_ROUTE, SLEEP_ROUTE = "/v1/preheat/load", "/v1/preheat/sleep"
WAKE_ROUTE, REFIT_ROUTE = "/v1/preheat/wake", "/v1/preheat/refit"
TIMELINE_ROUTE, TOKENIZER_ROUTE = "/v1/preheat/timeline", "/v1/preheat/tokenizer"
CONTROL_ROUTES = (LOAD_ROUTE, SLEEP_ROUTE, WAKE_ROUTE, REFIT_ROUTE)
CONTROL_PREFIX = "/v1/preheat/"
# The only routes under CONTROL_PREFIX a router forwards: they read, never change, what a replica runs.
FORWARDED = frozenset({TIMELINE_ROUTE, TOKENIZER_ROUTE})
# vLLM's routes that change what a replica runs (its dev-mode sleep, RPC and cache routes, its weight-transfer API):
# a router drives them itself (router/sleeping.py) and never forwards a client's.
VLLM_SLEEP, VLLM_WAKE, VLLM_IS_SLEEPING, VLLM_RPC = "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc"
ENGINE_CONTROL = frozenset({
    VLLM_SLEEP, VLLM_WAKE, VLLM_RPC, "/reset_prefix_cache", "/release_kv_cache_memory", "/pause", "/resume",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
    "/abort_requests", "/start_profile", "/stop_profile",
})  # fmt: skip
JSON = "application/json"
# Loopback names a client on this host may use, whatever address the server is bound to.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Bound to every address: none of them names this server (compared with, never bound).
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})  # noqa: S104


@dataclass(frozen=True)
class ControlRequest:
    """The headers a control check reads (each None when absent)."""

    authorization: str | None
    origin: str | None
    host: str | None
    content_type: str | None


@dataclass(frozen=True)
class ControlRefusal:
    """Why a control request is refused: the status, an OpenAI-style ``type`` and ``code``, a message that says what
    to send instead, and the headers to answer with (``WWW-Authenticate`` with a 401)."""

    status: int
    message: str
    code: str
    type: str = "permission_error"
    headers: tuple[tuple[str, str], ...] = ()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``). A wildcard (``0.0.0.0``, ``::``, ``""``) or any other name is the network.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("0.0.0.0"), is_loopback("10.0.0.7")
    (True, True, False, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it resolves to whatever DNS says, so it counts as the network
        return False


def request_of(handler: BaseHTTPRequestHandler) -> ControlRequest:
    """The headers of the request ``handler`` is answering."""
    headers = handler.headers
    return ControlRequest(
        headers.get("Authorization"), headers.get("Origin"), headers.get("Host"), headers.get("Content-Type")
    )


def allowed_hosts(bound_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names a key-less server answers control requests for: loopback names, the address it is bound to (unless
    it is bound to every address) and ``extra``.

    >>> sorted(allowed_hosts("0.0.0.0"))
    ['127.0.0.1', '::1', 'localhost']
    >>> "10.0.0.7" in allowed_hosts("10.0.0.7")
    True
    """
    bound = _name(bound_host)
    own = set() if bound_host.strip() in WILDCARDS or bound is None else {bound}
    return frozenset(LOOPBACK_NAMES | own | {n for n in (_name(e) for e in extra) if n is not None})


def control_refusal(
    request: ControlRequest,
    *,
    admin_key: str | None,
    api_key: str | None = None,
    bound_host: str = "127.0.0.1",
) -> ControlRefusal | None:
    """None when ``request`` may call a control route of a server with ``admin_key`` (its ``--admin-key``) and
    ``api_key`` (its inference key) bound to ``bound_host``; else why not (the module's rules, in this order:
    origin, who, then the body's type)."""
    return (
        _origin_refusal(request)
        or _caller_refusal(request, admin_key, api_key, bound_host)
        or _media_refusal(request.content_type)
    )


def _origin_refusal(request: ControlRequest) -> ControlRefusal | None:
    if request.origin is None or _same_origin(request.origin, request.host):
        return None
    return ControlRefusal(
        403,
        f"control routes refuse requests from a web page (Origin {request.origin[:100]!r}): call them from a "
        "program, without an Origin header",
        "cross_origin",
    )


def _caller_refusal(
    request: ControlRequest, admin_key: str | None, api_key: str | None, bound_host: str
) -> ControlRefusal | None:
    if admin_key:
        check = check_bearer(request.authorization, admin_key)
        if check == "missing":
            return ControlRefusal(
                401,
                "control routes need the admin key: send 'Authorization: Bearer <key>' (the server's --admin-key)",
                "invalid_admin_key",
                "authentication_error",
                (("WWW-Authenticate", 'Bearer realm="preheat-control"'),),
            )
        if check == "wrong":
            return ControlRefusal(403, "wrong admin key (the server's --admin-key)", "invalid_admin_key")
        return None
    if api_key:
        return ControlRefusal(
            403,
            "control routes take the admin key, never the API key: start the server with PREHEAT_ADMIN_KEY (or "
            "--admin-key) and send it as 'Authorization: Bearer <key>'",
            "admin_key_required",
        )
    return _keyless_refusal(request.host, bound_host)


def _keyless_refusal(host: str | None, bound_host: str) -> ControlRefusal | None:
    if not is_loopback(bound_host):
        return ControlRefusal(
            403,
            f"this server listens on {bound_host or '*'}, beyond loopback, without an admin key: its control routes "
            "are closed; start it with PREHEAT_ADMIN_KEY (or --admin-key), or bind it to loopback",
            "admin_key_required",
        )
    if _name(host or "") in allowed_hosts(bound_host):
        return None
    return ControlRefusal(
        403,
        "without an admin key, control routes answer only requests addressed to this host by a loopback name or "
        f"its own address, not {(host or 'no Host')[:100]!r}: start the server with PREHEAT_ADMIN_KEY "
        "(or --admin-key) to control it from elsewhere",
        "host_not_allowed",
    )


def _media_refusal(content_type: str | None) -> ControlRefusal | None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == JSON:
        return None
    return ControlRefusal(
        415,
        f"control routes take JSON bodies: send 'Content-Type: {JSON}' (got {media or 'none'!r})",
        "unsupported_media_type",
        "invalid_request_error",
    )


def is_control_path(target: str) -> bool:
    """Whether a request target names a control route, however it is spelt (percent-escapes, dot segments,
    repeated slashes, letter case, absolute form): anything under ``/v1/preheat/`` but the read-only
    ``FORWARDED`` routes, and vLLM's ``ENGINE_CONTROL`` routes. A router answers these itself and never forwards
    them.

    >>> [is_control_path(p) for p in ("/v1/preheat/sleep", "//v1/preheat/%73leep?x", "/v1/x/../preheat/wake")]
    [True, True, True]
    >>> [is_control_path(p) for p in ("/v1/preheat/timeline", "/v1/completions", "http://h/v1/preheat/load")]
    [False, False, True]
    >>> [is_control_path(p) for p in ("/sleep?level=2", "/%63ollective_rpc", "/is_sleeping")]
    [True, True, False]
    """
    return _cached_is_control(target) if len(target) <= _CACHED_TARGET else _is_control(target)


# The router asks on every request it forwards, and a fleet's clients use a handful of targets: the short ones
# are remembered, bounded in number and in size (a client sending endless distinct targets costs at most 1,024 x
# 256 characters).
_CACHED_TARGET = 256


@lru_cache(maxsize=1024)
def _cached_is_control(target: str) -> bool:
    return _is_control(target)


def _is_control(target: str) -> bool:
    path = target.split("#", 1)[0]
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", path):  # absolute form (``POST http://host/path``): only its path
        path = urlsplit(path).path
    path = unquote(path.split("?", 1)[0]).lower()
    path = posixpath.normpath(re.sub(r"/+", "/", "/" + path))  # one leading slash: normpath keeps two
    return ((path + "/").startswith(CONTROL_PREFIX) and path not in FORWARDED) or path in ENGINE_CONTROL


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether a browser's ``Origin`` names the server the request was sent to (its ``Host``)."""
    netloc = urlsplit(origin.strip()).netloc.lower()
    return bool(netloc) and host is not None and netloc == host.strip().lower()


def _name(host: str) -> str | None:
    """The host name of a ``Host`` value or bound address, without port, brackets or a final dot, in lower case."""
    value = host.strip().lower()
    if value.startswith("["):  # [::1]:8000
        end = value.find("]")
        return value[1:end] if end > 0 else None
    if value.count(":") == 1:  # name:port (an IPv6 address without brackets has several colons)
        value = value.split(":", 1)[0]
    return value.rstrip(".") or None
