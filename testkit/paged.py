"""Paged inputs for the library's call and their float64 truth.

make_paged_case builds a batch the way a serving engine's cache looks: pages handed out in shuffled order, every
slot no sequence owns poisoned (NaN where a kernel would read it: the FP8 NaN byte, the E8M0 NaN scale, a bf16 NaN),
and the block table's entries past each sequence's last page pointing at a poisoned page or outside the cache. A
kernel that reads a row it does not own, or follows a table entry past a sequence's length, gives that sequence a
NaN; one that skips a row it owns misses the float64 truth of paged_reference. ragged_twin lays a case's owned rows
out consecutively (the ragged layout); BAD_CONTENTS are the invalid tables and lengths the kernels must turn into NaN
rows; OUT_BOUND and LSE_BOUND hold the CPU backends to paged_reference (errors).
"""

import math
from typing import NamedTuple

import torch

from reference import dequantize_mxfp4, quantize_fp8, quantize_mxfp4, worst_row_relative_l2
from testkit.emulation import Tiling, e4m3_p_attention

QK_DIM, V_DIM = 576, 512
FP8_NAN_BYTE = 0x7F  # e4m3fn and e4m3fnuz: NaN
E8M0_NAN_BYTE = 0xFF
# The worst query token's output against the float64 truth: the bf16 output's rounding alone is ~1.7e-3 (the
# interpreter's bf16 cast truncates: ~3.3e-3), and a 1% softmax-scale error is >= 1.2e-2
# (tests/test_library.py::test_bounds_fail_on_bugs).
OUT_BOUND = 5e-3
# The largest LSE error: fp32 sums give < 1e-6; a 1% softmax-scale error moves it by ~2e-2.
LSE_BOUND = 1e-4


class PagedCase(NamedTuple):
    q: torch.Tensor  # (batch, q_len, heads, 576) bfloat16
    kv_cache: torch.Tensor  # (num_pages, page_size, 1, width) in the format's dtype
    kv_scale: torch.Tensor | None  # fp8 (1,) float32; mxfp4 (num_pages, page_size, 1, 18) E8M0; bf16 None
    block_table: torch.Tensor  # (batch, max_pages) int32
    cache_seqlens: torch.Tensor  # (batch,) int32
    keys: torch.Tensor  # (num_pages * page_size, 576) float64: every row exactly dequantized, NaN where unowned
    kv_format: str
    causal: bool

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[1]

    def args(self) -> tuple:
        """The positional arguments of mla_decode_with_kvcache and of a plan's run."""
        return self.q, self.kv_cache, self.block_table, self.cache_seqlens, self.kv_scale


def make_paged_case(kv_format: str, page_size: int, lens: list[int], seed: int, *, q_len: int = 1,
                    num_heads: int = 16, causal: bool | None = None, device: torch.device | str = "cpu",
                    fp8: torch.dtype = torch.float8_e4m3fn, q_scale: float = 1.0) -> PagedCase:
    """A batch of len(lens) sequences of those lengths over a cache of `kv_format` ("fp8", "mxfp4", "bf16") in pages
    of page_size rows; causal defaults to q_len > 1. q_scale multiplies the random queries (larger logits)."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    needed = [-(-n // page_size) for n in lens]
    max_pages = max(needed) + 1  # every row of the table has entries past its last page
    spare = 3
    num_pages = sum(needed) + spare
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.empty((len(lens), max_pages), dtype=torch.int32)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    junk = (order[-1], num_pages + 5, -1)  # past a sequence's last page: a poisoned page, outside the cache
    taken = 0
    for b, (n, k) in enumerate(zip(lens, needed, strict=True)):
        pages = order[taken:taken + k]
        taken += k
        table[b, :k] = torch.tensor(pages, dtype=torch.int32)
        table[b, k:] = torch.tensor([junk[(b + j) % len(junk)] for j in range(max_pages - k)], dtype=torch.int32)
        for i in range(n):
            owned[pages[i // page_size] * page_size + i % page_size] = True
    rows = num_pages * page_size
    values = torch.randn((rows, QK_DIM), generator=gen).to(torch.bfloat16)
    q = (torch.randn((len(lens), q_len, num_heads, QK_DIM), generator=gen) * q_scale).to(torch.bfloat16)
    unowned = ~owned
    if kv_format == "fp8":
        kv, scale = quantize_fp8(values, fp8)
        kv.view(torch.uint8)[unowned] = FP8_NAN_BYTE
        keys = kv.double() * scale.double()
        cache, kv_scale = kv.view(num_pages, page_size, 1, QK_DIM), scale
    elif kv_format == "mxfp4":
        codes, scales = quantize_mxfp4(values, ties="even", padded=False)  # (rows, 288), (rows, 18)
        scales.view(torch.uint8)[unowned] = E8M0_NAN_BYTE
        keys = dequantize_mxfp4(codes, scales, torch.float64)
        cache = codes.view(num_pages, page_size, 1, QK_DIM // 2)
        kv_scale = scales.view(num_pages, page_size, 1, QK_DIM // 32)
    elif kv_format == "bf16":
        values[unowned] = float("nan")
        keys, cache, kv_scale = values.double(), values.view(num_pages, page_size, 1, QK_DIM), None
    else:
        raise ValueError(f"kv_format: expected 'fp8', 'mxfp4' or 'bf16', got {kv_format!r}")
    kv_scale = None if kv_scale is None else kv_scale.to(device)
    return PagedCase(q.to(device), cache.to(device), kv_scale, table.to(device),
                     torch.tensor(lens, dtype=torch.int32, device=device), keys.to(device), kv_format,
                     q_len > 1 if causal is None else causal)


def owned_rows(case: PagedCase, b: int) -> torch.Tensor:
    """The cache rows sequence b owns, in order, (n,) int64."""
    n, page = int(case.cache_seqlens[b]), case.page_size
    pages = case.block_table[b, :-(-n // page)].long().cpu()
    return (pages[:, None] * page + torch.arange(page)).flatten()[:n]


def ragged_twin(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The rows each sequence owns gathered consecutively: (kv (total, 1, width), scale, kv_indptr)."""
    order = torch.cat([owned_rows(case, b) for b in range(case.q.shape[0])]).to(case.q.device)
    rows = case.kv_cache.view(torch.uint8)  # byte rows: MXFP4's float4_e2m1fn_x2 has no indexing
    kv = rows.view(-1, 1, rows.shape[-1])[order].view(case.kv_cache.dtype)
    scale = case.kv_scale
    if case.kv_format == "mxfp4":
        scale = case.kv_scale.view(torch.uint8).view(-1, 18)[order].view(case.kv_scale.dtype)
    indptr = torch.zeros(case.q.shape[0] + 1, dtype=torch.int32, device=case.q.device)
    indptr[1:] = torch.cumsum(case.cache_seqlens, 0)
    return kv.contiguous(), None if scale is None else scale.contiguous(), indptr


