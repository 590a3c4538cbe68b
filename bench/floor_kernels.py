"""Triton kernels that measure floors for leaderboard.py: the HBM read ceiling, an empty launch, and a memory-only walk
of the KV cache.

None of them computes attention. Each reads what it must and writes a tiny checksum, so the compiler cannot drop
the loads and leaderboard.py can prove that every byte it counts was read:
  read_ceiling: a large int32 buffer summed per program; the ceiling is bytes read / time.
  empty:        no work at all; its time under the leaderboard's timing is the cost of one launch there.
  memwalk:      the KV bytes one decode must read (FP8: 576 B per row; MXFP4: 288 B of codes + 18 E8M0 scale
                bytes per row), walked in the tile pattern of our split-KV decode kernel: program (s, b) walks
                its share s of sequence b's rows in BLOCK_N-row tiles, the 576 columns as 512 + 64 (the MXFP4 codes as
                256 + 32 bytes); over a contiguous cache or through a page table (the gather's cost). Its time is
                the practical floor of a kernel with that pattern.
Every load is done as int32 words (the FP8 row is 144 words, the MXFP4 row 72) and added with wrap-around into a
per-lane accumulator, so the arithmetic per byte is a quarter of an add; each program stores the int64 sum of its
lanes, and the checksum, that total modulo 2**32, equals the sum of every word (and scale byte) read, which torch
recomputes exactly. (The lanes are summed as int64 because the interpreter rejects an int32 reduction that wraps.)
The tile loops are `while` loops: Triton 3.6's interpreter cannot run a `for` over a runtime bound with NumPy 2.4
(it converts a 1-element array to an int), and the CPU test runs these kernels in the interpreter.
"""

import torch
import triton
import triton.language as tl

FP8_ROW_BYTES = 576
MXFP4_ROW_BYTES = 288
MXFP4_SCALES_READ = 18  # E8M0 scales of one row's 18 blocks of 32; the padded scale row is wider
FP8_ROW_WORDS = FP8_ROW_BYTES // 4  # 144 = 128 (values, dims 0..511) + 16 (rope, dims 512..575)
MXFP4_ROW_WORDS = MXFP4_ROW_BYTES // 4  # 72 = 64 (dims 0..511) + 8 (dims 512..575)
FP8_VALUE_WORDS, MXFP4_VALUE_WORDS = 128, 64  # the words of dims 0..511 (the values); the rest of a row is rope
WRAP = 1 << 32  # the lanes add int32 words with wrap-around: checksums agree modulo 2**32

# (BLOCK elements per load, loads per program, warps): the read-ceiling candidates; leaderboard.py keeps the fastest.
READ_CONFIGS = ((4096, 4, 8), (8192, 2, 8), (2048, 8, 4))


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, LOADS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * LOADS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(LOADS):  # unrolled: all loads of a program are in flight together
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _lane_total(acc):
    return tl.sum(tl.sum(acc.to(tl.int64), axis=1), axis=0)


