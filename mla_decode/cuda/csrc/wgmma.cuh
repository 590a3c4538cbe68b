// The Hopper (sm_90a) split kernel: warpgroup MMAs on FP8 operands, the FP8 or the MXFP4 cache.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "merge.cuh"

namespace mla {

constexpr int NTHREADS = 128;          // one warpgroup
constexpr int NWARPS = 4;              // per warpgroup
constexpr int CTAS_PER_SM = 2;
// Tiles per CTA in shared memory: 2 when two CTAs share an SM, 3 when the grid leaves each CTA an SM of its own.
// A split's first STAGES - 1 tiles are requested before the loop and the next when one lands: more at once delays
// the first (DRAM interleaves every request in flight), so with 4 stages (3 tiles requested at once) 4x8192 and
// 32x1024 took 18.7 and 18.9 us against 17.5 and 17.7 with 3 (H200; requesting all 4 at once: 20.0 and 20.1).
constexpr int STAGES_SHARED = 2;
constexpr int STAGES_ALONE = 3;
// MXFP4: stages of codes (18 KB) beside the one dequantized tile, 3 whether alone or not (5 alone: 19.6 us at
// 4x8192 and 19.7 at 32x1024, against 18.5 and 18.8 with 3).
constexpr int MX_STAGES = 3;
// Tile layout, wgmma's K-major swizzled layouts: dims 0..511 as four 8 KB blocks of [64 rows][128 bytes] with the
// 16-byte units of row r permuted by u ^ (r % 8) (128-byte swizzle), dims 512..575 as [64 rows][64 bytes] with
// u ^ ((r / 2) % 4) (64-byte swizzle). Each 128-byte line of a row lands in one 128-byte line of shared memory
// (a layout with 16-byte pieces 1 KB apart halved the copy rate), and ldmatrix on 8 rows of a unit is conflict-free.
constexpr int SW128_BLOCK = BN * 128;
constexpr int ROPE_OFFSET = 4 * SW128_BLOCK;
constexpr int TILE = BN * D;
constexpr int QCHUNK = H * 16;         // Q and P: [chunk][16 heads][16 bytes]
constexpr int SMEM_Q = H * D;
constexpr int SMEM_P = H * BN;
constexpr int SMEM_RED = NWARPS * H * 4;
// MXFP4 (MX = true): the stages hold a tile's E2M1 codes as they lie in memory ([64 rows][288 bytes]); each tile
// is dequantized once into one FP8 tile (e5m2, exact) at offset 0, which the products read as above.
constexpr bool SUPPORTS_MXFP4 = true;
constexpr int MX_ROW = D / 2;          // bytes of codes per row, two values per byte, low nibble first
constexpr int MX_STAGE = BN * MX_ROW;
constexpr int MX_BLOCKS = D / 32;      // E8M0 scales per row
constexpr int SMEM_PAGED = (ROW_SLOTS * BN + 4) * 4;  // PagedRows: the next tiles' rows and the bad-page flag
template <int STAGES, bool MX>
constexpr int smem_bytes() {
  return (MX ? TILE + STAGES * MX_STAGE : STAGES * TILE) + SMEM_Q + SMEM_P + SMEM_RED + H * 4 + SMEM_PAGED;
}
constexpr float P_BIAS = 8.f;          // P is stored as 2^8 * p (p <= 1): e4m3 keeps its normal range for small p

// Byte offset of the 16-byte unit `ch` (dims 16*ch..16*ch+15) of row r in a tile.
__device__ __forceinline__ int tile_offset(int r, int ch) {
  return ch < 32 ? (ch >> 3) * SW128_BLOCK + r * 128 + (((ch & 7) ^ (r & 7)) << 4)
                 : ROPE_OFFSET + r * 64 + ((((ch - 32) ^ (r >> 1)) & 3) << 4);
}

// Shared-memory matrix descriptor: start address, leading / stride byte offsets, layout (0 none, 1 128-byte swizzle,
// 2 64-byte swizzle). Adding (bytes >> 4) moves the start address (addresses stay below 256 KB: no carry out).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint64_t layout) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (layout << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < 8; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 16, fp32) (+)= A (64 x 32 e4m3, or e5m2 with A_E5M2, shared, K-major) * B (32 x 16 e4m3, shared, K-major).
template <bool A_E5M2>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t da, uint64_t db, int accumulate) {
#define MLA_WGMMA_SS(ATYPE)                                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                                         \
               "wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE                                                  \
               ".e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"                                              \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "l"(da), "l"(db), "r"(accumulate))
  if constexpr (A_E5M2) MLA_WGMMA_SS("e5m2"); else MLA_WGMMA_SS("e4m3");
#undef MLA_WGMMA_SS
}

