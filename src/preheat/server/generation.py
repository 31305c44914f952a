"""``POST /v1/completions`` and ``/v1/chat/completions``: validate, tokenize, queue, relay the worker's tokens.

The request thread never touches the model: it tokenizes (under a lock), hands a ``Job`` to the single generation
worker, and turns the steps the worker produces into an OpenAI response, either one JSON body or server-sent events.

The answer goes to a ``Responder`` (the HTTP handler of ``server/app.py`` on a real connection): whole JSON answers
or a stream of server-sent events; the HTTP framing is the responder's.

A client that goes away stops its generation. While streaming, the next write fails (EPIPE/ECONNRESET); before the
first byte is sent, and throughout a non-streaming request, the responder is asked between tokens (and every 50 ms
while waiting in line) whether the client closed its end.
"""

from __future__ import annotations

import queue
import time
import uuid
from typing import TYPE_CHECKING, Protocol

from preheat.core.errors import APIError, ClientGoneError, PreheatError, QueueFullError, WorkerPausedError
from preheat.server import openai, sse
from preheat.server.worker import Job
from preheat.text.request import GenerationRequest, bad_request, parse_request

if TYPE_CHECKING:
    from preheat.engine import Engine, GenerationStep, SamplingParams
    from preheat.server.state import ServerState

POLL_SECONDS = 0.05


class Responder(Protocol):
    """Where one generation request's answer goes. Every write raises ``OSError`` once the client has gone away."""

    def send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        """A whole JSON answer."""

    def send_error_json(self, error: APIError, headers: dict[str, str] | None = None) -> None:
        """A whole OpenAI-shaped error answer."""

    def start_events(self, headers: dict[str, str]) -> None:
        """Status 200 and the headers of an event stream, plus ``headers``."""

    def send_event(self, data: bytes) -> None:
        """Whole server-sent events, sent at once."""

    def end_events(self) -> None:
        """The end of the event stream."""

    def client_gone(self) -> bool:
        """Whether the client has closed its end (asked while the request waits for tokens)."""

    def abandon(self, answered: bool) -> None:
        """The client left: the connection ends; ``answered``: a status line was already sent."""


def handle_generation(responder: Responder, state: ServerState, kind: str, body: bytes) -> None:
    """Answer one generation request to ``responder``."""
    arrived = time.monotonic()
    try:
        request, job = _submit(state, kind, body, arrived)
    except APIError as exc:
        responder.send_error_json(exc)
        return
    except WorkerPausedError:
        responder.send_error_json(_unavailable(state), {"Retry-After": "1"})
        return
    except QueueFullError as exc:
        error = APIError(429, f"server busy: {exc}; retry later", type="rate_limit_error", code="queue_full")
        responder.send_error_json(error, {"Retry-After": "1"})
        return
    state.metrics.prompt_tokens.inc(len(job.prompt_ids))
    request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    relay = _Relay(responder, state, job, request, request_id)
    try:
        if request.stream:
            relay.stream()
        else:
            relay.whole()
    except ClientGoneError:
        job.cancel()
        responder.abandon(relay.answered)
    finally:
        job.cancel()  # a no-op for a finished job; stops the worker for any other way out of here
        _observe(state, job)


def _submit(state: ServerState, kind: str, body: bytes, arrived: float) -> tuple[GenerationRequest, Job]:
    """Parse, tokenize and queue one request: the only frame of a request thread that holds the engine.

    The relay after it holds the job alone. A sleep gives the weights back when the last reference to them goes, and
    a thread still writing an answer (to a slow client, or one not yet scheduled again on a busy CPU) would otherwise
    keep them: a relay held up for a second after its answer made the next sleep give back none of them."""
    loaded, worker = state.loaded, state.worker
    if loaded is None or worker is None or not state.ready.is_set():
        raise WorkerPausedError("the replica is not ready")
    request = parse_request(body, kind, state.settings.model_name, state.settings.served_names)
    prompt_ids = _tokenize(state, loaded.engine, request)
    job = Job(prompt_ids, _sampling(loaded.engine, request, len(prompt_ids)), arrived=arrived)
    worker.submit(job)
    return request, job


