// The cuda backend's kernel library: mla_decode.cuda builds it with nvcc at first use and calls it through ctypes.
// common.cuh: the problem's constants, helpers and the rows of a split; merge.cuh: the splits' barrier and merge;
// wgmma.cuh: the Hopper kernel (MLA_WGMMA, sm_90a), wgmma64.cuh its 64-row units; mma_sync.cuh: the kernel for sm_80
// and later; here: the C ABI and the launcher. `// TUNE: name` lines mark bench/tune_cuda.py's timeline and phase
// stamps.
//
// Two split kernels with one interface: with MLA_WGMMA (built for sm_90a) warpgroup MMAs on FP8 operands, else mma.sync
// in fp16 (sm_80 and later). The merge of the splits and the launcher are shared.
// split_kernel<STAGES, MX, LAYOUT[, H]>(DecodeCall) (LAYOUT: common.cuh's Layout; the mma.sync kernel's is a bool,
// PAGED): grid (num_splits, units) of CTAs of NTHREADS threads (a unit: the call's unit_rows query rows of a
// sequence, 16, or 32 in the wgmma kernel (its H), or 64 in split_kernel64<BF, PAGED, BAL> (WIDE_THREADS threads, FP8
// or BF16, the cache's TMA maps as a second argument; with one split its grid is at most one CTA an SM, each walking
// units in turn); common.cuh's QueryRows), the call's fields as common.cuh's DecodeCall states them.
// num_splits == 1: each CTA writes its rows of out. Otherwise each writes part_o (units * num_splits, unit_rows, 512)
// bf16, its normalised partial output, and part_lse (units * num_splits, unit_rows) fp32, their log2-sum-exp; the CTAs
// of a unit meet at a barrier (`sync`: per unit a count of arrivals over all launches, zero before the first) and each
// merges 1 / num_splits of the unit's outputs. The grid is launched cooperatively, so all its CTAs are resident and
// the wait cannot hang. With the balanced schedule (schedule.cuh) the grid is (groups, parts): each CTA walks its
// part's pieces, and combine_kernel (merge.cuh) merges the sequences of several pieces after it.

#if MLA_WGMMA
#include <cudaTypedefs.h>

#include <cstddef>
#include "wgmma64.cuh"
#else
#include "mma_sync.cuh"
#endif
#include "schedule.cuh"

using mla::DecodeCall;

// Split kernel CTAs of units of unit_rows that fit on one SM (the split heuristic's unit of parallelism; 64-row
// units: one, of 256 threads); whether this build reads the MXFP4 cache, and the most query rows its units take
// (DecodeCall's unit_rows: 16, or also 32 and, FP8 and BF16, 64).
#if MLA_WGMMA
extern "C" int mla_unit_ctas_per_sm(int unit_rows) {
  return unit_rows == mla::WIDE_ROWS ? mla::WIDE_CTAS_PER_SM : mla::CTAS_PER_SM;
}
#else
extern "C" int mla_unit_ctas_per_sm(int) { return mla::CTAS_PER_SM; }
#endif
extern "C" int mla_supports_mxfp4() { return mla::SUPPORTS_MXFP4 ? 1 : 0; }
extern "C" int mla_supports_bf16() { return mla::SUPPORTS_BF16 ? 1 : 0; }
// The BF16 kernel's CTAs per SM (its two 72 KB stages leave room for one): the plan's split count and shares.
#if MLA_WGMMA
extern "C" int mla_bf16_ctas_per_sm() { return 1; }
#else
extern "C" int mla_bf16_ctas_per_sm() { return 0; }
#endif
extern "C" int mla_max_unit_rows() { return mla::MAX_UNIT_ROWS; }

