// Shared by both kernels: the problem's constants, shared-memory helpers and the rows of a split.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace mla {

constexpr int H = 16;                  // query heads
constexpr int D = 576;                 // key width = bytes per FP8 row
constexpr int DV = 512;                // value width
constexpr int BN = 64;                 // KV rows per tile

// One call's arguments, the one list from the Python launcher to the kernels: mla_decode_cuda.DecodeCall is a ctypes
// Structure of the same fields in the same order (mla_decode_call_layout lets it check the layout), a plan sets its
// own fields once and a call its inputs', mla_decode gets its address, and the split kernels take it by value.
// q (batch, 16, 576) bf16; kv: kv_format 0, the FP8 cache (total_kv, 576) e4m3 with kv_scale (1,) fp32; 1, the
// MXFP4 codes (total_kv, 288) with kv_block_scales, E8M0 bytes, row r's 18 at r * scale_stride; kv_indptr (batch +
// 1,) int32; out (batch, 16, 512) bf16; part_o (batch * num_splits, 16, 512) bf16, part_lse (batch * num_splits,
// 16) fp32 and sync (batch,) uint32: the splits' partials and barrier (unused with one split); stream: the
// cudaStream_t to launch on; qk_scale = sm_scale * log2(e).
struct DecodeCall {
  const __nv_bfloat16* q;
  const uint8_t* kv;
  const float* kv_scale;
  const uint8_t* kv_block_scales;
  const int* kv_indptr;
  __nv_bfloat16* out;
  __nv_bfloat16* part_o;
  float* part_lse;
  unsigned* sync;
  void* stream;
  int scale_stride, kv_format, batch, total_kv, num_splits;
  float qk_scale;
};

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
