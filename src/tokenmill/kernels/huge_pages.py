"""Memory in transparent huge pages (2 MB) for what every decode step streams: the quantized weights.

A one-row decode step reads all of a model's weights once. With 4 KB pages SmolLM2's 98 MB span
~24,000 pages, far more than the TLB holds, so the stream pays a page walk every 4 KB, and the walks'
page-table lines are themselves evicted whenever something else runs between steps (a speculative
verification, the HTTP loop, a sleep). Linux backs an anonymous mapping with 2 MB pages where it is
advised (MADV_HUGEPAGE: the usual `transparent_hugepage/enabled` setting is `madvise`, so without the
advice nothing changes). Measured on the 2-core Sapphire Rapids box (SmolLM2, 1 thread, one stream):
decode steps 7.5-8.5 ms -> 7.1-7.6 ms. Where the kernel refuses or lacks the advice the pages are
ordinary ones: the same bytes, only slower.

An arena hands out 64-byte-aligned pieces of a few large mappings, so that many small weights (a
SmolLM2 layer's projections are under 1 MB each) share whole huge pages. A piece keeps its mapping
alive (torch.frombuffer holds a reference), so a model's weights go back to the system when its last
tensor does."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # per mapping: a model's weights in a few of them
ALIGN = 64              # the kernels' cache-line alignment
ENV = "TOKENMILL_HUGE_PAGES"  # "0" keeps weights where the loader put them (ordinary pages)

_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def wanted() -> bool:
    """Whether weights go into huge-page arenas: not turned off, and the system can give them."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def thp_mode() -> str | None:
    """The kernel's transparent huge page setting (the bracketed word), or None where there is none."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


class HugePageArena:
    """A bump allocator over anonymous mappings advised for huge pages, each started at a 2 MB
    boundary. Pieces are never freed one by one: an arena holds one model's weights for its life."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 view of the current mapping, from its 2 MB boundary
        self._used = 0
        self._lock = threading.Lock()  # a model's weights are packed on several threads

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of nbytes (contents undefined), 64-byte aligned."""
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk = self._map(max(self.chunk_bytes, nbytes))
                start = 0
            self._used = start + nbytes
            return self._chunk[start:start + nbytes]

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """t's contents, shape and dtype in the arena (empty tensors stay as they are)."""
        if t.numel() == 0:
            return t
        src = t.contiguous()
        out = self.take(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
        out.copy_(src)
        return out

    def _map(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start at a 2 MB boundary
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take whole 2 MB pages
        except (AttributeError, OSError):
            pass  # ordinary pages: the same bytes
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        return whole[skip:skip + size - HUGE_PAGE]


def return_freed_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim; False where there is none).
    Moving weights into the arena frees the loader's copies, and glibc keeps freed memory of that size
    in its heap for reuse rather than unmapping it: SmolLM2 loaded to 447 MB resident instead of the
    380 MB it takes with its weights left in place, until this call (2-core box, one process)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim(0)
    return True
