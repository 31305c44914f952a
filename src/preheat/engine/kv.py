"""The engine's KV cache: one pool of fixed-size token blocks, a block table per sequence, whole-chunk export/import.

Layout (docs/engine.md): one tensor ``pool[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``, block
major. Everything one block holds, for every layer, K then V, is one contiguous run of memory, so ``n`` consecutive
blocks are one contiguous tensor ``pool[b : b + n]``. A chunk of C tokens (C a multiple of ``block_size``; the KV
tier's default C is 256) whose blocks are consecutive is therefore exported as a *view* (no copy: the tier writes
those bytes straight to its file or host buffer) and imported with one ``copy_`` (or read straight into the view
``chunk_view`` returns). The allocator makes runs consecutive whenever it can: a sequence's next block is the one
after its last when that is free, and a multi-block reservation takes the first run of free blocks long enough.

Attention needs one layer's K and V as ``[kv_heads, tokens, head_dim]``; ``read`` gathers them with a single copy
per layer (``index_select`` over the block table). That copy is the price of the chunk-contiguous layout; it is small
next to the weight reads of a forward pass (measured in docs/engine.md).

Not thread-safe: the engine runs one sequence step at a time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from preheat.core.errors import KVError
from preheat.kv.spec import KVLayout


@dataclass
class Sequence:
    """One sequence's place in the pool: its blocks in token order and how many tokens hold computed K/V."""

    seq_id: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    _table: torch.Tensor | None = field(default=None, repr=False)  # blocks as a tensor, rebuilt when they change


