"""The triton backend's split kernel for Hopper (sm_90a) and the FP8, MXFP4 and BF16 caches, written in Gluon
(Triton's explicit-layout dialect): the products as the cuda backend's wgmma kernel takes them, which tl.dot's layouts
do not give.

Program (split, group, b) walks its share of sequence b's rows for 16 query rows with one warpgroup (4 warps), as
the portable kernel does (same arguments, same partials for its combine kernel; BALANCED: program (part, group) walks
its part's pieces of the schedule in line order, as there). Per 64-row tile, in shared memory
as wgmma's K-major swizzled layouts (dims 0..511 as four [64][128 B] blocks, 128-byte swizzle; the rope dims
[64][64 B], 64-byte swizzle), two tiles buffered (2 x 36 KB + Q, 9 KB in E4M3 or 18 in fp16: two programs an SM):
  S^T (64 x 16) = K Q^T   FP8 x FP8, both from shared memory, Q in E4M3 with one scale per query row;
  O^T (512 x 16) += V^T P^T  FP8 x FP8: V^T from registers, loaded from the same tile by ldmatrix.trans on pairs of
      bytes and split into the A fragments by byte permutes (no fp16 copy of V); P = 2^8 p in E4M3, in shared memory
      with its rows in the order those fragments give the tile's rows (_k_order).
Output row r of a 128-dim chunk of O^T is dim _dim_of(r): the fragments pair dims 2j and 2j + 1 in one thread.
FP8 tiles come by cp.async. MXFP4 tiles come to registers a tile ahead (codes and E8M0 scales) and are expanded once
into the buffer as E5M2 (an E2M1 value times its block scale, exactly), while the last tile's score product runs;
the products then take E5M2 tiles as they take E4M3 ones. Where a tile's rows are contiguous, L2 is asked for the
tile after the one in the registers (_l2_prefetch_tile), so that their load of it meets L2 rather than DRAM.
The precise mode (PRECISE, FP8 only) rounds nothing beyond the cache, as the portable kernel's: fp16 products, Q
scaled by a power of two, the tile's E4M3 fragments (K's by ldmatrix, V^T's as above) converted to fp16 in the
registers they lie in, P in fp16. A thread's fp16 fragments then hold another k than the FP8 ones did (_f16_k): Q
and P are stored in that order too. BF16 (BF16): the tile as bf16 in the same blocks, 64 dims wide a swizzle row (2
x 72 KB + Q: one program an SM); both products on bf16 wgmma with the tile read from shared memory, V^T as its
blocks transposed (MN-major A), P in bf16 in the tile's row order; O^T's rows are the dims in order. A BF16
program may take 32 or 64 query rows (BLOCK_H) on two warpgroups, so that fewer programs read and score each tile
and each product's N is wider: warpgroup w scores query rows [w BLOCK_H / 2, (w + 1) BLOCK_H / 2) of S^T, and takes
dims [64 w, 64 w + 64) of each 128-dim block of O^T for every row (each row's alpha, 1/l and LSE pass from the
one layout to the other through shared memory). A paged tile's table entries are read a tile ahead of its reads
(_tile_entries).
"""

from ..contract import MXFP4_ROW_BYTES, V_HEAD_DIM
from .common import (
    FP4_ROW_BYTES,
    MX_BLOCK,
    QK_DIM,
    TL_LN2,
    V_DIM,
    async_copy,
    gl,
    gluon,
    hopper,
    lse_at,
    sequence_span,
    triton,
)

HOPPER_PLAN_SHAPE = (64, 4, 16)  # (tile rows, warps, query rows a program) its layouts are written for
HOPPER_BF16_ROWS = (16, 32, 64)  # the query rows a program may take with the BF16 cache (more: two warpgroups)
HOPPER_BF16_PROGRAMS_PER_SM = 1  # a BF16 program's two 72 KB tiles leave no room for a second
P_LOG2_BIAS = 8  # P is stored as 2^8 p (p <= 1): E4M3 keeps its normal range for small p
# The Triton release whose Gluon the kernel is written for (measured on the H200): Gluon is experimental and its API
# changes between releases (3.9 renamed cp.async's load and the CTA barrier), so other releases take the portable one.
GLUON_TRITON = "3.6."


def hopper_num_warps(rows: int) -> int:
    """The warps of a Hopper program of `rows` query rows: one warpgroup at 16, two above."""
    return 4 if rows == 16 else 8


if gluon is None:
    HOPPER_KERNEL_REASON = "this Triton has no Gluon (triton.experimental.gluon)"
elif not triton.__version__.startswith(GLUON_TRITON):
    HOPPER_KERNEL_REASON = (f"the Hopper kernel is written for Triton {GLUON_TRITON}x's Gluon (an experimental API); "
                            f"this is Triton {triton.__version__}")
else:
    HOPPER_KERNEL_REASON = None  # why the plans cannot take the kernel here, or None
hopper_split_kernel = None
# MXFP4 -> E5M2, exactly (the MXFP4 tiles of the Hopper kernel; tests/test_triton.py runs this PTX on the CPU). The
# tables: the E5M2 bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 at block scale 2^0, one word each; a
# block scale 2^k adds 4k to each nonzero byte (E5M2's exponent field), exact for |k| <= E5M2_EXACT_SCALES.
E5M2_TABLES = (0x3E3C3800, 0x46444240)
E5M2_EXACT_SCALES = 13
# A code word (8 values, low nibble first; nibble bit 3 the sign) and the block's tables in: the magnitudes picked by
# byte permutes on the codes' low 3 bits, the signs spread to bit 7 of each byte by permutes in sign-replicate mode.
# Out: the E5M2 words of values 0..3 and 4..7.
E2M1_TO_E5M2_PTX = """{
.reg .b32 m, t, s0, s1;
and.b32 m, $2, 0x77777777;
shl.b32 t, $2, 4;
prmt.b32 s0, t, $2, 0xD9C8;
prmt.b32 s1, t, $2, 0xFBEA;
prmt.b32 $0, $3, $4, m;
shr.b32 m, m, 16;
prmt.b32 $1, $3, $4, m;
and.b32 s0, s0, 0x80808080;
and.b32 s1, s1, 0x80808080;
or.b32 $0, $0, s0;
or.b32 $1, $1, s1;
}"""

