"""An engine's KV-event wire, stood up in a test: a ZMQ publisher and a replay ROUTER socket that speak exactly what
vLLM's and SGLang's ``ZmqEventPublisher`` speak (vllm/distributed/kv_events.py), fed with the frames the engines'
own classes produced (tests/data/kv_events/). It is the engine's protocol, not a stand-in for any preheat code.

The publisher is an XPUB (wire-compatible with PUB to a SUB) only so that a test can wait until the router's
subscription arrived before it publishes: a message sent earlier is dropped, as with a real engine, and would make
the tests' counts depend on timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import zmq

FIXTURES = Path(__file__).resolve().parent / "data" / "kv_events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def load_frames(name: str) -> list[list[bytes]]:
    """The ``[topic, seq, payload]`` messages of fixture ``name`` (e.g. ``vllm-0.33.0``)."""
    frames: list[list[bytes]] = msgspec.msgpack.decode((FIXTURES / f"{name}.frames").read_bytes())
    return frames


def payloads(name: str) -> list[bytes]:
    return [frames[2] for frames in load_frames(name)]


class WirePublisher:
    """``publish(payload)`` numbers and sends a batch and keeps it for replay; ``publish(payload, drop=True)`` keeps
    it without sending (a message lost on the way); ``send_raw(frames)`` sends anything at all."""

    def __init__(self, *, replay: bool = True, start_seq: int = 0, ipc: str | None = None) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if ipc is not None:  # a Unix socket at this path: an engine on the router's own host
            self.endpoint = f"ipc://{ipc}"
            self.pub.bind(self.endpoint)
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = start_seq
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        if replay:
            self._router = self.context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def spec(self, url: str) -> str:
        """The router's ``--replica`` spec for an engine at ``url`` publishing here."""
        replay = f",replay={self.replay_endpoint}" if self.replay_endpoint else ""
        return f"{url},events={self.endpoint}{replay}"

    def wait_subscribed(self, timeout: float = 30.0) -> None:
        """Block until a subscriber's subscription arrived (XPUB hands it to us as a message)."""
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("no subscriber connected to the KV-event publisher")
        self.pub.recv()

    def publish(self, payload: bytes, *, drop: bool = False) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """What a restarted engine looks like on the wire: numbers start again at 0, the replay buffer is empty."""
        with self._lock:
            self.seq, self.buffer = 0, []

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        assert self._router is not None
        while not self._stop.is_set():
            if not self._router.poll(100):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:  # vLLM logs and ignores such a request
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                held = [(seq, payload) for seq, payload in self.buffer if seq >= first]
                self.replays += 1
            for seq, payload in held:
                self._router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._router is not None:
            self._router.close(linger=0)
        self.pub.close(linger=0)
        self.context.term()
