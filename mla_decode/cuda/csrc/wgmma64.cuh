// The Hopper (sm_90a) split kernel for units of 64 query rows (64 heads of one token), the FP8 cache: two
// warpgroups, one CTA an SM. The score product puts the heads on its M side (S = Q K^T, m64n64k32), so a head's max
// over a tile is a thread's 16 scores and two shuffles, and a thread's softmax works on 2 heads, not 16; the value
// product keeps them on N (O^T = V^T P^T, A from registers), as split_kernel has it.
#pragma once

#include "wgmma.cuh"

namespace mla {

constexpr int WIDE_ROWS = 64;                   // query rows a CTA (a unit)
constexpr int WIDE_THREADS = 256;               // two warpgroups
constexpr int WIDE_WARPS = WIDE_THREADS / 32;
constexpr int WIDE_CTAS_PER_SM = 1;             // 128 accumulators and 32 scores a thread: no room for a second
// Each loop iteration takes a pair of 64-row tiles (warpgroup w scores tile 2j + w): 4 stages hold the pair being
// read and the next one in flight.
constexpr int WIDE_STAGES = 4;
// Per head, fp32: each warpgroup's tile max of the pair, the pair's rescale, each warpgroup's final sum, Q's scale.
constexpr int WIDE_STATS = 6 * WIDE_ROWS;
// The running max a pair's P is taken against moves only when the pair's max passes it by more than LAZY_MAX (log2
// units): most pairs then rescale nothing. P = 2^(s - max + WIDE_P_BIAS) stays within e4m3's 448 (2^(6 + 2) = 256).
constexpr float LAZY_MAX = 2.f;
constexpr float WIDE_P_BIAS = 6.f;
static_assert(WIDE_P_BIAS + LAZY_MAX <= 8.f, "P's largest value within e4m3's range");
// The reference after a pair whose max is pair_max: the guess of a tile and the pair's own take the same rule.
__device__ __forceinline__ float lazy_reference(float reference, float pair_max) {
  return pair_max > reference + LAZY_MAX ? pair_max : reference;
}
// Shared memory: the stages, Q (64 x 576 e4m3), P (128 x 64 e4m3), the per-head stats and the paged rows.
constexpr int wide_smem_bytes() {
  return WIDE_STAGES * TILE + WIDE_ROWS * D + 2 * BN * WIDE_ROWS + WIDE_STATS * 4 + SMEM_PAGED;
}
static_assert(wide_smem_bytes() <= 227 * 1024, "a block's shared memory on Hopper");
// PagedRows' 4 slots (tile i in slot i % 4) hold pairs j + 1 and j + 2 during iteration j: pair j + 1's rows are read
// by its copies at the top of the iteration, pair j + 2's written after the scores (pair j's slots, free since then).
static_assert(ROW_SLOTS == 4, "two pairs of tiles' rows");


template <bool PAGED>
__global__ void __launch_bounds__(WIDE_THREADS, WIDE_CTAS_PER_SM)
split_kernel64(const DecodeCall call) {
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
  float* sums = pair_alpha + H;                                  // [warpgroup][head]
  float* qscale = sums + 2 * H;
  int* const rows_smem = reinterpret_cast<int*>(qscale + H);
  const PagedRows paged_rows{rows_smem, rows_smem + ROW_SLOTS * BN};

  const int split = blockIdx.x;
  const QueryRows rows = query_rows<H>(call, blockIdx.y);
  const int b = rows.b, unit = rows.unit;
  const SplitRange range = split_range(call, b, split, rows.t);
  const float kv_scale = *call.kv_scale;  // read with the length (wgmma.cuh's split_kernel says why)
  const unsigned base = arrival_base(call.sync, unit, call.num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles, start = range.start, npairs = (ntiles + 1) / 2;
  const bool valid = range.valid;
  // A tile's rows are consecutive in the cache when ragged or in pages of a multiple of BN rows.
  const bool consecutive = !PAGED || call.page_size % BN == 0;

  const CopyPlan<WIDE_THREADS, false> copy(tid);
  const uint32_t ks_addr = smem_u32(smem);
  // Pair p: tiles 2p and 2p + 1 to stages 2 (p % 2) and + 1, one cp.async group (empty past the last pair). An odd
  // split's last pair has its second tile past hi: zero-filled (no global reads) and masked.
  auto load_pair = [&](int p) {
    if (2 * p < ntiles) {
#pragma unroll
      for (int k = 0; k < 2; ++k)
        copy.tile(call, paged_rows, PAGED, consecutive, ks_addr + ((2 * p + k) % WIDE_STAGES) * TILE, 2 * p + k, lo,
                  hi, start);
    }
    asm volatile("cp.async.commit_group;\n");
  };
  using Query = QueryQuant<H, WIDE_WARPS>;
  typename Query::Regs qv;
  Query::load(qv, call, unit, cwarp, lane);
  if (PAGED) paged_rows.first_tiles<4>(call, b, lo, hi, tid);  // pairs 0 and 1
  load_pair(0);
  Query::store(qv, call, kv_scale, qs, qscale, cwarp, lane);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // The score rows of this thread: heads h0 and h1 = h0 + 8 (wgmma's accumulator rows g and g + 8 of the warp's 16),
  // kv columns 8i + 2 t4 + {0, 1} of its warpgroup's tile (s[4i], s[4i + 1] for h0, s[4i + 2], s[4i + 3] for h1).
  const int h0 = warp * 16 + g, h1 = h0 + 8;
  const float qsc0 = qscale[h0], qsc1 = qscale[h1];
  int heads[NE];
  thread_heads(heads, t4);
  const uint64_t pdesc = desc(smem_u32(ps), QCHUNK, 128, 0);
  const uint64_t qdesc = desc(smem_u32(qs), QCHUNK, 128, 0);
  // P's k order: the pair's tile 2j + w at k = 64 w + p_position(column). Columns 16c + 2 t4 + {0, 1} and
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

  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // running max and this thread's share of the sum
  float acc[4][H / 2];  // O^T: [64-dim block][accumulator]: dims 256*wg + 64*mb + 16*warp + 2g (+1 for rows g + 8)
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int e = 0; e < H / 2; ++e) acc[mb][e] = 0.f;

  // TUNE: pairs
  for (int j = 0; j < npairs; ++j) {
    asm volatile("cp.async.wait_group 0;\n");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // pair j is visible to the tensor cores; every warp is done with pair j - 1
    // TUNE: pair-top
    // The next pair's copies, then S (64 heads x 64 rows) = Q K^T (tile 2j + wg): 18 k32 steps, both operands from
    // shared memory.
    float s[H / 2];
    load_pair(j + 1);
    issue_scores<H, false, true>(s, ks_addr + ((2 * j + wg) % WIDE_STAGES) * TILE, qdesc);
    // Threads 0..127 look up one row each of pair j + 2, stored once the scores are in (its slots, pair j's, were
    // last read by this pair's copies, issued above; read after the next barrier).
    const int ahead = 2 * (j + 2) + (tid >> 6);
    const int next_entry = PAGED && tid < 2 * BN ? paged_rows.fetch(call, b, lo, hi, ahead, tid & (BN - 1)) : 0;
    wg_wait<0>();
    fence_acc<H / 2>(s);
    // TUNE: pair-scores
    if (PAGED && tid < 2 * BN) paged_rows.put(call, ahead, tid & (BN - 1), next_entry, lo, hi);

    // Online softmax over the pair's 128 rows, log2 domain; rows past hi are masked. The warpgroups' tile maxima
    // meet through shared memory at the barrier that completes P, and only where one moves a reference.
    const int in_tile = hi - lo - (2 * j + wg) * BN;  // columns < in_tile are rows before hi
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
          const int a = (e >> 1) * 4;  // heads e and e + 1: accumulators a, a + 1 (row g) and a + 2, a + 3 (row g + 8)
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
      const uint32_t vt = vbase + ((2 * j + (kk >> 1)) % WIDE_STAGES) * TILE + (kk & 1) * 32 * 128;
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
  asm volatile("cp.async.wait_group 0;\n");

  // Sums: over the quad's columns, then the two warpgroups' tiles through shared memory.
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  if (t4 == 0) sums[wg * H + h0] = l0, sums[wg * H + h1] = l1;
  __syncthreads();  // the sums are complete; every warp is done with the stages
  const bool bad_page = PAGED && *paged_rows.bad;
  const bool ok = valid && !bad_page;
  const size_t part = static_cast<size_t>(unit) * call.num_splits + split;
  if (wg == 0 && t4 == 0) {  // l carries 2^WIDE_P_BIAS
    const float l[2] = {sums[h0] + sums[H + h0], sums[h1] + sums[H + h1]}, m[2] = {m0, m1};
#pragma unroll
    for (int k = 0; k < 2; ++k)
      store_lse<H>(call, rows, part, h0 + 8 * k, l[k] > 0.f ? m[k] + __log2f(l[k]) - WIDE_P_BIAS : -INFINITY,
                   bad_page, ok);
  }
  // The output (or partial) through the free stages, as split_kernel stages it: 64 rows of 516 floats.
  constexpr int OUT_ROW = DV + 4;
  static_assert(H * OUT_ROW * 4 <= WIDE_STAGES * TILE, "the staged output fits the stages' bytes");
  float* staged = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int e = 0; e < NE; ++e) {
    const int a = (e & 1) + (e >> 1) * 4;
    const float l = sums[heads[e]] + sums[H + heads[e]];
    const float scale = l > 0.f ? __fdividef(kv_scale, l) : 0.f;  // kv_scale / the sum (no rows: zeros)
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) {
      const int dim = 256 * wg + 64 * mb + 16 * warp + 2 * g;
      *reinterpret_cast<float2*>(staged + heads[e] * OUT_ROW + dim) =
          make_float2(acc[mb][a] * scale, acc[mb][a + 2] * scale);
    }
  }
  __syncthreads();
  const int col = 4 * (tid & 127);
  __nv_bfloat16* dst =
      call.num_splits == 1 ? call.out + static_cast<size_t>(unit) * H * DV : call.part_o + part * H * DV;
#pragma unroll 4
  for (int h = wg; h < H; h += 2) {  // the warpgroups take alternate rows
    float4 v = *reinterpret_cast<const float4*>(staged + h * OUT_ROW + col);
    if (call.num_splits == 1 && !ok) v = make_float4(NAN, NAN, NAN, NAN);
    store_bf16x4(dst + h * DV + col, v);
  }
  if (call.num_splits > 1) merge_splits<H>(call, base, rows, split, valid);
}

}  // namespace mla
