// The Hopper (sm_90a) split kernel for units of 64 query rows (64 heads of one token), the FP8 cache: two
// warpgroups, one CTA an SM. Where the heads come in 64s, every KV tile is read from L2 half as often as in 32-row
// units, and each m64n64k32 MMA reads its 2 KB A operand for twice the output.
#pragma once

#include "wgmma.cuh"

namespace mla {

constexpr int WIDE_ROWS = 64;                   // query rows a CTA (a unit): the N side of both products
constexpr int WIDE_THREADS = 256;               // two warpgroups
constexpr int WIDE_WARPS = WIDE_THREADS / 32;
constexpr int WIDE_CTAS_PER_SM = 1;             // 128 accumulators and 32 scores a thread: no room for a second
// Each loop iteration takes a pair of 64-row tiles (warpgroup w scores tile 2j + w): 4 stages hold the pair being
// read and the next one in flight.
constexpr int WIDE_STAGES = 4;
// Shared memory: the stages, then Q (64 x 576 e4m3), P (128 x 64 e4m3), the max reductions (64 heads x 8 warps
// fp32), the running max (2 x 64 fp32, by the pair's parity), Q's scales (64 fp32), each thread's shares of its 16
// heads' sums ([16][256] fp32: in registers, beside the 128 accumulators and 32 scores, they made the kernel
// spill) and the paged rows.
constexpr int WIDE_SUMS = WIDE_ROWS / 4 * WIDE_THREADS;
constexpr int wide_smem_bytes() {
  return WIDE_STAGES * TILE + WIDE_ROWS * D + 2 * BN * WIDE_ROWS + WIDE_WARPS * WIDE_ROWS * 4 + 2 * WIDE_ROWS * 4 +
         WIDE_ROWS * 4 + WIDE_SUMS * 4 + SMEM_PAGED;
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
  constexpr int NE = H / 4;       // heads a thread
  extern __shared__ __align__(1024) uint8_t smem[];
  // wg: the warpgroup (its tile of a pair, its 256 value dims); warp: within the warpgroup; cwarp: within the CTA.
  const int tid = threadIdx.x, wg = tid >> 7, cwarp = tid >> 5, warp = cwarp & 3, lane = tid & 31, g = lane >> 2,
            t4 = lane & 3;
  uint8_t* qs = smem + WIDE_STAGES * TILE;
  uint8_t* ps = qs + H * D;
  float* red = reinterpret_cast<float*>(ps + 2 * BN * H);
  float* mrun = red + WIDE_WARPS * H;  // [pair parity][head]: the running max before the pair
  float* qscale = mrun + 2 * H;
  float* lsum = qscale + H;  // [head e][tid]: this thread's share of head heads[e]'s sum (2^8-biased)
  int* const rows_smem = reinterpret_cast<int*>(lsum + WIDE_SUMS);
  const PagedRows paged_rows{rows_smem, rows_smem + ROW_SLOTS * BN};

  const int split = blockIdx.x;
  const QueryRows rows = query_rows<H>(call, blockIdx.y);
  const int b = rows.b, unit = rows.unit;
  const SplitRange range = split_range(call, b, split, rows.t);
  const unsigned base = arrival_base(call.sync, unit, call.num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles, start = range.start, npairs = (ntiles + 1) / 2;
  const bool valid = range.valid;
  // A tile's rows are consecutive in the cache when ragged or in pages of a multiple of BN rows.
  const bool consecutive = !PAGED || call.page_size % BN == 0;

  using Copy = CopyPlan<WIDE_THREADS, false>;
  const uint32_t ks_addr = smem_u32(smem);
  // Pair p: tiles 2p and 2p + 1 to stages 2 (p % 2) and + 1, one cp.async group (empty past the last pair). An odd
  // split's last pair has its second tile past hi: zero-filled (no global reads), so its products add nothing.
  auto load_pair = [&](int p) {
    if (2 * p < ntiles) {
#pragma unroll
      for (int k = 0; k < 2; ++k)
        Copy::tile(call, paged_rows, PAGED, consecutive, ks_addr + ((2 * p + k) % WIDE_STAGES) * TILE, 2 * p + k, lo,
                   hi, start, tid, [&](int it) { return Copy::offset(tid, it); });
    }
    asm volatile("cp.async.commit_group;\n");
  };
  using Query = QueryQuant<H, WIDE_WARPS>;
  typename Query::Regs qv;
  Query::load(qv, call, unit, cwarp, lane);
  if (PAGED) paged_rows.first_tiles<4>(call, b, lo, hi, tid);  // pairs 0 and 1
  load_pair(0);
  const float kv_scale = *call.kv_scale;
  Query::store(qv, call, kv_scale, qs, qscale, cwarp, lane);
  if (tid < H) mrun[tid] = -INFINITY;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  int heads[NE];
  thread_heads(heads, t4);
  const uint64_t pdesc = desc(smem_u32(ps), QCHUNK, 128, 0);
  const uint64_t qdesc = desc(smem_u32(qs), QCHUNK, 128, 0);
  // P's k order: the pair's tile 2j + w at k = 64 w + p_position(row).
  const int k0 = BN * wg + p_position(warp * 16 + g), k1 = BN * wg + p_position(warp * 16 + g + 8);
  uint8_t* const p0dst = ps + (k0 >> 4) * QCHUNK + (k0 & 15);
  uint8_t* const p1dst = ps + (k1 >> 4) * QCHUNK + (k1 & 15);
  // Warpgroup w's value dims 256w .. 256w + 255 are the tile's 128-byte-swizzled blocks 2w and 2w + 1.
  const uint32_t vbase = ks_addr + 2 * wg * SW128_BLOCK;
  const uint32_t voff[2] = {lane * 128u + ((warp ^ (lane & 7)) << 4), lane * 128u + (((4 + warp) ^ (lane & 7)) << 4)};

#pragma unroll
  for (int e = 0; e < NE; ++e) lsum[e * WIDE_THREADS + tid] = 0.f;
  float acc[4][H / 2];  // O^T: [64-dim block][accumulator]: dims 256*wg + 64*mb + 16*warp + 2g (+1 for rows g + 8)
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int e = 0; e < H / 2; ++e) acc[mb][e] = 0.f;

  for (int j = 0; j < npairs; ++j) {
    asm volatile("cp.async.wait_group 0;\n");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // pair j is visible to the tensor cores; every warp is done with pair j - 1
    load_pair(j + 1);
    // Threads 0..127 look up one row each of pair j + 2, stored once the scores are in (its slots, pair j's, were
    // last read by this pair's copies, issued before the barrier above; read after the next barrier).
    const int ahead = 2 * (j + 2) + (tid >> 6);
    const int next_entry = PAGED && tid < 2 * BN ? paged_rows.fetch(call, b, lo, hi, ahead, tid & (BN - 1)) : 0;

    // S^T (64 rows x 64 heads) = K (tile 2j + wg) Q^T: 18 k32 steps, both operands from shared memory.
    const uint32_t kt = ks_addr + ((2 * j + wg) % WIDE_STAGES) * TILE;
    float s[H / 2];
    score_tile<H, false>(s, kt, qdesc);
    if (PAGED && tid < 2 * BN) paged_rows.put(call, ahead, tid & (BN - 1), next_entry, lo, hi);

    // Online softmax over the pair's 128 rows, log2 domain, one head at a time; rows past hi are masked. Each warp's
    // max of a head goes to red; after one barrier every thread combines the 8 warps' and the running max (one
    // writer: the next pair reads the other parity, so no second barrier).
    const int n0 = lo + (2 * j + wg) * BN, r0 = warp * 16 + g;
    const bool in0 = n0 + r0 < hi, in1 = n0 + r0 + 8 < hi;
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;
      const float qsc = qscale[heads[e]];
      s[a] = in0 ? s[a] * qsc : -INFINITY;
      s[a + 2] = in1 ? s[a + 2] * qsc : -INFINITY;
      float mx = fmaxf(s[a], s[a + 2]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (g == 0) red[heads[e] * WIDE_WARPS + cwarp] = mx;
    }
    __syncthreads();
    const float* mold = mrun + (j & 1) * H;
    float* mnew = mrun + ((j & 1) ^ 1) * H;
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const int h = heads[e], a = (e & 1) + (e >> 1) * 4;
      const float4 x = reinterpret_cast<const float4*>(red)[2 * h], y = reinterpret_cast<const float4*>(red)[2 * h + 1];
      const float mo = mold[h];
      const float mx = fmaxf(fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)), fmaxf(fmaxf(y.x, y.y), fmaxf(y.z, y.w)));
      const float mn = fmaxf(mo, mx);
      if (tid < 4) mnew[h] = mn;  // lanes 0..3 of warp 0 hold every head
      const float base_m = mn == -INFINITY ? 0.f : mn;
      const float alpha = ex2(mo - base_m);
      const float p0 = ex2(s[a] - (base_m - P_BIAS)), p1 = ex2(s[a + 2] - (base_m - P_BIAS));
      lsum[e * WIDE_THREADS + tid] = lsum[e * WIDE_THREADS + tid] * alpha + (p0 + p1);
      p0dst[h * 16] = to_e4m3(p0);
      p1dst[h * 16] = to_e4m3(p1);
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) {
        acc[mb][a] *= alpha;
        acc[mb][a + 2] *= alpha;
      }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // P is complete

    // O^T (this warpgroup's 256 dims x 64 heads) += V^T (256 x 128) P^T: k steps 0, 1 from tile 2j, 2, 3 from tile
    // 2j + 1. A from registers (v_fragment), a k step (4 m-blocks) at a
    // time, each group committed and the one before waited for: two groups' fragments live at most.
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
  }
  asm volatile("cp.async.wait_group 0;\n");

  __syncthreads();  // every warp has read red in its last pair
  float l[NE];  // sums across the CTA's rows
