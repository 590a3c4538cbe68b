// Shared by both kernels: the problem's constants, shared-memory helpers and the rows of a split.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace mla {

constexpr int D = 576;                 // key width = bytes per FP8 row
constexpr int DV = 512;                // value width
constexpr int BN = 64;                 // KV rows per tile

__host__ __device__ constexpr int log2i(int n) { return n > 1 ? 1 + log2i(n / 2) : 0; }  // n a power of two

// One call's arguments, the one list from the Python launcher to the kernels: mla_decode.cuda.build.DecodeCall is a
// ctypes Structure of the same fields in the same order (the build checks it against mla_decode_call_layout at load),
// a plan sets its own fields once and a call its inputs', mla_decode gets its address, and the split kernels take it
// by value.
// q (batch, q_len, num_heads, 576) bf16, num_heads >= 1, a sequence's q_len x num_heads rows in units of unit_rows
// query rows a CTA (16, or 32 and 64 in the wgmma build: the plan picks them, the launcher the kernel instance; a
// sequence's last unit is masked past its rows; QueryRows); kv: kv_format KV_FP8, the FP8 cache (total_kv rows of 576) e4m3 with kv_scale (1,) fp32;
// KV_MXFP4, the MXFP4 codes (total_kv rows of 288) with kv_block_scales, E8M0 bytes, row r's 18 at r * scale_stride;
// KV_BF16 (the wgmma build), the BF16 cache (total_kv rows of 576 bf16), no scale.
// The rows of sequence b: page_size 0 (ragged), seqs is kv_indptr (batch + 1,) and they are kv_indptr[b] ..
// kv_indptr[b+1] - 1; otherwise seqs is cache_seqlens (batch,) and position n is row block_table[b * max_pages + n /
// page_size] * page_size + n % page_size. out (batch, q_len, num_heads, 512) bf16; lse (batch, num_heads, q_len)
// fp32, natural log, or null; with units = batch * unit_groups (QueryRows), part_o (units *
// num_splits, unit_rows, 512) bf16, part_lse (units * num_splits, unit_rows) fp32 and sync (units,) uint32: the
// splits' partials and barrier (unused with one split); causal (q_len > 1): token t sees the first length - (q_len -
// 1 - t) positions; stream: the cudaStream_t to launch on; qk_scale = sm_scale * log2(e). Paged: page_mul and
// page_shift divide by page_size (page_of); guess_rows, split_rows of the plan's length (guess_entries).
// schedule: FIXED_SPLITS, num_splits a unit as above; or the work-balanced schedule (schedule.cuh), whose items
// (max_items,) int4 and part_first cut the batch into `parts` shares: SCHEDULE_IN_CALL, mla_decode makes them from
// seqs before the split kernel; SCHEDULE_GIVEN, mla_schedule made them earlier in the stream (one schedule for every
// layer of a step). Then part_o (max_items * groups, unit_rows, 512) and part_lse (max_items * groups, unit_rows),
// with groups = unit_groups; sync is unused (combine_kernel merges after the grid).
enum KvFormat : int { KV_FP8 = 0, KV_MXFP4 = 1, KV_BF16 = 2 };  // DecodeCall's kv_format
enum Schedule : int { FIXED_SPLITS = 0, SCHEDULE_IN_CALL = 1, SCHEDULE_GIVEN = 2 };
enum Cut : int { LINE_CUT = 0, FILL_CUT = 1, PACK_CUT = 2 };  // schedule.cuh's schedule_kernel, fill_, pack_
struct DecodeCall {
  const __nv_bfloat16* q;
  const uint8_t* kv;
  const float* kv_scale;
  const uint8_t* kv_block_scales;
  const int* seqs;
  const int* block_table;
  __nv_bfloat16* out;
  float* lse;
  __nv_bfloat16* part_o;
  float* part_lse;
  unsigned* sync;
  void* stream;
  int scale_stride, kv_format, batch, total_kv, num_splits, page_size, max_pages, num_heads, q_len, causal;
  float qk_scale;
  int unit_rows;  // the fields before it kept their offsets
  unsigned page_mul;
  int page_shift, guess_rows;
  int4* items;
  int schedule, parts, max_items;
  int min_share;  // the balanced schedule's least share in cost units: a short batch is cut into fewer, larger pieces
  int cut;        // the balanced schedule's cut: LINE_CUT, equal shares anywhere; FILL_CUT, parts filled in turn;
                  // PACK_CUT, filled from the longest sequence that fits
  int slack;      // the fill cut's overfill of a part, in cost units, that keeps a sequence whole
};

