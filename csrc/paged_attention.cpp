// Paged attention for a flat batch of query rows (prefill chunks and decode rows alike) over a
// head-major KV cache [kv_heads, slots, head_dim] of fp32, bf16, fp16 or int8 (+ per-slot scales).
//
// Batch invariance is the design constraint: a row's result must not depend on which other rows
// share its step or its work item. So keys are consumed in fixed tiles of at most 16 positions,
// aligned to their block (a tile never depends on where the work item's key range starts), tiles
// in position order, and every row runs the same fp32 operations on a tile: 16 scores at once,
// masked to the row's own keys, one online-softmax update, then V accumulated key by key
// (csrc/attention_tile.h). Rows of a work item only share the tile's loads (K converted and
// transposed once, V converted once); a decode row, and each row of an item of a few rows
// (takes_decode_path), reads K and V straight from the cache.
// Work items are (sequence, kv head, run of query rows). A row's keys are walked in fixed segments
// folded in order (attention_tile.h), so a long decode row's segments may run on different threads
// without changing its bits.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

// gcc 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_ps) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "attention_items.h"
#include "attention_tile.h"
#include "common.h"
#include "kernels.h"

namespace py = pybind11;

namespace tmk {
namespace {

using namespace attn;

struct Scratch {
    std::vector<float> kt, vt, q, acc, lane_sums, total_acc, total_sums;
    std::vector<const float*> qp;
    std::vector<RowState> st, total;
};

// Each (row, head)'s output: its accumulator over its softmax sum.
inline void store_output(const Problem& P, const RowState* st, int n, int G, int64_t row0, int64_t head0) {
    for (int i = 0; i < n; ++i) {
        const int r = i / G, g = i % G;
        const V16 total = vset1(vsum_all(vload(st[i].lane_sums)));
        float* dst = P.out + ((row0 + r) * P.H + head0 + g) * int64_t(P.D);
        for (int d = 0; d < P.D; d += 16) vstore(dst + d, vdiv(vload(st[i].acc + d), total));
    }
}

// The end of an item's rows: the last segment folded into each (row, head)'s total and the output
// written, or, for one segment of a split row, that segment's state left for the fold.
inline void finish_item(const Problem& P, const WorkItem& it, RowState* st, RowState* total, int n, int64_t row0,
                        int64_t head0) {
    const int D = P.D;
    if (it.split != nullptr) {
        const SplitRow& sr = *it.split;
        for (int g = 0; g < n; ++g) {
            float* dst = sr.state(it.segment, it.first_head - sr.first_head + g, D);
            std::copy(st[g].acc, st[g].acc + D, dst);
            std::copy(st[g].lane_sums, st[g].lane_sums + TILE, dst + D);
            dst[D + TILE] = st[g].max;
        }
        return;
    }
    for (int i = 0; i < n; ++i) fold_segment(total[i], st[i], D);
    store_output(P, total, n, it.num_heads, row0, head0);
}

// A split row's segments folded in order, then its output written.
void fold_split_row(const Problem& P, const SplitRow& sr) {
    const int D = P.D;
    std::vector<float> acc(static_cast<size_t>(D)), sums(static_cast<size_t>(TILE));
    const int64_t row0 = P.cu_rows[sr.seq] + sr.first_row;
    for (int g = 0; g < sr.num_heads; ++g) {
        RowState total{0.0f, sums.data(), acc.data()};
        reset_state(total, D);
        for (int64_t s = 0; s < sr.num_segments; ++s) {
            float* src = sr.state(sr.first_segment + s, g, D);
            fold_segment(total, RowState{src[D + TILE], src + D, src}, D);
        }
        store_output(P, &total, 1, 1, row0, int64_t(sr.kv_head) * P.G + sr.first_head + g);
    }
}

#if defined(TM_AVX512) || defined(TM_AVX2)
// A work item of one decode row, K and V read straight from the cache. Its heads' state lives in
// this frame rather than the shared scratch, and the models' head dims are compile-time constants
// (DIM; 0 = P.D). With the cache in L2, SmolLM2's shape ran 1.3x faster than in run_item's
// general loop (this file in a standalone C++ harness, 1 thread, 64 x 1024 keys, f16).
constexpr int DECODE_MAX_HEADS = 8, DECODE_MAX_D = 256;
template <int TYPE, int DIM, bool CAP>
void run_decode_item(const Problem& P, const WorkItem& it) {
    const int D = DIM > 0 ? DIM : P.D, G = it.num_heads;
    const int64_t head0 = int64_t(it.kv_head) * P.G + it.first_head;
    const int64_t row0 = P.cu_rows[it.seq] + it.first_row;
    const ItemTiles tiles(P, it);
    tiles.prefetch_first();
    alignas(64) float q[DECODE_MAX_HEADS * DECODE_MAX_D], acc[DECODE_MAX_HEADS * DECODE_MAX_D];
    alignas(64) float total_acc[DECODE_MAX_HEADS * DECODE_MAX_D];
    alignas(64) float sums[DECODE_MAX_HEADS * TILE], total_sums[DECODE_MAX_HEADS * TILE];
    const float* qp[DECODE_MAX_HEADS];
    RowState st[DECODE_MAX_HEADS], total[DECODE_MAX_HEADS];
    for (int g = 0; g < G; ++g) {
        const float* src = P.q + row0 * P.q_row_stride + (head0 + g) * P.q_head_stride;
        for (int d = 0; d < D; ++d) q[g * D + d] = src[d] * P.scale;
        qp[g] = q + g * D;
        st[g] = RowState{0.0f, sums + g * TILE, acc + g * D};
        total[g] = RowState{0.0f, total_sums + g * TILE, total_acc + g * D};
        reset_state(st[g], D);
        reset_state(total[g], D);
    }
    tiles.for_each([&](int64_t, int64_t, int first, int last, int64_t row, bool new_segment, const TileAhead& ahead) {
        if (new_segment) close_segment(total, st, G, D);
        attend_row<CAP>(qp, st, G, CacheTile<TYPE, DIM>{&P.k, &P.v, row, D, &ahead}, first, last, P.softcap);
    });
    finish_item(P, it, st, total, G, row0, head0);
}

// A few rows (a speculative verification, a prefill's last rows) run as decode rows, one after
// another, rather than through a converted and transposed tile shared by the rows: the per-key path's
// work a row is less, and the shared conversion pays only from about 8 rows. On the 2-core Sapphire
// Rapids box (bench/paged_attention.py's shapes, 300 keys in L2, one call, alternated builds) SmolLM2's
// 2 / 4 / 8 rows took 31 / 53 / 96 us against 43 / 62 / 105 (1 thread), 12 rows at 2 threads 76 against
// 85; Gemma 3's 2 / 4 / 8 rows 47 / 84 / 157 us against 76 / 117 / 182 (1 thread); in SmolLM2's
// engine step of one sequence verifying 2 / 3 / 5 / 7 proposals (2 threads, ~330 keys), attention 0.83 /
// 1.05 / 1.48 / 1.89 ms against 1.09 / 1.51 / 1.85 / 2.23. Only while a row's keys fit in L2
// (kDecodePathBytes of K and V), where the rows after the first find them: a long context's rows would
// each read them from further away, once a row.
constexpr int kDecodePathRows = 8;
constexpr int64_t kDecodePathBytes = int64_t(1) << 20;

bool takes_decode_path(const Problem& P, const WorkItem& it) {
    if (it.num_rows > kDecodePathRows || it.num_heads > DECODE_MAX_HEADS || P.D > DECODE_MAX_D) return false;
    if (it.num_rows == 1) return true;
    const int64_t pos_last = int64_t(P.start_pos[it.seq]) + it.first_row + it.num_rows - 1;
    const int64_t keys = pos_last + 1 - (P.window > 0 ? std::max<int64_t>(0, pos_last - it.num_rows + 2 - P.window) : 0);
    return keys * 2 * P.k.row_bytes <= kDecodePathBytes;
}
#endif

template <int TYPE, bool CAP>
void run_item(const Problem& P, const WorkItem& it, Scratch& sc) {
#if defined(TM_AVX512) || defined(TM_AVX2)
    if (takes_decode_path(P, it)) {
        for (int r = 0; r < it.num_rows; ++r) {  // a multi-row item is never a segment's (split_into_segments)
            WorkItem row = it;
            row.first_row = it.first_row + r;
            row.num_rows = 1;
            if (P.D == 64) run_decode_item<TYPE, 64, CAP>(P, row);
            else if (P.D == 256) run_decode_item<TYPE, 256, CAP>(P, row);
            else run_decode_item<TYPE, 0, CAP>(P, row);
        }
        return;
    }
#endif
    // G: this item's query heads, from the kv head's first_head-th on.
    const int D = P.D, G = it.num_heads, n = it.num_rows * G;
    const int64_t head0 = int64_t(it.kv_head) * P.G + it.first_head;
    const int64_t row0 = P.cu_rows[it.seq] + it.first_row;
    const ItemTiles tiles(P, it);
    tiles.prefetch_first();
    const int64_t pos0 = tiles.pos_last - (it.num_rows - 1);

    sc.q.resize(size_t(n) * D);
    sc.acc.resize(size_t(n) * D);
    sc.lane_sums.resize(size_t(n) * TILE);
    sc.total_acc.resize(size_t(n) * D);
    sc.total_sums.resize(size_t(n) * TILE);
    sc.qp.resize(size_t(n));
    sc.st.resize(size_t(n));
    sc.total.resize(size_t(n));
    const float** qp = sc.qp.data();
    RowState* st = sc.st.data();
    RowState* total = sc.total.data();
    for (int r = 0; r < it.num_rows; ++r)
        for (int g = 0; g < G; ++g) {
            const int i = r * G + g;
            const float* src = P.q + (row0 + r) * P.q_row_stride + (head0 + g) * P.q_head_stride;
            float* dst = sc.q.data() + size_t(i) * D;
            for (int d = 0; d < D; ++d) dst[d] = src[d] * P.scale;
            qp[i] = dst;
            st[i] = RowState{0.0f, sc.lane_sums.data() + size_t(i) * TILE, sc.acc.data() + size_t(i) * D};
            total[i] = RowState{0.0f, sc.total_sums.data() + size_t(i) * TILE, sc.total_acc.data() + size_t(i) * D};
            reset_state(st[i], D);
            reset_state(total[i], D);
        }

    tiles.for_each([&](int64_t ts, int64_t te, int first, int last, int64_t row, bool new_segment,
                       const TileAhead& ahead) {
        if (new_segment) close_segment(total, st, n, D);
#if defined(TM_AVX512) || defined(TM_AVX2)
        if (it.num_rows == 1) {
            attend_row<CAP>(qp, st, G, CacheTile<TYPE>{&P.k, &P.v, row, D, &ahead}, first, last, P.softcap);
            return;
        }
#endif
        ahead.all();  // a tile's work for many rows is long enough to hide the burst
        load_k_tile<TYPE>(P.k, row, first, last, sc.kt.data());
        load_v_tile<TYPE>(P.v, row, first, last, sc.vt.data());
        const ScratchTile tile{sc.kt.data(), sc.vt.data(), D};
        for (int r = 0; r < it.num_rows; ++r) {
            const int64_t pos = pos0 + r;
            const int64_t a = std::max({ts, tiles.first_key(pos), tiles.lo}), e = std::min({te, pos, tiles.hi});
            if (a > e) continue;
            attend_row<CAP>(qp + r * G, st + r * G, G, tile, int(a - ts), int(e - ts), P.softcap);
        }
    });
    finish_item(P, it, st, total, n, row0, head0);
}

// A work item's cost: its keys times its rows plus a constant for the walk over them (a decode row: 5
// a key), the unit kMinWorkPerThread counts in.
int64_t item_cost(const Problem& P, int seq, int first_row, int num_rows) {
    const int64_t pos0 = int64_t(P.start_pos[seq]) + first_row, p_last = pos0 + num_rows - 1;
    const int64_t keys = p_last + 1 - (P.window > 0 ? std::max<int64_t>(0, pos0 - P.window + 1) : 0);
    return keys * (num_rows + 4);
}

// Too few items for the threads (one sequence's short chunk: a speculative verification's few rows):
// halve the multi-row items by rows until there are `wanted` items or none has two rows left. Rows
// never share arithmetic, so this changes no bit of the result; it keeps each item's query heads
// together (the head split below would have every part convert the same tiles) and leaves
// single-row items for the decode path and its segment split. SmolLM2's 16-row verification at 2
// threads took its attention from 3 items (the heads then split in two) to 6.
void split_rows_of_items(const Problem& P, std::vector<WorkItem>& items, int64_t wanted) {
    while (int64_t(items.size()) < wanted) {
        std::vector<WorkItem> split;
        for (const WorkItem& it : items) {
            if (it.num_rows < 2) { split.push_back(it); continue; }
            const int half = it.num_rows / 2;
            WorkItem a = it, b = it;
            a.num_rows = half;
            a.cost = item_cost(P, it.seq, a.first_row, half);
            b.first_row = it.first_row + half;
            b.num_rows = it.num_rows - half;
            b.cost = item_cost(P, it.seq, b.first_row, b.num_rows);
            split.push_back(a);
            split.push_back(b);
        }
        if (split.size() == items.size()) return;
        items.swap(split);
    }
}

// Each decode item whose keys span several segments becomes one item per segment, writing its
// state into split_states for fold_split_row.
void split_into_segments(const Problem& P, std::vector<WorkItem>& items, std::vector<SplitRow>& split_rows,
                         std::vector<float>& split_states) {
    const int64_t seg_keys = int64_t(P.seg_blocks) * P.block_size;
    auto keys_of = [&](const WorkItem& it) {  // first and last key of a decode row
        const int64_t pos = int64_t(P.start_pos[it.seq]) + it.first_row;
        return std::pair<int64_t, int64_t>{P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0, pos};
    };
    auto segments_of = [&](const WorkItem& it) -> int64_t {
        if (it.num_rows != 1) return 1;
        const auto [lo, hi] = keys_of(it);
        return hi / seg_keys - lo / seg_keys + 1;
    };
    size_t floats = 0, rows = 0;
    for (const WorkItem& it : items)
        if (segments_of(it) > 1) floats += size_t(segments_of(it) * it.num_heads * state_floats(P.D)), ++rows;
    if (rows == 0) return;
    split_states.resize(floats);
    split_rows.reserve(rows);  // the items point into it: no reallocation
    float* next = split_states.data();
    std::vector<WorkItem> out;
    for (const WorkItem& it : items) {
        const int64_t n = segments_of(it);
        if (n <= 1) { out.push_back(it); continue; }
        const auto [lo, hi] = keys_of(it);
        split_rows.push_back({it.seq, it.first_row, it.kv_head, it.first_head, it.num_heads, lo / seg_keys, n, next});
        next += n * it.num_heads * state_floats(P.D);
        for (int64_t s = lo / seg_keys; s <= hi / seg_keys; ++s) {
            WorkItem sub = it;
            sub.segment = s;
            sub.split = &split_rows.back();
            sub.cost = (std::min(hi, (s + 1) * seg_keys - 1) - std::max(lo, s * seg_keys) + 1) * 5;
            out.push_back(sub);
        }
    }
    items.swap(out);
}

// A thread's least share of a call, in WorkItem cost x query heads x head dim (a decode row: 5 x G x D
// a key and kv head), which tracks time across shapes: one thread took ~0.022 ns a unit for SmolLM2's
// and Gemma 3's decode from an f16 cache (bench/paged_attention.py --threads 1, 100 against 1000
// keys, this 2-core Sapphire Rapids under load), so this is ~3 us: a SmolLM2 row of 100 keys takes 2
// threads, of 500 keys 11.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 17;

// Query rows per work item: enough to amortise each tile's conversion and transposition, few
// enough that the rows' accumulators (rows * G * D floats, <= 64 KB) stay in L2.
int rows_per_item(int G, int D) { return std::max(1, std::min(32, 16384 / (G * D))); }

void paged_attention(uintptr_t q, int64_t q_row_stride, int64_t q_head_stride, uintptr_t out, int64_t T, int H, int D,
                     uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scale, uintptr_t v_scale, int cache_type,
                     int Hkv, int64_t num_slots, uintptr_t cu_rows, uintptr_t start_pos, int S, uintptr_t block_tables,
                     int64_t table_width, int block_size, double scale, int window, double softcap) {
    if (D % 16 != 0 || D <= 0) throw std::invalid_argument("head_dim must be a positive multiple of 16");
    if (Hkv <= 0 || H % Hkv != 0) throw std::invalid_argument("query heads must be a multiple of kv heads");
    if (block_size <= 0 || num_slots % block_size != 0) throw std::invalid_argument("bad block_size");
    if (cache_type < CACHE_F32 || cache_type > CACHE_F16) throw std::invalid_argument("bad cache type");
    const int64_t row_bytes = int64_t(D) * (cache_type == CACHE_F32 ? 4 : cache_type == CACHE_I8 ? 1 : 2);
    Problem P{ptr<const float>(q), q_row_stride, q_head_stride, ptr<float>(out), H, Hkv, H / Hkv, D,
              CacheView{ptr<const void>(k_cache), cache_type == CACHE_I8 ? ptr<const float>(k_scale) : nullptr, num_slots, D, row_bytes},
              CacheView{ptr<const void>(v_cache), cache_type == CACHE_I8 ? ptr<const float>(v_scale) : nullptr, num_slots, D, row_bytes},
              ptr<const int32_t>(cu_rows), ptr<const int32_t>(start_pos), ptr<const int32_t>(block_tables), table_width,
              block_size, window, float(scale), segment_blocks(block_size), float(softcap)};

    // Check every block the kernel will read before any thread starts (no throwing inside a parallel region).
    const int64_t num_blocks = num_slots / block_size;
    const int step = rows_per_item(P.G, D);
    std::vector<WorkItem> items;
    if (P.cu_rows[0] != 0 || P.cu_rows[S] != T) throw std::invalid_argument("cu_rows must run from 0 to T");
    for (int s = 0; s < S; ++s) {
        const int rows = P.cu_rows[s + 1] - P.cu_rows[s];
        if (rows < 0) throw std::invalid_argument("cu_rows must be non-decreasing");
        if (rows == 0) continue;
        const int64_t first = P.start_pos[s], last = first + rows - 1;
        if (first < 0) throw std::invalid_argument("negative start_pos");
        if (last / block_size >= table_width) throw std::invalid_argument("block table too narrow for sequence " + std::to_string(s));
        const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
        for (int64_t b = lo / block_size; b <= last / block_size; ++b) {
            const int32_t id = P.tables[s * table_width + b];
            if (id < 0 || id >= num_blocks) throw std::out_of_range("block id out of range in sequence " + std::to_string(s));
        }
        for (int r = 0; r < rows; r += step) {
            const int n = std::min(step, rows - r);
            for (int h = 0; h < Hkv; ++h) items.push_back({s, h, r, n, 0, P.G, item_cost(P, s, r, n)});
        }
    }
    // Threads the work can feed: each must get a few microseconds of it (kMinWorkPerThread), so a
    // short decode row is not cut into slivers for 16 threads, each woken for about as long as its
    // wake-up costs.
    int64_t work = 0;
    for (const WorkItem& it : items) work += it.cost * it.num_heads * D;
    const int threads_wanted = int(std::max<int64_t>(1, std::min<int64_t>(num_threads(), work / kMinWorkPerThread)));
    // Too few items to keep those threads busy (one sequence decoding, few kv heads): split each long
    // decode row into its segments, then the items' query heads. Neither changes a bit of the
    // result (segments fold in order, fold_split_row; heads never interact), only who loads the
    // tiles: split by heads alone, every thread read all of the row's keys.
    if (threads_wanted > 1) split_rows_of_items(P, items, 2 * int64_t(threads_wanted));
    std::vector<SplitRow> split_rows;
    std::vector<float> split_states;
    if (threads_wanted > 1 && int64_t(items.size()) < 2 * threads_wanted)
        split_into_segments(P, items, split_rows, split_states);
    while (int64_t(items.size()) < 2 * threads_wanted) {
        std::vector<WorkItem> split;
        for (const WorkItem& it : items) {
            if (it.num_heads < 2) { split.push_back(it); continue; }
            const int half = it.num_heads / 2;
            WorkItem a = it, b = it;
            a.num_heads = half, a.cost = it.cost / 2;
            b.first_head = it.first_head + half, b.num_heads = it.num_heads - half, b.cost = it.cost - it.cost / 2;
            split.push_back(a);
            split.push_back(b);
        }
        if (split.size() == items.size()) break;
        items.swap(split);
    }
    // Longest first, handed out one at a time: balances a long prefill against many decodes.
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

    auto run_one = [&](const WorkItem& it, Scratch& sc) {
        if (P.softcap > 0.0f) {
            if (cache_type == CACHE_F32) run_item<CACHE_F32, true>(P, it, sc);
            else if (cache_type == CACHE_BF16) run_item<CACHE_BF16, true>(P, it, sc);
            else if (cache_type == CACHE_F16) run_item<CACHE_F16, true>(P, it, sc);
            else run_item<CACHE_I8, true>(P, it, sc);
        } else if (cache_type == CACHE_F32) run_item<CACHE_F32, false>(P, it, sc);
        else if (cache_type == CACHE_BF16) run_item<CACHE_BF16, false>(P, it, sc);
        else if (cache_type == CACHE_F16) run_item<CACHE_F16, false>(P, it, sc);
        else run_item<CACHE_I8, false>(P, it, sc);
    };
    const int64_t count = int64_t(items.size());
    const int threads = int(std::min<int64_t>(threads_wanted, count));
    auto scratch = [&](Scratch& sc) { sc.kt.resize(size_t(D) * TILE); sc.vt.resize(size_t(D) * TILE); };
    if (threads <= 1) {
        pool::count_inline();
        Scratch sc; scratch(sc);
        for (const WorkItem& it : items) run_one(it, sc);
    } else {
        // Items are claimed one at a time (an atomic counter), so a thread that drew short items takes
        // more; any thread may run any item without changing a bit of the result.
        std::atomic<int64_t> next{0};
        tmk::run(threads, [&](int, int) {
            Scratch sc; scratch(sc);
            // Claimed one ahead: the next item's first tiles load while this one computes (at short
            // contexts those are most of an item's tiles).
            int64_t i = next.fetch_add(1);
            while (i < count) {
                const int64_t j = next.fetch_add(1);
                if (j < count) ItemTiles(P, items[j]).prefetch_first();
                run_one(items[i], sc);
                i = j;
            }
        });
    }
    for (const SplitRow& sr : split_rows) fold_split_row(P, sr);
}

}  // namespace

void entry::paged_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, float* out, int64_t T, int H,
                            int D, const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
                            int cache_type, int Hkv, int64_t num_slots, const int32_t* cu_rows,
                            const int32_t* start_pos, int S, const int32_t* block_tables, int64_t table_width,
                            int block_size, float scale, int window, float softcap) {
    tmk::paged_attention(uintptr_t(q), q_row_stride, q_head_stride, uintptr_t(out), T, H, D, uintptr_t(k_cache),
                         uintptr_t(v_cache), uintptr_t(k_scale), uintptr_t(v_scale), cache_type, Hkv, num_slots,
                         uintptr_t(cu_rows), uintptr_t(start_pos), S, uintptr_t(block_tables), table_width, block_size,
                         scale, window, softcap);
}
}  // namespace tmk

void register_kv_write(py::module_& m);

void register_paged_attention(py::module_& m) {
    m.def("paged_attention", &tmk::paged_attention, py::call_guard<py::gil_scoped_release>(),
          "Attention of T query rows over a paged [Hkv, slots, D] cache (raw addresses; see kernels/attention.py)",
          py::arg("q"), py::arg("q_row_stride"), py::arg("q_head_stride"), py::arg("out"), py::arg("T"), py::arg("H"),
          py::arg("D"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
          py::arg("cache_type"), py::arg("Hkv"), py::arg("num_slots"), py::arg("cu_rows"), py::arg("start_pos"),
          py::arg("S"), py::arg("block_tables"), py::arg("table_width"), py::arg("block_size"), py::arg("scale"),
          py::arg("window"), py::arg("softcap") = 0.0);
    register_kv_write(m);
}
