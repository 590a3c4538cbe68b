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
// wait for: against a count that the last arrival reset before advancing a generation word (two more round trips
// on the barrier's path), 4x1024 10.7 -> 10.1 us, 4x8192 17.0 -> 16.3, 32x1024 17.3 -> 16.5 (H200, A/B twice).
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
// convex combination (its error stays at the bf16 output's) and half the bytes shorten the handoff: fp32 partials took
// 0.3-0.7 us more at the split shapes (H200, H = 16). S < L: a thread merges W = L / S neighbouring quads over all S
// splits. S >= L: W = 1, and the S / L threads of a quad (neighbouring lanes) take L splits each, then combine their
// (max, sum, acc) by shuffles. S must be a power of two (every thread then has exactly its G = L / W splits;
// merge_splits dispatches on W).
constexpr int MERGE_THREADS = 128;
constexpr int MAX_SPLITS = 512;        // a quad's S / L threads stay within one warp (S / 16 <= 32)
// A split's NaN LSE marks a page outside the cache: the unit's rows become NaN. out_lse, or null: the merged
// natural-log LSE of row h at out_lse[h * lse_stride], written by the thread of each row's first quad.
template <int W, int H, int L = H>
__device__ __forceinline__ void merge_quads(const float* lse, const __nv_bfloat16* po, __nv_bfloat16* out,
                                            float* out_lse, int lse_stride, int num_splits, int split,
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
  if (threadIdx.x & (per_quad - 1)) return;
  const bool ok = valid && !bad_page;
  const float scale = (wsum > 0.f ? 1.f / wsum : 0.f) * (ok ? 1.f : NAN);  // every split empty: zeros
  if (out_lse && col == 0) out_lse[h * lse_stride] = ok ? (wsum > 0.f ? (mx + __log2f(wsum)) * LN2 : -INFINITY) : NAN;
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
  __nv_bfloat16* o = call.out + static_cast<size_t>(u) * H * DV;
  float* out_lse = call.lse ? call.lse + rows.lse0 : nullptr;
  const int ls = rows.lse_stride;
  if constexpr (H == 64) {  // 8192 quads on 256 threads: 32 loads a thread
    constexpr int L = 32;
    switch (num_splits) {
      case 2: return merge_quads<L / 2, H, L>(lse, po, o, out_lse, ls, num_splits, split, valid);
      case 4: return merge_quads<L / 4, H, L>(lse, po, o, out_lse, ls, num_splits, split, valid);
      case 8: return merge_quads<L / 8, H, L>(lse, po, o, out_lse, ls, num_splits, split, valid);
      case 16: return merge_quads<L / 16, H, L>(lse, po, o, out_lse, ls, num_splits, split, valid);
      default: return merge_quads<1, H, L>(lse, po, o, out_lse, ls, num_splits, split, valid);  // num_splits >= L
    }
  }
  if constexpr (H == 32) {  // 16 splits take W = 2 here; a `case 16` in the switch changed the 16-row SASS
    if (num_splits == 16) return merge_quads<2, H>(lse, po, o, out_lse, ls, num_splits, split, valid);
  }
  switch (num_splits) {
    case 2: merge_quads<H / 2, H>(lse, po, o, out_lse, ls, num_splits, split, valid); break;
    case 4: merge_quads<H / 4, H>(lse, po, o, out_lse, ls, num_splits, split, valid); break;
    case 8: merge_quads<H / 8, H>(lse, po, o, out_lse, ls, num_splits, split, valid); break;
    default: merge_quads<1, H>(lse, po, o, out_lse, ls, num_splits, split, valid);  // num_splits >= H
  }
}

