"""``POST /v1/completions`` and ``/v1/chat/completions``: validate, tokenize, queue, relay the worker's tokens.

The request thread never touches the model: it tokenizes (under a lock), hands a ``Job`` to the single generation
worker, and turns the steps the worker produces into an OpenAI response, either one JSON body or server-sent events.

A client that goes away stops its generation. While streaming, the next write fails (EPIPE/ECONNRESET); before the
first byte is sent, and throughout a non-streaming request, the socket is checked between tokens (and every 50 ms
while waiting in line): a readable socket whose peek returns EOF means the client closed it.
"""

from __future__ import annotations

import queue
import time
import uuid
from typing import TYPE_CHECKING

from preheat.errors import PreheatError
from preheat.server import openai, sse
from preheat.server.worker import Job, QueueFullError

if TYPE_CHECKING:
    from preheat.engine import Engine, GenerationStep, SamplingParams
    from preheat.server.app import Handler

POLL_SECONDS = 0.05


class ClientGoneError(Exception):
    """The client closed the connection; its generation was cancelled."""


def handle_generation(handler: Handler, kind: str, body: bytes) -> None:
    """Answer one generation request on ``handler``'s connection."""
    arrived = time.monotonic()
    state = handler.state
    loaded = state.loaded
    if loaded is None or state.worker is None:
        message = "the model is still loading; retry when GET /health answers 200"
        error = openai.APIError(503, message, type="service_unavailable", code="model_loading")
        handler.send_error_json(error, {"Retry-After": "1"})
        return
    try:
        request = openai.parse_request(body, kind, state.settings.model_name)
        prompt_ids = _tokenize(handler, loaded.engine, request)
        job = Job(prompt_ids, _sampling(loaded.engine, request, len(prompt_ids)), arrived=arrived)
        state.worker.submit(job)
    except openai.APIError as exc:
        handler.send_error_json(exc)
        return
    except QueueFullError as exc:
        error = openai.APIError(429, f"server busy: {exc}; retry later", type="rate_limit_error", code="queue_full")
        handler.send_error_json(error, {"Retry-After": "1"})
        return
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    relay = _Relay(handler, job, request, request_id)
    try:
        if request.stream:
            relay.stream()
        else:
            relay.whole()
    except ClientGoneError:
        job.cancel()
        handler.close_connection = True
        if not relay.answered:  # a stream that already counted its 200 is not counted twice
            handler.count(499)  # nginx's "client closed request": the request ended without an answer
    finally:
        job.cancel()  # a no-op for a finished job; stops the worker for any other way out of here
        _observe(handler, job)


def _tokenize(handler: Handler, engine: Engine, request: openai.GenerationRequest) -> list[int]:
    try:
        with handler.state.tokenize_lock:
            if request.messages is not None:
                ids = engine.encode_chat(request.messages)
            elif isinstance(request.prompt, str):
                ids = engine.encode_prompt(request.prompt)
            else:
                ids = list(request.prompt or [])
    except PreheatError as exc:  # e.g. a chat the model's template cannot render
        raise openai.bad_request(str(exc), param="messages" if request.messages else "prompt") from None
    param = "messages" if request.messages is not None else "prompt"
    if not ids:
        raise openai.bad_request("the prompt is empty", param=param)
    if len(ids) >= engine.max_model_len:
        raise openai.bad_request(
            f"this model's maximum context length is {engine.max_model_len} tokens, and the prompt alone has "
            f"{len(ids)}: shorten it to at most {engine.max_model_len - 1}",
            param=param,
            code="context_length_exceeded",
        )
    try:
        engine.check_prompt(ids)  # token ids out of the vocabulary; pure, so safe outside the worker
    except PreheatError as exc:
        raise openai.bad_request(str(exc), param=param) from None
    return ids


def _sampling(engine: Engine, request: openai.GenerationRequest, prompt_len: int) -> SamplingParams:
    from preheat.engine import SamplingParams

    room = engine.max_model_len - prompt_len
    # A max_tokens past the context is clamped rather than refused: the answer's finish_reason "length" says so.
    max_tokens = room if request.max_tokens is None else min(request.max_tokens, room)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=list(request.stop),
        seed=request.seed,
    )


