"""The control-route rule (preheat.http.control) as the pure functions it is: who may call a control route, and which
request targets name one (a router refuses them all). The same rule on real servers:
tests/integration/server/test_control_routes.py and tests/integration/router/test_router_control.py."""

from __future__ import annotations

from preheat.http.control import ControlRequest, allowed_hosts, control_refusal, is_control_path


def test_the_rule_refuses_pages_strangers_and_the_wrong_key() -> None:
    def ask(
        host: str | None = "127.0.0.1:8000",
        origin: str | None = None,
        kind: str | None = "application/json; charset=utf-8",
        auth: str | None = None,
        **keys: str | None,
    ) -> str | None:
        refusal = control_refusal(ControlRequest(auth, origin, host, kind), admin_key=keys.get("admin"),
                                  api_key=keys.get("api"), bound_host=keys.get("bound") or "127.0.0.1")  # fmt: skip
        return None if refusal is None else f"{refusal.status} {refusal.code}"

    assert ask() is None
    for name in ("localhost:8000", "[::1]:8000", "LOCALHOST.", "localhost"):
        assert ask(name) is None, name
    assert ask("127.0.0.2:8000", bound="127.0.0.2") is None  # the address it is bound to names it too
    assert ask("127.0.0.2:8000") == "403 host_not_allowed"
    # Bound beyond loopback, a program elsewhere could write any Host: no key, no control.
    for bound in ("0.0.0.0", "::", "10.0.0.7", "replica.internal"):
        assert ask(bound=bound) == "403 admin_key_required", bound
    assert ask(auth="Bearer a", admin="a", bound="0.0.0.0") is None
    assert ask(None) == "403 host_not_allowed"
    assert ask(origin="http://127.0.0.1:8000") is None  # its own page (same origin)
    assert ask(origin="null") == "403 cross_origin"
    assert ask(kind=None) == "415 unsupported_media_type"
    assert ask(kind="application/x-www-form-urlencoded") == "415 unsupported_media_type"
    assert ask(admin="a") == "401 invalid_admin_key"
    assert ask(auth="Bearer k", admin="a", api="k") == "403 invalid_admin_key"
    assert ask(auth="Bearer a", admin="a", host="anything.example") is None  # with a key, any name
    assert ask(auth="Bearer k", api="k") == "403 admin_key_required"
    assert allowed_hosts("::") == {"localhost", "127.0.0.1", "::1"}


def test_every_spelling_of_a_control_route_is_one() -> None:
    for path in ("/v1/preheat/sleep", "/v1/preheat/SLEEP", "/v1/preheat/%73leep", "//v1//preheat/wake/",
                 "/v1/preheat/timeline/../load", "/v1/./preheat/refit?x=1", "/v1/preheat/anything-new",
                 "http://replica:8000/v1/preheat/sleep", "/v1/preheat"):  # fmt: skip
        assert is_control_path(path), path
    for path in ("/v1/completions", "/v1/preheat/timeline", "/v1/preheat/tokenizer?x", "/health", "/v1/kv/events"):
        assert not is_control_path(path), path
