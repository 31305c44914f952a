"""The router's bounds on what replicas, engines and clients make it hold (issue 29, *Bounded routers*): a replica
that sends one huge server-sent event or a huge answer, an engine that publishes huge block hashes or a replay that
never ends, and a client whose prompt is megabytes long. Each ends with a clear error or a count, in bounded memory,
and never holds up other requests.

The replicas here are hostile doubles (tests/hostile.py's scripted server, a ZMQ replay socket that keeps sending);
the router is a real ``preheat router`` process whose memory is read from /proc, or its real parts in this process
where a test must see inside (the tokenizer held mid-prompt, the engine-event counters).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from enginewire import WirePublisher
from hostile import Answer, ScriptedServer
from preheat.core.errors import ConfigError
from preheat.core.procs import Child
from preheat.http.metrics import Counter
from preheat.kv.keys import chunk_keys
from preheat.router.engine_index import engine_fingerprint
from preheat.router.index import KVIndex
from preheat.router.prompts import INLINE_CHARS, PromptReader, context_window
from preheat.router.settings import RouterSettings
from preheat.router.upstream import Replica, parse_replica_spec
from preheat.router.zmq_events import EngineEventSubscriber, engine_events_counter
from preheat.text.tokenizer import TextTokenizer
from routing import NAME, wait_until
from serving import Client

MIB = 1024 * 1024
URL = "http://127.0.0.1:9"  # the engine replica the event tests feed (never asked over HTTP)
IDENTITY = "test-model"
BLOCK = 32
PROMPT = list(range(1000, 1000 + 2 * BLOCK))


# --- a router process in front of a hostile replica ------------------------------------------------------------------


def replica(answer: Callable[[str], Answer]) -> Callable[[str, str, dict[str, str]], Answer]:
    """A scripted replica: healthy, and ``answer(path)`` for everything else."""

    def script(method: str, path: str, headers: dict[str, str]) -> Answer:
        if path == "/health":
            return 200, {"Content-Type": "application/json", "Content-Length": "2"}, [b"{}"]
        return answer(path)

    return script


@contextlib.contextmanager
def router_in_front_of(url: str, *flags: str) -> Iterator[tuple[int, str]]:
    """A ``preheat router`` process in front of the replica at ``url``, once the replica is in rotation: its pid
    and URL."""
    with Child("preheat router", ["router", "--replica", url, "--port", "0", *flags], merge_stderr=True) as router:
        address = router.wait_address(60.0)
        wait_until(lambda: Client(address).get("/health").status == 200, "the replica in rotation", 60.0)
        yield router.pid, address


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@contextlib.contextmanager
def peak_growth(pid: int) -> Iterator[list[int]]:
    """How far (KiB) the process's resident memory rose above where it was, at its highest, within the block."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = memory_kib(pid, "VmRSS")
    grown = [0]
    yield grown
    grown[0] = memory_kib(pid, "VmHWM") - before


def get_all(url: str, path: str) -> tuple[int, bytes]:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_a_48_mib_event_ends_its_stream_with_a_clear_error_and_is_never_held_whole() -> None:
    def one_huge_event(path: str) -> Answer:
        def pieces() -> Iterator[bytes]:
            yield b'data: {"choices": [{"text": "a"}]}\n\n'  # the stream has started: no other replica can take over
            yield b'data: {"choices": [{"text": "'
            for _ in range(48 * 16):
                yield b"x" * 65536
            yield b'"}]}\n\ndata: [DONE]\n\n'

        return 200, {"Content-Type": "text/event-stream"}, pieces()

    with ScriptedServer(replica(one_huge_event)) as hostile, router_in_front_of(hostile.url) as (pid, url):
        with peak_growth(pid) as grown:
            status, body = get_all(url, "/v1/stream")
        errors = Client(url).metric("preheat_router_errors_total", code="event_too_large")
        still_serving = Client(url).get("/health").status
    events = [e for e in body.split(b"\n\n") if e]
    assert status == 200
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "event_too_large"
    assert "--max-event-bytes" in error["message"]
    assert events[0] == b'data: {"choices": [{"text": "a"}]}'
    assert len(body) < 64 * 1024  # nothing of the huge event went out
    assert errors == 1
    assert grown[0] < 32 * 1024, f"the router grew by {grown[0]} KiB for one event"  # the old router: ~174 MB
    assert still_serving == 200


