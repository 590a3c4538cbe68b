// The Hopper (sm_90a) split kernel for units of 64 query rows (64 heads of one token), the FP8 cache: two
// warpgroups, one CTA an SM. The score product puts the heads on its M side (S = Q K^T, m64n64k32), so a head's max
// over a tile is a thread's 16 scores and two shuffles, and a thread's softmax works on 2 heads, not 16; the value
// product keeps them on N (O^T = V^T P^T, A from registers), as split_kernel has it.
#pragma once

#include <cuda.h>

#include "wgmma.cuh"

namespace mla {

constexpr int WIDE_ROWS = 64;                   // query rows a CTA (a unit)
constexpr int WIDE_THREADS = 256;               // two warpgroups
constexpr int WIDE_WARPS = WIDE_THREADS / 32;
constexpr int WIDE_CTAS_PER_SM = 1;             // 128 accumulators and 32 scores a thread: no room for a second
// Each loop iteration takes a pair of 64-row tiles (warpgroup w scores tile 2q + w of the stream): 4 stages hold
// the pair being read and the next one in flight.
constexpr int WIDE_STAGES = 4;
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
// their bad-page flags (PagedRows::bad) and split_range's verdicts; and the stages' mbarriers.
struct WideItems {
  WideRange range[WIDE_MAX_ITEMS];
  int end[WIDE_MAX_ITEMS];
  int bad[WIDE_MAX_ITEMS];
  int valid[WIDE_MAX_ITEMS];
  uint64_t bars[WIDE_STAGES];
  // The item of stream position q, from the item k of an earlier one (positions past the last item: nitems).
  __device__ __forceinline__ int at(int k, int q, int nitems) const {
    while (k < nitems && q >= end[k]) ++k;
    return k;
  }
};
// Shared memory: the stages, Q (64 x 576 e4m3), P (128 x 64 e4m3), the per-head stats, the paged rows and the units.
constexpr int wide_smem_bytes() {
  return WIDE_STAGES * TILE + WIDE_ROWS * D + 2 * BN * WIDE_ROWS + WIDE_STATS * 4 + SMEM_PAGED + sizeof(WideItems);
}
static_assert(wide_smem_bytes() <= 227 * 1024, "a block's shared memory on Hopper");
// PagedRows' 4 slots (the stream's tile i in slot i % 4) hold pairs q + 1 and q + 2 during stream position q: pair q +
// 1's rows are read by its copies at the top of the iteration, pair q + 2's written after the scores (pair q's slots,
// free since then).
static_assert(ROW_SLOTS == 4, "two pairs of tiles' rows");

// A whole tile of consecutive cache rows reaches its stage by TMA: one thread issues two boxes (dims 0..511 as 4
// blocks of [64 rows][128 bytes], 128-byte swizzle, through a map that takes a row's 128-byte chunks as a third
// dimension; the rope dims as [64 rows][64 bytes], 64-byte swizzle: the layouts tile_offset states) and the stage's
// mbarrier counts their bytes, so the warps issue no copies ahead of the score product. Other tiles (a split's partial
// last one, pages under 64 rows, a bad page) are copied by every thread as split_kernel copies them, and TMA_THREAD
// arrives on the mbarrier alone.
constexpr int TMA_THREAD = WIDE_THREADS / 2;  // warpgroup 1's: warpgroup 0 looks the next rows up
struct WideMaps {
  CUtensorMap main, rope;  // the cache as (4 chunks, total_kv rows, 128 bytes) and (total_kv rows, 576 bytes)
};

__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}
// Box {0, row, 0} of the main map to the stage's dims 0..511, box {512, row} of the rope map to its rope dims.
__device__ __forceinline__ void tma_tile(const WideMaps& maps, uint32_t dst, uint32_t bar, int row) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "n"(TILE) : "memory");
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %2}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(&maps.main)), "r"(0), "r"(row), "r"(bar) : "memory");
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst + ROPE_OFFSET), "l"(reinterpret_cast<uint64_t>(&maps.rope)), "r"(DV), "r"(row), "r"(bar) : "memory");
}