# An E8M0 scale byte in ($2), the block's two tables out ($0: codes 0..3, $1: codes 4..7): 4k added to the nonzero
# bytes for k in [-13, 13] (kk = k + 13 in [0, 26]); beyond, the block is flushed to 0 below and NaN above (the E8M0
# NaN, 255, among them: loud rather than plausible), with one select a word for both ends.
E8M0_TO_E5M2_TABLES_PTX = f"""{{
.reg .b32 kk, end;
.reg .pred out;
sub.s32 kk, $2, {127 - E5M2_EXACT_SCALES};
mad.lo.s32 $0, kk, 0x04040400, {(E5M2_TABLES[0] - 4 * E5M2_EXACT_SCALES * 0x01010100) & 0xFFFFFFFF};
mad.lo.s32 $1, kk, 0x04040404, {(E5M2_TABLES[1] - 4 * E5M2_EXACT_SCALES * 0x01010101) & 0xFFFFFFFF};
shr.s32 end, kk, 31;
not.b32 end, end;
and.b32 end, end, 0x7F7F7F7F;
setp.gt.u32 out, kk, {2 * E5M2_EXACT_SCALES};
selp.b32 $0, end, $0, out;
selp.b32 $1, end, $1, out;
}}"""

# A tile's MXFP4 rows asked of L2: $3 rows (none if <= 0) of codes from $1 (contiguous, 16-byte aligned) by one
# bulk prefetch of thread 0, and their E8M0 scale rows from $2 ($4 bytes apart) by one line prefetch each, of threads
# 0 .. $3 - 1. $0 unused.
L2_PREFETCH_PTX = f"""{{
.reg .pred p, q;
.reg .b32 t, n;
.reg .b64 a;
mov.u32 t, %tid.x;
setp.lt.s32 q, t, $3;
setp.eq.and.u32 p, t, 0, q;
mul.lo.s32 n, $3, {MXFP4_ROW_BYTES};
@p cp.async.bulk.prefetch.L2.global [$1], n;
mad.wide.u32 a, t, $4, $2;
@q prefetch.global.L2 [a];
mov.b32 $0, 0;
}}"""

