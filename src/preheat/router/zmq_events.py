"""The subscriber behind ``--replica URL,events=tcp://...``: an engine's KV events (vLLM, SGLang) into the KV index.

One thread per engine replica holds a ZMQ SUB socket on the engine's publisher and, when given, a DEALER socket on
its replay endpoint (a ROUTER: we send ``["", start_seq]``, it answers every batch it still holds from ``start_seq``
on as ``["", topic, seq, payload]``, then ``["", "", -1, ""]``). Batches are numbered; the thread applies them in
order and resynchronises through the replay socket:

- when it joins (and when the replica comes back into rotation): from seq 0, so blocks stored before are known;
- after a gap in the numbers (the PUB socket dropped messages at its high-water mark, or the network did): the
  missing range;
- when the numbers go backwards (the engine restarted with a fresh counter): everything known is dropped, then the
  new process's batches are replayed.

A replica that is ejected (health checks, failed requests) loses its state: what it held may be gone, and it is
routed by prefix until it is back and resynchronised. Malformed frames, unknown event types, gaps and unreachable
endpoints are logged and counted (``preheat_router_engine_events_total``), never fatal.

Bounded, since the publisher chooses what it sends: a frame over ``MAX_PAYLOAD_BYTES`` is dropped by ZMQ itself
(``MAXMSGSIZE``: the connection is closed, and dialled again here) before it is held whole; a batch with an
oversized block hash is refused and counted (``oversized``); a replay ends after ``replay_deadline`` seconds or
``replay_batches`` batches however long its socket keeps sending (``replay_cut``), so the stream's thread always
comes back to its live events and to ``stop()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import xxhash
import zmq
import zmq.utils.monitor

from preheat.core.errors import EngineEventError
from preheat.http.metrics import Counter
from preheat.router.engine_events import MAX_PAYLOAD_BYTES, EventBatch, decode_message
from preheat.router.engine_index import Applied, EngineBlockMap
from preheat.router.index import KVIndex, ReplicaCache
from preheat.router.upstream import EventSource, Replica

log = logging.getLogger("preheat.router")
POLL_SECONDS = 0.25
# A replay longer than either is cut short: vLLM keeps 10,000 batches for replay (KVEventsConfig.buffer_steps),
# which arrive in well under a second on a live network.
REPLAY_SECONDS = 30.0
REPLAY_BATCHES = 20_000


def engine_events_counter() -> Counter:
    return Counter(
        "preheat_router_engine_events_total",
        "Engine KV events (vLLM, SGLang) by replica and outcome: batches, stored, removed, cleared, unmapped, "
        "foreign, unknown_event, malformed, oversized, gap, resync, restart, replay_failed, replay_cut, unreachable.",
    )


class EngineEventSubscriber:
    """One thread per engine replica feeding ``index``; ``start()`` then ``stop()``."""

    def __init__(
        self,
        sources: Sequence[tuple[Replica, EventSource]],
        index: KVIndex,
        counter: Counter,
        *,
        identity: str,
        max_keys: int = 100_000,
        replay_timeout: float = 2.0,
        replay_deadline: float = REPLAY_SECONDS,
        replay_batches: int = REPLAY_BATCHES,
    ) -> None:
        self.sources, self.index, self.counter = list(sources), index, counter
        self.identity, self.max_keys, self.replay_timeout = identity, max_keys, replay_timeout
        self.replay_deadline, self.replay_batches = replay_deadline, replay_batches
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.streams: dict[str, _Stream] = {}

    def start(self) -> None:
        """One thread per replica; returns once each has replayed what its engine published so far (or its replay
        socket did not answer in ``replay_timeout``), so that the router's first request finds the index built."""
        for replica, source in self.sources:
            stream = _Stream(self, replica, source)
            self.streams[replica.url] = stream
            thread = threading.Thread(target=stream.run, name=f"kv-events {replica.url}", daemon=True)
            thread.start()
            self._threads.append(thread)
        for stream in self.streams.values():
            stream.joined.wait(self.replay_timeout + 1)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.replay_timeout + 2)
        if any(thread.is_alive() for thread in self._threads):
            # term() would wait for that thread's sockets forever; the daemon thread ends with the process.
            log.warning("KV-event subscriber: a stream thread did not stop in time; leaving its sockets open")
            return
        self._context.term()


