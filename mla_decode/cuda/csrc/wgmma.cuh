// The Hopper (sm_90a) split kernel: warpgroup MMAs on FP8 operands (the FP8 or the MXFP4 cache) or on BF16 ones (the
// BF16 cache).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <utility>

#include "merge.cuh"

namespace mla {

constexpr int NTHREADS = 128;          // one warpgroup
constexpr int NWARPS = 4;              // per warpgroup
constexpr int CTAS_PER_SM = 2;
// Tiles per CTA in shared memory: 2 when two CTAs share an SM, 3 when the grid leaves each CTA an SM of its own. A
// split's first STAGES - 1 tiles are requested before the loop and the next when one lands: more at once delays the
// first (DRAM interleaves every request in flight), so 4 stages lost to 3 (docs/design-notes.md, "The kernels' measured
// choices").
constexpr int STAGES_SHARED = 2;
constexpr int STAGES_ALONE = 3;
// MXFP4: stages of codes (18 KB) beside the one dequantized tile, 3 whether alone or not (5 alone lost: the same
// notes).
constexpr int MX_STAGES = 3;
// Tile layout, wgmma's K-major swizzled layouts: dims 0..511 as four 8 KB blocks of [64 rows][128 bytes] with the
// 16-byte units of row r permuted by u ^ (r % 8) (128-byte swizzle), dims 512..575 as [64 rows][64 bytes] with
// u ^ ((r / 2) % 4) (64-byte swizzle). Each 128-byte line of a row lands in one 128-byte line of shared memory
// (a layout with 16-byte pieces 1 KB apart halved the copy rate), and ldmatrix on 8 rows of a unit is conflict-free.
constexpr int SW128_BLOCK = BN * 128;
constexpr int ROPE_OFFSET = 4 * SW128_BLOCK;
constexpr int TILE = BN * D;
// MXFP4 (MX = true): the stages hold a tile's E2M1 codes as they lie in memory ([64 rows][288 bytes]); each tile
// is dequantized once into one FP8 tile (e5m2, exact) at offset 0, which the products read as above.
constexpr bool SUPPORTS_MXFP4 = true;
constexpr bool SUPPORTS_BF16 = true;
constexpr int MAX_UNIT_ROWS = 64;      // units of 16 or 32 query rows (split_kernel's H), or 64 (wgmma64.cuh, FP8)
constexpr int MX_ROW = D / 2;          // bytes of codes per row, two values per byte, low nibble first
constexpr int MX_STAGE = BN * MX_ROW;
constexpr int MX_BLOCKS = D / 32;      // E8M0 scales per row
constexpr int SMEM_PAGED = (ROW_SLOTS * BN + 4) * 4;  // PagedRows: the next tiles' rows and the bad-page flag
// BF16 (KV_BF16): a tile is nine 8 KB blocks of [64 rows][128 bytes] (64 dims each, the rope's the ninth), every one
// in the 128-byte swizzle; two stages of 72 KB, one CTA an SM. Q and P are bf16 in the FP8 layouts' 16-byte chunks.
constexpr int BF_ROW = 2 * D;          // bytes per BF16 row
constexpr int BF_TILE = BN * BF_ROW;
constexpr int BF_STAGES = 2;
__host__ __device__ constexpr int operand_bytes(int kv) { return kv == KV_BF16 ? 2 : 1; }  // Q and P elements
// Shared memory: the stages (MX: the dequantized tile, then the stages of codes), then for H query rows Q (H x 576
// e4m3, or bf16), P (64 x H e4m3, or bf16), the reductions (H x NWARPS fp32), Q's scales (H fp32), the rows' cuts
// (H int32) and the paged rows.
template <int STAGES, int KV>
__host__ __device__ constexpr int stage_bytes() {
  return KV == KV_MXFP4 ? TILE + STAGES * MX_STAGE : STAGES * (KV == KV_BF16 ? BF_TILE : TILE);
}
template <int STAGES, int KV, int H>
constexpr int smem_bytes() {
  return stage_bytes<STAGES, KV>() + (H * D + H * BN) * operand_bytes(KV) + NWARPS * H * 4 + 2 * H * 4 + SMEM_PAGED;
}
// Two CTAs a SM (228 KB, 1 KB of it reserved per CTA) for the instances that share SMs, at 32 rows (16 take less):
// FP8 2 x (95,888 + 1,024) bytes, MXFP4 2 x (114,320 + 1,024).
static_assert(2 * (smem_bytes<STAGES_SHARED, KV_FP8, 32>() + 1024) <= 228 * 1024, "2 FP8 CTAs of 32 rows a SM");
static_assert(2 * (smem_bytes<MX_STAGES, KV_MXFP4, 32>() + 1024) <= 228 * 1024, "2 MXFP4 CTAs of 32 rows a SM");
static_assert(smem_bytes<BF_STAGES, KV_BF16, 32>() <= 227 * 1024, "a BF16 CTA of 32 rows");
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
template <int N>  // until at most N committed groups are pending
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int N>  // before and after the asynchronous products that read and write these N accumulators
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The products with N (the CTA's query rows, 16, 32 or 64) as their N side: N / 2 fp32 accumulators a thread, which
// hold for rows g and g + 8 of the warp's 16 (lane g = lane / 4, t4 = lane % 4) columns 8j + 2 t4 + {0, 1}, j < N / 8:
// d[4j], d[4j + 1] at row g, d[4j + 2], d[4j + 3] at row g + 8.
#define MLA_ACC8(i)                                                                                                 \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),     \
      "+f"(d[i + 7])
#define MLA_REGS8 "{%0,%1,%2,%3,%4,%5,%6,%7}"
#define MLA_REGS16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define MLA_REGS32                                                                                                  \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"    \
  "%29,%30,%31}"

// D (64 x N, fp32) (+)= A (64 x 32 e4m3, or e5m2 with A_E5M2, shared, K-major) * B (32 x N e4m3, shared, K-major).
template <int N, bool A_E5M2>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t da, uint64_t db, int accumulate) {
#define MLA_WGMMA_SS(ATYPE)                                                                                         \
  if constexpr (N == 16)                                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE ".e4m3 " MLA_REGS8 ", %8, %9, p, 1, 1;\n}\n"    \
                 : MLA_ACC8(0) : "l"(da), "l"(db), "r"(accumulate));                                               \
  else if constexpr (N == 32)                                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32." ATYPE ".e4m3 " MLA_REGS16 ", %16, %17, p, 1, 1;\n}\n" \
                 : MLA_ACC8(0), MLA_ACC8(8) : "l"(da), "l"(db), "r"(accumulate));                                  \
  else                                                                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32." ATYPE ".e4m3 " MLA_REGS32 ", %32, %33, p, 1, 1;\n}\n" \
                 : MLA_ACC8(0), MLA_ACC8(8), MLA_ACC8(16), MLA_ACC8(24) : "l"(da), "l"(db), "r"(accumulate))
  static_assert(N == 16 || N == 32 || N == 64, "m64n16k32, m64n32k32 or m64n64k32");
  if constexpr (A_E5M2) { MLA_WGMMA_SS("e5m2"); } else { MLA_WGMMA_SS("e4m3"); }
