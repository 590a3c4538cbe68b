// Shared by the kernels: the per-unit barrier (a unit: 16, 32 or 64 query rows of a sequence) of the splits and their
// merge.
#pragma once

#include "common.cuh"

namespace mla {

// The per-unit barrier of the splits: sync[u] counts the arrivals of unit u's CTAs over every launch (it
// only grows, wrapping at 2^32, a multiple of every power-of-two split count). A launch of S splits starts from a
// multiple of S (every earlier launch on this workspace had S splits and completed) and its CTAs wait until the
// count reaches the next one. Each CTA reads the count when it starts (arrival_base: off the barrier's path; its
// own arrival has not happened, so the count is below the next multiple), then thread 0 adds its arrival with
// release semantics after the CTA's barrier (publishing the CTA's partial stores) and polls with acquire loads (so
// the other CTAs' partials are visible after the closing barrier). The last arrival is itself what the others
// wait for: a count that the last arrival reset before advancing a generation word puts two more round trips on the
// barrier's path (docs/design-notes.md, "The kernels' measured choices").
__device__ __forceinline__ unsigned arrival_base(const unsigned* sync, int b, int num_splits) {
  unsigned count = 0;
  if (num_splits > 1 && threadIdx.x == 0)
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(count) : "l"(sync + b) : "memory");
  return count & ~static_cast<unsigned>(num_splits - 1);
}

__device__ __forceinline__ void wait_for_splits(unsigned* sync, int b, int num_splits, unsigned base) {
  __syncthreads();
  // TUNE: synced
  if (threadIdx.x == 0) {
    const unsigned target = base + static_cast<unsigned>(num_splits);
    unsigned now;
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync + b) : "memory");
    // TUNE: arrived
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(sync + b) : "memory");
    } while (static_cast<int>(now - target) < 0);
  }
  __syncthreads();
}

