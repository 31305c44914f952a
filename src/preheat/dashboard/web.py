"""The dashboard's HTTP answers, for the router's and ``preheat serve``'s handlers (``TrackedHandler``).

Routes (GET, read-only, but the login):

- ``/dashboard``: the page; ``/dashboard/static/<file>``: its script and stylesheet, from the package;
- ``/dashboard/api/state``: the state document (``preheat.dashboard/1``, docs/dashboard.md);
- ``POST /dashboard`` (form ``key=KEY``): the login.

With an API key, a browser cannot send ``Authorization: Bearer`` on a page load, so the login form posts the key
in its body (never in a URL, where a proxy's access log or the history would keep it): the answer sets a cookie
holding a random session id that the server keeps until it expires (``preheat.dashboard.login``: HttpOnly,
SameSite=Strict, limited to ``/dashboard``, ``Secure`` over https) and redirects to the page. Wrong keys are
throttled per client address (429 with ``Retry-After`` after a few). The state API takes the cookie or a Bearer
header (curl). The static files are the package's own, the same for everyone: they are served without a key, so the
login page has its stylesheet.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from preheat.dashboard.login import Login
from preheat.http.server import CLOSE, BodyRefusal, TrackedHandler, check_bearer, write_body

if TYPE_CHECKING:
    from preheat.dashboard.state import StateDocument

PREFIX = "/dashboard"
COOKIE = "preheat_dashboard_session"
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
State = Callable[[], "StateDocument"]


def is_dashboard_path(path: str) -> bool:
    """Whether ``path`` (without its query) is one of the dashboard's."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def asset(name: str) -> bytes:
    """A file of ``assets/``, as shipped in the package."""
    return resources.files("preheat.dashboard").joinpath("assets").joinpath(name).read_bytes()


def answer(handler: TrackedHandler, api_key: str | None, state: State, login: Login) -> None:
    """Answer a dashboard request on ``handler`` (its path is one ``is_dashboard_path`` accepts); ``login``: the
    server's sessions and login throttle."""
    path = handler.path.partition("?")[0]
    page = path in (PREFIX, PREFIX + "/")
    if path.startswith(PREFIX + "/static/"):
        _static(handler, path[len(PREFIX + "/static/") :])
    elif handler.command == "POST":
        _log_in(handler, api_key, path, page, login)
    elif not _authorized(handler, api_key, login):
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


def _log_in(handler: TrackedHandler, api_key: str | None, path: str, page: bool, login: Login) -> None:
    """``POST /dashboard`` with the form's ``key``: 303 to the page with a new session's cookie, or the form again
    (429 while the client's address has used up its wrong keys)."""
    if not page:
        _text(handler, 405, f"POST {path}: only the login (POST {PREFIX}) takes a body\n", CLOSE)
        return
    client = str(handler.client_address[0])
    wait = login.throttle.wait(client) if api_key else None
    if wait is not None:  # the key is not even compared: a guesser learns nothing until the wait is over
        seconds = math.ceil(wait)
        handler.close_connection = True  # the form's body stays unread
        _login(handler, f"too many wrong keys: try again in {seconds} s", 429, {"Retry-After": str(seconds), **CLOSE})
        return
    given = _posted_key(handler)
    if given is None:
        return
    if not api_key:  # nothing to log in to
        write_body(handler, 303, b"", "text/plain", {"Location": PREFIX, **NO_STORE})
    elif hmac.compare_digest(given.encode(), api_key.encode()):
        secure = "; Secure" if handler.server.tls is not None else ""  # over https, never sent in clear
        max_age = int(login.sessions.ttl_s)
        cookie = f"{COOKIE}={login.sessions.new()}; Path={PREFIX}; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}"
        write_body(handler, 303, b"", "text/plain", {"Location": PREFIX, "Set-Cookie": cookie, **NO_STORE})
    else:
        login.throttle.failed(client)
        _login(handler, "wrong key: try again")


def _authorized(handler: BaseHTTPRequestHandler, api_key: str | None, login: Login) -> bool:
    if not api_key:
        return True
    if check_bearer(handler.headers.get("Authorization"), api_key) == "ok":
        return True
    try:
        cookie = SimpleCookie(handler.headers.get("Cookie") or "")
    except CookieError:
        return False
    morsel = cookie.get(COOKIE)
    return morsel is not None and login.sessions.valid(morsel.value)


def _login(
    handler: BaseHTTPRequestHandler, problem: str | None, status: int = 401, headers: dict[str, str] | None = None
) -> None:
    page = asset("login.html").decode()
    note = f'<p class="problem" role="alert">{problem}</p>' if problem else ""
    write_body(handler, status, page.replace("<!--problem-->", note).encode(), "text/html; charset=utf-8",
               {**SECURITY, **NO_STORE, **(headers or {})})  # fmt: skip


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
