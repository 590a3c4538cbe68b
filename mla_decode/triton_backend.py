"""The triton backend: one split-KV decode kernel for every KV format and both layouts, and an LSE combine. It runs
on NVIDIA and AMD GPUs (and on the CPU under TRITON_INTERPRET=1); its plans are sized per target.

A sequence's q_len x num_heads query rows are folded as row t * num_heads + h (token t, head h; q's own layout) and
taken BLOCK_H at a time (16 unless the plan says otherwise: TritonPlan.block_h; any head count, the last group's
rows past the sequence's masked): program (split, group, b) walks its share of sequence b's rows in tiles of
BLOCK_N rows, each tile read once for the group's BLOCK_H query rows.
Causal: token t sees the positions before end - (q_len - 1 - t), a mask per query row (a group may span tokens).
Scores are computed transposed, S^T (BLOCK_N x BLOCK_H) = K Q^T, so that the rows are the MMA's M side (wgmma needs
M >= 64); the output likewise, O^T (512 x BLOCK_H) += V^T P^T, in four 128-dim chunks so each operand dies early.
The softmax is online, fp32, base 2. A tile's rows come from the layout: consecutive rows (ragged, or pages of whole
tiles, whose bases are read from the table PAGE_CHUNK_TILES at a time; not on AMD, TritonPlan.chunked_pages) or
one table read per row (smaller pages).

Q and the score product by format (docs/design-notes.md has the measurements behind each choice):
  fp8 fast:    Q to the cache's FP8 type per head in the kernel, an fp8 x fp8 MMA on the tile as it lies.
  fp8 precise: K converted exactly to fp16, Q scaled by a power of two, fp16 MMA with fp32 sums.
  mxfp4:       gfx950: tl.dot_scaled on the codes and block scales as they lie, Q in E4M3 per head. Elsewhere the
               codes become fp16 (value * 2^-6, exact) times the block scale, against fp16 Q * softmax scale.
  bf16:        bf16 Q against the bf16 tile, fp32 sums.
V is the same tile (FP8 and MXFP4 converted to fp16, BF16 as it is; fast FP8 on NVIDIA cast before the transpose).
Under the interpreter the dots take fp32 operands (DOT_DTYPE): its bf16 dots are wrong.
On Hopper with Triton 3.6 the FP8 plans (fast and precise) and the fast MXFP4 ones launch triton_hopper.py's Gluon
kernel in this one's place (TritonPlan.hopper), with the same arguments and combine.
"""

import functools
import os
from typing import NamedTuple

import torch

from .contract import (
    MXFP4_BLOCK,
    MXFP4_ROW_BYTES,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    TRITON_IMPORT_ERROR,
    V_HEAD_DIM,
    Problem,
    tl,
    triton,
)
from .triton_common import _FP4_ROW_BYTES, _LN2, _MX_BLOCK, _QK_DIM, _V_DIM, _lse_at, _sequence
from .triton_hopper import HOPPER_KERNEL_REASON, HOPPER_PLAN_SHAPE, _hopper_split_kernel

TRITON_BLOCK_H = 16  # query rows (tokens x heads, folded) per program in the default plan: the kernel's N side
# NVIDIA's fast FP8 plan: programs of 32 query rows (8 warps) where heads come in 32s and a program still walks
# WIDE_MIN_TILES tiles, or the grid is more than a wave without splits (triton_plan)
WIDE_BLOCK_H, WIDE_NUM_WARPS, WIDE_MIN_TILES = 32, 8, 32
PAGE_CHUNK_TILES = 32  # pages of whole tiles: the tiles whose bases are read from the table at once
TRITON_MAX_GRID = 65535  # the split kernel's grid: (splits, groups, batch); CUDA and HIP cap the last two there


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


