"""The torch backend: fp32 attention over the exactly dequantized rows a sequence owns, on any device, for every
q_len, head count, format and layout. It reads the lengths and the page table on the host (a sync) and checks them
first, so it raises where the GPU kernels write NaN; it is the reference-grade fallback, not a fast path.
Q stays bf16, widened to fp32 exactly: quantizing it as the FP8 kernels do would only add error.
"""

import torch

from .contract import MXFP4_BLOCK, MXFP4_BLOCKS_PER_ROW, V_HEAD_DIM, Problem, expect

# Rows dequantized to fp32 at a time (65536 x 576 x 4 B = 151 MB): bounds memory whatever the sequence's length.
TORCH_CHUNK_ROWS = 1 << 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def torch_unusable_reason(problem: Problem) -> str | None:
    return None  # every shape, format and layout, on any device


def dequantized_rows(kv: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor, kv_format: str
                     ) -> torch.Tensor:
    """Cache rows `rows` (n,) int64 of kv (num_rows, width) in fp32, (n, 576): FP8 times its scale, MXFP4 codes
    times their block scales, BF16 widened."""
    if kv_format == "fp8":
        return kv[rows].float() * scale.reshape(()).float()
    if kv_format == "bf16":
        return kv[rows].float()
    codes = kv.view(torch.uint8)[rows]  # (n, 288): float4_e2m1fn_x2 has no indexing
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=kv.device)
    vals = torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1)  # low nibble first
    block_scale = torch.exp2(scale.view(torch.uint8)[rows, :MXFP4_BLOCKS_PER_ROW].float() - 127.0)
    n = rows.shape[0]
    return (vals.reshape(n, MXFP4_BLOCKS_PER_ROW, MXFP4_BLOCK) * block_scale.unsqueeze(-1)).reshape(n, -1)


def sequence_rows(problem: Problem, seqs: torch.Tensor, table: torch.Tensor | None, num_rows: int
                  ) -> list[torch.Tensor]:
    """The cache rows each sequence owns, in order, (n,) int64 each, after checking the lengths and the table on the
    host (a sync): a ValueError names cache_seqlens, block_table or kv_indptr and the sequence. seqs, table:
    cache_seqlens and block_table (paged) or kv_indptr and None (ragged)."""
    device, host = seqs.device, seqs.tolist()
    if problem.layout == "ragged":
        for b in range(problem.batch):
            expect(0 <= host[b] <= host[b + 1] <= num_rows, f"kv_indptr[{b}:{b + 2}]",
                   f"0 <= start <= end <= {num_rows} (the cache's rows)", host[b:b + 2])
        return [torch.arange(lo, hi, device=device) for lo, hi in zip(host[:-1], host[1:], strict=True)]
    page, capacity = problem.page_size, problem.page_size * problem.max_pages
    num_pages, rows, pages_of = num_rows // page, [], table.tolist()
    in_page = torch.arange(page, device=device)
    for b, n in enumerate(host):
        expect(0 <= n <= capacity, f"cache_seqlens[{b}]",
               f"0 <= length <= {capacity} (block_table's {problem.max_pages} pages of {page})", n)
        pages = pages_of[b][:-(-n // page)]
        bad = next((j for j, p in enumerate(pages) if not 0 <= p < num_pages), None)
        expect(bad is None, f"block_table[{b}, {bad}]", f"a page in [0, {num_pages}) (sequence {b} uses it)",
               None if bad is None else pages[bad])
        rows.append((table[b, :len(pages)].long()[:, None] * page + in_page).flatten()[:n])
    return rows


def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float, state: tuple | None) -> tuple:
    """Online softmax over one chunk of keys. q (tokens * heads, 576) fp32, keys (n, 576) fp32, visible (tokens *
    heads, n) bool; state (acc, m, l) or None -> the merged state."""
    scores = (q @ keys.T) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    mc = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(mc == float("-inf"), 0.0, mc))
    o, lc = p @ keys[:, :V_HEAD_DIM], p.sum(dim=-1, keepdim=True)
    if state is None:
        return o, mc, lc
    acc, m, l = state
    m_new = torch.maximum(m, mc)
    base = torch.where(m_new == float("-inf"), 0.0, m_new)
    a, c = torch.exp(m - base), torch.exp(mc - base)
    return acc * a + o * c, m_new, l * a + lc * c


class TorchDecode:
    """The torch backend's plan: nothing to allocate or compile; run() checks and reads the lengths on the host."""

    def __init__(self, problem: Problem):
        self.problem = problem

    def run(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor | None, seqs: torch.Tensor,
            table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """q (batch, q_len, heads, 576) bf16; kv (num_rows, width) rows of the cache's format, scale as the format
        has it (MXFP4: (num_rows, >= 18)); seqs: cache_seqlens (batch,) (paged) or kv_indptr (batch + 1,)
        (ragged); table (batch, max_pages) or None; writes out (batch, q_len, heads, 512) bf16 and lse (batch,
        heads, q_len) fp32 (None: not asked)."""
        problem = self.problem
        kv = kv.view(kv.shape[0], -1)  # (num_rows, width) whatever view of the rows it came as
        rows_of = sequence_rows(problem, seqs, table, kv.shape[0])
        q_len, heads = problem.q_len, problem.num_heads
        token = torch.arange(q_len, device=q.device).repeat_interleave(heads)[:, None]  # (q_len * heads, 1)
        for b, rows in enumerate(rows_of):
            n = rows.shape[0]
            # Causal: query token t sees the first n - q_len + 1 + t rows; otherwise all n.
            last = token + (n - q_len + 1) if problem.causal else torch.full_like(token, n)
            qb = q[b].float().reshape(q_len * heads, -1)
            state = None
            for lo in range(0, n, TORCH_CHUNK_ROWS):
                chunk = rows[lo:lo + TORCH_CHUNK_ROWS]
                keys = dequantized_rows(kv, scale, chunk, problem.kv_format)
                visible = lo + torch.arange(chunk.shape[0], device=q.device)[None, :] < last
                state = attend(qb, keys, visible, problem.softmax_scale, state)
            if state is None:  # no rows at all
                out[b] = 0.0
                if lse is not None:
                    lse[b] = float("-inf")
                continue
            acc, m, l = state
            seen = l > 0  # a causal token may see nothing: output 0, LSE -inf
            o = torch.where(seen, acc / torch.where(seen, l, 1.0), 0.0)
            out[b] = o.reshape(q_len, heads, V_HEAD_DIM).to(out.dtype)
            if lse is not None:
                lse_b = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
                lse[b] = lse_b.reshape(q_len, heads).T
