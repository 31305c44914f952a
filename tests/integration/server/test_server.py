"""``preheat serve`` spoken to over HTTP, as an OpenAI client would: a real subprocess on 127.0.0.1 serving a tiny
random-weight Llama (its text is noise, but every byte of the pipeline is real), plus SmolLM2 for one real answer."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.core.errors import ConfigError, HTTPClientError
from preheat.router.cluster import ServerProcess
from preheat.server.settings import ServeSettings
from preheat.testing.fileserver import FileServer
from preheat.testing.smollm2 import SmolLM2
from preheat.testing.synthetic import make_tiny_servable_model
from serving import Client, Gate

NAME = "tiny"
MAX_LEN = 512
LONG = "The capital of France is"  # greedy from this prompt never meets the end token on the tiny model
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_servable_model(tmp_path_factory.mktemp("servable") / NAME))


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model, "--served-model-name", NAME, "--max-model-len", str(MAX_LEN)) as process:
        process.wait_ready(timeout=120)
        yield process


@pytest.fixture
def client(server: ServerProcess) -> Client:
    return Client(server.url)


def wait_for(condition: object, what: str, deadline: float = 60.0) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``deadline`` seconds (a hang, not a speed check)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


# -- answers ---------------------------------------------------------------------------------------------------------
def test_completion_returns_text_and_usage(client: Client) -> None:
    reply = client.post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["object"] == "text_completion"
    assert body["model"] == NAME
    choice = body["choices"][0]
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= 5
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_completion_answers_as_the_assistant(client: Client) -> None:
    reply = client.post("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 6, "temperature": 0})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["completion_tokens"] <= 6


def test_model_may_be_omitted(client: Client) -> None:
    assert client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status == 200


def test_stream_carries_the_same_text_as_the_whole_answer(client: Client) -> None:
    request = {"model": NAME, "prompt": LONG, "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/completions", request).json()
    stream = client.stream("/v1/completions", request)
    assert stream.status == 200
    assert stream.headers["Content-Type"].startswith("text/event-stream")
    assert stream.done, "a stream ends with data: [DONE]"
    assert stream.text == whole["choices"][0]["text"]
    assert stream.finish_reason == whole["choices"][0]["finish_reason"] == "length"
    assert stream.usage is None, "usage only when stream_options.include_usage asks for it"


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client: Client) -> None:
    stream = client.stream(
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 8, "temperature": 0, "stream_options": {"include_usage": True}},
    )
    assert stream.status == 200
    assert stream.done
    assert all(c["object"] == "chat.completion.chunk" for c in stream.chunks)
    assert stream.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *body, last = stream.chunks
    assert last["choices"] == []
    assert all(c["usage"] is None for c in body), "every chunk but the last carries usage: null"
    usage = last["usage"]
    assert usage["completion_tokens"] == 8 or stream.finish_reason == "stop"
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert len({c["id"] for c in stream.chunks}) == 1


def test_greedy_decoding_is_deterministic(client: Client) -> None:
    request = {"prompt": LONG, "max_tokens": 16, "temperature": 0}
    first, second = (client.post("/v1/completions", request).json()["choices"][0]["text"] for _ in range(2))
    assert first == second


def test_a_seed_reproduces_a_sampled_answer(client: Client) -> None:
    def sample(seed: int) -> str:
        request = {"prompt": "Hello", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": seed}
        return str(client.post("/v1/completions", request).json()["choices"][0]["text"])

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1, "different seeds sample different texts"


def test_stop_string_ends_the_answer_before_it(client: Client) -> None:
    request: dict[str, object] = {"prompt": LONG, "max_tokens": 40, "temperature": 0}
    text = client.post("/v1/completions", request).json()["choices"][0]["text"]
    cut = next(i for i in range(4, len(text) - 2) if text.find(text[i : i + 2]) == i)
    stop = text[cut : cut + 2]
    for stops in (stop, [stop, "\u2603never"]):
        body = client.post("/v1/completions", {**request, "stop": stops}).json()
        assert body["choices"][0]["text"] == text[:cut]
        assert body["choices"][0]["finish_reason"] == "stop"


def test_models_lists_the_served_name(client: Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [NAME]
    assert body["data"][0]["max_model_len"] == MAX_LEN


# -- errors ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", b"{not json", None, "invalid_json"),
        ("/v1/completions", b"[1, 2]", None, "invalid_json"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens", "invalid_type"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature", "invalid_type"),
        ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p", "invalid_value"),
        ("/v1/completions", {"prompt": "Hi", "stop": 5}, "stop", "invalid_type"),
        ("/v1/completions", {"prompt": "Hi", "seed": 1.5}, "seed", "invalid_type"),
        ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream", "invalid_type"),
        ("/v1/completions", {"prompt": {"text": "Hi"}}, "prompt", "invalid_type"),
        ("/v1/completions", {"prompt": "Hi", "n": 2}, "n", "unsupported"),
        ("/v1/completions", {"prompt": "word " * 600}, "prompt", "context_length_exceeded"),
        ("/v1/chat/completions", {"messages": "Hi"}, "messages", "invalid_type"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 600}]},
            "messages",
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_get_400_with_an_openai_error(
    client: Client, path: str, body: object, param: str | None, code: str | None
) -> None:
    reply = client.post(path, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    assert error["message"]


def test_unknown_model_is_404_with_openais_error_body(client: Client) -> None:
    # OpenAI and vLLM answer 404 here; a 400 told clients their request was malformed.
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": []})):
        reply = client.post(path, {**body, "model": "gpt-4"})
        assert reply.status == 404, reply.body
        error = reply.json()["error"]
        assert {k: error[k] for k in ("type", "param", "code")} == {
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        assert "'gpt-4'" in error["message"]
        assert NAME in error["message"]


def test_unknown_route_is_404_and_wrong_method_405(client: Client) -> None:
    assert client.get("/v1/nothing").status == 404
    assert client.get("/v1/completions").status == 405


def test_a_prompt_too_long_does_not_harm_the_next_request(client: Client) -> None:
    assert client.post("/v1/completions", {"prompt": "word " * 600}).status == 400
    assert client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status == 200


# -- disconnects -----------------------------------------------------------------------------------------------------
def test_a_streaming_client_that_leaves_stops_its_generation(client: Client) -> None:
    aborted = client.metric("preheat_generations_finished_total", reason="abort")
    generated = client.metric("preheat_generated_tokens_total")
    conn = client.connect()
    body = {"prompt": LONG, "max_tokens": MAX_LEN, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=client.headers())
    response = conn.getresponse()
    assert response.status == 200
    assert response.fp is not None
    assert response.fp.readline()  # the first chunk arrived: generation is under way
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: client.metric("preheat_generations_finished_total", reason="abort") > aborted, "an abort")
    made = client.metric("preheat_generated_tokens_total") - generated
    assert made < MAX_LEN - len(LONG.split()) - 1, "generation stopped well before max_tokens"
    assert client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status == 200


def test_a_waiting_non_streaming_client_that_leaves_stops_its_generation(client: Client) -> None:
    aborted = client.metric("preheat_generations_finished_total", reason="abort")
    generated = client.metric("preheat_generated_tokens_total")
    sock = socket.create_connection((client.host, client.port))
    raw = json.dumps({"prompt": LONG, "max_tokens": MAX_LEN, "temperature": 0}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + raw)
    wait_for(lambda: client.metric("preheat_requests_running") == 1, "the generation to start")
    sock.close()
    wait_for(lambda: client.metric("preheat_generations_finished_total", reason="abort") > aborted, "an abort")
    assert client.metric("preheat_generated_tokens_total") - generated < MAX_LEN - 10


def test_sigterm_during_generation_exits_cleanly(tiny_model: str) -> None:
    """Kubernetes stops pods with SIGTERM while they generate: that is a clean exit (0), not a C++ abort (-6)."""
    with ServerProcess(tiny_model) as process:
        process.wait_ready(timeout=120)
        client = Client(process.url)
        body = {"prompt": LONG, "max_tokens": MAX_LEN, "temperature": 0, "stream": True}
        streams = [threading.Thread(target=_ignore_errors, args=(client.stream, "/v1/completions", body)) for _ in "ab"]
        for thread in streams:
            thread.start()
        wait_for(lambda: client.metric("preheat_requests_running") == 1, "the generation to start")
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(timeout=60) == 0, process.lines[-5:]
        for thread in streams:
            thread.join(timeout=60)


def _ignore_errors(call: object, *args: object) -> None:
    """Run a client call whose connection the test expects the server to cut."""
    with contextlib.suppress(HTTPClientError, OSError, http.client.HTTPException, ValueError):
        call(*args)  # type: ignore[operator]


# -- observability ---------------------------------------------------------------------------------------------------
def test_health_is_200_once_ready(client: Client) -> None:
    reply = client.get("/health")
    assert reply.status == 200
    assert reply.json()["status"] == "ok"


def test_metrics_are_prometheus_text_with_the_serving_series(client: Client) -> None:
    client.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    reply = client.get("/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = reply.body.decode()
    for name, kind in [
        ("preheat_time_to_first_token_seconds", "histogram"),
        ("preheat_generation_tokens_per_second", "histogram"),
        ("preheat_prompt_tokens_total", "counter"),
        ("preheat_prompt_tokens_cached_total", "counter"),
        ("preheat_generated_tokens_total", "counter"),
        ("preheat_requests_total", "counter"),
        ("preheat_queue_depth", "gauge"),
        ("preheat_load_stage_seconds", "gauge"),
    ]:
        assert f"# TYPE {name} {kind}" in text
    client_ = Client(f"http://{client.host}:{client.port}")
    assert client_.metric("preheat_time_to_first_token_seconds_count") >= 1
    assert client_.metric("preheat_time_to_first_token_seconds_bucket", le="+Inf") >= 1
    assert client_.metric("preheat_prompt_tokens_total") > 0
    assert client_.metric("preheat_generated_tokens_total") >= 3
    assert client_.metric("preheat_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert client_.metric("preheat_load_stage_seconds", stage="weight_load") > 0
    assert client_.metric("preheat_queue_depth") == 0


def test_timeline_stages_are_ordered_and_cover_the_time_to_ready(client: Client) -> None:
    client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    timeline = client.get("/v1/preheat/timeline").json()
    stages = timeline["stages"]
    names = [s["name"] for s in stages]
    by_name = {s["name"]: s for s in stages}
    assert names[:2] == ["imports", "config"]
    assert names[-4:-1] == ["model_build", "warmup", "ready"]
    assert {"engine_imports", "model_config", "page_in", "tokenizer", "weight_load"} <= set(names)
    assert "first_request_ttft" in names
    starts = [s["start"] for s in stages]
    assert starts == sorted(starts)
    assert all(s["end"] >= s["start"] for s in stages)
    ready = by_name["ready"]["start"]
    # The model's own files are read while torch imports: those stages start before the import ends ...
    for early in ("model_config", "page_in", "tokenizer"):
        assert by_name[early]["start"] < by_name["engine_imports"]["end"], early
    # ... and the weights load once torch is there; the model is built after, then warmed, then ready.
    assert by_name["weight_load"]["start"] >= by_name["engine_imports"]["end"]
    assert by_name["model_build"]["start"] >= by_name["weight_load"]["end"]
    assert by_name["warmup"]["start"] >= max(by_name["model_build"]["end"], by_name["tokenizer"]["end"])
    assert by_name["ready"]["start"] >= by_name["warmup"]["end"]
    # Together the stages cover the whole way to ready, gaps being thread hand-offs (arithmetic, not a speed check):
    # 5%, and 0.1 s more for the hand-offs of a busy 2-core machine (a CI run saw 64 ms of them in a 1.18 s start).
    covered, reached = 0.0, 0.0
    for s in sorted(stages[: names.index("ready")], key=lambda s: s["start"]):
        covered += max(0.0, s["end"] - max(s["start"], reached))
        reached = max(reached, s["end"])
    assert abs(covered - ready) <= 0.05 * ready + 0.1, (covered, ready)
    ttft = by_name["first_request_ttft"]
    assert ttft["detail"]["ttft"] > 0
    assert ttft["start"] >= ready
    assert timeline["total"] == max(s["end"] for s in stages)
    assert by_name["weight_load"]["bytes"] > 0


def test_what_runs_while_torch_imports_needs_no_torch(tiny_model: str) -> None:
    code = (
        "import sys, preheat.server.app, preheat.server.lifecycle\n"
        "from preheat.server.prepare import prepare\n"
        "from preheat.text.process import TokenizerProcess\n"
        "from preheat.core.timeline import Timeline\n"
        f"prepared = prepare({tiny_model!r}, Timeline(), TokenizerProcess.start(), premap=True)\n"
        "prepared.tokenizer.result()\n"
        "print('torch' in sys.modules, 'tokenizers' in sys.modules, len(prepared.mapped))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    # The tokenizer was built in its own process: this one has not even imported the tokenizers library.
    assert done.stdout.split() == ["False", "False", "1"]


def test_the_tokenizer_is_built_beside_torch_in_another_process_which_leaves_once_idle(
    tiny_model: str, client: Client
) -> None:
    client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    stages = {s["name"]: s for s in client.get("/v1/preheat/timeline").json()["stages"]}
    assert stages["tokenizer"]["detail"]["process"] == "own"
    assert stages["tokenizer"]["start"] < stages["engine_imports"]["end"]
    # The weights were mapped and populated while torch imported: the load only made views of them.
    assert stages["page_in"]["detail"]["mapped"] == 1
    assert stages["weight_load"]["detail"]["premapped"] is True
    child = stages["tokenizer"]["detail"]["pid"]
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)  # the server settles on its own copy after SETTLE_IDLE_S without a call
    assert not os.path.exists(f"/proc/{child}")
    chat = client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status == 200


def test_a_pull_through_the_node_cache_needs_no_torch(tiny_model: str, tmp_path: Path) -> None:
    # A URI's fetch runs while torch imports; importing torch there would wait for that import to finish.
    code = (
        "import sys, preheat.server.loading, preheat.server.peering\n"
        "from preheat.testing.fileserver import FileServer\n"
        "from preheat.store.cache import ModelCache\n"
        "from preheat.store.pull import pull\n"
        f"with FileServer({tiny_model!r}) as origin:\n"
        f"    pulled = pull(origin.url, ModelCache({str(tmp_path)!r}))\n"
        "print(pulled.bytes_fetched > 0, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["True", "False"]


# -- API key and the bounded queue ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tiny_model: str) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model, "--served-model-name", NAME, "--api-key", "sekret", "--max-queue", "1") as process:
        process.wait_ready(timeout=120)
        yield process


def test_api_key_is_required_on_v1_routes(guarded: ServerProcess) -> None:
    anonymous, wrong, right = Client(guarded.url), Client(guarded.url, "guess"), Client(guarded.url, "sekret")
    for who in (anonymous, wrong):
        reply = who.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert reply.status == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"
        assert reply.headers["WWW-Authenticate"] == "Bearer"
        assert who.get("/v1/preheat/timeline").status == 401
    assert right.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status == 200
    assert anonymous.get("/health").status == 200, "probes need no key"
    assert anonymous.get("/metrics").status == 200, "scrapers need no key"


def test_a_replicas_dashboard_logs_in_with_the_key_in_a_form_body(guarded: ServerProcess) -> None:
    browser = Client(guarded.url)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert browser.request("POST", "/dashboard", b"key=guess", form).status == 401
    assert browser.get("/dashboard/api/state").status == 401
    logged_in = browser.request("POST", "/dashboard", b"key=sekret", form)
    assert logged_in.status == 303
    cookie = logged_in.headers["Set-Cookie"].split(";", 1)[0]
    state = browser.request("GET", "/dashboard/api/state", headers={"Cookie": cookie})
    assert state.status == 200
    assert state.json()["replicas"]


@pytest.mark.parametrize(("path", "key", "status"), [("/v1/completions", "guess", 401), ("/v1/nowhere", "sekret", 404)])
def test_a_refusal_before_the_body_is_read_closes_the_connection(
    guarded: ServerProcess, path: str, key: str, status: int
) -> None:
    """A body the server never read must not be parsed as the keep-alive client's next request."""
    host, port = guarded.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = b'{"prompt": "GET /health HTTP/1.1", "max_tokens": 1}'
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {key}"})
    refused = conn.getresponse()
    refused.read()
    assert refused.status == status
    assert refused.headers["Connection"] == "close"
    conn.request("GET", "/health")  # http.client reconnects after 'Connection: close'; garbage would be a 400
    assert conn.getresponse().status == 200
    conn.close()