def test_an_answer_over_the_cap_is_a_502_and_is_never_read() -> None:
    size = 80 * MIB  # over the 64 MiB default

    def huge_answer(path: str) -> Answer:
        body = (b"x" * 65536 for _ in range(size // 65536))
        return 200, {"Content-Type": "application/json", "Content-Length": str(size)}, body

    with ScriptedServer(replica(huge_answer)) as hostile, router_in_front_of(hostile.url) as (pid, url):
        with peak_growth(pid) as grown:
            reply = Client(url).get("/v1/models")
        errors = Client(url).metric("preheat_router_errors_total", code="answer_too_large")
        refused = Client(url).metric(
            "preheat_router_refused_answers_total", code="answer_too_large", replica=hostile.url
        )
    assert reply.status == 502  # no other replica to take the request
    assert reply.json()["error"]["code"] == "answer_too_large"
    assert errors == 1
    assert refused == 1
    assert grown[0] < 16 * 1024, f"the router grew by {grown[0]} KiB"


HONEST_ANSWER = b'{"choices": [{"text": "honest"}]}'
HONEST_EVENTS = b'data: {"choices": [{"text": "honest"}]}\n\ndata: [DONE]\n\n'


def honest(path: str) -> Answer:
    if path.startswith("/v1/stream"):
        return 200, {"Content-Type": "text/event-stream"}, [HONEST_EVENTS]
    return 200, {"Content-Type": "application/json", "Content-Length": str(len(HONEST_ANSWER))}, [HONEST_ANSWER]


def refusals(path: str) -> Answer:
    """Answers a router must refuse before relaying a byte: too large by Content-Length, a first event over the
    bound, a stream cut before its first event."""
    if path == "/v1/too-large":
        return 200, {"Content-Type": "application/json", "Content-Length": str(1 << 40)}, [b"{"]
    if path == "/v1/stream-huge-first":
        return 200, {"Content-Type": "text/event-stream"}, (b"x" * 65536 for _ in range(64))  # 4 MiB, no event end
    if path == "/v1/stream-cut":
        return 200, {"Content-Type": "text/event-stream"}, cut_mid_event()
    raise AssertionError(path)


def cut_mid_event() -> Iterator[bytes]:
    yield b'data: {"cho'
    raise ConnectionAbortedError("cut")  # an OSError: ScriptedServer closes the connection, with no last chunk


@pytest.mark.parametrize(
    ("path", "code"),
    [("/v1/too-large", "answer_too_large"), ("/v1/stream-huge-first", "event_too_large"),
     ("/v1/stream-cut", "replica_failed")],
)  # fmt: skip
def test_an_answer_refused_before_its_first_byte_is_retried_on_another_replica(path: str, code: str) -> None:
    with ScriptedServer(replica(refusals)) as hostile, ScriptedServer(replica(honest)) as good:
        flags = ["--replica", good.url, "--policy", "round-robin", "--max-event-bytes", "1MiB"]
        with router_in_front_of(hostile.url, *flags) as (_, url):
            wait_until(lambda: all(r["healthy"] for r in Client(url).get("/health").json()["replicas"]),
                       "both replicas in rotation", 60.0)  # fmt: skip
            answers = [get_all(url, path) for _ in range(4)]
            refused = Client(url).metric("preheat_router_refused_answers_total", replica=hostile.url, code=code)
            retries = Client(url).metric("preheat_router_retries_total")
            errors = Client(url).metric("preheat_router_errors_total", code=code)
    honest_body = HONEST_EVENTS if path.startswith("/v1/stream") else HONEST_ANSWER
    assert answers == [(200, honest_body)] * 4  # the client never saw the hostile replica's answer
    assert [p for _, p in hostile.requests if p == path]  # it was asked, and refused
    assert refused == len([p for _, p in hostile.requests if p == path]) == retries
    assert errors == 0


def test_a_stream_cut_anywhere_is_relayed_byte_for_byte() -> None:
    events = b"".join(b'data: {"n": %d, "text": "%s"}\n\n' % (n, b"ab\ncd" * n) for n in range(50))
    events += b"data: [DONE]\n\n"

    def in_odd_pieces(path: str) -> Answer:
        return 200, {"Content-Type": "text/event-stream"}, (events[i : i + 7] for i in range(0, len(events), 7))

    flags = ("--max-event-bytes", "1KiB")  # every event is shorter
    with ScriptedServer(replica(in_odd_pieces)) as hostile, router_in_front_of(hostile.url, *flags) as (_, url):
        status, body = get_all(url, "/v1/stream")
    assert (status, body) == (200, events)


# --- prompts: read only as far as routing can use them, never one behind another --------------------------------------


def body(prompt: str) -> bytes:
    return json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 1}).encode()