// A sequence's q_len x num_heads query rows, token-major as q and out lie them (row f = t * num_heads + h), in units
// of H rows (the grid's groups a sequence); the last unit is masked past the sequence's rows.
__host__ __device__ __forceinline__ int unit_groups(const DecodeCall& c, int H) {
  return (c.q_len * c.num_heads + H - 1) / H;
}

// A CTA's H query rows: grid row `unit` = b * groups + group holds rows f0 = group * H .. f0 + live - 1 of sequence
// b, which may span tokens (16 heads x 2 tokens in 32 rows); rows from live on read a zero query and are never stored
// to out or lse. t: the unit's last token, whose causal range is the widest: the unit walks it, and a row of an
// earlier token masks the positions it does not see (row_shift). q and out rows row0 + e; the unit indexes the
// partials and the barrier.
struct QueryRows {
  int b, unit, t, live, f0;
  size_t row0;
};

template <int H>
__device__ __forceinline__ QueryRows query_rows(const DecodeCall& c, int unit) {
  const int groups = unit_groups(c, H), b = unit / groups, f0 = (unit % groups) * H;
  const int live = min(H, c.q_len * c.num_heads - f0);
  return {b, unit, (f0 + live - 1) / c.num_heads, live, f0, static_cast<size_t>(b) * c.q_len * c.num_heads + f0};
}

// The positions row e of the unit sees fewer than its last token (causal; 0 for the rows past live).
__device__ __forceinline__ int row_shift(const DecodeCall& c, const QueryRows& r, int e) {
  return c.causal && e < r.live ? r.t - (r.f0 + e) / c.num_heads : 0;
}

// Row e's LSE in lse (batch, num_heads, q_len).
__device__ __forceinline__ size_t row_lse(const DecodeCall& c, const QueryRows& r, int e) {
  const int f = r.f0 + e, t = f / c.num_heads;
  return (static_cast<size_t>(r.b) * c.num_heads + (f - t * c.num_heads)) * c.q_len + t;
}

constexpr float LN2 = 0.6931471805599453f;  // the kernels' log-sum-exp is base 2, the caller's natural

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// v rounded to bf16, stored as 4 consecutive values (8-byte aligned dst).
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* dst, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// A kernel instance's cache layout (the launcher picks it from page_size and the format): ragged rows
// (kv_indptr), pages whose tiles are consecutive rows of one page (FP8, a multiple of BN rows: each thread reads its
// tiles' table entries itself), or rows looked up in PagedRows (other pages, and MXFP4, whose block scales are read
// per row).
enum Layout : int { RAGGED = 0, ROW_PAGES = 1, TILE_PAGES = 2 };

// The positions [lo, hi) of sequence b that split `split` attends to for token t: splits of whole 64-row tiles,
// ntiles of them, over the len positions the token sees; `start`: the sequence's first row (ragged). An invalid
// kv_indptr range or length reads nothing (valid = false; its output rows become NaN).
struct SplitRange {
  int lo, hi, ntiles, start, len;
  bool valid;
};

// The positions of each split of a sequence of len >= 0 (num_splits is a power of two): whole tiles.
__device__ __forceinline__ int split_rows(const DecodeCall& c, int len) {
  return (((len + c.num_splits - 1) >> (__ffs(c.num_splits) - 1)) + BN - 1) / BN * BN;
}

__device__ __forceinline__ SplitRange split_range(const DecodeCall& c, int b, int split, int t) {
  int start = 0, len;
  bool valid;
  if (c.page_size == 0) {
    start = c.seqs[b];
    const int end = c.seqs[b + 1];
    valid = start >= 0 && end >= start && end <= c.total_kv;
    len = end - start;
  } else {
    len = c.seqs[b];
    valid = len >= 0 && len <= c.max_pages * c.page_size;
  }
  if (!valid) start = len = 0;
  if (c.causal) len = max(len - (c.q_len - 1 - t), 0);
  const int per_split = split_rows(c, len);
  const int lo = split * per_split;
  const int hi = min(lo + per_split, len);
  return {lo, hi, hi > lo ? (hi - lo + BN - 1) / BN : 0, start, len, valid};
}

// The positions of a range [lo, hi) of the unit's last token that row e does not see, from its end: row e attends to
// [lo, hi - row_cut). tail: the positions the last token sees past hi (len - hi). 0 but in a unit that spans tokens,
// at the end of the sequence.
__device__ __forceinline__ int row_cut(const DecodeCall& c, const QueryRows& rows, int e, int tail) {
  return max(0, row_shift(c, rows, e) - tail);
}
__device__ __forceinline__ int row_cut(const DecodeCall& c, const QueryRows& rows, const SplitRange& r, int e) {
  return row_cut(c, rows, e, r.len - r.hi);
}

