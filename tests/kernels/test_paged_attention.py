"""kernels.attention: the compiled paged attention and K/V write against their PyTorch references,
for every variant this CPU runs, every cache dtype and head dims 64 (SmolLM2: 9 q / 3 kv heads) and
256 (Gemma 3 270M: 4 / 1); and the kernel's batch invariance, bit for bit.

Tolerance against the reference: |native - ref| <= 2e-5 + 1e-4 |ref|. Both read the same cache
values (int8 dequantised the same way), so only fp32 summation order and exp differ; outputs are
O(1) (values are unit normals)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.attention import (paged_attention, paged_attention_op, paged_attention_reference, write_kv,
                                         write_kv_op, write_kv_reference)

VARIANTS = native.runnable_variants()
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
SHAPES = {64: (9, 3), 256: (4, 1)}  # head dim -> (q heads, kv heads)
BS = 16
ATOL, RTOL = 2e-5, 1e-4


@dataclass
class Cache:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    tables: torch.Tensor  # [S, W] int32, padded with junk past each sequence's blocks
    q: list[torch.Tensor]  # per sequence: [length, H, D], the query of every position
    scale: float

    def args(self):
        return self.k, self.v, self.k_scale, self.v_scale


def make_cache(lengths: list[int], d: int, dtype: torch.dtype, seed: int = 0, block_size: int = BS,
               spare_blocks: int = 5) -> Cache:
    """Sequences of the given lengths, fully written, in shuffled non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    h, h_kv = SHAPES[d]
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + 2
    tables, taken = [], 0
    for n in needed:
        tables.append(ids[taken:taken + n] + [num_blocks + 1000] * (width - n))  # junk: must never be read
        taken += n
    slots_total = num_blocks * block_size
    k = torch.full((h_kv, slots_total, d), float("nan")).to(dtype) if dtype != torch.int8 else \
        torch.full((h_kv, slots_total, d), 99, dtype=torch.int8)
    v = k.clone()
    k_scale = torch.full((h_kv, slots_total), float("nan")) if dtype == torch.int8 else torch.empty(0)
    v_scale = k_scale.clone()
    qs = []
    for s, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = torch.as_tensor(tables[s])[pos // block_size] * block_size + pos % block_size
        kv = torch.randn(2, n, h_kv, d, generator=gen)
        write_kv_reference(kv[0], kv[1], k, v, k_scale, v_scale, slots)
        qs.append(torch.randn(n, h, d, generator=gen))
    return Cache(k, v, k_scale, v_scale, torch.tensor(tables, dtype=torch.int32), qs, d ** -0.5)


def run(c: Cache, chunks: list[tuple[int, int, int]], window: int = 0, block_size: int = BS, reference=False):
    """chunks: (sequence, first position, rows) in batch order. Returns the [T, H, D] output."""
    q = torch.cat([c.q[s][p:p + n] for s, p, n in chunks])
    cu = torch.tensor([0] + [sum(n for _, _, n in chunks[:i + 1]) for i in range(len(chunks))], dtype=torch.int32)
    start = torch.tensor([p for _, p, _ in chunks], dtype=torch.int32)
    tables = c.tables[[s for s, _, _ in chunks]]
    fn = paged_attention_reference if reference else paged_attention
    return fn(q, *c.args(), cu, start, tables, block_size, c.scale, window)


def assert_close(out, ref):
    err = (out - ref).abs()
    bound = ATOL + RTOL * ref.abs()
    assert out.shape == ref.shape and bool(torch.isfinite(out).all())
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def check(c: Cache, chunks, window: int = 0, block_size: int = BS):
    ref = run(c, chunks, window, block_size, reference=True)
    out = run(c, chunks, window, block_size)
    assert_close(out, ref)
    return out


@pytest.fixture(params=VARIANTS)
def variant(request):
    with native.use_variant(request.param):
        yield request.param


pytestmark = pytest.mark.skipif(not VARIANTS, reason="native extension not built")
dims = pytest.mark.parametrize("d", list(SHAPES))
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])


# ---- against the reference ------------------------------------------------------------------

@dims
@dtypes
def test_decode_ragged_tables(variant, d, dtype):
    """One decode row per sequence: 1 token, 1 block + 1, a full block, and long ones."""
    lengths = [1, BS + 1, BS, 100, 257, 3]
    c = make_cache(lengths, d, dtype)
    check(c, [(s, n - 1, 1) for s, n in enumerate(lengths)])


