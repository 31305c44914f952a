"""The wire format of vLLM's and SGLang's KV-cache events, decoded and checked. Pure: bytes in, values out.

An engine publishes on a ZMQ PUB socket one multipart message per batch of events (docs/integrations.md):

    [topic, seq (8 bytes, big-endian, signed), payload (msgpack)]
    payload = [ts, [event, ...], dp_rank]                  # an array-like struct; dp_rank may be left out

and each event is a *tagged* msgpack struct, in one of two shapes:

- a map with a ``"type"`` tag (vLLM >= 0.11, as in 0.32 and 0.33; SGLang 0.5):
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h, "token_ids": [...], ...}``;
- an array whose first item is the tag (older vLLM, ``array_like=True``):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``.

Fields a decoder does not know are ignored (engines add optional fields at the end); an event type it does not know
is kept as ``UnknownEvent`` so the caller can count it. Anything else that is not this shape raises
``EngineEventError``: the caller logs and counts it, and never stops for it. Only ``msgspec`` is needed (no engine).

Sizes are the sender's choice, so they are bounded: a payload over ``MAX_PAYLOAD_BYTES`` and a block hash over
``MAX_HASH_BYTES`` refuse the whole batch (``EngineEventError(oversized=True)``) before anything is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from preheat.core.errors import EngineEventError

BlockHash = int | bytes  # vLLM: uint64 with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, else the digest's bytes; SGLang: int64
END_SEQ = -1  # the replay socket's "no more batches" marker
# vLLM and SGLang batch one scheduler step: a 128k-token prefill is under 1 MiB of token ids and hashes. Decoded, a
# payload of small integers takes ~8x its size in Python lists, so the bound is what the router may hold per batch.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
# The longest block hash: vLLM's are 32 bytes (sha256, sha256_cbor) or a uint64, SGLang's an int64. The router keeps
# up to 4 x --index-keys of them per engine replica (engine_index.py), so their length is its memory.
MAX_HASH_BYTES = 64
_U32 = 2**32
_FIELDS = {  # positional order of the array-like form (vLLM's struct field order), after the tag
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


@dataclass(frozen=True)
class BlockStored:
    """Blocks ``block_hashes`` (in order, each the child of the one before) now hold ``token_ids``
    (``block_size`` tokens per block); the first block's parent is ``parent``, None at the start of a prompt."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    # The block's hash also covers something beyond its tokens (a LoRA adapter, image features, a cache salt,
    # prompt embeddings): the router cannot compute the same key from a prompt's tokens alone.
    extra: bool
    group: int | None  # the KV-cache group (hybrid models have several; a plain one has None or 0)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group: int | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class UnknownEvent:
    type: str


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


_decoder = msgspec.msgpack.Decoder()


def decode_message(frames: Sequence[bytes]) -> tuple[int, EventBatch | None]:
    """``(seq, batch)`` from one multipart message ``[topic, seq, payload]``; batch None for the replay socket's
    end marker (``seq == END_SEQ``, empty payload).

    >>> import msgspec
    >>> payload = msgspec.msgpack.encode([1.5, [{"type": "AllBlocksCleared"}], 0])
    >>> decode_message([b"", (7).to_bytes(8, "big"), payload])
    (7, EventBatch(ts=1.5, events=(AllBlocksCleared(),), dp_rank=0))
    """
    if len(frames) != 3:
        raise EngineEventError(f"a KV-event message has 3 frames [topic, seq, payload], got {len(frames)}")
    _topic, raw_seq, payload = frames
    if len(raw_seq) != 8:
        raise EngineEventError(f"a sequence number is 8 bytes, got {len(raw_seq)}")
    seq = int.from_bytes(raw_seq, "big", signed=True)
    if seq == END_SEQ:
        return seq, None
    if seq < 0:
        raise EngineEventError(f"negative sequence number {seq}")
    return seq, decode_batch(payload)


def decode_batch(payload: bytes) -> EventBatch:
    """One msgpack batch ``[ts, [event, ...], dp_rank]`` (events as tagged maps or tagged arrays)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EngineEventError(f"a KV-event batch of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}", oversized=True)
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise EngineEventError(f"not msgpack: {exc}") from None
    if isinstance(raw, Mapping):  # a struct without array_like: accepted, though no engine sends it
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise EngineEventError(f"a batch is [ts, events, dp_rank], got {_brief(raw)}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EngineEventError(f"a batch's ts must be a number, got {_brief(ts)}")
    if not isinstance(events, list):
        raise EngineEventError(f"a batch's events must be an array, got {_brief(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise EngineEventError(f"a batch's dp_rank must be an integer, got {_brief(rank)}")
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


def decode_event(raw: object) -> Event:
    """One event, as a tagged map or a tagged array."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        fields: Mapping[object, object] = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EngineEventError(f"an event is a tagged map or array, got {_brief(raw)}")
    if not isinstance(tag, str):
        raise EngineEventError(f"an event's type tag must be a string, got {_brief(tag)}")
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"))
        parent = fields.get("parent_block_hash")
        if parent is not None:
            parent = _hash(parent)
        tokens = fields.get("token_ids")
        size = fields.get("block_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EngineEventError(f"BlockStored: block_size must be a positive integer, got {_brief(size)}")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _U32 for t in tokens
        ):
            raise EngineEventError(f"BlockStored: token_ids must be token ids, got {_brief(tokens)}")
        if len(tokens) != size * len(hashes):
            raise EngineEventError(f"BlockStored: {len(hashes)} blocks of {size} tokens, but {len(tokens)} token ids")
        # vLLM: lora_id/lora_name, extra_keys (one entry per block, None when nothing: multimodal features, cache
        # salt, prompt embeddings), lookahead_token_ids (0.33: tokens past the block in its hash); SGLang: lora_id,
        # lora_name, cache_salt. Any of them set means the hash covers more than the block's tokens.
        extra = any(fields.get(name) is not None for name in ("lora_id", "lora_name", "cache_salt"))
        for name in ("extra_keys", "lookahead_token_ids"):
            more = fields.get(name)
            if more is not None and not isinstance(more, list):
                raise EngineEventError(f"BlockStored: {name} must be an array, got {_brief(more)}")
            extra = extra or any(k for k in more or ())
        return BlockStored(hashes, parent, tuple(tokens), size, _medium(fields), extra, _group(fields))
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), _medium(fields), _group(fields))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag[:64])


def _hash(value: object) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise EngineEventError(f"a block hash is an integer or bytes, got {_brief(value)}")
    if isinstance(value, bytes) and len(value) > MAX_HASH_BYTES:
        raise EngineEventError(f"a block hash of {len(value)} bytes is over {MAX_HASH_BYTES}", oversized=True)
    return value


def _hashes(value: object) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not value:
        raise EngineEventError(f"block_hashes must be a non-empty array, got {_brief(value)}")
    return tuple(_hash(h) for h in value)


def _medium(fields: Mapping[object, object]) -> str | None:
    medium = fields.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise EngineEventError(f"medium must be a string, got {_brief(medium)}")
    return medium


def _group(fields: Mapping[object, object]) -> int | None:
    group = fields.get("group_idx")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise EngineEventError(f"group_idx must be an integer, got {_brief(group)}")
    return group


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