def test_a_4_mib_prompt_is_read_only_as_far_as_the_context_window(kv_model: Path) -> None:
    reader = PromptReader.from_model(str(kv_model))
    window = context_window(str(kv_model))
    prompt = "hello world, the cache  holds\n" * (4 * MIB // 30)
    request = reader.read("/v1/completions", body(prompt), None)
    whole = TextTokenizer.from_dir(str(kv_model)).encode(prompt[: 64 * window])  # far past the window's tokens
    assert window == 2048  # the tiny model's config.json
    assert request.token_ids == whole[:window]


def test_a_chat_whose_pieces_were_read_before_needs_no_tokenizer(kv_model: Path) -> None:
    """What the event loop reads itself (``on_loop``): a chat whose every piece is known, or whose new pieces are
    short, with the ids a whole encoding gives; anything longer is left for a thread (None), as is a long plain
    prompt."""
    reader = PromptReader.from_model(str(kv_model))
    tokenizer = TextTokenizer.from_dir(str(kv_model))
    document = "Reference: " + "the long shared document " * 12  # past INLINE_CHARS
    assert len(document) > INLINE_CHARS
    messages = [{"role": "system", "content": document}, {"role": "user", "content": "The capital of France is"}]
    chat = json.dumps({"model": NAME, "messages": messages}).encode()
    assert reader.read("/v1/chat/completions", chat, None, on_loop=True) is None
    first = reader.read("/v1/chat/completions", chat, "s-1")
    again = reader.read("/v1/chat/completions", chat, "s-1", on_loop=True)
    assert again is not None
    assert again.token_ids == first.token_ids == tokenizer.encode_chat(messages)
    assert again.session == "s-1"
    # The next question about the same document: its one new piece is short, so the loop encodes it itself.
    messages[1]["content"] = "And of Germany?"
    follow_up = json.dumps({"model": NAME, "messages": messages}).encode()
    read = reader.read("/v1/chat/completions", follow_up, None, on_loop=True)
    assert read is not None
    assert read.token_ids == tokenizer.encode_chat(messages)
    assert reader.read("/v1/completions", body(document), None, on_loop=True) is None
    short = reader.read("/v1/completions", body("The capital of France is"), None, on_loop=True)
    assert short is not None
    assert short.token_ids == tokenizer.encode("The capital of France is")


class HeldTokenizer:
    """The ``tokenizers`` library's tokenizer, held inside any encoding of a long text until ``release`` is set:
    what a 4 MiB prompt looks like to other requests while it is being tokenized, without depending on how fast."""

    def __init__(self, real: Any) -> None:  # Any: tokenizers.Tokenizer
        self.real = real
        self.started, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:  # Any: whatever the library's tokenizer has
        return getattr(self.real, name)

    def hold(self, text: str) -> None:
        if len(text) > 10_000:
            self.started.set()
            self.release.wait(30)

    def encode(self, text: str, **options: Any) -> Any:  # Any: the library's keywords and Encoding
        self.hold(text)
        return self.real.encode(text, **options)

    def encode_batch(self, texts: list[str], **options: Any) -> Any:  # Any: as above
        self.hold(texts[0])
        return self.real.encode_batch(texts, **options)


def test_a_long_prompt_being_tokenized_does_not_hold_up_a_short_one(kv_model: Path) -> None:
    real = TextTokenizer.from_dir(str(kv_model))
    held = HeldTokenizer(real.tokenizer)
    tokenizer = TextTokenizer(
        held,  # type: ignore[arg-type]  # the library's tokenizer, wrapped to hold it mid-encoding
        eos_ids=real.eos_ids, special_tokens=real.special_tokens, template=real.template, where=real.where,
    )  # fmt: skip
    reader = PromptReader(tokenizer)
    finished: list[str] = []

    def read_long() -> None:
        reader.read("/v1/completions", body("word " * MIB), None)
        finished.append("long")

    long = threading.Thread(target=read_long)
    long.start()
    try:
        assert held.started.wait(30), "the long prompt never reached the tokenizer"
        short = reader.read("/v1/completions", body("Hello there"), None)  # on this thread: blocks if locked out
        finished.append("short")
    finally:
        held.release.set()
        long.join(60)
    assert finished == ["short", "long"]
    assert short.token_ids == real.encode("Hello there")


# --- engine KV events: bounded frames and hashes, replays that end ----------------------------------------------------


def stored_batch(hashes: list[int | bytes], tokens: list[int]) -> bytes:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
             "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    return msgspec.msgpack.encode([1.0, [event], 0])


class Subscribed:
    """An ``EngineEventSubscriber`` on one engine replica (out of rotation: no replay when it starts)."""

    def __init__(self, publisher: WirePublisher, replay: str | None = None, **bounds: float) -> None:
        spec = parse_replica_spec(f"{URL},events={publisher.endpoint}" + (f",replay={replay}" if replay else ""))
        assert spec.events is not None
        self.replica, self.index = Replica(spec.url), KVIndex()
        self.counter: Counter = engine_events_counter()
        self.subscriber = EngineEventSubscriber(
            [(self.replica, spec.events)],
            self.index,
            self.counter,
            identity=IDENTITY,
            **bounds,  # type: ignore[arg-type]
        )

    def count(self, outcome: str) -> float:
        return self.counter.value(replica=URL, outcome=outcome)

    def holds(self, tokens: list[int]) -> bool:
        state = self.index.state(URL)
        wanted = chunk_keys(engine_fingerprint(IDENTITY, BLOCK), tokens, BLOCK)
        return state is not None and all(k in state.gpu for k in wanted)


@contextlib.contextmanager
def subscribed(publisher: WirePublisher, replay: str | None = None, **bounds: float) -> Iterator[Subscribed]:
    sub = Subscribed(publisher, replay, **bounds)
    sub.subscriber.start()
    publisher.wait_subscribed()
    try:
        yield sub
    finally:
        sub.subscriber.stop()


def test_oversized_block_hashes_are_refused_and_counted() -> None:
    publisher = WirePublisher(replay=False)
    try:
        with subscribed(publisher) as sub:
            publisher.publish(stored_batch([b"h" * 65, b"i" * 65], PROMPT))  # past the 64-byte bound
            publisher.publish(stored_batch([b"h" * 32, b"i" * 32], PROMPT))  # vLLM's sha256 hashes
            wait_until(lambda: sub.count("batches") == 1, "the good batch")
            assert sub.count("oversized") == 1
            assert sub.count("stored") == 2
            assert sub.holds(PROMPT)
    finally:
        publisher.close()


def test_a_frame_over_the_cap_is_dropped_before_it_is_held() -> None:
    publisher = WirePublisher(replay=False)
    try:
        with subscribed(publisher) as sub:
            # 50 one-MiB "block hashes": ZMQ drops the frame (MAXMSGSIZE) and reconnects; nothing is decoded.
            publisher.publish(stored_batch([bytes([i]) * MIB for i in range(50)], list(range(50 * BLOCK))))

            def published_once_back() -> bool:  # batches sent before the subscriber is back are lost: send again
                publisher.publish(stored_batch([1, 2], PROMPT))
                return sub.holds(PROMPT)

            wait_until(published_once_back, "a batch after the dropped one")
            assert sub.count("stored") == 2 * sub.count("batches")  # only the 2-block batches were ever applied
    finally:
        publisher.close()


class EndlessReplay:
    """A replay socket that answers a request with batches that never end (no end-of-replay marker), ``every``
    seconds apart, or as fast as it can."""

    EMPTY = msgspec.msgpack.encode([1.0, [], 0])

    def __init__(self, every: float = 0.0) -> None:
        self.every = every
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        clients: list[bytes] = []
        seq = 0
        while not self._stop.is_set():
            if self.socket.poll(1):
                clients.append(self.socket.recv_multipart()[0])
            for client in clients:  # a ROUTER drops what a full peer cannot take: it never blocks here
                self.socket.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), self.EMPTY])
            seq += 1
            if self.every:
                self._stop.wait(self.every)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.socket.close(linger=0)
        self.context.term()