def test_a_full_queue_answers_429(guarded: ServerProcess) -> None:
    client = Client(guarded.url, "sekret")
    clients = 4
    statuses: list[int] = []
    bodies: list[bytes] = []
    barrier = threading.Barrier(clients, timeout=120)
    start = threading.Barrier(clients, timeout=30)

    def one() -> None:
        conn = client.connect()
        body = {"prompt": LONG, "max_tokens": 300, "temperature": 0, "stream": True}
        start.wait()
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=client.headers())
        response = conn.getresponse()
        statuses.append(response.status)
        if response.status != 200:
            bodies.append(response.read())
        barrier.wait()  # hold every admitted stream open until all clients have their answer
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(set(statuses)) == [200, 429], statuses
    assert statuses.count(200) <= 2, "one generating + --max-queue 1 waiting"
    error = json.loads(bodies[0])["error"]
    assert error["code"] == "queue_full"
    assert error["type"] == "rate_limit_error"
    assert client.metric("preheat_requests_total", endpoint="/v1/completions", status="429") >= 1


# -- loading: 503 until ready, with the model pulled through the node cache ------------------------------------------
def test_health_is_503_while_the_model_downloads_then_200(tiny_model: str, tmp_path: Path) -> None:
    with FileServer(Path(tiny_model).parent) as origin, Gate(origin.port) as gate:
        uri = f"{gate.url}/{NAME}"
        with ServerProcess(uri, "--cache-dir", str(tmp_path / "cache")) as process:
            client = Client(process.url)
            assert gate.waiting.wait(timeout=60), "the server asks the origin for the model"
            health = client.get("/health")
            assert health.status == 503
            assert health.json() == {"status": "loading", "stage": "fetch"}
            early = client.post("/v1/completions", {"prompt": "Hi"})
            assert early.status == 503
            assert early.json()["error"]["code"] == "model_loading"
            gate.open()
            process.wait_ready(timeout=120)
            assert client.get("/health").status == 200
            assert client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status == 200
            stages = {s["name"]: s for s in client.get("/v1/preheat/timeline").json()["stages"]}
    fetch = stages["fetch"]
    assert fetch["detail"]["cache"] == "miss"
    assert fetch["bytes"] > 0
    assert fetch["end"] <= stages["weight_load"]["start"]