if HOPPER_KERNEL_REASON is None:
    _P_SCALE = gl.constexpr(2.0 ** P_LOG2_BIAS)
    _L2_PREFETCH = gl.constexpr(L2_PREFETCH_PTX)
    _ONE = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # one element in every thread (per-thread inline asm)
    _NCHUNK = gl.constexpr(V_HEAD_DIM // 128)

    # BF16 programs of more than 16 query rows (BLOCK_H) take two warpgroups: the score product's S^T (64 x rows) is
    # split by query rows (a warpgroup scores half of them), each value chunk O^T (128 x rows) by dims (a warpgroup
    # takes 64 of a block's 128 for every row); the copies' layouts then span 8 warps
    _warps = gluon.constexpr_function(hopper_num_warps)

    @gluon.constexpr_function
    def _score_layout(rows, k):
        if rows == 16:
            return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, k])
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, rows // 2, k])

    @gluon.constexpr_function
    def _value_layout(rows, k):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_warps(rows), 1], instr_shape=[16, rows, k])

    # wgmma's accumulator layout for 4 warps (16 query rows): S^T (64 x 16) and each O^T chunk (128 x 16)
    _MMA = gl.constexpr(_score_layout(16, 32))
    _A_FP8 = gl.constexpr(gl.DotOperandLayout(0, _MMA, 4))  # e4m3 A fragments: V^T's (128 x 64); precise: K's too
    # the precise kernel's: fp16 products (k 16 an instruction; the accumulators lie as _MMA's) and their A fragments
    _MMA16 = gl.constexpr(_score_layout(16, 16))
    _A_F16 = gl.constexpr(gl.DotOperandLayout(0, _MMA16, 2))
    # A 128-dim block of the tile as int16 pairs of dims, transposed ([64 pairs][64 rows]), in the layout whose
    # registers ldmatrix.trans fills: lane (g, t4) gets pairs j = g (+ 8 warp + 32 r4), rows 2 t4 + {0, 1}
    # (+ 8 r1 + 16 r2 + 32 r3), r the register bits. Its bytes are the A fragments of _A_FP8 after _v_fragments.
    _PAIRS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [32, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[64, 64]))
    _SW128 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _SW128_16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    _SW64 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))

    @gluon.constexpr_function
    def _blocked(size, threads, rows):
        """A row-major blocked layout over the warps of a program of `rows` query rows."""
        return gl.BlockedLayout(size, threads, [_warps(rows), 1], [1, 0])

    # cp.async's 16-byte pieces: a [64][128 B] block and the [64][64 B] rope block of a tile; Q's [rows][128] blocks
    @gluon.constexpr_function
    def _copy128(rows):
        return _blocked([1, 16], [4, 8], rows)

    @gluon.constexpr_function
    def _copy64(rows):
        return _blocked([1, 16], [8, 4], rows)

    @gluon.constexpr_function
    def _qload(rows):
        return _blocked([1, 8], [2, 16], rows)
    # MXFP4: a tile's codes as words, by 16-byte pieces (one 32-value block, one E8M0 scale): the value dims
    # [64][16][4 words] and the rope dims [64][2][4 words]; their scales and rows in the slices. A warp's value dims
    # are 2 rows x 16 blocks, lanes ordered so that each 8 (one phase of a 16-byte shared store) hold 4 blocks of
    # one 128-dim block and 2 rows: their expanded halves land in 8 distinct 16-byte bank groups of the swizzled
    # tile (lane order rows-then-blocks stored 2-way bank-conflicted)
    _CODES512 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [16, 0, 0], [32, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [0, 4, 0], [0, 8, 0]],
        warp_bases=[[2, 0, 0], [4, 0, 0]], block_bases=[], shape=[64, 16, 4]))
    _CODES64 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [16, 2, 1], [4, 1, 1], [2, 1, 0]))
    _SCALES512 = gl.constexpr(gl.SliceLayout(2, _CODES512))
    _SCALES64 = gl.constexpr(gl.SliceLayout(2, _CODES64))
    _SW128_32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    _SW64_32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2))
    _E2M1_TO_E5M2 = gl.constexpr(E2M1_TO_E5M2_PTX)
    _E8M0_TO_TABLES = gl.constexpr(E8M0_TO_E5M2_TABLES_PTX)

    @gluon.constexpr_function
    def _tile_in_one_page(page_size):
        """Whether a tile (64 rows from a multiple of 64: splits are whole tiles) lies in one page: paged by a
        multiple of 64."""
        return page_size > 0 and page_size % 64 == 0

    @gluon.jit
    def _k_order(x):
        """Rows of x (64, N) in the order the value product's k runs through the tile: k (bits k5..k0) holds tile
        row (k5, k4, k1, k3, k2, k0), the order in which ldmatrix.trans and the byte permutes deliver a thread's
        four tile rows of one A register (rows 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 of each 16)."""
        n: gl.constexpr = x.shape[1]
        return x.reshape([2, 2, 2, 2, 2, 2, n]).permute((0, 1, 3, 4, 2, 5, 6)).reshape([64, n])

    @gluon.jit
    def _dim_of(r):
        """The dim (within its 128-dim block) of V^T / O^T row r of the value product."""
        return ((r >> 3) & 1) | ((r & 7) << 1) | (r & ~15)

    @gluon.jit
    def _v_fragments(block):
        """The A operand V^T (128 x 64 in the tile's FP8 type, rows in _dim_of order, k in _k_order) of a [64][128 B]
        tile block in shared memory: ldmatrix.trans of the block as int16 pairs, then one byte permute per register
        (the even dims of four tile rows from two registers, and the odd ones)."""
        pairs = block._reinterpret(gl.int16, [64, 64], _SW128_16).permute((1, 0)).load(_PAIRS)
        even, odd = gl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x6420; prmt.b32 $1, $2, $3, 0x7531;",
                                              "=r,=r,r,r", [pairs], dtype=(gl.int8, gl.int8), is_pure=True, pack=4)
        v = gl.join(even.to(block.dtype, bitcast=True), odd.to(block.dtype, bitcast=True))  # [pair, row, odd]
        v = v.reshape([2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # pair bits j5..j0, row bits t5..t0, odd
        # A row (r6..r0) = (j5, j4, j3, odd, j2, j1, j0): _dim_of; k (k5..k0) = (t5, t4, t2, t1, t3, t0): _k_order
        v = v.permute((0, 1, 2, 12, 3, 4, 5, 6, 7, 9, 10, 8, 11)).reshape([128, 64])
        return gl.convert_layout(v, _A_FP8, assert_trivial=True)

    @gluon.jit
    def _f16_k(x):
        """x (M, K) with its k reordered as a thread's registers hold it in the fp16 A fragments after the FP8 ones:
        in each 16, k' (bits k'3..k'0) holds k (k1, k3, k2, k0)."""
        m: gl.constexpr = x.shape[0]
        k: gl.constexpr = x.shape[1]
        return x.reshape([m, k // 16, 2, 2, 2, 2]).permute((0, 1, 4, 2, 3, 5)).reshape([m, k])

    @gluon.jit
    def _f16_fragments(a8):
        """The fp16 A operand (exact) of an E4M3 one in _A_FP8, its k in _f16_k order: converted where it lies."""
        return gl.convert_layout(_f16_k(a8.to(gl.float16)), _A_F16, assert_trivial=True)

    @gluon.jit
    def _q_operand(q, PRECISE: gl.constexpr, BF16: gl.constexpr, FP8_MAX: gl.constexpr):
        """Scaled Q rows (16, K) as the score product's B takes them: bf16 (K from shared memory: its order), fp16
        in _f16_k order, or E4M3."""
        if BF16:
            return q.to(gl.bfloat16)
        elif PRECISE:
            return _f16_k(q.to(gl.float16))
        else:
            return gl.minimum(gl.maximum(q, -FP8_MAX), FP8_MAX).to(gl.float8e4nv)

    @gluon.jit
    def _e5m2_tables(e8m0):
        """The E5M2 bytes of the 8 E2M1 magnitudes times 2^(e8m0 - 127), as two prmt table words (int32): exact for
        block scales 2^-13 .. 2^13; smaller ones flush the block to 0 (|values| <= 1.5 x 2^-12), larger ones and
        the E8M0 NaN (255) give NaN (E8M0_TO_E5M2_TABLES_PTX)."""
        return gl.inline_asm_elementwise(_E8M0_TO_TABLES, "=r,=r,r", [e8m0], dtype=(gl.int32, gl.int32),
                                         is_pure=True, pack=1)

    @gluon.jit
    def _mx_load(kv_ptr, kscale_ptr, kscale_stride, base, offs, ok, col0: gl.constexpr, NB: gl.constexpr,
                 layout: gl.constexpr, ROWS32: gl.constexpr):
        """NB 32-value blocks from dim col0 of the MXFP4 rows base + offs (in layout's row slice; rows not ok read
        as zeros): their codes (64, NB, 4) int32 and E8M0 scales (64, NB) int32."""
        blk = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        words = kv_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        if ROWS32:  # the tile's (or its page's) first row, then 32-bit offsets from it
            words += base * (FP4_ROW_BYTES // 4)
            kscale_ptr += base * kscale_stride
            rows = offs
        else:
            rows = base + offs.to(gl.int64)
        at = (rows * (FP4_ROW_BYTES // 4) + col0 // 8)[:, None] + blk[None, :] * 4
        codes = gl.load(words + at[:, :, None] + word[None, None, :], mask=ok[:, None, None], other=0)
        scales = gl.load(kscale_ptr + (rows * kscale_stride + col0 // MX_BLOCK)[:, None] + blk[None, :],
                         mask=ok[:, None], other=127)
        return codes, scales.to(gl.int32)

    @gluon.constexpr_function
    def _mx_rows32(page_size, q_len):
        """Whether the MXFP4 loads address a tile's rows by 32-bit offsets from its first row (or its page's): a
        tile in one page, and ragged tiles of one query token (the MTP kernels spill with them)."""
        return _tile_in_one_page(page_size) or (page_size == 0 and q_len == 1)

    @gluon.jit
    def _l2_prefetch_tile(kv_ptr, kscale_ptr, kscale_stride, table_row, n0, hi, num_pages, PAGE_SIZE: gl.constexpr):
        """L2 asked for the MXFP4 codes and scales of the tile at n0 (none past hi, or in a page outside the cache):
        a tile further ahead than the registers hold. Ragged tiles and tiles in one page (contiguous rows) only."""
        rows = gl.minimum(hi - n0, 64)
        if PAGE_SIZE == 0:
            first = n0.to(gl.int64)
        else:
            entry = gl.load(table_row + n0 // PAGE_SIZE, mask=n0 < hi, other=-1)
            rows = gl.where(_in_cache(entry, num_pages), rows, 0)
            first = entry.to(gl.int64) * PAGE_SIZE + n0 % PAGE_SIZE
        one = gl.full([1], 0, gl.int32, _ONE)
        gl.inline_asm_elementwise(_L2_PREFETCH, "=r,l,l,r,r",
                                  [kv_ptr + first * FP4_ROW_BYTES + one, kscale_ptr + first * kscale_stride + one,
                                   rows + one, kscale_stride + one], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _mx_expand(codes, scales):
        """codes (64, NB, 4) with their scales (64, NB) as E5M2: (64, NB, 8) int32 words, in the dims' order."""
        lo, hi = _e5m2_tables(scales)
        lo, _ = gl.broadcast(lo[:, :, None], codes)
        hi, _ = gl.broadcast(hi[:, :, None], codes)
        first, last = gl.inline_asm_elementwise(_E2M1_TO_E5M2, "=r,=r,r,r,r", [codes, lo, hi],
                                                dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return gl.join(first, last).reshape([64, codes.shape[1], 8])

    @gluon.jit
    def _mx_load_tile(kv_ptr, kscale_ptr, kscale_stride, entries512, entries64, n0, hi, num_pages,
                      PAGE_SIZE: gl.constexpr, ROWS32: gl.constexpr):
        """The MXFP4 tile at n0 in registers, from its table entries (_tile_entries in _SCALES512's and _SCALES64's
        row slices): the codes and scales (_mx_load) of its value dims and of its rope dims, and its first position
        on a page outside the cache (hi if none). ROWS32: addressed by 32-bit offsets from the tile's first row
        (_mx_rows32)."""
        base, offs, ok, bad = _hopper_tile_rows(entries512, n0, hi, num_pages, _SCALES512, PAGE_SIZE)
        c, s = _mx_load(kv_ptr, kscale_ptr, kscale_stride, base, offs, ok, 0, 16, _CODES512, ROWS32)
        base, offs, ok, _ = _hopper_tile_rows(entries64, n0, hi, num_pages, _SCALES64, PAGE_SIZE)
        cr, sr = _mx_load(kv_ptr, kscale_ptr, kscale_stride, base, offs, ok, V_DIM, 2, _CODES64, ROWS32)
        return (c, s, cr, sr), bad

    @gluon.jit
    def _mx_expand_tile(tile, blocks, rope):
        """A tile of _mx_load_tile as E5M2 into its buffers: the four 128-dim blocks, stacked (4 x 64, 128), in one
        store (one barrier), the rope dims (64, 64)."""
        v = _mx_expand(tile[0], tile[1]).reshape([64, 4, 32]).permute((1, 0, 2)).reshape([4 * 64, 32])
        blocks._reinterpret(gl.int32, [4 * 64, 32], _SW128_32).store(v)
        rope._reinterpret(gl.int32, [64, 16], _SW64_32).store(_mx_expand(tile[2], tile[3]).reshape([64, 16]))

    @gluon.jit
    def _copy_tile(kv_ptr, blocks, kr, base, offs128, ok128, offs64, ok64, BLOCK_H: gl.constexpr):
        """cp.async of one tile's rows (cache rows base + offs, rows not ok zero-filled) into its four 128-dim
        blocks, stacked (4 x 64, 128), and its rope block kr (64, 64), by a program of BLOCK_H query rows."""
        c128 = gl.arange(0, 128, layout=gl.SliceLayout(0, _copy128(BLOCK_H)))
        src = kv_ptr + (base + offs128.to(gl.int64))[:, None] * QK_DIM + c128[None, :]
        for c in gl.static_range(_NCHUNK):
            async_copy.async_copy_global_to_shared(blocks.slice(64 * c, 64), src + c * 128, mask=ok128[:, None])
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, _copy64(BLOCK_H)))
        src64 = kv_ptr + (base + offs64.to(gl.int64))[:, None] * QK_DIM + V_DIM + c64[None, :]
        async_copy.async_copy_global_to_shared(kr, src64, mask=ok64[:, None])

    @gluon.jit
    def _tile_entries(table_row, n0, hi, layout: gl.constexpr, PAGE_SIZE: gl.constexpr):
        """The block table's entries of the tile at positions n0 .. n0 + 63 in `layout`'s row slice (paged; positions
        past hi read nothing; pages of a multiple of 64: the tile's one entry, a scalar; ragged: the positions,
        unused). Read apart from _hopper_tile_rows, so that their latency can pass under other work."""
        pos = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        if PAGE_SIZE == 0:
            return pos
        elif _tile_in_one_page(PAGE_SIZE):  # one page, one entry
            return gl.load(table_row + n0 // PAGE_SIZE, mask=n0 < hi, other=0)
        else:
            return gl.load(table_row + pos // PAGE_SIZE, mask=pos < hi, other=0)

    @gluon.jit
    def _in_cache(entries, num_pages):
        """Whether block-table entries name pages of the cache (others: a bad page, read as nothing)."""
        return (entries >= 0) & (entries < num_pages)

    @gluon.jit
    def _hopper_tile_rows(entries, n0, hi, num_pages, layout: gl.constexpr, PAGE_SIZE: gl.constexpr):
        """The tile at n0's rows in `layout`'s row slice: (cache row base, row offsets, rows to read, the first position
        on a page outside the cache, hi if none). Ragged: positions are rows; paged: from its table `entries`."""
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        pos = n0 + r
        in_seq = pos < hi
        if PAGE_SIZE == 0:
            return n0.to(gl.int64), r, in_seq, hi
        else:
            page_ok = _in_cache(entries, num_pages)
            bad = gl.min(gl.where(in_seq & ~page_ok, pos, hi), 0)
            # a bad entry's rows are masked off; page 0 keeps their addresses in the cache
            page_row = gl.where(page_ok, entries, 0).to(gl.int64) * PAGE_SIZE
            if _tile_in_one_page(PAGE_SIZE):  # one page (_tile_entries): its first row, and 32-bit offsets in it
                return page_row, pos % PAGE_SIZE, in_seq & page_ok, bad
            else:
                return gl.to_tensor(0).to(gl.int64), page_row + pos % PAGE_SIZE, in_seq & page_ok, bad

    @gluon.jit
    def _issue_tile(kv_ptr, blocks, kr, entries128, entries64, n0, hi, num_pages, PAGE_SIZE: gl.constexpr,
                    BLOCK_H: gl.constexpr):
        """_copy_tile for the tile at n0, its table entries read in each copy layout (_tile_entries: twice, the
        second from L1); returns its first position on a page outside the cache (hi if none)."""
        base, offs128, ok128, bad = _hopper_tile_rows(entries128, n0, hi, num_pages, _copy128(BLOCK_H), PAGE_SIZE)
        _, offs64, ok64, _ = _hopper_tile_rows(entries64, n0, hi, num_pages, _copy64(BLOCK_H), PAGE_SIZE)
        _copy_tile(kv_ptr, blocks, kr, base, offs128, ok128, offs64, ok64, BLOCK_H)
        return bad

    @gluon.jit
    def _hopper_store_output(out_ptr, lse_ptr, b, first_row, qrow, row_in, at, mask, ok, acc0, acc1, acc2, acc3, inv,
                             lse2, WRITE_LSE: gl.constexpr, NUM_HEADS: gl.constexpr, Q_LEN: gl.constexpr,
                             PARTIAL_ROWS: gl.constexpr):
        """A whole sequence's query rows of one group: its output, bf16 (NaN where not ok, by row), and its LSE."""
        dst = out_ptr + first_row * V_DIM + at
        gl.store(dst, gl.where(ok[None, :], acc0 * inv[None, :], float("nan")).to(gl.bfloat16), mask=mask)
        gl.store(dst + 128, gl.where(ok[None, :], acc1 * inv[None, :], float("nan")).to(gl.bfloat16), mask=mask)
        gl.store(dst + 256, gl.where(ok[None, :], acc2 * inv[None, :], float("nan")).to(gl.bfloat16), mask=mask)
        gl.store(dst + 384, gl.where(ok[None, :], acc3 * inv[None, :], float("nan")).to(gl.bfloat16), mask=mask)
        if WRITE_LSE:
            gl.store(lse_at(lse_ptr, b, qrow, NUM_HEADS, Q_LEN), gl.where(ok, lse2 * TL_LN2, float("nan")),
                     mask=row_in if PARTIAL_ROWS else None)

    @gluon.jit
    def _hopper_store_partial(part_o_ptr, part_lse_ptr, part, group, qrow, row_in, at, mask, bad, acc0, acc1, acc2,
                              acc3, inv, lse2, ROWS: gl.constexpr, PARTIAL_ROWS: gl.constexpr, BLOCK_H: gl.constexpr):
        """A piece's normalized partial output and its log2-sum-exp (NaN: a page outside the cache) into slot
        `part`."""
        dst = part_o_ptr + (part * ROWS + group * BLOCK_H) * V_DIM + at
        gl.store(dst, acc0 * inv[None, :], mask=mask)
        gl.store(dst + 128, acc1 * inv[None, :], mask=mask)
        gl.store(dst + 256, acc2 * inv[None, :], mask=mask)
        gl.store(dst + 384, acc3 * inv[None, :], mask=mask)
        gl.store(part_lse_ptr + part * ROWS + qrow, gl.where(bad == 0, lse2, float("nan")),
                 mask=row_in if PARTIAL_ROWS else None)

    @gluon.jit
    def _hopper_piece(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                      lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, qk_scale, piece, b, group,
                      NUM_SPLITS: gl.constexpr, PAGE_SIZE: gl.constexpr, FP8_MAX: gl.constexpr,
                      WRITE_LSE: gl.constexpr, NUM_HEADS: gl.constexpr, Q_LEN: gl.constexpr, CAUSAL: gl.constexpr,
                      PRECISE: gl.constexpr, MXFP4: gl.constexpr, BF16: gl.constexpr, BALANCED: gl.constexpr,
                      BLOCK_H: gl.constexpr):
        """Group `group` of sequence b's BLOCK_H query rows over one piece of its rows: BALANCED, the schedule's item
        `piece`; else split `piece` of NUM_SPLITS. Its output, or its partial in the piece's slot."""
        ROWS: gl.constexpr = Q_LEN * NUM_HEADS
        PARTIAL_ROWS: gl.constexpr = ROWS % BLOCK_H != 0
        start, end, valid = sequence_span(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE)
        num_pages = kv_rows // PAGE_SIZE if PAGE_SIZE > 0 else kv_rows
        if BALANCED:  # whole 64-row tiles (the schedule's)
            lo = start + gl.load(items_ptr + piece * 4 + 1) * 64
            hi = gl.minimum(start + gl.load(items_ptr + piece * 4 + 2) * 64, end)
        else:
            per_split = gl.cdiv(gl.cdiv(end - start, NUM_SPLITS), 64) * 64
            lo = start + piece * per_split
            hi = gl.minimum(lo + per_split, end)
        gl.static_assert(BLOCK_H == 16 or BF16, "programs of more than 16 query rows read BF16 only")
        WIDE_OPS: gl.constexpr = PRECISE or BF16  # 16-bit products (k 16 an instruction)
        K_STEP: gl.constexpr = 16 if WIDE_OPS else 32
        MMA: gl.constexpr = _score_layout(BLOCK_H, K_STEP)  # S^T's accumulator
        MMA_O: gl.constexpr = _value_layout(BLOCK_H, K_STEP)  # O^T's (MMA itself at 16 query rows)
        cols: gl.constexpr = gl.SliceLayout(0, MMA)  # per query row: the scores' columns
        cols_o: gl.constexpr = gl.SliceLayout(0, MMA_O)  # and the accumulators'
        qrow = group * BLOCK_H + gl.arange(0, BLOCK_H, layout=cols)
        limit = end - (Q_LEN - 1 - qrow // NUM_HEADS)  # causal: the positions before it are seen
        if PARTIAL_ROWS:
            limit = gl.where(qrow < ROWS, limit, 0)
        if CAUSAL:
            hi = gl.minimum(hi, gl.max(limit, 0))
        first_row = b.to(gl.int64) * ROWS + group * BLOCK_H
        table_row = table_ptr + b.to(gl.int64) * max_pages

        # Q with one scale per query row (rows past the sequence's read as 0), into shared memory [BLOCK_H][576]
        QLOAD: gl.constexpr = _qload(BLOCK_H)
        qr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QLOAD))
        q_at = q_ptr + (first_row + qr)[:, None] * QK_DIM
        q_ok = (group * BLOCK_H + qr < ROWS)[:, None]
        c128 = gl.arange(0, 128, layout=gl.SliceLayout(0, QLOAD))
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, QLOAD))
        if BF16:  # bf16 as it comes: no scale, so no row maximum
            q_scale = gl.full([BLOCK_H], 1.0, gl.float32, gl.SliceLayout(1, QLOAD))
        else:
            q_max = gl.max(gl.abs(gl.load(q_at + V_DIM + c64[None, :], mask=q_ok, other=0.0).to(gl.float32)), 1)
            for c in gl.static_range(_NCHUNK):
                q_c = gl.load(q_at + c * 128 + c128[None, :], mask=q_ok, other=0.0).to(gl.float32)
                q_max = gl.maximum(q_max, gl.max(gl.abs(q_c), 1))
            if PRECISE:  # fp16, scaled by a power of two (exact) so that its largest |q| lies in [2^14, 2^15)
                q_scale = gl.exp2(14.0 - gl.floor(gl.log2(gl.maximum(q_max, 1e-30))))
            else:  # E4M3; the IEEE quotient, as the portable kernel takes it
                q_scale = gl.div_rn(gl.full([BLOCK_H], FP8_MAX, gl.float32, gl.SliceLayout(1, QLOAD)),
                                    gl.maximum(q_max, 1e-30))
        # the products' operands
        OP_DTYPE: gl.constexpr = gl.bfloat16 if BF16 else gl.float16 if PRECISE else gl.float8e4nv
        qs = gl.allocate_shared_memory(OP_DTYPE, [4, BLOCK_H, 128], _SW128_16 if WIDE_OPS else _SW128)
        for c in gl.static_range(_NCHUNK):
            q_c = gl.load(q_at + c * 128 + c128[None, :], mask=q_ok, other=0.0).to(gl.float32) * q_scale[:, None]
            qs.index(c).store(_q_operand(q_c, PRECISE, BF16, FP8_MAX))
        q_pe = gl.load(q_at + V_DIM + c64[None, :], mask=q_ok, other=0.0).to(gl.float32) * q_scale[:, None]
        qr_s = gl.allocate_shared_memory(OP_DTYPE, [BLOCK_H, 64], _SW128_16 if WIDE_OPS else _SW64,
                                         _q_operand(q_pe, PRECISE, BF16, FP8_MAX))
        if MXFP4 or BF16:
            kv_scale = 1.0  # MXFP4: the block scales are in the tile; BF16: none
        else:
            kv_scale = gl.load(kscale_ptr)
        s_scale = kv_scale * qk_scale / gl.convert_layout(q_scale, cols)  # scores in log2 units

        # MXFP4: expanded, exactly, to E5M2
        TILE_DTYPE: gl.constexpr = gl.bfloat16 if BF16 else gl.float8e5 if MXFP4 else gl.float8e4nv
        kt = gl.allocate_shared_memory(TILE_DTYPE, [2, 4 * 64, 128], _SW128_16 if BF16 else _SW128)  # 128-dim blocks
        kr = gl.allocate_shared_memory(TILE_DTYPE, [2, 64, 64], _SW128_16 if BF16 else _SW64)
        # P (rows x k): the tile's row order (BF16), else _k_order
        ps = gl.allocate_shared_memory(OP_DTYPE, [BLOCK_H, 64], _SW128_16 if WIDE_OPS else _SW64)
        p_scale: gl.constexpr = 1.0 if WIDE_OPS else _P_SCALE
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, cols)
        l_i = gl.zeros([BLOCK_H], gl.float32, cols)
        first_bad = hi  # the first position on a page outside the cache (its rows were not read); hi if none
        acc0 = gl.zeros([128, BLOCK_H], gl.float32, MMA_O)
        acc1 = gl.zeros([128, BLOCK_H], gl.float32, MMA_O)
        acc2 = gl.zeros([128, BLOCK_H], gl.float32, MMA_O)
        acc3 = gl.zeros([128, BLOCK_H], gl.float32, MMA_O)
        n_tiles = gl.cdiv(hi - lo, 64)
        if MXFP4:  # tiles 0 and 1 requested, tile 0 expanded
            ROWS32: gl.constexpr = _mx_rows32(PAGE_SIZE, Q_LEN)
            first, first_bad = _mx_load_tile(kv_ptr, kscale_ptr, kscale_stride,
                                       _tile_entries(table_row, lo, hi, _SCALES512, PAGE_SIZE),
                                       _tile_entries(table_row, lo, hi, _SCALES64, PAGE_SIZE), lo, hi, num_pages,
                                       PAGE_SIZE, ROWS32)
            codes, bad1 = _mx_load_tile(kv_ptr, kscale_ptr, kscale_stride,
                                        _tile_entries(table_row, lo + 64, hi, _SCALES512, PAGE_SIZE),
                                        _tile_entries(table_row, lo + 64, hi, _SCALES64, PAGE_SIZE), lo + 64, hi,
                                        num_pages, PAGE_SIZE, ROWS32)
            first_bad = gl.minimum(first_bad, bad1)
            _mx_expand_tile(first, kt.index(0), kr.index(0))
            hopper.fence_async_shared()
            gl.thread_barrier()
        else:
            for t in gl.static_range(2):  # the first two tiles (a group committed for each, empty or not)
                if t < n_tiles:
                    n0 = lo + 64 * t
                    first_bad = gl.minimum(first_bad, _issue_tile(
                        kv_ptr, kt.index(t), kr.index(t), _tile_entries(table_row, n0, hi, _copy128(BLOCK_H),
                                                                        PAGE_SIZE),
                        _tile_entries(table_row, n0, hi, _copy64(BLOCK_H), PAGE_SIZE), n0, hi, num_pages, PAGE_SIZE,
                        BLOCK_H))
                async_copy.commit_group()
        tile_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        for i in range(n_tiles):
            buf = i % 2
            tile = kt.index(buf)
            n0 = lo + 64 * i
            # tile i + 2's table entries (none past hi), read before this tile's products rather than behind them
            next128 = _tile_entries(table_row, n0 + 128, hi, _SCALES512 if MXFP4 else _copy128(BLOCK_H), PAGE_SIZE)
            next64 = _tile_entries(table_row, n0 + 128, hi, _SCALES64 if MXFP4 else _copy64(BLOCK_H), PAGE_SIZE)
            if not MXFP4:
                async_copy.wait_group(1)  # tile i has landed (tile i + 1 may be in flight)
                hopper.fence_async_shared()
                gl.thread_barrier()
            s = gl.zeros([64, BLOCK_H], gl.float32, MMA)
            if PRECISE:  # K as fp16 A fragments, a block converted while the last one's product runs (the waits
                # name the fragments the product reads: they stay live until it is done)
                a = _f16_fragments(tile.slice(0, 64).load(_A_FP8))
                for c in gl.static_range(1, _NCHUNK):
                    s = hopper.warpgroup_mma(a, qs.index(c - 1).permute((1, 0)), s, use_acc=c > 1, is_async=True)
                    a_next = _f16_fragments(tile.slice(64 * c, 64).load(_A_FP8))
                    s, a = hopper.warpgroup_mma_wait(0, deps=[s, a])
                    a = a_next
                s = hopper.warpgroup_mma(a, qs.index(_NCHUNK - 1).permute((1, 0)), s, is_async=True)
                a_pe = _f16_fragments(kr.index(buf).load(_A_FP8))
                s, a = hopper.warpgroup_mma_wait(0, deps=[s, a])
                s = hopper.warpgroup_mma(a_pe, qr_s.permute((1, 0)), s, is_async=True)
                s, a_pe = hopper.warpgroup_mma_wait(0, deps=[s, a_pe])
            else:
                s = hopper.warpgroup_mma(tile.slice(0, 64), qs.index(0).permute((1, 0)), s, use_acc=False,
                                         is_async=True)
                for c in gl.static_range(1, _NCHUNK):
                    s = hopper.warpgroup_mma(tile.slice(64 * c, 64), qs.index(c).permute((1, 0)), s, is_async=True)
                s = hopper.warpgroup_mma(kr.index(buf), qr_s.permute((1, 0)), s, is_async=True)
                if MXFP4:  # the next tile expanded while the products run, and the one after it requested
                    _mx_expand_tile(codes, kt.index(1 - buf), kr.index(1 - buf))
                    codes, bad1 = _mx_load_tile(kv_ptr, kscale_ptr, kscale_stride, next128, next64, n0 + 128, hi,
                                                num_pages, PAGE_SIZE, ROWS32)
                    first_bad = gl.minimum(first_bad, bad1)
                    if ROWS32:  # tile i + 3 into L2 for the registers' load of it next iteration (contiguous rows;
                        # not MTP, whose ragged kernel spills with it)
                        _l2_prefetch_tile(kv_ptr, kscale_ptr, kscale_stride, table_row, n0 + 192, hi, num_pages,
                                          PAGE_SIZE)
                s = hopper.warpgroup_mma_wait(0, deps=[s])
            pos = n0 + tile_rows
            seen = (pos < hi)[:, None]
            if CAUSAL:
                seen = seen & (pos[:, None] < limit[None, :])
            s = gl.where(seen, s * s_scale[None, :], float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            m_base = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing keeps p = 0
            alpha = gl.exp2(m_i - m_base)
            p = gl.exp2(s - m_base[None, :])
            l_i = l_i * alpha + gl.sum(p, 0)
            m_i = m_new
            alpha = gl.convert_layout(alpha, cols_o)  # (two warpgroups: each scored half the rows)
            if BF16:
                ps.store(p.to(gl.bfloat16).permute((1, 0)))
            elif PRECISE:
                ps.store(_f16_k(_k_order(p.to(gl.float16)).permute((1, 0))))
            else:
                ps.store(_k_order((p * p_scale).to(gl.float8e4nv)).permute((1, 0)))
            hopper.fence_async_shared()
            gl.thread_barrier()
            pt = ps.permute((1, 0))
            if BF16:  # V^T straight from the tile: each 128-dim block transposed (MN-major A)
                acc0 = hopper.warpgroup_mma(tile.slice(0, 64).permute((1, 0)), pt, acc0 * alpha[None, :],
                                            is_async=True)
                acc1 = hopper.warpgroup_mma(tile.slice(64 * 1, 64).permute((1, 0)), pt, acc1 * alpha[None, :],
                                            is_async=True)
                acc2 = hopper.warpgroup_mma(tile.slice(64 * 2, 64).permute((1, 0)), pt, acc2 * alpha[None, :],
                                            is_async=True)
                acc3 = hopper.warpgroup_mma(tile.slice(64 * 3, 64).permute((1, 0)), pt, acc3 * alpha[None, :],
                                            is_async=True)
                acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3])
            elif PRECISE:  # V^T's fp16 fragments, a block converted while the last one's product runs
                a0 = _f16_fragments(_v_fragments(tile.slice(0, 64)))
                acc0 = hopper.warpgroup_mma(a0, pt, acc0 * alpha[None, :], is_async=True)
                a1 = _f16_fragments(_v_fragments(tile.slice(64 * 1, 64)))
                acc0, a0 = hopper.warpgroup_mma_wait(0, deps=[acc0, a0])
                acc1 = hopper.warpgroup_mma(a1, pt, acc1 * alpha[None, :], is_async=True)
                a2 = _f16_fragments(_v_fragments(tile.slice(64 * 2, 64)))
                acc1, a1 = hopper.warpgroup_mma_wait(0, deps=[acc1, a1])
                acc2 = hopper.warpgroup_mma(a2, pt, acc2 * alpha[None, :], is_async=True)
                a3 = _f16_fragments(_v_fragments(tile.slice(64 * 3, 64)))
                acc2, a2 = hopper.warpgroup_mma_wait(0, deps=[acc2, a2])
                acc3 = hopper.warpgroup_mma(a3, pt, acc3 * alpha[None, :], is_async=True)
                acc0, acc1, acc2, acc3, a3 = hopper.warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3, a3])
            else:  # (Triton 3.6's wait takes no 8-bit operands: the FP8 fragments are not named)
                a0 = _v_fragments(tile.slice(0, 64))
                acc0 = hopper.warpgroup_mma(a0, pt, acc0 * alpha[None, :], is_async=True)
                a1 = _v_fragments(tile.slice(64 * 1, 64))
                acc1 = hopper.warpgroup_mma(a1, pt, acc1 * alpha[None, :], is_async=True)
                a2 = _v_fragments(tile.slice(64 * 2, 64))
                acc2 = hopper.warpgroup_mma(a2, pt, acc2 * alpha[None, :], is_async=True)
                a3 = _v_fragments(tile.slice(64 * 3, 64))
                acc3 = hopper.warpgroup_mma(a3, pt, acc3 * alpha[None, :], is_async=True)
                acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3])
            gl.thread_barrier()  # every warp is done with the tile's buffer and P
            if not MXFP4:
                if i + 2 < n_tiles:
                    first_bad = gl.minimum(first_bad, _issue_tile(kv_ptr, tile, kr.index(buf), next128, next64,
                                                                  n0 + 128, hi, num_pages, PAGE_SIZE, BLOCK_H))
                async_copy.commit_group()
        if not MXFP4:
            async_copy.wait_group(0)

        # the rows' figures in the accumulators' columns
        inv = gl.convert_layout(gl.where(l_i > 0, kv_scale / (p_scale * l_i), 0.0), cols_o)  # empty: zeros
        lse2 = gl.convert_layout(gl.where(l_i > 0, m_i + gl.log2(l_i), float("-inf")), cols_o)
        limit = gl.convert_layout(limit, cols_o)
        h = gl.arange(0, BLOCK_H, layout=cols_o)
        qrow = group * BLOCK_H + h
        row_in = qrow < ROWS
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA_O))
        at = h[None, :] * V_DIM + (r if BF16 else _dim_of(r))[:, None]
        mask = row_in[None, :] if PARTIAL_ROWS else None
        # a row is bad where it would have seen that position: a causal token that stops before it keeps its value.
        # limit * 0 + hi: hi as a (BLOCK_H,) row vector in `cols_o`, the layout of the rows' flags
        bad = (first_bad < (gl.minimum(limit, hi) if CAUSAL else limit * 0 + hi)).to(gl.int32)
        if BALANCED:  # a sequence of one piece is written here, the pieces of the others to their item's slot
            if (gl.load(items_ptr + piece * 4 + 3) & 0xFFFF) == 1:
                _hopper_store_output(out_ptr, lse_ptr, b, first_row, qrow, row_in, at, mask, valid & (bad == 0), acc0,
                                     acc1, acc2, acc3, inv, lse2, WRITE_LSE, NUM_HEADS, Q_LEN, PARTIAL_ROWS)
            else:
                _hopper_store_partial(part_o_ptr, part_lse_ptr, piece.to(gl.int64), group, qrow, row_in, at, mask, bad,
                                      acc0, acc1, acc2, acc3, inv, lse2, ROWS, PARTIAL_ROWS, BLOCK_H)
        elif NUM_SPLITS == 1:
            _hopper_store_output(out_ptr, lse_ptr, b, first_row, qrow, row_in, at, mask, valid & (bad == 0), acc0,
                                 acc1, acc2, acc3, inv, lse2, WRITE_LSE, NUM_HEADS, Q_LEN, PARTIAL_ROWS)
        else:
            _hopper_store_partial(part_o_ptr, part_lse_ptr, b * NUM_SPLITS + piece, group, qrow, row_in, at, mask,
                                  bad, acc0, acc1, acc2, acc3, inv, lse2, ROWS, PARTIAL_ROWS, BLOCK_H)

    @gluon.jit
    def hopper_split_kernel(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows,
                             out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, part_first_ptr, qk_scale,
                             NUM_SPLITS: gl.constexpr, PAGE_SIZE: gl.constexpr, FP8_MAX: gl.constexpr,
                             WRITE_LSE: gl.constexpr, NUM_HEADS: gl.constexpr, Q_LEN: gl.constexpr,
                             CAUSAL: gl.constexpr, PRECISE: gl.constexpr, MXFP4: gl.constexpr, BF16: gl.constexpr,
                             BALANCED: gl.constexpr, BLOCK_H: gl.constexpr):
        # the portable kernel's arguments, so that TritonDecode launches either (FP8: kscale_stride unused); BALANCED:
        # program (part, group) walks its part's pieces, as the portable kernel does
        gl.static_assert(not (MXFP4 and PRECISE), "MXFP4 is expanded for the fast products only")
        gl.static_assert(not (BF16 and (MXFP4 or PRECISE)), "BF16 takes its own products (PRECISE: FP8's fp16 ones)")
        group = gl.program_id(1)
        if BALANCED:
            part = gl.program_id(0)
            for item in range(gl.load(part_first_ptr + part), gl.load(part_first_ptr + part + 1)):
                _hopper_piece(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows,
                              out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, qk_scale, item,
                              gl.load(items_ptr + item * 4), group, NUM_SPLITS, PAGE_SIZE, FP8_MAX, WRITE_LSE,
                              NUM_HEADS, Q_LEN, CAUSAL, PRECISE, MXFP4, BF16, BALANCED, BLOCK_H)
        else:
            _hopper_piece(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                          lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, qk_scale, gl.program_id(0), gl.program_id(2),
                          group, NUM_SPLITS, PAGE_SIZE, FP8_MAX, WRITE_LSE, NUM_HEADS, Q_LEN, CAUSAL, PRECISE, MXFP4,
                          BF16, BALANCED, BLOCK_H)