// The merge of one unit's splits: out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). A unit of H rows has
// H x 128 quads (4 columns of one head): split `split` of S merges H x 128 / S of them with 128 threads (256 at H = 64:
// L = 32 loads a thread; L = H below), and every thread issues all its L loads (8-byte quads of the bf16 partials, L2
// only: other SMs wrote them) before using any: one round trip (at H = 32 twice the loads a thread rather than a second
// round trip; the accumulators of the split product are dead by then). The partials are bf16 because the merge is a
// convex combination (its error stays at the bf16 output's) and half the bytes shorten the handoff (fp32 partials were
// slower at the split shapes: docs/design-notes.md, "The kernels' measured choices"). S < L: a thread merges W = L / S
// neighbouring quads over all S splits. S >= L: W = 1, and the S / L threads of a quad (neighbouring lanes) take L
// splits each, then combine their (max, sum, acc) by shuffles. S must be a power of two (every thread then has exactly
// its G = L / W splits; merge_splits dispatches on W).
constexpr int MERGE_THREADS = 128;
constexpr int MAX_SPLITS = 512;        // a quad's S / L threads stay within one warp (S / 16 <= 32)
// A split's NaN LSE marks a page outside the cache that the row sees: the row becomes NaN. The merged natural-log
// LSE of row h goes to call.lse (if any) at row_lse, written by the thread of each row's first quad. Rows from
// rows.live on (masked rows) are merged but not stored.
template <int W, int H, int L = H>
__device__ __forceinline__ void merge_quads(const DecodeCall& call, const QueryRows& rows, const float* lse,
                                            const __nv_bfloat16* po, __nv_bfloat16* out, int num_splits, int split,
                                            bool valid) {
  constexpr int G = L / W;  // splits per thread
  constexpr int LOG_QUADS = log2i(H * DV / 4);  // the unit's quads: 2048 at H = 16
  const int log_splits = __ffs(num_splits) - 1;
  const int log_per_quad = max(log_splits - (__ffs(G) - 1), 0);  // threads per quad: num_splits / G (W == 1) or 1
  const int per_quad = 1 << log_per_quad;
  const int quad = (split << (LOG_QUADS - log_splits)) + (threadIdx.x >> log_per_quad) * W;
  const int h = quad / (DV / 4), col = quad % (DV / 4) * 4, s0 = (threadIdx.x & (per_quad - 1)) * G;
  const float* lse_s0 = lse + s0 * H + h;  // split s0 + j at j * H
  const uint2* po_s0 = reinterpret_cast<const uint2*>(po + (static_cast<size_t>(s0) * H + h) * DV + col);
  float l[G];
  uint2 o[G][W];  // 4 bf16
#pragma unroll
  for (int j = 0; j < G; ++j) {  // G splits from s0, all present: num_splits is G x per_quad
    l[j] = __ldcg(lse_s0 + j * H);
#pragma unroll
    for (int w = 0; w < W; ++w) o[j][w] = __ldcg(po_s0 + j * (H * DV / 4) + w);
  }
  float mx = -INFINITY, wsum = 0.f;
  float4 acc[W];
  bool bad_page = false;
#pragma unroll
  for (int j = 0; j < G; ++j) {
    bad_page |= l[j] != l[j];
    l[j] = l[j] != l[j] ? -INFINITY : l[j];
    mx = fmaxf(mx, l[j]);
  }
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = make_float4(0.f, 0.f, 0.f, 0.f);
  // TUNE: lse
  if (mx != -INFINITY) {  // else only empty splits (their partials hold zeros)
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const float wt = exp2f(l[j] - mx);
      wsum += wt;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o[j][w].x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o[j][w].y));
        acc[w].x += wt * lo.x;
        acc[w].y += wt * lo.y;
        acc[w].z += wt * hi.x;
        acc[w].w += wt * hi.y;
      }
    }
  }
  for (int lane = 1; lane < per_quad; lane <<= 1) {
    const float omx = __shfl_xor_sync(0xffffffffu, mx, lane), ows = __shfl_xor_sync(0xffffffffu, wsum, lane);
    const float nm = fmaxf(mx, omx);
    const float a = nm == -INFINITY ? 0.f : exp2f(mx - nm), c = nm == -INFINITY ? 0.f : exp2f(omx - nm);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      acc[w].x = acc[w].x * a + __shfl_xor_sync(0xffffffffu, acc[w].x, lane) * c;
      acc[w].y = acc[w].y * a + __shfl_xor_sync(0xffffffffu, acc[w].y, lane) * c;
      acc[w].z = acc[w].z * a + __shfl_xor_sync(0xffffffffu, acc[w].z, lane) * c;
      acc[w].w = acc[w].w * a + __shfl_xor_sync(0xffffffffu, acc[w].w, lane) * c;
    }
    wsum = wsum * a + ows * c;
    mx = nm;
    bad_page |= __shfl_xor_sync(0xffffffffu, bad_page, lane);
  }
  if ((threadIdx.x & (per_quad - 1)) || h >= rows.live) return;
  const bool ok = valid && !bad_page;
  const float scale = (wsum > 0.f ? 1.f / wsum : 0.f) * (ok ? 1.f : NAN);  // every split empty: zeros
  if (call.lse && col == 0)
    call.lse[row_lse(call, rows, h)] = ok ? (wsum > 0.f ? (mx + __log2f(wsum)) * LN2 : -INFINITY) : NAN;
#pragma unroll
  for (int w = 0; w < W; ++w)
    store_bf16x4(out + h * DV + col + 4 * w,
                 make_float4(acc[w].x * scale, acc[w].y * scale, acc[w].z * scale, acc[w].w * scale));
}

