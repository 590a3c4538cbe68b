// The split kernel for other GPUs (sm_80 and later): mma.sync m16n8k16 in fp16, the FP8 cache.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "merge.cuh"

namespace mla {

constexpr int H = 16;                  // query rows per CTA (QueryRows)
constexpr int NWARPS = 8;
constexpr int NTHREADS = NWARPS * 32;
constexpr int CTAS_PER_SM = 1;
constexpr bool SUPPORTS_MXFP4 = false;
constexpr bool SUPPORTS_BF16 = false;
constexpr int MAX_UNIT_ROWS = H;
constexpr int TOKW = BN / NWARPS;      // score columns (tile rows) per warp: one m16n8 tile
constexpr int VCOLS = DV / NWARPS;     // output columns per warp
constexpr int KROW = D + 16;           // smem bytes per tile row: 8 consecutive rows hit distinct banks (ldmatrix)
constexpr int QROW = D + 8;            // halves per row of the fp16 Q staging
constexpr int PROW = BN + 8;           // halves per P row
constexpr int KSTEPS = D / 16;         // k16 steps of the score product
constexpr float Q_F16_SCALE = 0.0625f;  // Q's fp16 staging scale: a power of two near sm_scale * log2(e) keeps the range
constexpr int SMEM_Q = H * QROW * 2;
constexpr int SMEM_P = H * PROW * 2;
constexpr int SMEM_RED = NWARPS * H * 4;
constexpr int SMEM_PAGED = (ROW_SLOTS * BN + 4) * 4;  // PagedRows: the next tiles' rows and the bad-page flag
template <int STAGES, int KV>
constexpr int smem_bytes() { return STAGES * BN * KROW + SMEM_Q + SMEM_P + SMEM_RED + SMEM_PAGED; }

__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 bytes (low byte first) -> f16x2 by the hardware cvt.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// One piece of a unit's positions in split_kernel's CTA: the output (one piece) or its partial (merged by the fixed
// splits' barrier here, by combine_kernel after a balanced grid).
template <int STAGES, bool PAGED, bool BALANCED>
__device__ __forceinline__ void decode_piece(const DecodeCall& call, const Piece& piece, uint8_t* smem) {
  uint8_t* ks = smem;
  uint8_t* const tail = smem + STAGES * BN * KROW;
  __half* qs = reinterpret_cast<__half*>(tail);
  __half* ps = reinterpret_cast<__half*>(tail + SMEM_Q);
  float* red = reinterpret_cast<float*>(tail + SMEM_Q + SMEM_P);
  int* const rows_smem = reinterpret_cast<int*>(tail + SMEM_Q + SMEM_P + SMEM_RED);
  const PagedRows paged_rows{rows_smem, rows_smem + ROW_SLOTS * BN};

  const QueryRows& rows = piece.rows;
  const int b = rows.b, unit = rows.unit;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  constexpr bool paged = PAGED;  // call.page_size != 0: the launcher picks the instance
  GuessedEntries<STAGES> guess = {-1, {}};  // before the length's load, which it must not wait for
  if constexpr (paged) guess = guess_entries<STAGES>(call, b, piece.lo, tid);
  const SplitRange range = piece_range<BALANCED>(call, piece, rows.t);
  const float kv_scale = *call.kv_scale;  // read with the length (wgmma.cuh's split_kernel says why)
  const float score_scale = kv_scale * call.qk_scale / Q_F16_SCALE;
  const unsigned base = BALANCED ? 0u : arrival_base(call.sync, unit, call.num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles, start = range.start;
  const bool valid = range.valid;

  auto load_tile = [&](int i) {  // rows past hi (and on a page outside the cache) are zero-filled, never read
    uint8_t* dst = ks + (i % STAGES) * BN * KROW;
    const int n0 = lo + i * BN;
    for (int c = tid; c < BN * (D / 16); c += NTHREADS) {
      const int r = c / (D / 16), col = (c % (D / 16)) * 16;
      const int row = n0 + r >= hi ? -1 : paged ? paged_rows.at(i, r) : start + n0 + r;
      const uint8_t* src = call.kv + static_cast<size_t>(max(row, 0)) * D + col;
      const uint32_t d = smem_u32(dst + r * KROW + col);
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(row >= 0 ? 16 : 0));
    }
  };
  if (paged) paged_rows.first_tiles<STAGES>(call, b, lo, hi, tid, guess);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < ntiles) load_tile(i);
    asm volatile("cp.async.commit_group;\n");
  }
  // The loop puts tile i + STAGES's entries an iteration after asking for them: with one CTA an SM, an entry asked
  // for in the same iteration can come after the products at long lengths, its load queued behind the copies.
  int next_entry = paged ? paged_rows.fetch(call, b, lo, hi, STAGES, tid) : 0;  // put at the end of iteration 0

  // Q -> fp16 * Q_F16_SCALE, exact (bf16 has 8 significant bits, fp16 11; a power of two keeps them; |q| < ~1e6):
  // the scores take sm_scale * log2(e) in fp32, so a q of FP8 values gives exact products. Then into registers as the
  // A operand of every k16 step. Within each 16-dim chunk, lane t4 takes dims 4*t4 + {0,1} as the k-pair t4*2 and
  // 4*t4 + {2,3} as the k-pair t4*2 + 8: the products run over that permutation of the dims, the same for K (whose
  // ldmatrix fragments come out in exactly this order).
  // Rows from rows.live on (masked rows) are zeros.
  for (int c = tid; c < H * D / 2; c += NTHREADS) {
    const int h = c / (D / 2), j = c % (D / 2);
    const float2 v = h < rows.live ? __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(
                                         call.q + rows.row0 * D)[c]) : make_float2(0.f, 0.f);
    *reinterpret_cast<__half2*>(qs + h * QROW + 2 * j) = __floats2half2_rn(v.x * Q_F16_SCALE, v.y * Q_F16_SCALE);
  }
  __syncthreads();
  uint32_t qa[KSTEPS][4];
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    const __half* r0 = qs + g * QROW + s * 16 + 4 * t4;
    const __half* r1 = r0 + 8 * QROW;
    qa[s][0] = *reinterpret_cast<const uint32_t*>(r0);
    qa[s][1] = *reinterpret_cast<const uint32_t*>(r1);
    qa[s][2] = *reinterpret_cast<const uint32_t*>(r0 + 2);
    qa[s][3] = *reinterpret_cast<const uint32_t*>(r1 + 2);
  }

  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads g and g + 8
  const int hi0 = hi - row_cut(call, rows, range, g), hi1 = hi - row_cut(call, rows, range, g + 8);  // their ends
  float acc[VCOLS / 8][4];  // [2 * group + parity]: even / odd columns of 16-column group `group`
