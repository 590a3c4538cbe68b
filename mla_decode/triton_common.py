"""What the triton backend's two split kernels (the portable one, triton_backend.py; the Hopper one,
triton_hopper.py) read alike: the row widths and MXFP4's block as constexprs, a sequence's positions and validity,
and where a query row's LSE goes. The combine kernel reads them too."""

from .contract import LN2, MXFP4_BLOCK, MXFP4_ROW_BYTES, QK_HEAD_DIM, V_HEAD_DIM, tl, triton

# without Triton: no kernels to share them
_QK_DIM = _V_DIM = _FP4_ROW_BYTES = _MX_BLOCK = _LN2 = _sequence = _lse_at = None

if triton is not None:
    # a jit function reads only constexpr globals
    _QK_DIM = tl.constexpr(QK_HEAD_DIM)  # a query/key row: 576
    _V_DIM = tl.constexpr(V_HEAD_DIM)  # a value/output row: the first 512
    _FP4_ROW_BYTES = tl.constexpr(MXFP4_ROW_BYTES)  # an MXFP4 row: two codes a byte, 288
    _MX_BLOCK = tl.constexpr(MXFP4_BLOCK)  # values per E8M0 scale: 32
    _LN2 = tl.constexpr(LN2)

    @triton.jit
    def _sequence(seq_ptr, b, max_pages, kv_rows, PAGE_SIZE: tl.constexpr):
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
    def _lse_at(lse_ptr, b, r, NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr):
        """Where query row r (token r // NUM_HEADS, head r % NUM_HEADS) of sequence b has its LSE: lse is
        (batch, num_heads, q_len)."""
        return lse_ptr + b * (Q_LEN * NUM_HEADS) + (r % NUM_HEADS) * Q_LEN + r // NUM_HEADS
