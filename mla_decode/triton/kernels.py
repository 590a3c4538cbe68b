"""The triton backend's portable kernels: one split-KV decode kernel for every KV format and both layouts, and an LSE
combine. They run on NVIDIA and AMD GPUs (and on the CPU under TRITON_INTERPRET=1); plan.py sizes their plans per
target, decode.py launches them.

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
On Hopper with Triton 3.6 the FP8 plans (fast and precise) and the fast MXFP4 ones launch hopper.py's Gluon
kernel in this one's place (TritonPlan.hopper), with the same arguments and combine.

Two ways to cut the work (TritonDecode's schedule). Fixed: program (split, group, b) takes split `split` of
NUM_SPLITS equal ones of sequence b. BALANCED: mla_schedule_kernel first lists the pieces of the work-balanced
schedule (mla_decode/schedule.py) from the lengths on the device; program (part, group) walks its part's pieces in
line order (persistent: one program a part, no second wave), each tiles [first, end) of its sequence, and a sequence
of one piece writes its output directly, else its pieces' partials (a slot an item) are merged by the combine.
"""

from ..contract import QK_ROPE_HEAD_DIM
from ..schedule import SEQUENCE_COST
from .common import (
    FP4_ROW_BYTES,
    MX_BLOCK,
    QK_DIM,
    TL_LN2,
    V_DIM,
    lse_at,
    round_to_e4m3,
    sequence_span,
    tl,
    triton,
)

PAGE_CHUNK_TILES = 32  # pages of whole tiles: the tiles whose bases are read from the table at once
ITEM_FIELDS = 4  # a schedule item: {b, first tile, end tile, index << 16 | count} (mla_schedule_kernel)
# without Triton: no kernels (the backend is unusable, plan.triton_unusable_reason)
mla_split_kernel = mla_combine_kernel = mla_schedule_kernel = None

