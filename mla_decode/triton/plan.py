"""The triton backend's plans: what a call launches (TritonPlan, triton_plan: splits, tiles, warps, stages, query rows
a program, which split kernel) and what the compiled kernels are specialized on (TritonKey, triton_key), and whether
the backend, and its Hopper kernel, can serve a call. Planning only: nothing here compiles or launches a kernel.
"""

from typing import NamedTuple

import torch

from ..contract import MXFP4_BLOCK, MXFP4_ROW_BYTES, QK_HEAD_DIM, Problem
from .common import (
    NVIDIA_PROGRAMS_PER_SM,
    PROGRAMS_PER_SM,
    SCALED_MFMA_ARCHS,
    TRITON_IMPORT_ERROR,
    TritonTarget,
    triton,
    triton_interpreted,
    triton_target,
)
from .hopper import (
    HOPPER_BF16_PROGRAMS_PER_SM,
    HOPPER_BF16_ROWS,
    HOPPER_KERNEL_REASON,
    HOPPER_PLAN_SHAPE,
    hopper_num_warps,
)

TRITON_BLOCK_H = 16  # query rows (tokens x heads, folded) per program in the default plan: the kernel's N side
# NVIDIA's fast FP8 plan: programs of 32 query rows (8 warps) where heads come in 32s and a program still walks
# WIDE_MIN_TILES tiles, or the grid is more than a wave without splits (triton_plan)
WIDE_BLOCK_H, WIDE_NUM_WARPS, WIDE_MIN_TILES = 32, 8, 32
TRITON_MAX_GRID = 65535  # the split kernel's grid: (splits, groups, batch); CUDA and HIP cap the last two there
# The most shares a balanced schedule cuts a batch into: bounds the partials' workspace and the schedule kernel's
# rounds (a sequence's pieces), far below the 2^16 pieces an item's count field holds
MAX_PARTS = 1024


