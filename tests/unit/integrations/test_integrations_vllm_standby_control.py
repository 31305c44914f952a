"""The pure half of ``preheat vllm-standby`` (``preheat.integrations.vllm.standby_control``, its settings): the
``vllm serve`` words an activation parses, the phases ``/health`` reports, and which load requests start anything."""

from __future__ import annotations

import pytest

from preheat.core.errors import APIError, ConfigError
from preheat.integrations.vllm.standby_control import (
    LOADING,
    SERVING,
    STANDBY,
    StandbyState,
    load_request,
    not_serving,
    own_words,
    serve_argv,
    single_server,
)
from preheat.integrations.vllm.standby_settings import VllmStandbySettings


def test_serve_argv_puts_the_model_first_and_the_standbys_socket_last() -> None:
    words = serve_argv(["--dtype", "float32", "--enforce-eager"], "/models/smol", host="127.0.0.1", port=8123)
    assert words == ["/models/smol", "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1", "--port", "8123"]


def test_the_loads_served_name_comes_after_the_users_so_it_wins() -> None:
    words = serve_argv(["--served-model-name", "a"], "/m", host="h", port=1, served_model_name="b")
    assert words[-2:] == ["--served-model-name", "b"]
    assert words.index("a") < words.index("b")


@pytest.mark.parametrize("word", ["--port", "--port=9000", "--host", "--uds=/tmp/s", "--model"])
def test_user_arguments_that_name_the_socket_or_the_model_are_refused(word: str) -> None:
    assert own_words(["--dtype", "float32", word]) is not None
    with pytest.raises(ConfigError, match="sets --host, --port"):
        serve_argv([word, "x"], "/m", host="127.0.0.1", port=1)


def test_a_flag_that_merely_starts_like_an_owned_one_is_kept() -> None:
    assert own_words(["--hosted-tools", "--portable"]) is None


@pytest.mark.parametrize(
    ("headless", "grpc", "servers", "dp", "refused"),
    [
        (False, False, None, 1, False),
        (False, False, 1, 1, False),
        (True, False, None, 1, True),
        (False, True, None, 1, True),
        (False, False, 2, 1, True),
        (False, False, 0, 1, True),
        (False, False, None, 2, True),
    ],
)
def test_only_one_http_api_server_fits_one_socket(
    headless: bool, grpc: bool, servers: int | None, dp: int, refused: bool
) -> None:
    assert (single_server(headless, grpc, servers, dp) is not None) is refused


def test_health_says_standby_then_prepared_never_200() -> None:
    state = StandbyState()
    assert state.health() == (503, {"status": STANDBY, "prepared": False})
    state.prepared = True
    assert state.health() == (503, {"status": STANDBY, "prepared": True})


def test_a_load_moves_to_loading_and_a_second_load_is_409_is_loading() -> None:
    state = StandbyState()
    assert state.begin("/models/a") is None
    assert state.health() == (503, {"status": LOADING, "model": "/models/a"})
    busy = state.begin("/models/b")
    assert busy is not None
    assert (busy.status, busy.code) == (409, "is_loading")


def test_a_failed_activation_is_standby_again_with_last_error_and_takes_the_next_load() -> None:
    state = StandbyState()
    state.prepared = True
    state.begin("/models/a")
    state.failed("ActivationFailed: no config.json")
    assert state.done.is_set()
    assert state.health() == (
        503,
        {"status": STANDBY, "prepared": True, "last_error": "ActivationFailed: no config.json"},
    )
    assert state.begin("/models/b") is None
    assert "last_error" not in state.health()[1]


def test_after_the_hand_over_no_load_is_taken() -> None:
    state = StandbyState()
    state.begin("/models/a")
    state.handed_over()
    assert state.phase == SERVING
    refused = state.begin("/models/b")
    assert refused is not None
    assert refused.code == "is_serving"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"", "model"),
        (b"{}", "model"),
        (b'{"model": ""}', "model"),
        (b'{"model": 7}', "model"),
        (b'{"model": "/m", "served_model_name": 3}', "served_model_name"),
        (b'{"model": "/m", "wait": "yes"}', "wait"),
    ],
)
def test_load_requests_without_a_usable_model_are_400(body: bytes, param: str) -> None:
    with pytest.raises(APIError) as caught:
        load_request(body)
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"model": ' * 50])
def test_a_body_that_is_no_json_object_is_400(body: bytes) -> None:
    with pytest.raises(APIError) as caught:
        load_request(body)
    assert caught.value.status == 400


def test_a_load_request_keeps_the_name_and_wait() -> None:
    got = load_request(b'{"model": "/m/smol", "served_model_name": "smol", "wait": true}')
    assert (got.model, got.served_model_name, got.wait) == ("/m/smol", "smol", True)


def test_other_routes_are_503_with_the_code_the_router_reads_as_not_serving() -> None:
    error = not_serving("/v1/completions")
    assert (error.status, error.code) == (503, STANDBY)
    assert "POST /v1/preheat/load" in error.message


def test_settings_refuse_a_standby_without_allow_model() -> None:
    with pytest.raises(ConfigError, match="--allow-model"):
        VllmStandbySettings.resolve({}, {})


def test_settings_refuse_a_standby_beyond_loopback_without_an_admin_key() -> None:
    with pytest.raises(ConfigError, match="admin"):
        VllmStandbySettings.resolve({"host": "0.0.0.0", "allow_model": ["/m/*"]}, {})
    keyed = VllmStandbySettings.resolve({"host": "0.0.0.0", "allow_model": ["/m/*"]}, {"PREHEAT_ADMIN_KEY": "k"})
    assert keyed.admin_key == "k"


def test_settings_come_from_the_variables_when_no_flag_is_given() -> None:
    got = VllmStandbySettings.resolve(
        {"port": None}, {"PREHEAT_VLLM_STANDBY_PORT": "9001", "PREHEAT_VLLM_STANDBY_ALLOW_MODEL": "/a/*,/b/*"}
    )
    assert (got.port, got.allow_model) == (9001, ("/a/*", "/b/*"))


def test_a_standby_told_to_load_allows_that_model_and_may_listen_beyond_loopback_without_a_key() -> None:
    # Its load route is then closed to everyone (no key, not loopback): the command line chose its only model.
    told = VllmStandbySettings.resolve({"host": "0.0.0.0", "load": "/models/smol"}, {})
    assert (told.load, told.allow_model, told.admin_key) == ("/models/smol", ("/models/smol",), None)
    given = VllmStandbySettings.resolve({"load": "/models/smol", "allow_model": ["/models/*"]}, {})
    assert given.allow_model == ("/models/*",)
