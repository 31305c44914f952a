"""The soak's two attackers: a hostile replica in the router's rotation and a rogue weight publisher.

- ``HostileReplica``: an HTTP server the router lists as a replica, which passes another replica's KV events off as
  its own (so that a cache-aware router sends it requests). Out of a fault, its ``/health`` answers 503, so the
  router keeps it out of rotation; during a ``hostile_replica`` fault it says it is healthy and answers every
  request with something the router must refuse before relaying a byte (docs/router.md, *Failures*): a plain answer
  whose Content-Length is 1 TiB, a stream whose first event never ends, a stream cut mid-event. Honest clients must
  never see one of them, and the router must count each in ``preheat_router_refused_answers_total``.
- ``Trainer``: the honest trainer, a ``preheat.refit.Publisher`` signing with the key the replicas trust
  (``--refit-trust-key``), publishing the model's own weights (so the reference answers stay right whatever version
  a replica serves). A ``rogue_publisher`` fault publishes, under the same name, a version far ahead with the first
  layer's q_proj zeroed, signed by another key, and another one unsigned; then the trainer publishes its next
  version. Every replica must reach the trainer's version, never serve the rogue's, and count the rogues as liars
  (``preheat_refit_lies_total``).

Used by ``bench/soak_fleet.py``.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import load_file

from preheat.artifacts.signing import generate
from preheat.refit import Publisher

HOST = "127.0.0.1"
# What the hostile replica answers, one chosen per request; each is a refusal code of the router's.
HOSTILE_MODES = {"too_large": "answer_too_large", "endless_event": "event_too_large", "cut": "replica_failed"}
MAX_EVENT_BYTES = 1024 * 1024  # the soak's router runs with --max-event-bytes 1MiB: an endless event costs 1 MiB
ROGUE_VERSION = 10**17  # a version far ahead, as a rogue would publish it


class HostileReplica:
    """A replica the router can list (``url``), hostile while ``hostile`` is set; ``answered`` counts its hostile
    answers by mode."""

    def __init__(self, seed: int) -> None:
        self.hostile = threading.Event()
        self.twin = ""  # the replica whose KV events it passes off as its own (none: it has no KV tier)
        self.answered: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._rng = random.Random(f"{seed}:hostile")
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass  # the soak reports counts, not a log line per request

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/health" and outer.hostile.is_set():
                    self.send_json(200, {"status": "ok"})
                elif path == "/health":
                    self.send_json(503, {"status": "loading"})
                elif path == "/v1/kv/events" and outer.twin:
                    self.send_twins_events()
                else:
                    self.send_json(404, {"error": "not here"})

            def send_twins_events(self) -> None:
                """Another replica's KV events as its own: the router believes it holds that replica's cache, so a
                cache-aware policy sends it requests."""
                try:
                    with urllib.request.urlopen(outer.twin + self.path, timeout=2) as answer:
                        status, body = answer.status, answer.read()
                except urllib.error.HTTPError as exc:
                    with exc:
                        status, body = exc.code, exc.read()
                except OSError:
                    status, body = 503, b"{}"
                self.send_body(status, body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                mode = outer.choose()
                self.close_connection = True
                if mode == "too_large":  # a Content-Length the router must refuse unread
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(1 << 40))
                    self.end_headers()
                    self.wfile.write(b'{"choices": [')
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                pieces = endless_event() if mode == "endless_event" else iter([b'data: {"choices": [{"te'])
                try:
                    for piece in pieces:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                except OSError:
                    pass  # the router hung up on it: what it should do
                # No last chunk: the stream ends cut, mid-event.

            def send_json(self, status: int, doc: dict[str, str]) -> None:
                self.send_body(status, json.dumps(doc).encode())

            def send_body(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hostile replica", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.httpd.server_address[1]}"

    def choose(self) -> str:
        with self._lock:
            mode = self._rng.choice(sorted(HOSTILE_MODES))
            self.answered[mode] += 1
            return mode

    def total(self) -> int:
        with self._lock:
            return sum(self.answered.values())

    def close(self) -> None:
        self.hostile.clear()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)


def endless_event() -> Iterator[bytes]:
    """One server-sent event that never ends, in 64 KiB pieces: the router must stop reading past its bound (here
    twice the bound is the most it is sent, so a router that did not stop would relay a cut stream)."""
    yield b'data: {"choices": [{"text": "'
    for _ in range(2 * MAX_EVENT_BYTES // 65536):
        yield b"x" * 65536


def model_weights(model: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``model``, as its files hold them."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model).glob("*.safetensors")):
        out.update(load_file(str(path)))
    if not out:
        raise SystemExit(f"{model}: no .safetensors files to publish as the trainer's versions")
    return out


def zeroed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rogue's weights: the first layer's q_proj zeroed (answers change if a replica ever served them)."""
    name = next((n for n in weights if n.endswith("layers.0.self_attn.q_proj.weight")), None)
    if name is None:
        raise SystemExit("the model has no layers.0.self_attn.q_proj.weight for the rogue publisher to zero")
    return {**weights, name: torch.zeros_like(weights[name])}


class Trainer:
    """The honest trainer of ``name`` (its key pair in ``workdir``: replicas trust ``public_key``) and the rogue
    publishers a ``rogue_publisher`` fault brings up, all publishing through the ``registry``."""

    def __init__(self, name: str, model: str, registry: str, workdir: Path) -> None:
        self.name, self.registry = name, registry
        keys = workdir / "keys"
        keys.mkdir(exist_ok=True)
        self.private_key, self.public_key, _ = generate(str(keys / "trainer"))
        self.rogue_key, _, _ = generate(str(keys / "rogue"))
        self.weights = model_weights(model)
        self.publisher = Publisher(name, registry=registry, signing_key=self.private_key)
        self.version = self.publisher.publish(self.weights).version
        self.rogue_tensors_served = 0  # tensors the rogues served: a replica that asked for one believed them
        self._rogues: list[Publisher] = []

    def rogue_then_honest(self) -> tuple[int, int]:
        """Two rogues publish ``ROGUE_VERSION`` (signed by another key) and ``ROGUE_VERSION + 1`` (unsigned), then
        the trainer its next version; returns (the rogue's version, the trainer's). The rogues stay up until
        ``close_rogues``."""
        bad = zeroed(self.weights)
        signed = Publisher(self.name, registry=self.registry, signing_key=self.rogue_key)
        unsigned = Publisher(self.name, registry=self.registry)
        self._rogues = [signed, unsigned]
        signed.publish(bad, ROGUE_VERSION)
        unsigned.publish(bad, ROGUE_VERSION + 1)
        self.version = self.publisher.publish(self.weights).version
        return ROGUE_VERSION, self.version

    def close_rogues(self) -> None:
        for rogue in self._rogues:
            self.rogue_tensors_served += rogue.server.tensors_served
            rogue.close()
        self._rogues = []

    def close(self) -> None:
        self.close_rogues()
        self.publisher.close()