def query_groups(q_len: int, num_heads: int, block_h: int = TRITON_BLOCK_H) -> int:
    """The programs a sequence's query rows take per split, block_h rows each (the last masked where they do not
    divide q_len x num_heads)."""
    return -(-q_len * num_heads // block_h)


def programs_per_sm(target: TritonTarget) -> int:
    """Split-kernel programs resident at once per SM (CU on AMD), which the splits and the balanced schedule's
    shares fill."""
    return PROGRAMS_PER_SM.get(target.arch, 1) if target.vendor == "amd" else NVIDIA_PROGRAMS_PER_SM


def resident_programs(target: TritonTarget, kv_format: str, hopper: bool) -> int:
    """Programs of a plan's split kernel resident at once per SM: programs_per_sm, but one where the Hopper kernel
    reads BF16 (its tiles take an SM's shared memory)."""
    return HOPPER_BF16_PROGRAMS_PER_SM if hopper and kv_format == "bf16" else programs_per_sm(target)


def balanced_parts(target: TritonTarget, groups: int, resident: int) -> int:
    """The shares a balanced schedule cuts a batch into: one per split-kernel program resident at once (`resident` a
    SM: resident_programs), over the `groups` programs of each piece (every group of a sequence's query rows runs the
    same cut), at most MAX_PARTS. More shares than resident programs would run as a second wave."""
    return max(1, min(MAX_PARTS, resident * target.num_sms // max(groups, 1)))


def triton_unusable_reason(problem: Problem) -> str | None:
    if triton is None:
        return f"triton does not import: {TRITON_IMPORT_ERROR!r}"
    if problem.device.type != "cuda" and not triton_interpreted():
        return f"triton backend: needs a GPU (or TRITON_INTERPRET=1); device is {problem.device}"
    groups = query_groups(problem.q_len, problem.num_heads)
    if max(problem.batch, groups) > TRITON_MAX_GRID:
        return (f"triton backend: batch {problem.batch} and {groups} groups of query rows a sequence must each be at "
                f"most {TRITON_MAX_GRID} (the grid's second and third dimensions)")
    return None


class TritonPlan(NamedTuple):
    num_splits: int  # programs per group of query rows, each over a contiguous share of the sequence's rows
    block_n: int  # rows per tile
    num_warps: int
    num_stages: int  # Triton's software pipeline: num_stages - 1 tiles in flight in shared memory
    scaled_scores: bool = False  # MXFP4: the score product by tl.dot_scaled on the codes (else dequantized K)
    # pages of whole tiles read PAGE_CHUNK_TILES tile bases at a time (else each tile's rows looked up as for small
    # pages): the chunked walk's nested loop does not compile for gfx950 with Triton 3.6 (tools/amd_check.py)
    chunked_pages: bool = True
    # FP8 V cast to the dot type before its transpose (ldmatrix.trans on an fp16 tile, not one shared load a byte):
    # no spills and half the instructions a tile on the H200; AMD keeps the figures tools/amd_check.py gates
    v_cast_first: bool = False
    # query rows per program (a power of 2 >= 16; the last group masked where they do not divide q_len x num_heads):
    # more read each tile for more rows, in fewer programs. triton_plan takes 16, or WIDE_BLOCK_H for NVIDIA's fast
    # FP8 kernel where that wins (its docstring says where); a caller may choose more
    block_h: int = TRITON_BLOCK_H
    # the split kernel for Hopper (hopper.py: Gluon, the products as the cuda kernel takes them) in place of the
    # portable one, for the FP8 cache (fast or precise), the MXFP4 one (fast) and the BF16 one; 16 query rows, 4 warps,
    # two tiles buffered (BF16: 16, 32 or 64 rows, 8 warps above 16)
    hopper: bool = False


def hopper_bf16_rows(query_rows: int) -> int:
    """The query rows a Hopper BF16 program takes for a sequence's `query_rows`: the fewest of HOPPER_BF16_ROWS that
    hold them, at most the largest. More rows a program read each tile for more of them (its products' N), so the
    tile is read and scored by fewer programs; 16 (one warpgroup) where the rows are few (memory-bound)."""
    return next((rows for rows in HOPPER_BF16_ROWS if rows >= query_rows), HOPPER_BF16_ROWS[-1])


def hopper_takes_rows(block_h: int, kv_format: str) -> bool:
    """Whether the Hopper kernel's layouts are written for programs of block_h query rows with this cache: 16
    (HOPPER_PLAN_SHAPE's) for every format, and HOPPER_BF16_ROWS for BF16."""
    return block_h == HOPPER_PLAN_SHAPE[2] or (kv_format == "bf16" and block_h in HOPPER_BF16_ROWS)


def split_kernel_shared_bytes(block_n: int, num_stages: int, kv_format: str) -> int:
    """A model of the split kernel's shared memory: num_stages - 1 buffered tiles plus 2 KB of reduction scratch
    (exact for FP8 at block_n 64 and 16 query rows on gfx950/gfx942, Triton 3.6.0; tools/amd_check.py checks every
    plan's figure)."""
    row_bytes = {"fp8": QK_HEAD_DIM, "mxfp4": MXFP4_ROW_BYTES + QK_HEAD_DIM // MXFP4_BLOCK,
                 "bf16": 2 * QK_HEAD_DIM}[kv_format]
    return (num_stages - 1) * block_n * row_bytes + 2048


def hopper_unusable_reason(target: TritonTarget, kv_format: str, kv_dtype: torch.dtype | None = None,
                           precise: bool = False) -> str | None:
    """Why the Hopper kernel (hopper.py) cannot serve a call of this format, cache dtype (None: the format's
    usual one) and precision on `target`, or None: it takes the e4m3fn FP8 cache (fast or precise), the MXFP4 cache
    (fast) and the BF16 one (its products are the same in either precision) on sm_90, with the Triton it is written
    for."""
    if HOPPER_KERNEL_REASON is not None:
        return HOPPER_KERNEL_REASON
    if target.arch != "sm_90":
        return f"the Hopper kernel is compiled for sm_90; the target is {target.arch}"
    if kv_format == "mxfp4" and precise:
        return "the Hopper kernel takes the MXFP4 cache for its fast (E4M3 Q and P) products only; this call is precise"
    if not (kv_format in ("mxfp4", "bf16") or (kv_format == "fp8" and kv_dtype in (None, torch.float8_e4m3fn))):
        return f"the Hopper kernel takes the float8_e4m3fn, MXFP4 and BF16 caches; got {kv_format} ({kv_dtype})"
    return None


def triton_plan(batch: int, seq_len: int, target: TritonTarget, kv_format: str, query_rows: int = TRITON_BLOCK_H,
                num_heads: int = TRITON_BLOCK_H, precise: bool = False, block_h: int | None = None) -> TritonPlan:
    """The launch plan for `batch` sequences of up to `seq_len` rows and `query_rows` (q_len x num_heads) query rows
    each on `target`: block_n 64; programs of block_h rows (None: 16, or on NVIDIA the fast FP8 kernel's 32 where
    the heads come in 32s and a 32-row program walks at least WIDE_MIN_TILES tiles or the 32-row grid, unsplit, is
    more than the programs resident at once: there each tile serves twice the rows; with fewer tiles a program's
    fixed cost, with fewer programs the idle SMs, outweigh it; the Hopper kernel's BF16: hopper_bf16_rows), 4 warps at
    16 rows and 8 above; splits a power of two that puts batch x groups x splits near the programs resident at once
    (more only add partials and waves); as many stages (3 at most) as fit the target's shared memory. AMD MXFP4 takes
    2 stages (3 spill), and gfx950's dot_scaled MXFP4 1 (2 waves per SIMD). V cast before its transpose
    (v_cast_first): the fast FP8 kernel on NVIDIA only. docs/design-notes.md has the measurements."""
    amd = target.vendor == "amd"
    scaled = kv_format == "mxfp4" and target.arch in SCALED_MFMA_ARCHS  # where the MMAs take E2M1 and E8M0
    hopper_takes = not scaled and hopper_unusable_reason(target, kv_format, precise=precise) is None
    if block_h is None and hopper_takes and kv_format == "bf16":
        block_h = hopper_bf16_rows(query_rows)
    hopper = hopper_takes and (block_h is None or hopper_takes_rows(block_h, kv_format))
    if block_h is None and not hopper:
        block_h = TRITON_BLOCK_H
        if target.vendor == "nvidia" and kv_format == "fp8" and not precise and num_heads % WIDE_BLOCK_H == 0:
            wide = triton_plan(batch, seq_len, target, kv_format, query_rows, num_heads, precise, WIDE_BLOCK_H)
            programs = batch * query_groups(1, query_rows, WIDE_BLOCK_H)
            tiles = -(-seq_len // (wide.block_n * wide.num_splits))
            if tiles >= WIDE_MIN_TILES or (wide.num_splits == 1 and programs > NVIDIA_PROGRAMS_PER_SM * target.num_sms):
                return wide
    block_h = block_h or TRITON_BLOCK_H
    block_n = 64
    num_warps = hopper_num_warps(block_h) if hopper else 4 if block_h == TRITON_BLOCK_H else WIDE_NUM_WARPS
    max_splits = 32 if kv_format == "fp8" or hopper else 64  # Hopper MXFP4: a split expands a tile past its end
    resident = resident_programs(target, kv_format, hopper)
    want = max(1, resident * target.num_sms // max(batch * query_groups(1, query_rows, block_h), 1))
    splits = 1 << (min(want, max(1, seq_len // block_n), max_splits).bit_length() - 1)  # a power of 2, rounded down
    # bf16 at 3 stages asks an H200 for 241,664 B of shared memory (the model counts 2 buffered tiles; Triton holds
    # more): 2 stages
    stage_choices = (1,) if scaled else (2,) if (amd and kv_format == "mxfp4") or kv_format == "bf16" else (3, 2)
    stages = next((s for s in stage_choices if split_kernel_shared_bytes(block_n, s, kv_format) <= target.shared_bytes),
                  1)
    return TritonPlan(splits, block_n, num_warps, stages, scaled, chunked_pages=not amd,
                      v_cast_first=kv_format == "fp8" and not precise and not amd, block_h=block_h, hopper=hopper)


class TritonKey(NamedTuple):
    """What a triton launch depends on: the compiled kernels are specialized on these; lengths and tables are read
    on the device."""

    device: torch.device
    target: TritonTarget
    batch: int
    q_len: int
    num_heads: int
    causal: bool
    kv_format: str
    kv_dtype: torch.dtype
    scale_dtype: torch.dtype | None
    scale_stride: int
    precise: bool
    page_size: int  # 0: ragged
    max_seqlen: int
    write_lse: bool
    plan: TritonPlan  # triton_plan's, or one a caller chose (tests, bench/tune_triton.py)


def triton_key(problem: Problem, target: TritonTarget | None = None, plan: TritonPlan | tuple | None = None
               ) -> TritonKey:
    """The launch key of a problem on its device's target (or `target`), with triton_plan's plan (or `plan`: a
    TritonPlan, or its first fields, the others as triton_plan chooses them for the problem; first fields the Hopper
    kernel cannot take (its tile rows, warps and query rows are fixed) run the portable kernel; a whole plan that asks
    for it where it cannot serve is refused)."""
    target = target or triton_target(problem.device)
    chosen = triton_plan(problem.batch, problem.max_seqlen, target, problem.kv_format,
                         problem.q_len * problem.num_heads, problem.num_heads, problem.precision == "precise")
    given = len(plan) if plan is not None else 0
    plan = chosen if plan is None else TritonPlan(*plan, *chosen[len(plan):])
    if plan.hopper:
        reason = hopper_unusable_reason(target, problem.kv_format, problem.kv_dtype, problem.precision == "precise")
        layouts = (HOPPER_PLAN_SHAPE[0], hopper_num_warps(plan.block_h))  # its tile rows and warps for block_h
        if reason is None and not ((plan.block_n, plan.num_warps) == layouts
                                   and hopper_takes_rows(plan.block_h, problem.kv_format)):
            reason = (f"the Hopper kernel takes (block_n, num_warps, block_h) {HOPPER_PLAN_SHAPE}, or with the BF16 "
                      f"cache block_h in {HOPPER_BF16_ROWS} with its warps; got "
                      f"{(plan.block_n, plan.num_warps, plan.block_h)}")
        if reason is None and plan.scaled_scores:
            reason = "the Hopper kernel has no scaled (E2M1 x E8M0) score product; the plan asks for both"
        if reason is not None and given == len(TritonPlan._fields):
            raise ValueError(f"triton backend: the plan asks for the Hopper kernel (plan.hopper), but {reason}")
        if reason is not None:
            plan = plan._replace(hopper=False)
    if plan.block_h < TRITON_BLOCK_H or plan.block_h & (plan.block_h - 1):
        raise ValueError(f"triton backend: the plan's block_h (query rows a program) must be a power of 2, at least "
                         f"{TRITON_BLOCK_H}; got {plan.block_h}")
    return TritonKey(problem.device, target, problem.batch, problem.q_len, problem.num_heads, problem.causal,
                     problem.kv_format, problem.kv_dtype, problem.scale_dtype, problem.scale_stride,
                     problem.precision == "precise", problem.page_size, problem.max_seqlen, problem.return_lse, plan)