class _Stream:
    """One replica's event stream; every socket here is used by this stream's thread only (ZMQ sockets are not
    thread-safe)."""

    def __init__(self, owner: EngineEventSubscriber, replica: Replica, source: EventSource) -> None:
        self.owner, self.replica, self.source = owner, replica, source
        self.blocks = EngineBlockMap(owner.identity, max_keys=owner.max_keys)
        self.last: int | None = None  # the last batch applied, None: nothing since (re)joining
        # The batches the last replay applied (seq -> payload digest): the same may also wait on the SUB socket,
        # and must not be taken for an engine that restarted (numbers going back, different payloads).
        self.replayed: dict[int, bytes] = {}
        self._said: set[str] = set()  # warnings given once per replica and kind
        self.joined = threading.Event()  # the first replay is done (or was not possible)

    # --- the loop ------------------------------------------------------------------------------------------------

    def run(self) -> None:
        context = self.owner._context
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.source.endpoint)
        except zmq.ZMQError as exc:  # e.g. a host name that does not resolve: this replica is routed by prefix
            self.count("unreachable")
            log.error("%s: KV events at %s: %s; routed by prefix", self.replica.url, self.source.endpoint, exc)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self.joined.set()
            return
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        was_healthy = self.replica.healthy
        if was_healthy:
            self.resync("joining")
        self.joined.set()
        try:
            while not self.owner._stop.is_set():
                healthy = self.replica.healthy
                if was_healthy and not healthy:
                    self.reset("the replica left rotation")
                elif healthy and not was_healthy:
                    self.resync("the replica is back in rotation")
                was_healthy = healthy
                ready = dict(poller.poll(int(POLL_SECONDS * 1000)))
                if monitor in ready:
                    self.on_monitor(zmq.utils.monitor.recv_monitor_message(monitor), sub)
                if sub in ready:
                    for _ in range(1000):  # drain what is there, then look at health again
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.on_message(frames)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def on_monitor(self, message: Mapping[str, object], sub: zmq.Socket[bytes]) -> None:
        event = message.get("event")
        where = f"{self.replica.url}: KV events at {self.source.endpoint}"
        if event == zmq.EVENT_CONNECT_RETRIED and "unreachable" not in self._said:
            self._said.add("unreachable")
            self.count("unreachable")
            log.warning("%s: cannot connect (retrying); routed by prefix until its events arrive", where)
        elif event == zmq.EVENT_CONNECTED:
            self._said.discard("unreachable")
            log.info("%s: connected", where)
        elif event == zmq.EVENT_DISCONNECTED:
            log.warning("%s: disconnected (reconnecting)", where)
            # ZMQ dials again by itself after a network error, but never after a protocol error, and a frame over
            # MAXMSGSIZE is one: dial again here, or one oversized batch would end this replica's events for good.
            # The batches missed meanwhile show as a gap, filled from the replay socket.
            with contextlib.suppress(zmq.ZMQError):  # ZMQ's own reconnection already gone (nothing to end)
                sub.disconnect(self.source.endpoint)
            sub.connect(self.source.endpoint)

    def on_message(self, frames: Sequence[bytes]) -> None:
        try:
            seq, batch = decode_message(frames)
        except EngineEventError as exc:
            self.malformed(exc)
            return
        if batch is None:
            self.malformed(EngineEventError("an end-of-replay marker on the PUB socket"))
            return
        if self.replayed:
            if self.replayed.get(seq) == _digest(frames[2]):
                return  # also sent live while the replay socket answered: applied already
            if seq > max(self.replayed):
                self.replayed = {}
        if self.last is None:
            if seq > 0:
                self.replay(0, seq - 1, "joined mid-stream")
        elif seq <= self.last:
            self.count("restart")
            self.reset(f"its sequence numbers went back from {self.last} to {seq}: the engine restarted")
            if seq > 0:
                self.replay(0, seq - 1, "after a restart")
        elif seq > self.last + 1:
            self.count("gap")
            self.warn_once("gap", f"missed batches {self.last + 1}..{seq - 1}")
            self.replay(self.last + 1, seq - 1, "after a gap")
        self.apply(seq, batch)

    # --- state ---------------------------------------------------------------------------------------------------

    def apply(self, seq: int, batch: EventBatch) -> None:
        if self.last is not None and seq <= self.last:
            return
        done = Applied()

        def change() -> ReplicaCache | None:
            nonlocal done
            done = self.blocks.apply(batch)
            return self.blocks.cache

        self.owner.index.edit(self.replica.url, change)
        self.last = seq
        self.count("batches")
        for what in ("stored", "removed", "cleared", "unmapped", "foreign", "unknown"):
            n = getattr(done, what)
            if n:
                self.count("unknown_event" if what == "unknown" else what, n)
        if done.unknown:
            self.warn_once("unknown", f"{done.unknown} event(s) of a type this router does not know: skipped")
        if done.unmapped:
            self.warn_once(
                "unmapped", f"{done.unmapped} block(s) whose parent is unknown (stored before the router joined "
                "and no longer replayable): not counted until their prompt's first block is stored again",
            )  # fmt: skip
        if done.foreign:
            self.warn_once(
                "foreign", f"{done.foreign} block(s) whose hash covers more than tokens (LoRA, multimodal, cache "
                "salt) or another KV group: not counted",
            )  # fmt: skip

    def reset(self, why: str) -> None:
        if self.blocks.cache is not None:
            log.warning("%s: KV events: forgetting its cache (%s)", self.replica.url, why)

        def change() -> ReplicaCache | None:
            self.blocks.clear()
            return None

        self.owner.index.edit(self.replica.url, change)
        self.last = None
        self.replayed = {}

    def resync(self, why: str) -> None:
        self.reset(why)
        self.replay(0, None, why)

    def replay(self, start: int, end: int | None, why: str) -> None:
        """Ask the replay socket for batches ``start``..``end`` (None: all it has) and apply them in order."""
        if self.source.replay is None:
            if why != "joining":
                self.warn_once("no_replay", f"{why}: no replay endpoint (replay=tcp://...), blocks missed stay unknown")
            return
        self.count("resync")
        dealer = self.owner._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        timeout = int(self.owner.replay_timeout * 1000)
        deadline = time.monotonic() + self.owner.replay_deadline
        got: dict[int, bytes] = {}
        received = 0
        try:
            dealer.connect(self.source.replay)
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if self.owner._stop.is_set():
                    return
                if received >= self.owner.replay_batches or time.monotonic() >= deadline:
                    self.count("replay_cut")
                    self.warn_once(
                        "replay_cut", f"replay endpoint {self.source.replay} was still sending after {received} "
                        f"batch(es) ({why}): cut short; routed on what it sent and its live events",
                    )  # fmt: skip
                    break
                wait = min(timeout, max(int((deadline - time.monotonic()) * 1000), 1))
                if not dealer.poll(wait):
                    if wait < timeout:
                        continue  # the deadline came first: cut short above
                    self.count("replay_failed")
                    self.warn_once(
                        "replay", f"replay endpoint {self.source.replay} did not answer in "
                        f"{self.owner.replay_timeout} s ({why}): routed on what its live events say",
                    )  # fmt: skip
                    return
                frames = dealer.recv_multipart()
                received += 1  # every message counts: one that keeps sending garbage ends too
                try:
                    seq, batch = decode_message(frames[1:] if frames and frames[0] == b"" else frames)
                except EngineEventError as exc:
                    self.malformed(exc)
                    continue
                if batch is None:
                    break
                if end is None or seq <= end:
                    self.apply(seq, batch)
                    got[seq] = _digest(frames[-1])
        finally:
            dealer.close(linger=0)
        if got:
            self.replayed = got
            if min(got) > start:
                self.count("gap")  # the engine's replay buffer no longer had the first ones
        log.info("%s: KV events: replayed %d batch(es) from %d (%s)", self.replica.url, len(got), start, why)

    # --- reporting -----------------------------------------------------------------------------------------------

    def count(self, what: str, n: int = 1) -> None:
        self.owner.counter.inc(float(n), replica=self.replica.url, outcome=what)

    def malformed(self, exc: EngineEventError) -> None:
        kind = "oversized" if exc.oversized else "malformed"
        self.count(kind)
        self.warn_once(kind, f"ignoring a {kind} message: {exc}")

    def warn_once(self, kind: str, message: str) -> None:
        """Warn the first time per kind, then at debug level: a broken publisher must not flood the log."""
        emit: Callable[..., None] = log.debug if kind in self._said else log.warning
        self._said.add(kind)
        emit("%s: KV events from %s: %s", self.replica.url, self.source.endpoint, message)


def _digest(payload: bytes) -> bytes:
    return xxhash.xxh3_128_digest(payload)
