"""fp32 attention over exactly what a backend reads (in the competition's tuple), and the check every backend test
makes with it.

A backend's output is held to two references: fp32 attention over the same quantized cache (and the same quantized
Q where the backend quantizes Q), where only the output's bf16 rounding and what the kernel rounds on purpose
remain, under a tight bound; and the BF16 truth through reference.check_implementation (the leaderboard's rule and
the strict per-sequence gate). reference.py holds the attention itself and the dequantizers; this module only
picks what each backend reads.
"""

import torch

import reference as R
from testkit.emulation import E4M3_P_RANDOM_BOUND, emulation_of, kernel_emulation, round_q_per_head
from testkit.inputs import GRID_REL_L2_BOUND, generate_grid_input


def dequantized_cache(kv_data: dict, kv_format: str) -> torch.Tensor:
    """The `kv_format` cache of kv_data ("fp8" or "mxfp4") in fp32: (total_kv, 1, 576)."""
    if kv_format not in ("fp8", "mxfp4"):
        raise ValueError(f"kv_format: expected 'fp8' or 'mxfp4', got {kv_format!r}")
    kv, scale = kv_data[kv_format]
    return kv.float() * scale if kv_format == "fp8" else R.dequantize_mxfp4(kv, scale)


def fp8_per_tensor(q: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The aiter path's Q: dynamic per-tensor FP8 (reference.quantize_fp8), dequantized to fp32."""
    q8, scale = R.quantize_fp8(q, fp8)
    return q8.float() * scale


def fp8_per_head(q: torch.Tensor) -> torch.Tensor:
    """The triton kernel's Q on the fp8 path: per-head E4M3 with scale 448 / max|q_h|, dequantized to fp32."""
    q8, scale = round_q_per_head(q)
    return q8 / scale


def fp32_attention(data, kv_format: str, q: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention of `q` (default: data's bf16 q) over data's dequantized `kv_format` cache: what a kernel that
    reads them computes, before its output is rounded. (total_q, 16, 512) float32."""
    q_data, kv_data, qo_indptr, kv_indptr, config = data
    return R.attention_reference(q_data if q is None else q, dequantized_cache(kv_data, kv_format), qo_indptr,
                                 kv_indptr, config["sm_scale"])


def triton_reference(data, kv_format: str, scaled_scores: bool = False) -> torch.Tensor:
    """fp32 attention over what the triton kernel reads: FP8 Q per head on the fp8 path and on MXFP4 with the scaled
    score product (TritonPlan.scaled_scores), the bf16 Q on MXFP4 otherwise."""
    return fp32_attention(data, kv_format, fp8_per_head(data[0]) if kv_format == "fp8" or scaled_scores else None)


# vs triton_reference, per sequence (the worst one): bf16 output rounding is ~2-3e-3, in the interpreter, whose fp32
# division is exact like the model's, and on a GPU, where the kernel's Q scale is the IEEE quotient too (div_rn).
# Measured on the H200 over the task shapes and varlen batches (bench/emulation_errors.py): worst sequence 2.1e-3 (the
# portable FP8 fast kernel), 1.7e-3 (MXFP4), where sm_scale x 1.01 gives >= 1.30e-2 (bench/negative_controls.py).
TRITON_REL_L2 = 5e-3


def triton_expected(data, kv_format: str, walked=None) -> tuple[torch.Tensor, float]:
    """What the triton kernel custom_kernel runs on `data` (on its device) is held to, and the bound on the worst
    sequence: triton_reference within TRITON_REL_L2; where its plan takes the Hopper kernel (triton/hopper.py, P in
    e4m3 as the cuda wgmma kernel rounds it), the emulation of that kernel's walk within the bound the cuda wgmma
    kernel is held to. walked: the input the kernel ran on, whose plan (splits) the walk follows, where it is not
    `data` (a poisoned copy: its extra rows change the adapter's plan)."""
    emulation, tiling = emulation_of(data if walked is None else walked, "triton", kv_format, "fast")
    if emulation == "+Q+P":
        return kernel_emulation(data, emulation, kv_format, tiling), E4M3_P_RANDOM_BOUND
    return triton_reference(data, kv_format), TRITON_REL_L2


def assert_matches(data, out: torch.Tensor, exact: torch.Tensor, bound: float,
                   metric=R.worst_row_relative_l2, kv_format: str | None = None) -> str:
    """`out` within `bound` of `exact`, the fp32 computation over the same quantized data, by `metric` (default
    per sequence: the worst row's relative L2, where an empty sequence must be all zeros; or
    reference.relative_l2 over the whole output), and `out` through reference.check_implementation against the
    BF16 truth, with the bound of `kv_format` (default: the environment's, MLA_KV_FORMAT). Returns a line with both
    results."""
    error = metric(out, exact)
    assert error < bound, f"{metric.__name__} {error:.3e} against fp32 over the same data (bound {bound:g})"
    ok, msg = R.check_implementation(data, out, kv_format)
    assert ok, msg
    return f"{metric.__name__} {error:.2e} against fp32 over the same data; BF16 truth: {msg}"


def nan_outside(data, kv_format: str, keep: int, trailing: int):
    """data's inputs less its last `trailing` sequences (their rows stay in the cache, past kv_indptr[-1]), with every
    row of the `kv_format` cache outside sequence `keep`'s range non-finite (FP8: the NaN byte 0x7F; MXFP4: the
    E8M0 scale byte 0xFF, 2^128): a backend that reads a row outside a sequence's range gives that sequence a
    non-finite row. Returns (those inputs, the fp32 attention of sequence `keep` over the clean cache)."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    batch = q.shape[0] - trailing
    exact = fp32_attention(data, kv_format)[keep]
    lo, hi = kv_indptr[keep].item(), kv_indptr[keep + 1].item()
    kv, scale = kv_data[kv_format]
    outside = torch.ones(kv_indptr[-1].item(), dtype=torch.bool, device=kv.device)
    outside[lo:hi] = False
    kv, scale = kv.clone(), scale.clone()
    if kv_format == "fp8":
        kv.view(torch.uint8)[outside] = 0x7F
    else:
        scale.view(torch.uint8)[:outside.shape[0]][outside] = 0xFF
    poisoned = (q[:batch].contiguous(), dict(kv_data, **{kv_format: (kv, scale)}), qo_indptr[:batch + 1].clone(),
                kv_indptr[:batch + 1].clone(), dict(config, batch_size=batch, kv_seq_len=None))
    return poisoned, exact


def assert_grid_match(decode, expect, lens: list[int], seed: int) -> None:
    """decode(data) (custom_kernel, with the backend and format the environment selects) on grid data of these KV
    lengths (testkit.inputs.generate_grid_input, where the fast kernels' roundings are exact) within
    GRID_REL_L2_BOUND of expect(data), the emulation of what the kernel rounds, worst sequence."""
    data = generate_grid_input(lens, seed=seed)
    error = R.worst_row_relative_l2(decode(data), expect(data))
    bound = GRID_REL_L2_BOUND
    assert error < bound, f"grid data, {len(lens)} sequences: worst sequence {error:.3e} (bound {bound:g})"
