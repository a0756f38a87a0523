// What a work item of paged attention is, and where its keys lie: the batch's description
// (Problem), the items it is cut into (WorkItem, SplitRow), and the walk over an item's key tiles in
// position order with the prefetch ahead (ItemTiles). Included by paged_attention.cpp only.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_tile.h"

namespace tmk {
namespace {

using namespace attn;

// ---- The batch.
struct Problem {
    const float* q; int64_t q_row_stride, q_head_stride;
    float* out;  // [T, H, D] contiguous
    int H, Hkv, G, D;
    CacheView k, v;
    const int32_t* cu_rows; const int32_t* start_pos; const int32_t* tables; int64_t table_width;
    int block_size, window;
    float scale;
    int seg_blocks;  // blocks per segment (attention_tile.h)
    float softcap;   // > 0: scores soft-capped (attend_group)
};

inline int64_t state_floats(int D) { return D + TILE + 1; }  // acc, lane sums, max

// A decode row whose segments run as separate work items: each writes its heads' state per
// segment into `states` ([segment][head][state_floats(D)]), folded in order once all have run.
struct SplitRow {
    int seq, first_row, kv_head, first_head, num_heads;
    int64_t first_segment, num_segments;
    float* states;
    // The state of segment `segment` (absolute) for the row's head'th head.
    float* state(int64_t segment, int head, int D) const {
        return states + ((segment - first_segment) * num_heads + head) * state_floats(D);
    }
};

struct WorkItem {
    int seq, kv_head, first_row, num_rows;  // rows relative to the sequence's chunk
    int first_head, num_heads;              // of the kv head's query heads (all of them unless split)
    int64_t cost;
    int64_t segment = -1;                   // the only segment it takes (-1: all of the row's keys)
    const SplitRow* split = nullptr;        // where it leaves its state instead of the output
};

// Tiles ahead to prefetch, into L2 (the line-fill buffers of L1 are few, and filling them with
// prefetches stalled the loads of the tile being computed). Measured with the per-key decode path,
// 64 sequences x 112 and x 1024 keys (bench/paged_attention.py, Zen 4): 1-3 tiles ahead ran alike,
// 4 and 8 up to 1.4x slower. With the prefetches spread over the tile (TileAhead), 2-4 ran alike
// on Zen 5, 1 about 7% slower.
constexpr int PREFETCH_TILES = 2;

// A tile of a work item's keys: block `block` of the sequence's table, tile `tile` of that block.
// Stepped through by increments, never recomputed from a flat tile number: that took several 64-bit
// divisions per tile, which the prefetch of the tile ahead then waited for.
struct TileCursor {
    int64_t block;
    int tile;
};

// Where a work item's keys lie, tile by tile in position order.
struct ItemTiles {
    const Problem& P;
    const int32_t* table;
    int64_t head_row, pos_last;  // pos_last: the last row's position
    int64_t lo, hi, last_block;  // the keys taken: the rows' (within the item's segment if it has one)
    int per_block;
    ItemTiles(const Problem& p, const WorkItem& it)
        : P(p), table(p.tables + it.seq * p.table_width), head_row(int64_t(it.kv_head) * p.k.num_slots) {
        const int64_t pos0 = int64_t(P.start_pos[it.seq]) + it.first_row;
        pos_last = pos0 + it.num_rows - 1;
        lo = first_key(pos0);
        hi = pos_last;
        if (it.segment >= 0) {
            const int64_t keys = int64_t(P.seg_blocks) * P.block_size;
            lo = std::max(lo, it.segment * keys);
            hi = std::min(hi, (it.segment + 1) * keys - 1);
        }
        per_block = (P.block_size + TILE - 1) / TILE;
        last_block = hi / P.block_size;
    }
    int64_t first_key(int64_t pos) const { return P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : int64_t(0); }
    // The first tile holding one of the item's keys.
    TileCursor first() const {
        const int64_t block = lo / P.block_size;
        return {block, int((lo - block * P.block_size) / TILE)};
    }
    static void next(TileCursor& c, int per_block) {
        if (++c.tile == per_block) { c.tile = 0; ++c.block; }
    }
    int64_t start(const TileCursor& c) const { return c.block * P.block_size + int64_t(c.tile) * TILE; }
    // The tile's last position (inclusive): 16 on, or the block's end.
    int64_t end(const TileCursor& c) const { return std::min<int64_t>(start(c) + TILE, (c.block + 1) * P.block_size) - 1; }
    bool done(const TileCursor& c) const { return c.block > last_block || start(c) > hi; }
    int64_t row(const TileCursor& c) const { return head_row + int64_t(table[c.block]) * P.block_size + int64_t(c.tile) * TILE; }
    // The item's keys of tile c, for the prefetch ahead (none once c is past the item's end).
    TileAhead ahead_of(const TileCursor& c) const {
        if (done(c)) return {};
        const int64_t r = row(c);
        return {static_cast<const char*>(P.k.data) + r * P.k.row_bytes, static_cast<const char*>(P.v.data) + r * P.k.row_bytes,
                P.k.scale != nullptr ? P.k.scale + r : nullptr, P.v.scale != nullptr ? P.v.scale + r : nullptr,
                P.k.row_bytes, int(std::min(end(c), hi) - start(c) + 1)};
    }
    // The tile PREFETCH_TILES after c.
    TileCursor ahead(TileCursor c) const {
        for (int i = 0; i < PREFETCH_TILES; ++i) next(c, per_block);
        return c;
    }
    // The first PREFETCH_TILES tiles: a short decode context is mostly these, so without this most of
    // its tiles would be waited for one after another.
    void prefetch_first() const {
        TileCursor c = first();
        for (int i = 0; i < PREFETCH_TILES; ++i, next(c, per_block)) ahead_of(c).all();
    }
    // f(ts, te, first, last, row, new_segment, ahead) for each tile in order: positions ts..te
    // (inclusive), of which first..last (relative to ts) hold the item's keys, at cache row `row`;
    // new_segment when an earlier tile of the item lay in another segment; ahead, the tile
    // PREFETCH_TILES on, which f prefetches (TileAhead).
    template <typename F>
    void for_each(F&& f) const {
        TileCursor pf = ahead(first());
        const TileCursor c0 = first();
        // The next segment's first block, stepped rather than found by a division per tile
        int64_t boundary = (c0.block / P.seg_blocks + 1) * P.seg_blocks;
        for (TileCursor c = c0; !done(c); next(c, per_block), next(pf, per_block)) {
            const int64_t ts = start(c), te = end(c);
            const bool new_segment = c.block == boundary && c.tile == 0;
            if (new_segment) boundary += P.seg_blocks;
            f(ts, te, int(std::max(ts, lo) - ts), int(std::min(te, hi) - ts), row(c), new_segment, ahead_of(pf));
        }
    }
};

}  // namespace
}  // namespace tmk
