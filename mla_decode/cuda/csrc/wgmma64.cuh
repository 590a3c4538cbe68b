// The Hopper (sm_90a) split kernel for units of 64 query rows (QueryRows): two warpgroups, one CTA an SM.
// The score product puts the heads on its M side (S = Q K^T), so a head's max over a tile is a thread's few scores
// and two shuffles, and a thread's softmax works on 2 heads.
// - FP8: each warpgroup scores one tile of a pair (m64n64k32); the value product keeps the heads on N (O^T = V^T P^T,
//   A from registers), as split_kernel has it.
// - BF16 (a tile is 72 KB: two stages and Q fill the SM): a seesaw. Warpgroup w scores tile 2q + w of a pair
//   (m64n64k16) and owns O[:, 256w .. 256w + 255]; each takes both tiles' P into its half of O (m64n256k16, V as an
//   MN-major B straight from the tile): its own tile's from registers, the other's from that tile's rope block, dead
//   after its scores. The running max passes from tile 2q's softmax to tile 2q + 1's and back through shared memory,
//   so one warpgroup's softmax runs while the other's products do. A stage is reloaded by groups of 64-dim blocks,
//   each as soon as its last reader retires, so the next pair's copies overlap this pair's products.
#pragma once

#include <cuda.h>

#include "wgmma.cuh"

