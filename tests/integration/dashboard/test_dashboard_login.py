"""Dashboard logins (docs/dashboard.md, *Login*): a random session per login that the server keeps and ends, never
a value derived from the key, and wrong keys throttled per client address. A real router in this process, asked
over real sockets."""

from __future__ import annotations

import hashlib
import hmac
import http.client
from urllib.parse import urlsplit

from preheat.dashboard.login import BURST
from routing import running_router, wait_until
from serving import Client, Reply

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens there
KEY = "sesame"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def log_in(url: str, key: str) -> Reply:
    return Client(url).request("POST", "/dashboard", f"key={key}".encode(), FORM)


def state(url: str, cookie: str) -> int:
    return Client(url).request("GET", "/dashboard/api/state", headers={"Cookie": cookie}).status


def cookie_of(reply: Reply) -> str:
    return reply.headers["Set-Cookie"].split(";", 1)[0]


def test_each_login_is_a_session_of_its_own_that_only_its_server_knows() -> None:
    with running_router([DOWN], api_key=KEY) as one, running_router([DOWN], api_key=KEY) as other:
        first, second = log_in(one.url, KEY), log_in(one.url, KEY)
        a, b = cookie_of(first), cookie_of(second)
        here, elsewhere = state(one.url, a), state(other.url, a)
    derived = hmac.new(KEY.encode(), b"preheat dashboard session", hashlib.sha256).hexdigest()
    assert a != b  # random, not derived from the key: two logins, two sessions
    assert derived not in first.headers["Set-Cookie"]
    assert KEY not in first.headers["Set-Cookie"]
    assert "Max-Age=43200" in first.headers["Set-Cookie"]  # 12 h unless --dashboard-session-ttl says otherwise
    assert here == 200
    assert elsewhere == 401  # the same key, another server: the session is held by the one that made it


def test_a_session_ends_at_its_expiry() -> None:
    with running_router([DOWN], api_key=KEY, dashboard_session_ttl=1) as router:
        login = log_in(router.url, KEY)
        cookie = cookie_of(login)
        fresh = state(router.url, cookie)
        wait_until(lambda: state(router.url, cookie) == 401, "the session to expire", deadline=30)
        again = log_in(router.url, KEY)
    assert "Max-Age=1" in login.headers["Set-Cookie"]
    assert fresh == 200
    assert again.status == 303  # a new login makes a new session


def _log_in_from(url: str, source: str, key: str) -> int:
    """A login sent from the loopback address ``source`` (127.0.0.0/8 is all this machine's)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30, source_address=(source, 0))
    try:
        conn.request("POST", "/dashboard", f"key={key}".encode(), FORM)
        return conn.getresponse().status
    finally:
        conn.close()


def test_wrong_keys_from_one_address_are_throttled_and_not_from_another() -> None:
    with running_router([DOWN], api_key=KEY) as router:
        wrong = [log_in(router.url, f"guess{i}").status for i in range(BURST)]
        throttled = log_in(router.url, "guess")
        right_but_throttled = log_in(router.url, KEY)
        bearer = Client(router.url, api_key=KEY).get("/dashboard/api/state")  # a program with the key is unaffected
        elsewhere = _log_in_from(router.url, "127.0.0.2", KEY)
    assert wrong == [401] * BURST
    assert throttled.status == 429
    assert int(throttled.headers["Retry-After"]) > 0
    assert b"too many wrong keys" in throttled.body
    assert right_but_throttled.status == 429  # not even compared until the wait is over
    assert bearer.status == 200
    assert elsewhere == 303  # another address has its own bucket