def test_a_model_that_does_not_exist_fails_before_binding(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    command = [sys.executable, "-m", "preheat", "serve", missing, "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "listening" not in done.stdout
    assert f"model {missing!r} is not a directory" in done.stderr


def test_a_model_that_fails_to_load_ends_the_server_with_its_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with ServerProcess(str(tmp_path / "empty")) as process:
        assert process.proc.wait(timeout=120) == 1, "a server that cannot serve exits instead of staying unready"


def test_flags_win_over_environment_variables_which_win_over_defaults(tmp_path: Path) -> None:
    env = {"PREHEAT_PORT": "9001", "PREHEAT_MAX_QUEUE": "3", "PREHEAT_API_KEY": "k", "PREHEAT_MODEL": str(tmp_path)}
    settings = ServeSettings.resolve({"port": 9002, "model": None}, env)
    assert (settings.port, settings.max_queue, settings.api_key, settings.model) == (9002, 3, "k", str(tmp_path))
    assert settings.host == "127.0.0.1", "binds loopback unless told otherwise"
    assert settings.model_name == tmp_path.name
    with pytest.raises(ConfigError, match="PREHEAT_PORT"):
        ServeSettings.resolve({"model": str(tmp_path)}, {"PREHEAT_PORT": "eighty"})
    with pytest.raises(ConfigError, match="PREHEAT_MODEL"):
        ServeSettings.resolve({}, {})
    with pytest.raises(ConfigError, match="--device"):
        ServeSettings.resolve({"model": str(tmp_path), "device": "tpu"}, {})


# -- the real model ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2: SmolLM2) -> None:
    with ServerProcess(str(smollm2.path("keep")), "--served-model-name", "smollm2") as process:
        process.wait_ready(timeout=300)
        client = Client(process.url)
        reply = client.post(
            "/v1/chat/completions",
            {"model": "smollm2", "messages": CHAT, "max_tokens": 24, "temperature": 0},
        )
    assert reply.status == 200, reply.body
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]


def test_http_client_library_parses_our_chunked_stream(client: Client) -> None:
    """The standard library's chunked decoder accepts our framing byte for byte (no stray or missing CRLF)."""
    conn = http.client.HTTPConnection(client.host, client.port, timeout=60)
    body = json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True}).encode()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    first = conn.getresponse()
    first.read()
    conn.request("GET", "/health")  # keep-alive: the same connection serves the next request
    assert conn.getresponse().status == 200
    conn.close()