// Whether a row that sees [lo, hi - cut) of a valid range comes out a number: it reaches no position at or past
// bad, the first on a page outside the cache (PagedRows::bad; NO_BAD_PAGE where none).
__device__ __forceinline__ bool row_ok(bool valid, int bad, int hi, int cut = 0) {
  return valid && bad >= hi - cut;
}

// A CTA's work: piece `index` of the `count` pieces that cut unit rows.unit's positions, positions [lo, ...) (the
// first: exact, or with fixed splits the plan's guess: the range is piece_range's); count 1: the CTA writes out,
// else its partial at part_o's slot `part`.
struct Piece {
  QueryRows rows;
  int index, count, lo, tile_hi;  // tile_hi: the balanced piece's end, in tiles of its sequence
  size_t part;
};

// The fixed splits' piece of this CTA: grid (num_splits, units), split blockIdx.x of unit blockIdx.y; the unit's
// split s at slot unit * num_splits + s.
template <int H>
__device__ __forceinline__ Piece split_piece_of(const DecodeCall& c) {
  Piece p;
  p.rows = query_rows<H>(c, blockIdx.y);
  p.index = blockIdx.x;
  p.count = c.num_splits;
  p.lo = p.index * c.guess_rows;
  p.tile_hi = 0;
  p.part = static_cast<size_t>(p.rows.unit) * c.num_splits + p.index;
  return p;
}

constexpr int MAX_PIECES = 512;  // the most parts a balanced schedule cuts (the most pieces a sequence has)

// The balanced schedule's items, then part_first (parts + 1,) int32: part p's pieces are items part_first[p] ..
// part_first[p + 1] - 1 (schedule.cuh writes both).
__device__ __forceinline__ const int* part_first(const DecodeCall& c) {
  return reinterpret_cast<const int*>(c.items + c.max_items);
}

// The balanced grid is (groups, parts): a part's groups, which read the same tiles, are neighbours in launch order.
__device__ __forceinline__ int balanced_part() { return blockIdx.y; }
__device__ __forceinline__ int balanced_group() { return blockIdx.x; }

// Item k's piece of group balanced_group()'s unit; its partial at slot k * groups + group, so a sequence's pieces
// (consecutive items) lie groups slots apart.
template <int H>
__device__ __forceinline__ Piece item_piece(const DecodeCall& c, int k) {
  const int4 item = c.items[k];  // {b, first tile, end tile, index << 16 | count}
  const int groups = unit_groups(c, H);
  Piece p;
  p.rows = query_rows<H>(c, item.x * groups + balanced_group());
  p.index = item.w >> 16;
  p.count = item.w & 0xffff;
  p.lo = item.y * BN;
  p.tile_hi = item.z;
  p.part = static_cast<size_t>(k) * groups + balanced_group();
  return p;
}

// A persistent CTA of the balanced grid walks its part's pieces (balanced_part()) in line order, decode(piece) each;
// a barrier between pieces frees the shared memory. A part's work is one share of the batch, so every CTA of the
// resident grid has about the same.
template <int H, typename Decode>
__device__ __forceinline__ void for_each_piece(const DecodeCall& c, Decode&& decode) {
  const int part = balanced_part(), first = __ldg(part_first(c) + part), end = __ldg(part_first(c) + part + 1);
  for (int k = first; k < end; ++k) {
    if (k > first) __syncthreads();
    decode(item_piece<H>(c, k));
  }
}

// The positions of piece p for token t: split_range's with fixed splits; the item's tiles with the balanced schedule,
// cut at what the token sees.
template <bool BALANCED>
__device__ __forceinline__ SplitRange piece_range(const DecodeCall& c, const Piece& p, int t) {
  if constexpr (!BALANCED) {
    return split_range(c, p.rows.b, p.index, t);
  } else {
    SplitRange r = split_range(c, p.rows.b, 0, t);  // one split of the call: the whole range the token sees
    const int hi = min(p.tile_hi * BN, r.hi);
    r.lo = p.lo;
    r.hi = hi;
    r.ntiles = hi > p.lo ? (hi - p.lo + BN - 1) / BN : 0;
    return r;
  }
}

// The page of position pos >= 0, pos / page_size as a multiply and a shift (the host's page_divisor; exact below
// 2^31): the first copies of a paged split wait behind it, where a division takes ~25 dependent instructions.
__device__ __forceinline__ int page_of(const DecodeCall& c, int pos) {
  return static_cast<int>((static_cast<unsigned long long>(pos) * c.page_mul) >> c.page_shift);
}