#pragma unroll
  for (int j = 0; j < VCOLS / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();  // tile i is visible; every warp is done with tile i - 1 (its stage, P and red)
    if (i + STAGES - 1 < ntiles) load_tile(i + STAGES - 1);
    asm volatile("cp.async.commit_group;\n");
    const int later_entry = paged ? paged_rows.fetch(call, b, lo, hi, i + STAGES + 1, tid) : 0;  // put a tile later
    const uint8_t* kt = ks + (i % STAGES) * BN * KROW;
    const int n0 = lo + i * BN;

    // S (16 heads x this warp's 8 rows): ldmatrix gives lane (g, t4) bytes 4*t4..4*t4+3 of a 16-byte chunk of
    // row g: the B fragment of that chunk's k16 step. Four accumulators keep four mma chains in flight.
    float s4[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) s4[a][0] = s4[a][1] = s4[a][2] = s4[a][3] = 0.f;
    const uint8_t* krow = kt + (warp * TOKW + (lane & 7)) * KROW + (lane >> 3) * 16;
#pragma unroll
    for (int c4 = 0; c4 < KSTEPS / 4; ++c4) {
      uint32_t kb[4];
      ldsm_x4(kb, smem_u32(krow + c4 * 64));
#pragma unroll
      for (int a = 0; a < 4; ++a)
        mma_f16(s4[a], qa[c4 * 4 + a], e4m3x2_to_f16x2(kb[a]), e4m3x2_to_f16x2(kb[a] >> 16));
    }
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = (s4[0][e] + s4[1][e]) + (s4[2][e] + s4[3][e]);

    // Online softmax over the tile, log2 domain; rows past a head's end are masked.
    const int row = n0 + warp * TOKW + t4 * 2;
    s[0] = row < hi0 ? s[0] * score_scale : -INFINITY;
    s[1] = row + 1 < hi0 ? s[1] * score_scale : -INFINITY;
    s[2] = row < hi1 ? s[2] * score_scale : -INFINITY;
    s[3] = row + 1 < hi1 ? s[3] * score_scale : -INFINITY;
    float mx0 = fmaxf(s[0], s[1]), mx1 = fmaxf(s[2], s[3]);
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if (t4 == 0) {
      red[warp * H + g] = mx0;
      red[warp * H + g + 8] = mx1;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      mx0 = fmaxf(mx0, red[w * H + g]);
      mx1 = fmaxf(mx1, red[w * H + g + 8]);
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float base0 = mn0 == -INFINITY ? 0.f : mn0, base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = exp2f(s[0] - base0), p1 = exp2f(s[1] - base0);
    const float p2 = exp2f(s[2] - base1), p3 = exp2f(s[3] - base1);
    *reinterpret_cast<uint32_t*>(ps + g * PROW + warp * TOKW + t4 * 2) = pack_half2(p0, p1);
    *reinterpret_cast<uint32_t*>(ps + (g + 8) * PROW + warp * TOKW + t4 * 2) = pack_half2(p2, p3);
    l0 = l0 * alpha0 + (p0 + p1);  // this thread's share; summed across the CTA at the end
    l1 = l1 * alpha1 + (p2 + p3);
#pragma unroll
    for (int j = 0; j < VCOLS / 8; ++j) {
      acc[j][0] *= alpha0;
      acc[j][1] *= alpha0;
      acc[j][2] *= alpha1;
      acc[j][3] *= alpha1;
    }
    __syncthreads();  // P is complete

    // O (16 x this warp's 64 columns) += P (16 x 64) V (64 x 64). ldmatrix.trans of the FP8 rows as b16 gives lane
    // (g, t4) the bytes V[2t4][d], V[2t4][d+1], V[2t4+1][d], V[2t4+1][d+1] with d = group base + 2g: bytes 0 and 2
    // form the B fragment of the even column tile (column g = dim d), bytes 1 and 3 that of the odd one (d + 1).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4];
      ldsm_x4(pa, smem_u32(ps + (lane & 15) * PROW + kk * 16 + (lane >> 4) * 8));
      const uint8_t* vrow =
          kt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KROW + warp * VCOLS + (lane >> 4) * 16;
#pragma unroll
      for (int gp = 0; gp < VCOLS / 32; ++gp) {  // pairs of 16-column groups
        uint32_t vb[4];
        ldsm_x4_trans(vb, smem_u32(vrow + gp * 32));
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const uint32_t lo_rows = vb[2 * h2], hi_rows = vb[2 * h2 + 1];
          float* even = acc[(gp * 2 + h2) * 2];
          float* odd = acc[(gp * 2 + h2) * 2 + 1];
          mma_f16(even, pa, e4m3x2_to_f16x2(__byte_perm(lo_rows, 0, 0x0020)),
                  e4m3x2_to_f16x2(__byte_perm(hi_rows, 0, 0x0020)));
          mma_f16(odd, pa, e4m3x2_to_f16x2(__byte_perm(lo_rows, 0, 0x0031)),
                  e4m3x2_to_f16x2(__byte_perm(hi_rows, 0, 0x0031)));
        }
      }
    }
    if (paged) paged_rows.put(call, i + STAGES, tid, next_entry, lo, hi);  // read after the next iteration's barrier
    next_entry = later_entry;
  }
  asm volatile("cp.async.wait_group 0;\n");

  // Row sums across the quad and the warps (every warp holds the same m0, m1).
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  __syncthreads();  // every warp has read red in its last tile
  if (t4 == 0) {
    red[warp * H + g] = l0;
    red[warp * H + g + 8] = l1;
  }
  __syncthreads();
  l0 = l1 = 0.f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) {
    l0 += red[w * H + g];
    l1 += red[w * H + g + 8];
  }
  const float inv0 = l0 > 0.f ? kv_scale / l0 : 0.f, inv1 = l1 > 0.f ? kv_scale / l1 : 0.f;  // no rows: zeros
  // The first position on a page outside the cache, written before the loop's last barrier: a head is ok where it sees
  // none.
  const int bad_page = paged ? *paged_rows.bad : NO_BAD_PAGE;
  const bool ok0 = row_ok(valid, bad_page, hi0), ok1 = row_ok(valid, bad_page, hi1);
  // Group `grp` holds dims base + 4*t4 + {0, 1, 2, 3} as (even c0, odd c0, even c1, odd c1) for head g (c2, c3: g + 8).
  const size_t part = piece.part;
  const bool direct = piece.count == 1;  // else a partial, merged below
