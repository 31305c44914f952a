"""Reading one value of the blob store (``kv/store.py``) from its ``fs://`` file straight into an engine's memory:
the readers ``BlobStore.get_into`` hands ``FileTier.read_framed`` and ``FileTier.read_split``.

One copy (kernel to the engine's buffers) and one pass of the checksum over those buffers: header and value in one
``preadv`` when the header's length follows from the file's size and the key (``chunkfile.blob_frame``: a byte-wise
header comparison instead of a JSON parse), a value of ``PIECEWISE_BYTES`` or more a MiB at a time, each hashed
while still in the CPU's cache; the header first, parsed, otherwise (a file of another writer, a damaged one, an
engine that sizes its buffers from the value's first bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from preheat.core.errors import CorruptChunkError, Reframe
from preheat.kv import chunkfile, mac
from preheat.kv.fileio import fill, fill_pieces

PEEK_BYTES = 256  # how much of a value ``get_into`` shows its caller before the value is read
PIECEWISE_BYTES = 16 << 20  # a value this large is read and hashed a MiB at a time (fileio.fill_pieces); smaller ones
# are read in one preadv with their header and hashed after it (at 4-8 MiB the extra system calls cost more)
Allocate = Callable[[int, bytes], "memoryview | Sequence[memoryview] | None"]  # (n, peek) -> buffers for n bytes
Place = Callable[[bytes, int], "list[memoryview] | None"]
Finish = Callable[[bytes, "list[memoryview]"], int]


def framed_reader(key: str, expect: chunkfile.BlobExpect, allocate: Allocate) -> Callable[[int, int], int]:
    """``FileTier.read_framed``'s ``frame`` for ``get_into(peek=False)``: the header's length is predicted from
    the file's size (``chunkfile.blob_frame``), header and value are read by one ``preadv`` straight into the
    caller's buffers, the header is compared byte for byte with the one this key's value must have (a JSON
    parse only when it differs: to say what is wrong, or where the value starts in a file of another writer),
    and the value's checksum is computed over those buffers: one copy, one pass of the hash."""
    keyed = expect.mac_key is not None

    def frame(fd: int, size: int) -> int:
        found = chunkfile.blob_frame(key, expect.fingerprint, size, keyed)
        if found is None:  # no value of this key fits the file: read its header first to say why
            raise Reframe
        buffers = fitted(allocate(found.payload_bytes, b""), found.payload_bytes)
        if buffers is None:  # no room, or a damaged file whose size says another length: its header tells
            raise Reframe
        head = bytearray(found.offset)
        if not keyed and len(buffers) == 1 and found.payload_bytes >= PIECEWISE_BYTES:
            fill(fd, [memoryview(head)], 0, found.offset, key)
            checksum = found.checksum_in(head)
            if checksum is None:  # damaged, or another writer's layout: parsing the header says which
                raise Reframe
            digest = chunkfile.payload_hasher()
            fill_pieces(fd, buffers[0], found.offset, size, key, each=digest.update)  # hashed while in cache
            chunkfile.check_digest(digest.hexdigest(), checksum, key)
            return found.payload_bytes
        if not keyed:
            fill(fd, [memoryview(head), *buffers], 0, size, key)
            checksum = found.checksum_in(head)
            if checksum is not None:  # the common case: exactly the header this value must have
                chunkfile.check_checksum(buffers, checksum, key)
                return found.payload_bytes
            tag = memoryview(b"")
        else:
            tag = memoryview(bytearray(mac.TAG_BYTES))
            fill(fd, [memoryview(head), *buffers, tag], 0, size, key)
            checksum = found.checksum_in(head)
        if checksum is None:
            parsed = chunkfile.blob_head(head, key, expect)  # raises for what is wrong
            if parsed.offset != found.offset:
                raise Reframe
        else:
            parsed = chunkfile.BlobHead(found.offset, found.payload_bytes, checksum, keyed)
        chunkfile.check_blob(head, buffers, tag=tag.tobytes(), parsed=parsed, key=key, expect=expect)
        return parsed.payload_bytes

    return frame


def split_reader(key: str, expect: chunkfile.BlobExpect, allocate: Allocate) -> tuple[Place, Finish]:
    """``FileTier.read_split``'s ``place`` and ``finish`` for ``get_into``: the header is parsed and checked once,
    by ``place``, and ``finish`` verifies the payload against it."""
    parsed_by_place: list[chunkfile.BlobHead] = []

    def place(head: bytes, size: int) -> list[memoryview] | None:
        frame = chunkfile.blob_frame(key, expect.fingerprint, size, expect.mac_key is not None)
        checksum = frame.checksum_in(head[: frame.offset]) if frame is not None else None
        if frame is not None and checksum is not None:  # exactly the header this key's value has: no parse
            parsed = chunkfile.BlobHead(frame.offset, frame.payload_bytes, checksum, frame.keyed)
        else:
            parsed = chunkfile.blob_head(head, key, expect)
        if parsed.size != size:
            raise CorruptChunkError(f"value {key!r}: {size} bytes, its header says {parsed.size}")
        parsed_by_place.append(parsed)
        peek = head[parsed.offset : parsed.offset + PEEK_BYTES]
        buffers = fitted(allocate(parsed.payload_bytes, peek), parsed.payload_bytes)
        if buffers is None:
            return None
        return [*buffers, memoryview(bytearray(mac.TAG_BYTES))] if parsed.keyed else buffers

    def finish(head: bytes, buffers: list[memoryview]) -> int:
        parsed = parsed_by_place[-1]
        payload, tag = (buffers[:-1], buffers[-1].tobytes()) if parsed.keyed else (buffers, b"")
        chunkfile.check_blob(head, payload, tag=tag, parsed=parsed, key=key, expect=expect)
        return parsed.payload_bytes

    return place, finish


def exactly(buffer: memoryview) -> Allocate:
    """An ``allocate`` for one engine buffer (SGLang's page, vLLM's chunk row): the buffer when the value is exactly
    its size, else no room (a value of another size is not that layout's: a miss)."""
    return lambda n, peek: buffer if n == len(buffer) else None


def fitted(buffers: memoryview | Sequence[memoryview] | None, n: int) -> list[memoryview] | None:
    """``buffers`` cut to exactly ``n`` bytes in all (byte views), or None when they hold fewer."""
    if buffers is None:
        return None
    if isinstance(buffers, memoryview) and buffers.format == "B" and buffers.c_contiguous and len(buffers) == n:
        return [buffers]  # one flat byte buffer of the value's size (SGLang's page, vLLM's chunk): as it is
    out: list[memoryview] = []
    left = n
    for buffer in [buffers] if isinstance(buffers, memoryview) else buffers:
        view = memoryview(buffer).cast("B")[:left]
        if len(view):
            out.append(view)
        left -= len(view)
    return out if left == 0 else None