// D (64 x 16, fp32) += A (64 x 32 e4m3 or e5m2, registers) * B (32 x 16 e4m3, shared, K-major).
template <bool A_E5M2>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db) {
#define MLA_WGMMA_RS(ATYPE)                                                                                         \
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE                                                  \
               ".e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1;\n"                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
  if constexpr (A_E5M2) MLA_WGMMA_RS("e5m2"); else MLA_WGMMA_RS("e4m3");
#undef MLA_WGMMA_RS
}

__device__ __forceinline__ uint32_t prmt_sign(uint32_t a, uint32_t b, uint32_t sel) {  // prmt with sign replication
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One MXFP4 block (32 values: 16 bytes of E2M1 codes, low nibble first, and its E8M0 scale byte) -> 32 e5m2 bytes,
// exactly: E2M1 x 2^k is an e5m2 value for |k| <= 13. A table of the 8 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6, with
// k added to the nonzero exponents) indexed by byte permutes; the sign bits are spread by a permute in sign-
// replication mode. Scales below 2^-13 flush the block to zero (|values| < 2^-12), above 2^13 are clamped.
__device__ __forceinline__ void dequant_block(uint4 codes, uint32_t scale, uint4& lo, uint4& hi) {
  const int k = static_cast<int>(scale) - 127;
  const uint32_t step = static_cast<uint32_t>(min(k, 13) * 4);  // k in the e5m2 exponent field (bits 2..6)
  uint32_t lut0 = 0x3E3C3800u + step * 0x01010100u, lut1 = 0x46444240u + step * 0x01010101u;
  if (k < -13) lut0 = lut1 = 0u;
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // values 8i..8i+7: nibble j of w[i] is value 8i + j, its bit 3 the sign
    const uint32_t t = w[i] << 4;  // byte j of t holds the sign of value 2j as its top bit, byte j of w value 2j+1's
    o[2 * i] = __byte_perm(lut0, lut1, w[i] & 0x7777u) | (prmt_sign(t, w[i], 0xD9C8u) & 0x80808080u);
    o[2 * i + 1] = __byte_perm(lut0, lut1, (w[i] >> 16) & 0x7777u) | (prmt_sign(t, w[i], 0xFBEAu) & 0x80808080u);
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint16_t to_e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint8_t to_e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// Position of tile row r in the k order of the value product: its A fragments (ldmatrix.trans + byte permutes)
// hold, at k = 4*t4 + j of each 16-row half, row 8*(j >> 1) + 2*t4 + (j & 1).
__device__ __forceinline__ int p_position(int r) {
  const int q = r & 15;
  return (r & ~15) + 4 * ((q & 7) >> 1) + 2 * (q >> 3) + (q & 1);
}

// Reduces v[e] (head heads[e]) over a tile's 64 rows: over the lanes of equal t4 (shuffles), then over the 4
// warps through `red` ([16 heads][4 warps]); every thread gets the results for its heads. op: max or sum.
template <typename Op>
__device__ __forceinline__ void reduce_rows(float (&v)[4], const int* heads, float* red, int warp, int g, Op op) {
#pragma unroll
  for (int e = 0; e < 4; ++e)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v[e] = op(v[e], __shfl_xor_sync(0xffffffffu, v[e], o));
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) red[heads[e] * NWARPS + warp] = v[e];
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float4 r = reinterpret_cast<const float4*>(red)[heads[e]];
    v[e] = op(op(r.x, r.y), op(r.z, r.w));
  }
}