// A limit below the GPU's shared memory per block, for tests: the mma.sync kernel then runs with the stages that
// GPUs with less shared memory get (0: none). Returns the stages it will run with on the current device (0 in the
// wgmma build, which has one configuration per grid: Hopper has 227 KB per block).
#if MLA_WGMMA
extern "C" int mla_limit_shared_memory(int) { return 0; }
#else
static int smem_limit_for_tests = 0;
// As many stages as fit the shared memory per block (or the limit for tests): 4 (169 KB) on sm_90 and sm_100, 3 on
// sm_80 (163 KB), 2 on sm_86, sm_89 and sm_120 (99 KB).
static int mma_sync_stages(int smem_per_block) {
  const int limit = smem_limit_for_tests ? min(smem_limit_for_tests, smem_per_block) : smem_per_block;
  return limit >= mla::smem_bytes<4, mla::KV_FP8>() ? 4 : limit >= mla::smem_bytes<3, mla::KV_FP8>() ? 3 : 2;
}
extern "C" int mla_limit_shared_memory(int bytes) {
  smem_limit_for_tests = bytes;
  int dev = 0, smem_per_block = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return mma_sync_stages(smem_per_block);
}
#endif

// The 64-row kernel's CTAs with one split: one an SM, each walking units blockIdx.y, + gridDim.y, ... (at most
// WIDE_MAX_ITEMS), so that a unit's first copies overlap the last unit's output; fewer for tests (0: no limit).
#if MLA_WGMMA
static int wide_ctas_for_tests = 0;
extern "C" void mla_limit_wide_ctas(int ctas) { wide_ctas_for_tests = ctas; }
static int wide_ctas(int units, int sms) {
  const int limit = wide_ctas_for_tests > 0 ? wide_ctas_for_tests : sms * mla::WIDE_CTAS_PER_SM;
  const int fewest = (units + mla::WIDE_MAX_ITEMS - 1) / mla::WIDE_MAX_ITEMS;
  return units < limit ? units : limit > fewest ? limit : fewest;
}