#undef MLA_WGMMA_SS
}

// D (64 x N, fp32) += A (64 x 32 e4m3 or e5m2, registers) * B (32 x N e4m3, shared, K-major).
template <int N, bool A_E5M2>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db) {
#define MLA_WGMMA_RS(ATYPE)                                                                                         \
  if constexpr (N == 16)                                                                                            \
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE ".e4m3 " MLA_REGS8                             \
                 ", {%8,%9,%10,%11}, %12, 1, 1, 1;\n"                                                               \
                 : MLA_ACC8(0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                             \
  else if constexpr (N == 32)                                                                                       \
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.f32." ATYPE ".e4m3 " MLA_REGS16                            \
                 ", {%16,%17,%18,%19}, %20, 1, 1, 1;\n"                                                             \
                 : MLA_ACC8(0), MLA_ACC8(8) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                \
  else                                                                                                              \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32." ATYPE ".e4m3 " MLA_REGS32                            \
                 ", {%32,%33,%34,%35}, %36, 1, 1, 1;\n"                                                             \
                 : MLA_ACC8(0), MLA_ACC8(8), MLA_ACC8(16), MLA_ACC8(24)                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
  static_assert(N == 16 || N == 32 || N == 64, "m64n16k32, m64n32k32 or m64n64k32");
  if constexpr (A_E5M2) { MLA_WGMMA_RS("e5m2"); } else { MLA_WGMMA_RS("e4m3"); }
#undef MLA_WGMMA_RS
}
// The BF16 products: D (64 x N, fp32) (+)= A (64 x 16 bf16, shared, K-major) * B (16 x N bf16, shared, K-major), and
// D += A (registers) * B (shared).
template <int N>
__device__ __forceinline__ void wgmma_ss_bf16(float* d, uint64_t da, uint64_t db, int accumulate) {
  static_assert(N == 16 || N == 32 || N == 64, "m64n16k16, m64n32k16 or m64n64k16");
  if constexpr (N == 16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " MLA_REGS8 ", %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : MLA_ACC8(0) : "l"(da), "l"(db), "r"(accumulate));
  else if constexpr (N == 32)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " MLA_REGS16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : MLA_ACC8(0), MLA_ACC8(8) : "l"(da), "l"(db), "r"(accumulate));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MLA_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : MLA_ACC8(0), MLA_ACC8(8), MLA_ACC8(16), MLA_ACC8(24) : "l"(da), "l"(db), "r"(accumulate));
}

template <int N>
__device__ __forceinline__ void wgmma_rs_bf16(float* d, const uint32_t* a, uint64_t db) {
  static_assert(N == 16 || N == 32, "m64n16k16 or m64n32k16");
  if constexpr (N == 16)
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " MLA_REGS8
                 ", {%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
                 : MLA_ACC8(0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " MLA_REGS16
                 ", {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
                 : MLA_ACC8(0), MLA_ACC8(8) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// The 64-row BF16 unit's value products: O (64 x 256, fp32, 128 a thread: rows g and g + 8 of the warp's 16, columns
// 8j + 2 t4 + {0, 1} at d[4j], d[4j + 1] and d[4j + 2], d[4j + 3]) += A (64 x 16 bf16: shared and K-major, or
// registers) * B (16 x 256 bf16, shared, MN-major: trans-b).
#define MLA_ACC128                                                                                                  \
  MLA_ACC8(0), MLA_ACC8(8), MLA_ACC8(16), MLA_ACC8(24), MLA_ACC8(32), MLA_ACC8(40), MLA_ACC8(48), MLA_ACC8(56),     \
      MLA_ACC8(64), MLA_ACC8(72), MLA_ACC8(80), MLA_ACC8(88), MLA_ACC8(96), MLA_ACC8(104), MLA_ACC8(112),            \
      MLA_ACC8(120)
#define MLA_REGS128                                                                                                 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"    \
  "%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,"   \
  "%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,"   \
  "%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,"   \
  "%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
__device__ __forceinline__ void wgmma_bf16_n256_mn(float* d, uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MLA_REGS128 ", %128, %129, 1, 1, 1, 0, 1;\n"
               : MLA_ACC128 : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_bf16_n256_rs_mn(float* d, const uint32_t* a, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MLA_REGS128
               ", {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
               : MLA_ACC128 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#undef MLA_ACC128
#undef MLA_REGS128
#undef MLA_ACC8
#undef MLA_REGS8
#undef MLA_REGS16
#undef MLA_REGS32

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

// 2^x (x <= 127) on the FMA pipe, within 1e-3 relative (-inf -> 2^-126): x rounded to n by the 1.5 x 2^23 trick
// (r's low bits then hold n), 2^(x - n) by a cubic, n added to its exponent.
__device__ __forceinline__ float ex2_fma(float x) {
  const float xc = fmaxf(x, -126.f);
  const float r = xc + 12582912.f;
  const float f = xc - (r - 12582912.f);
  const float q = fmaf(fmaf(fmaf(0.0555041086648216f, f, 0.2402264923172690f), f, 0.6931471805599453f), f, 1.f);
  return __int_as_float(__float_as_int(q) + (__float_as_int(r) << 23));
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

// This thread's heads, the score and output columns of both products: 8j + 2*t4 and 8j + 2*t4 + 1, j < NE / 2. Head
// e is at accumulator a = (e & 1) + (e >> 1) * 4 for row g of the warp's 16 rows and a + 2 for row g + 8 (wgmma's
// layout).
template <int NE>
__device__ __forceinline__ void thread_heads(int (&heads)[NE], int t4) {
#pragma unroll
  for (int e = 0; e < NE; ++e) heads[e] = 8 * (e >> 1) + 2 * t4 + (e & 1);
}

// S^T (64 tile rows x N query rows, fp32: N / 2 a thread) = K (the tile at shared address kt, 576 dims) Q^T (qdesc:
// [chunk][N][16] e4m3): 18 k32 steps, both operands from shared memory, issued and committed as one group (wait for
// it, then fence_acc). Q_ROWS: the transpose, S (N = 64 query rows x 64 tile rows) = Q K^T, Q on the M side.
template <int N, bool A_E5M2, bool Q_ROWS = false>
__device__ __forceinline__ void issue_scores(float* s, uint32_t kt, uint64_t qdesc) {
  static_assert(!Q_ROWS || (N == 64 && !A_E5M2), "Q as the 64-row A operand, the FP8 cache as B");
  wg_fence();
  const uint64_t k128 = desc(kt, 16, 1024, 1), k64 = desc(kt + ROPE_OFFSET, 16, 512, 2);
#pragma unroll
  for (int st = 0; st < D / 32; ++st) {
    const uint64_t dk =
        st < 16 ? k128 + (((st >> 2) * SW128_BLOCK + (st & 3) * 32) >> 4) : k64 + (((st - 16) * 32) >> 4);
    const uint64_t dq = qdesc + ((2 * st * N * 16) >> 4);
    if constexpr (Q_ROWS) wgmma_ss<N, false>(s, dq, dk, st);
    else wgmma_ss<N, A_E5M2>(s, dk, dq, st);
  }
  wg_commit();
}

// issue_scores, returning with the products done.
template <int N, bool A_E5M2>
__device__ __forceinline__ void score_tile(float* s, uint32_t kt, uint64_t qdesc) {
  issue_scores<N, A_E5M2>(s, kt, qdesc);
  wg_wait<0>();
  fence_acc<N / 2>(s);
}

// score_tile over the BF16 cache: S^T (64 tile rows x N query rows) = K (the BF16 tile at kt: nine 128-byte-swizzled
// blocks) Q^T (qdesc: [chunk][N][8] bf16), 36 k16 steps, returning with the products done.
template <int N>
__device__ __forceinline__ void score_tile_bf16(float* s, uint32_t kt, uint64_t qdesc) {
  wg_fence();
  const uint64_t k128 = desc(kt, 16, 1024, 1);
#pragma unroll
  for (int st = 0; st < D / 16; ++st)
    wgmma_ss_bf16<N>(s, k128 + (((st >> 2) * SW128_BLOCK + (st & 3) * 32) >> 4), qdesc + ((2 * st * N * 16) >> 4), st);
  wg_commit();
  wg_wait<0>();
  fence_acc<N / 2>(s);
}

// The value product's A fragment (V^T, 64 dims x 32 tile rows) of the 8-row blocks at shared address addr.
// ldmatrix.trans of a chunk's 8-row blocks as b16 gives lane (g, t4) bytes V[r + 2t4][2g], V[r + 2t4][2g+1],
// V[r + 2t4 + 1][2g], V[r + 2t4 + 1][2g+1] of block r; byte permutes of blocks r and r + 8 give the fragment of A
// row g (dim 2g) and row g + 8 (dim 2g+1).
__device__ __forceinline__ void v_fragment(uint32_t* a, uint32_t addr) {
  uint32_t vb[4];
  ldsm_x4_trans(vb, addr);
  a[0] = __byte_perm(vb[0], vb[1], 0x6420);
  a[1] = __byte_perm(vb[0], vb[1], 0x7531);
  a[2] = __byte_perm(vb[2], vb[3], 0x6420);
  a[3] = __byte_perm(vb[2], vb[3], 0x7531);
}

// Query row h's log2-sum-exp lse2 (of H rows): where the unit has more than one piece, to part_lse's row `part` (NaN
// where not ok, a page outside the cache or an invalid range: the merge makes the row NaN), else to lse (natural
// log; NaN where not ok).
template <int H>
__device__ __forceinline__ void store_lse(const DecodeCall& call, const QueryRows& rows, int pieces, size_t part,
                                          int h, float lse2, bool ok) {
  if (pieces > 1)
    call.part_lse[part * H + h] = ok ? lse2 : NAN;
  else if (call.lse && h < rows.live)
    call.lse[row_lse(call, rows, h)] = ok ? lse2 * LN2 : NAN;
}

// Reduces v[e] (head heads[e], NE heads a thread) over the CTA's rows: over the lanes of equal t4 (shuffles), then
// over the 4 warps through `red` ([H heads][4 warps]); every thread gets the results for its heads. op: max or sum.
template <int NE, typename Op>
__device__ __forceinline__ void reduce_rows(float (&v)[NE], const int* heads, float* red, int warp, int g, Op op) {
#pragma unroll
  for (int e = 0; e < NE; ++e)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v[e] = op(v[e], __shfl_xor_sync(0xffffffffu, v[e], o));
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < NE; ++e) red[heads[e] * NWARPS + warp] = v[e];
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < NE; ++e) {
    const float4 r = reinterpret_cast<const float4*>(red)[heads[e]];
    v[e] = op(op(r.x, r.y), op(r.z, r.w));
  }
}

// A tile's copies by NT threads (128 or 256), 16 bytes each; rows past hi are zero-filled, never read. FP8: dims
// 0..511 of rows R it + r0 (R = NT / 32 rows a round, r0 = tid / 32) as unit u = tid % 32 of the row, so a warp
// reads a row's 512 contiguous bytes; a row's 128-byte swizzle repeats every 8 rows, so the shared offsets are
// 8 / R bases plus immediates and the global ones immediates (no address arithmetic a copy). Dims 512..575: rows
// tid / 4 + (NT / 4) k, one unit each. MXFP4: a tile's 64 x 288 bytes of codes are contiguous and land as they are
// (unit c = tid + NT it at byte 16 c). The copies ask L2 for whole 128-byte lines (.L2::128B), which cut the large
// shapes' time by a tenth (the same notes); gather() says where not.
template <int NT, bool MX>
struct CopyPlan {
  static_assert(NT == 128 || NT == 256, "one or two warpgroups");
  static constexpr int R = NT / 32, ROUNDS = BN / R, PERIOD = 8 / R;  // FP8: rows a round, rounds, swizzle period
  static constexpr int ROPE_ROWS = NT / 4, ROPE_COPIES = BN / ROPE_ROWS;
  static constexpr int MX_COPIES = MX_STAGE / 16 / NT, MX_UNITS = MX_ROW / 16;
  uint32_t main_off[PERIOD], rope_off;  // FP8: shared offsets of rounds 0 .. PERIOD - 1 and of the first rope unit
  int tid, main_src, rope_src;          // FP8: global offsets within the tile's first row

  __device__ __forceinline__ explicit CopyPlan(int thread) : tid(thread) {
    const int u = tid & 31, r0 = tid >> 5, rr = tid >> 2, ru = tid & 3;
#pragma unroll
    for (int k = 0; k < PERIOD; ++k) {
      const int r = r0 + R * k;
      main_off[k] = (u >> 3) * SW128_BLOCK + r * 128 + (((u & 7) ^ (r & 7)) << 4);
    }
    rope_off = ROPE_OFFSET + rr * 64 + (((ru ^ (rr >> 1)) & 3) << 4);  // rows + 32 k keep (rr >> 1) & 3
    main_src = r0 * D + u * 16, rope_src = rr * D + DV + ru * 16;
  }
  // FP8 round `it` (row r0 + R it) and rope copy k (row tid / 4 + ROPE_ROWS k): shared offset and row.
  __device__ __forceinline__ uint32_t main_at(int it) const { return main_off[it % PERIOD] + it / PERIOD * 1024; }
  __device__ __forceinline__ uint32_t rope_at(int k) const { return rope_off + k * ROPE_ROWS * 64; }
  __device__ __forceinline__ int main_row(int it) const { return (tid >> 5) + R * it; }
  __device__ __forceinline__ int rope_row(int k) const { return (tid >> 2) + ROPE_ROWS * k; }

  template <int SOFF, int GOFF>
  static __device__ __forceinline__ void copy(uint32_t dst, const uint8_t* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0+%2], [%1+%3], 16;\n" ::"r"(dst), "l"(src), "n"(SOFF),
                 "n"(GOFF));
  }
  template <int... IT>  // every FP8 round of a whole tile whose first row is `src`
  __device__ __forceinline__ void rounds(uint32_t dst, const uint8_t* src, std::integer_sequence<int, IT...>) const {
    (copy<IT / PERIOD * 1024, IT * R * D>(dst + main_off[IT % PERIOD], src + main_src), ...);
  }
  template <int... K>
  __device__ __forceinline__ void ropes(uint32_t dst, const uint8_t* src, std::integer_sequence<int, K...>) const {
    (copy<K * ROPE_ROWS * 64, K * ROPE_ROWS * D>(dst + rope_off, src + rope_src), ...);
  }
  template <int... IT>  // every MXFP4 copy of a whole tile (src: this thread's first unit)
  static __device__ __forceinline__ void mx_rounds(uint32_t dst, const uint8_t* src, std::integer_sequence<int, IT...>) {
    (copy<IT * NT * 16, IT * NT * 16>(dst, src), ...);
  }
  template <bool WHOLE_LINES = true>
  static __device__ __forceinline__ void copy_or_zero(uint32_t dst, const uint8_t* src, bool in) {
    if constexpr (WHOLE_LINES)
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0));
    else
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0));
  }
  // Tile i's rows each looked up in paged_rows (-1: past hi or a bad page). WHOLE_LINES: the pages' rows start on
  // 128-byte lines; where they do not (pages of one FP8 row), whole lines would fetch the neighbours' bytes too.
  template <bool WHOLE_LINES>
  __device__ __forceinline__ void gather(const DecodeCall& call, const PagedRows& paged_rows, uint32_t dst,
                                         int i) const {
    if constexpr (MX) {
#pragma unroll
      for (int it = 0; it < MX_COPIES; ++it) {
        const int c = tid + NT * it, row = paged_rows.at(i, c / MX_UNITS);
        copy_or_zero<WHOLE_LINES>(dst + c * 16,
                                  call.kv + static_cast<size_t>(max(row, 0)) * MX_ROW + (c % MX_UNITS) * 16, row >= 0);
      }
    } else {
#pragma unroll
      for (int it = 0; it < ROUNDS; ++it) {
        const int row = paged_rows.at(i, main_row(it));
        copy_or_zero<WHOLE_LINES>(dst + main_at(it), call.kv + static_cast<size_t>(max(row, 0)) * D + (tid & 31) * 16,
                                  row >= 0);
      }
#pragma unroll
      for (int k = 0; k < ROPE_COPIES; ++k) {
        const int row = paged_rows.at(i, rope_row(k));
        copy_or_zero<WHOLE_LINES>(dst + rope_at(k),
                                  call.kv + static_cast<size_t>(max(row, 0)) * D + DV + (tid & 3) * 16, row >= 0);
      }
    }
  }

  // Copies tile i (positions n0 = lo + 64 i ..) to shared dst. consecutive: its rows follow cache row `first`
  // (-1: a page outside the cache, nothing read), else gather() looks each up.
  __device__ __forceinline__ void tile(const DecodeCall& call, const PagedRows& paged_rows, bool consecutive,
                                       int first, uint32_t dst, int i, int lo, int hi) const {
    const int n0 = lo + i * BN;
    if (!consecutive) {
      if (call.page_size * (MX ? MX_ROW : D) % 128 == 0) gather<true>(call, paged_rows, dst, i);
      else gather<false>(call, paged_rows, dst, i);
    } else if constexpr (MX) {
      const uint8_t* src = call.kv + static_cast<size_t>(max(first, 0)) * MX_ROW + tid * 16;
      const int rows = first < 0 ? 0 : hi - n0;
      if (rows >= BN) {
        mx_rounds(dst + tid * 16, src, std::make_integer_sequence<int, MX_COPIES>{});
      } else {
#pragma unroll
        for (int it = 0; it < MX_COPIES; ++it) {
          const bool in = (tid + NT * it) / MX_UNITS < rows;
          copy_or_zero(dst + (tid + NT * it) * 16, in ? src + it * NT * 16 : call.kv, in);
        }
      }
    } else {
      const uint8_t* src = call.kv + static_cast<size_t>(max(first, 0)) * D;
      const int rows = first < 0 ? 0 : hi - n0;
      if (rows >= BN) {
        rounds(dst, src, std::make_integer_sequence<int, ROUNDS>{});
        ropes(dst, src, std::make_integer_sequence<int, ROPE_COPIES>{});
      } else {
#pragma unroll
        for (int it = 0; it < ROUNDS; ++it) {
          const bool in = main_row(it) < rows;
          copy_or_zero(dst + main_at(it), in ? src + main_src + it * R * D : call.kv, in);
        }
#pragma unroll
        for (int k = 0; k < ROPE_COPIES; ++k) {
          const bool in = rope_row(k) < rows;
          copy_or_zero(dst + rope_at(k), in ? src + rope_src + k * ROPE_ROWS * D : call.kv, in);
        }
      }
    }
  }
};