// Position pos's row in the cache, from its page's block-table entry; -1 where that page lies outside the cache
// (never followed).
__device__ __forceinline__ int page_row(const DecodeCall& c, int entry, int pos) {
  return static_cast<unsigned>(entry) < static_cast<unsigned>(page_of(c, c.total_kv))
             ? entry * c.page_size + (pos - page_of(c, pos) * c.page_size)
             : -1;
}

// A paged split's table entries for its first STAGES tiles, asked for beside the sequence's length instead of after
// it, from position lo: Piece's lo (fixed splits: that of a sequence of the plan's length, guess_rows a split; the
// balanced schedule's items give it exactly).
// Where the real split starts there too (always at split 0, and wherever the length gives the plan's split rows)
// they are the right ones, else the caller reads them again. e[i]: the entry of row `row` of tile i (positions
// clamped into the table; past the split's end they go unused). No branch and a short chain from the arguments:
// these loads must be issued before the first instruction that waits for the length, and ptxas orders them only
// within a basic block.
template <int STAGES>
struct GuessedEntries {
  int lo;
  int e[STAGES];
};

template <int STAGES>
__device__ __forceinline__ GuessedEntries<STAGES> guess_entries(const DecodeCall& c, int b, int lo, int row) {
  GuessedEntries<STAGES> g;
  g.lo = lo;
  const int table_rows = c.max_pages * c.page_size;
  const int* table_row = c.block_table + static_cast<size_t>(b) * c.max_pages;
#pragma unroll
  for (int i = 0; i < STAGES; ++i) {
    const int pos = min(g.lo + i * BN + row, table_rows - 1);  // -1 only without a table: then not followed
    g.e[i] = __ldg(table_rows > 0 ? table_row + page_of(c, pos) : c.seqs);
  }
  return g;
}

// The rows of the next tiles of a paged split, in shared memory: ROW_SLOTS tiles of BN rows (tile i in slot i %
// ROW_SLOTS), written one iteration before the copies that read them. Threads 0..BN-1 each look up one row; `bad`
// records the first position on a page outside the cache (never followed: the rows that would see it become NaN),
// NO_BAD_PAGE if none.
constexpr int NO_BAD_PAGE = 0x7fffffff;
constexpr int ROW_SLOTS = 4;  // the copies' STAGES - 1 tiles ahead (3 at most) and the tile after the current one
struct PagedRows {
  int* rows;  // [ROW_SLOTS][BN]
  int* bad;   // shared: the first bad position

  // Thread tid < BN: the block table's entry for tile `tile`'s row tid (-1 past hi), which put() turns into a row.
  // Nothing here depends on the loaded entry: a branch on it where it is loaded stalled the warp (and with it the
  // warpgroup's next MMA) for the load's latency, every tile and once per tile before the first copies.
  __device__ __forceinline__ int fetch(const DecodeCall& c, int b, int lo, int hi, int tile, int tid) const {
    const int pos = lo + tile * BN + tid;
    return tid < BN && pos < hi ? __ldg(c.block_table + static_cast<size_t>(b) * c.max_pages + page_of(c, pos))
                                : -1;
  }
  // Stores the row of fetch()'s entry: -1 past hi, or where the page lies outside the cache (then flagged bad).
  __device__ __forceinline__ void put(const DecodeCall& c, int tile, int tid, int entry, int lo, int hi) const {
    const int pos = lo + tile * BN + tid;
    if (tid < BN) {
      const bool in = pos < hi;
      const int row = in ? page_row(c, entry, pos) : -1;
      rows[(tile % ROW_SLOTS) * BN + tid] = row;
      if (in && row < 0) atomicMin(bad, pos);
    }
  }
  __device__ __forceinline__ int at(int tile, int r) const { return rows[(tile % ROW_SLOTS) * BN + r]; }

  // The rows of tiles 0 .. STAGES - 1, visible to the whole CTA on return (the loop looks the later ones up a tile
  // ahead); guess: guess_entries' per row, taken where the split starts where it guessed.
  template <int STAGES>
  __device__ __forceinline__ void first_tiles(const DecodeCall& c, int b, int lo, int hi, int tid,
                                              const GuessedEntries<STAGES>& guess) const {
    if (tid == 0) *bad = NO_BAD_PAGE;
    int first[STAGES];
#pragma unroll
    for (int i = 0; i < STAGES; ++i) first[i] = lo == guess.lo ? guess.e[i] : fetch(c, b, lo, hi, i, tid);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < STAGES; ++i) put(c, i, tid, first[i], lo, hi);
    __syncthreads();
  }
};

}  // namespace mla