if triton is not None:
    # The problem's sizes as the kernels see them (a jit function reads only constexpr globals); the row widths and
    # LN2 are common.py's.
    _ROPE_DIM = tl.constexpr(QK_ROPE_HEAD_DIM)  # the rope dims after them: 64
    _PAGE_CHUNK = tl.constexpr(PAGE_CHUNK_TILES)
    _SEQUENCE_COST = tl.constexpr(SEQUENCE_COST)
    _ITEM_FIELDS = tl.constexpr(ITEM_FIELDS)

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
        scalar), which rows to read (before hi, on a page in [0, num_pages)), and the first position on a page
        outside it (never followed; hi if none)."""
        r = tl.arange(0, BLOCK_N)
        in_seq = n0 + r < hi
        if PAGE_SIZE == 0:
            return tl.cast(n0, tl.int64), r, in_seq, hi  # ragged positions are rows
        else:
            pos = n0 + r
            page = tl.load(table_row + pos // PAGE_SIZE, mask=in_seq, other=0)
            page_ok = (page >= 0) & (page < num_pages)
            rows = tl.where(page_ok, page, 0).to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
            return tl.zeros([], tl.int64), rows, in_seq & page_ok, tl.min(tl.where(in_seq & ~page_ok, pos, hi), 0)

    @triton.jit
    def _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
                  CACHE: tl.constexpr):
        """Columns COL0:COL0+WIDTH of the MXFP4 rows base + offs as they lie: their E2M1 codes, (BLOCK_N, WIDTH / 2)
        bytes, and their E8M0 block scales, (BLOCK_N, WIDTH / 32) bytes; rows not row_ok read as code 0, scale 127
        (1.0). CACHE: the loads' cache modifier."""
        codes = tl.load(kv_ptr + base * FP4_ROW_BYTES + COL0 // 2 + offs[:, None] * FP4_ROW_BYTES
                        + tl.arange(0, WIDTH // 2)[None, :], mask=row_ok[:, None], other=0, cache_modifier=CACHE)
        scales = tl.load(kscale_ptr + base * kscale_stride + offs[:, None] * kscale_stride
                         + (tl.arange(0, WIDTH // MX_BLOCK) + COL0 // MX_BLOCK)[None, :], mask=row_ok[:, None],
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
            x = tl.load(kv_ptr + base * QK_DIM + COL0 + offs[:, None] * QK_DIM + tl.arange(0, WIDTH)[None, :],
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
            NB: tl.constexpr = WIDTH // MX_BLOCK
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
            x = tl.join(even, odd).reshape(BLOCK_N, NB, MX_BLOCK) * bscale[:, :, None]
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
        x = _load_rows(q_grp + tl.arange(0, q_scale.shape[0])[None, :] * QK_DIM + d[:, None], row_in[None, :],
                       PARTIAL_ROWS)
        x = x.to(tl.float32) * q_scale[None, :]
        if FP8_MAX > 0:
            x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
            if ROUND_FP8:
                x = round_to_e4m3(x)
        return x.to(Q_DTYPE)

    @triton.jit
    def _store_chunk(ptr, acc, inv, valid, row_in, COL0: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     PARTIAL_ROWS: tl.constexpr):
        """Writes the (128, BLOCK_H) O^T chunk acc * inv to ptr[r * 512 + COL0 + d] (query row r); NaN where not
        valid (a scalar, or (BLOCK_H,) by row); PARTIAL_ROWS: only the rows row_in."""
        d = COL0 + tl.arange(0, acc.shape[0])
        o = tl.where(valid, acc * inv[None, :], float("nan"))
        tl.store(ptr + tl.arange(0, acc.shape[1])[None, :] * V_DIM + d[:, None], o.to(OUT_DTYPE),
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
            s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, V_DIM, _ROPE_DIM, q_rope, s)
        else:
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 0, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q0)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 128, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q1, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 256, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q2, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, 384, 128, False, KV_FORMAT,
                                K_DTYPE, USE_ASM), q3, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, V_DIM, _ROPE_DIM, False,
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
    def _sequence_tiles(seq_ptr, b, in_batch, max_pages, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """The KV tiles of sequences b (in_batch: those in the batch; others 0), int64: schedule.py's sequence_tiles,
        0 for an invalid length or range. A ragged range is judged without the cache's rows (as the cuda schedule's:
        a schedule is made from kv_indptr alone): one past them costs its tiles, and the split kernel reads none."""
        if PAGE_SIZE == 0:
            start = tl.load(seq_ptr + b, mask=in_batch, other=0)
            end = tl.load(seq_ptr + b + 1, mask=in_batch, other=0)
            length = tl.where((start >= 0) & (end >= start), end.to(tl.int64) - start, 0)
        else:
            length = tl.load(seq_ptr + b, mask=in_batch, other=0).to(tl.int64)
            length = tl.where((length >= 0) & (length <= max_pages.to(tl.int64) * PAGE_SIZE), length, 0)
        return (length + BLOCK_N - 1) // BLOCK_N

    @triton.jit
    def mla_schedule_kernel(seq_ptr, max_pages, items_ptr, first_ptr, part_first_ptr, batch, parts, max_items,
                            min_share, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        """One program: the pieces of the work-balanced schedule of the lengths (seq_ptr: cache_seqlens, or kv_indptr
        where PAGE_SIZE is 0) cut into `parts` shares of tiles of BLOCK_N rows, each at least min_share units,
        exactly as schedule.py's
        schedule_items lists them: items (max_items, 4) int32 rows {b, first tile, end tile, index << 16 | count},
        then {-1, 0, 0, 0}; first (batch,) int32, the item of each sequence's first piece (the combine's); and
        part_first (parts + 1,) int32, schedule.py's part_first (the split kernel's programs walk their part's items).
        The sequences come BLOCK_B at a time: one pass sums the line's length, a second cuts it by prefix sums."""
        r = tl.arange(0, BLOCK_B)
        field = tl.arange(0, _ITEM_FIELDS)[None, :]
        total = tl.full([], 0, tl.int64)
        for b0 in range(0, batch, BLOCK_B):
            in_batch = b0 + r < batch
            tiles = _sequence_tiles(seq_ptr, b0 + r, in_batch, max_pages, PAGE_SIZE, BLOCK_N)
            total += tl.sum(tl.where(in_batch, tiles + _SEQUENCE_COST, 0), 0)
        share = tl.maximum((total + parts - 1) // parts, min_share)
        line = tl.full([], 0, tl.int64)  # where this block's first sequence starts on the line
        item = tl.full([], 0, tl.int32)  # its first piece
        for b0 in range(0, batch, BLOCK_B):
            b = b0 + r
            in_batch = b < batch
            cost = tl.where(in_batch, _sequence_tiles(seq_ptr, b, in_batch, max_pages, PAGE_SIZE, BLOCK_N)
                            + _SEQUENCE_COST, 0)
            start = line + tl.cumsum(cost, 0) - cost
            first_part = start // share
            count = tl.where(in_batch, ((start + cost - 1) // share - first_part + 1).to(tl.int32), 0)
            first = item + tl.cumsum(count, 0) - count
            tl.store(first_ptr + b, first, mask=in_batch)
            # piece j of every sequence of the block at once: as many rounds as its longest sequence has pieces
            for j in range(0, tl.max(count, 0)):
                part = first_part + j
                lo = tl.maximum(tl.maximum(start, part * share) - start - _SEQUENCE_COST, 0)
                hi = tl.maximum(tl.minimum(start + cost, (part + 1) * share) - start - _SEQUENCE_COST, lo)
                row = tl.where(field == 0, b[:, None], tl.where(field == 1, lo.to(tl.int32)[:, None], tl.where(
                    field == 2, hi.to(tl.int32)[:, None], ((j << 16) | count)[:, None])))
                tl.store(items_ptr + (first + j)[:, None] * _ITEM_FIELDS + field, row, mask=(j < count)[:, None])
                # a part's first piece starts on its share's first unit: every part before the line's end has one
                tl.store(part_first_ptr + part, first + j, mask=(j < count) & (tl.maximum(start, part * share)
                                                                               == part * share))
            line += tl.sum(cost, 0)
            item += tl.sum(count, 0)
        for k0 in range(0, max_items, BLOCK_B):
            k = k0 + r
            tl.store(items_ptr + k[:, None] * _ITEM_FIELDS + field, tl.where(field == 0, -1, 0),
                     mask=((k >= item) & (k < max_items))[:, None])
        # the parts past the line's end (share rounds up) take none; part_first[parts] closes the last part
        for p0 in range((total + share - 1) // share, parts + 1, BLOCK_B):
            tl.store(part_first_ptr + p0 + r, item, mask=p0 + r <= parts)

    @triton.jit
    def _store_output(out_ptr, lse_ptr, b, first_row, qrow, row_in, valid, acc0, acc1, acc2, acc3, inv, lse2,
                      WRITE_LSE: tl.constexpr, NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr,
                      PARTIAL_ROWS: tl.constexpr):
        """A whole sequence's group of query rows: its output, bf16 (NaN where not valid), and its LSE."""
        dst = out_ptr + first_row * V_DIM
        _store_chunk(dst, acc0, inv, valid, row_in, 0, tl.bfloat16, PARTIAL_ROWS)
        _store_chunk(dst, acc1, inv, valid, row_in, 128, tl.bfloat16, PARTIAL_ROWS)
        _store_chunk(dst, acc2, inv, valid, row_in, 256, tl.bfloat16, PARTIAL_ROWS)
        _store_chunk(dst, acc3, inv, valid, row_in, 384, tl.bfloat16, PARTIAL_ROWS)
        if WRITE_LSE:
            tl.store(lse_at(lse_ptr, b, qrow, NUM_HEADS, Q_LEN), tl.where(valid, lse2 * TL_LN2, float("nan")),
                     mask=row_in if PARTIAL_ROWS else None)

    @triton.jit
    def _store_partial(part_o_ptr, part_lse_ptr, part, group, qrow, row_in, bad, acc0, acc1, acc2, acc3, inv, lse2,
                       ROWS: tl.constexpr, BLOCK_H: tl.constexpr, PARTIAL_ROWS: tl.constexpr):
        """A piece's normalized partial output, fp32, and its log2-sum-exp (NaN: a page outside the cache) into
        slot `part` of the partials; the combine weighs them."""
        dst = part_o_ptr + (part * ROWS + group * BLOCK_H) * V_DIM
        _store_chunk(dst, acc0, inv, True, row_in, 0, tl.float32, PARTIAL_ROWS)
        _store_chunk(dst, acc1, inv, True, row_in, 128, tl.float32, PARTIAL_ROWS)
        _store_chunk(dst, acc2, inv, True, row_in, 256, tl.float32, PARTIAL_ROWS)
        _store_chunk(dst, acc3, inv, True, row_in, 384, tl.float32, PARTIAL_ROWS)
        tl.store(part_lse_ptr + part * ROWS + qrow, tl.where(bad == 0, lse2, float("nan")),
                 mask=row_in if PARTIAL_ROWS else None)

    @triton.jit
    def _split_piece(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                     lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, qk_scale, piece, b, group, NUM_SPLITS: tl.constexpr,
                     BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr, PRECISE: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, USE_ASM: tl.constexpr, ROUND_FP8: tl.constexpr,
                     SCALED_SCORES: tl.constexpr, WRITE_LSE: tl.constexpr, CHUNKED_PAGES: tl.constexpr,
                     NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, CAUSAL: tl.constexpr, V_CAST_FIRST: tl.constexpr,
                     BLOCK_H: tl.constexpr, BALANCED: tl.constexpr):
        """Group `group` of sequence b's query rows over one piece of its rows: BALANCED, the schedule's item `piece`;
        else split `piece` of NUM_SPLITS. Its output, or its partial in the piece's slot."""
        ROWS: tl.constexpr = Q_LEN * NUM_HEADS  # a sequence's query rows
        PARTIAL_ROWS: tl.constexpr = ROWS % BLOCK_H != 0  # the last group has rows past the sequence's: masked
        start, end, valid = sequence_span(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE)
        if BALANCED:  # whole tiles of BLOCK_N rows (the schedule's), so pages of whole tiles keep a tile in one page
            lo = start + tl.load(items_ptr + piece * _ITEM_FIELDS + 1) * BLOCK_N
            hi = tl.minimum(start + tl.load(items_ptr + piece * _ITEM_FIELDS + 2) * BLOCK_N, end)
        else:
            per_split = tl.cdiv(tl.cdiv(end - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = start + piece * per_split
            hi = tl.minimum(lo + per_split, end)
        qrow = group * BLOCK_H + tl.arange(0, BLOCK_H)  # token qrow // NUM_HEADS, head qrow % NUM_HEADS
        row_in = qrow < ROWS
        limit = end - (Q_LEN - 1 - qrow // NUM_HEADS)  # causal: the positions before it are seen
        if PARTIAL_ROWS:  # rows past the sequence's see nothing (and do not lengthen the walk)
            limit = tl.where(row_in, limit, 0)
        if CAUSAL:
            hi = tl.minimum(hi, tl.max(limit, 0))
        first_row = b.to(tl.int64) * ROWS + group * BLOCK_H  # the group's first row in q, out and the partials
        q_grp = q_ptr + first_row * QK_DIM
        table_row = table_ptr + b.to(tl.int64) * max_pages
        if PAGE_SIZE > 0:
            num_pages = kv_rows // PAGE_SIZE
        else:
            num_pages = kv_rows  # unused

        FP8_Q: tl.constexpr = (KV_FORMAT == "fp8" and not PRECISE) or SCALED_SCORES
        q_fp8_max: tl.constexpr = FP8_MAX if FP8_Q else 0.0
        if KV_FORMAT == "fp8" or SCALED_SCORES:  # one Q scale per head; the fp32 scores get qk_scale / q_scale
            q_row = q_grp + tl.arange(0, BLOCK_H)[:, None] * QK_DIM
            # rows past the sequence's (PARTIAL_ROWS) read as 0: a finite scale, zero scores
            q_nope = _load_rows(q_row + tl.arange(0, V_DIM)[None, :], row_in[:, None], PARTIAL_ROWS)
            q_pe = _load_rows(q_row + V_DIM + tl.arange(0, _ROPE_DIM)[None, :], row_in[:, None], PARTIAL_ROWS)
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
        q_rope = _q_cols(q_grp, q_scale, row_in, V_DIM, _ROPE_DIM, q_dtype, q_fp8_max, ROUND_FP8, PARTIAL_ROWS)

        if KV_FORMAT == "fp8" and not PRECISE:
            K_DTYPE: tl.constexpr = kv_ptr.dtype.element_ty
        else:
            K_DTYPE: tl.constexpr = DOT_DTYPE
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        first_bad = hi  # the first position on a page outside the cache (its rows were not read); hi if none
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
                first_bad = tl.minimum(first_bad, tl.min(tl.where(in_seq & ~page_ok, first, hi), 0))
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
                if PAGE_SIZE > 0:  # ragged: no page to check, and no loop-carried position to hold
                    first_bad = tl.minimum(first_bad, tile_bad)
                m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
                    kv_ptr, kscale_ptr, kscale_stride, base, offs, row_ok, n0, limit, q0, q1, q2, q3, q_rope, s_scale,
                    m_i, l_i, acc0, acc1, acc2, acc3, KV_FORMAT, K_DTYPE, DOT_DTYPE, USE_ASM, SCALED_SCORES,
                    CAUSAL, V_CAST_FIRST)

        inv = tl.where(l_i > 0, out_scale / l_i, 0.0)  # an empty sequence or split gives zeros
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))  # base 2
        # a row is bad where it would have seen that position: a causal token that stops before it keeps its value
        bad = (first_bad < (tl.minimum(limit, hi) if CAUSAL else hi)).to(tl.int32)
        if BALANCED:  # a sequence of one piece is written here; the pieces of the others go to their item's slot
            if (tl.load(items_ptr + piece * _ITEM_FIELDS + 3) & 0xFFFF) == 1:
                _store_output(out_ptr, lse_ptr, b, first_row, qrow, row_in, valid & (bad == 0), acc0, acc1,
                              acc2, acc3, inv, lse2, WRITE_LSE, NUM_HEADS, Q_LEN, PARTIAL_ROWS)
            else:
                _store_partial(part_o_ptr, part_lse_ptr, tl.cast(piece, tl.int64), group, qrow, row_in, bad, acc0,
                               acc1, acc2, acc3, inv, lse2, ROWS, BLOCK_H, PARTIAL_ROWS)
        elif NUM_SPLITS == 1:
            _store_output(out_ptr, lse_ptr, b, first_row, qrow, row_in, valid & (bad == 0), acc0, acc1,
                          acc2, acc3, inv, lse2, WRITE_LSE, NUM_HEADS, Q_LEN, PARTIAL_ROWS)
        else:
            _store_partial(part_o_ptr, part_lse_ptr, b * NUM_SPLITS + piece, group, qrow, row_in, bad, acc0, acc1,
                           acc2, acc3, inv, lse2, ROWS, BLOCK_H, PARTIAL_ROWS)

    @triton.jit
    def mla_split_kernel(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                          lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, part_first_ptr, qk_scale,
                          NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                          KV_FORMAT: tl.constexpr, PRECISE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                          FP8_MAX: tl.constexpr, USE_ASM: tl.constexpr, ROUND_FP8: tl.constexpr, USE_PDL: tl.constexpr,
                          SCALED_SCORES: tl.constexpr, WRITE_LSE: tl.constexpr, CHUNKED_PAGES: tl.constexpr,
                          NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, CAUSAL: tl.constexpr,
                          V_CAST_FIRST: tl.constexpr, BLOCK_H: tl.constexpr, BALANCED: tl.constexpr):
        group = tl.program_id(1)  # query rows group * BLOCK_H onwards: the groups of a split or piece read the same
        # tiles, all but the first from L2
        if USE_PDL:  # let the combine launch (and wait in gdc_wait) while this grid's last wave runs
            tl.extra.cuda.gdc_launch_dependents()
        if BALANCED:  # program (part, group): the schedule's pieces part_first[part] .. part_first[part + 1] - 1
            part = tl.program_id(0)
            item = tl.load(part_first_ptr + part)
            last = tl.load(part_first_ptr + part + 1)
            # a while loop: gfx950's FP8 dot inside a for loop nested in another does not lower with Triton 3.6
            while item < last:
                _split_piece(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows,
                             out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, qk_scale, item,
                             tl.load(items_ptr + item * _ITEM_FIELDS), group, NUM_SPLITS, BLOCK_N, PAGE_SIZE,
                             KV_FORMAT, PRECISE, DOT_DTYPE, FP8_MAX, USE_ASM, ROUND_FP8, SCALED_SCORES, WRITE_LSE,
                             CHUNKED_PAGES, NUM_HEADS, Q_LEN, CAUSAL, V_CAST_FIRST, BLOCK_H, BALANCED)
                item += 1
        else:  # program (split, group, b)
            _split_piece(q_ptr, kv_ptr, kscale_ptr, kscale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                         lse_ptr, part_o_ptr, part_lse_ptr, items_ptr, qk_scale, tl.program_id(0), tl.program_id(2),
                         group, NUM_SPLITS, BLOCK_N, PAGE_SIZE, KV_FORMAT, PRECISE, DOT_DTYPE, FP8_MAX, USE_ASM,
                         ROUND_FP8, SCALED_SCORES, WRITE_LSE, CHUNKED_PAGES, NUM_HEADS, Q_LEN, CAUSAL, V_CAST_FIRST,
                         BLOCK_H, BALANCED)

    @triton.jit
    def _merge_pieces(part_o_ptr, part_lse_ptr, first, count, r, dv, ROWS: tl.constexpr):
        """The `count` partials of query row r in slots first .. first + count - 1, merged by an online max and sum
        (a piece of no row, LSE -inf, weighs 0): (their weighted sum (BLOCK_DV,) / its weights' sum, the running max,
        the weights' sum, whether a piece met a page outside the cache (its LSE NaN))."""
        m = tl.full([], float("-inf"), tl.float32)
        denom = tl.full([], 0.0, tl.float32)
        bad = tl.full([], 0, tl.int32)
        acc = tl.zeros(dv.shape, tl.float32)
        for i in range(0, count):
            slot = (first + i).to(tl.int64) * ROWS + r  # a slot a piece: (parts + batch) x ROWS rows
            lse = tl.load(part_lse_ptr + slot)
            bad = bad | (lse != lse).to(tl.int32)
            lse = tl.where(lse == lse, lse, float("-inf"))
            m_new = tl.maximum(m, lse)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - base)
            w = tl.exp2(lse - base)
            acc = acc * alpha + w * tl.load(part_o_ptr + slot * V_DIM + dv)
            denom = denom * alpha + w
            m = m_new
        return acc / tl.where(denom > 0, denom, 1.0), m, denom, bad != 0

    @triton.jit
    def mla_combine_kernel(seq_ptr, max_pages, kv_rows, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, items_ptr,
                            first_ptr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_DV: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, USE_PDL: tl.constexpr, WRITE_LSE: tl.constexpr,
                            NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, BALANCED: tl.constexpr):
        ROWS: tl.constexpr = Q_LEN * NUM_HEADS
        bh = tl.program_id(0)  # b * ROWS + query row
        b = bh // ROWS
        r = bh % ROWS
        dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        _, _, valid = sequence_span(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE)
        if BALANCED:  # sequence b's pieces are items first .. first + count - 1 (the schedule lists them in order)
            first = tl.load(first_ptr + b)
            count = tl.load(items_ptr + first * _ITEM_FIELDS + 3) & 0xFFFF
            if count == 1:  # one piece: the split kernel wrote the output
                return
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
            res, m, denom, bad = _merge_pieces(part_o_ptr, part_lse_ptr, first, count, r, dv, ROWS)
            valid = valid & ~bad
            tl.store(out_ptr + bh * V_DIM + dv, tl.where(valid, res, float("nan")).to(tl.bfloat16))
            if WRITE_LSE:
                if tl.program_id(1) == 0:
                    total = tl.where(denom > 0, (m + tl.log2(denom)) * TL_LN2, float("-inf"))
                    tl.store(lse_at(lse_ptr, b, r, NUM_HEADS, Q_LEN), tl.where(valid, total, float("nan")))
        else:
            sp = tl.arange(0, SPLITS_P2)
            row = (b * NUM_SPLITS + sp) * ROWS + r
            if USE_PDL:  # everything above overlapped the split kernel; the partials are read only after it
                tl.extra.cuda.gdc_wait()
            lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
            valid = valid & (tl.sum((lse != lse).to(tl.int32), 0) == 0)  # a split met a page outside the cache
            lse = tl.where(lse == lse, lse, float("-inf"))
            m = tl.max(lse, 0)
            w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
            o = tl.load(part_o_ptr + row[:, None] * V_DIM + dv[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
            denom = tl.sum(w, 0)
            res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
            tl.store(out_ptr + bh * V_DIM + dv, tl.where(valid, res, float("nan")).to(tl.bfloat16))
            if WRITE_LSE:
                if tl.program_id(1) == 0:
                    total = tl.where(denom > 0, (m + tl.log2(denom)) * TL_LN2, float("-inf"))
                    tl.store(lse_at(lse_ptr, b, r, NUM_HEADS, Q_LEN), tl.where(valid, total, float("nan")))