// A BF16 tile's copies by NT threads, 16 bytes each (72 a row): copy c = tid + NT it is unit u = c % 72 (dims 8u ..
// 8u + 7) of row c / 72, at block u / 8 of the tile in the 128-byte swizzle, so a warp reads 512 consecutive bytes of
// consecutive rows. consecutive: the tile's rows follow cache row `first` (-1: a page outside the cache, nothing
// read), else each is looked up in paged_rows; rows past hi are zero-filled, never read.
template <int NT>
__device__ __forceinline__ void bf16_tile(const DecodeCall& call, const PagedRows& paged_rows, bool consecutive,
                                          int first, uint32_t dst, int i, int lo, int hi, int tid) {
  constexpr int UNITS = BF_ROW / 16, COPIES = BN * UNITS / NT;
  static_assert(BN * UNITS % NT == 0, "whole rounds");
  const int rows = consecutive && first >= 0 ? hi - (lo + i * BN) : 0;
#pragma unroll 4
  for (int it = 0; it < COPIES; ++it) {
    const int c = tid + NT * it, r = c / UNITS, u = c - r * UNITS;
    const int row = consecutive ? (r < rows ? first + r : -1) : paged_rows.at(i, r);
    const uint32_t off = (u >> 3) * SW128_BLOCK + r * 128 + (((u & 7) ^ (r & 7)) << 4);
    CopyPlan<NT, false>::copy_or_zero(dst + off, call.kv + static_cast<size_t>(max(row, 0)) * BF_ROW + u * 16,
                                      row >= 0);
  }
}