class _Relay:
    """Turns one job's steps into the HTTP answer, watching for the client going away."""

    def __init__(self, handler: Handler, job: Job, request: openai.GenerationRequest, request_id: str) -> None:
        self.handler, self.job, self.request, self.request_id = handler, job, request, request_id
        self.created = int(time.time())
        self.cached = 0
        self.prompt_tokens = len(job.prompt_ids)
        self.first_seen = False
        self.answered = False  # a status line was sent (and counted)

    def events(self, watch_socket: bool) -> tuple[GenerationStep | None, BaseException | None]:
        """The next step (None at the end), or the engine's error; checks the client while waiting."""
        while True:
            try:
                event = self.job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self.handler.peer_closed():
                    raise ClientGoneError from None
                continue
            if watch_socket and self.handler.peer_closed():
                raise ClientGoneError
            if isinstance(event, BaseException):
                return None, event
            if event is not None and not self.first_seen:
                self.first_token(event)
            return event, None

    def first_token(self, step: GenerationStep) -> None:
        self.first_seen = True
        self.cached = step.cached_tokens
        self.prompt_tokens = step.prompt_tokens or self.prompt_tokens
        state = self.handler.state
        state.metrics.cached_tokens.inc(step.cached_tokens)
        ttft = (self.job.first_token_at or time.monotonic()) - self.job.arrived
        state.metrics.ttft.observe(ttft)
        state.first_token(ttft)

    def usage(self) -> dict[str, object]:
        return openai.usage(self.prompt_tokens, self.job.generated, self.cached)

    def whole(self) -> None:
        texts: list[str] = []
        while True:
            step, error = self.events(watch_socket=True)
            if error is not None:
                self.handler.send_error_json(_as_api_error(error))
                return
            if step is None:
                break
            texts.append(step.text)
        finish = self.job.finish if self.job.finish in ("stop", "length") else "stop"
        answer = openai.response(
            self.request, self.request_id, self.created, text="".join(texts), finish=finish, use=self.usage()
        )
        self.handler.send_json(200, answer, {"X-Request-Id": self.request_id})

    def stream(self) -> None:
        # Headers wait for the first step, so an error the engine raises up front is still a proper 4xx/5xx.
        step, error = self.events(watch_socket=True)
        if error is not None:
            self.handler.send_error_json(_as_api_error(error))
            return
        self.start_stream()
        first = True
        while step is not None or error is not None:
            if error is not None:
                self.write(sse.event(_as_api_error(error).body()))
                break
            if step is not None and (step.text or first):
                self.write(sse.event(self.chunk(step.text, None, first=first)))
                first = False
            step, error = self.events(watch_socket=False)
        if error is None:
            finish = self.job.finish if self.job.finish in ("stop", "length") else "stop"
            self.write(sse.event(self.chunk(None, finish, first=first)))
            if self.request.include_usage:
                self.write(sse.event(openai.usage_chunk(self.request, self.request_id, self.created, self.usage())))
        self.write(sse.DONE)
        self.write_raw(sse.LAST_CHUNK)

    def chunk(self, text: str | None, finish: str | None, *, first: bool) -> dict[str, object]:
        return openai.stream_chunk(self.request, self.request_id, self.created, text, finish, first=first)

    def start_stream(self) -> None:
        handler = self.handler
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("X-Request-Id", self.request_id)
        try:
            handler.end_headers()
        except OSError:
            raise ClientGoneError from None
        self.answered = True
        handler.count(200)

    def write(self, data: bytes) -> None:
        self.write_raw(sse.chunk(data))

    def write_raw(self, data: bytes) -> None:
        try:
            self.handler.wfile.write(data)
            self.handler.wfile.flush()
        except OSError:  # EPIPE / ECONNRESET: the client went away mid-stream
            raise ClientGoneError from None


def _as_api_error(error: BaseException) -> openai.APIError:
    if isinstance(error, openai.APIError):
        return error
    from preheat.errors import RequestError

    if isinstance(error, RequestError):
        return openai.bad_request(str(error), code="invalid_request")
    return openai.APIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")


def _observe(handler: Handler, job: Job) -> None:
    """Per-request metrics once the request is over: latency and generation rate (TTFT is observed as it happens)."""
    metrics = handler.state.metrics
    metrics.latency.observe(time.monotonic() - job.arrived)
    first, last = job.first_token_at, job.last_token_at
    if first is not None and last is not None and job.generated > 1 and last > first:
        metrics.rate.observe((job.generated - 1) / (last - first))