def query_groups(q_len: int, num_heads: int, block_h: int = TRITON_BLOCK_H) -> int:
    """The programs a sequence's query rows take per split, block_h rows each (the last masked where they do not
    divide q_len x num_heads)."""
    return -(-q_len * num_heads // block_h)


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


if triton is not None:
    # The problem's sizes as the kernels see them (a jit function reads only constexpr globals); the row widths and
    # LN2 are triton_common's.
    _ROPE_DIM = tl.constexpr(QK_ROPE_HEAD_DIM)  # the rope dims after them: 64
    _PAGE_CHUNK = tl.constexpr(PAGE_CHUNK_TILES)

    @triton.jit
    def _round_to_e4m3(x):
        """fp32 x (|x| <= 448) rounded to the nearest E4M3 value, ties to even, still fp32, so that its cast is exact.
        For Triton's interpreter only (ROUND_FP8), whose fp32 -> fp8 cast drops the carry of a mantissa rounding up
        into the exponent (126.2 -> 64) and rounds ties up; compiled kernels cast with the hardware's rounding."""
        bits = x.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6
        ulp = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): three mantissa bits
        magnitude = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23 rounds to an integer
        return (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # sign

    # 4 packed bytes ($4) -> the e4m3 bytes of their low nibbles and of their high nibbles, interleaved byte by byte
    # -> f16x2 pairs in the values' order: $k = (low, high) nibble of byte k, which the join after it keeps (a pair a
    # register, no byte permutes).
    _MXFP4_PTX = tl.constexpr("""{
    .reg .b32 lo, hi, t, u, p, q;
    .reg .b16 a, b, c, d;
    shl.b32 t, $4, 2;
    shl.b32 u, $4, 4;
    and.b32 t, t, 0x1C1C1C1C;
    and.b32 u, u, 0x80808080;
    or.b32 lo, t, u;
    shr.b32 t, $4, 2;
    and.b32 t, t, 0x1C1C1C1C;
    and.b32 u, $4, 0x80808080;
    or.b32 hi, t, u;
    prmt.b32 p, lo, hi, 0x5140;
    prmt.b32 q, lo, hi, 0x7362;
    mov.b32 {a, b}, p;
    mov.b32 {c, d}, q;
    cvt.rn.f16x2.e4m3x2 $0, a;
    cvt.rn.f16x2.e4m3x2 $1, b;
    cvt.rn.f16x2.e4m3x2 $2, c;
    cvt.rn.f16x2.e4m3x2 $3, d;
    }""")

    @triton.jit
    def _e2m1_as_fp16(codes):
        """E2M1 codes (uint8, 0..15) -> value * 2^-6 in fp16, the PTX recipe in plain Triton ops."""
        bits = ((codes & 7) << 2) | ((codes & 8) << 4)
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @triton.jit
    def _tile_rows(table_row, n0, hi, num_pages, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
        """Where positions n0 .. n0 + BLOCK_N - 1 of a sequence lie, ragged or paged row by row: cache row
        base + offs[r] for tile row r (base an int64 scalar, offs (BLOCK_N,): consecutive rows keep the 64-bit part
        scalar), which rows to read (before hi, on a page in [0, num_pages)), and 1 where a page outside it was met
        (never followed)."""
        r = tl.arange(0, BLOCK_N)
        in_seq = n0 + r < hi
        if PAGE_SIZE == 0:
            return tl.cast(n0, tl.int64), r, in_seq, 0  # ragged positions are rows
        else:
            pos = n0 + r
            page = tl.load(table_row + pos // PAGE_SIZE, mask=in_seq, other=0)
            page_ok = (page >= 0) & (page < num_pages)
            rows = tl.where(page_ok, page, 0).to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
            return tl.zeros([], tl.int64), rows, in_seq & page_ok, tl.max((in_seq & ~page_ok).to(tl.int32), 0)

    @triton.jit
    def _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
                  CACHE: tl.constexpr):
        """Columns COL0:COL0+WIDTH of the MXFP4 rows base + offs as they lie: their E2M1 codes, (BLOCK_N, WIDTH / 2)
        bytes, and their E8M0 block scales, (BLOCK_N, WIDTH / 32) bytes; rows not row_ok read as code 0, scale 127
        (1.0). CACHE: the loads' cache modifier."""
        codes = tl.load(kv_ptr + base * _FP4_ROW_BYTES + COL0 // 2 + offs[:, None] * _FP4_ROW_BYTES
                        + tl.arange(0, WIDTH // 2)[None, :], mask=row_ok[:, None], other=0, cache_modifier=CACHE)
        scales = tl.load(kscale_ptr + base * kscale_stride + offs[:, None] * kscale_stride
                         + (tl.arange(0, WIDTH // _MX_BLOCK) + COL0 // _MX_BLOCK)[None, :], mask=row_ok[:, None],
                         other=127)
        return codes, scales

    @triton.jit
    def _kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
                 TRANS: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
                 V_CAST_FIRST: tl.constexpr = False):
        """Columns COL0:COL0+WIDTH of the cache rows base + offs, (BLOCK_N, WIDTH), or their transpose when TRANS (the
        V^T operand), in DOT_DTYPE. fp8 and bf16: the tile as it lies, converted; mxfp4: the values * 2^-6. Rows not
        row_ok read as 0. V_CAST_FIRST: fp8 V^T converted before its transpose (TritonPlan.v_cast_first)."""
        BLOCK_N: tl.constexpr = row_ok.shape[0]
        if KV_FORMAT != "mxfp4":
            x = tl.load(kv_ptr + base * _QK_DIM + COL0 + offs[:, None] * _QK_DIM + tl.arange(0, WIDTH)[None, :],
                        mask=row_ok[:, None], other=0.0)
            if TRANS and V_CAST_FIRST and KV_FORMAT == "fp8":
                # Triton moves a plain cast after the transpose, which then reads the FP8 bytes one at a time; split
                # and join (of the 4-byte halves of 8, whole registers: no byte permutes) keep it before.
                first, second = x.reshape(BLOCK_N, WIDTH // 8, 2, 4).permute(0, 1, 3, 2).split()
                v = tl.join(first.to(DOT_DTYPE), second.to(DOT_DTYPE)).permute(0, 1, 3, 2)
                return tl.trans(v.reshape(BLOCK_N, WIDTH))
            if TRANS:  # the same load as the K operand: Triton reads both from one shared-memory tile
                x = tl.trans(x)
            return x.to(DOT_DTYPE)
        else:
            NB: tl.constexpr = WIDTH // _MX_BLOCK
            # another cache modifier keeps the V read apart from the K read (no CSE: one register tile for both
            # products was slower)
            packed, sbytes = _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, COL0, WIDTH,
                                       ".ca" if TRANS else "")
            bscale = tl.exp2(sbytes.to(tl.float32) - 127.0).to(tl.float16)
            if USE_ASM:  # a byte's two values as one f16x2 (int32), split into the halves the join puts back
                pairs = tl.inline_asm_elementwise(_MXFP4_PTX, "=r,=r,=r,=r,r", [packed], dtype=tl.int32,
                                                  is_pure=True, pack=4)
                even, odd = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs],
                                                      dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
            else:
                even = _e2m1_as_fp16(packed & 0xF)
                odd = _e2m1_as_fp16(packed >> 4)
            x = tl.join(even, odd).reshape(BLOCK_N, NB, _MX_BLOCK) * bscale[:, :, None]
            x = x.reshape(BLOCK_N, WIDTH).to(DOT_DTYPE)
            if TRANS:
                x = tl.trans(x)
            return x

    @triton.jit
    def _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr, q_t,
                   acc):
        """acc + K[:, COL0:COL0+WIDTH] @ q_t, (BLOCK_N, BLOCK_H) fp32, by tl.dot_scaled on the rows' E2M1 codes and
        E8M0 scales as they lie against q_t (WIDTH, BLOCK_H) E4M3 (gfx950: the scaled MFMA); acc None: 0."""
        codes, scales = _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, COL0, WIDTH, "")
        return tl.dot_scaled(codes, scales, "e2m1", q_t, None, "e4m3", acc)

    @triton.jit
    def _load_rows(at, row_in, PARTIAL_ROWS: tl.constexpr):
        """tl.load(at); PARTIAL_ROWS: 0 where not row_in (a mask broadcast to at's shape: the rows past the
        sequence's)."""
        if PARTIAL_ROWS:
            return tl.load(at, mask=row_in, other=0.0)
        else:
            return tl.load(at)

    @triton.jit
    def _q_cols(q_grp, q_scale, row_in, COL0: tl.constexpr, WIDTH: tl.constexpr, Q_DTYPE: tl.constexpr,
                FP8_MAX: tl.constexpr, ROUND_FP8: tl.constexpr, PARTIAL_ROWS: tl.constexpr):
        """Dims COL0:COL0+WIDTH of the BLOCK_H query rows from q_grp on, transposed, (WIDTH, BLOCK_H), times the
        per-row q_scale (BLOCK_H,), as Q_DTYPE; FP8_MAX > 0: Q_DTYPE is an FP8 type of that largest value, to which
        the values are clamped. PARTIAL_ROWS: rows not row_in (past the sequence's) read as 0."""
        d = COL0 + tl.arange(0, WIDTH)
        x = _load_rows(q_grp + tl.arange(0, q_scale.shape[0])[None, :] * _QK_DIM + d[:, None], row_in[None, :],
                       PARTIAL_ROWS)
        x = x.to(tl.float32) * q_scale[None, :]
        if FP8_MAX > 0:
            x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
            if ROUND_FP8:
                x = _round_to_e4m3(x)
        return x.to(Q_DTYPE)

    @triton.jit
    def _store_chunk(ptr, acc, inv, valid, row_in, COL0: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     PARTIAL_ROWS: tl.constexpr):
        """Writes the (128, BLOCK_H) O^T chunk acc * inv to ptr[r * 512 + COL0 + d] (query row r); NaN where not
        valid; PARTIAL_ROWS: only the rows row_in."""
        d = COL0 + tl.arange(0, acc.shape[0])
        o = tl.where(valid, acc * inv[None, :], float("nan"))
        tl.store(ptr + tl.arange(0, acc.shape[1])[None, :] * _V_DIM + d[:, None], o.to(OUT_DTYPE),
                 mask=row_in[None, :] if PARTIAL_ROWS else None)

    @triton.jit
    def _attend_tile(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, n0, limit, q0, q1, q2, q3, q_rope,
                     s_scale, m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT: tl.constexpr, K_DTYPE: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, SCALED_SCORES: tl.constexpr,
                     CAUSAL: tl.constexpr, V_CAST_FIRST: tl.constexpr):
        """One tile of the online softmax: the scores of rows base + offs, positions n0 .. n0 + BLOCK_N - 1 (those
        not row_ok masked, and under CAUSAL those at or past a query row's limit (BLOCK_H,)), the running max and sum,
        and the four 128-dim chunks of O^T, updated."""
        if SCALED_SCORES:
            s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 0, 128, q0, None)
            s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 128, 128, q1, s)
            s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 256, 128, q2, s)
            s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 384, 128, q3, s)
            s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, _V_DIM, _ROPE_DIM, q_rope, s)
        else:
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 0, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q0)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 128, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q1, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 256, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q2, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 384, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q3, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, _V_DIM, _ROPE_DIM, False,
                                KV_FORMAT, K_DTYPE, USE_ASM), q_rope, s)
        if CAUSAL:
            pos = n0 + tl.arange(0, row_ok.shape[0])
            seen = row_ok[:, None] & (pos[:, None] < limit[None, :])
        else:
            seen = row_ok[:, None]
        s = tl.where(seen, s * s_scale[None, :], float("-inf"))  # (BLOCK_N, BLOCK_H), log2 units
        m_new = tl.maximum(m_i, tl.max(s, 0))
        if CAUSAL:  # a query row that has seen nothing yet keeps p = alpha = 0 (else -inf - -inf = NaN)
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # -inf only for a first tile all on bad pages: NaN, as it must be
            m_base = m_new
        p = tl.exp2(s - m_base[None, :])
        alpha = tl.exp2(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        p = p.to(DOT_DTYPE)
        acc0 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 0, 128, True, KV_FORMAT,
                               DOT_DTYPE, USE_ASM, V_CAST_FIRST), p, acc0 * alpha[None, :])
        acc1 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 128, 128, True, KV_FORMAT,
                               DOT_DTYPE, USE_ASM, V_CAST_FIRST), p, acc1 * alpha[None, :])
        acc2 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 256, 128, True, KV_FORMAT,
                               DOT_DTYPE, USE_ASM, V_CAST_FIRST), p, acc2 * alpha[None, :])
        acc3 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 384, 128, True, KV_FORMAT,
                               DOT_DTYPE, USE_ASM, V_CAST_FIRST), p, acc3 * alpha[None, :])
        return m_i, l_i, acc0, acc1, acc2, acc3

    @triton.jit
    def _mla_split_kernel(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                          lse_ptr, part_o_ptr, part_lse_ptr, qk_scale, NUM_SPLITS: tl.constexpr,
                          BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr,
                          PRECISE: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr,
                          USE_ASM: tl.constexpr, ROUND_FP8: tl.constexpr, USE_PDL: tl.constexpr,
                          SCALED_SCORES: tl.constexpr, WRITE_LSE: tl.constexpr, CHUNKED_PAGES: tl.constexpr,
                          NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, CAUSAL: tl.constexpr,
                          V_CAST_FIRST: tl.constexpr, BLOCK_H: tl.constexpr):
        split = tl.program_id(0)
        group = tl.program_id(1)  # query rows group * BLOCK_H onwards of sequence b: a sequence's groups are
        b = tl.program_id(2)  # launched together, so all but the first read its tiles from L2
        ROWS: tl.constexpr = Q_LEN * NUM_HEADS  # a sequence's query rows
        PARTIAL_ROWS: tl.constexpr = ROWS % BLOCK_H != 0  # the last group has rows past the sequence's: masked
        if USE_PDL:  # let the combine launch (and wait in gdc_wait) while this grid's last wave runs
            tl.extra.cuda.gdc_launch_dependents()
        start, end, valid = _sequence(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE)
        per_split = tl.cdiv(tl.cdiv(end - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, end)
        qrow = group * BLOCK_H + tl.arange(0, BLOCK_H)  # token qrow // NUM_HEADS, head qrow % NUM_HEADS
        row_in = qrow < ROWS
        limit = end - (Q_LEN - 1 - qrow // NUM_HEADS)  # causal: the positions before it are seen
        if PARTIAL_ROWS:  # rows past the sequence's see nothing (and do not lengthen the walk)
            limit = tl.where(row_in, limit, 0)
        if CAUSAL:
            hi = tl.minimum(hi, tl.max(limit, 0))
        first_row = b.to(tl.int64) * ROWS + group * BLOCK_H  # the group's first row in q, out and the partials
        q_grp = q_ptr + first_row * _QK_DIM
        table_row = table_ptr + b.to(tl.int64) * max_pages
        if PAGE_SIZE > 0:
            num_pages = kv_rows // PAGE_SIZE
        else:
            num_pages = kv_rows  # unused

        FP8_Q: tl.constexpr = (KV_FORMAT == "fp8" and not PRECISE) or SCALED_SCORES
        q_fp8_max: tl.constexpr = FP8_MAX if FP8_Q else 0.0
        if KV_FORMAT == "fp8" or SCALED_SCORES:  # one Q scale per head; the fp32 scores get qk_scale / q_scale
            q_row = q_grp + tl.arange(0, BLOCK_H)[:, None] * _QK_DIM
            # rows past the sequence's (PARTIAL_ROWS) read as 0: a finite scale, zero scores
            q_nope = _load_rows(q_row + tl.arange(0, _V_DIM)[None, :], row_in[:, None], PARTIAL_ROWS)
            q_pe = _load_rows(q_row + _V_DIM + tl.arange(0, _ROPE_DIM)[None, :], row_in[:, None], PARTIAL_ROWS)
            q_max = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), 1), tl.max(tl.abs(q_pe.to(tl.float32)), 1))
            if not FP8_Q:  # DOT_DTYPE Q scaled by a power of two (exact) so its largest |q| lies in [2^14, 2^15)
                q_scale = tl.exp2(14.0 - tl.floor(tl.log2(tl.maximum(q_max, 1e-30))))
                q_dtype: tl.constexpr = DOT_DTYPE
            else:  # FP8 Q: the cache's FP8 type, or E4M3 against MXFP4 codes. The scale is the IEEE quotient
                # (div_rn): NVIDIA's `/` is an ulp off at times, which moves Q values at an E4M3 tie a whole step.
                q_scale = tl.math.div_rn(tl.full([BLOCK_H], FP8_MAX, tl.float32), tl.maximum(q_max, 1e-30))
                q_dtype: tl.constexpr = kv_ptr.dtype.element_ty if KV_FORMAT == "fp8" else tl.float8e4nv
            if KV_FORMAT == "fp8":  # the per-tensor KV scale, on the scores and the output
                out_scale = tl.load(kscale_ptr)
                s_scale = out_scale * qk_scale / q_scale
            else:  # dot_scaled's scores are exact values; the dequantized V carries 2^-6 (_kv_cols)
                out_scale = 64.0
                s_scale = qk_scale / q_scale
        elif KV_FORMAT == "bf16":  # bf16 Q as it is against the bf16 tile
            q_scale = tl.full([BLOCK_H], 1.0, tl.float32)
            q_dtype: tl.constexpr = DOT_DTYPE
            out_scale = 1.0
            s_scale = tl.full([BLOCK_H], qk_scale, tl.float32)
        else:  # MXFP4 dequantized: fp16 Q pre-scaled by qk_scale; the codes' 2^6 goes into the scores and the output
            q_scale = tl.full([BLOCK_H], qk_scale, tl.float32)
            q_dtype: tl.constexpr = DOT_DTYPE
            out_scale = 64.0
            s_scale = tl.full([BLOCK_H], 64.0, tl.float32)
        q0 = _q_cols(q_grp, q_scale, row_in, 0, 128, q_dtype, q_fp8_max, ROUND_FP8, PARTIAL_ROWS)
        q1 = _q_cols(q_grp, q_scale, row_in, 128, 128, q_dtype, q_fp8_max, ROUND_FP8, PARTIAL_ROWS)
        q2 = _q_cols(q_grp, q_scale, row_in, 256, 128, q_dtype, q_fp8_max, ROUND_FP8, PARTIAL_ROWS)
        q3 = _q_cols(q_grp, q_scale, row_in, 384, 128, q_dtype, q_fp8_max, ROUND_FP8, PARTIAL_ROWS)
        q_rope = _q_cols(q_grp, q_scale, row_in, _V_DIM, _ROPE_DIM, q_dtype, q_fp8_max, ROUND_FP8, PARTIAL_ROWS)

        if KV_FORMAT == "fp8" and not PRECISE:
            K_DTYPE: tl.constexpr = kv_ptr.dtype.element_ty
        else:
            K_DTYPE: tl.constexpr = DOT_DTYPE
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        bad = tl.zeros([BLOCK_H], tl.int32)  # > 0: a page outside the cache was met (its rows were not read)
        acc0 = tl.zeros([128, BLOCK_H], tl.float32)
        acc1 = tl.zeros([128, BLOCK_H], tl.float32)
        acc2 = tl.zeros([128, BLOCK_H], tl.float32)
        acc3 = tl.zeros([128, BLOCK_H], tl.float32)
        if PAGE_SIZE > 0 and PAGE_SIZE % BLOCK_N == 0 and CHUNKED_PAGES:
            # Pages of whole tiles: a chunk's tile bases are read from the table at once, so that the tiles' own loads
            # depend on no load inside the inner loop (an in-loop table read keeps Triton from pipelining them).
            t = tl.arange(0, _PAGE_CHUNK)
            for c0 in range(lo, hi, _PAGE_CHUNK * BLOCK_N):
                first = c0 + t * BLOCK_N
                in_seq = first < hi
                page = tl.load(table_row + first // PAGE_SIZE, mask=in_seq, other=0)
                page_ok = (page >= 0) & (page < num_pages)
                bad = bad | tl.max((in_seq & ~page_ok).to(tl.int32), 0)
                tile_base = tl.where(page_ok, page, 0).to(tl.int64) * PAGE_SIZE + first % PAGE_SIZE
                for n0 in range(c0, tl.minimum(c0 + _PAGE_CHUNK * BLOCK_N, hi), BLOCK_N):
                    this = t == (n0 - c0) // BLOCK_N
                    base = tl.sum(tl.where(this, tile_base, 0), 0)
                    tile_ok = tl.sum(tl.where(this, page_ok.to(tl.int32), 0), 0) > 0
                    offs = tl.arange(0, BLOCK_N)
                    row_ok = tl.where(tile_ok, n0 + offs < hi, False)
                    m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
                        kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, n0, limit, q0, q1, q2, q3, q_rope,
                        s_scale, m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT, K_DTYPE, DOT_DTYPE, USE_ASM,
                        SCALED_SCORES, CAUSAL, V_CAST_FIRST)
        else:
            for n0 in range(lo, hi, BLOCK_N):
                base, offs, row_ok, tile_bad = _tile_rows(table_row, n0, hi, num_pages, BLOCK_N, PAGE_SIZE)
                if PAGE_SIZE > 0:  # ragged: no page to check, and no loop-carried flag to hold
                    bad = bad | tile_bad
                m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
                    kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, n0, limit, q0, q1, q2, q3, q_rope, s_scale,
                    m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT, K_DTYPE, DOT_DTYPE, USE_ASM, SCALED_SCORES,
                    CAUSAL, V_CAST_FIRST)

        inv = tl.where(l_i > 0, out_scale / l_i, 0.0)  # an empty sequence or split gives zeros
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))  # base 2
        if NUM_SPLITS == 1:
            valid = valid & (tl.max(bad, 0) == 0)
            dst = out_ptr + first_row * _V_DIM
            _store_chunk(dst, acc0, inv, valid, row_in, 0, tl.bfloat16, PARTIAL_ROWS)
            _store_chunk(dst, acc1, inv, valid, row_in, 128, tl.bfloat16, PARTIAL_ROWS)
            _store_chunk(dst, acc2, inv, valid, row_in, 256, tl.bfloat16, PARTIAL_ROWS)
            _store_chunk(dst, acc3, inv, valid, row_in, 384, tl.bfloat16, PARTIAL_ROWS)
            if WRITE_LSE:
                tl.store(_lse_at(lse_ptr, b, qrow, NUM_HEADS, Q_LEN), tl.where(valid, lse2 * _LN2, float("nan")),
                         mask=row_in if PARTIAL_ROWS else None)
        else:  # normalized partial output and its log2-sum-exp (NaN: a page outside the cache); the combine weighs them
            part = b * NUM_SPLITS + split
            dst = part_o_ptr + (part * ROWS + group * BLOCK_H) * _V_DIM
            _store_chunk(dst, acc0, inv, True, row_in, 0, tl.float32, PARTIAL_ROWS)
            _store_chunk(dst, acc1, inv, True, row_in, 128, tl.float32, PARTIAL_ROWS)
            _store_chunk(dst, acc2, inv, True, row_in, 256, tl.float32, PARTIAL_ROWS)
            _store_chunk(dst, acc3, inv, True, row_in, 384, tl.float32, PARTIAL_ROWS)
            tl.store(part_lse_ptr + part * ROWS + qrow, tl.where(bad == 0, lse2, float("nan")),
                     mask=row_in if PARTIAL_ROWS else None)

    @triton.jit
    def _mla_combine_kernel(seq_ptr, max_pages, kv_rows, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
                            NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_DV: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, USE_PDL: tl.constexpr, WRITE_LSE: tl.constexpr,
                            NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr):
        ROWS: tl.constexpr = Q_LEN * NUM_HEADS
        bh = tl.program_id(0)  # b * ROWS + query row
        b = bh // ROWS
        r = bh % ROWS
        dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        _, _, valid = _sequence(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE)
        sp = tl.arange(0, SPLITS_P2)
        row = (b * NUM_SPLITS + sp) * ROWS + r
        if USE_PDL:  # everything above overlapped the split kernel; the partials are read only after it
            tl.extra.cuda.gdc_wait()
        lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
        valid = valid & (tl.sum((lse != lse).to(tl.int32), 0) == 0)  # a split met a page outside the cache
        lse = tl.where(lse == lse, lse, float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
        o = tl.load(part_o_ptr + row[:, None] * _V_DIM + dv[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
        denom = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(out_ptr + bh * _V_DIM + dv, tl.where(valid, res, float("nan")).to(tl.bfloat16))
        if WRITE_LSE:
            if tl.program_id(1) == 0:
                total = tl.where(denom > 0, (m + tl.log2(denom)) * _LN2, float("-inf"))
                tl.store(_lse_at(lse_ptr, b, r, NUM_HEADS, Q_LEN), tl.where(valid, total, float("nan")))


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
    # more read each tile for more rows, in fewer programs. Unmeasured above 16 (docs/2026-12-02-triton-speed.md
    # has the compile figures), so the plans keep 16 and a caller may choose more
    block_h: int = TRITON_BLOCK_H
    # the split kernel for Hopper (triton_hopper.py: Gluon, the products as the cuda kernel takes them) in place of the
    # portable one, for the FP8 cache (fast or precise) and the MXFP4 one (fast); 16 query rows, 4 warps, two tiles
    # buffered
    hopper: bool = False


def split_kernel_shared_bytes(block_n: int, num_stages: int, kv_format: str) -> int:
    """A model of the split kernel's shared memory: num_stages - 1 buffered tiles plus 2 KB of reduction scratch
    (exact for FP8 at block_n 64 and 16 query rows on gfx950/gfx942, Triton 3.6.0; tools/amd_check.py checks every
    plan's figure)."""
    row_bytes = {"fp8": QK_HEAD_DIM, "mxfp4": MXFP4_ROW_BYTES + QK_HEAD_DIM // MXFP4_BLOCK,
                 "bf16": 2 * QK_HEAD_DIM}[kv_format]
    return (num_stages - 1) * block_n * row_bytes + 2048


def hopper_unusable_reason(target: TritonTarget, kv_format: str, kv_dtype: torch.dtype | None = None,
                           precise: bool = False) -> str | None:
    """Why the Hopper kernel (triton_hopper.py) cannot serve a call of this format, cache dtype (None: the format's
    usual one) and precision on `target`, or None: it takes the e4m3fn FP8 cache (fast or precise) and the MXFP4
    cache (fast) on sm_90, with the Triton it is written for."""
    if HOPPER_KERNEL_REASON is not None:
        return HOPPER_KERNEL_REASON
    if target.arch != "sm_90":
        return f"the Hopper kernel is compiled for sm_90; the target is {target.arch}"
    if kv_format == "mxfp4" and precise:
        return "the Hopper kernel takes the MXFP4 cache for its fast (E4M3 Q and P) products only; this call is precise"
    if not (kv_format == "mxfp4" or (kv_format == "fp8" and kv_dtype in (None, torch.float8_e4m3fn))):
        return f"the Hopper kernel takes the float8_e4m3fn and the MXFP4 caches; got {kv_format} ({kv_dtype})"
    return None


def triton_plan(batch: int, seq_len: int, target: TritonTarget, kv_format: str, query_rows: int = TRITON_BLOCK_H,
                num_heads: int = TRITON_BLOCK_H, precise: bool = False, block_h: int | None = None) -> TritonPlan:
    """The launch plan for `batch` sequences of up to `seq_len` rows and `query_rows` (q_len x num_heads) query rows
    each on `target`: block_n 64; programs of block_h rows (None: 16, or on NVIDIA the fast FP8 kernel's 32 where
    the heads come in 32s and a 32-row program walks at least WIDE_MIN_TILES tiles or the 32-row grid, unsplit, is
    more than the programs resident at once: there each tile serves twice the rows; with fewer tiles a program's
    fixed cost, with fewer programs the idle SMs, outweigh it), 4 warps at 16 rows and 8 above; splits a power of two
    that puts batch x groups x splits near the programs resident at once (more only add partials and waves); as many
    stages (3 at most) as fit the target's shared memory. AMD MXFP4 takes 2 stages (3 spill), and gfx950's
    dot_scaled MXFP4 1 (2 waves per SIMD). V cast before its transpose (v_cast_first): the fast FP8 kernel on NVIDIA
    (the precise one ran up to 1.45x slower with it). docs/design-notes.md has the measurements."""
    amd = target.vendor == "amd"
    scaled = kv_format == "mxfp4" and target.arch in SCALED_MFMA_ARCHS  # where the MMAs take E2M1 and E8M0
    hopper = (not scaled and block_h in (None, TRITON_BLOCK_H)
              and hopper_unusable_reason(target, kv_format, precise=precise) is None)
    if block_h is None and not hopper:
        block_h = TRITON_BLOCK_H
        if target.vendor == "nvidia" and kv_format == "fp8" and not precise and num_heads % WIDE_BLOCK_H == 0:
            wide = triton_plan(batch, seq_len, target, kv_format, query_rows, num_heads, precise, WIDE_BLOCK_H)
            programs = batch * query_groups(1, query_rows, WIDE_BLOCK_H)
            tiles = -(-seq_len // (wide.block_n * wide.num_splits))
            if tiles >= WIDE_MIN_TILES or (wide.num_splits == 1 and programs > NVIDIA_PROGRAMS_PER_SM * target.num_sms):
                return wide
    block_h = block_h or TRITON_BLOCK_H
    block_n, num_warps = 64, 4 if block_h == TRITON_BLOCK_H else WIDE_NUM_WARPS
    max_splits = 32 if kv_format == "fp8" or hopper else 64  # Hopper MXFP4: a split expands a tile past its end
    per_sm = PROGRAMS_PER_SM.get(target.arch, 1) if amd else NVIDIA_PROGRAMS_PER_SM
    want = max(1, per_sm * target.num_sms // max(batch * query_groups(1, query_rows, block_h), 1))
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
        if reason is None and (plan.block_n, plan.num_warps, plan.block_h) != HOPPER_PLAN_SHAPE:
            reason = (f"the Hopper kernel takes (block_n, num_warps, block_h) {HOPPER_PLAN_SHAPE}; got "
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


class TritonDecode:
    """The triton backend's plan for a problem: its launch key, the split partials' workspace, grids, meta-arguments
    and, after the first run on a GPU, the compiled kernels' launchers, called with addresses (Triton's JIT dispatch
    costs host time on every call). run() allocates nothing and reads nothing back. Runs of one plan share its
    workspace: they must be issued in order on one queue. `target` and `plan`: as triton_key takes them."""

    def __init__(self, problem: Problem, target: TritonTarget | None = None, plan: TritonPlan | tuple | None = None):
        self.key = key = triton_key(problem, target, plan)
        self.qk_scale = problem.qk_scale
        target, plan = key.target, key.plan
        splits = plan.num_splits
        nvidia, interpreted = target.vendor == "nvidia", target.vendor == "interpreter"
        splits_p2 = triton.next_power_of_2(splits)
        block_dv = min(V_HEAD_DIM, max(16, 8192 // splits_p2))  # a (splits, block_dv) fp32 tile: 64 registers/thread
        query_rows = key.q_len * key.num_heads  # a sequence's, folded token-major as q lays them out
        parts = key.batch * splits if splits > 1 else 0
        self.part_o = torch.empty((parts, query_rows, V_HEAD_DIM), dtype=torch.float32, device=key.device)
        self.part_lse = torch.empty((parts, query_rows), dtype=torch.float32, device=key.device)
        self.workspace = (self.part_o.data_ptr(), self.part_lse.data_ptr())
        # Q's FP8 maximum: the cache's FP8 type (448 e4m3fn, 240 fnuz), E4M3 against MXFP4 codes; none otherwise
        fp8_max = (float(torch.finfo(key.kv_dtype).max) if key.kv_format == "fp8" else
                   float(torch.finfo(torch.float8_e4m3fn).max) if plan.scaled_scores or plan.hopper else 0.0)
        dot_dtype = tl.float32 if interpreted else tl.bfloat16 if key.kv_format == "bf16" else tl.float16
        if plan.hopper:
            split_consts = dict(NUM_SPLITS=splits, PAGE_SIZE=key.page_size, FP8_MAX=fp8_max, WRITE_LSE=key.write_lse,
                                NUM_HEADS=key.num_heads, Q_LEN=key.q_len, CAUSAL=key.causal and key.q_len > 1,
                                PRECISE=key.precise, MXFP4=key.kv_format == "mxfp4")
        else:
            split_consts = dict(NUM_SPLITS=splits, BLOCK_N=plan.block_n, PAGE_SIZE=key.page_size,
                                KV_FORMAT=key.kv_format, PRECISE=key.precise, DOT_DTYPE=dot_dtype, FP8_MAX=fp8_max,
                                USE_ASM=nvidia, ROUND_FP8=interpreted, USE_PDL=nvidia and splits > 1,
                                SCALED_SCORES=plan.scaled_scores, WRITE_LSE=key.write_lse,
                                CHUNKED_PAGES=plan.chunked_pages, NUM_HEADS=key.num_heads, Q_LEN=key.q_len,
                                CAUSAL=key.causal and key.q_len > 1, V_CAST_FIRST=plan.v_cast_first,
                                BLOCK_H=plan.block_h)
        self.split_kernel = _hopper_split_kernel if plan.hopper else _mla_split_kernel
        combine_consts = dict(NUM_SPLITS=splits, SPLITS_P2=splits_p2, BLOCK_DV=block_dv, PAGE_SIZE=key.page_size,
                              USE_PDL=nvidia, WRITE_LSE=key.write_lse, NUM_HEADS=key.num_heads, Q_LEN=key.q_len)
        self.split_grid = (splits, query_groups(key.q_len, key.num_heads, plan.block_h), key.batch)
        self.combine_grid = (key.batch * query_rows, V_HEAD_DIM // block_dv, 1)
        # constexprs in the kernels' parameter order: the compiled kernels take them after the other arguments
        self.split_consts, self.combine_consts = tuple(split_consts.values()), tuple(combine_consts.values())
        self.split_meta = dict(split_consts, **triton_launch_options(target, plan.num_warps, plan.num_stages))
        self.combine_meta = dict(combine_consts, **triton_launch_options(target, 4, pdl=nvidia))
        self.split_run = self.combine_run = None

    def run(self, q, kv, scale, seqs, table, out, lse) -> None:
        """q (batch, q_len, num_heads, 576) bf16; kv (num_rows, width) in the key's format, scale as it has it (fp8
        (1,) fp32, mxfp4 (num_rows, >= 18) E8M0 with the key's row stride, bf16 None); seqs: cache_seqlens (batch,)
        (paged) or kv_indptr (batch + 1,) (ragged); table (batch, max_pages) or None; out (batch, q_len, num_heads,
        512) bf16 and lse (batch, num_heads, q_len) fp32 (None when the key does not write it)."""
        scale = kv if scale is None else scale  # bf16: an unused pointer
        table = seqs if table is None else table  # ragged: an unused pointer
        kv_rows, scale_stride = kv.shape[0], self.key.scale_stride
        max_pages = table.shape[-1] if self.key.page_size else 0
        q_ptr, kv_ptr, scale_ptr, seq_ptr, table_ptr = (q.data_ptr(), kv.data_ptr(), scale.data_ptr(), seqs.data_ptr(),
                                                        table.data_ptr())
        if (q_ptr | kv_ptr | seq_ptr | table_ptr) % 16:
            # A cache one byte off a boundary gives wrong FP8 scores in a kernel compiled for aligned ones (H200,
            # Triton 3.6), so none is compiled for such inputs.
            raise ValueError(f"triton backend: q, the KV cache ({kv.dtype}), the sequence lengths or offsets and the "
                             "page table must start on 16-byte boundaries")
        out_ptr, lse_ptr = out.data_ptr(), 0 if lse is None else lse.data_ptr()
        aligned = scale_ptr % 16 == 0 and lse_ptr % 16 == 0  # read or written element by element: any address
        if self.split_run is not None and aligned:
            part_o, part_lse = self.workspace
            self.split_run(q_ptr, kv_ptr, scale_ptr, scale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                           lse_ptr, part_o, part_lse, self.qk_scale, *self.split_consts)
            if self.combine_run is not None:
                self.combine_run(seq_ptr, max_pages, kv_rows, out_ptr, lse_ptr, part_o, part_lse,
                                 *self.combine_consts)
            return
        if self.key.kv_format == "mxfp4":  # the kernel reads the codes and the E8M0 scales as bytes
            kv, scale = kv.view(torch.uint8), scale.view(torch.uint8)
        lse = out if lse is None else lse  # not written: an unused pointer
        split = self.split_kernel[self.split_grid](q, kv, scale, scale_stride, seqs, table, max_pages, kv_rows, out,
                                                   lse, self.part_o, self.part_lse, self.qk_scale,
                                                   **self.split_meta)
        combine = None
        if self.key.plan.num_splits > 1:
            combine = _mla_combine_kernel[self.combine_grid](seqs, max_pages, kv_rows, out, lse, self.part_o,
                                                             self.part_lse, **self.combine_meta)
        if aligned and split is not None and (combine is not None or self.key.plan.num_splits == 1):
            # the compiled kernels' launchers, with their grids bound once
            self.split_run = split[self.split_grid]
            self.combine_run = combine[self.combine_grid] if combine is not None else None