@dims
@dtypes
def test_prefill_with_and_without_context(variant, d, dtype):
    lengths = [40, 130, 33]
    c = make_cache(lengths, d, dtype, seed=1)
    check(c, [(0, 0, 40)])                       # whole prompt, no earlier context
    check(c, [(1, 50, 80), (2, 17, 16)])         # chunks after cached context, mid-block starts


@dims
@dtypes
def test_mixed_decode_and_prefill(variant, d, dtype):
    lengths = [70, 1, 200, 18, 45]
    c = make_cache(lengths, d, dtype, seed=2)
    check(c, [(0, 69, 1), (2, 150, 50), (1, 0, 1), (4, 0, 45), (3, 17, 1)])


@dims
@dtypes
@pytest.mark.parametrize("context", [7, 8, 9, 40])
def test_window_edges(variant, d, dtype, context):
    c = make_cache([context, 40], d, dtype, seed=3)
    check(c, [(0, context - 1, 1)], window=8)    # a decode row
    check(c, [(0, 0, context)], window=8)        # the prompt as one chunk
    check(c, [(1, 20, 20), (0, context - 1, 1)], window=8)


@pytest.mark.parametrize("block_size", [8, 32, 48])
def test_other_block_sizes(variant, block_size):
    c = make_cache([100, 37], 64, torch.bfloat16, seed=4, block_size=block_size)
    check(c, [(0, 60, 40), (1, 36, 1)], block_size=block_size)
    check(c, [(0, 60, 40), (1, 36, 1)], window=21, block_size=block_size)