template <int STAGES, bool MX, bool PAGED>
__global__ void __launch_bounds__(NTHREADS, CTAS_PER_SM)
split_kernel(const DecodeCall call) {
  extern __shared__ __align__(1024) uint8_t smem[];
  // TUNE: entry
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  uint8_t* ks = MX ? smem + TILE : smem;  // the stages (MX: after the dequantized tile)
  uint8_t* qs = MX ? smem + TILE + STAGES * MX_STAGE : smem + STAGES * TILE;
  uint8_t* ps = qs + SMEM_Q;
  float* red = reinterpret_cast<float*>(ps + SMEM_P);
  float* qscale = red + NWARPS * H;
  const PagedRows paged_rows{reinterpret_cast<int*>(qscale + H), reinterpret_cast<int*>(qscale + H) + ROW_SLOTS * BN};

  const int split = blockIdx.x;
  const QueryRows rows = query_rows(call, blockIdx.y);
  const int b = rows.b, unit = rows.unit;
  const SplitRange range = split_range(call, b, split, rows.t);
  const unsigned base = arrival_base(call.sync, unit, call.num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles, start = range.start;
  const bool valid = range.valid;
  constexpr bool paged = PAGED;  // call.page_size != 0: the launcher picks the instance
  // A tile's rows are consecutive in the cache (one address per tile) when ragged or in pages of a multiple of BN
  // rows; otherwise each copy looks its row up in paged_rows.
  const bool consecutive = !paged || call.page_size % BN == 0;
  // TUNE: start

  // Copy plan: thread tid copies units c = tid + NTHREADS * it of a tile, row c / 36, unit c % 36: its global
  // bytes lie c * 16 bytes after the tile's first row (one warp reads 512 contiguous bytes); its shared offsets are
  // the same for every tile. Rows past hi are zero-filled, never read. The copies ask L2 for whole 128-byte lines
  // (.L2::128B): 256x8192 took 285-286 us against 321-325 without (H200, A/B in one run; 64 or 256 bytes: no gain).
  // MXFP4: a tile's 64 x 288 bytes of codes are contiguous, and land as they are (unit c at byte 16 c).
  constexpr int COPIES = (MX ? MX_STAGE : TILE) / 16 / NTHREADS;
  constexpr int ROW_UNITS = MX ? MX_ROW / 16 : D / 16;
  const uint32_t ks_addr = smem_u32(ks);
  uint32_t soff[COPIES];
#pragma unroll
  for (int it = 0; it < COPIES; ++it) {
    const int c = tid + NTHREADS * it;
    soff[it] = MX ? c * 16 : tile_offset(c / (D / 16), c % (D / 16));
  }
  constexpr int ROW_BYTES = MX ? MX_ROW : D;
  auto load_tile = [&](int i) {
    const uint32_t dst = ks_addr + (i % STAGES) * (MX ? MX_STAGE : TILE);
    const int n0 = lo + i * BN;
    if (consecutive) {
      const int first = paged ? paged_rows.at(i, 0) : start + n0;  // -1: a page outside the cache
      const uint8_t* src = call.kv + static_cast<size_t>(max(first, 0)) * ROW_BYTES + tid * 16;
      const int rows = first < 0 ? 0 : hi - n0;
      if (rows >= BN) {
#pragma unroll
        for (int it = 0; it < COPIES; ++it)
          asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst + soff[it]),
                       "l"(src + it * NTHREADS * 16));
      } else {
#pragma unroll
        for (int it = 0; it < COPIES; ++it) {
          const bool in = (tid + NTHREADS * it) / ROW_UNITS < rows;
          asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst + soff[it]),
                       "l"(in ? src + it * NTHREADS * 16 : call.kv), "r"(in ? 16 : 0));
        }
      }
    } else {  // each 16-byte unit's row looked up (a thread's units lie in several rows; warps stay coalesced)
#pragma unroll
      for (int it = 0; it < COPIES; ++it) {
        const int c = tid + NTHREADS * it, row = paged_rows.at(i, c / ROW_UNITS);  // -1: past hi or a bad page
        const uint8_t* src = call.kv + static_cast<size_t>(max(row, 0)) * ROW_BYTES + (c % ROW_UNITS) * 16;
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst + soff[it]), "l"(src),
                     "r"(row >= 0 ? 16 : 0));
      }
    }
  };
  // Q -> e4m3 with one scale per head (its amax maps to 448), in the [chunk][head][16] layout of the score
  // product's B operand; the head's scale, sm_scale * log2(e) and the KV scale multiply the scores. Q's loads are
  // issued before the first tiles' copies so they do not queue behind them.
  constexpr int QPAIRS = D / 64;  // bf16 pairs per lane and head
  __nv_bfloat162 qv[H / NWARPS][QPAIRS];