// When the splits of a unit's rows have all written their partials, split `split` merges its share
// (call.num_splits: a power of two, 2 .. MAX_SPLITS; the launcher checks); valid: split_range's verdict on the
// sequence's range (false: NaN rows).
template <int H>
__device__ __forceinline__ void merge_splits(const DecodeCall& call, unsigned base, const QueryRows& rows, int split,
                                             bool valid) {
  const int num_splits = call.num_splits, u = rows.unit;
  wait_for_splits(call.sync, u, num_splits, base);
  // TUNE: barrier
  if (H < 64 && threadIdx.x >= MERGE_THREADS) return;  // 64 rows: all 256 threads of split_kernel64
  const float* lse = call.part_lse + static_cast<size_t>(u) * num_splits * H;
  const __nv_bfloat16* po = call.part_o + static_cast<size_t>(u) * num_splits * H * DV;
  __nv_bfloat16* o = call.out + rows.row0 * DV;
  if constexpr (H == 64) {  // 8192 quads on 256 threads: 32 loads a thread
    constexpr int L = 32;
    switch (num_splits) {
      case 2: return merge_quads<L / 2, H, L>(call, rows, lse, po, o, num_splits, split, valid);
      case 4: return merge_quads<L / 4, H, L>(call, rows, lse, po, o, num_splits, split, valid);
      case 8: return merge_quads<L / 8, H, L>(call, rows, lse, po, o, num_splits, split, valid);
      case 16: return merge_quads<L / 16, H, L>(call, rows, lse, po, o, num_splits, split, valid);
      default: return merge_quads<1, H, L>(call, rows, lse, po, o, num_splits, split, valid);  // num_splits >= L
    }
  }
  if constexpr (H == 32) {  // 16 splits take W = 2 here; a `case 16` in the switch changed the 16-row SASS
    if (num_splits == 16) return merge_quads<2, H>(call, rows, lse, po, o, num_splits, split, valid);
  }
  switch (num_splits) {
    case 2: merge_quads<H / 2, H>(call, rows, lse, po, o, num_splits, split, valid); break;
    case 4: merge_quads<H / 4, H>(call, rows, lse, po, o, num_splits, split, valid); break;
    case 8: merge_quads<H / 8, H>(call, rows, lse, po, o, num_splits, split, valid); break;
    default: merge_quads<1, H>(call, rows, lse, po, o, num_splits, split, valid);  // num_splits >= H
  }
}

// The balanced schedule's merge, a kernel after the split kernel: out = sum_i w_i o_i / sum_i w_i over a sequence's
// pieces, w_i = 2^(lse_i - max lse). A sequence of count > 1 pieces (items k0 .. k0 + count - 1) lies in consecutive
// parts, piece j in part p + j, and is merged by those parts' CTAs in `slices` = min(count, 32) (rounded down to a
// power of two) column slices: piece j's part takes slice j (j < slices), so a sequence of many pieces is merged by
// as many SMs. Grid (parts, groups, H / COMBINE_WARPS): warp w merges query row blockIdx.z * COMBINE_WARPS + w of
// group blockIdx.y's unit, its lanes split between the slice's columns (16 a lane) and the pieces, then summed by
// shuffles. A piece of no positions has LSE -inf and weighs 0 (every piece empty: zeros, LSE -inf, as one piece
// writes); a NaN LSE (a page outside the cache, an invalid range) makes the row NaN.
constexpr int COMBINE_WARPS = 4;
constexpr int COMBINE_SLICES = 32;  // the most column slices (CTAs a row) of one sequence's merge: 16 columns each

__device__ __forceinline__ int combine_slices(int count) {
  return min(1 << (31 - __clz(count)), COMBINE_SLICES);
}