// Q -> e4m3 with one scale per head (its amax maps to 448), in the [chunk][head][16] layout of the score product's B
// operand (QCHUNK = H * 16 bytes a chunk); the head's scale, sm_scale * log2(e) and the KV scale multiply the
// scores. BF: Q as it is, bf16 in the same chunks (8 dims each), sm_scale * log2(e) its scale. NW warps, warp w
// quantizing heads w, w + NW, ...; load() is issued before the first tiles' copies so that Q's loads do not queue
// behind them, store() after.
template <int H, int NW, bool BF = false>
struct QueryQuant {
  static constexpr int QPAIRS = D / 64;  // bf16 pairs per lane and head
  using Regs = __nv_bfloat162[H / NW][QPAIRS];

  // Rows from rows.live on (masked rows) are zeros.
  static __device__ __forceinline__ void load(Regs& qv, const DecodeCall& call, const QueryRows& rows, int warp,
                                              int lane) {
#pragma unroll
    for (int j = 0; j < H / NW; ++j) {
      const int h = warp + j * NW;
      const __nv_bfloat162* src = reinterpret_cast<const __nv_bfloat162*>(call.q + (rows.row0 + h) * D);
#pragma unroll
      for (int i = 0; i < QPAIRS; ++i) qv[j][i] = h < rows.live ? src[lane + 32 * i] : __nv_bfloat162{};
    }
  }
  static __device__ __forceinline__ void store(const Regs& qv, const DecodeCall& call, float kv_scale, uint8_t* qs,
                                               float* qscale, int warp, int lane) {
#pragma unroll
    for (int j = 0; j < H / NW; ++j) {
      const int h = warp + j * NW;
      if constexpr (BF) {
#pragma unroll
        for (int i = 0; i < QPAIRS; ++i) {
          const int d = 2 * (lane + 32 * i);
          *reinterpret_cast<__nv_bfloat162*>(qs + (d >> 3) * (H * 16) + h * 16 + (d & 7) * 2) = qv[j][i];
        }
        if (lane == 0) qscale[h] = call.qk_scale;
        continue;
      }
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
        *reinterpret_cast<uint16_t*>(qs + (d >> 4) * (H * 16) + h * 16 + (d & 15)) =
            to_e4m3x2(v[i].x * inv, v[i].y * inv);
      }
      if (lane == 0) qscale[h] = (amax > 0.f ? amax / 448.f : 1.f) * call.qk_scale * kv_scale;
    }
  }
};