namespace mla {

constexpr int WIDE_ROWS = 64;                   // query rows a CTA (a unit)
constexpr int WIDE_THREADS = 256;               // two warpgroups
constexpr int WIDE_WARPS = WIDE_THREADS / 32;
constexpr int WIDE_CTAS_PER_SM = 1;             // 128 accumulators and 32 scores a thread: no room for a second
// Each loop iteration (a stream position) takes a pair of 64-row tiles: warpgroup w scores tile 2q + w of the stream.
// FP8: 4 stages hold the pair being read and the next one in flight. BF16: the pair fills BF_STAGES = 2, tile 2q + s
// in stage s.
constexpr int WIDE_STAGES = 4;
constexpr int PAIR = 2;  // tiles a stream position
template <bool BF>
__host__ __device__ constexpr int wide_stages() { return BF ? BF_STAGES : WIDE_STAGES; }
static_assert(BF_STAGES == PAIR, "a BF16 pair: one stage a tile");
// BF16: stage s's tile is copied in two groups of 64-dim blocks, each by the warpgroup w that reads it last: blocks
// 4w .. 4w + 3 (the values of w's half of O) and, where s != w, block 8 (the rope dims, then the other warpgroup's
// P). Group (s, w) has the mbarrier bars[2 s + w], which each of w's threads arrives on (with the TMA's bytes).
__host__ __device__ constexpr int group_blocks(int s, int w) { return 4 + (s != w); }
// Per head, fp32: each warpgroup's tile max of the pair, the pair's rescale, each warpgroup's final sum (two sets: a
// unit's output reads them while the next unit's are written), Q's scale.
constexpr int WIDE_STATS = 8 * WIDE_ROWS;
// The running max a pair's P is taken against moves only when the pair's max passes it by more than LAZY_MAX (log2
// units): most pairs then rescale nothing. P = 2^(s - max + WIDE_P_BIAS) stays within e4m3's 448 (2^(6 + 2) = 256).
constexpr float LAZY_MAX = 2.f;
constexpr float WIDE_P_BIAS = 6.f;
static_assert(WIDE_P_BIAS + LAZY_MAX <= 8.f, "P's largest value within e4m3's range");
// The reference after a pair whose max is pair_max: the guess of a tile and the pair's own take the same rule.
__device__ __forceinline__ float lazy_reference(float reference, float pair_max) {
  return pair_max > reference + LAZY_MAX ? pair_max : reference;
}
// A CTA walks units blockIdx.y, + gridDim.y, ... (with one split the grid is at most one CTA an SM), or its part's
// pieces (the balanced schedule); their pairs of tiles form one stream, so the next unit's first pair is copied
// during this unit's last pair and output. The items are laid out WIDE_MAX_ITEMS at a time (warp 0, 2 a lane): the
// fixed splits' grid keeps to one such chunk, a part may take several.
constexpr int WIDE_MAX_ITEMS = 64;
// A unit's positions [lo, hi), lo shifted so that the CTA's stream tile i (pair i / 2) covers positions lo + 64 i ..;
// start: the sequence's first row (ragged); b: the sequence.
struct alignas(16) WideRange {
  int lo, hi, start, b;
};
// The units a CTA walks, in shared memory (one chunk: unit blockIdx.y + k gridDim.y, or the part's piece k of the
// chunk, is item k): their ranges, the stream position past each one's last pair (a unit without tiles takes none),
// the positions past hi its last token sees (row_cut's tail), their first bad positions (PagedRows::bad) and
// split_range's verdicts; each row's row_cut (two sets: a unit's output reads them while the next unit's are
// written; in shared memory, not registers, which the pair loop has none to spare for); and the stages' mbarriers.
struct WideItems {
  WideRange range[WIDE_MAX_ITEMS];
  int end[WIDE_MAX_ITEMS];
  int tail[WIDE_MAX_ITEMS];
  int bad[WIDE_MAX_ITEMS];
  int valid[WIDE_MAX_ITEMS];
  int cuts[2][WIDE_ROWS];
  uint64_t bars[WIDE_STAGES];
  // The item of stream position q, from the item k of an earlier one (positions past the last item: nitems).
  __device__ __forceinline__ int at(int k, int q, int nitems) const {
    while (k < nitems && q >= end[k]) ++k;
    return k;
  }
};
// Shared memory: the stages, Q (64 x 576 e4m3, or bf16), P (FP8: 128 x 64 e4m3; BF16: in the stages), the per-head
// stats, the paged rows (BF16: a set a warpgroup, which looks up the rows of its own copies) and the units.
template <bool BF>
__host__ __device__ constexpr int wide_rows_bytes() { return (BF ? 2 : 1) * SMEM_PAGED; }
template <bool BF>
constexpr int wide_smem_bytes() {
  const int stages_and_p = BF ? BF_STAGES * BF_TILE : WIDE_STAGES * TILE + 2 * BN * WIDE_ROWS;
  return stages_and_p + WIDE_ROWS * D * operand_bytes(BF ? KV_BF16 : KV_FP8) + WIDE_STATS * 4 +
         wide_rows_bytes<BF>() + sizeof(WideItems);
}
static_assert(wide_smem_bytes<false>() <= 227 * 1024, "a block's shared memory on Hopper");
static_assert(wide_smem_bytes<true>() <= 227 * 1024, "a block's shared memory on Hopper (BF16)");
// PagedRows' 4 slots (the stream's tile i in slot i % 4) hold positions q + 1 and q + 2 during stream position q
// (FP8): q + 1's rows are read by its copies at the top of the iteration, q + 2's written after the scores (q's
// slots, free since then). BF16: a warpgroup's slots hold position q + 1's, written after the scores and read by the
// copies the warpgroup issues later in the iteration.
static_assert(ROW_SLOTS == 4, "two pairs of tiles' rows");

// A whole tile of consecutive cache rows reaches its stage by TMA: one thread issues two boxes (dims 0..511 as 4
// blocks of [64 rows][128 bytes], 128-byte swizzle, through a map that takes a row's 128-byte chunks as a third
// dimension; the rope dims as [64 rows][64 bytes], 64-byte swizzle: the layouts tile_offset states) and the stage's
// mbarrier counts their bytes, so the warps issue no copies ahead of the score product. Other tiles (a split's partial
// last one, pages under 64 rows, a bad page) are copied by every thread as split_kernel copies them, and TMA_THREAD
// arrives on the mbarrier alone.
constexpr int TMA_THREAD = WIDE_THREADS / 2;  // warpgroup 1's: warpgroup 0 looks the next rows up
struct WideMaps {
  // FP8: the cache as (4 chunks, total_kv rows, 128 bytes) and (total_kv rows, 576 bytes). BF16: both as (9 chunks,
  // total_kv rows, 128 bytes), main's box 4 blocks (a group's values) and rope's 1 (block 8), 128-byte swizzled.
  CUtensorMap main, rope;
};

__device__ __forceinline__ void mbar_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}
// Box {0, row, chunk} of a 3D map (128 bytes, rows, chunks) to dst, counted by bar.
__device__ __forceinline__ void tma_3d(const CUtensorMap& map, uint32_t dst, uint32_t bar, int row, int chunk) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(0), "r"(row), "r"(chunk), "r"(bar) : "memory");
}
// FP8: box {0, row, 0} of the main map to the stage's dims 0..511, box {512, row} of the rope map to its rope dims.
__device__ __forceinline__ void tma_tile(const WideMaps& maps, uint32_t dst, uint32_t bar, int row) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "n"(TILE) : "memory");
  tma_3d(maps.main, dst, bar, row, 0);
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst + ROPE_OFFSET), "l"(reinterpret_cast<uint64_t>(&maps.rope)), "r"(DV), "r"(row), "r"(bar) : "memory");
}
// BF16: group (s, w) of a tile whose 64 rows follow cache row `row` into its stage at dst.
__device__ __forceinline__ void tma_group(const WideMaps& maps, uint32_t dst, uint32_t bar, int row, int s, int w) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(group_blocks(s, w) * SW128_BLOCK)
               : "memory");
  tma_3d(maps.main, dst + 4 * w * SW128_BLOCK, bar, row, 4 * w);
  if (s != w) tma_3d(maps.rope, dst + 8 * SW128_BLOCK, bar, row, 8);
}
// BF16: group (s, w) of tile i by warpgroup w's threads (wtid), 16 bytes each: copy c = wtid + 128 it is unit c % 8 of
// row (c / 8) % 64 of the group's block c / 512, so a warp reads 4 rows' 128 consecutive bytes. consecutive: the
// tile's rows follow cache row `first` (-1: a page outside the cache, nothing read), else each is looked up in
// paged_rows; rows past hi are zero-filled, never read.
__device__ __forceinline__ void bf16_group(const DecodeCall& call, const PagedRows& paged_rows, bool consecutive,
                                           int first, uint32_t dst, int i, int lo, int hi, int wtid, int s, int w) {
  constexpr int PER_BLOCK = BN * 8 / 128;  // copies a thread a block
  const int rows = consecutive && first >= 0 ? hi - (lo + i * BN) : 0, copies = group_blocks(s, w) * PER_BLOCK;
#pragma unroll
  for (int it = 0; it < 5 * PER_BLOCK; ++it) {
    if (it >= copies) break;
    const int c = wtid + 128 * it, block = it < 4 * PER_BLOCK ? 4 * w + (c >> 9) : 8, r = (c >> 3) & (BN - 1),
              u = c & 7;
    const int row = consecutive ? (r < rows ? first + r : -1) : paged_rows.at(i, r);
    CopyPlan<128, false>::copy_or_zero(dst + block * SW128_BLOCK + r * 128 + ((u ^ (r & 7)) << 4),
                                       call.kv + static_cast<size_t>(max(row, 0)) * BF_ROW + (8 * block + u) * 16,
                                       row >= 0);
  }
}
// Named barriers of the BF16 seesaw (0 is __syncthreads'): warpgroup 0's reference and P are in (X), warpgroup 1's
// (Y); a warpgroup's own paged rows are in (ROWS_BAR + w).
constexpr int SEESAW_X = 1, SEESAW_Y = 2, ROWS_BAR = 3;
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void rows_bar(int w) {  // constant ids: ptxas then reserves 5 barriers, not 16
  if (w) bar_sync(ROWS_BAR + 1, 128);
  else bar_sync(ROWS_BAR, 128);
}
// BF16: S (64 heads x the 64 rows of tile 2q + W, in stage W at kt) = Q K^T, 36 k16 steps, both operands in shared
// memory. The steps take the blocks of group (W, 0) first (its mbarrier bar0), then those of group (W, 1) (bar1),
// each group as soon as it is in.
template <int W>
__device__ __forceinline__ void seesaw_scores(float* s, uint32_t kt, uint64_t qdesc, uint32_t bar0, uint32_t bar1,
                                              int parity) {
  constexpr int QCHUNK = WIDE_ROWS * 16, FIRST = 4 * group_blocks(W, 0);  // k16 steps of the first group
  const uint64_t krows = desc(kt, 16, 1024, 1);
  mbar_wait(bar0, parity);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // a group copied by cp.async
  wg_fence();
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    if (j == FIRST) {
      mbar_wait(bar1, parity);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    // group (0, 0): steps 0..15; (0, 1): 16..35; (1, 0): 0..15 and 32..35; (1, 1): 16..31
    const int st = W == 0 || j < 16 ? j : j < FIRST ? j + 16 : j - 4;
    wgmma_ss_bf16<64>(s, qdesc + ((2 * st * QCHUNK) >> 4), krows + (((st >> 2) * SW128_BLOCK + (st & 3) * 32) >> 4),
                      j);
  }
  wg_commit();
}