// The 64-row kernel's TMA maps of the FP8 or the BF16 cache (wgmma64.cuh's WideMaps), encoded on the host for each
// launch (a graph keeps the launch's). cuTensorMapEncodeTiled comes from the driver through the runtime: no libcuda
// link.
static cudaError_t kv_maps(const DecodeCall& a, mla::WideMaps& maps) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
#else  // CUDA 12.0-12.4
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
  }();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t rows = a.total_kv > 0 ? a.total_kv : 1;
  void* kv = const_cast<uint8_t*>(a.kv);
  const cuuint32_t steps[3] = {1, 1, 1};
  if (a.kv_format == mla::KV_BF16) {  // (128 bytes, rows, 9 chunks of a row): boxes of 4 chunks (main) and 1 (rope)
    const cuuint64_t dims[3] = {128, rows, mla::BF_ROW / 128}, strides[2] = {mla::BF_ROW, 128};
    CUresult r = CUDA_SUCCESS;
    for (const cuuint32_t chunks : {4u, 1u}) {
      const cuuint32_t box[3] = {128, mla::BN, chunks};
      const CUresult e = encode(chunks == 4 ? &maps.main : &maps.rope, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, kv, dims,
                                strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      if (e != CUDA_SUCCESS) r = e;
    }
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
  }
  // main: (128 bytes, rows, 4 chunks of a row), boxes of all 4 chunks of 64 rows; rope: (576 bytes, rows), boxes of
  // 64 bytes (from 512) of 64 rows.
  const cuuint64_t main_dims[3] = {128, rows, 4}, main_strides[2] = {mla::D, 128};
  const cuuint64_t rope_dims[2] = {mla::D, rows}, rope_strides[1] = {mla::D};
  const cuuint32_t main_box[3] = {128, mla::BN, 4}, rope_box[2] = {mla::D - mla::DV, mla::BN};
  const CUresult r1 = encode(&maps.main, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, kv, main_dims, main_strides, main_box,
                             steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  const CUresult r2 = encode(&maps.rope, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, kv, rope_dims, rope_strides, rope_box,
                             steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r1 == CUDA_SUCCESS && r2 == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}
#else
extern "C" void mla_limit_wide_ctas(int) {}
static int wide_ctas(int units, int) { return units; }
#endif

// With more than one split the launch is cooperative: the merge's wait needs every CTA of the grid resident (the split
// plan keeps the grid within the CTAs that fit at once; a grid that cannot fit fails to launch, never hangs). The KV
// cache, read once per launch, is marked streaming in L2 for the launch (an access policy window over its first
// max_window bytes; none where the device has no windows): its lines are evicted before others, which helps where the
// cache and the split partials written after it overflow L2 (docs/design-notes.md, "The kernels' measured choices").
// BAL: the balanced schedule's grid (groups, parts), launched plainly: no CTA waits for another.
template <int STAGES, int KV, int LAYOUT, int H, bool BAL>
static cudaError_t launch_split(int dev, const DecodeCall& a, int max_window, int sms) {
  constexpr bool PAGED = LAYOUT != mla::RAGGED;
#if MLA_WGMMA
  constexpr bool wide = H == mla::WIDE_ROWS, bf = KV == mla::KV_BF16;
  static_assert(!wide || (STAGES == mla::wide_stages<bf>() && KV != mla::KV_MXFP4),
                "64-row units: FP8 in 4 stages or BF16 in 2");
  const auto kernel = [] {
    if constexpr (wide) return mla::split_kernel64<bf, PAGED, BAL>;
    else return mla::split_kernel<STAGES, KV, LAYOUT, H, BAL>;
  }();
  constexpr int smem = wide ? mla::wide_smem_bytes<bf>() : mla::smem_bytes<STAGES, KV, H>();
  constexpr int threads = wide ? mla::WIDE_THREADS : mla::NTHREADS;
#else
  constexpr bool wide = false;
  constexpr int threads = mla::NTHREADS;
  static_assert(H == mla::H, "the mma.sync kernel's units are 16 rows");
  const auto kernel = mla::split_kernel<STAGES, KV, PAGED, BAL>;
  constexpr int smem = mla::smem_bytes<STAGES, KV>();
#endif
  static thread_local unsigned configured = 0;  // devices whose dynamic shared-memory limit was raised
  if (!(configured & (1u << dev))) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    configured |= 1u << dev;
  }
  cudaLaunchConfig_t cfg = {};
  const int groups = mla::unit_groups(a, H), units = a.batch * groups;
  if constexpr (BAL) cfg.gridDim = dim3(groups, a.parts);
  else cfg.gridDim = dim3(a.num_splits, wide && a.num_splits == 1 ? wide_ctas(units, sms) : units);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(a.stream);
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (max_window > 0) {
    constexpr int row_bytes = KV == mla::KV_MXFP4 ? mla::D / 2 : KV == mla::KV_BF16 ? 2 * mla::D : mla::D;
    const size_t kv_bytes = static_cast<size_t>(a.total_kv) * row_bytes;
    attrs[n].id = cudaLaunchAttributeAccessPolicyWindow;
    cudaAccessPolicyWindow& window = attrs[n++].val.accessPolicyWindow;
    window.base_ptr = const_cast<uint8_t*>(a.kv);
    window.num_bytes = kv_bytes < static_cast<size_t>(max_window) ? kv_bytes : static_cast<size_t>(max_window);
    window.hitRatio = 1.f;
    window.hitProp = cudaAccessPropertyStreaming;
    window.missProp = cudaAccessPropertyStreaming;
  }
  if (!BAL && a.num_splits > 1) {
    attrs[n].id = cudaLaunchAttributeCooperative;
    attrs[n++].val.cooperative = 1;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
#if MLA_WGMMA
  if constexpr (wide) {
    mla::WideMaps maps;
    const cudaError_t e = kv_maps(a, maps);
    return e == cudaSuccess ? cudaLaunchKernelEx(&cfg, kernel, a, maps) : e;
  } else
#endif
  return cudaLaunchKernelEx(&cfg, kernel, a);
}

// The instance of a configuration for the call's layout (common.cuh's Layout: the wgmma kernel's FP8 pages of a
// multiple of BN rows read their tiles' table entries per thread) and rows per unit.
template <int STAGES, int KV, int H, bool BAL>
static cudaError_t launch_rows(int dev, const DecodeCall& a, int max_window, int sms) {
  using namespace mla;
  if (!a.page_size) return launch_split<STAGES, KV, RAGGED, H, BAL>(dev, a, max_window, sms);
#if MLA_WGMMA
  if constexpr (KV != KV_MXFP4) {
    if (a.page_size % BN == 0) return launch_split<STAGES, KV, TILE_PAGES, H, BAL>(dev, a, max_window, sms);
  }
#endif
  return launch_split<STAGES, KV, ROW_PAGES, H, BAL>(dev, a, max_window, sms);
}

template <int STAGES, int KV, int H>
static cudaError_t launch_schedule(int dev, const DecodeCall& a, int max_window, int sms) {
  return a.schedule == mla::FIXED_SPLITS ? launch_rows<STAGES, KV, H, false>(dev, a, max_window, sms)
                                         : launch_rows<STAGES, KV, H, true>(dev, a, max_window, sms);
}

template <int STAGES, int KV>
static cudaError_t launch_layout(int dev, const DecodeCall& a, int max_window, int sms) {
#if MLA_WGMMA
  if (a.unit_rows == 32) return launch_schedule<STAGES, KV, 32>(dev, a, max_window, sms);
#endif
  return launch_schedule<STAGES, KV, 16>(dev, a, max_window, sms);
}

#if MLA_WGMMA
// The 64-row kernel's configuration of a format (FP8 in 4 stages, BF16 in 2; one CTA an SM), ragged or paged.
template <int KV>
static cudaError_t launch_wide(int dev, const DecodeCall& a, int max_window, int sms) {
  constexpr int ROWS = mla::WIDE_ROWS, STAGES = mla::wide_stages<KV == mla::KV_BF16>();
  if (a.schedule != mla::FIXED_SPLITS)
    return a.page_size ? launch_split<STAGES, KV, mla::ROW_PAGES, ROWS, true>(dev, a, max_window, sms)
                       : launch_split<STAGES, KV, mla::RAGGED, ROWS, true>(dev, a, max_window, sms);
  return a.page_size ? launch_split<STAGES, KV, mla::ROW_PAGES, ROWS, false>(dev, a, max_window, sms)
                     : launch_split<STAGES, KV, mla::RAGGED, ROWS, false>(dev, a, max_window, sms);
}
#endif

// DecodeCall's layout for the ctypes side to check: offsets[i] = the byte offset of field i (in declaration order),
// offsets[DECODE_CALL_FIELDS] = its size.
constexpr int DECODE_CALL_FIELDS = 34;
extern "C" int mla_decode_call_fields() { return DECODE_CALL_FIELDS; }
extern "C" void mla_decode_call_layout(int* offsets) {
  const size_t layout[DECODE_CALL_FIELDS + 1] = {
      offsetof(DecodeCall, q), offsetof(DecodeCall, kv), offsetof(DecodeCall, kv_scale),
      offsetof(DecodeCall, kv_block_scales), offsetof(DecodeCall, seqs), offsetof(DecodeCall, block_table),
      offsetof(DecodeCall, out), offsetof(DecodeCall, lse), offsetof(DecodeCall, part_o),
      offsetof(DecodeCall, part_lse), offsetof(DecodeCall, sync), offsetof(DecodeCall, stream),
      offsetof(DecodeCall, scale_stride), offsetof(DecodeCall, kv_format), offsetof(DecodeCall, batch),
      offsetof(DecodeCall, total_kv), offsetof(DecodeCall, num_splits), offsetof(DecodeCall, page_size),
      offsetof(DecodeCall, max_pages), offsetof(DecodeCall, num_heads), offsetof(DecodeCall, q_len),
      offsetof(DecodeCall, causal), offsetof(DecodeCall, qk_scale), offsetof(DecodeCall, unit_rows),
      offsetof(DecodeCall, page_mul), offsetof(DecodeCall, page_shift), offsetof(DecodeCall, guess_rows),
      offsetof(DecodeCall, items), offsetof(DecodeCall, schedule), offsetof(DecodeCall, parts),
      offsetof(DecodeCall, max_items), offsetof(DecodeCall, min_share), offsetof(DecodeCall, cut),
      offsetof(DecodeCall, slack), sizeof(DecodeCall)};
  for (int i = 0; i <= DECODE_CALL_FIELDS; ++i) offsets[i] = static_cast<int>(layout[i]);
}

// page_of's multiply and shift are pos / page_size for every pos below 2^31 when page_mul * page_size exceeds
// 2^page_shift by less than page_size, and page_size <= 2^(page_shift - 31) (mla_decode.cuda.plan.page_divisor).
static bool page_divisor_exact(const DecodeCall& c) {
  if (c.page_shift < 31 || c.page_shift > 62) return false;
  const unsigned long long size = static_cast<unsigned>(c.page_size), power = 1ull << c.page_shift;
  const unsigned long long product = static_cast<unsigned long long>(c.page_mul) * size;
  return product >= power && product - power < size && size <= 1ull << (c.page_shift - 31);
}

// The balanced schedule's arguments: its items, at most MAX_PIECES parts, max_items = parts + batch, one split.
static bool schedule_ok(const DecodeCall& c) {
  if (c.schedule == mla::FIXED_SPLITS) return true;
  return (c.schedule == mla::SCHEDULE_IN_CALL || c.schedule == mla::SCHEDULE_GIVEN) && c.items && c.parts >= 1 &&
         c.parts <= mla::MAX_PIECES && c.max_items == c.parts + c.batch && c.num_splits == 1 && c.min_share >= 1 &&
         (c.cut == mla::LINE_CUT || c.cut == mla::FILL_CUT ||
          (c.cut == mla::PACK_CUT && c.batch <= mla::PACK_MAX_BATCH)) && c.slack >= 0;
}

// The balanced grid's merge (merge.cuh's combine_kernel) on c.stream, in units of the call's rows.
static cudaError_t launch_combine(const DecodeCall& c) {
  const int groups = mla::unit_groups(c, c.unit_rows);
  const dim3 grid(c.parts, groups, c.unit_rows / mla::COMBINE_WARPS), block(mla::COMBINE_WARPS * 32);
  const cudaStream_t stream = static_cast<cudaStream_t>(c.stream);
  switch (c.unit_rows) {
#if MLA_WGMMA
    case 64: mla::combine_kernel<64><<<grid, block, 0, stream>>>(c); break;
    case 32: mla::combine_kernel<32><<<grid, block, 0, stream>>>(c); break;
#endif
    default: mla::combine_kernel<16><<<grid, block, 0, stream>>>(c);
  }
  return cudaGetLastError();
}

// The balanced schedule's kernel of the call's cut (schedule.cuh) on c.stream.
static cudaError_t launch_schedule_kernel(const DecodeCall& c) {
  const cudaStream_t stream = static_cast<cudaStream_t>(c.stream);
  if (c.cut == mla::FILL_CUT)
    mla::fill_schedule_kernel<<<1, mla::SCHEDULE_THREADS, 0, stream>>>(c);
  else if (c.cut == mla::PACK_CUT)
    mla::pack_schedule_kernel<<<1, mla::SCHEDULE_THREADS, 0, stream>>>(c);
  else
    mla::schedule_kernel<<<1, mla::SCHEDULE_THREADS, 0, stream>>>(c);
  return cudaGetLastError();
}

// A failed launch's error, returned to the caller and cleared from the runtime's last error, which the next call's
// cudaGetLastError would otherwise report as its own (a cooperative grid too large, say, is not sticky).
static int reported(cudaError_t e) {
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

// Launches the schedule kernel alone on c->stream: c->items from c->seqs (schedule.cuh), for calls with
// SCHEDULE_GIVEN. Returns a cudaError_t.
extern "C" int mla_schedule(const DecodeCall* c) {
  if (c->schedule == mla::FIXED_SPLITS || !schedule_ok(*c) || c->batch < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  return reported(launch_schedule_kernel(*c));
}

// Launches the split kernel (which merges fixed splits itself) on c->stream, after the schedule kernel where the call
// makes its schedule (SCHEDULE_IN_CALL) and before the balanced schedule's combine_kernel.
// C ABI (loaded with ctypes: no torch headers, seconds to build). Returns a cudaError_t.
extern "C" int mla_decode(const DecodeCall* c) {
  static thread_local int sms[32] = {}, smem_per_block[32] = {}, max_window[32] = {};  // per device
  int dev = 0;
  cudaGetDevice(&dev);
  const int num_splits = c->num_splits, kv_format = c->kv_format;
  const int rows = c->unit_rows;  // 16, or 32 and 64 (FP8, BF16) where the build takes them; units of a sequence's rows
  const bool rows_ok = (rows == 16 || rows == 32 || rows == 64) && rows <= mla::MAX_UNIT_ROWS &&
                       !(rows == 64 && kv_format == mla::KV_MXFP4) && c->num_heads > 0 &&
                       c->q_len > 0;
  const bool splits_ok = num_splits >= 1 && num_splits <= mla::MAX_SPLITS && (num_splits & (num_splits - 1)) == 0;
  const bool pages_ok = c->page_size == 0 || (c->page_size > 0 && c->max_pages >= 0 && c->block_table &&
                                               page_divisor_exact(*c) && c->guess_rows >= 0);
  const bool format_ok = kv_format == mla::KV_FP8 || (kv_format == mla::KV_MXFP4 && mla::SUPPORTS_MXFP4) ||
                         (kv_format == mla::KV_BF16 && mla::SUPPORTS_BF16);
  if (dev >= 32 || !splits_ok || !pages_ok || !rows_ok || !schedule_ok(*c) || !format_ok)
    return static_cast<int>(cudaErrorInvalidValue);
  if (sms[dev] == 0) {
    cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&smem_per_block[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaDeviceGetAttribute(&max_window[dev], cudaDevAttrMaxAccessPolicyWindowSize, dev);
  }
  if (c->schedule == mla::SCHEDULE_IN_CALL) {
    const cudaError_t e = launch_schedule_kernel(*c);
    if (e != cudaSuccess) return reported(e);
  }
  cudaError_t e;
#if MLA_WGMMA
  const int groups = mla::unit_groups(*c, rows);
  // CTAs of the grid: with more than the SMs, two share an SM (fewer stages each)
  const int ctas = c->schedule == mla::FIXED_SPLITS ? c->batch * groups * num_splits : c->parts * groups;
  if (rows == mla::WIDE_ROWS)
    e = kv_format == mla::KV_BF16 ? launch_wide<mla::KV_BF16>(dev, *c, max_window[dev], sms[dev])
                                  : launch_wide<mla::KV_FP8>(dev, *c, max_window[dev], sms[dev]);
  else if (kv_format == mla::KV_MXFP4)
    e = launch_layout<mla::MX_STAGES, mla::KV_MXFP4>(dev, *c, max_window[dev], sms[dev]);
  else if (kv_format == mla::KV_BF16)
    e = launch_layout<mla::BF_STAGES, mla::KV_BF16>(dev, *c, max_window[dev], sms[dev]);
  else if (ctas > sms[dev])
    e = launch_layout<mla::STAGES_SHARED, mla::KV_FP8>(dev, *c, max_window[dev], sms[dev]);
  else
    e = launch_layout<mla::STAGES_ALONE, mla::KV_FP8>(dev, *c, max_window[dev], sms[dev]);
#else
  switch (mma_sync_stages(smem_per_block[dev])) {
    case 4: e = launch_layout<4, mla::KV_FP8>(dev, *c, max_window[dev], sms[dev]); break;
    case 3: e = launch_layout<3, mla::KV_FP8>(dev, *c, max_window[dev], sms[dev]); break;
    default: e = launch_layout<2, mla::KV_FP8>(dev, *c, max_window[dev], sms[dev]);
  }
#endif
  if (e == cudaSuccess && c->schedule != mla::FIXED_SPLITS) e = launch_combine(*c);
  return reported(e);
}