#pragma unroll
  for (int grp = 0; grp < VCOLS / 16; ++grp) {
    const float* ev = acc[2 * grp];
    const float* od = acc[2 * grp + 1];
    const int col = warp * VCOLS + grp * 16 + 4 * t4;
    float4 v0 = make_float4(ev[0] * inv0, od[0] * inv0, ev[1] * inv0, od[1] * inv0);
    float4 v1 = make_float4(ev[2] * inv1, od[2] * inv1, ev[3] * inv1, od[3] * inv1);
    if (direct) {
      if (!ok0) v0 = make_float4(NAN, NAN, NAN, NAN);
      if (!ok1) v1 = make_float4(NAN, NAN, NAN, NAN);
      __nv_bfloat16* o = call.out + rows.row0 * DV + col;
      if (g < rows.live) store_bf16x4(o + g * DV, v0);
      if (g + 8 < rows.live) store_bf16x4(o + (g + 8) * DV, v1);
    } else {
      __nv_bfloat16* o = call.part_o + part * H * DV + col;
      store_bf16x4(o + g * DV, v0);
      store_bf16x4(o + (g + 8) * DV, v1);
    }
  }
  if (warp == 0 && t4 == 0) {
    const float lse0 = l0 > 0.f ? m0 + log2f(l0) : -INFINITY, lse1 = l1 > 0.f ? m1 + log2f(l1) : -INFINITY;
    if (!direct) {  // NaN: a page outside the cache or an invalid range; the merge makes the row NaN
      call.part_lse[part * H + g] = ok0 ? lse0 : NAN;
      call.part_lse[part * H + g + 8] = ok1 ? lse1 : NAN;
    } else if (call.lse) {
      if (g < rows.live) call.lse[row_lse(call, rows, g)] = ok0 ? lse0 * LN2 : NAN;
      if (g + 8 < rows.live) call.lse[row_lse(call, rows, g + 8)] = ok1 ? lse1 * LN2 : NAN;
    }
  }
  if (!BALANCED && !direct) merge_splits<H>(call, base, rows, piece.index, valid);
}

// KV: KV_FP8 (the launcher instantiates no other). BALANCED: the balanced schedule's grid (groups,
// parts), each CTA walking its part's pieces (for_each_piece); else fixed splits.
template <int STAGES, int KV, bool PAGED, bool BALANCED>
__global__ void __launch_bounds__(NTHREADS, 1)
split_kernel(const DecodeCall call) {
  extern __shared__ __align__(128) uint8_t smem[];
  if constexpr (BALANCED)
    for_each_piece<H>(call, [&](const Piece& piece) { decode_piece<STAGES, PAGED, true>(call, piece, smem); });
  else
    decode_piece<STAGES, PAGED, false>(call, split_piece_of<H>(call), smem);
}

}  // namespace mla
