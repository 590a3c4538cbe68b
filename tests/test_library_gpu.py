"""The library's call, mla_decode_with_kvcache and its plans, on an NVIDIA GPU (`pytest -m gpu
tests/test_library_gpu.py`): the cuda and triton kernels over paged caches, bit for bit their ragged twins
(testkit.paged.ragged_twin) and within GPU_BOUNDS of the float64 truth with Q (and P) rounded as each kernel rounds
them; serving shapes (MTP, 8 to 128 heads), the cuda kernel's wider units, invalid pages and lengths, CUDA-graph
capture; each bound beside a planted bug that fails it. The same call on the CPU: tests/test_library.py."""

import functools
import math

import pytest
import torch

import mla_decode
from testkit.emulation import E4M3_P_RANDOM_BOUND, Tiling, round_q_per_head, schedule_pieces
from testkit.paged import (
    BAD_CONTENTS,
    LSE_BOUND,
    OUT_BOUND,
    V_DIM,
    errors,
    make_paged_case,
    owned_rows,
    paged_reference,
    ragged_twin,
)

needs_nvidia = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                                  reason="needs an NVIDIA GPU")
# (backend, format, precision) of every GPU kernel the library runs on NVIDIA
GPU_KERNELS = [("cuda", "fp8", "fast"), ("cuda", "fp8", "precise"), ("cuda", "mxfp4", "fast"), ("cuda", "bf16", "fast"),
               ("triton", "fp8", "fast"), ("triton", "fp8", "precise"), ("triton", "mxfp4", "fast"),
               ("triton", "bf16", "fast")]
GPU_LENS = [0, 1, 77, 1000, 8191, 64, 3]
# Against the float64 truth over the same pages with Q rounded as the kernel rounds it, (backend, format, precision)
# -> the bound on the worst token's output and on the LSE. Measured on the H200 (the worst of 4 seeds x
# pages 1, 16, 64, q scaled up to 4x, 2026-12-02): the cuda fast kernels round P to e4m3 too (out 2.0-2.2e-2; held to
# the emulation of their walk in test_cuda_gpu.py), and the FP8 MMAs' sums move the LSE by up to 1.1e-2 (cuda and triton
# fast FP8), the dequantizing MXFP4 triton kernel by 2.8e-3, the cuda MXFP4 kernel's by 4.8e-3; the fp16 and bf16
# products keep it within 1e-5 (the mma.sync kernel's fp16 Q is exact: sm_scale goes into the fp32 scores).
GPU_BOUNDS = {("cuda", "fp8", "fast"): (4e-2, 2e-2), ("cuda", "mxfp4", "fast"): (4e-2, 1e-2),
              ("cuda", "fp8", "precise"): (OUT_BOUND, LSE_BOUND), ("triton", "fp8", "fast"): (OUT_BOUND, 2e-2),
              ("triton", "mxfp4", "fast"): (OUT_BOUND, 5e-3), ("triton", "fp8", "precise"): (OUT_BOUND, LSE_BOUND),
              ("triton", "bf16", "fast"): (OUT_BOUND, LSE_BOUND), ("cuda", "bf16", "fast"): (OUT_BOUND, LSE_BOUND)}


def _triton_takes_hopper(kv_format: str, precision: str) -> bool:
    """Whether this GPU's triton plans of that format and precision take the Hopper kernel (triton/hopper.py)."""
    return mla_decode.triton.triton_plan(1, 1, mla_decode.triton.triton_target(torch.device("cuda")), kv_format,
                                         precise=precision == "precise").hopper


def gpu_bounds(kernel: tuple[str, str, str]) -> tuple[float, float]:
    """GPU_BOUNDS of the kernel a call with the default plan runs on this GPU: the triton backend's fast FP8 and
    MXFP4 calls run its Hopper kernel on sm_90 (Q and P in e4m3, as the cuda fast kernels: held to their bounds; its
    precise FP8 calls round as the portable precise kernel and keep that kernel's bounds)."""
    backend, kv_format, precision = kernel
    if backend == "triton" and precision == "fast" and kv_format != "bf16" and _triton_takes_hopper(kv_format, "fast"):
        return GPU_BOUNDS[("cuda", kv_format, "fast")]
    return GPU_BOUNDS[kernel]


def _hopper_takes_32_rows(precision: str) -> bool:
    """Whether this GPU's cuda kernel takes 32-row units: the Hopper (wgmma) kernel, fast mode."""
    return torch.cuda.get_device_capability() == (9, 0) and precision == "fast"


def _gpu_queries(case, backend, precision):
    if precision == "fast" and case.kv_format != "bf16" and (backend == "cuda" or case.kv_format == "fp8" or (
            backend == "triton" and case.kv_format == "mxfp4" and _triton_takes_hopper("mxfp4", "fast"))):
        values, scale = round_q_per_head(case.q)  # the FP8 score products' Q, e4m3 per head
        return values.double() / scale.double()
    return None


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kernel", GPU_KERNELS, ids="-".join)
def test_gpu_paged_is_the_ragged_kernel_over_the_same_rows(kernel, page_size):
    """Paged with every unowned slot NaN and shuffled pages: bit for bit what the same kernel and split plan give
    over the owned rows laid out consecutively (the leaderboard's layout, which test_cuda_gpu and test_triton_gpu hold
    to each kernel's emulation), and within bounds of the float64 truth, LSE included."""
    backend, kv_format, precision = kernel
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    case = make_paged_case(kv_format, page_size, GPU_LENS, seed=page_size, device="cuda")
    max_seqlen = max(GPU_LENS)
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), backend=backend, precision=precision,
                                                  max_seqlen=max_seqlen)
    kv, scale, indptr = ragged_twin(case)
    twin = mla_decode.plan_ragged(len(GPU_LENS), kv.dtype, "cuda", max_seqlen, backend=backend, precision=precision,
                                  kv_scale_dtype=None if scale is None else scale.dtype)
    twin_out, twin_lse = twin.run_ragged(case.q, kv, indptr, scale)
    assert torch.equal(out, twin_out) and torch.equal(lse, twin_lse)
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, backend, precision))
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    out_bound, lse_bound = gpu_bounds(kernel)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    # these bounds are sanity bounds (the paged result is the ragged one, held tightly elsewhere), yet each fails on a
    # planted 10% softmax-scale error
    bad_out, bad_lse = mla_decode.mla_decode_with_kvcache(*case.args(), softmax_scale=1.1 / math.sqrt(576),
                                                          backend=backend, precision=precision, max_seqlen=max_seqlen)
    bad_out_error, bad_lse_error = errors(bad_out, bad_lse, ref_out, ref_lse)
    assert bad_out_error > out_bound and bad_lse_error > lse_bound, (bad_out_error, bad_lse_error)


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kernel", [kernel for kernel in GPU_KERNELS if kernel[0] == "cuda"], ids="-".join)
def test_gpu_cuda_sequences_longer_than_the_plan(kernel, page_size):
    """A plan made for 1000 positions runs on longer and shorter sequences: the kernel's first table reads, asked
    for the split a sequence of the plan's length would have, are the wrong ones past split 0 of the longest
    sequence and read again; within bounds of the float64 truth, LSE included, with every unowned slot NaN."""
    plan = pytest.importorskip("mla_decode.cuda.plan")
    _, kv_format, precision = kernel
    case = make_paged_case(kv_format, page_size, GPU_LENS, seed=page_size + 1, device="cuda")
    decode = mla_decode.plan(len(GPU_LENS), page_size, case.block_table.shape[1], case.kv_cache.dtype, "cuda",
                             backend="cuda", precision=precision, max_seqlen=1000,
                             kv_scale_dtype=torch.uint8 if case.kv_scale is None else case.kv_scale.dtype,
                             backend_options={"schedule": "fixed"})
    splits = decode.impl.num_splits  # with one split every split starts at 0, where a guess cannot miss
    assert splits > 1 and decode.impl.call.guess_rows != plan.split_rows(max(GPU_LENS), splits)
    out, lse = decode.run(*case.args())
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "cuda", precision))
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    out_bound, lse_bound = gpu_bounds(kernel)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"