class PagedKVCache:
    """The block pool plus per-sequence block tables.

    >>> cache = PagedKVCache(layout, num_blocks=64, device=torch.device("cpu"))     # doctest: +SKIP
    >>> seq = cache.new_sequence()                                                  # doctest: +SKIP
    >>> chunk = cache.export_chunk(seq, 0, 256)   # a view when its blocks are consecutive   # doctest: +SKIP
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise KVError(f"a KV cache needs at least one block (asked for {num_blocks})")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        # torch.empty: on CPU the pages are only touched (and so only cost memory) as tokens are written.
        self.pool = torch.empty((num_blocks, *layout.block_shape), dtype=layout.dtype, device=device)
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free; bytes.find locates runs of free blocks in C
        self._ids = itertools.count()

    # -- sequences and blocks -------------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self._free.count(1)

    def new_sequence(self) -> Sequence:
        """An empty sequence (no blocks yet)."""
        return Sequence(next(self._ids))

    def release(self, seq: Sequence) -> None:
        """Give ``seq``'s blocks back to the pool; ``seq`` is empty afterwards."""
        for block in seq.blocks:
            self._free[block] = 1
        seq.blocks.clear()
        seq.length = 0
        seq._table = None

    def reserve(self, seq: Sequence, n_tokens: int) -> None:
        """Make room for ``n_tokens`` tokens in ``seq`` (allocating blocks, consecutive when possible).

        Raises ``KVError`` when the pool has too few free blocks.
        """
        bs = self.layout.block_size
        need = -(-n_tokens // bs) - len(seq.blocks)
        if need <= 0:
            return
        if need > self.free_blocks:
            raise KVError(
                f"KV cache full: {need} more blocks of {bs} tokens needed, {self.free_blocks} of "
                f"{self.num_blocks} free (raise max_model_len or the KV block count)"
            )
        after = seq.blocks[-1] + 1 if seq.blocks else 0
        if seq.blocks and after + need <= self.num_blocks and self._free[after : after + need] == b"\x01" * need:
            start = after
        else:
            start = self._free.find(b"\x01" * need)
        if start >= 0:
            new = list(range(start, start + need))
        else:  # fragmented: any free blocks (export of chunks spanning a break then copies; still correct)
            new = [i for i, free in enumerate(self._free) if free][:need]
        for block in new:
            self._free[block] = 0
        seq.blocks.extend(new)
        seq._table = None

    def _block_table(self, seq: Sequence) -> torch.Tensor:
        if seq._table is None:
            seq._table = torch.tensor(seq.blocks, dtype=torch.int64, device=self.device)
        return seq._table

    def slots(self, seq: Sequence, start: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) index tensors for tokens ``start .. start + n_tokens`` (reserve first)."""
        positions = torch.arange(start, start + n_tokens, device=self.device)
        bs = self.layout.block_size
        return self._block_table(seq)[positions // bs], positions % bs

    # -- the forward pass's reads and writes ----------------------------------------------------------------------

    def write(
        self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ``[kv_heads, T, head_dim]`` of ``layer`` into the token ``slots``."""
        blocks, offsets = slots
        # Indexed [T] on the block and token dims; the sliced dims (kv, heads, head_dim) follow: value [T, 2, H, D].
        self.pool.select(1, layer)[blocks, :, :, offsets] = torch.stack((key, value)).permute(2, 0, 1, 3)

    def read(self, seq: Sequence, layer: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for the first ``n_tokens`` tokens, each ``[kv_heads, n_tokens, head_dim]``."""
        bs = self.layout.block_size
        n_blocks = -(-n_tokens // bs)
        # [blocks, 2, H, bs, D] -> [2, H, blocks, bs, D]: one gather copy lays every head's tokens out in order.
        per_layer = self.pool.select(1, layer).permute(1, 2, 0, 3, 4)
        gathered = per_layer.index_select(2, self._block_table(seq)[:n_blocks])
        kv = gathered.view(2, self.layout.num_kv_heads, n_blocks * bs, self.layout.head_dim)[:, :, :n_tokens]
        return kv[0], kv[1]

    # -- whole chunks, for the KV tiers ---------------------------------------------------------------------------

    def _chunk_blocks(self, token_start: int, n_tokens: int) -> tuple[int, int]:
        bs = self.layout.block_size
        if token_start % bs or n_tokens % bs or n_tokens <= 0 or token_start < 0:
            raise KVError(
                f"KV chunks are whole blocks: token_start {token_start} and n_tokens {n_tokens} must be "
                f"non-negative multiples of the block size {bs} (and n_tokens > 0)"
            )
        return token_start // bs, n_tokens // bs

    def _run(self, seq: Sequence, first: int, count: int) -> torch.Tensor:
        blocks = seq.blocks[first : first + count]
        if blocks == list(range(blocks[0], blocks[0] + count)):
            return self.pool[blocks[0] : blocks[0] + count]  # consecutive: a contiguous view, no copy
        return self.pool[torch.tensor(blocks, device=self.device)]  # fragmented: gathered (a copy)

    def is_view(self, seq: Sequence, token_start: int, n_tokens: int) -> bool:
        """True when that chunk's blocks are consecutive, so export returns a view of the pool."""
        first, count = self._chunk_blocks(token_start, n_tokens)
        blocks = seq.blocks[first : first + count]
        return len(blocks) == count and blocks == list(range(blocks[0], blocks[0] + count))

    def export_chunk(self, seq: Sequence, token_start: int, n_tokens: int) -> torch.Tensor:
        """K/V of tokens ``token_start .. token_start + n_tokens`` as ``layout.chunk_shape(n_tokens)``.

        A view of the pool when the chunk's blocks are consecutive (always, unless the pool was fragmented): copy it
        out (or write it to a file) before the sequence is released or overwritten.
        """
        first, count = self._chunk_blocks(token_start, n_tokens)
        if token_start + n_tokens > seq.length:
            raise KVError(
                f"cannot export tokens {token_start}..{token_start + n_tokens}: sequence {seq.seq_id} holds K/V "
                f"for {seq.length} tokens"
            )
        return self._run(seq, first, count)

    def chunk_view(self, seq: Sequence, token_start: int, n_tokens: int) -> torch.Tensor:
        """A writable view of the pool for tokens ``token_start .. +n_tokens`` (allocating its blocks), for a tier
        to read a chunk straight into; then call ``mark_filled``. Raises ``KVError`` if the blocks are not
        consecutive (use ``import_chunk`` then) or the chunk would leave a gap after ``seq.length``."""
        first, count = self._chunk_blocks(token_start, n_tokens)
        if token_start > seq.length:
            raise KVError(f"chunk at token {token_start} would leave a gap: sequence {seq.seq_id} has {seq.length}")
        self.reserve(seq, token_start + n_tokens)
        if not self.is_view(seq, token_start, n_tokens):
            raise KVError(f"tokens {token_start}..{token_start + n_tokens} are not in consecutive blocks")
        return self._run(seq, first, count)

    def mark_filled(self, seq: Sequence, token_end: int) -> None:
        """Record that K/V of tokens ``0 .. token_end`` are present (after writing into ``chunk_view``)."""
        if token_end > len(seq.blocks) * self.layout.block_size:
            raise KVError(f"token {token_end} is beyond sequence {seq.seq_id}'s reserved blocks")
        seq.length = max(seq.length, token_end)

    def import_chunk(self, seq: Sequence, token_start: int, data: torch.Tensor) -> None:
        """Copy an exported chunk into ``seq`` at ``token_start`` (one copy; none beyond it when the blocks are
        consecutive). The chunk must start at or before ``seq.length``, so no tokens are left without K/V."""
        n_tokens = data.shape[0] * self.layout.block_size if data.dim() else 0
        expected = self.layout.chunk_shape(n_tokens)
        if tuple(data.shape) != expected or data.dtype != self.layout.dtype:
            raise KVError(
                f"chunk of shape {list(data.shape)} {data.dtype} does not fit this cache's layout "
                f"{list(expected)} {self.layout.dtype}"
            )
        first, count = self._chunk_blocks(token_start, n_tokens)
        if token_start > seq.length:
            raise KVError(f"chunk at token {token_start} would leave a gap: sequence {seq.seq_id} has {seq.length}")
        self.reserve(seq, token_start + n_tokens)
        if self.is_view(seq, token_start, n_tokens):
            self._run(seq, first, count).copy_(data)
        else:
            self.pool[torch.tensor(seq.blocks[first : first + count], device=self.device)] = data.to(self.device)
        seq.length = max(seq.length, token_start + n_tokens)