// One piece of a unit's positions, in split_kernel's CTA: the output (one piece) or its partial (merged by the
// fixed splits' barrier here, by combine_kernel after a balanced grid).
template <int STAGES, int KV, int LAYOUT, int H, bool BALANCED>
__device__ __forceinline__ void decode_piece(const DecodeCall& call, const Piece& piece, uint8_t* smem) {
  static_assert(H == 16 || H == 32, "16 or 32 query rows a CTA");
  constexpr bool MX = KV == KV_MXFP4, BF = KV == KV_BF16;
  constexpr int OB = operand_bytes(KV), KTILE = BF ? BF_TILE : TILE;  // Q and P element bytes; a stage's tile
  static_assert(!(KV == KV_MXFP4 && LAYOUT == TILE_PAGES), "MXFP4 reads its block scales per row: ROW_PAGES");
  constexpr int QCHUNK = H * 16;  // Q and P: [16-byte chunk][H heads][16 bytes]
  constexpr int NE = H / 4;       // heads a thread (score columns; value product columns)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  uint8_t* ks = MX ? smem + TILE : smem;  // the stages (MX: after the dequantized tile)
  uint8_t* qs = smem + stage_bytes<STAGES, KV>();
  uint8_t* ps = qs + H * D * OB;
  float* red = reinterpret_cast<float*>(ps + H * BN * OB);
  float* qscale = red + NWARPS * H;
  int* const cut_of = reinterpret_cast<int*>(qscale + H);  // [H]: each row's row_cut
  const PagedRows paged_rows{cut_of + H, cut_of + H + ROW_SLOTS * BN};

  const QueryRows& rows = piece.rows;
  const int b = rows.b, unit = rows.unit;
  constexpr bool paged = LAYOUT != RAGGED, row_pages = LAYOUT == ROW_PAGES;  // the launcher picks the instance
  GuessedEntries<STAGES> guess = {-1, {}};  // before the length's load, which it must not wait for
  if constexpr (paged) guess = guess_entries<STAGES>(call, b, piece.lo, row_pages ? tid : 0);
  const SplitRange range = piece_range<BALANCED>(call, piece, rows.t);
  // Read with the length, not behind the first copies: Q's scale waits for it, a round trip after the L2 flush.
  const float kv_scale = MX || BF ? 1.f : *call.kv_scale;
  const unsigned base = BALANCED ? 0u : arrival_base(call.sync, unit, call.num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles, start = range.start;
  const bool valid = range.valid;
  // A tile's rows are consecutive in the cache (one address per tile) when ragged or in pages of a multiple of BN
  // rows; otherwise each copy looks its row up in paged_rows.
  const bool consecutive = !row_pages || call.page_size % BN == 0;
  // TILE_PAGES: tile i's first row from its page's table entry, which every thread reads itself (one address a
  // warp) a tile ahead of the copies that need it; an entry outside the cache is never followed (bad).
  const int* table_row = call.block_table + static_cast<size_t>(b) * call.max_pages;
  auto page_entry = [&](int i) { return i < ntiles ? __ldg(table_row + page_of(call, lo + i * BN)) : 0; };
  int bad = NO_BAD_PAGE;  // TILE_PAGES: the first position on a page outside the cache (every thread reads every entry)
  auto first_row = [&](int i, int entry) {
    const int n0 = lo + i * BN;
    if constexpr (LAYOUT == TILE_PAGES) {
      const int row = page_row(call, entry, n0);
      if (row < 0) bad = min(bad, n0);
      return row;
    } else {
      return paged ? paged_rows.at(i, 0) : start + n0;
    }
  };
  // TUNE: start

  const CopyPlan<NTHREADS, MX> copy(tid);
  const uint32_t ks_addr = smem_u32(ks);
  auto load_tile = [&](int i, int entry) {
    const int first = consecutive ? first_row(i, entry) : -1;
    if constexpr (BF) bf16_tile<NTHREADS>(call, paged_rows, consecutive, first, ks_addr + (i % STAGES) * BF_TILE, i,
                                          lo, hi, tid);
    else copy.tile(call, paged_rows, consecutive, first, ks_addr + (i % STAGES) * (MX ? MX_STAGE : TILE), i, lo, hi);
  };
  using Query = QueryQuant<H, NWARPS, BF>;
  typename Query::Regs qv;
  Query::load(qv, call, rows, warp, lane);
  // One cp.async group per tile (empty past the last); entry: TILE_PAGES' table entry of tile i.
  auto load_group = [&](int i, int entry) {
    if (i < ntiles) load_tile(i, entry);
    asm volatile("cp.async.commit_group;\n");
  };
  int entries[STAGES] = {};  // TILE_PAGES: tiles 0 .. STAGES - 1, all asked for before the first is used
  if constexpr (LAYOUT == TILE_PAGES) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) entries[i] = lo == guess.lo ? guess.e[i] : page_entry(i);
  }
  if (row_pages) paged_rows.first_tiles<STAGES>(call, b, lo, hi, tid, guess);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) load_group(i, entries[i]);
  int ahead = entries[STAGES - 1];  // TILE_PAGES: the entry of the tile the loop's next copies take
  // TUNE: issued
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
  Query::store(qv, call, kv_scale, qs, qscale, warp, lane);
  if (tid < H) cut_of[tid] = row_cut(call, rows, range, tid);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // TUNE: Q
  int heads[NE];
  thread_heads(heads, t4);
  // Rows may see fewer positions than hi (cut_of) only in tiles past cut_from: row 0's cut is the unit's largest.
  const int cut_from = hi - cut_of[0];
  const uint64_t pdesc = desc(smem_u32(ps), QCHUNK, 128, 0);
  const uint64_t qdesc = desc(smem_u32(qs), QCHUNK, 128, 0);
  // Fixed per thread: where its P bytes go (rows warp*16 + g and + 8) and where its ldmatrix rows start. BF: P in
  // chunks of 8 tile rows, in their order; V^T's fragments straight from ldmatrix.trans (matrix j = lane / 8 of a
  // k16 step: tile rows 8 (j / 2) .., the warp's dims 16 warp + 8 (j % 2) ..).
  const int k0 = BF ? warp * 16 + g : p_position(warp * 16 + g), k1 = BF ? k0 + 8 : p_position(warp * 16 + g + 8);
  uint8_t* const p0dst = BF ? ps + (k0 >> 3) * QCHUNK + (k0 & 7) * 2 : ps + (k0 >> 4) * QCHUNK + (k0 & 15);
  uint8_t* const p1dst = BF ? ps + (k1 >> 3) * QCHUNK + (k1 & 7) * 2 : ps + (k1 >> 4) * QCHUNK + (k1 & 15);
  const uint32_t voff[2] = {lane * 128u + ((warp ^ (lane & 7)) << 4), lane * 128u + (((4 + warp) ^ (lane & 7)) << 4)};
  const uint32_t bf_voff =
      ((lane & 7) + ((lane >> 4) << 3)) * 128u + (((2 * warp + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
  float qsc[NE];
#pragma unroll
  for (int e = 0; e < NE; ++e) qsc[e] = qscale[heads[e]];

  float m[NE], l[NE];
#pragma unroll
  for (int e = 0; e < NE; ++e) m[e] = -INFINITY, l[e] = 0.f;
  float acc[8][H / 2];  // O^T: [64-dim block][accumulator]: dims 64*mb + 16*warp + 2g (+1 for rows g + 8; BF: g, g + 8)
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int e = 0; e < H / 2; ++e) acc[mb][e] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // tile i is visible to the tensor cores; every warp is done with tile i - 1
    // TUNE: tile
    load_group(i + STAGES - 1, ahead);
    if constexpr (LAYOUT == TILE_PAGES) ahead = page_entry(i + STAGES);  // used by the next iteration's copies
    const int next_entry = row_pages ? paged_rows.fetch(call, b, lo, hi, i + STAGES, tid) : 0;  // put after the products
    uint32_t kt = ks_addr + (i % STAGES) * KTILE;
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

    // S^T (64 rows x H heads) = K (64 x 576) Q^T
    float s[H / 2];
    if constexpr (BF) score_tile_bf16<H>(s, kt, qdesc);
    else score_tile<H, MX>(s, kt, qdesc);
    // TUNE: scored

    // Online softmax over the tile, log2 domain; rows past hi (past hi - its cut for head e) are masked.
    const int past0 = n0 + warp * 16 + g - hi;  // < 0: tile row g is before hi
    const bool cut_tile = n0 + BN > cut_from;
    float mx[NE];
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;  // accumulator of head e at row g; a + 2 at row g + 8
      const int cut = cut_tile ? cut_of[heads[e]] : 0;
      s[a] = past0 + cut < 0 ? s[a] * qsc[e] : -INFINITY;
      s[a + 2] = past0 + 8 + cut < 0 ? s[a + 2] * qsc[e] : -INFINITY;
      mx[e] = fmaxf(s[a], s[a + 2]);
    }
    reduce_rows(mx, heads, red, warp, g, [](float x, float y) { return fmaxf(x, y); });
    // TUNE: maxed
    float alpha[NE];
    bool moved = false;
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const float mn = fmaxf(m[e], mx[e]);
      const float base = mn == -INFINITY ? 0.f : mn;
      alpha[e] = ex2(m[e] - base);
      m[e] = mn;
      const int a = (e & 1) + (e >> 1) * 4;
      const float p0 = ex2(s[a] - (base - P_BIAS)), p1 = ex2(s[a + 2] - (base - P_BIAS));
      l[e] = l[e] * alpha[e] + (p0 + p1);  // this thread's share; summed across the CTA at the end
      if constexpr (BF) {
        *reinterpret_cast<__nv_bfloat16*>(p0dst + heads[e] * 16) = __float2bfloat16_rn(p0);
        *reinterpret_cast<__nv_bfloat16*>(p1dst + heads[e] * 16) = __float2bfloat16_rn(p1);
      } else {
        p0dst[heads[e] * 16] = to_e4m3(p0);
        p1dst[heads[e] * 16] = to_e4m3(p1);
      }
      moved |= alpha[e] != 1.f;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    // Rescale only when a running max moved somewhere in the warp (rare after the first tiles).
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
#pragma unroll
        for (int e = 0; e < NE; ++e) {
          const int a = (e & 1) + (e >> 1) * 4;
          acc[mb][a] *= alpha[e];
          acc[mb][a + 2] *= alpha[e];
        }
      }
    }
    __syncthreads();  // P is complete
    // TUNE: P

    // O^T (512 dims x H heads) += V^T (512 x 64) P^T: A from registers (v_fragment). The fragments of MB m-blocks at a
    // time: all 8 at 16 rows; 4 at 32 rows, each group committed and the one before waited for, so that two groups' (32
    // registers) at most are live beside the 128 accumulators.
    // BF: k16 steps (tile rows 16 kk ..), m-block mb's dims in the tile's block mb.
    constexpr int MB = H == 16 ? 8 : 4, KSTEP = BF ? 16 : 32;