SERVING_SHAPES = [(2, 16), (4, 16), (1, 32), (2, 32), (1, 128), (2, 128), (1, 8), (3, 8)]  # (q_len, num_heads)
SERVING_LENS = [0, 1, 3, 77, 1000, 4097]


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("q_len,num_heads", SERVING_SHAPES)
@pytest.mark.parametrize("kernel", GPU_KERNELS, ids="-".join)
def test_gpu_serving_shapes(kernel, q_len, num_heads):
    """MTP (q_len 2 and 4, causal; lengths 0, 1 and 3 leave tokens that see nothing), 32 or 128 heads (the Hopper cuda
    kernel: units of 32 rows) and 8 (the last unit or group of 16 rows part masked), paged (64) and ragged (the same
    kernel over the owned rows laid out consecutively: bit for bit the paged result), against the float64 truth with
    the bounds of q_len 1; a planted bug fails them: the tokens not causal, or a 10% softmax scale error."""
    backend, kv_format, precision = kernel
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    case = make_paged_case(kv_format, 64, SERVING_LENS, seed=q_len * num_heads, q_len=q_len, num_heads=num_heads,
                           device="cuda")
    settings = dict(backend=backend, precision=precision, max_seqlen=max(SERVING_LENS))
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), causal=case.causal, **settings)
    kv, scale, indptr = ragged_twin(case)
    twin = mla_decode.plan_ragged(len(SERVING_LENS), kv.dtype, "cuda", max(SERVING_LENS), q_len=q_len,
                                  num_heads=num_heads, causal=case.causal, backend=backend, precision=precision,
                                  kv_scale_dtype=None if scale is None else scale.dtype)
    twin_out, twin_lse = twin.run_ragged(case.q, kv, indptr, scale)
    assert torch.equal(out, twin_out) and torch.equal(lse, twin_lse)
    if backend == "cuda":
        # the plan's rule (plan_unit_rows, checked on the CPU); on the H200 the serving lengths' plans at (1, 128)
        # and (2, 128) take 64-row CTAs of 8 and 16 tiles with the FP8 cache (the 16-row plan splitting too), and
        # 32-row ones with MXFP4; at (2, 32) a 32-row CTA would walk 4 tiles
        D = pytest.importorskip("mla_decode.cuda.decode")
        facts = D.device_facts(twin.problem.device, precision == "precise")
        assert twin.impl.call.unit_rows == D.plan_unit_rows(twin.problem, facts)
        if _hopper_takes_32_rows(precision) and num_heads == 128:
            assert twin.impl.call.unit_rows == (32 if kv_format == "mxfp4" else 64)
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, backend, precision))
    out_bound, lse_bound = gpu_bounds(kernel)
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    planted = [dict(causal=case.causal, softmax_scale=1.1 / math.sqrt(576))] + ([dict(causal=False)] if q_len > 1
                                                                                 else [])
    for bug in planted:
        bad_out, bad_lse = mla_decode.mla_decode_with_kvcache(*case.args(), **bug, **settings)
        bad_out_error, bad_lse_error = errors(bad_out, bad_lse, ref_out, ref_lse)
        assert bad_out_error > out_bound and bad_lse_error > lse_bound, (bug, bad_out_error, bad_lse_error)


MASKED_HEADS = [(1, 1), (1, 8), (2, 8), (1, 24), (1, 40), (2, 72)]  # (q_len, num_heads), not multiples of 16


