"""What the triton backend's modules share: Triton and Gluon as this Python has them (None where they do not import),
the targets its plans and launch options are sized for, and the jit helpers both split kernels (the portable one,
kernels.py; the Hopper one, hopper.py), the combine and aiter's Q quantizer read alike: the row widths and MXFP4's
block as constexprs, a sequence's positions and validity, where a query row's LSE goes, E4M3 rounding for the
interpreter. Importing it never fails; without Triton the helpers are None.
"""

import functools
import os
from typing import NamedTuple

import torch

from ..contract import LN2, MXFP4_BLOCK, MXFP4_ROW_BYTES, QK_HEAD_DIM, V_HEAD_DIM

TRITON_IMPORT_ERROR = None
try:
    import triton
    import triton.language as tl
except ImportError as e:  # no triton here: the triton backend says so when asked (select_backend)
    triton = tl = None
    TRITON_IMPORT_ERROR = e
try:  # Gluon, Triton's explicit-layout dialect (3.5+): the Hopper kernel of the triton backend (hopper.py)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # older Triton: the portable kernel serves Hopper too
    gluon = gl = hopper = async_copy = None


class TritonTarget(NamedTuple):
    """What the plans and launch options depend on besides the call, read once per device (triton_target)."""

    vendor: str  # "nvidia", "amd", or "interpreter" (TRITON_INTERPRET=1 on the CPU)
    arch: str  # "sm_90", "gfx950", "gfx942", ...; "cpu" under the interpreter
    num_sms: int  # SMs (NVIDIA) or CUs (AMD) that the split count fills
    shared_bytes: int  # shared memory (LDS on AMD) one program may use


# LDS per CU by AMD architecture (CDNA3 / CDNA4 ISA guides; torch does not report it on ROCm); others: the smallest.
AMD_LDS_BYTES = {"gfx950": 160 * 1024, "gfx942": 64 * 1024, "gfx941": 64 * 1024, "gfx940": 64 * 1024,
                 "gfx90a": 64 * 1024}
# Split-kernel programs resident per CU, which the split count fills: the waves per SIMD of the offline compile
# (tools/amd_check.py), a 4-warp program being one wave on each of a CU's 4 SIMDs.
PROGRAMS_PER_SM = {"gfx950": 2, "gfx942": 1}
NVIDIA_PROGRAMS_PER_SM = 2  # ~255 registers x 128 threads and ~100 KB of shared memory each
# CDNA4's MFMAs take E2M1 operands with E8M0 block scales: there the MXFP4 scores are tl.dot_scaled on the codes.
SCALED_MFMA_ARCHS = ("gfx950",)
INTERPRETER_TARGET = TritonTarget("interpreter", "cpu", 132, 228 * 1024)  # plans as on an H200


def amd_triton_target(arch: str, num_cus: int) -> TritonTarget:
    """An AMD GPU's target from its architecture ("gfx950") and CU count (tools/amd_check.py builds them so)."""
    return TritonTarget("amd", arch, num_cus, AMD_LDS_BYTES.get(arch, 64 * 1024))


def triton_interpreted() -> bool:
    """Triton's own switch (not a setting of ours): its interpreter runs the kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_target(device: torch.device) -> TritonTarget:
    if device.type != "cuda":
        return INTERPRETER_TARGET
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return amd_triton_target(props.gcnArchName.split(":")[0], props.multi_processor_count)  # "gfx950:sramecc+"
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return TritonTarget("nvidia", f"sm_{props.major}{props.minor}", props.multi_processor_count, shared)


def triton_launch_options(target: TritonTarget, num_warps: int, num_stages: int | None = None,
                          pdl: bool = False) -> dict:
    """Launch options for `target`: AMD's backend refuses NVIDIA's launch_pdl, so it is named on NVIDIA only."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if target.vendor == "nvidia":
        options["launch_pdl"] = pdl
    return options


# without Triton: no kernels to share them
QK_DIM = V_DIM = FP4_ROW_BYTES = MX_BLOCK = TL_LN2 = sequence_span = lse_at = round_to_e4m3 = None

if triton is not None:
    # a jit function reads only constexpr globals
    QK_DIM = tl.constexpr(QK_HEAD_DIM)  # a query/key row: 576
    V_DIM = tl.constexpr(V_HEAD_DIM)  # a value/output row: the first 512
    FP4_ROW_BYTES = tl.constexpr(MXFP4_ROW_BYTES)  # an MXFP4 row: two codes a byte, 288
    MX_BLOCK = tl.constexpr(MXFP4_BLOCK)  # values per E8M0 scale: 32
    TL_LN2 = tl.constexpr(LN2)  # named apart from the contract's float: the bundle is one namespace

    @triton.jit
    def sequence_span(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE: tl.constexpr):
        """(start, end, valid) of sequence b's positions. PAGE_SIZE 0 (ragged): seq_ptr is kv_indptr, and the
        positions kv_indptr[b]:kv_indptr[b+1] are the cache's rows; else seq_ptr is cache_seqlens, the positions are
        0:cache_seqlens[b] and the rows come through the page table. An invalid range or length reads nothing and
        its outputs become NaN."""
        if PAGE_SIZE == 0:
            start = tl.load(seq_ptr + b)
            end = tl.load(seq_ptr + b + 1)
            valid = (start >= 0) & (end >= start) & (end <= kv_rows)
            return tl.where(valid, start, 0), tl.where(valid, end, 0), valid
        else:
            n = tl.load(seq_ptr + b)
            valid = (n >= 0) & (n <= max_pages * PAGE_SIZE)
            return 0, tl.where(valid, n, 0), valid

    @triton.jit
    def lse_at(lse_ptr, b, r, NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr):
        """Where query row r (token r // NUM_HEADS, head r % NUM_HEADS) of sequence b has its LSE: lse is
        (batch, num_heads, q_len)."""
        return lse_ptr + b * (Q_LEN * NUM_HEADS) + (r % NUM_HEADS) * Q_LEN + r // NUM_HEADS

    @triton.jit
    def round_to_e4m3(x):
        """fp32 x (|x| <= 448) rounded to the nearest E4M3 value, ties to even, still fp32, so that its cast is exact.
        For Triton's interpreter only (ROUND_FP8), whose fp32 -> fp8 cast drops the carry of a mantissa rounding up
        into the exponent (126.2 -> 64) and rounds ties up; compiled kernels cast with the hardware's rounding."""
        bits = x.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6
        ulp = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): three mantissa bits
        magnitude = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23 rounds to an integer
        return (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # sign