#pragma unroll
  for (int j = 0; j < H / NWARPS; ++j) {
    const __nv_bfloat162* src =
        reinterpret_cast<const __nv_bfloat162*>(call.q + (static_cast<size_t>(unit) * H + warp + j * NWARPS) * D);
#pragma unroll
    for (int i = 0; i < QPAIRS; ++i) qv[j][i] = src[lane + 32 * i];
  }
  // One cp.async group per tile (empty past the last).
  auto load_group = [&](int i) {
    if (i < ntiles) load_tile(i);
    asm volatile("cp.async.commit_group;\n");
  };
  if (paged) paged_rows.first_tiles<STAGES>(call, b, lo, hi, tid);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) load_group(i);
  // TUNE: issued
  const float kv_scale = MX ? 1.f : *call.kv_scale;
  // MXFP4: this thread dequantizes blocks c = tid + 128 j (j < 9) of each tile, row c / 18, block c % 18; their
  // E8M0 scales are loaded one tile ahead, into registers (rows past hi: 127, a scale of 1 over zero codes).
  constexpr int MX_JOBS = MX ? BN * MX_BLOCKS / NTHREADS : 1;
  uint32_t next_scales[MX_JOBS];
  auto load_scales = [&](int i) {
#pragma unroll
    for (int j = 0; j < MX_JOBS; ++j) {
      const int c = tid + NTHREADS * j, n = lo + i * BN + c / MX_BLOCKS;
      const int row = i >= ntiles || n >= hi ? -1 : paged ? paged_rows.at(i, c / MX_BLOCKS) : start + n;
      next_scales[j] = row >= 0 ? call.kv_block_scales[static_cast<size_t>(row) * call.scale_stride + c % MX_BLOCKS]
                                : 127u;
    }
  };
  if constexpr (MX) load_scales(0);