def _poisoned(shape: tuple, dtype: torch.dtype, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN buffer of `shape` followed by `tail` NaN elements: (the buffer, the whole)."""
    n = math.prod(shape)
    whole = torch.full((n + tail,), float("nan"), dtype=dtype, device="cuda")
    return whole[:n].view(shape), whole


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("q_len,num_heads", MASKED_HEADS)
@pytest.mark.parametrize("kernel", [kernel for kernel in GPU_KERNELS if kernel[0] == "cuda"], ids="-".join)
def test_gpu_cuda_masks_the_heads_past_the_last(kernel, q_len, num_heads, schedule):
    """Head counts that are not a multiple of the 16-row unit (1, 8, 24, 40, 72): a token's last unit reads zero
    queries past its heads and stores none of those rows. out and lse, NaN-poisoned buffers with a NaN tail past
    their ends, are within the bounds of the float64 truth (a masked row stored lands on the next token's heads) and
    leave the tail NaN (the last token's masked rows would land there), through fixed splits (their merge) and the
    balanced schedule (its combine). Planted: a 10% softmax scale error fails the bound; the same call over the
    padded heads (q with zero heads appended) stores finite rows in their place, which the checks would see."""
    _, kv_format, precision = kernel
    pytest.importorskip("mla_decode.cuda")
    case = make_paged_case(kv_format, 64, SERVING_LENS, seed=3 * q_len + num_heads, q_len=q_len, num_heads=num_heads,
                           device="cuda")
    batch, tail = len(SERVING_LENS), 16 * V_DIM

    def run(q, heads, **bug):
        decode = mla_decode.plan(batch, 64, case.block_table.shape[1], case.kv_cache.dtype, "cuda", num_heads=heads,
                                 q_len=q_len, causal=case.causal, backend="cuda", precision=precision,
                                 max_seqlen=max(SERVING_LENS), backend_options={"schedule": schedule},
                                 kv_scale_dtype=torch.uint8 if case.kv_scale is None else case.kv_scale.dtype, **bug)
        out, out_whole = _poisoned((batch, q_len, heads, V_DIM), torch.bfloat16, tail)
        lse, lse_whole = _poisoned((batch, heads, q_len), torch.float32, 16)
        decode.run(q, case.kv_cache, case.block_table, case.cache_seqlens, case.kv_scale, out=out, lse=lse)
        return out, lse, out_whole[out.numel():], lse_whole[lse.numel():]

    out, lse, out_tail, lse_tail = run(case.q, num_heads)
    assert out_tail.isnan().all() and lse_tail.isnan().all(), "a masked row was stored past the buffers' ends"
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "cuda", precision))
    out_bound, lse_bound = gpu_bounds(kernel)
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    bad_out, bad_lse, _, _ = run(case.q, num_heads, softmax_scale=1.1 / math.sqrt(576))
    bad_out_error, bad_lse_error = errors(bad_out, bad_lse, ref_out, ref_lse)
    assert bad_out_error > out_bound and bad_lse_error > lse_bound, (bad_out_error, bad_lse_error)
    slots = -(-num_heads // 16) * 16  # the padded heads stored: the rows the tail check would see
    padded = torch.cat([case.q, case.q.new_zeros((batch, q_len, slots - num_heads, case.q.shape[-1]))], dim=2)
    padded_out, _, _, _ = run(padded, slots)
    assert not padded_out[:, :, num_heads:].isnan().any()


def _hopper_plan(case, precise: bool = False, block_h: int | None = None) -> "mla_decode.triton.TritonPlan":
    """The triton plan of a SERVING_LENS case on this GPU (block_h: its programs' query rows), which on sm_90 with the
    Triton the Hopper kernel is written for must take that kernel; elsewhere the test is skipped."""
    _, q_len, num_heads, _ = case.q.shape
    plan = mla_decode.triton.triton_plan(len(SERVING_LENS), max(SERVING_LENS),
                                         mla_decode.triton.triton_target(torch.device("cuda")), case.kv_format,
                                         q_len * num_heads, num_heads, precise=precise, block_h=block_h)
    if not plan.hopper:
        assert (torch.cuda.get_device_capability() != (9, 0)
                or mla_decode.triton.hopper.HOPPER_KERNEL_REASON is not None), "sm_90 plans the portable kernel"
        pytest.skip("the triton plan takes the portable kernel on this GPU or Triton")
    return plan


def _triton_run(case, plan, schedule: str, precision: str, **bug):
    """The triton backend's (output, LSE) for a SERVING_LENS case with `plan` and `schedule`; bug: a planted causal
    flag or softmax scale."""
    _, q_len, num_heads, _ = case.q.shape
    return mla_decode.plan(len(SERVING_LENS), case.page_size, case.block_table.shape[1], case.kv_cache.dtype, "cuda",
                           num_heads=num_heads, q_len=q_len, causal=bug.get("causal", case.causal),
                           softmax_scale=bug.get("softmax_scale"),
                           kv_scale_dtype=None if case.kv_scale is None else case.kv_scale.dtype,
                           backend="triton", max_seqlen=max(SERVING_LENS), precision=precision,
                           backend_options={"plan": plan, "schedule": schedule}).run(*case.args())


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("kv_format,precision", [("fp8", "fast"), ("fp8", "precise"), ("mxfp4", "fast"),
                                                 ("bf16", "fast")])
@pytest.mark.parametrize("page_size", [1, 64, 128])  # 128: a tile in either half of a page (one table entry a tile)
@pytest.mark.parametrize("q_len,num_heads", SERVING_SHAPES)
def test_gpu_the_triton_hopper_kernel_rounds_p_as_its_walk(q_len, num_heads, page_size, kv_format, precision,
                                                           schedule):
    """Where the triton plan takes the Hopper kernel (on sm_90 with the Triton it is written for, it must): MTP,
    8-128 heads and pages held to the float64 truth. Fast (FP8, or MXFP4 expanded to E5M2; P = 2^8 p in e4m3): with
    Q and P rounded as its walk rounds them (paged_reference with the plan's splits, or the balanced schedule's
    pieces), within the bound the "+Q+P" emulation holds the leaderboard shapes to (times sqrt(16 / heads) below 16
    heads), LSE within the cuda fast kernel's bound for the format. Precise (fp16 products, nothing rounded beyond
    the cache) and BF16 (bf16 products and P): the exact computation within the format's bounds. The tokens not
    causal, or a 2% softmax scale error, fail it."""
    case = make_paged_case(kv_format, page_size, SERVING_LENS, seed=q_len * num_heads + page_size, q_len=q_len,
                           num_heads=num_heads, device="cuda")
    target = mla_decode.triton.triton_target(torch.device("cuda"))
    plan = _hopper_plan(case, precise=precision == "precise")
    decode = functools.partial(_triton_run, case, plan, schedule, precision)
    out, lse = decode()
    if precision == "fast" and kv_format != "bf16":
        if schedule == "fixed":
            tiling = Tiling(plan.num_splits, plan.block_n, torch.float32)
        else:  # the schedule kernel's pieces, as the CPU reference cuts them for this GPU's parts
            groups = mla_decode.triton.plan.query_groups(q_len, num_heads, plan.block_h)
            resident = mla_decode.triton.plan.resident_programs(target, kv_format, plan.hopper)
            pieces = schedule_pieces(SERVING_LENS, mla_decode.triton.plan.balanced_parts(target, groups, resident),
                                     plan.block_n)
            tiling = Tiling(block_n=plan.block_n, partial_dtype=torch.float32, pieces=pieces)
        ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "triton", "fast"), tiling=tiling)
        # a P rounding the FP8 scores flip weighs on a token of fewer heads more: its relative L2 goes as 1/sqrt(heads)
        out_bound = E4M3_P_RANDOM_BOUND * max(1.0, math.sqrt(16 / num_heads))
        lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")][1]
    else:
        ref_out, ref_lse = paged_reference(case)
        out_bound, lse_bound = GPU_BOUNDS[("triton", kv_format, precision)]
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    planted = [dict(causal=case.causal, softmax_scale=1.02 / math.sqrt(576))] + ([dict(causal=False)] if q_len > 1
                                                                                  else [])
    for bug in planted:
        assert errors(decode(**bug)[0], None, ref_out, ref_lse)[0] > out_bound, bug


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("q_len,num_heads", [(1, 1), (1, 8), (2, 24), (1, 40), (1, 72), (4, 16), (1, 128)])
@pytest.mark.parametrize("block_h", mla_decode.triton.hopper.HOPPER_BF16_ROWS)
def test_gpu_the_triton_hopper_bf16_kernel_takes_16_to_64_query_rows(block_h, q_len, num_heads, page_size, schedule):
    """The Hopper kernel's BF16 programs of 16 query rows (one warpgroup), 32 and 64 (two warpgroups: each scores half
    the rows and takes half of each block's dims) against the float64 truth, with the rows the heads leave in the last
    group masked; a 2% softmax scale error, and the tokens not causal, fail it."""
    case = make_paged_case("bf16", page_size, SERVING_LENS, seed=block_h + q_len * num_heads + page_size,
                           q_len=q_len, num_heads=num_heads, device="cuda")
    decode = functools.partial(_triton_run, case, _hopper_plan(case, block_h=block_h), schedule, "fast")
    out, lse = decode()
    ref_out, ref_lse = paged_reference(case)
    out_bound, lse_bound = GPU_BOUNDS[("triton", "bf16", "fast")]
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    planted = [dict(softmax_scale=1.02 / math.sqrt(576))] + ([dict(causal=False)] if q_len > 1 else [])
    for bug in planted:
        assert errors(decode(**bug)[0], None, ref_out, ref_lse)[0] > out_bound, bug


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("q_len,num_heads,block_h", [(2, 16, 32), (2, 128, 32), (3, 8, 32), (1, 128, 64)])
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
def test_gpu_triton_takes_more_query_rows_a_program(kv_format, q_len, num_heads, block_h):
    """A triton plan of 32 or 64 query rows a program and 8 warps (bench/serving.py's triton-fp8-rows32; the portable
    kernel) against the float64 truth, within the portable 16-row kernel's bounds, and bit for bit its ragged twin."""
    case = make_paged_case(kv_format, 64, SERVING_LENS, seed=block_h + q_len * num_heads, q_len=q_len,
                           num_heads=num_heads, device="cuda")
    rows = q_len * num_heads
    problem = mla_decode.api.make_problem(len(SERVING_LENS), case.kv_cache.dtype, "cuda", layout="paged",
                                          page_size=64, max_pages=case.block_table.shape[1], num_heads=num_heads,
                                          q_len=q_len, causal=case.causal, max_seqlen=max(SERVING_LENS),
                                          scale_dtype=case.kv_scale.dtype if kv_format == "mxfp4" else torch.uint8)
    target = mla_decode.triton.triton_target(torch.device("cuda"))
    plan = mla_decode.triton.triton_plan(len(SERVING_LENS), max(SERVING_LENS), target, kv_format, rows, num_heads,
                                         block_h=block_h)
    decode = mla_decode.DecodePlan(problem, "triton", backend_options={"plan": plan})
    out, lse = decode.run(*case.args())
    # the portable kernel (more rows than the Hopper kernel's 16): E4M3 Q against FP8, bf16 Q against MXFP4
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "triton", "fast") if kv_format == "fp8" else None)
    out_bound, lse_bound = GPU_BOUNDS[("triton", kv_format, "fast")]
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    kv, scale, indptr = ragged_twin(case)
    twin = mla_decode.plan_ragged(len(SERVING_LENS), kv.dtype, "cuda", max(SERVING_LENS), q_len=q_len,
                                  num_heads=num_heads, causal=case.causal, backend="triton",
                                  kv_scale_dtype=None if scale is None else scale.dtype,
                                  backend_options={"plan": plan})
    twin_out, twin_lse = twin.run_ragged(case.q, kv, indptr, scale)
    assert torch.equal(out, twin_out) and torch.equal(lse, twin_lse)


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", GPU_KERNELS, ids="-".join)
def test_gpu_many_sequences_one_split(kernel, causal):
    """40 sequences of q_len 2 x 128 heads fill the GPU without splitting (640 units or programs of 16 rows; the
    cuda plan keeps 16 since a 32-row CTA would walk 3 tiles): the split kernels write the output and the LSE
    themselves; causal and not, against the float64 truth. (Wider units' one-split cases: their forced-rows tests.)"""
    backend, kv_format, precision = kernel
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    lens = [0, 1, 3, 77, 200] * 8
    case = make_paged_case(kv_format, 64, lens, seed=40 + causal, q_len=2, num_heads=128, causal=causal,
                           device="cuda")
    decode = mla_decode.plan(len(lens), 64, case.block_table.shape[1], case.kv_cache.dtype, "cuda", num_heads=128,
                             q_len=2, causal=causal, backend=backend, precision=precision, max_seqlen=max(lens),
                             kv_scale_dtype=None if case.kv_scale is None else case.kv_scale.dtype,
                             backend_options={"schedule": "fixed"})
    splits = decode.impl.num_splits if backend == "cuda" else decode.impl.key.plan.num_splits
    assert splits == 1
    out, lse = decode.run(*case.args())
    out_error, lse_error = errors(out, lse, *paged_reference(case, q=_gpu_queries(case, backend, precision)))
    out_bound, lse_bound = gpu_bounds(kernel)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16, 32, 64])  # 3 units x 64: within two CTAs per SM
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
def test_gpu_cuda_units_of_32_rows_through_every_split_count(monkeypatch, kv_format, splits):
    """The Hopper cuda kernel's 32-row units (32 heads) through every merge width: merge_quads' W = 16, 8, 4, 2 quads a
    thread at 2 .. 16 splits, W = 1 at 32 and, at 64, two threads a quad and their shuffles; an empty sequence, a
    one-row one and splits that get no rows, over pages of 16 rows (each copy looks its row up), against the float64
    truth and (up to 32 splits) against the same plan in units of 16 rows: every head's sums are the same products
    (only the merge groups its splits otherwise at 32 splits), so a layout slip shows far above a tenth of the
    bounds."""
    P = pytest.importorskip("mla_decode.cuda.plan")
    if not _hopper_takes_32_rows("fast"):
        pytest.skip("units of 32 rows are the Hopper kernel's")
    monkeypatch.setattr(P, "cuda_plan", lambda *args: splits)
    lens = [0, 1, 3001]
    case = make_paged_case(kv_format, 16, lens, seed=splits, num_heads=32, device="cuda")
    decode = mla_decode.plan(len(lens), 16, case.block_table.shape[1], case.kv_cache.dtype, "cuda", num_heads=32,
                             backend="cuda", max_seqlen=max(lens),
                             backend_options={"unit_rows": 32, "schedule": "fixed"},
                             kv_scale_dtype=None if case.kv_scale is None else case.kv_scale.dtype)
    assert (decode.impl.num_splits, decode.impl.call.unit_rows) == (splits, 32)
    out, lse = decode.run(*case.args())
    out_error, lse_error = errors(out, lse, *paged_reference(case, q=_gpu_queries(case, "cuda", "fast")))
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    if splits > 32:  # 6 units of 16 rows x 64 splits: more CTAs than a cooperative launch holds at once
        return
    narrow = mla_decode.plan(len(lens), 16, case.block_table.shape[1], case.kv_cache.dtype, "cuda", num_heads=32,
                             backend="cuda", max_seqlen=max(lens),
                             backend_options={"unit_rows": 16, "schedule": "fixed"},
                             kv_scale_dtype=None if case.kv_scale is None else case.kv_scale.dtype)
    assert (narrow.impl.num_splits, narrow.impl.call.unit_rows) == (splits, 16)
    narrow_out, narrow_lse = narrow.run(*case.args())
    out_error, lse_error = errors(out, lse, narrow_out.double().cpu(), narrow_lse.double().cpu())
    assert out_error < out_bound / 10 and lse_error < lse_bound / 10, f"out {out_error:.2e}, lse {lse_error:.2e}"