#pragma unroll
  for (int e = 0; e < NE; ++e) l[e] = lsum[e * WIDE_THREADS + tid];
  reduce_rows<NE, WIDE_WARPS>(l, heads, red, cwarp, g, [](float x, float y) { return x + y; });
  const float* m = mrun + (npairs & 1) * H;  // the final running max (written before the loop's last barrier)
  const bool bad_page = PAGED && *paged_rows.bad;
  const bool ok = valid && !bad_page;
  const size_t part = static_cast<size_t>(unit) * call.num_splits + split;
  if (tid < 4) {  // lanes 0..3 of warp 0 hold every head. l carries 2^8
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const float lse2 = l[e] > 0.f ? m[heads[e]] + __log2f(l[e]) - P_BIAS : -INFINITY;
      store_lse<H>(call, rows, part, heads[e], lse2, bad_page, ok);
    }
  }
  // The output (or partial) through the free stages, as split_kernel stages it: 64 rows of 516 floats. A head at a
  // time (its scale made from its sum there: 16 scales held beside the accumulators spilled).
  constexpr int OUT_ROW = DV + 4;
  static_assert(H * OUT_ROW * 4 <= WIDE_STAGES * TILE, "the staged output fits the stages' bytes");
  float* staged = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int e = 0; e < NE; ++e) {
    const int a = (e & 1) + (e >> 1) * 4;
    const float scale = l[e] > 0.f ? __fdividef(kv_scale, l[e]) : 0.f;  // kv_scale / the sum (no rows: zeros)
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
