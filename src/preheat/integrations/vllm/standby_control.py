"""The pure half of ``preheat vllm-standby`` (``standby.py`` is the process): what ``/health`` answers in each phase,
what a ``POST /v1/preheat/load`` may start, and the ``vllm serve`` command line an activation parses.

Phases: ``standby`` (``prepared`` once vLLM and its machinery are imported), ``loading`` (the engine builds behind
the standby's own listener), then vLLM's own API server answers on the same socket (``/health`` 200, from vLLM);
a failed activation goes back to ``standby`` with ``last_error``. Values in, values out: tested without vLLM.

>>> state = StandbyState()
>>> state.health()
(503, {'status': 'standby', 'prepared': False})
>>> state.begin("/models/smol") is None, state.health()
(True, (503, {'status': 'loading', 'model': '/models/smol'}))
>>> state.begin("/models/other").code
'is_loading'
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from preheat.core.errors import APIError, ConfigError, JSONInputError
from preheat.core.jsonsafe import loads_bounded

STANDBY, LOADING, SERVING = "standby", "loading", "serving"
MAX_BODY = 64 * 1024  # a load request is a model name and a served name
# ``vllm serve`` words the standby sets itself: it owns the socket (host, port) and is told the model by the load.
OWN_WORDS = ("--host", "--port", "--uds", "--model")
# What one API server on one socket cannot be: vLLM starts other servers, or none, for these.
SINGLE_SERVER = "a vLLM standby is one API server on its own socket"


@dataclass(frozen=True)
class LoadRequest:
    """``POST /v1/preheat/load``'s body: the model (as sent; the allow-list normalizes it) and an optional name."""

    model: str
    served_model_name: str | None = None
    wait: bool = False


class StandbyState:
    """The phase every request thread reads and the one activation that may run; guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.phase = STANDBY
        self.prepared = False
        self.model: str | None = None
        self.last_error: str | None = None
        # Set when an activation ends: handed to vLLM (``phase`` serving) or failed (back in standby).
        self.done = threading.Event()

    def health(self) -> tuple[int, dict[str, object]]:
        """``/health``'s status and body: never 200 (vLLM's own server answers that once it serves)."""
        with self.lock:
            if self.phase == LOADING:
                return 503, {"status": LOADING, "model": self.model}
            body: dict[str, object] = {"status": self.phase, "prepared": self.prepared}
            if self.last_error is not None:
                body["last_error"] = self.last_error
            return 503, body

    def begin(self, model: str) -> APIError | None:
        """Move to ``loading`` for ``model``; the 409 to answer when an activation runs or ran already."""
        with self.lock:
            if self.phase != STANDBY:
                return APIError(409, f"cannot load a model: the standby is {self.phase}", code=f"is_{self.phase}")
            self.phase, self.model, self.last_error = LOADING, model, None
            self.done.clear()
            return None

    def failed(self, error: str) -> None:
        """The activation failed cleanly: back to standby, saying why."""
        with self.lock:
            self.phase, self.model, self.last_error = STANDBY, None, error
        self.done.set()

    def handed_over(self) -> None:
        """vLLM's own API server takes the socket from here on."""
        with self.lock:
            self.phase = SERVING
        self.done.set()


def load_request(body: bytes) -> LoadRequest:
    """The load request in ``body``; ``APIError`` 400 for anything else."""
    try:
        value = loads_bounded(body or b"{}", max_bytes=MAX_BODY, max_depth=4)
    except (JSONInputError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_type")
    model, name, wait = value.get("model"), value.get("served_model_name"), value.get("wait", False)
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: a checkpoint directory or URI", param="model", code="missing")
    if name is not None and (not isinstance(name, str) or not name):
        raise APIError(400, "'served_model_name' must be a non-empty string", param="served_model_name",
                       code="invalid_type")  # fmt: skip
    if not isinstance(wait, bool):
        raise APIError(400, "'wait' must be a boolean", param="wait", code="invalid_type")
    return LoadRequest(model, name, wait)


def not_serving(path: str) -> APIError:
    """What every route but ``/health`` and the load route answers before vLLM serves (the router reads ``code``
    ``standby`` as "not serving": preheat.router.capacity)."""
    return APIError(
        503,
        f'{path}: this is a vLLM standby, not serving yet: POST /v1/preheat/load {{"model": ...}} first',
        type="server_error",
        code=STANDBY,
    )


def own_words(user_args: Sequence[str]) -> str | None:
    """Why ``user_args`` (the user's ``vllm serve`` arguments, without MODEL) cannot be used, or None.

    >>> own_words(["--dtype", "float32", "--enforce-eager"]) is None
    True
    >>> own_words(["--port=9000"]).startswith("--port=9000: the standby sets --host, --port")
    True
    """
    for word in user_args:
        if word.split("=", 1)[0] in OWN_WORDS:
            return (
                f"{word}: the standby sets {', '.join(OWN_WORDS)} itself (give --host/--port to preheat "
                "vllm-standby; the model comes with POST /v1/preheat/load)"
            )
    return None


def serve_argv(
    user_args: Sequence[str], model: str, *, host: str, port: int, served_model_name: str | None = None
) -> list[str]:
    """The words vLLM's ``serve`` parser reads for this activation: MODEL, the user's arguments, then the socket the
    standby holds (and the load's served name, which wins over the user's).

    >>> serve_argv(["--dtype", "float32"], "/m/smol", host="127.0.0.1", port=8000, served_model_name="smol")
    ['/m/smol', '--dtype', 'float32', '--host', '127.0.0.1', '--port', '8000', '--served-model-name', 'smol']
    """
    refusal = own_words(user_args)
    if refusal is not None:
        raise ConfigError(refusal)
    words = [model, *user_args, "--host", host, "--port", str(port)]
    if served_model_name is not None:
        words += ["--served-model-name", served_model_name]
    return words


def single_server(headless: bool, grpc: bool, api_servers: int | None, data_parallel: int) -> str | None:
    """Why parsed ``vllm serve`` arguments need more (or other) than one HTTP API server, or None.

    >>> single_server(False, False, None, 1) is None, single_server(False, False, 2, 1)
    (True, '--api-server-count 2: a vLLM standby is one API server on its own socket')
    """
    if headless:
        return f"--headless: {SINGLE_SERVER}"
    if grpc:
        return f"--grpc: {SINGLE_SERVER} (HTTP)"
    if api_servers is not None and api_servers != 1:
        return f"--api-server-count {api_servers}: {SINGLE_SERVER}"
    if data_parallel != 1:
        return f"--data-parallel-size {data_parallel}: {SINGLE_SERVER}"
    return None