def _cuda_plan_in_units_of(rows: int, case, max_seqlen: int, ragged: bool = False, **settings):
    """The cuda backend's plan for `case` (FP8 or BF16; paged, or ragged over its ragged_twin) in units of `rows` query
    rows, whatever plan_unit_rows would pick; settings override the case's causal and the default softmax scale."""
    batch, q_len, num_heads = case.q.shape[:3]
    shared = dict(num_heads=num_heads, q_len=q_len, causal=case.causal, backend="cuda", max_seqlen=max_seqlen,
                  backend_options={"unit_rows": rows, "schedule": "fixed"},
                  kv_scale_dtype=None if case.kv_scale is None else case.kv_scale.dtype) | settings
    if ragged:
        return mla_decode.plan_ragged(batch, case.kv_cache.dtype, "cuda", **shared)
    return mla_decode.plan(batch, case.page_size, case.block_table.shape[1], case.kv_cache.dtype, "cuda", **shared)


def _needs_units_of_64():
    pytest.importorskip("mla_decode.cuda")
    if not _hopper_takes_32_rows("fast"):
        pytest.skip("units of 64 rows are the Hopper kernel's")


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("num_heads", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_gpu_cuda_units_of_64_rows_through_every_split_count(monkeypatch, kv_format, page_size, num_heads, splits):
    """The Hopper cuda kernel's 64-row units (split_kernel64: two warpgroups, one CTA an SM, on pairs of 64-row tiles;
    BF16 the seesaw, each warpgroup taking both tiles' P into its half of O) through every merge width (W = 16 .. 2
    quads a thread at 2 .. 16 splits, W = 1 from 32, two threads a quad at 64): 3001 rows (47 tiles: an odd split
    leaves the second tile of its last pair empty, NaN-poisoned rows
    beyond it), one row and none (as many sequences as one CTA an SM holds at once), over pages of 16 (each copy
    looks its row up) and 64 (a tile's rows consecutive), 64 and 128 heads (1 and 2 units a token), against the
    float64 truth and, where the 16-row grid fits, against the same split plan in 16-row units. A pair's two tiles,
    the two warpgroups' halves of V's dims and the merge of 8192 quads each fail the truth far above its bounds when
    wrong. Against 16-row units P's e4m3 rounding differs (scaled by a pair's running max, not a tile's: 0.6-1.7e-2
    apart on random data in testkit's emulation of both walks; BF16's P rounds to bf16 against either max), so half
    the output bound; the LSE (both sum the unrounded P) within a quarter of its bound."""
    P = pytest.importorskip("mla_decode.cuda.plan")
    _needs_units_of_64()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [3001, 1, 0][:sms // (splits * num_heads // 64)]  # a cooperative grid of 64-row CTAs: one an SM
    if not lens:
        pytest.skip(f"{splits} splits of {num_heads // 64} units of 64 rows exceed {sms} SMs")
    monkeypatch.setattr(P, "cuda_plan", lambda *args: splits)
    case = make_paged_case(kv_format, page_size, lens, seed=splits + num_heads + page_size, num_heads=num_heads,
                           device="cuda")
    decode = _cuda_plan_in_units_of(64, case, max(lens))
    assert (decode.impl.num_splits, decode.impl.call.unit_rows) == (splits, 64)
    out, lse = decode.run(*case.args())
    out_error, lse_error = errors(out, lse, *paged_reference(case, q=_gpu_queries(case, "cuda", "fast")))
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    if len(lens) * num_heads // 16 * splits > (1 if kv_format == "bf16" else 2) * sms:  # the 16-row grid's CTAs a SM
        return
    narrow = _cuda_plan_in_units_of(16, case, max(lens))
    assert (narrow.impl.num_splits, narrow.impl.call.unit_rows) == (splits, 16)
    narrow_out, narrow_lse = narrow.run(*case.args())
    out_error, lse_error = errors(out, lse, narrow_out.double().cpu(), narrow_lse.double().cpu())
    assert out_error < out_bound / 2 and lse_error < lse_bound / 4, f"out {out_error:.2e}, lse {lse_error:.2e}"


# (unit rows, q_len, heads): units of a sequence's query rows that span its tokens
SPANNING_UNITS = [(64, 2, 32), (64, 4, 16), (32, 2, 16), (16, 2, 8), (16, 3, 8)]
SPANNING_LENS = [4097, 65, 64, 130, 3, 1, 0]


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("schedule,splits", [("fixed", 1), ("fixed", 2), ("fixed", 8), ("balanced", None)])
@pytest.mark.parametrize("rows,q_len,num_heads", SPANNING_UNITS)
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_gpu_cuda_units_that_span_tokens(monkeypatch, kv_format, rows, q_len, num_heads, schedule, splits):
    """A unit of a sequence's q_len x heads query rows spans its tokens (causal): it walks its last token's positions
    and each row masks those its own token does not see. Lengths whose earlier tokens end a tile sooner (4097 and 65:
    token 0 of 2 ends on a tile boundary, the last tile is the last token's alone; 64, 130, 3, 1 and 0: tokens that
    see nothing), pages of 16, through fixed splits (a split of positions only the last token sees leaves the other
    rows a piece of no positions, weight 0) and the balanced schedule: within the float64 truth's bounds, out and lse
    NaN-poisoned before the call. Planted: every row reading its unit's whole range (causal off) fails them."""
    P = pytest.importorskip("mla_decode.cuda.plan")
    pytest.importorskip("mla_decode.cuda")
    if rows > 16 and not _hopper_takes_32_rows("fast"):
        pytest.skip("units of 32 and 64 rows are the Hopper kernel's")
    if splits is not None:
        monkeypatch.setattr(P, "cuda_plan", lambda *args: splits)
    lens = SPANNING_LENS
    case = make_paged_case(kv_format, 16, lens, seed=rows + q_len + num_heads, q_len=q_len, num_heads=num_heads,
                           device="cuda")

    def run(**bug):
        decode = mla_decode.plan(len(lens), 16, case.block_table.shape[1], case.kv_cache.dtype, "cuda",
                                 num_heads=num_heads, q_len=q_len, backend="cuda", max_seqlen=max(lens),
                                 backend_options={"unit_rows": rows, "schedule": schedule},
                                 kv_scale_dtype=None if case.kv_scale is None else case.kv_scale.dtype,
                                 **({"causal": True} | bug))
        assert decode.impl.call.unit_rows == rows
        if splits is not None:
            assert decode.impl.num_splits == splits
        out, _ = _poisoned((len(lens), q_len, num_heads, V_DIM), torch.bfloat16, 0)
        lse, _ = _poisoned((len(lens), num_heads, q_len), torch.float32, 0)
        decode.run(*case.args(), out=out, lse=lse)
        return out, lse

    out, lse = run()
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "cuda", "fast"))
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    bad_out, bad_lse = run(causal=False)
    bad_out_error, bad_lse_error = errors(bad_out, bad_lse, ref_out, ref_lse)
    assert bad_out_error > out_bound and bad_lse_error > lse_bound, (bad_out_error, bad_lse_error)