#pragma unroll
  for (int j = 0; j < H / NWARPS; ++j) {
    const int h = warp + j * NWARPS;
    float2 v[QPAIRS];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < QPAIRS; ++i) {
      v[i] = __bfloat1622float2(qv[j][i]);
      amax = fmaxf(amax, fmaxf(fabsf(v[i].x), fabsf(v[i].y)));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? 448.f / amax : 1.f;
#pragma unroll
    for (int i = 0; i < QPAIRS; ++i) {
      const int d = 2 * (lane + 32 * i);
      *reinterpret_cast<uint16_t*>(qs + (d >> 4) * QCHUNK + h * 16 + (d & 15)) = to_e4m3x2(v[i].x * inv, v[i].y * inv);
    }
    if (lane == 0) qscale[h] = (amax > 0.f ? amax / 448.f : 1.f) * call.qk_scale * kv_scale;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // TUNE: Q
  // This thread's score columns (heads) are 2*t4, 2*t4 + 1, 8 + 2*t4, 9 + 2*t4 (accumulator pairs 0/1 and 4/5 for
  // row g of the warp's 16 rows, 2/3 and 6/7 for row g + 8).
  const int heads[4] = {2 * t4, 2 * t4 + 1, 8 + 2 * t4, 9 + 2 * t4};
  const uint64_t pdesc = desc(smem_u32(ps), QCHUNK, 128, 0);
  const uint64_t qdesc = desc(smem_u32(qs), QCHUNK, 128, 0);
  // Fixed per thread: where its P bytes go (rows warp*16 + g and + 8) and where its ldmatrix rows start.
  const int k0 = p_position(warp * 16 + g), k1 = p_position(warp * 16 + g + 8);
  uint8_t* const p0dst = ps + (k0 >> 4) * QCHUNK + (k0 & 15);
  uint8_t* const p1dst = ps + (k1 >> 4) * QCHUNK + (k1 & 15);
  const uint32_t voff[2] = {lane * 128u + ((warp ^ (lane & 7)) << 4), lane * 128u + (((4 + warp) ^ (lane & 7)) << 4)};
  float qsc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) qsc[e] = qscale[heads[e]];

  float m[4], l[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) m[e] = -INFINITY, l[e] = 0.f;
  float acc[8][8];  // O^T: [64-dim block][accumulator]: dims 64*mb + 16*warp + 2g (+1 for rows g + 8)
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[mb][e] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // tile i is visible to the tensor cores; every warp is done with tile i - 1
    // TUNE: tile
    load_group(i + STAGES - 1);
    const int next_row = paged ? paged_rows.fetch(call, b, lo, hi, i + STAGES, tid) : 0;  // stored after the products
    uint32_t kt = ks_addr + (i % STAGES) * TILE;
    if constexpr (MX) {  // codes + scales -> the e5m2 tile at offset 0 (free: every warp is done with tile i - 1)
      uint32_t scales[MX_JOBS];
#pragma unroll
      for (int j = 0; j < MX_JOBS; ++j) scales[j] = next_scales[j];
      load_scales(i + 1);
      const uint8_t* codes = ks + (i % STAGES) * MX_STAGE;
#pragma unroll
      for (int j = 0; j < MX_JOBS; ++j) {
        const int c = tid + NTHREADS * j, r = c / MX_BLOCKS, blk = c % MX_BLOCKS;
        uint4 lo16, hi16;
        dequant_block(*reinterpret_cast<const uint4*>(codes + c * 16), scales[j], lo16, hi16);
        *reinterpret_cast<uint4*>(smem + tile_offset(r, 2 * blk)) = lo16;
        *reinterpret_cast<uint4*>(smem + tile_offset(r, 2 * blk + 1)) = hi16;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      kt = smem_u32(smem);
    }
    const int n0 = lo + i * BN;

    // S^T (64 rows x 16 heads) = K (64 x 576) Q^T: 18 k32 steps, both operands from shared memory.
    float s[8];
    wg_fence();
    const uint64_t k128 = desc(kt, 16, 1024, 1), k64 = desc(kt + ROPE_OFFSET, 16, 512, 2);
#pragma unroll
    for (int st = 0; st < D / 32; ++st) {
      const uint64_t da =
          st < 16 ? k128 + (((st >> 2) * SW128_BLOCK + (st & 3) * 32) >> 4) : k64 + (((st - 16) * 32) >> 4);
      wgmma_ss<MX>(s, da, qdesc + ((2 * st * QCHUNK) >> 4), st);
    }
    wg_commit();
    wg_wait0();
    fence_acc(s);
    // TUNE: scored

    // Online softmax over the tile, log2 domain; rows past hi are masked.
    const int r0 = warp * 16 + g;
    const bool in0 = n0 + r0 < hi, in1 = n0 + r0 + 8 < hi;
    float mx[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;  // accumulator of head e at row g; a + 2 at row g + 8
      s[a] = in0 ? s[a] * qsc[e] : -INFINITY;
      s[a + 2] = in1 ? s[a + 2] * qsc[e] : -INFINITY;
      mx[e] = fmaxf(s[a], s[a + 2]);
    }
    reduce_rows(mx, heads, red, warp, g, [](float x, float y) { return fmaxf(x, y); });
    // TUNE: maxed
    float alpha[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mn = fmaxf(m[e], mx[e]);
      const float base = mn == -INFINITY ? 0.f : mn;
      alpha[e] = ex2(m[e] - base);
      m[e] = mn;
      const int a = (e & 1) + (e >> 1) * 4;
      const float p0 = ex2(s[a] - (base - P_BIAS)), p1 = ex2(s[a + 2] - (base - P_BIAS));
      l[e] = l[e] * alpha[e] + (p0 + p1);  // this thread's share; summed across the CTA at the end
      p0dst[heads[e] * 16] = to_e4m3(p0);
      p1dst[heads[e] * 16] = to_e4m3(p1);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    // Rescale only when a running max moved somewhere in the warp (rare after the first tiles).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f || alpha[2] != 1.f || alpha[3] != 1.f)) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int a = (e & 1) + (e >> 1) * 4;
          acc[mb][a] *= alpha[e];
          acc[mb][a + 2] *= alpha[e];
        }
      }
    }
    __syncthreads();  // P is complete
    // TUNE: P

    // O^T (512 dims x 16 heads) += V^T (512 x 64) P^T: A from registers. ldmatrix.trans of a chunk's 8-row blocks
    // as b16 gives lane (g, t4) bytes V[r + 2t4][2g], V[r + 2t4][2g+1], V[r + 2t4 + 1][2g], V[r + 2t4 + 1][2g+1] of
    // block r; byte permutes of blocks r and r + 8 give the fragment of A row g (dim 2g) and row g + 8 (dim 2g+1).
