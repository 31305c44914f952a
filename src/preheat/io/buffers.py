"""Host buffers for loads: one large allocation per file, handed out as a torch uint8 tensor.

Why torch.empty and not an anonymous shared mapping: private anonymous memory faults in about twice as fast as a
shared mapping on Linux, and torch owns its lifetime, so tensor views keep it alive with no copies.

torch is imported by the functions that build or read a tensor, not here: ``io.reads`` (and through it
``checkpoint.layout`` and ``store.pull``) imports this module, and a pull of a checkpoint or a header's check must
not wait for torch's import (~1 s), which a server runs beside them (docs/server.md, *Start-up order*).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAGE = mmap.PAGESIZE
HUGEPAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # linux/mman.h; not exported by the mmap module on every Python we support
_MADV_POPULATE_READ = 22  # linux/mman.h, Linux >= 5.14; mmap.madvise would hold the GIL through the whole call
POPULATE_CHUNK = 8 << 20  # bytes per MADV_POPULATE_READ call (see populate_read)

# dlopen(NULL): the process's own symbols, libc's among them; ctypes.util.find_library("c") would run ldconfig in a
# child process first (~7 ms of every start that imports the loader).
_libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def round_down(n: int, align: int) -> int:
    return n // align * align


def host_buffer(nbytes: int, *, align: int = 64, pinned: bool = False, hugepages: bool = True) -> torch.Tensor:
    """A fresh uint8 tensor of ``nbytes`` whose data pointer is ``align``-aligned.

    Large buffers are advised to use transparent huge pages where the kernel allows it ("madvise" mode), which cuts
    the page-fault cost of first touch by up to 512x fewer faults. ``pinned`` asks for page-locked memory (CUDA only).
    """
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if pinned:
        # cudaHostAlloc returns page-aligned memory; pinning is not something we can madvise afterwards.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if align <= 64:
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if hugepages and nbytes >= 4 * HUGEPAGE:
            advise_hugepages(raw)
        return raw
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % align
    buf = raw[shift : shift + nbytes]
    if hugepages and nbytes >= 4 * HUGEPAGE:
        advise_hugepages(buf)
    return buf


def mapped_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 tensor of ``nbytes`` over a private anonymous mapping of its own, unmapped as soon as the last
    tensor viewing it is freed; page-aligned, zero-filled, each page allocated at its first touch.

    For memory that must go back to the OS the moment its owner drops it. The allocator behind ``torch.empty``
    does not promise that: glibc returns a freed block only when it was mapped for itself, and its threshold for
    that rises to the largest block freed so far (up to 32 MiB), so blocks allocated after a first round of frees
    stay in its heap once freed; jemalloc and tcmalloc cache freed pages too. No huge pages: where the kernel must
    compact memory to find them, the first touch of 538 MB took 1.3-1.5 s of system time here instead of 0.2 s.
    """
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # not POSIX: the allocator's memory, which the platform returns as it does
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=private)  # -1: anonymous; private faults in ~2x faster than shared
    return torch.frombuffer(region, dtype=torch.uint8)  # the tensor holds the mapping; the last view unmaps it


def advise_hugepages(buf: torch.Tensor) -> None:
    """Best-effort MADV_HUGEPAGE over the whole huge pages inside ``buf``; silently a no-op where unsupported."""
    if _libc is None:
        return
    start = round_up(buf.data_ptr(), HUGEPAGE)
    end = round_down(buf.data_ptr() + buf.numel(), HUGEPAGE)
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def populate_read(address: int, nbytes: int) -> bool:
    """Map the pages of ``[address, address + nbytes)`` (mapped memory) for reading now, as a touch of every page
    would, with ``madvise(MADV_POPULATE_READ)``: the kernel fills the page tables in one pass (about half the time
    of a touch per page: 0.06-0.09 s against 0.13-0.18 s for 538 MB in the page cache here), and the calls, made
    through ctypes, release the GIL meanwhile. One call per ``POPULATE_CHUNK``: each holds the process's mmap lock
    for reading, and another thread's ``mmap``/``brk`` (a large malloc) waits for it; beside a single call for the
    whole 538 MB, a tokenizer parse took 0.13 s instead of 0.07 s. False where the kernel refuses it (before 5.14) or
    off Linux: the caller then touches the pages itself."""
    if _libc is None or nbytes <= 0:
        return _libc is not None
    start = round_down(address, PAGE)
    end = round_up(address + nbytes, PAGE)
    for offset in range(start, end, POPULATE_CHUNK):
        length = min(POPULATE_CHUNK, end - offset)
        if _libc.madvise(ctypes.c_void_p(offset), ctypes.c_size_t(length), _MADV_POPULATE_READ) != 0:
            return False
    return True


def as_memoryview(buf: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor, sharing its memory (no copy)."""
    import torch

    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("as_memoryview needs a contiguous CPU uint8 tensor")
    if buf.numel() == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * buf.numel()).from_address(buf.data_ptr())
    return memoryview(array).cast("B")
