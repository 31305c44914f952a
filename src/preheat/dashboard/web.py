"""The dashboard's HTTP answers, for the router's and ``preheat serve``'s handlers (``TrackedHandler``).

Routes (GET, read-only, but the login):

- ``/dashboard``: the page; ``/dashboard/static/<file>``: its script and stylesheet, from the package;
- ``/dashboard/api/state``: the state document (``preheat.dashboard/1``, docs/dashboard.md);
- ``POST /dashboard`` (form ``key=KEY``): the login.

With an API key, a browser cannot send ``Authorization: Bearer`` on a page load, so the login form posts the key
in its body (never in a URL, where a proxy's access log or the history would keep it): the answer sets a cookie
derived from it (HttpOnly, SameSite=Strict, limited to ``/dashboard``) and redirects to the page. The state API takes
the cookie or a Bearer header (curl). The static files are the package's own, the same for everyone: they are served
without a key, so the login page has its stylesheet.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from preheat.http.server import CLOSE, BodyRefusal, TrackedHandler, check_bearer, write_body

PREFIX = "/dashboard"
COOKIE = "preheat_dashboard_key"
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Everything comes from this origin: no CDN, no inline script; the page works offline and injected markup cannot run.
SECURITY = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
NO_STORE = {"Cache-Control": "no-store"}
MAX_LOGIN_BODY = 4096  # a form with one key
State = Callable[[], dict[str, Any]]  # Any: the state document (a JSON object)


def is_dashboard_path(path: str) -> bool:
    """Whether ``path`` (without its query) is one of the dashboard's."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def asset(name: str) -> bytes:
    """A file of ``assets/``, as shipped in the package."""
    return resources.files("preheat.dashboard").joinpath("assets").joinpath(name).read_bytes()


def answer(handler: TrackedHandler, api_key: str | None, state: State) -> None:
    """Answer a dashboard request on ``handler`` (its path is one ``is_dashboard_path`` accepts)."""
    path = handler.path.partition("?")[0]
    page = path in (PREFIX, PREFIX + "/")
    if path.startswith(PREFIX + "/static/"):
        _static(handler, path[len(PREFIX + "/static/") :])
    elif handler.command == "POST":
        _log_in(handler, api_key, path, page)
    elif not _authorized(handler, api_key):
        if page:
            _login(handler, None)
        else:
            message = "missing or wrong API key: log in at /dashboard, or send 'Authorization: Bearer <key>'"
            body = {"error": {"message": message, "type": "authentication_error", "code": "invalid_api_key"}}
            write_body(handler, 401, json.dumps(body).encode(), "application/json", NO_STORE)
    elif page:
        write_body(handler, 200, asset("index.html"), "text/html; charset=utf-8", {**SECURITY, **NO_STORE})
    elif path == PREFIX + "/api/state":
        write_body(handler, 200, json.dumps(state()).encode(), "application/json", NO_STORE)
    else:
        _text(handler, 404, f"no dashboard route {path}\n")


def _static(handler: TrackedHandler, name: str) -> None:
    if name not in ASSETS:
        _text(handler, 404, f"no dashboard file {name!r}\n")
    else:
        write_body(handler, 200, asset(name), ASSETS[name], {**SECURITY, "Cache-Control": "no-cache"})


def _log_in(handler: TrackedHandler, api_key: str | None, path: str, page: bool) -> None:
    """``POST /dashboard`` with the form's ``key``: 303 to the page with the session cookie, or the form again."""
    if not page:
        _text(handler, 405, f"POST {path}: only the login (POST {PREFIX}) takes a body\n", CLOSE)
        return
    given = _posted_key(handler)
    if given is None:
        return
    if not api_key:  # nothing to log in to
        write_body(handler, 303, b"", "text/plain", {"Location": PREFIX, **NO_STORE})
    elif hmac.compare_digest(given.encode(), api_key.encode()):
        cookie = f"{COOKIE}={session_token(api_key)}; Path={PREFIX}; HttpOnly; SameSite=Strict"
        write_body(handler, 303, b"", "text/plain", {"Location": PREFIX, "Set-Cookie": cookie, **NO_STORE})
    else:
        _login(handler, "wrong key: try again")


def _authorized(handler: BaseHTTPRequestHandler, api_key: str | None) -> bool:
    if not api_key:
        return True
    if check_bearer(handler.headers.get("Authorization"), api_key) == "ok":
        return True
    try:
        cookie = SimpleCookie(handler.headers.get("Cookie") or "")
    except CookieError:
        return False
    morsel = cookie.get(COOKIE)
    return morsel is not None and hmac.compare_digest(morsel.value.encode(), session_token(api_key).encode())


def session_token(api_key: str) -> str:
    """The cookie's value: derived from the key (hex, cookie-safe), so the key itself is never stored in a browser;
    it changes when the key does, which logs every browser out."""
    return hmac.new(api_key.encode(), b"preheat dashboard session", hashlib.sha256).hexdigest()


def _login(handler: BaseHTTPRequestHandler, problem: str | None) -> None:
    page = asset("login.html").decode()
    note = f'<p class="problem" role="alert">{problem}</p>' if problem else ""
    write_body(handler, 401, page.replace("<!--problem-->", note).encode(), "text/html; charset=utf-8",
               {**SECURITY, **NO_STORE})  # fmt: skip


def _posted_key(handler: TrackedHandler) -> str | None:
    """The ``key`` field of the login form's body (``application/x-www-form-urlencoded``); None after answering a
    body that is missing, too large or has no key."""
    body = handler.read_body_within(MAX_LOGIN_BODY)
    if isinstance(body, BodyRefusal):
        _text(handler, body.status, body.message + "\n", CLOSE)
        return None
    key = parse_qs(body.decode("utf-8", "replace")).get("key", [None])[0]
    if key is None:
        _login(handler, "no key was sent: type it in the form")
        return None
    return key


def _text(handler: BaseHTTPRequestHandler, status: int, text: str, headers: dict[str, str] | None = None) -> None:
    write_body(handler, status, text.encode(), "text/plain; charset=utf-8", {**NO_STORE, **(headers or {})})