#pragma unroll
    for (int kk = 0; kk < BN / KSTEP; ++kk) {
#pragma unroll
      for (int mb0 = 0; mb0 < 8; mb0 += MB) {
        uint32_t a[MB][4];
#pragma unroll
        for (int j = 0; j < MB; ++j) {
          const int mb = mb0 + j;
          if constexpr (BF) ldsm_x4_trans(a[j], kt + mb * SW128_BLOCK + kk * 16 * 128 + bf_voff);
          else v_fragment(a[j], kt + (mb >> 1) * SW128_BLOCK + kk * 32 * 128 + voff[mb & 1]);
        }
#pragma unroll
        for (int j = 0; j < MB; ++j) fence_acc<H / 2>(acc[mb0 + j]);
        wg_fence();
        const uint64_t db = pdesc + ((2 * kk * QCHUNK) >> 4);
#pragma unroll
        for (int j = 0; j < MB; ++j) {
          if constexpr (BF) wgmma_rs_bf16<H>(acc[mb0 + j], a[j], db);
          else wgmma_rs<H, MX>(acc[mb0 + j], a[j], db);
        }
        if (MB < 8 && !(kk == BN / KSTEP - 1 && mb0 + MB == 8)) {  // the last group's wait is the one below
          wg_commit();
          wg_wait<1>();
        }
      }
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb) fence_acc<H / 2>(acc[mb]);
    if (row_pages) paged_rows.put(call, i + STAGES, tid, next_entry, lo, hi);  // read after the next iteration's barrier
    // TUNE: PV
  }
  asm volatile("cp.async.wait_group 0;\n");

  // TUNE: loop
  // Row sums across the warp's rows and the warps (every warp holds the same m).
  __syncthreads();  // every warp has read red in its last tile
  reduce_rows(l, heads, red, warp, g, [](float x, float y) { return x + y; });
  float scale[NE];  // kv_scale / the sum (no rows: zeros)
