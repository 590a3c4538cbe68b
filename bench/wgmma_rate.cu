// The tensor rate of wgmma with both operands in shared memory (SS), by N and warpgroups a CTA: the question a
// 64-row BF16 unit raises (docs/2026-12-07-gluon-bf16-and-precise-q.md, section 3): whether m64n32k16 bf16 runs at
// the rate m64n64k16 does, or is held back by shared-memory reads (2 KB of A for every 64 x N x 16 product).
//     nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_rate bench/wgmma_rate.cu
//     /tmp/wgmma_rate      # one line a case: dtype, N, warpgroups a CTA, TFLOPS (one CTA an SM, every SM)
// Operands are zeros in 128-byte-swizzled K-major tiles, as the kernels lay them out; only the rate is measured.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int KSTEPS = 4;  // products a group: one 128-byte swizzle row of K (64 bf16 or 128 e4m3), 32 bytes a step
constexpr int ITERS = 8192;

__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {  // K-major, 128-byte swizzle, 8-row groups 1 KB apart
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

#define ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                "+f"(d[i + 6]), "+f"(d[i + 7])

// D (64 x N) += A (64 x K) B (K x N), K = 16 (bf16) or 32 (e4m3), both from shared memory.
template <int N, bool FP8>
__device__ __forceinline__ void wgmma(float* d, uint64_t da, uint64_t db) {
#define SHAPE(n, k, T) "wgmma.mma_async.sync.aligned.m64n" #n "k" #k ".f32." T "." T " "
#define BF16_ARGS ", 1, 1, 0, 0;\n"
#define FP8_ARGS ", 1, 1;\n"
  if constexpr (N == 32 && !FP8)
    asm volatile(SHAPE(32, 16, "bf16") "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, 1" BF16_ARGS
                 : ACC8(0), ACC8(8) : "l"(da), "l"(db));
  else if constexpr (N == 32)
    asm volatile(SHAPE(32, 32, "e4m3") "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, 1" FP8_ARGS
                 : ACC8(0), ACC8(8) : "l"(da), "l"(db));
  else if constexpr (N == 64 && !FP8)
    asm volatile(SHAPE(64, 16, "bf16")
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
                 "%27,%28,%29,%30,%31}, %32, %33, 1" BF16_ARGS
                 : ACC8(0), ACC8(8), ACC8(16), ACC8(24) : "l"(da), "l"(db));
  else
    asm volatile(SHAPE(64, 32, "e4m3")
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
                 "%27,%28,%29,%30,%31}, %32, %33, 1" FP8_ARGS
                 : ACC8(0), ACC8(8), ACC8(16), ACC8(24) : "l"(da), "l"(db));
#undef SHAPE
#undef BF16_ARGS
#undef FP8_ARGS
}

// Each warpgroup: its own A (64 rows) and B (N rows) tile, KSTEPS products a group, a group in flight while the next
// is issued.
template <int N, bool FP8>
__global__ void rate_kernel(float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int wg = threadIdx.x / 128;
  uint8_t* a = smem + wg * (64 + N) * 128;
  for (int i = threadIdx.x % 128; i < (64 + N) * 128 / 16; i += 128) reinterpret_cast<uint4*>(a)[i] = uint4{};
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(a));
  const uint64_t da = sw128_desc(base), db = sw128_desc(base + 64 * 128);
  float d[N / 2] = {};
  for (int it = 0; it < ITERS; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) wgmma<N, FP8>(d, da + 2 * k, db + 2 * k);  // 32 bytes of K a step
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if (s != 0.f) sink[0] = s;  // never: the operands are zeros; keeps the products
}

template <int N, bool FP8>
void run(int warpgroups, int sms, float* sink) {
  const int smem = warpgroups * (64 + N) * 128 + 1024;
  cudaFuncSetAttribute(rate_kernel<N, FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t start, stop;
  cudaEventCreate(&start), cudaEventCreate(&stop);
  rate_kernel<N, FP8><<<sms, 128 * warpgroups, smem>>>(sink);  // warm-up
  cudaEventRecord(start);
  rate_kernel<N, FP8><<<sms, 128 * warpgroups, smem>>>(sink);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  const double k = FP8 ? 32 : 16, flops = 2.0 * sms * warpgroups * ITERS * KSTEPS * 64.0 * N * k;
  printf("%s N=%d warpgroups=%d: %.0f TFLOPS (%s)\n", FP8 ? "e4m3" : "bf16", N, warpgroups, flops / ms / 1e9,
         cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  cudaMalloc(&sink, sizeof(float));
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<32, false>(wgs, sms, sink);
    run<64, false>(wgs, sms, sink);
    run<32, true>(wgs, sms, sink);
    run<64, true>(wgs, sms, sink);
  }
  return 0;
}