# Invalid contents of a case's sequence 1: name -> (an edit of the block table or None, an edit of cache_seqlens or
# None, the field check_contents' error names); each edit takes (table, lens) and changes one of them in place.
BAD_CONTENTS = {
    "a page outside the cache": (lambda t, n: t.__setitem__((1, 2), 10_000), None, "block_table[1, 2]"),
    "a negative page": (lambda t, n: t.__setitem__((1, 0), -1), None, "block_table[1, 0]"),
    "a negative length": (None, lambda t, n: n.__setitem__(1, -3), "cache_seqlens[1]"),
    "a length past the table": (None, lambda t, n: n.__setitem__(1, 10_000), "cache_seqlens[1]"),
}


def paged_reference(case: PagedCase, softmax_scale: float | None = None, q: torch.Tensor | None = None,
                    tiling: Tiling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over the exactly dequantized rows each sequence owns -> (out (batch, q_len, heads, 512),
    lse (batch, heads, q_len), natural log). q: the queries as the kernel under test rounds them (float, the case's
    shape; default the case's bf16 q, exactly). tiling: P rounded as a kernel with that walk rounds it
    (testkit.emulation.e4m3_p_attention; the splits, or a schedule's pieces, cut each sequence's own rows), else
    exact."""
    scale = 1.0 / math.sqrt(QK_DIM) if softmax_scale is None else softmax_scale
    qd = (case.q if q is None else q).double().cpu()
    keys = case.keys.cpu()
    batch, q_len, heads, _ = qd.shape
    out = torch.zeros((batch, q_len, heads, V_DIM), dtype=torch.float64)
    lse = torch.full((batch, heads, q_len), -math.inf, dtype=torch.float64)
    for b in range(batch):
        k = keys[owned_rows(case, b)]
        n = k.shape[0]
        for t in range(q_len):
            seen = n - q_len + 1 + t if case.causal else n
            if seen <= 0:
                continue
            if tiling is not None:  # the walk cuts the sequence's rows; the token's unseen ones are -inf
                logits = torch.full((heads, n), -math.inf, dtype=torch.float64)
                logits[:, :seen] = qd[b, t] @ k[:seen].T * (scale * math.log2(math.e))
                out[b, t], lse2 = e4m3_p_attention(logits, k[:, :V_DIM], tiling.of_sequence(b))
                lse[b, :, t] = lse2 * math.log(2.0)
                continue
            scores = qd[b, t] @ k[:seen].T * scale  # (heads, seen)
            out[b, t] = torch.softmax(scores, dim=-1) @ k[:seen, :V_DIM]
            lse[b, :, t] = torch.logsumexp(scores, dim=-1)
    return out, lse


def errors(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor
           ) -> tuple[float, float]:
    """(the worst relative L2 error of one query token's output (all heads; a token whose truth is zero must be
    zero), the largest absolute LSE error (-inf where the truth is -inf, else a failure)) of a kernel's result."""
    out_error = worst_row_relative_l2(out.cpu().flatten(0, 1), ref_out.flatten(0, 1))
    if lse is None:
        return out_error, 0.0
    got, want = lse.double().cpu(), ref_lse
    empty = want == -math.inf
    lse_error = 0.0 if not empty.any() else (0.0 if (got[empty] == -math.inf).all() else math.inf)
    if (~empty).any():
        lse_error = max(lse_error, (got[~empty] - want[~empty]).abs().max().item())
    return (out_error if math.isfinite(out_error) else math.inf), (lse_error if lse_error == lse_error else math.inf)