// The balanced schedule's merge (schedule.cuh): the `count` pieces of a unit meet at no barrier. Each adds its
// arrival to sync[unit] once its partial is stored (acq_rel: publishing its partial, and seeing the others' when it
// is the last); the last to arrive merges them all and zeroes the count for the next launch. No CTA waits for
// another, so the grid need not be resident. A piece of no positions has LSE -inf and weighs 0; a NaN LSE marks a
// page outside the cache and makes the unit's rows NaN, as does valid = false (piece_range's verdict). smem: shared
// memory for H x (count + 2) + 1 words, free when called. NT threads; out and lse as merge_quads writes them.
constexpr int MERGE_QUADS = 8;   // quads a thread merges at once (its accumulators)
constexpr int MERGE_AHEAD = 4;   // pieces whose loads a thread has in flight at once: MERGE_QUADS x this
template <int H, int NT>
__device__ __forceinline__ void merge_pieces(const DecodeCall& call, const Piece& piece, bool valid, float* smem) {
  static_assert(NT % 32 == 0 && H * DV / 4 % (NT * MERGE_QUADS) == 0, "whole passes of MERGE_QUADS quads a thread");
  const int unit = piece.rows.unit, count = piece.count;
  int* const last = reinterpret_cast<int*>(smem + H * (count + 2));
  __syncthreads();  // every partial store of the CTA is issued before its arrival
  if (threadIdx.x == 0) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(call.sync + unit) : "memory");
    *last = old == static_cast<unsigned>(count - 1);
    if (*last) call.sync[unit] = 0;  // every piece has arrived: the next launch starts from zero
  }
  __syncthreads();
  if (!*last) return;
  // Each row's LSEs (log2) in smem, and per row its max and 1 / the sum of its weights (NaN when not ok): a warp a
  // row, one pass of loads with an online max and sum.
  float* const lses = smem;                   // [H][count]
  float* const row_max = smem + H * count;    // [H]
  float* const row_scale = row_max + H;       // [H]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int h = warp; h < H; h += NT / 32) {
    float mx = -INFINITY, sum = 0.f;
    bool bad_page = false;
    for (int i = lane; i < count; i += 32) {
      const float l = __ldcg(call.part_lse + (piece.part0 + i * piece.part_stride) * H + h);
      lses[h * count + i] = l;
      bad_page |= l != l;
      if (l > mx) sum = sum * exp2f(mx - l) + 1.f, mx = l;  // -inf and NaN never raise the max
      else if (l > -INFINITY) sum += exp2f(l - mx);
    }
    for (int o = 16; o; o >>= 1) {
      const float omx = __shfl_xor_sync(0xffffffffu, mx, o), osum = __shfl_xor_sync(0xffffffffu, sum, o);
      const float nm = fmaxf(mx, omx);
      sum = (mx == -INFINITY ? 0.f : sum * exp2f(mx - nm)) + (omx == -INFINITY ? 0.f : osum * exp2f(omx - nm));
      mx = nm;
    }
    bad_page = __any_sync(0xffffffffu, bad_page);
    if (lane == 0) {
      const bool ok = valid && !bad_page;
      row_max[h] = mx;
      row_scale[h] = (sum > 0.f ? 1.f / sum : 0.f) * (ok ? 1.f : NAN);  // every piece empty: zeros
      if (call.lse)
        call.lse[piece.rows.lse0 + h * piece.rows.lse_stride] =
            ok ? (sum > 0.f ? (mx + __log2f(sum)) * LN2 : -INFINITY) : NAN;
    }
  }
  __syncthreads();
  // Thread t merges quads t + NT j (4 columns of one row each), MERGE_QUADS at a time over every piece, the loads of
  // MERGE_AHEAD pieces issued before any is used: a round trip to L2 per MERGE_AHEAD pieces, not per piece and quad.
  __nv_bfloat16* out = call.out + static_cast<size_t>(unit) * H * DV;
  const uint2* parts = reinterpret_cast<const uint2*>(call.part_o + piece.part0 * H * DV);
  const size_t piece_step = piece.part_stride * H * DV / 4;  // uint2 (4 bf16) from one piece's partial to the next
  for (int q0 = threadIdx.x; q0 < H * DV / 4; q0 += NT * MERGE_QUADS) {
    float4 acc[MERGE_QUADS];
#pragma unroll
    for (int j = 0; j < MERGE_QUADS; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i0 = 0; i0 < count; i0 += MERGE_AHEAD) {
      uint2 o[MERGE_AHEAD][MERGE_QUADS];
#pragma unroll
      for (int a = 0; a < MERGE_AHEAD; ++a)
#pragma unroll
        for (int j = 0; j < MERGE_QUADS; ++j)
          o[a][j] = i0 + a < count ? __ldcg(parts + (i0 + a) * piece_step + q0 + NT * j) : make_uint2(0u, 0u);
#pragma unroll
      for (int a = 0; a < MERGE_AHEAD; ++a) {
#pragma unroll
        for (int j = 0; j < MERGE_QUADS; ++j) {
          const int h = (q0 + NT * j) / (DV / 4);
          const float l = i0 + a < count ? lses[h * count + i0 + a] : -INFINITY;
          const float wt = l > -INFINITY ? exp2f(l - row_max[h]) : 0.f;  // NaN LSE: weight 0, the row is NaN
          const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o[a][j].x));
          const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o[a][j].y));
          acc[j].x += wt * lo.x, acc[j].y += wt * lo.y, acc[j].z += wt * hi.x, acc[j].w += wt * hi.y;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < MERGE_QUADS; ++j) {
      const int quad = q0 + NT * j, h = quad / (DV / 4), col = quad % (DV / 4) * 4;
      const float s = row_scale[h];
      store_bf16x4(out + h * DV + col, make_float4(acc[j].x * s, acc[j].y * s, acc[j].z * s, acc[j].w * s));
    }
  }
}

}  // namespace mla