def test_head_dim_80_and_strided_query(variant):
    """Any multiple of 16; q may be a view with free token/head strides (e.g. of a fused qkv)."""
    gen = torch.Generator().manual_seed(5)
    h, h_kv, d = 6, 2, 80
    k = torch.randn(h_kv, 64, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(h_kv, 64, d, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(30, (h + 2 * h_kv) * d, generator=gen)
    q = qkv[:, :h * d].view(30, h, d)
    args = (q, k, v, torch.empty(0), torch.empty(0), torch.tensor([0, 29, 30], dtype=torch.int32),
            torch.tensor([3, 40], dtype=torch.int32), torch.tensor([[3, 0, 1], [1, 2, 3]], dtype=torch.int32), 16, 0.1)
    assert_close(paged_attention(*args), paged_attention_reference(*args))


def test_bad_block_table_raises(variant):
    c = make_cache([20], 64, torch.float32)
    tables = c.tables.clone()
    tables[0, 1] = 10_000
    with pytest.raises((IndexError, ValueError)):
        paged_attention(c.q[0][19:20], *c.args(), torch.tensor([0, 1], dtype=torch.int32),
                        torch.tensor([19], dtype=torch.int32), tables, BS, c.scale)


# ---- batch invariance (bitwise, per variant) ----------------------------------------------------

@dims
@dtypes
@pytest.mark.parametrize("window", [0, 100])
def test_prompt_chunking_is_bitwise_invariant(variant, d, dtype, window):
    c = make_cache([600], d, dtype, seed=6)
    whole = run(c, [(0, 0, 600)], window)
    for split in ([300, 300], [7, 593], [1, 16, 17, 566]):
        parts, start = [], 0
        for n in split:
            parts.append(run(c, [(0, start, n)], window))
            start += n
        assert torch.equal(torch.cat(parts), whole), f"split {split}"


@dims
@dtypes
def test_batch_company_decode_vs_prefill_and_threads_are_bitwise_invariant(variant, d, dtype):
    lengths = [300, 90, 1, 160]
    c = make_cache(lengths, d, dtype, seed=7)
    alone = run(c, [(0, 200, 100)])
    # the same rows with other sequences before and after them
    shared = run(c, [(1, 89, 1), (3, 0, 160), (0, 200, 100), (2, 0, 1)])
    assert torch.equal(shared[161:261], alone)
    # each row as a decode row (a chunk of one), alone (too few work items: the kernel splits the
    # row's key segments and query heads over threads) and in a batch of decodes
    decodes = torch.cat([run(c, [(0, p, 1)]) for p in range(200, 300, 7)])
    assert torch.equal(decodes, alone[::7])
    batch = run(c, [(1, 89, 1)] + [(0, p, 1) for p in range(200, 300, 7)] + [(3, 159, 1)])
    assert torch.equal(batch[1:-1], alone[::7])
    # thread counts
    saved = torch.get_num_threads()
    try:
        for threads in (1, 3):
            native.set_num_threads(threads)
            assert torch.equal(run(c, [(1, 89, 1), (3, 0, 160), (0, 200, 100), (2, 0, 1)]), shared), threads
    finally:
        native.set_num_threads(saved)


@dims
@dtypes
@pytest.mark.parametrize("window,block_size", [(0, BS), (300, BS), (0, 48), (0, 512)])
def test_long_decode_rows_split_into_segments_are_bitwise_invariant(variant, d, dtype, window, block_size):
    """A decode row alone leaves threads idle, so the kernel runs its key segments (whole blocks,
    about 256 positions) as separate work items and folds them afterwards: the same bits as the row
    in a batch of decodes (one item, segments folded as it goes), as a prefill row, and at any
    thread count."""
    c = make_cache([1100, 40], d, dtype, seed=11, block_size=block_size)
    positions = [255, 256, 600, 1099]
    alone = [run(c, [(0, p, 1)], window, block_size) for p in positions]
    prefill = run(c, [(0, 200, 900)], window, block_size)
    batch = run(c, [(1, 39, 1)] * 4 + [(0, p, 1) for p in positions], window, block_size)
    for i, p in enumerate(positions):
        assert torch.equal(batch[4 + i:5 + i], alone[i]), p
        if 200 <= p < 1100:
            assert torch.equal(prefill[p - 200:p - 199], alone[i]), p
        assert_close(alone[i], run(c, [(0, p, 1)], window, block_size, reference=True))
    # a chunk whose last work item is a single row (rows per item: 32 at d=64, 16 at d=256): that
    # row alone is split into segments, and its output still lands on its own row
    rows = 33 if d == 64 else 17
    tail = run(c, [(0, 1099 - rows + 1, rows)], window, block_size)
    assert torch.equal(tail[-1:], alone[-1])
    assert torch.equal(tail[:-1], prefill[1099 - rows + 1 - 200:-1])
    saved = torch.get_num_threads()
    try:
        for threads in (1, 3):
            native.set_num_threads(threads)
            assert torch.equal(run(c, [(0, 1099, 1)], window, block_size), alone[-1]), threads
    finally:
        native.set_num_threads(saved)


@dims
@dtypes
@pytest.mark.parametrize("window", [0, 100])
def test_short_chunk_alone_split_by_rows_is_bitwise_invariant(variant, d, dtype, window):
    """A speculative verification: a few rows of one sequence, alone in the step. With more than one
    thread the kernel halves its work items by rows (down to single rows, which take the decode path
    and its segment split) to feed the threads: every row keeps the bits it has as a decode row
    alone and in a batch, at any thread count."""
    c = make_cache([700, 30], d, dtype, seed=12)
    saved = torch.get_num_threads()
    try:
        for rows in (2, 3, 5, 17):
            first = 700 - rows
            native.set_num_threads(1)
            one_item = run(c, [(0, first, rows)], window)
            decodes = torch.cat([run(c, [(0, p, 1)], window) for p in range(first, 700)])
            assert torch.equal(one_item, decodes), rows
            in_batch = run(c, [(1, 29, 1), (0, first, rows)], window)
            assert torch.equal(in_batch[1:], one_item), rows
            for threads in (2, 3, 4, 16):
                native.set_num_threads(threads)
                assert torch.equal(run(c, [(0, first, rows)], window), one_item), (rows, threads)
            assert_close(one_item, run(c, [(0, first, rows)], window, reference=True))
    finally:
        native.set_num_threads(saved)


@dims
@dtypes
@pytest.mark.parametrize("window", [0, 100])
def test_few_rows_of_one_sequence_keep_each_rows_decode_bits(variant, d, dtype, window):
    """A few rows of one sequence (a verification: up to 8 take the decode path) give each row the
    bits it has as a decode row alone and beside another sequence: 8 rows whose windows start in
    different tiles and segments (window 100: first keys 254-261, across the 256 boundary), rows
    whose last keys end in different tiles."""
    c = make_cache([700, 30], d, dtype, seed=13)
    saved = torch.get_num_threads()
    try:
        native.set_num_threads(1)
        for first, rows in ((353, 8), (350, 8), (600, 6), (696, 4)):
            together = run(c, [(0, first, rows)], window)
            decodes = torch.cat([run(c, [(0, p, 1)], window) for p in range(first, first + rows)])
            assert torch.equal(together, decodes), (first, rows)
            assert torch.equal(run(c, [(1, 29, 1), (0, first, rows)], window)[1:], together), (first, rows)
    finally:
        native.set_num_threads(saved)


@dtypes
def test_window_rows_are_bitwise_invariant(variant, dtype):
    c = make_cache([90], 64, dtype, seed=8)
    whole = run(c, [(0, 0, 90)], window=8)
    parts = torch.cat([run(c, [(0, 0, 41)], window=8), run(c, [(0, 41, 49)], window=8)])
    assert torch.equal(parts, whole)
    assert torch.equal(run(c, [(0, 89, 1)], window=8), whole[89:])


# ---- write_kv ---------------------------------------------------------------------------------

@dtypes
@pytest.mark.parametrize("d", [64, 256])
def test_write_kv_matches_reference_and_round_trips(variant, dtype, d):
    gen = torch.Generator().manual_seed(9)
    t, h_kv, slots = 37, 3, 128
    fused = torch.randn(t, 3 * h_kv * d, generator=gen) * 3
    k = fused[:, h_kv * d:2 * h_kv * d].view(t, h_kv, d)          # strided views, as from a fused qkv
    v = fused[:, 2 * h_kv * d:].view(t, h_kv, d)
    k[5, 1] = 0.0                                                   # an all-zero row: scale 0, values 0
    mapping = torch.tensor(random.Random(0).sample(range(slots), t))
    mapping[3] = -1                                                 # padding token: skipped

    def fresh():
        cache = [torch.zeros(h_kv, slots, d, dtype=dtype) for _ in range(2)]
        scales = [torch.zeros(h_kv, slots) if dtype == torch.int8 else torch.empty(0) for _ in range(2)]
        return cache + scales

    want, got = fresh(), fresh()
    write_kv_reference(k, v, *want, mapping)
    write_kv(k, v, *got, mapping)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    kc, vc, ks, vs = got
    keep = mapping >= 0
    for x, cache, sc in ((k, kc, ks), (v, vc, vs)):
        stored = cache[:, mapping[keep]].float()
        if dtype == torch.int8:
            step = sc[:, mapping[keep], None]
            assert bool(((stored * step - x[keep].transpose(0, 1)).abs() <= step / 2 * 1.0001 + 1e-7).all())
            assert int(cache.abs().max()) <= 127
        elif dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(stored, x[keep].transpose(0, 1).to(dtype).float())
        else:
            assert torch.equal(stored, x[keep].transpose(0, 1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_write_kv_float16_rounds_as_torch_does(variant):
    """Ties to even, overflow to inf, subnormals, signed zeros; the vector loop and its scalar tail
    (head dim 20: 16 + 4)."""
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 1e5, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26,
                          1e-8, 0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2049.0, 2051.0, float("inf")])
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(200, generator=gen) * torch.exp2(torch.randint(-30, 18, (200,), generator=gen).float())
    x = torch.cat([edges, -edges, wide])
    t, d = x.numel() // 20, 20
    k = x[:t * d].view(t, 1, d)
    mapping = torch.arange(t)
    with native.use_variant(variant):
        cache = [torch.zeros(1, t, d, dtype=torch.float16) for _ in range(2)]
        write_kv(k, k, *cache, torch.empty(0), torch.empty(0), mapping)
    expected = k.transpose(0, 1).to(torch.float16)
    assert torch.equal(cache[0].view(torch.int16), expected.view(torch.int16))


def test_custom_ops_pass_opcheck():
    """Schema, fake implementations and mutation declarations (not the slow aot_dispatch pass)."""
    fast = ("test_schema", "test_autograd_registration", "test_faketensor")
    c = make_cache([20, 5], 64, torch.int8)
    q = torch.cat([c.q[0][10:20], c.q[1][4:5]])
    args = (q, *c.args(), torch.tensor([0, 10, 11], dtype=torch.int32), torch.tensor([10, 4], dtype=torch.int32),
            c.tables, BS, c.scale, 0, 0.5)
    torch.library.opcheck(paged_attention_op, args, test_utils=fast)
    k, v = torch.randn(2, 4, 3, 64).unbind(0)
    torch.library.opcheck(write_kv_op, (k, v, *[x.clone() for x in c.args()], torch.tensor([0, 7, 20, 33])), test_utils=fast)