# split_kernel64's lazy running max (wgmma64.cuh's LAZY_MAX, in log2 units): a step's P (FP8: a pair of tiles; BF16:
# a tile, the pair's first and then its second) is taken against the running max, which moves only where the step's
# max passes it by more than this.
LAZY_MAX = 2.0


def _rising_logits_case(kv_format: str, lens: list[int], rise: float, seed: int):
    """A paged FP8 or BF16 case of 64 heads whose logits climb along each sequence: key dim 575 ramps over the
    format's grid to 400 (x kv_scale) and every head's q dim 575 is set so that the ramp adds about `rise` log2 units
    from the first row to the last. Every other dim is make_paged_case's random data; keys and kv_cache edited
    alike."""
    case = make_paged_case(kv_format, 64, lens, seed=seed, num_heads=64)
    kv, keys = case.kv_cache.view(-1, 576).clone(), case.keys.clone()
    scale = 1.0 if case.kv_scale is None else float(case.kv_scale)
    for b, n in enumerate(lens):
        rows = owned_rows(case, b)
        ramp = (torch.arange(n, dtype=torch.float64) * (400.0 / max(n - 1, 1))).to(kv.dtype)
        kv[rows, 575] = ramp
        keys[rows, 575] = ramp.double() * scale
    q = case.q.clone()
    q[..., 575] = rise / (400.0 * scale / math.sqrt(576) * math.log2(math.e))
    return case._replace(q=q, kv_cache=kv.view(case.kv_cache.shape), keys=keys)


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_gpu_cuda_units_of_64_rows_rising_logits(monkeypatch, kv_format):
    """The 64-row kernel's lazy running max where the logits climb 40 log2 units along a sequence of 3001 rows (one
    split; FP8: 24 pairs of tiles, BF16: 47 tiles): the kernel's rule, replayed here on the float64 logits, moves the
    max on some steps and keeps it on others whose max lies above it (P up to 2^LAZY_MAX times larger), and the
    result meets the float64 truth. A kernel that stopped rescaling after the first step fails it (FP8: checked on
    the H200)."""
    P = pytest.importorskip("mla_decode.cuda.plan")
    _needs_units_of_64()
    lens = [3001, 1, 0]
    case = _rising_logits_case(kv_format, lens, rise=40.0, seed=64)
    q = _gpu_queries(case, "cuda", "fast")
    q = case.q.double() if q is None else q
    logits = (q[0, 0] @ case.keys[owned_rows(case, 0)].T.cpu() / math.sqrt(576) * math.log2(math.e))  # (64, 3001)
    step = 128 if kv_format == "fp8" else 64  # the rows a step of the stream scores
    pair_max = torch.nn.functional.pad(logits, (0, 3072 - 3001), value=-math.inf).view(64, -1, step).amax(-1)
    running, moved, kept_above = pair_max[:, 0].clone(), 0, 0
    for j in range(1, pair_max.shape[1]):
        up = pair_max[:, j] > running + LAZY_MAX
        moved += int(up.sum())
        kept_above += int(((pair_max[:, j] > running) & ~up).sum())
        running = torch.where(up, pair_max[:, j], running)
    assert moved >= 64 and kept_above >= 64, (moved, kept_above)
    monkeypatch.setattr(P, "cuda_plan", lambda *args: 1)
    device_case = case._replace(**{name: getattr(case, name).cuda() for name in
                                   ("q", "kv_cache", "kv_scale", "block_table", "cache_seqlens")
                                   if getattr(case, name) is not None})
    decode = _cuda_plan_in_units_of(64, device_case, max(lens))
    assert (decode.impl.num_splits, decode.impl.call.unit_rows) == (1, 64)
    out, lse = decode.run(*device_case.args())
    out_error, lse_error = errors(out, lse, *paged_reference(case, q=q))
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("q_len,num_heads", [(1, 64), (2, 64), (1, 128), (2, 128)])
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_gpu_cuda_units_of_64_rows_serving_shapes(kv_format, q_len, num_heads):
    """64-row units asked for (backend option unit_rows) on the serving lengths (0, 1 and 3: tokens that see nothing
    at q_len 2, causal; 77: one pair; 4097: 65 tiles, odd) in pages of 64, the plan's own splits: against the float64
    truth, bit for bit the ragged twin, and a planted bug (the tokens not causal, a 10% softmax scale error) fails."""
    _needs_units_of_64()
    case = make_paged_case(kv_format, 64, SERVING_LENS, seed=64 + q_len * num_heads, q_len=q_len, num_heads=num_heads,
                           device="cuda")
    decode = _cuda_plan_in_units_of(64, case, max(SERVING_LENS))
    assert decode.impl.call.unit_rows == 64
    out, lse = decode.run(*case.args())
    kv, scale, indptr = ragged_twin(case)
    twin = _cuda_plan_in_units_of(64, case, max(SERVING_LENS), ragged=True)
    twin_out, twin_lse = twin.run_ragged(case.q, kv, indptr, scale)
    assert torch.equal(out, twin_out) and torch.equal(lse, twin_lse)
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "cuda", "fast"))
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    planted = [dict(softmax_scale=1.1 / math.sqrt(576))] + ([dict(causal=False)] if q_len > 1 else [])
    for bug in planted:
        bad = _cuda_plan_in_units_of(64, case, max(SERVING_LENS), **bug)
        bad_out, bad_lse = bad.run(*case.args())
        bad_out_error, bad_lse_error = errors(bad_out, bad_lse, ref_out, ref_lse)
        assert bad_out_error > out_bound and bad_lse_error > lse_bound, (bug, bad_out_error, bad_lse_error)


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("name", ["a bad page only token 1 reaches", *sorted(BAD_CONTENTS)])
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_gpu_cuda_units_of_64_rows_invalid_contents(kv_format, name):
    """q_len 2 x 128 heads (causal) in 64-row units, pages of 16: sequence 1's table or length invalid makes all its
    rows NaN and leaves the others' truth; a page outside the cache holding only its last position makes its token 1
    NaN and keeps token 0."""
    _needs_units_of_64()
    lens = [200, 4497, 7]
    case = make_paged_case(kv_format, 16, lens, seed=7, q_len=2, num_heads=128, device="cuda")
    table, seqlens = case.block_table.cpu(), case.cache_seqlens.cpu()
    if name in BAD_CONTENTS:
        edit_table, edit_lens, _ = BAD_CONTENTS[name]
        (edit_table or edit_lens)(table, seqlens)
        nan_tokens, truthful = slice(None), [([0, 2], slice(None))]
    else:
        table[1, 4496 // 16] = 10_000
        nan_tokens, truthful = slice(1, 2), [([0, 2], slice(None)), ([1], slice(0, 1))]
    decode = _cuda_plan_in_units_of(64, case, max(lens))
    out, lse = decode.run(case.q, case.kv_cache, table.cuda(), seqlens.cuda(), case.kv_scale)
    assert torch.isnan(out[1, nan_tokens]).all() and torch.isnan(lse[1, :, nan_tokens]).all()
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "cuda", "fast"))  # over the table as it was
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    for rows, tokens in truthful:
        out_error, lse_error = errors(out[rows][:, tokens], lse[rows][:, :, tokens], ref_out[rows][:, tokens],
                                      ref_lse[rows][:, :, tokens])
        assert out_error < out_bound and lse_error < lse_bound, (rows, out_error, lse_error)


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_gpu_cuda_units_of_64_rows_walked_by_fewer_ctas(monkeypatch, kv_format, page_size, ctas):
    """The 64-row kernel's one-split grid walks units in turn (CTA c: units c, c + ctas, ...; the next unit's first
    pair copied during this one's last): 1, 3 or 7 CTAs over 36 units (9 sequences x q_len 2 x 128 heads, causal;
    empty, one-row and one-pair units between long ones; sequence 5's last position alone on a page outside the
    cache, which only its token 1 reaches), pages of 16 and 64. The output and the LSE equal the grid of one unit a
    CTA bit for bit, NaN rows alike (a unit that kept the last one's sums, max or bad-page flag, or copied another's
    pair, would not), and meet the float64 truth."""
    P = pytest.importorskip("mla_decode.cuda.plan")
    _needs_units_of_64()
    monkeypatch.setattr(P, "cuda_plan", lambda *args: 1)
    lens = [77, 0, 4097, 1, 3, 1025, 200, 0, 130]
    case = make_paged_case(kv_format, page_size, lens, seed=ctas + page_size, q_len=2, num_heads=128, device="cuda")
    table = case.block_table.clone()
    table[5, 1024 // page_size] = 10_000
    args = (case.q, case.kv_cache, table, case.cache_seqlens, case.kv_scale)
    decode = _cuda_plan_in_units_of(64, case, max(lens))
    assert (decode.impl.num_splits, decode.impl.call.unit_rows) == (1, 64)
    lib = pytest.importorskip("mla_decode.cuda.build").library(torch.cuda.get_device_capability())
    one_a_cta = [x.clone() for x in decode.run(*args)]  # 36 CTAs
    try:
        lib.mla_limit_wide_ctas(ctas)
        out, lse = decode.run(*args)
    finally:
        lib.mla_limit_wide_ctas(0)
    for walked, alone in zip((out, lse), one_a_cta, strict=True):
        assert torch.equal(walked.isnan(), alone.isnan()) and torch.equal(walked.nan_to_num(), alone.nan_to_num())
    assert out[5, 1].isnan().all() and lse[5, :, 1].isnan().all() and not out[5, 0].isnan().any()
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, "cuda", "fast"))  # over the table as it was
    out_bound, lse_bound = GPU_BOUNDS[("cuda", kv_format, "fast")]
    others = [b for b in range(len(lens)) if b != 5]
    for rows, tokens in [(others, slice(None)), ([5], slice(0, 1))]:
        out_error, lse_error = errors(out[rows][:, tokens], lse[rows][:, :, tokens], ref_out[rows][:, tokens],
                                      ref_lse[rows][:, :, tokens])
        assert out_error < out_bound and lse_error < lse_bound, (rows, out_error, lse_error)


