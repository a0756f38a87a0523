"""kernels/huge_pages.py: the arena the gguf weight mode moves its blocks into (2 MB pages where the
kernel gives them), and that the model computes the same with its weights there or not."""
from __future__ import annotations

import gguf
import pytest
import torch

from model_helpers import prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.kernels import huge_pages
from tokenmill.kernels.huge_pages import ALIGN, HUGE_PAGE, HugePageArena
from tokenmill.kernels.qmatmul import QuantizedWeight
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 100, 3, 250, 9, 42, 42, 17, 200, 11, 60]


def test_pieces_are_aligned_disjoint_copies():
    arena = HugePageArena(chunk_bytes=1 << 20)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for n in (5, 64, 1000, 3, 700_000)]
    sources += [torch.randn(7, 9, generator=g), torch.randn(3, 4, generator=g).to(torch.float16)]
    copies = [arena.copy_of(t) for t in sources]
    spans = []
    for src, cp in zip(sources, copies):
        assert cp.dtype == src.dtype and cp.shape == src.shape and torch.equal(cp, src)
        assert cp.data_ptr() % ALIGN == 0 and cp.data_ptr() != src.data_ptr()
        spans.append((cp.data_ptr(), cp.data_ptr() + cp.numel() * cp.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    # a mapping starts on a huge page boundary; a piece larger than a chunk gets a mapping of its own
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    big = arena.copy_of(torch.zeros(3 << 20, dtype=torch.uint8))
    assert big.data_ptr() % HUGE_PAGE == 0 and big.numel() == 3 << 20
    assert arena.copy_of(torch.empty(0)).numel() == 0


def test_the_switch_and_the_system_setting(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.wanted()
    monkeypatch.setenv(huge_pages.ENV, "1")
    assert huge_pages.wanted() == (huge_pages.thp_mode() in ("always", "madvise"))


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping holding addr, from /proc/self/smaps."""
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
            elif current and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not huge_pages.wanted(), reason="transparent huge pages are off on this system")
def test_touched_arena_memory_is_in_huge_pages():
    arena = HugePageArena(chunk_bytes=8 << 20)
    piece = arena.take(6 << 20)
    piece.fill_(1)  # the first touch faults the pages in
    assert _anon_huge_kb(piece.data_ptr()) >= 2048


@pytest.mark.parametrize("wtype", [Q.Q4_1, Q.Q8_0])
def test_model_computes_the_same_with_weights_in_the_arena(tmp_path, monkeypatch, wtype):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=wtype))
    monkeypatch.setenv(huge_pages.ENV, "0")
    plain = load_model(path, "gguf").model
    monkeypatch.setenv(huge_pages.ENV, "1")
    monkeypatch.setattr(huge_pages, "wanted", lambda: True)  # move even where the system has no THP
    moved = load_model(path, "gguf").model
    w_plain = plain.head_quantized.parts[0][0]
    w_moved = moved.head_quantized.parts[0][0]
    assert isinstance(w_moved, QuantizedWeight) and w_moved.qs.data_ptr() % ALIGN == 0
    assert torch.equal(w_moved.qs, w_plain.qs) and torch.equal(w_moved.sc, w_plain.sc)
    assert torch.equal(prefill_logits(moved, PROMPT), prefill_logits(plain, PROMPT))


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not huge_pages.return_freed_heap(), reason="no malloc_trim (not glibc)")
def test_freed_heap_goes_back_to_the_system():
    # What a load leaves behind once its copies moved into the arena: many freed mid-sized blocks that
    # glibc keeps in its heap (one still in use at the end stops the heap from shrinking on its own).
    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # 128 MB under the mmap threshold: the heap
    for b in blocks:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page
    kept = blocks[::50]
    del blocks
    before = _rss_anon_mb()
    huge_pages.return_freed_heap()
    after = _rss_anon_mb()
    assert before - after > 64, (before, after)
    assert len(kept) == 40