#pragma unroll
    for (int kk = 0; kk < BN / 32; ++kk) {
      uint32_t a[8][4];
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        uint32_t vb[4];
        ldsm_x4_trans(vb, kt + (mb >> 1) * SW128_BLOCK + kk * 32 * 128 + voff[mb & 1]);
        a[mb][0] = __byte_perm(vb[0], vb[1], 0x6420);
        a[mb][1] = __byte_perm(vb[0], vb[1], 0x7531);
        a[mb][2] = __byte_perm(vb[2], vb[3], 0x6420);
        a[mb][3] = __byte_perm(vb[2], vb[3], 0x7531);
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) fence_acc(acc[mb]);
      wg_fence();
      const uint64_t db = pdesc + ((2 * kk * QCHUNK) >> 4);
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) wgmma_rs<MX>(acc[mb], a[mb], db);
    }
    wg_commit();
    wg_wait0();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb) fence_acc(acc[mb]);
    if (paged) paged_rows.put(i + STAGES, tid, next_row, lo, hi);  // read after the next iteration's barrier
    // TUNE: PV
  }
  asm volatile("cp.async.wait_group 0;\n");

  // TUNE: loop
  // Row sums across the warp's rows and the warps (every warp holds the same m).
  __syncthreads();  // every warp has read red in its last tile
  reduce_rows(l, heads, red, warp, g, [](float x, float y) { return x + y; });
  float scale[4];  // kv_scale / the sum (no rows: zeros)
#pragma unroll
  for (int e = 0; e < 4; ++e) scale[e] = l[e] > 0.f ? __fdividef(kv_scale, l[e]) : 0.f;
  const bool bad_page = paged && *paged_rows.bad;  // written before the loop's last barrier
  const bool ok = valid && !bad_page;
  const size_t part = static_cast<size_t>(unit) * call.num_splits + split;
  if (tid < 32 && g == 0) {  // first: not queued behind the partial's stores. l carries 2^8
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lse2 = l[e] > 0.f ? m[e] + __log2f(l[e]) - P_BIAS : -INFINITY;
      if (call.num_splits > 1)
        call.part_lse[part * H + heads[e]] = bad_page ? NAN : lse2;  // NaN: the merge makes the unit NaN
      else if (call.lse)
        call.lse[rows.lse0 + heads[e] * rows.lse_stride] = ok ? lse2 * LN2 : NAN;
    }
  }
  // The output (or partial) goes through shared memory (the stages are free: no copies or products pending) so
  // that each warp store writes whole 128-byte lines; from the fragments, each store wrote four 64-byte pieces and
  // the 32 stores took ~1500 cycles per CTA. Rows padded by 4 floats: the fragments' float2 writes take 2 wavefronts.
  constexpr int OUT_ROW = DV + 4;
  static_assert(H * OUT_ROW * 4 <= TILE, "the staged output fits the first tile's bytes");
  float* staged = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int dim = 64 * mb + 16 * warp + 2 * g;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;
      *reinterpret_cast<float2*>(staged + heads[e] * OUT_ROW + dim) =
          make_float2(acc[mb][a] * scale[e], acc[mb][a + 2] * scale[e]);
    }
  }
  __syncthreads();
  // TUNE: staged
  const int col = 4 * tid;
#pragma unroll 4
  for (int h = 0; h < H; ++h) {
    float4 v = *reinterpret_cast<const float4*>(staged + h * OUT_ROW + col);
    if (call.num_splits == 1 && !ok) v = make_float4(NAN, NAN, NAN, NAN);
    __nv_bfloat16* dst =
        call.num_splits == 1 ? call.out + static_cast<size_t>(unit) * H * DV : call.part_o + part * H * DV;
    store_bf16x4(dst + h * DV + col, v);
  }
  // TUNE: partial
  if (call.num_splits > 1) merge_splits(call, base, rows, split, valid);
  // TUNE: merged
}

}  // namespace mla