def test_a_replay_that_never_ends_is_cut_short_by_its_batch_cap() -> None:
    publisher, replay = WirePublisher(replay=False, start_seq=5), EndlessReplay()
    try:
        with subscribed(publisher, replay.endpoint, replay_batches=200) as sub:
            publisher.publish(stored_batch([1, 2], PROMPT))  # seq 5: 0..4 are asked of the endless replay
            wait_until(lambda: sub.holds(PROMPT), "the live batch after the replay")
            assert sub.count("replay_cut") == 1
    finally:
        replay.close()
        publisher.close()


def test_a_replay_that_trickles_forever_is_cut_short_by_its_deadline() -> None:
    publisher, replay = WirePublisher(replay=False, start_seq=5), EndlessReplay(every=0.1)
    try:
        with subscribed(publisher, replay.endpoint, replay_deadline=3.0) as sub:
            publisher.publish(stored_batch([1, 2], PROMPT))
            wait_until(lambda: sub.holds(PROMPT), "the live batch after the replay")
            assert sub.count("replay_cut") == 1
    finally:
        replay.close()
        publisher.close()


def test_bounds_that_make_no_sense_are_refused_naming_the_flag() -> None:
    base = {"replicas": [URL]}
    for flags, named in (
        ({"max_event_bytes": "lots"}, "lots"),
        ({"max_answer_bytes": "0"}, "--max-answer-bytes"),
        ({"max_connections": 0}, "--max-connections"),
        ({"header_timeout": 0.0}, "--header-timeout"),
        ({"max_prompt_tokens": 0}, "--max-prompt-tokens"),
    ):
        with pytest.raises(ConfigError, match=named):
            RouterSettings.resolve({**base, **flags}, {})