// Slice `slice` of the merge of sequence b's `count` pieces from item k0, for this CTA's group and rows; lse: the
// warp's scratch for count LSEs. AHEAD: pieces whose loads a lane has in flight at once (2 x 16 bytes each).
template <int H, int AHEAD>
__device__ __forceinline__ void combine_slice(const DecodeCall& c, float* lse, int k0, int b, int count, int slice) {
  const int groups = unit_groups(c, H), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.z * COMBINE_WARPS + warp;
  const QueryRows rows = query_rows<H>(c, b * groups + blockIdx.y);
  if (h >= rows.live) return;  // a masked row: nothing to store
  // piece i's partial of this row: slot (k0 + i) * groups + group
  const size_t row0 = (static_cast<size_t>(k0) * groups + blockIdx.y) * H + h, step = static_cast<size_t>(groups) * H;
  float mx = -INFINITY, sum = 0.f;
  bool bad = false;
  __syncwarp();  // the scratch's last reader is done
  for (int i = lane; i < count; i += 32) {  // an online max and sum over the lane's pieces, then across the lanes
    const float l = __ldcg(c.part_lse + row0 + i * step);
    lse[i] = l;
    bad |= l != l;
    if (l > mx) sum = sum * exp2f(mx - l) + 1.f, mx = l;  // -inf and NaN never raise the max
    else if (l > -INFINITY) sum += exp2f(l - mx);
  }
  for (int o = 16; o; o >>= 1) {
    const float omx = __shfl_xor_sync(0xffffffffu, mx, o), osum = __shfl_xor_sync(0xffffffffu, sum, o);
    const float nm = fmaxf(mx, omx);
    sum = (mx == -INFINITY ? 0.f : sum * exp2f(mx - nm)) + (omx == -INFINITY ? 0.f : osum * exp2f(omx - nm));
    mx = nm;
  }
  bad = __any_sync(0xffffffffu, bad);
  __syncwarp();
  const int slices = combine_slices(count), col_lanes = 32 / slices;  // lane = piece lane x col_lanes + column lane
  const int first = lane / col_lanes, col = slice * (DV / slices) + lane % col_lanes * 16;
  float acc[16] = {};
  const uint4* po = reinterpret_cast<const uint4*>(c.part_o + row0 * DV + col);
  const size_t po_step = step * DV / 8;  // uint4 (8 bf16) from one piece's row to the next's
  for (int i0 = first; i0 < count; i0 += AHEAD * slices) {
    uint4 o[AHEAD][2];  // loads from a piece that exists (past the last: the last again, weight 0), no branch
#pragma unroll
    for (int a = 0; a < AHEAD; ++a)
#pragma unroll
      for (int j = 0; j < 2; ++j) o[a][j] = __ldcg(po + min(i0 + a * slices, count - 1) * po_step + j);
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      const int i = i0 + a * slices;
      const float l = i < count ? lse[i] : -INFINITY;
      const float wt = l > -INFINITY ? exp2f(l - mx) : 0.f;  // NaN: weight 0, the row is NaN below
      if (wt == 0.f) continue;  // a piece of no positions, or past the last: its partial may hold anything
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t w[4] = {o[a][j].x, o[a][j].y, o[a][j].z, o[a][j].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k]));
          acc[8 * j + 2 * k] += wt * v.x;
          acc[8 * j + 2 * k + 1] += wt * v.y;
        }
      }
    }
  }
  for (int o = col_lanes; o < 32; o <<= 1)  // the lanes of one column group, every weight against one max
#pragma unroll
    for (int k = 0; k < 16; ++k) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
  const bool ok = !bad;
  const float scale = (sum > 0.f ? 1.f / sum : 0.f) * (ok ? 1.f : NAN);
  if (first == 0) {
    __nv_bfloat16* out = c.out + (rows.row0 + h) * DV + col;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      store_bf16x4(out + 4 * j, make_float4(acc[4 * j] * scale, acc[4 * j + 1] * scale, acc[4 * j + 2] * scale,
                                            acc[4 * j + 3] * scale));
  }
  if (c.lse && slice == 0 && lane == 0)
    c.lse[row_lse(c, rows, h)] = ok ? (sum > 0.f ? (mx + __log2f(sum)) * LN2 : -INFINITY) : NAN;
}

// 8 CTAs an SM, 64 registers a thread: the grid (parts x groups x H / COMBINE_WARPS CTAs, 2,112 at 128 heads) runs in
// half the waves of one at 128 registers, which held 8 pieces' loads in flight (docs/2026-12-07-cut-cost.md).
constexpr int COMBINE_CTAS_PER_SM = 8, COMBINE_AHEAD = 2;

template <int H>
__global__ void __launch_bounds__(COMBINE_WARPS * 32, COMBINE_CTAS_PER_SM) combine_kernel(const DecodeCall c) {
  __shared__ float lses[COMBINE_WARPS][MAX_PIECES];  // a sequence has at most `parts` pieces
  const int* const starts = part_first(c);
  const int first = __ldg(starts + blockIdx.x), last = __ldg(starts + blockIdx.x + 1) - 1;
  if (last < first) return;  // a part of no pieces
  float* const lse = lses[threadIdx.x >> 5];
  const int4 head = c.items[first], tail = c.items[last];
  const int j = head.w >> 16, head_count = head.w & 0xffff, tail_count = tail.w & 0xffff;
  // the part's first piece, piece j >= 1 of a sequence begun in part p - j: slice j of that sequence's merge
  if (j >= 1 && j < combine_slices(head_count))
    combine_slice<H, COMBINE_AHEAD>(c, lse, first - j, head.x, head_count, j);
  // its last piece, the first of several: slice 0
  if ((tail.w >> 16) == 0 && tail_count > 1)
    combine_slice<H, COMBINE_AHEAD>(c, lse, last, tail.x, tail_count, 0);
}

}  // namespace mla
