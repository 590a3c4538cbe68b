// Shared by both kernels: the problem's constants, shared-memory helpers and the rows of a split.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace mla {

constexpr int H = 16;                  // query heads
constexpr int D = 576;                 // key width = bytes per FP8 row
constexpr int DV = 512;                // value width
constexpr int BN = 64;                 // KV rows per tile

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

// The rows [lo, hi) of the cache that split `split` of sequence b attends to: splits of whole 64-row tiles,
// ntiles of them. An invalid kv_indptr range reads nothing (valid = false; its output rows become NaN).
struct SplitRange {
  int lo, hi, ntiles;
  bool valid;
};

__device__ __forceinline__ SplitRange split_range(const int* kv_indptr, int b, int split, int num_splits,
                                                  int total_kv) {
  int start = kv_indptr[b], end = kv_indptr[b + 1];
  const bool valid = start >= 0 && end >= start && end <= total_kv;
  if (!valid) start = end = 0;
  const int per_split = ((end - start + num_splits - 1) / num_splits + BN - 1) / BN * BN;
  const int lo = start + split * per_split;
  const int hi = min(lo + per_split, end);
  return {lo, hi, hi > lo ? (hi - lo + BN - 1) / BN : 0, valid};
}

}  // namespace mla