// BAL: the balanced schedule's grid (parts, groups): a CTA walks its part's pieces (item_piece), merged by
// combine_kernel after the grid.
template <bool PAGED, bool BAL>
__global__ void __launch_bounds__(WIDE_THREADS, WIDE_CTAS_PER_SM)
split_kernel64(const DecodeCall call, const __grid_constant__ WideMaps maps) {
  constexpr int H = WIDE_ROWS;
  constexpr int QCHUNK = H * 16;  // Q and P: [16-byte chunk][64 heads][16 bytes]
  constexpr int NE = H / 4;       // heads a thread in the value product (O^T's columns)
  extern __shared__ __align__(1024) uint8_t smem[];
  // wg: the warpgroup (its tile of a pair, its 256 value dims); warp: within the warpgroup; cwarp: within the CTA.
  const int tid = threadIdx.x, wg = tid >> 7, cwarp = tid >> 5, warp = cwarp & 3, lane = tid & 31, g = lane >> 2,
            t4 = lane & 3;
  uint8_t* qs = smem + WIDE_STAGES * TILE;
  uint8_t* ps = qs + H * D;
  float* tile_max = reinterpret_cast<float*>(ps + 2 * BN * H);  // [warpgroup][head]
  float* pair_alpha = tile_max + 2 * H;                          // [head]
  float* sums = pair_alpha + H;                                  // [item parity][warpgroup][head]
  float* qscale = sums + 4 * H;
  int* const rows_smem = reinterpret_cast<int*>(qscale + H);
  WideItems& items = *reinterpret_cast<WideItems*>(rows_smem + SMEM_PAGED / 4);
  auto paged_rows = [&](int k) { return PagedRows{rows_smem, items.bad + k}; };
  const uint32_t bars = smem_u32(items.bars);  // stage s's mbarrier at bars + 8 s
  const int split = blockIdx.x;  // fixed splits
  const int units = call.batch * unit_groups(call, H);
  int first_item = 0, total_items;  // the CTA's items: the balanced part's pieces from item first_item, or units
  if constexpr (BAL) {
    first_item = __ldg(part_first(call) + blockIdx.x);
    total_items = __ldg(part_first(call) + blockIdx.x + 1) - first_item;
  } else {
    total_items = (units - static_cast<int>(blockIdx.y) + gridDim.y - 1) / gridDim.y;
  }
  if (total_items <= 0) return;
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < WIDE_STAGES; ++st) mbar_init(bars + 8 * st);
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
  const float kv_scale = *call.kv_scale;  // read with the length (wgmma.cuh's split_kernel says why)
  // fixed splits: one item, one chunk
  const unsigned base = BAL ? 0u : arrival_base(call.sync, piece_at(0).rows.unit, call.num_splits);
  static_assert(WIDE_MAX_ITEMS == 64, "two items a lane of warp 0");
  int q = 0;  // the stream position of the pair being scored, over every chunk (the stages' mbarrier phases)
  for (int chunk = 0; chunk < total_items; chunk += WIDE_MAX_ITEMS) {
    item0 = first_item + chunk;
    nitems = min(total_items - chunk, WIDE_MAX_ITEMS);
    if (chunk > 0) __syncthreads();  // every warp is done with the last chunk's items
    // Warp 0 reads the items' lengths and lays out the stream: item k's pairs take positions end[k - 1] .. end[k] - 1,
    // from the stream's position q.
    if (cwarp == 0) {
      int npairs[2], first = q;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = lane + 32 * i;
        SplitRange r{0, 0, 0, 0, true};
        int b = 0;
        if (k < nitems) {
          const Piece piece = piece_at(k);
          b = piece.rows.b;
          r = piece_range<BAL>(call, piece, piece.rows.t);
        }
        npairs[i] = (r.ntiles + 1) / 2;
        int scan = npairs[i];  // inclusive prefix sum over the warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, scan, o);
          if (lane >= o) scan += v;
        }
        const int end = first + scan;
        first += __shfl_sync(0xffffffffu, scan, 31);
        if (k < nitems) {
          items.range[k] = WideRange{r.lo - 2 * (end - npairs[i]) * BN, r.hi, r.start, b};
          items.end[k] = end;
          items.bad[k] = 0;
          items.valid[k] = r.valid;
        }
      }
    }
    const bool consecutive = !PAGED || call.page_size % BN == 0;  // a tile's rows: consecutive cache rows

    const CopyPlan<WIDE_THREADS, false> copy(tid);
    const uint32_t ks_addr = smem_u32(smem);
    // Stream position q (a pair of item k, range r): tiles 2q and 2q + 1 to stages (2q) % 4 and + 1, one cp.async group
    // (empty past the last item). A tile past the item's hi (the second of an odd item's last pair) is zero-filled.
    auto load_pair = [&](int k, const WideRange& r, int q) {
      if (k < nitems) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int t = 2 * q + i, n0 = r.lo + t * BN, stage = t % WIDE_STAGES;
          const int first = PAGED ? paged_rows(k).at(t, 0) : r.start + n0;  // the tile's first row, if consecutive
          if (consecutive && first >= 0 && r.hi - n0 >= BN) {
            if (tid == TMA_THREAD) tma_tile(maps, ks_addr + stage * TILE, bars + 8 * stage, first);
          } else {
            copy.tile(call, paged_rows(k), consecutive, first, ks_addr + stage * TILE, t, r.lo, r.hi);
            if (tid == TMA_THREAD) mbar_arrive(bars + 8 * stage);
          }
        }
      }
      asm volatile("cp.async.commit_group;\n");
    };
    // Threads 0..127: the block-table entry of one row of position q's tiles (item k, range r), then its row.
    auto fetch_rows = [&](int k, const WideRange& r, int q) {
      return k < nitems && tid < 2 * BN ? paged_rows(k).fetch(call, r.b, r.lo, r.hi, 2 * q + (tid >> 6), tid & (BN - 1))
                                        : 0;
    };
    auto put_rows = [&](int k, const WideRange& r, int q, int entry) {
      if (k < nitems && tid < 2 * BN) paged_rows(k).put(call, 2 * q + (tid >> 6), tid & (BN - 1), entry, r.lo, r.hi);
    };
    // The item of position q past item k's last pair, and its range.
    auto later = [&](int k, int q, WideRange& r) {
      const int next = items.at(k + 1, q, nitems);
      if (next < nitems) r = items.range[next];
      return next;
    };
    using Query = QueryQuant<H, WIDE_WARPS>;
    typename Query::Regs qv;
    Query::load(qv, call, piece_at(0).rows, cwarp, lane);
    __syncthreads();  // the items
    WideRange r0{}, r1{};
    const int k0 = later(-1, q, r0), k1 = later(k0 - 1, q + 1, r1);  // the items of positions q and q + 1
    if (PAGED) {  // their rows
      const int e0 = fetch_rows(k0, r0, q), e1 = fetch_rows(k1, r1, q + 1);
      __syncthreads();
      put_rows(k0, r0, q, e0);
      put_rows(k1, r1, q + 1, e1);
      __syncthreads();
    }
    load_pair(k0, r0, q);
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
      float acc[4][H / 2];  // O^T: [64-dim block][accumulator]: dims 256*wg + 64*mb + 16*warp + 2g (+1 for rows g + 8)
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int e = 0; e < H / 2; ++e) acc[mb][e] = 0.f;

      // TUNE: pairs
      for (; q < end; ++q) {
        asm volatile("cp.async.wait_group 0;\n");
        mbar_wait(bars + 8 * (2 * (q & 1)), (q >> 1) & 1);  // tile 2q + i's stage: its (q / 2)-th use
        mbar_wait(bars + 8 * (2 * (q & 1) + 1), (q >> 1) & 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();  // position q is visible to the tensor cores; every warp is done with q - 1
        // TUNE: pair-top
        // S (64 heads x 64 rows) = Q K^T (tile 2q + wg): 18 k32 steps, both operands from shared memory; then the next
        // position's copies (a TMA issue by one thread, or every thread's cp.async), while the tensor cores work.
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
        if (in_tile >= BN) {
    #pragma unroll
          for (int i = 0; i < H / 2; ++i) s[i] *= i & 2 ? qsc1 : qsc0;
        } else {
    #pragma unroll
          for (int i = 0; i < H / 2; ++i) {
            const bool in = 8 * (i >> 2) + 2 * t4 + (i & 1) < in_tile;
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
        // down below). A quarter of the exps on the FMA pipe: MUFU (16 a cycle an SM) is the softmax's narrowest pipe.
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
        // and nothing needs rescaling; otherwise the pair's reference is made from both tiles, P scaled down where this
        // tile's guess was below it and stored again, and the accumulators rescaled.
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

        // O^T (this warpgroup's 256 dims x 64 heads) += V^T (256 x 128) P^T: k steps 0, 1 from tile 2j, 2, 3 from tile
        // 2j + 1. A from registers (v_fragment), a k step (4 m-blocks) at a time, each group committed and the one
        // before waited for: two groups' fragments live at most.
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
      const bool bad_page = PAGED && items.bad[k];
      const bool ok = items.valid[k] && !bad_page;
      const size_t part = piece.part;
      if (wg == 0 && t4 == 0) {  // l carries 2^WIDE_P_BIAS
        const float l[2] = {sum[h0] + sum[H + h0], sum[h1] + sum[H + h1]}, m[2] = {m0, m1};
#pragma unroll
        for (int i = 0; i < 2; ++i)
          store_lse<H>(call, rows, pieces, part, h0 + 8 * i,
                       l[i] > 0.f ? m[i] + __log2f(l[i]) - WIDE_P_BIAS : -INFINITY, ok);
      }
      // The output (or partial) from the accumulators: a store writes 2 dims of a head, a warp's 4 whole 32-byte
      // sectors (the stages stay free for the next unit's pairs).
      __nv_bfloat16* dst = pieces == 1 ? call.out + rows.row0 * DV : call.part_o + part * H * DV;
      const bool poison = pieces == 1 && !ok;
      const int stored = pieces == 1 ? rows.live : H;  // a partial keeps every row (its slot is the unit's)
#pragma unroll
      for (int e = 0; e < NE; ++e) {
        if (heads[e] >= stored) continue;
        const int a = (e & 1) + (e >> 1) * 4;
        const float l = sum[heads[e]] + sum[H + heads[e]];
        const float scale = poison ? NAN : l > 0.f ? __fdividef(kv_scale, l) : 0.f;  // no rows: zeros
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) {
          const int dim = 256 * wg + 64 * mb + 16 * warp + 2 * g;
          *reinterpret_cast<__nv_bfloat162*>(dst + heads[e] * DV + dim) =
              __floats2bfloat162_rn(acc[mb][a] * scale, acc[mb][a + 2] * scale);
        }
      }
      if (!BAL && pieces > 1) merge_splits<H>(call, base, rows, split, items.valid[k]);  // one item
    }
  }
}

}  // namespace mla
