"""HTTP helpers for the server tests: a tiny client over ``preheat.http.client``, the long prompts and greedy
completions of the KV tests, and a gate that holds connections.

The tests speak plain HTTP to a real ``preheat serve`` subprocess, exactly as an OpenAI client would; nothing of the
server is imported or mocked. Failures are ``preheat.http``'s errors (``HTTPClientError``), as for every other
client of preheat.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from netfaults import LoopbackProxy
from preheat.http.client import Timeouts, connect, request, stream
from preheat.server.sse import parse_events

MAX_ANSWER = 1 << 30  # the tests read whatever the server sends


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:  # Any: whatever JSON the server sent
        return json.loads(self.body)


@dataclass
class Stream:
    """A finished streamed response: status, the JSON chunks, whether it ended with [DONE], and its text."""

    status: int
    headers: dict[str, str]
    chunks: list[dict[str, Any]] = field(default_factory=list)  # Any: OpenAI chunk JSON
    done: bool = False

    @property
    def text(self) -> str:
        parts = []
        for chunk in self.chunks:
            for choice in chunk.get("choices", []):
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(parts)

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for ch in self.chunks for c in ch.get("choices", []) if c.get("finish_reason")]
        return reasons[-1] if reasons else None

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [c["usage"] for c in self.chunks if c.get("usage")]
        return found[-1] if found else None


class Client:
    """One-request-per-connection HTTP client for a server at ``url``."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.url = f"http://{parts.netloc}"
        # Connecting may take as long as reading: a busy test machine can let a listen queue overflow for seconds.
        self.api_key, self.timeouts = api_key, Timeouts(connect=timeout, read=timeout)

    def connect(self) -> http.client.HTTPConnection:
        """An open connection of its own, for tests that drive the exchange by hand (and cut it)."""
        return connect(self.host, self.port, self.timeouts)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out | (extra or {})

    def request(self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None) -> Reply:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        answer = request(self.url + path, method, timeouts=self.timeouts, body=raw, headers=self.headers(headers))
        return Reply(answer.status, dict(answer.headers.items()), answer.body)

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, body: object, headers: dict[str, str] | None = None) -> Reply:
        return self.request("POST", path, body, headers)

    def stream(self, path: str, body: dict[str, Any]) -> Stream:
        raw = json.dumps({**body, "stream": True}).encode()
        with stream(self.url + path, "POST", timeouts=self.timeouts, body=raw, headers=self.headers()) as answer:
            result = Stream(answer.status, dict(answer.headers.items()))
            for payload in parse_events(answer.read(MAX_ANSWER)):
                if payload == "[DONE]":
                    result.done = True
                else:
                    result.chunks.append(json.loads(payload))
        return result

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series of ``/metrics`` (0 when absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        series = f"{name}{{{want}}}" if want else name
        for line in self.get("/metrics").body.decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return 0.0


# Prompts longer than a KV chunk (256 tokens), as the KV tests send them: each seed its own, the same every run.
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]


def long_prompt(seed: int = 0, words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete(client: Client, prompt: str) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a greedy completion."""
    reply = client.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert reply.status == 200, reply.body
    body = reply.json()
    usage = body["usage"]
    return body["choices"][0]["text"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


class Gate(LoopbackProxy):
    """A TCP proxy to ``upstream_port`` that holds every connection until ``open()``: a model origin that is
    "still downloading" for exactly as long as a test wants."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.opened = threading.Event()
        self.waiting = threading.Event()  # set once a client is being held

    def open(self) -> None:
        self.opened.set()

    def closing(self) -> None:
        self.opened.set()

    def handle(self, client: socket.socket) -> None:
        self.waiting.set()
        self.opened.wait()
        if self._closed:
            return
        upstream = self.connect_upstream()
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