#pragma unroll
  for (int e = 0; e < NE; ++e) scale[e] = l[e] > 0.f ? __fdividef(kv_scale, l[e]) : 0.f;
  // The first position on a page outside the cache (rows: written before the loop's last barrier); row e is ok where
  // it sees none.
  const int bad_page = row_pages ? *paged_rows.bad : bad;
  const bool ok = row_ok(valid, bad_page, hi);  // every row
  const bool direct = piece.count == 1;  // else a partial, merged below
  if (tid < 32 && g == 0) {  // first: not queued behind the partial's stores. l carries 2^8
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      store_lse<H>(call, rows, piece.count, piece.part, heads[e], l[e] > 0.f ? m[e] + __log2f(l[e]) - P_BIAS : -INFINITY,
                   row_ok(valid, bad_page, hi, cut_of[heads[e]]));
    }
  }
  // The output (or partial) goes through shared memory (the stages are free: no copies or products pending) so
  // that each warp store writes whole 128-byte lines; from the fragments, each store wrote four 64-byte pieces and
  // the 32 stores took ~1500 cycles per CTA (16 rows). Rows padded by 4 floats: the fragments' float2 writes take 2
  // wavefronts. 32 rows take 66 KB: more than a tile, within the 2 stages (or the MXFP4 tiles) before Q.
  constexpr int OUT_ROW = DV + 4;
  static_assert(H * OUT_ROW * 4 <= stage_bytes<STAGES, KV>(), "the staged output fits the stages' bytes");
  float* staged = reinterpret_cast<float*>(smem);
  // Accumulator rows g and g + 8 of the warp's 16: dims 2g and 2g + 1 (the FP8 fragments' order), BF: g and g + 8.
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int dim = 64 * mb + 16 * warp + (BF ? g : 2 * g);
#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;
      float* row = staged + heads[e] * OUT_ROW + dim;
      if constexpr (BF) {
        row[0] = acc[mb][a] * scale[e];
        row[8] = acc[mb][a + 2] * scale[e];
      } else {
        *reinterpret_cast<float2*>(row) = make_float2(acc[mb][a] * scale[e], acc[mb][a + 2] * scale[e]);
      }
    }
  }
  __syncthreads();
  // TUNE: staged
  const int col = 4 * tid;
  const int stored = direct ? rows.live : H;  // a partial keeps every row (its slot is the unit's)