// BF: the BF16 cache (else FP8). BAL: the balanced schedule's grid (groups, parts): a CTA walks its part's pieces
// (item_piece), merged by combine_kernel after the grid.
template <bool BF, bool PAGED, bool BAL>
__global__ void __launch_bounds__(WIDE_THREADS, WIDE_CTAS_PER_SM)
split_kernel64(const DecodeCall call, const __grid_constant__ WideMaps maps) {
  constexpr int H = WIDE_ROWS;
  constexpr int QCHUNK = H * 16;  // Q and P: [16-byte chunk][64 heads][16 bytes] (8 dims a chunk in bf16)
  constexpr int NE = H / 4;       // heads a thread in the FP8 value product (O^T's columns)
  constexpr int STAGES = wide_stages<BF>(), STEP = PAIR, KTILE = BF ? BF_TILE : TILE;
  extern __shared__ __align__(1024) uint8_t smem[];
  // wg: the warpgroup (its tile of a pair; its 256 value dims; BF16: warp-uniform as the compiler sees it, so that a
  // branch on it around the products is not divergent); warp: within the warpgroup; cwarp: within the CTA.
  const int tid = threadIdx.x, wg = BF ? __shfl_sync(0xffffffffu, tid >> 7, 0) : tid >> 7, wtid = tid & 127, cwarp = tid >> 5, warp = cwarp & 3, lane = tid & 31,
            g = lane >> 2, t4 = lane & 3;
  uint8_t* qs = smem + STAGES * KTILE;
  uint8_t* ps = qs + H * D * operand_bytes(BF ? KV_BF16 : KV_FP8);  // FP8's P (BF16: in the stage)
  // [warpgroup][head]; BF16: the references after the pair's first tile and after its second
  float* tile_max = reinterpret_cast<float*>(ps + (BF ? 0 : 2 * BN * H));
  float* pair_alpha = tile_max + 2 * H;                          // [head]
  float* sums = pair_alpha + H;                                  // [item parity][warpgroup][head]
  float* qscale = sums + 4 * H;
  int* const rows_smem = reinterpret_cast<int*>(qscale + H);
  WideItems& items = *reinterpret_cast<WideItems*>(rows_smem + wide_rows_bytes<BF>() / 4);
  auto paged_rows = [&](int k) { return PagedRows{rows_smem + (BF ? wg * SMEM_PAGED / 4 : 0), items.bad + k}; };
  const uint32_t bars = smem_u32(items.bars);  // stage s's mbarrier at bars + 8 s
  const int split = blockIdx.x;  // fixed splits
  const int units = call.batch * unit_groups(call, H);
  int first_item = 0, total_items;  // the CTA's items: the balanced part's pieces from item first_item, or units
  if constexpr (BAL) {
    first_item = __ldg(part_first(call) + balanced_part());
    total_items = __ldg(part_first(call) + balanced_part() + 1) - first_item;
  } else {
    total_items = (units - static_cast<int>(blockIdx.y) + gridDim.y - 1) / gridDim.y;
  }
  if (total_items <= 0) return;
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < WIDE_STAGES; ++st) mbar_init(bars + 8 * st, BF ? 128 : 1);
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  }

  int item0 = first_item, nitems = 0;  // the chunk's first item and its items
  // Item k of the chunk: its piece (the balanced part's) or its unit's split `split`.
  auto piece_at = [&](int k) {
    if constexpr (BAL) return item_piece<H>(call, item0 + k);
    Piece p{};
    p.rows = query_rows<H>(call, static_cast<int>(blockIdx.y + (item0 + k) * gridDim.y));
    p.index = split, p.count = call.num_splits;
    p.part = static_cast<size_t>(p.rows.unit) * call.num_splits + split;
    return p;
  };
  const float kv_scale = BF ? 1.f : *call.kv_scale;  // read with the length (wgmma.cuh's split_kernel says why)
  // fixed splits: one item, one chunk
  const unsigned base = BAL ? 0u : arrival_base(call.sync, piece_at(0).rows.unit, call.num_splits);
  static_assert(WIDE_MAX_ITEMS == 64, "two items a lane of warp 0");
  int q = 0;  // the stream position of the pair being scored, over every chunk (the stages' mbarrier phases)
  for (int chunk = 0; chunk < total_items; chunk += WIDE_MAX_ITEMS) {
    item0 = first_item + chunk;
    nitems = min(total_items - chunk, WIDE_MAX_ITEMS);
    if (chunk > 0) __syncthreads();  // every warp is done with the last chunk's items
    // Warp 0 reads the items' lengths and lays out the stream: item k's pairs of tiles take positions end[k - 1] ..
    // end[k] - 1, from the stream's position q.
    if (cwarp == 0) {
      int npairs[2], first = q;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = lane + 32 * i;
        SplitRange r{0, 0, 0, 0, 0, true};
        int b = 0;
        if (k < nitems) {
          const Piece piece = piece_at(k);
          b = piece.rows.b;
          r = piece_range<BAL>(call, piece, piece.rows.t);
        }
        npairs[i] = (r.ntiles + STEP - 1) / STEP;
        int scan = npairs[i];  // inclusive prefix sum over the warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, scan, o);
          if (lane >= o) scan += v;
        }
        const int end = first + scan;
        first += __shfl_sync(0xffffffffu, scan, 31);
        if (k < nitems) {
          items.range[k] = WideRange{r.lo - STEP * (end - npairs[i]) * BN, r.hi, r.start, b};
          items.end[k] = end;
          items.tail[k] = r.len - r.hi;
          items.bad[k] = NO_BAD_PAGE;
          items.valid[k] = r.valid;
        }
      }
    }
    const bool consecutive = !PAGED || call.page_size % BN == 0;  // a tile's rows: consecutive cache rows

    const CopyPlan<WIDE_THREADS, false> copy(tid);
    const uint32_t ks_addr = smem_u32(smem);
    // FP8: stream position q (a pair of item k, range r): tiles STEP q .. STEP q + STEP - 1 to their stages (tile t
    // in t % STAGES), one cp.async group (empty past the last item). A tile past the item's hi (the second of an odd
    // item's last pair) is zero-filled.
    auto load_pair = [&](int k, const WideRange& r, int q) {
      if (k < nitems) {
#pragma unroll
        for (int i = 0; i < STEP; ++i) {
          const int t = STEP * q + i, n0 = r.lo + t * BN, stage = t % STAGES;
          const int first = PAGED ? paged_rows(k).at(t, 0) : r.start + n0;  // the tile's first row, if consecutive
          if (consecutive && first >= 0 && r.hi - n0 >= BN) {
            if (tid == TMA_THREAD) tma_tile(maps, ks_addr + stage * KTILE, bars + 8 * stage, first);
          } else {
            copy.tile(call, paged_rows(k), consecutive, first, ks_addr + stage * KTILE, t, r.lo, r.hi);
            if (tid == TMA_THREAD) mbar_arrive(bars + 8 * stage);
          }
        }
      }
      asm volatile("cp.async.commit_group;\n");
    };
    // BF16: group (s, wg) of position q's tile STEP q + s (item k, range r) to stage s, by this warpgroup: TMA where
    // the tile's rows are consecutive cache rows, else its threads' cp.async; each thread arrives on the group's
    // mbarrier (with cp.async, once its copies are in). A tile past the item's hi is zero-filled.
    auto load_group = [&](int k, const WideRange& r, int q, int s) {
      if (k >= nitems) return;
      const int t = STEP * q + s, n0 = r.lo + t * BN;
      const uint32_t dst = ks_addr + s * BF_TILE, bar = bars + 8 * (2 * s + wg);
      const int first = PAGED ? paged_rows(k).at(t, 0) : r.start + n0;
      if (consecutive && first >= 0 && r.hi - n0 >= BN) {
        if (wtid == 0) tma_group(maps, dst, bar, first, s, wg);
        else mbar_arrive(bar);
      } else {
        bf16_group(call, paged_rows(k), consecutive, first, dst, t, r.lo, r.hi, wtid, s, wg);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
      }
    };
    // Threads 0..64 STEP - 1 (BF16: of each warpgroup, into its own rows): the block-table entry of one row of
    // position q's tiles (item k, range r), then its row.
    const int row_tid = BF ? wtid : tid;
    auto fetch_rows = [&](int k, const WideRange& r, int q) {
      return k < nitems && row_tid < STEP * BN
                 ? paged_rows(k).fetch(call, r.b, r.lo, r.hi, STEP * q + (row_tid >> 6), row_tid & (BN - 1)) : 0;
    };
    auto put_rows = [&](int k, const WideRange& r, int q, int entry) {
      if (k < nitems && row_tid < STEP * BN)
        paged_rows(k).put(call, STEP * q + (row_tid >> 6), row_tid & (BN - 1), entry, r.lo, r.hi);
    };
    // The item of position q past item k's last pair, and its range.
    auto later = [&](int k, int q, WideRange& r) {
      const int next = items.at(k + 1, q, nitems);
      if (next < nitems) r = items.range[next];
      return next;
    };
    using Query = QueryQuant<H, WIDE_WARPS, BF>;
    typename Query::Regs qv;
    Query::load(qv, call, piece_at(0).rows, cwarp, lane);
    __syncthreads();  // the items
    WideRange r0{}, r1{};
    const int k0 = later(-1, q, r0), k1 = later(k0 - 1, q + 1, r1);  // the items of positions q and q + 1
    if constexpr (BF) {  // position q's rows and groups, by each warpgroup
      if (PAGED) {
        put_rows(k0, r0, q, fetch_rows(k0, r0, q));
        rows_bar(wg);
      }
      load_group(k0, r0, q, 0);
      load_group(k0, r0, q, 1);
    } else {
      if (PAGED) {  // their rows
        const int e0 = fetch_rows(k0, r0, q), e1 = fetch_rows(k1, r1, q + 1);
        __syncthreads();
        put_rows(k0, r0, q, e0);
        put_rows(k1, r1, q + 1, e1);
        __syncthreads();
      }
      load_pair(k0, r0, q);
    }
    Query::store(qv, call, kv_scale, qs, qscale, cwarp, lane);
    // The score rows of this thread: heads h0 and h1 = h0 + 8 (wgmma's accumulator rows g and g + 8 of the warp's 16),
    // kv columns 8i + 2 t4 + {0, 1} of its warpgroup's tile (s[4i], s[4i + 1] for h0, s[4i + 2], s[4i + 3] for h1).
    const int h0 = warp * 16 + g, h1 = h0 + 8;
    int heads[NE];
    thread_heads(heads, t4);
    const uint64_t pdesc = desc(smem_u32(ps), QCHUNK, 128, 0);
    const uint64_t qdesc = desc(smem_u32(qs), QCHUNK, 128, 0);
    // P's k order: the pair's tile 2q + w at k = 64 w + p_position(column). Columns 16c + 2 t4 + {0, 1} and
    // 16c + 8 + 2 t4 + {0, 1} land on k = 64 w + 16c + 4 t4 + {0..3}: one 4-byte store a head and 16 columns.
    uint8_t* const pdst = ps + 4 * wg * QCHUNK + h0 * 16 + 4 * t4;
    // This thread's 32 values of P (the score layout: columns 16c .. 16c + 15 in p[8c .. 8c + 7]) into P as e4m3.
    auto store_p = [&](const float* p32) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float* p = p32 + 8 * c;
        *reinterpret_cast<uint32_t*>(pdst + c * QCHUNK) = to_e4m3x2(p[0], p[1]) | to_e4m3x2(p[4], p[5]) << 16;
        *reinterpret_cast<uint32_t*>(pdst + c * QCHUNK + 8 * 16) = to_e4m3x2(p[2], p[3]) | to_e4m3x2(p[6], p[7]) << 16;
      }
    };
    // Warpgroup w's value dims 256w .. 256w + 255 are the tile's 128-byte-swizzled blocks 2w and 2w + 1.
    const uint32_t vbase = ks_addr + 2 * wg * SW128_BLOCK;
    const uint32_t voff[2] = {lane * 128u + ((warp ^ (lane & 7)) << 4), lane * 128u + (((4 + warp) ^ (lane & 7)) << 4)};

    for (int k = 0; k < nitems; ++k) {
      const Piece piece = piece_at(k);
      const int unit = piece.rows.unit, end = items.end[k], pieces = piece.count;
      const WideRange range = items.range[k];
      if (k > 0 && q < end) {  // the unit's Q, once every warp is done with the last one's (the output's barrier)
        Query::load(qv, call, piece.rows, cwarp, lane);
        Query::store(qv, call, kv_scale, qs, qscale, cwarp, lane);
      }
      if (k + 1 < nitems) {  // the next unit's Q into L2 while this one runs
        const QueryRows next = piece_at(k + 1).rows;
        const char* next_q = reinterpret_cast<const char*>(call.q + next.row0 * D);
        for (int line = tid; line < next.live * D * 2 / 128; line += WIDE_THREADS)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(next_q + line * 128));
      }
      float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // running max and this thread's share of the sum
      // The positions before hi that each row does not see (row_cut; row 0's is the largest), read after the first
      // pair's barrier (or the sums' barrier).
      int* const cut = items.cuts[k & 1];
      if (tid < H) cut[tid] = row_cut(call, piece.rows, tid, items.tail[k]);
      // FP8: O^T, [64-dim block][accumulator]: dims 256*wg + 64*mb + 16*warp + 2g (+1 for rows g + 8). BF16: O, acc[0]
      // in wgmma_bf16_n256_mn's layout (heads h0 and h1, dims 256*wg + 8j + 2 t4 + {0, 1}).
      float acc[BF ? 1 : 4][BF ? 4 * H / 2 : H / 2];
