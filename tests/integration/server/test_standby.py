"""Standby replicas: ``preheat serve --standby`` waits warm with no model until ``POST /v1/preheat/load`` (or
``preheat activate``) names one, from the node cache, a peer or an HTTP origin. Real subprocesses on 127.0.0.1, real
files; the model rule (``--allow-model``) is also tested as the pure function it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers import SeedPeer
from preheat.checkpoint.manifest import MANIFEST_NAME
from preheat.core.errors import ConfigError
from preheat.router.cluster import ServerProcess
from preheat.server.allow import refusal
from preheat.server.settings import ServeSettings
from preheat.store.cache import ModelCache
from preheat.store.pull import pull
from preheat.testing.fileserver import FileServer
from serving import Client, Gate

NAME = "tiny"


def wait_for(condition: object, what: str, deadline: float = 120.0) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``deadline`` s (a hang, not a speed check)."""
    import time

    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def origin_dir(kv_model: Path, tmp_path: Path) -> Path:
    """A directory an HTTP origin serves, holding a copy of the manifest-carrying tiny model as ``tiny/``."""
    root = tmp_path / "origin"
    shutil.copytree(kv_model, root / NAME)
    return root


def standby(*extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess("", "--standby", *extra, env=env)


def health(client: Client) -> dict[str, object]:
    reply = client.get("/health")
    body = dict(reply.json())
    assert (reply.status == 200) == (body["status"] == "ok"), body  # 200 means ready, and only ready is 200
    return body


def load(client: Client, model: str, *, wait: bool = True) -> tuple[int, dict[str, object]]:
    reply = client.post("/v1/preheat/load", {"model": model, "wait": wait})
    return reply.status, dict(reply.json())


def complete(client: Client) -> int:
    return client.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status


def stage(client: Client, name: str) -> dict[str, object]:
    stages = client.get("/v1/preheat/timeline").json()["stages"]
    return dict(next(s for s in stages if s["name"] == name))


# -- the standby phase ---------------------------------------------------------------------------------------------
def test_a_standby_replica_says_standby_and_refuses_generation(tmp_path: Path) -> None:
    with standby("--allow-model", str(tmp_path / "*")) as server:
        client = Client(server.url)
        wait_for(lambda: health(client).get("prepared") is True, "the standby replica to finish its imports")
        assert health(client) == {"status": "standby", "prepared": True}
        refused = client.post("/v1/completions", {"prompt": "Hi"})
        assert refused.status == 503
        assert refused.json()["error"]["code"] == "standby"
        names = [s["name"] for s in client.get("/v1/preheat/timeline").json()["stages"]]
        assert {"engine_imports", "engine_warm", "standby"} <= set(names)


def test_activation_from_an_http_origin_serves_the_model_on_a_timeline_from_the_request(
    origin_dir: Path, tmp_path: Path
) -> None:
    with FileServer(origin_dir) as origin:
        uri = f"{origin.url}/{NAME}"
        with standby("--allow-model", f"{origin.url}/*", "--cache-dir", str(tmp_path / "cache")) as server:
            client = Client(server.url)
            status, answer = load(client, uri)
            assert status == 200, answer
            assert answer["model"] == NAME
            assert health(client) == {"status": "ok", "model": NAME}
            assert complete(client) == 200
            timeline = client.get("/v1/preheat/timeline").json()
            assert timeline["origin_source"] == "load request"
            names = [s["name"] for s in timeline["stages"]]
            assert names[0] == "load_request"
            assert "imports" not in names  # the process's own start is the standby's timeline, not this one
            fetch = stage(client, "fetch")
            assert fetch["detail"]["cache"] == "miss"  # type: ignore[index]
            assert fetch["bytes"] > 0  # type: ignore[operator]


def test_activation_from_the_node_cache_fetches_nothing(origin_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with FileServer(origin_dir) as origin:
        uri = f"{origin.url}/{NAME}"
        pull(uri, ModelCache(str(cache)))  # the node already holds it (another replica pulled it)
        with standby("--allow-model", uri, "--cache-dir", str(cache)) as server:
            client = Client(server.url)
            status, answer = load(client, uri)
            assert status == 200, answer
            fetch = stage(client, "fetch")
            assert fetch["detail"]["cache"] == "hit"  # type: ignore[index]
            assert fetch["bytes"] == 0
            assert complete(client) == 200


def test_activation_from_a_peer_pulls_preheat_names_from_it(kv_model: Path, tmp_path: Path) -> None:
    identity = json.loads((kv_model / MANIFEST_NAME).read_bytes())["identity"]
    with SeedPeer(kv_model) as peer:
        env = {**os.environ, "PREHEAT_PEERS": peer.address}
        with standby("--allow-model", "preheat://*", "--cache-dir", str(tmp_path / "cache"), env=env) as server:
            client = Client(server.url)
            status, answer = load(client, f"preheat://{identity}")
            assert status == 200, answer
            fetch = stage(client, "fetch")
            assert fetch["detail"]["sources"] == {f"peer {peer.address}": fetch["bytes"]}  # type: ignore[index]
            assert complete(client) == 200


def test_preheat_activate_loads_a_directory_and_says_so(kv_model: Path) -> None:
    with standby("--allow-model", str(kv_model)) as server:
        done = subprocess.run(
            [sys.executable, "-m", "preheat", "activate", server.url, str(kv_model)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)["status"] == "ok"
        assert complete(Client(server.url)) == 200


def test_an_activation_that_names_no_served_name_keeps_the_replicas_own(kv_model: Path) -> None:
    with standby("--allow-model", str(kv_model), "--served-model-name", "fleet-model") as server:
        client = Client(server.url)
        status, body = load(client, str(kv_model))
        assert status == 200, body
        names = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert names == ["fleet-model"]


# -- one activation at a time, and failures go back to standby -----------------------------------------------------
def test_a_second_activation_while_loading_gets_409(origin_dir: Path, tmp_path: Path) -> None:
    with FileServer(origin_dir) as origin, Gate(origin.port) as gate:
        uri = f"{gate.url}/{NAME}"
        with standby("--allow-model", f"{gate.url}/*", "--cache-dir", str(tmp_path / "cache")) as server:
            client = Client(server.url)
            status, answer = load(client, uri, wait=False)
            assert (status, answer["status"]) == (202, "loading")
            assert gate.waiting.wait(timeout=60), "the replica asks the origin for the model"
            second, refused = load(client, uri)
            assert second == 409
            assert refused["error"]["code"] == "is_loading"  # type: ignore[index]
            assert health(client)["status"] == "loading"
            gate.open()
            wait_for(lambda: health(client)["status"] == "ok", "the first activation to finish")
            assert complete(client) == 200


def test_a_corrupt_checkpoint_leaves_the_replica_on_standby_and_able_to_load_another(
    origin_dir: Path, kv_model: Path, tmp_path: Path
) -> None:
    bad = origin_dir / "bad"
    shutil.copytree(kv_model, bad)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte inside the last tensor: its digest in preheat.json no longer matches
    weights.write_bytes(bytes(data))
    cache = str(tmp_path / "cache")
    with FileServer(origin_dir) as origin, standby("--allow-model", f"{origin.url}/*", "--cache-dir", cache) as server:
        client = Client(server.url)
        status, answer = load(client, f"{origin.url}/bad")
        assert status == 500, answer
        state = health(client)
        assert state["status"] == "standby"
        assert "digest" in str(state["last_error"]) or "match" in str(state["last_error"]), state
        assert server.proc.poll() is None  # still running: a standby replica outlives a bad model
        status, answer = load(client, f"{origin.url}/{NAME}")
        assert status == 200, answer
        assert complete(client) == 200


def test_an_unreachable_peer_leaves_the_replica_on_standby(kv_model: Path, tmp_path: Path) -> None:
    identity = json.loads((kv_model / MANIFEST_NAME).read_bytes())["identity"]
    env = {**os.environ, "PREHEAT_PEERS": "127.0.0.1:9"}  # discard port: nothing listens there
    with standby("--allow-model", "preheat://*", "--cache-dir", str(tmp_path / "cache"), env=env) as server:
        client = Client(server.url)
        status, _ = load(client, f"preheat://{identity}")
        assert status == 500
        state = health(client)
        assert state["status"] == "standby"
        assert state["last_error"]
        assert complete(client) == 503


# -- who may activate what -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    allowed = tmp_path_factory.mktemp("allowed")
    env = {**os.environ, "PREHEAT_API_KEY": "sekret", "PREHEAT_ADMIN_KEY": "admin-sekret"}
    with standby("--allow-model", str(allowed / "*"), env=env) as server:
        yield server, allowed


def test_control_routes_need_the_admin_key_and_the_api_key_is_not_it(guarded: tuple[ServerProcess, Path]) -> None:
    server, allowed = guarded
    for path in ("/v1/preheat/load", "/v1/preheat/sleep", "/v1/preheat/wake"):
        assert Client(server.url).post(path, {"model": str(allowed / "m")}).status == 401, path
        reply = Client(server.url, api_key="sekret").post(path, {"model": str(allowed / "m")})
        assert (reply.status, reply.json()["error"]["code"]) == (403, "invalid_admin_key"), path
    assert health(Client(server.url))["status"] == "standby"


@pytest.mark.parametrize(
    "model",
    ["/etc", "http://elsewhere/model", "preheat://anything", "{allowed}/../secret", "{allowed}/x\n", ""],
)
def test_a_model_outside_allow_model_is_refused(guarded: tuple[ServerProcess, Path], model: str) -> None:
    server, allowed = guarded
    admin = Client(server.url, api_key="admin-sekret")
    reply = admin.post("/v1/preheat/load", {"model": model.format(allowed=allowed)})
    assert reply.status in (400, 403), reply.body
    assert health(Client(server.url))["status"] == "standby"


def test_a_symlink_out_of_an_allowed_directory_is_refused(tmp_path: Path, kv_model: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "sneaky").symlink_to(kv_model)
    assert refusal(str(allowed / "sneaky"), [str(allowed / "*")]) is not None
    real = allowed / "real"
    shutil.copytree(kv_model, real)
    assert refusal(str(real), [str(allowed / "*")]) is None


def test_allow_model_refuses_uris_that_could_name_something_else() -> None:
    patterns = ["https://models.internal/*", "s3://models/*"]
    assert refusal("https://models.internal/llama", patterns) is None
    assert refusal("s3://models/team/llama", patterns) is None
    for sneaky in (
        "https://models.internal/../admin",
        "https://user:pw@models.internal/llama",
        "https://models.internal/llama?x=1",
        "https://models.internal.evil.com/llama",
        "file:///etc/passwd",
    ):
        assert refusal(sneaky, patterns) is not None, sneaky


def test_without_allow_model_only_the_operators_model_is_allowed(kv_model: Path) -> None:
    settings = ServeSettings.resolve({"model": str(kv_model)}, {})
    assert refusal(str(kv_model), settings.allowed_models) is None
    assert refusal(str(kv_model.parent), settings.allowed_models) is not None


def test_standby_needs_allow_model_and_an_admin_key_beyond_loopback() -> None:
    with pytest.raises(ConfigError, match="--allow-model"):
        ServeSettings.resolve({"standby": True}, {})
    with pytest.raises(ConfigError, match="ADMIN_KEY"):
        ServeSettings.resolve({"standby": True, "allow_model": ["s3://m/*"], "host": "0.0.0.0"}, {})
    with pytest.raises(ConfigError, match="ADMIN_KEY"):  # the API key alone never opens the control routes
        ServeSettings.resolve({"standby": True, "allow_model": ["s3://m/*"], "host": "0.0.0.0", "api_key": "k"}, {})
    env = {"PREHEAT_ALLOW_MODEL": "s3://m/*,/models/*", "PREHEAT_ADMIN_KEY": "k"}
    ok = ServeSettings.resolve({"standby": True, "host": "0.0.0.0"}, env)
    assert ok.allowed_models == ("s3://m/*", "/models/*")


def test_the_health_of_a_replica_is_never_200_before_it_serves(origin_dir: Path, tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []
    stop = threading.Event()
    cache = str(tmp_path / "cache")
    with FileServer(origin_dir) as origin, standby("--allow-model", f"{origin.url}/*", "--cache-dir", cache) as server:
        client = Client(server.url)

        def watch() -> None:
            while not stop.is_set():
                seen.append(health(client))  # asserts 200 <=> "ok" on every answer

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            assert load(client, f"{origin.url}/{NAME}")[0] == 200
        finally:
            stop.set()
            watcher.join(timeout=30)
    assert {"standby", "loading"} & {str(s["status"]) for s in seen}


# -- behind the router: only a ready replica gets traffic ----------------------------------------------------------
def test_a_router_sends_nothing_to_a_standby_or_sleeping_replica(kv_model: Path) -> None:
    from routing import replica_of, running_router, wait_until

    with (
        ServerProcess(str(kv_model), "--served-model-name", NAME) as serving,
        standby("--allow-model", str(kv_model), "--served-model-name", NAME) as waiting,
    ):
        serving.wait_ready(timeout=120)
        with running_router([serving.url, waiting.url], health_interval=0.1) as router:
            client = Client(router.url)
            replicas = {r.url: r for r in router.router.replicas}
            wait_until(lambda: replicas[serving.url].healthy, "the router to admit the serving replica")
            for _ in range(6):
                reply = client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
                assert reply.status == 200
                assert replica_of(reply) == serving.url  # round-robin, yet never the standby one
            assert load(Client(waiting.url), str(kv_model))[0] == 200
            wait_until(lambda: replicas[waiting.url].healthy, "the router to admit the activated replica")
            seen = {replica_of(client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})) for _ in range(6)}
            assert seen == {serving.url, waiting.url}
            assert Client(serving.url).post("/v1/preheat/sleep", {"level": 1}).status == 200
            wait_until(lambda: not replicas[serving.url].healthy, "the router to take the sleeping replica out")
            for _ in range(6):
                reply = client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
                assert reply.status == 200
                assert replica_of(reply) == waiting.url