@triton.jit
def _split_rows(seq_ptr, b, s, splits, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """(first row, positions [lo, hi)) of split s of sequence b: the same partition as the decode kernels. PAGE 0:
    seq_ptr is kv_indptr (rows kv_indptr[b] + position); else cache_seqlens (rows through the page table)."""
    if PAGE == 0:
        start = tl.load(seq_ptr + b)
        n = tl.load(seq_ptr + b + 1) - start
    else:
        start = 0
        n = tl.load(seq_ptr + b)
    chunk = tl.cdiv(tl.cdiv(n, splits), BLOCK_N) * BLOCK_N
    lo = s * chunk
    return start, lo, tl.minimum(lo + chunk, n)


@triton.jit
def _rows(start, table_row, pos, PAGE: tl.constexpr):
    """The cache rows of positions pos: consecutive from start (PAGE 0), else looked up in the page table."""
    if PAGE == 0:
        return (start + pos).to(tl.int64)
    else:
        return tl.load(table_row + pos // PAGE).to(tl.int64) * PAGE + pos % PAGE


# splits is not specialized (Triton would compile one variant for 1, one for multiples of 16, one for the rest).
@triton.jit(do_not_specialize=["splits"])
def _walk_kernel(words_ptr, scale_ptr, seq_ptr, table_ptr, max_pages, out_ptr, splits, ROW_WORDS: tl.constexpr,
                 V_WORDS: tl.constexpr, SCALE_STRIDE: tl.constexpr, SCALES: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr):
    """Sums every int32 word of a row's values (V_WORDS, a power of two) and rope (the rest of ROW_WORDS) and, with
    SCALES > 0, its first SCALES scale bytes, over the split's rows: each byte our kernel reads, read once."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    start, lo, hi = _split_rows(seq_ptr, b, s, splits, BLOCK_N, PAGE)
    table_row = table_ptr + b.to(tl.int64) * max_pages
    ROPE_WORDS: tl.constexpr = ROW_WORDS - V_WORDS
    rows = tl.arange(0, BLOCK_N)
    cols_v = tl.arange(0, V_WORDS)
    cols_r = tl.arange(0, ROPE_WORDS)
    cols_s = tl.arange(0, 32)
    acc_v = tl.zeros([BLOCK_N, V_WORDS], dtype=tl.int32)
    acc_r = tl.zeros([BLOCK_N, ROPE_WORDS], dtype=tl.int32)
    acc_s = tl.zeros([BLOCK_N, 32], dtype=tl.int32)
    r0 = lo
    while r0 < hi:
        pos = r0 + rows
        live = (pos < hi)[:, None]
        r = _rows(start, table_row, tl.where(pos < hi, pos, 0), PAGE)
        row_ptr = words_ptr + r[:, None] * ROW_WORDS
        acc_v += tl.load(row_ptr + cols_v[None, :], mask=live, other=0)
        acc_r += tl.load(row_ptr + V_WORDS + cols_r[None, :], mask=live, other=0)
        if SCALES > 0:
            scale_ptrs = scale_ptr + r[:, None] * SCALE_STRIDE + cols_s[None, :]
            acc_s += tl.load(scale_ptrs, mask=live & (cols_s < SCALES)[None, :], other=0).to(tl.int32)
        r0 += BLOCK_N
    tl.store(out_ptr + b * splits + s, _lane_total(acc_v) + _lane_total(acc_r) + _lane_total(acc_s))


def _as_words(kv: torch.Tensor) -> torch.Tensor:
    """A KV cache of 1-byte elements (FP8 or packed FP4) as a flat int32 view, no copy."""
    return kv.view(torch.uint8).reshape(-1).view(torch.int32)


class ReadCeiling:
    """Sums an int32 buffer of `nbytes` random values; bytes read per call = 4 * n."""

    def __init__(self, nbytes: int, device: torch.device, block: int, loads: int, warps: int):
        self.n = nbytes // 4
        self.nbytes = 4 * self.n
        self.x = torch.randint(-1000, 1000, (self.n,), dtype=torch.int32, device=device)
        self.block, self.loads, self.warps = block, loads, warps
        self.grid = (triton.cdiv(self.n, block * loads),)
        self.partials = torch.empty(self.grid[0], dtype=torch.int32, device=device)

    def __call__(self) -> torch.Tensor:
        _read_sum_kernel[self.grid](self.x, self.partials, self.n, BLOCK=self.block, LOADS=self.loads,
                                    num_warps=self.warps)
        return self.partials

    def verify(self) -> bool:
        """Each program sums at most 16384 values of |v| < 1000, so its int32 sum is exact."""
        return self().sum(dtype=torch.int64).item() == self.x.sum(dtype=torch.int64).item()


def empty_launch(buf: torch.Tensor) -> None:
    _empty_kernel[(1,)](buf)


class MemWalk:
    """A memory-only walk of one input's KV cache (kv_format "fp8" or "mxfp4") with `splits` programs per
    sequence and BLOCK_N-row tiles; writes one int64 lane total per program. `pages`: (block_table, cache_seqlens,
    page_size) of a paged cache (kv_data's caches then hold the pages' rows), else the rows kv_indptr covers."""

    def __init__(self, kv_format: str, kv_data: dict, kv_indptr: torch.Tensor, splits: int, block_n: int,
                 pages: tuple | None = None):
        if kv_format not in ("fp8", "mxfp4"):
            raise ValueError(f"kv_format: expected 'fp8' or 'mxfp4', got {kv_format!r}")
        self.kv_format, self.splits, self.block_n = kv_format, splits, block_n
        kv, scale = kv_data[kv_format]
        self.words = _as_words(kv)
        self.scales = scale.view(torch.uint8).reshape(-1, scale.shape[-1])
        if pages is None:
            self.seqs, self.table, self.page = kv_indptr, kv_indptr, 0
        else:
            self.table, self.seqs, self.page = pages
        self.batch = self.seqs.shape[0] - (1 if pages is None else 0)
        self.out = torch.empty(self.batch * splits, dtype=torch.int64, device=kv.device)

    def __call__(self) -> torch.Tensor:
        grid = (self.splits, self.batch)  # as our kernel's split grid: a sequence's splits launch side by side
        fp8 = self.kv_format == "fp8"
        _walk_kernel[grid](self.words, self.scales, self.seqs, self.table, self.table.shape[-1], self.out, self.splits,
                           ROW_WORDS=FP8_ROW_WORDS if fp8 else MXFP4_ROW_WORDS,
                           V_WORDS=FP8_VALUE_WORDS if fp8 else MXFP4_VALUE_WORDS, SCALE_STRIDE=self.scales.stride(0),
                           SCALES=0 if fp8 else MXFP4_SCALES_READ, BLOCK_N=self.block_n, PAGE=self.page, num_warps=4)
        return self.out

    @staticmethod
    def checksum(out: torch.Tensor) -> int:
        """The walk's checksum from its per-program totals."""
        return out.sum().item() % WRAP


def kv_checksum(kv_format: str, kv_data: dict, kv_indptr: torch.Tensor) -> int:
    """What a correct walk's checksum must be: the sum, modulo 2**32, of every word (and, for MXFP4, of the 18
    scale bytes) of the rows kv_indptr covers, computed by torch."""
    kv, scale = kv_data[kv_format]
    lo, hi = (int(v) for v in kv_indptr[[0, -1]].tolist())
    row_words = FP8_ROW_WORDS if kv_format == "fp8" else MXFP4_ROW_WORDS
    total = _as_words(kv)[lo * row_words:hi * row_words].sum(dtype=torch.int64).item()
    if kv_format == "mxfp4":
        total += scale.view(torch.uint8)[lo:hi, :MXFP4_SCALES_READ].sum(dtype=torch.int64).item()
    return total % WRAP
