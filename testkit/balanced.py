"""The work-balanced schedule's GPU tests, for either backend that cuts one (cuda, triton): a plan of a paged case,
and the float64 truth with Q as that plan's kernel rounds it, with the bounds it is held to (tests/test_library_gpu.py's
GPU_BOUNDS)."""

import torch

import mla_decode
from testkit.emulation import round_q_per_head
from testkit.paged import LSE_BOUND, OUT_BOUND, PagedCase, paged_reference

# (kv_format, precision) -> (output rel-L2, LSE) bounds: the cuda kernels, and the triton backend's portable kernel and
# its Hopper one (P in e4m3 too, as the cuda fast kernels)
CUDA_BOUNDS = {("fp8", "fast"): (4e-2, 2e-2), ("fp8", "precise"): (5e-3, 5e-3), ("mxfp4", "fast"): (4e-2, 1e-2),
               ("bf16", "fast"): (OUT_BOUND, LSE_BOUND)}
PORTABLE_BOUNDS = {("fp8", "fast"): (OUT_BOUND, 2e-2), ("mxfp4", "fast"): (OUT_BOUND, 5e-3),
                   ("fp8", "precise"): (OUT_BOUND, LSE_BOUND), ("bf16", "fast"): (OUT_BOUND, LSE_BOUND)}
HOPPER_BOUNDS = {("fp8", "fast"): (4e-2, 2e-2), ("mxfp4", "fast"): (4e-2, 1e-2), ("fp8", "precise"): (OUT_BOUND, 5e-3)}


def balanced_plan(backend: str, case: PagedCase, precision: str = "fast", **options) -> mla_decode.DecodePlan:
    """`backend`'s plan of `case` on the GPU with the balanced schedule (options override it: schedule="fixed")."""
    batch, q_len, heads = case.q.shape[:3]
    scale_dtype = torch.uint8 if case.kv_scale is None else case.kv_scale.dtype  # the default where none is read
    return mla_decode.plan(batch, case.page_size, case.block_table.shape[1], case.kv_cache.dtype, "cuda",
                           num_heads=heads, q_len=q_len, causal=case.causal, backend=backend, precision=precision,
                           kv_scale_dtype=scale_dtype, backend_options={"schedule": "balanced", **options})


def plan_truth(case: PagedCase, plan: mla_decode.DecodePlan, precision: str) -> tuple[tuple, tuple[float, float]]:
    """(the float64 truth with Q as the plan's kernel rounds it, the bounds it is held to)."""
    if plan.backend == "cuda":
        rounds_q, bounds = precision == "fast" and case.kv_format != "bf16", CUDA_BOUNDS
    else:
        hopper = plan.impl.key.plan.hopper
        rounds_q = precision == "fast" and (case.kv_format == "fp8" or (case.kv_format == "mxfp4" and hopper))
        bounds = HOPPER_BOUNDS if hopper else PORTABLE_BOUNDS
    q = None
    if rounds_q:
        values, scale = round_q_per_head(case.q)
        q = values.double() / scale.double()
    return paged_reference(case, q=q), bounds[(case.kv_format, precision)]