# the kernels whose bad-page flags are their own code: the cuda ones and the triton Hopper kernel's FP8 copies and
# MXFP4 loads
BAD_PAGE_KERNELS = [("cuda", "fp8"), ("triton", "fp8"), ("triton", "mxfp4")]


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("num_heads", [8, 16, 32])
@pytest.mark.parametrize("backend,kv_format", [*BAD_PAGE_KERNELS, ("cuda", "bf16")])
@pytest.mark.parametrize("page_size", [16, 128])  # 128: the Hopper kernel's one table entry a tile
def test_gpu_a_bad_page_only_later_tokens_reach(backend, kv_format, page_size, num_heads):
    """q_len 2, causal: sequence 1's last page, outside the cache, holds only its last position. Token 1 reads it
    and comes out NaN; token 0 stops before it and keeps its value, as the other sequences do. The cuda kernel's
    units span both tokens (8 x 2 rows in 16, 16 x 2 in 32, 32 x 2 in 64 on Hopper): the unit reads the page, and
    only token 1's rows may take its verdict; so do the triton kernels' groups of 16 rows at 8 heads."""
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    case = make_paged_case(kv_format, page_size, [200, 4481, 7], seed=6, q_len=2, num_heads=num_heads,
                           device="cuda")
    table = case.block_table.clone()
    table[1, 4480 // page_size] = 10_000
    out, lse = mla_decode.mla_decode_with_kvcache(case.q, case.kv_cache, table, case.cache_seqlens, case.kv_scale,
                                                  causal=True, backend=backend, max_seqlen=4481)
    assert torch.isnan(out[1, 1]).all() and torch.isnan(lse[1, :, 1]).all()
    # everything else is its float64 truth (over the table as it was: those tokens never reach the page changed)
    ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, backend, "fast"))
    out_bound, lse_bound = gpu_bounds((backend, kv_format, "fast"))
    for rows, tokens in (([0, 2], slice(None)), ([1], slice(0, 1))):
        out_error, lse_error = errors(out[rows][:, tokens], lse[rows][:, :, tokens], ref_out[rows][:, tokens],
                                      ref_lse[rows][:, :, tokens])
        assert out_error < out_bound and lse_error < lse_bound, (rows, out_error, lse_error)


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("q_len,num_heads", [(1, 16), (2, 32)])
@pytest.mark.parametrize("backend,kv_format", BAD_PAGE_KERNELS)
@pytest.mark.parametrize("name", sorted(BAD_CONTENTS))
def test_gpu_invalid_contents_give_nan_rows(backend, kv_format, name, q_len, num_heads):
    """Sequence 1's table (an early page, which every token reads) or length is invalid: every one of its query rows
    is NaN, the other sequences' finite."""
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    edit_table, edit_lens, _ = BAD_CONTENTS[name]
    case = make_paged_case(kv_format, 16, [200, 4500, 7], seed=5, q_len=q_len, num_heads=num_heads, device="cuda")
    table, lens = case.block_table.cpu(), case.cache_seqlens.cpu()
    (edit_table or edit_lens)(table, lens)
    out, lse = mla_decode.mla_decode_with_kvcache(case.q, case.kv_cache, table.cuda(), lens.cuda(), case.kv_scale,
                                                  causal=case.causal, backend=backend, max_seqlen=4500)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(out[[0, 2]]).all() and torch.isfinite(lse[[0, 2]]).all()


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_graph_capture_replays_with_new_lengths_tables_and_data(backend, kv_format):
    """A plan's run captured once in a CUDA graph, then replayed over other lengths, page tables, queries and cache
    contents copied into the same buffers: each replay gives its own batch's truth. With out and lse given, a run
    allocates nothing."""
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    cases = [make_paged_case(kv_format, 16, lens, seed=seed, device="cuda")
             for seed, lens in ((1, [40, 3, 0, 700]), (2, [700, 45, 17, 2]), (3, [1, 700, 690, 0]))]
    max_pages = cases[0].block_table.shape[1]
    assert all(case.block_table.shape[1] == max_pages for case in cases)
    pages = max(case.kv_cache.shape[0] for case in cases)
    first = cases[0]
    cache = torch.empty((pages, *first.kv_cache.shape[1:]), dtype=first.kv_cache.dtype, device="cuda")
    scale = None if first.kv_scale is None else torch.empty((pages, *first.kv_scale.shape[1:]) if kv_format ==
                                                            "mxfp4" else (1,), dtype=first.kv_scale.dtype,
                                                            device="cuda")
    q, table, lens = first.q.clone(), first.block_table.clone(), first.cache_seqlens.clone()

    def load(case):
        n = case.kv_cache.shape[0]
        cache.view(torch.uint8)[:n] = case.kv_cache.view(torch.uint8)
        cache.view(torch.uint8)[n:] = 0xFF  # NaN pages (e4m3 and E8M0 NaN bytes) beyond this case's cache
        if kv_format == "mxfp4":
            scale.view(torch.uint8)[:n] = case.kv_scale.view(torch.uint8)
            scale.view(torch.uint8)[n:] = 0xFF
        else:
            scale.copy_(case.kv_scale)
        q.copy_(case.q)
        table.copy_(case.block_table)
        lens.copy_(case.cache_seqlens)

    decode = mla_decode.plan(4, 16, max_pages, cache.dtype, "cuda", backend=backend, max_seqlen=704,
                             kv_scale_dtype=None if kv_format == "fp8" else scale.dtype)
    out = torch.empty((4, 1, 16, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((4, 16, 1), dtype=torch.float32, device="cuda")
    load(first)
    decode.run(q, cache, table, lens, scale, out=out, lse=lse)  # compiles and binds the launchers
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    decode.run(q, cache, table, lens, scale, out=out, lse=lse)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(q, cache, table, lens, scale, out=out, lse=lse)
    for case in cases[1:] + cases[:1]:
        out.fill_(float("nan"))
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = paged_reference(case, q=_gpu_queries(case, backend, "fast"))
        out_error, lse_error = errors(out, lse, ref_out, ref_lse)
        out_bound, lse_bound = gpu_bounds((backend, kv_format, "fast"))
        assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