#pragma unroll 4
  for (int h = 0; h < stored; ++h) {
    float4 v = *reinterpret_cast<const float4*>(staged + h * OUT_ROW + col);
    if (direct && !ok && !row_ok(valid, bad_page, hi, cut_of[h])) v = make_float4(NAN, NAN, NAN, NAN);
    __nv_bfloat16* dst = direct ? call.out + rows.row0 * DV : call.part_o + piece.part * H * DV;
    store_bf16x4(dst + h * DV + col, v);
  }
  // TUNE: partial
  if (!BALANCED && !direct) merge_splits<H>(call, base, rows, piece.index, valid);
  // TUNE: merged
}

// H: the CTA's query rows (a unit, QueryRows), 16 or 32, the N side of both products. BALANCED: the grid is
// the balanced schedule's (groups, parts), each CTA walking its part's pieces (for_each_piece); else fixed splits.
template <int STAGES, int KV, int LAYOUT, int H, bool BALANCED>
__global__ void __launch_bounds__(NTHREADS, CTAS_PER_SM)
split_kernel(const DecodeCall call) {
  extern __shared__ __align__(1024) uint8_t smem[];
  // TUNE: entry
  if constexpr (BALANCED)
    for_each_piece<H>(call, [&](const Piece& piece) { decode_piece<STAGES, KV, LAYOUT, H, true>(call, piece, smem); });
  else
    decode_piece<STAGES, KV, LAYOUT, H, false>(call, split_piece_of<H>(call), smem);
}

}  // namespace mla