def _unavailable(state: ServerState) -> APIError:
    """503 while the replica cannot generate: loading, or (preheat.server.lifecycle) standby, asleep, waking."""
    phase = state.life.phase
    if phase in ("loading", "ready"):  # ready: the worker is being paused for a sleep, or was just installed
        message, code = "the model is still loading; retry when GET /health answers 200", "model_loading"
    elif phase == "standby":
        message, code = "this replica is on standby with no model: POST /v1/preheat/load first", "standby"
    else:
        message, code = f"this replica is {phase} (POST /v1/preheat/wake); retry when GET /health answers 200", phase
    return APIError(503, message, type="service_unavailable", code=code)


def _tokenize(state: ServerState, engine: Engine, request: GenerationRequest) -> list[int]:
    try:
        with state.tokenize_lock:
            if request.messages is not None:
                ids = engine.encode_chat(request.messages)
            elif isinstance(request.prompt, str):
                ids = engine.encode_prompt(request.prompt)
            else:
                ids = list(request.prompt or [])
    except PreheatError as exc:  # e.g. a chat the model's template cannot render
        raise bad_request(str(exc), param="messages" if request.messages else "prompt") from None
    param = "messages" if request.messages is not None else "prompt"
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    if len(ids) >= engine.max_model_len:
        raise bad_request(
            f"this model's maximum context length is {engine.max_model_len} tokens, and the prompt alone has "
            f"{len(ids)}: shorten it to at most {engine.max_model_len - 1}",
            param=param,
            code="context_length_exceeded",
        )
    try:
        engine.check_prompt(ids)  # token ids out of the vocabulary; pure, so safe outside the worker
    except PreheatError as exc:
        raise bad_request(str(exc), param=param) from None
    return ids


def _sampling(engine: Engine, request: GenerationRequest, prompt_len: int) -> SamplingParams:
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

    def __init__(
        self, responder: Responder, state: ServerState, job: Job, request: GenerationRequest, request_id: str
    ) -> None:
        self.responder, self.state = responder, state
        self.job, self.request, self.request_id = job, request, request_id
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
                if self.responder.client_gone():
                    raise ClientGoneError from None
                continue
            if watch_socket and self.responder.client_gone():
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
        state = self.state
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
                self.responder.send_error_json(_as_api_error(error))
                return
            if step is None:
                break
            texts.append(step.text)
        finish = self.job.finish if self.job.finish in ("stop", "length") else "stop"
        answer = openai.response(
            self.request, self.request_id, self.created, text="".join(texts), finish=finish, use=self.usage()
        )
        self.responder.send_json(200, answer, self.headers())

    def stream(self) -> None:
        # Headers wait for the first step, so an error the engine raises up front is still a proper 4xx/5xx.
        step, error = self.events(watch_socket=True)
        if error is not None:
            self.responder.send_error_json(_as_api_error(error))
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
        try:
            self.responder.end_events()
        except OSError:
            raise ClientGoneError from None

    def chunk(self, text: str | None, finish: str | None, *, first: bool) -> dict[str, object]:
        return openai.stream_chunk(self.request, self.request_id, self.created, text, finish, first=first)

    def headers(self) -> dict[str, str]:
        """``X-Request-Id``, and with ``--follow`` the weights version the request ran on (docs/refit.md)."""
        out = {"X-Request-Id": self.request_id}
        version = self.job.version
        if version is None and self.state.refit is not None:
            version = 0  # it started before the follower did: on the loaded checkpoint
        if version is not None:
            out["X-Preheat-Version"] = str(version)
        return out

    def start_stream(self) -> None:
        try:
            self.responder.start_events({"Cache-Control": "no-cache", **self.headers()})
        except OSError:
            raise ClientGoneError from None
        self.answered = True

    def write(self, data: bytes) -> None:
        try:
            self.responder.send_event(data)
        except OSError:  # EPIPE / ECONNRESET: the client went away mid-stream
            raise ClientGoneError from None


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    from preheat.core.errors import RequestError

    if isinstance(error, RequestError):
        return bad_request(str(error), code="invalid_request")
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")


def _observe(state: ServerState, job: Job) -> None:
    """Per-request metrics once the request is over: latency and generation rate (TTFT is observed as it happens)."""
    metrics = state.metrics
    metrics.latency.observe(time.monotonic() - job.arrived)
    first, last = job.first_token_at, job.last_token_at
    if first is not None and last is not None and job.generated > 1 and last > first:
        metrics.rate.observe((job.generated - 1) / (last - first))