#pragma unroll
      for (auto& block : acc)
#pragma unroll
        for (float& a : block) a = 0.f;

      if constexpr (BF) {  // Q and the cuts, before the first scores (the FP8 pairs' barrier does it)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
      }

      // TUNE: pairs
      for (; q < end; ++q) {
        if constexpr (BF) {
          // The seesaw (the header says why). Warpgroup 0: S0, P0 and the reference after tile 2q (X), O_L += P0 V0;
          // once warpgroup 1's P1 and reference are in (Y), O_L += P1 V1. Warpgroup 1: S1; at X, O_R += P0 V0, then
          // P1 against X's reference (Y), O_R += P1 V1. Each group of the next pair is copied as its last reader
          // retires, and the next pair's rows are looked up while the scores run.
          float s[H / 2];
          if (wg == 0) seesaw_scores<0>(s, ks_addr, qdesc, bars, bars + 8, q & 1);
          else seesaw_scores<1>(s, ks_addr + BF_TILE, qdesc, bars + 16, bars + 24, q & 1);
          WideRange rn = range;
          const int kn = q + 1 < end ? k : later(k, q + 1, rn);
          const int next_entry = PAGED ? fetch_rows(kn, rn, q + 1) : 0;
          wg_wait<0>();
          fence_acc<H / 2>(s);
          if (PAGED) {
            put_rows(kn, rn, q + 1, next_entry);
            rows_bar(wg);  // the warpgroup's rows of position q + 1, for its copies below
          }
          // Softmax over the tile's 64 rows, log2 domain; rows past hi (less the head's cut) are masked. s[i]: head
          // i & 2 ? h1 : h0, row 8 (i / 4) + 2 t4 + (i & 1).
          const int in_tile = range.hi - range.lo - (STEP * q + wg) * BN, in0 = in_tile - cut[h0],
                    in1 = in_tile - cut[h1];
          float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
          for (int i = 0; i < H / 2; ++i) {
            const bool in = 8 * (i >> 2) + 2 * t4 + (i & 1) < (i & 2 ? in1 : in0);
            s[i] = in ? s[i] * call.qk_scale : -INFINITY;
            if (i & 2) mx1 = fmaxf(mx1, s[i]);
            else mx0 = fmaxf(mx0, s[i]);
          }
#pragma unroll
          for (int o = 1; o < 4; o <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
          }
          // The accumulators and sum from reference (m0, m1) to (n0, n1) (no product in flight on them).
          auto rebase = [&](float n0, float n1) {
            const float alpha0 = ex2(m0 - (n0 == -INFINITY ? 0.f : n0)),
                        alpha1 = ex2(m1 - (n1 == -INFINITY ? 0.f : n1));
            if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {  // warp-uniform: the products' registers
#pragma unroll
              for (int i = 0; i < 4 * H / 2; ++i) acc[0][i] *= i & 2 ? alpha1 : alpha0;
              l0 *= alpha0, l1 *= alpha1;
            }
            m0 = n0, m1 = n1;
          };
          // P = 2^(s - reference) (at most 2^LAZY_MAX) into s, and into stage wg's rope block as [8-row chunk][head][8
          // rows], the other warpgroup's K-major A. Returns this thread's sums of P, heads h0 and h1.
          auto take_p = [&](float n0, float n1) {
            const float base0 = n0 == -INFINITY ? 0.f : n0, base1 = n1 == -INFINITY ? 0.f : n1;
            float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
            for (int i = 0; i < H / 2; ++i) {
              s[i] = ex2(s[i] - (i & 2 ? base1 : base0));
              if (i & 2) sum1 += s[i];
              else sum0 += s[i];
            }
            uint8_t* const pt = smem + wg * BF_TILE + 8 * SW128_BLOCK + h0 * 16 + 4 * t4;
#pragma unroll
            for (int j = 0; j < H / 8; ++j) {
              *reinterpret_cast<__nv_bfloat162*>(pt + j * QCHUNK) = __floats2bfloat162_rn(s[4 * j], s[4 * j + 1]);
              *reinterpret_cast<__nv_bfloat162*>(pt + j * QCHUNK + 8 * 16) =
                  __floats2bfloat162_rn(s[4 * j + 2], s[4 * j + 3]);
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            return make_float2(sum0, sum1);
          };
          // O[:, 256 wg ..] += P V over stage st's tile, 4 k16 steps; V is its 64-dim blocks 4 wg .. 4 wg + 3 (8 KB
          // apart, 8-row groups 1 KB apart) as an MN-major B. P: this warpgroup's own (registers: s as A fragments,
          // rows g and g + 8 of the warp's heads, k 2 t4 + {0, 1} and + 8) or the other's (its stage's rope block).
          uint32_t pa[BN / 16][4];
          auto values = [&](int st, bool own) {
            const uint64_t vd = desc(ks_addr + st * BF_TILE + 4 * wg * SW128_BLOCK, SW128_BLOCK, 1024, 1);
            const uint64_t pd = desc(ks_addr + st * BF_TILE + 8 * SW128_BLOCK, QCHUNK, 128, 0);
            fence_acc<4 * H / 2>(acc[0]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
              if (own) wgmma_bf16_n256_rs_mn(acc[0], pa[kk], vd + ((kk * 16 * 128) >> 4));
              else wgmma_bf16_n256_mn(acc[0], pd + ((2 * kk * QCHUNK) >> 4), vd + ((kk * 16 * 128) >> 4));
            }
            wg_commit();
          };
          auto own_fragments = [&] {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const __nv_bfloat162 v = __floats2bfloat162_rn(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
                pa[kk][i] = *reinterpret_cast<const uint32_t*>(&v);
              }
          };
          auto retire = [&] {
            wg_wait<0>();
            fence_acc<4 * H / 2>(acc[0]);
          };
          float* const ref_x = tile_max, * const ref_y = tile_max + H;  // the references after tiles 2q and 2q + 1
          if (wg == 0) {
            const float n0 = lazy_reference(m0, mx0), n1 = lazy_reference(m1, mx1);
            rebase(n0, n1);
            if (t4 == 0) ref_x[h0] = n0, ref_x[h1] = n1;
            const float2 sum = take_p(n0, n1);
            l0 += sum.x, l1 += sum.y;
            bar_arrive(SEESAW_X, WIDE_THREADS);
            own_fragments();
            values(0, true);
            bar_sync(SEESAW_Y, WIDE_THREADS);
            // the blocks of group (1, 0) this warpgroup copied, which warpgroup 1 waited for (cp.async: generic writes)
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            const float y0 = ref_y[h0], y1 = ref_y[h1];
            retire();
            load_group(kn, rn, q + 1, 0);  // stage 0's blocks 0..3
            rebase(y0, y1);
            values(1, false);
            retire();
            load_group(kn, rn, q + 1, 1);  // stage 1's blocks 0..3 and 8
          } else {
            bar_sync(SEESAW_X, WIDE_THREADS);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // group (0, 1), as warpgroup 0 above
            const float x0 = ref_x[h0], x1 = ref_x[h1];
            rebase(x0, x1);
            values(0, false);
            const float n0 = lazy_reference(x0, mx0), n1 = lazy_reference(x1, mx1);
            if (t4 == 0) ref_y[h0] = n0, ref_y[h1] = n1;
            const float2 sum = take_p(n0, n1);
            bar_arrive(SEESAW_Y, WIDE_THREADS);
            own_fragments();
            retire();
            load_group(kn, rn, q + 1, 0);  // stage 0's blocks 4..8
            rebase(n0, n1);  // once the product over tile 2q is in
            l0 += sum.x, l1 += sum.y;
            values(1, true);
            retire();
            load_group(kn, rn, q + 1, 1);  // stage 1's blocks 4..7
          }
        } else {
          asm volatile("cp.async.wait_group 0;\n");
          mbar_wait(bars + 8 * (2 * (q & 1)), (q >> 1) & 1);  // tile 2q + i's stage: its (q / 2)-th use
          mbar_wait(bars + 8 * (2 * (q & 1) + 1), (q >> 1) & 1);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          __syncthreads();  // position q is visible to the tensor cores; every warp is done with q - 1
          // TUNE: pair-top
          // S (64 heads x 64 rows) = Q K^T (tile 2q + wg): 18 k32 steps, both operands from shared memory; then the
          // next position's copies (a TMA issue by one thread, or every thread's cp.async), while the tensor cores
          // work.
          float s[H / 2];
          issue_scores<H, false, true>(s, ks_addr + ((2 * q + wg) % WIDE_STAGES) * TILE, qdesc);
          WideRange rc = range;
          load_pair(q + 1 < end ? k : later(k, q + 1, rc), rc, q + 1);
          // Threads 0..127 look up one row each of position q + 2, stored once the scores are in (its slots, q's, were
          // last read by q's copies; read after the next barrier).
          WideRange ra = range;
          const int ka = q + 2 < end ? k : later(k, q + 2, ra);
          const int next_entry = PAGED ? fetch_rows(ka, ra, q + 2) : 0;
          const float qsc0 = qscale[h0], qsc1 = qscale[h1];
          wg_wait<0>();
          fence_acc<H / 2>(s);
          // TUNE: pair-scores
          if (PAGED) put_rows(ka, ra, q + 2, next_entry);

          // Online softmax over the pair's 128 rows, log2 domain; rows past hi are masked. The warpgroups' tile maxima
          // meet through shared memory at the barrier that completes P, and only where one moves a reference.
          const int in_tile = range.hi - range.lo - (2 * q + wg) * BN;  // columns < in_tile are rows before hi
          if (in_tile >= BN + cut[0]) {
      #pragma unroll
            for (int i = 0; i < H / 2; ++i) s[i] *= i & 2 ? qsc1 : qsc0;
          } else {  // less the head's cut
            const int in0 = in_tile - cut[h0], in1 = in_tile - cut[h1];
      #pragma unroll
            for (int i = 0; i < H / 2; ++i) {
              const bool in = 8 * (i >> 2) + 2 * t4 + (i & 1) < (i & 2 ? in1 : in0);
              s[i] = in ? s[i] * (i & 2 ? qsc1 : qsc0) : -INFINITY;
            }
          }
          float mx0 = -INFINITY, mx1 = -INFINITY;
      #pragma unroll
          for (int i = 0; i < H / 2; i += 4) {
            mx0 = fmaxf(mx0, fmaxf(s[i], s[i + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[i + 2], s[i + 3]));
          }
      #pragma unroll
          for (int o = 1; o < 4; o <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
          }
          if (t4 == 0) tile_max[wg * H + h0] = mx0, tile_max[wg * H + h1] = mx1;
          // P against the reference this tile alone gives (the other tile rarely moves it; where it does, P is scaled
          // down below). A quarter of the exps on the FMA pipe: MUFU (16 a cycle an SM) is the softmax's narrowest
          // pipe.
          const float g0 = lazy_reference(m0, mx0), g1 = lazy_reference(m1, mx1);
          const float gb0 = g0 == -INFINITY ? 0.f : g0, gb1 = g1 == -INFINITY ? 0.f : g1;
          float sum0 = 0.f, sum1 = 0.f;
      #pragma unroll
          for (int c = 0; c < 4; ++c) {
      #pragma unroll
            for (int k = 0; k < 8; ++k) {
              const float x = s[8 * c + k] - ((k & 2 ? gb1 : gb0) - WIDE_P_BIAS);
              s[8 * c + k] = c == 3 ? ex2_fma(x) : ex2(x);
            }
            sum0 += (s[8 * c] + s[8 * c + 1]) + (s[8 * c + 4] + s[8 * c + 5]);
            sum1 += (s[8 * c + 2] + s[8 * c + 3]) + (s[8 * c + 6] + s[8 * c + 7]);
          }
          store_p(s);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          // P and the tile maxima are complete. Where no head's reference moved in either tile (most pairs), P is right
          // and nothing needs rescaling; otherwise the pair's reference is made from both tiles, P scaled down where
          // this tile's guess was below it and stored again, and the accumulators rescaled.
          if (__syncthreads_or(g0 != m0 || g1 != m1)) {
            const float pm0 = fmaxf(mx0, tile_max[(wg ^ 1) * H + h0]), pm1 = fmaxf(mx1, tile_max[(wg ^ 1) * H + h1]);
            const float mn0 = lazy_reference(m0, pm0), mn1 = lazy_reference(m1, pm1);
            const float base0 = mn0 == -INFINITY ? 0.f : mn0, base1 = mn1 == -INFINITY ? 0.f : mn1;
            if (__any_sync(0xffffffffu, base0 != gb0 || base1 != gb1)) {  // the other tile moved the reference
              const float f0 = ex2(gb0 - base0), f1 = ex2(gb1 - base1);
      #pragma unroll
              for (int i = 0; i < H / 2; ++i) s[i] *= i & 2 ? f1 : f0;
              sum0 *= f0, sum1 *= f1;
              store_p(s);
            }
            const float alpha0 = ex2(m0 - base0), alpha1 = ex2(m1 - base1);
            m0 = mn0, m1 = mn1;
            l0 *= alpha0, l1 *= alpha1;
            if (wg == 0 && t4 == 0) pair_alpha[h0] = alpha0, pair_alpha[h1] = alpha1;
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();  // the pair's P and alphas are complete
            // O^T's columns are heads: each thread rescales its 16 heads two at a time, where one of the pair's 8 heads
            // in the warp moved.
      #pragma unroll
            for (int e = 0; e < NE; e += 2) {
              const float2 alpha = *reinterpret_cast<const float2*>(pair_alpha + heads[e]);
              if (__any_sync(0xffffffffu, alpha.x != 1.f || alpha.y != 1.f)) {
                // heads e and e + 1: accumulators a, a + 1 (row g) and a + 2, a + 3 (row g + 8)
                const int a = (e >> 1) * 4;
      #pragma unroll
                for (int mb = 0; mb < 4; ++mb) {
                  acc[mb][a] *= alpha.x, acc[mb][a + 2] *= alpha.x;
                  acc[mb][a + 1] *= alpha.y, acc[mb][a + 3] *= alpha.y;
                }
              }
            }
          }
          l0 += sum0, l1 += sum1;
          // TUNE: pair-softmax

          // O^T (this warpgroup's 256 dims x 64 heads) += V^T (256 x 128) P^T: k steps 0, 1 from tile 2j, 2, 3 from
          // tile 2j + 1. A from registers (v_fragment), a k step (4 m-blocks) at a time, each group committed and the
          // one before waited for: two groups' fragments live at most.
      #pragma unroll
          for (int kk = 0; kk < 2 * BN / 32; ++kk) {
            const uint32_t vt = vbase + ((2 * q + (kk >> 1)) % WIDE_STAGES) * TILE + (kk & 1) * 32 * 128;
            uint32_t a[4][4];
      #pragma unroll
            for (int mb = 0; mb < 4; ++mb) v_fragment(a[mb], vt + (mb >> 1) * SW128_BLOCK + voff[mb & 1]);
      #pragma unroll
            for (int mb = 0; mb < 4; ++mb) fence_acc<H / 2>(acc[mb]);
            wg_fence();
            const uint64_t db = pdesc + ((2 * kk * QCHUNK) >> 4);
      #pragma unroll
            for (int mb = 0; mb < 4; ++mb) wgmma_rs<H, false>(acc[mb], a[mb], db);
            wg_commit();
            if (kk < 2 * BN / 32 - 1) wg_wait<1>();
          }
          wg_wait<0>();
      #pragma unroll
          for (int mb = 0; mb < 4; ++mb) fence_acc<H / 2>(acc[mb]);
          // TUNE: pair-values
        }
      }
      // TUNE: pairs-done

      // Sums: over the quad's columns, then the two warpgroups' tiles through shared memory.
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
      }
      float* const sum = sums + (k & 1) * 2 * H;
      if (t4 == 0) sum[wg * H + h0] = l0, sum[wg * H + h1] = l1;
      __syncthreads();  // the sums are complete; every warp is done with the unit's Q
      const QueryRows rows = query_rows<H>(call, unit);
      // The first position on a page outside the cache: a row is ok where it sees none.
      const int bad_page = PAGED ? items.bad[k] : NO_BAD_PAGE;
      const bool valid = items.valid[k], ok = row_ok(valid, bad_page, range.hi);  // ok: every row
      const bool ok0 = row_ok(valid, bad_page, range.hi, cut[h0]), ok1 = row_ok(valid, bad_page, range.hi, cut[h1]);
      const size_t part = piece.part;
      if (wg == 0 && t4 == 0) {  // FP8: l carries 2^WIDE_P_BIAS
        const float l[2] = {sum[h0] + sum[H + h0], sum[h1] + sum[H + h1]}, m[2] = {m0, m1};
#pragma unroll
        for (int i = 0; i < 2; ++i)
          store_lse<H>(call, rows, pieces, part, h0 + 8 * i,
                       l[i] > 0.f ? m[i] + __log2f(l[i]) - (BF ? 0.f : WIDE_P_BIAS) : -INFINITY, i ? ok1 : ok0);
      }
      // The output (or partial) from the accumulators: a store writes 2 dims of a head (FP8: a warp's 4 whole 32-byte
      // sectors; the stages stay free for the next unit's tiles).
      __nv_bfloat16* dst = pieces == 1 ? call.out + rows.row0 * DV : call.part_o + part * H * DV;
      const int stored = pieces == 1 ? rows.live : H;  // a partial keeps every row (its slot is the unit's)
      if constexpr (BF) {
        const int hs[2] = {h0, h1};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (hs[i] >= stored) continue;
          const float l = sum[hs[i]] + sum[H + hs[i]];
          const bool poison = pieces == 1 && !(i ? ok1 : ok0);
          const float scale = poison ? NAN : l > 0.f ? __fdividef(1.f, l) : 0.f;  // no rows: zeros
#pragma unroll
          for (int j = 0; j < H / 2; ++j)
            *reinterpret_cast<__nv_bfloat162*>(dst + hs[i] * DV + 256 * wg + 8 * j + 2 * t4) =
                __floats2bfloat162_rn(acc[0][4 * j + 2 * i] * scale, acc[0][4 * j + 2 * i + 1] * scale);
        }
      } else {
#pragma unroll
        for (int e = 0; e < NE; ++e) {
          if (heads[e] >= stored) continue;
          const int a = (e & 1) + (e >> 1) * 4;
          const float l = sum[heads[e]] + sum[H + heads[e]];
          const bool poison = pieces == 1 && !ok && !row_ok(valid, bad_page, range.hi, cut[heads[e]]);
          const float scale = poison ? NAN : l > 0.f ? __fdividef(kv_scale, l) : 0.f;  // no rows: zeros
#pragma unroll
          for (int mb = 0; mb < 4; ++mb) {
            const int dim = 256 * wg + 64 * mb + 16 * warp + 2 * g;
            *reinterpret_cast<__nv_bfloat162*>(dst + heads[e] * DV + dim) =
                __floats2bfloat162_rn(acc[mb][a] * scale, acc[mb][a + 2] * scale);
          }
        }
      }
      if (!BAL && pieces > 1) merge_splits<H>(call, base, rows, split, valid);  // one item
    }
  }
}

}  // namespace mla
