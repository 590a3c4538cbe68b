"""float64 emulations of what each fast kernel rounds, and which kernel rounds what: the bounds the tests hold the GPU
kernels to (with their negative controls) come from these."""

import math
from typing import NamedTuple

import torch

from mla_decode.schedule import make_schedule
from reference import NUM_HEADS, V_HEAD_DIM, dequantize_mxfp4
from task import input_t

# What a fast kernel rounds, for kernel_emulation: "cache" none (fp32-exact attention with bf16 Q over the cache, the
# torch backend's and the precise kernels' computation); "+Q" Q rounded to e4m3 with one scale per head
# (round_q_per_head: the triton kernel's fast FP8 score product); "+Q+P" and the softmax weights rounded to e4m3 as
# 2^8 p, p relative to the running maximum of the kernel's walk (Tiling), its row sums not rounded (the cuda
# backend's wgmma kernel).
EMULATIONS = ("cache", "+Q", "+Q+P")


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


def round_q_per_head(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q (..., 16, 576) as the fast kernels round it: E4M3 values (fp32) and the per-head scale 448 / max|q_h| (fp32,
    (..., 16, 1)), q ~ values / scale, in fp32 steps as the kernels take them: the IEEE quotient, then the fp32
    product. (A number divided by a tensor is, in torch, the number times the tensor's reciprocal, often an ulp off
    the quotient; an ulp of the scale moves a value that sits at an E4M3 rounding tie by a whole step. Against exact
    float64 steps, ~1 in 2000 of random bf16 values get another E4M3 value: 299 of 589,824 at 64x1024.)"""
    qf = q.float()
    amax = qf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    scale = torch.full_like(amax, 448.0) / amax
    return _round_e4m3(qf * scale), scale


class Tiling(NamedTuple):
    """How a split kernel walks a sequence of n rows, for kernel_emulation's "+Q+P" (both cuda kernels' split_range):
    num_splits splits of per_split = ceil(ceil(n / num_splits) / block_n) * block_n rows, from the sequence's start;
    each split's running maximum moves per block_n-row tile, and its normalized partial output is rounded to
    partial_dtype before the log-sum-exp merge (with more than one split). pieces: the balanced schedule's walk in
    their place (schedule_pieces), per sequence its pieces' tile ranges ((first, end), ...), each walked as a split
    is and merged as splits are (a sequence of one piece is written directly); of_sequence(b) gives sequence b's walk,
    as e4m3_p_attention takes it."""

    num_splits: int = 1
    block_n: int = 64
    partial_dtype: torch.dtype = torch.bfloat16
    pieces: tuple | None = None

    def of_sequence(self, b: int) -> "Tiling":
        """Sequence b's walk: its own pieces where the tiling is a schedule's (pieces then holds b's ranges)."""
        return self if self.pieces is None else self._replace(pieces=self.pieces[b])


def schedule_pieces(lengths: list[int], parts: int, tile_rows: int = 64) -> tuple:
    """The balanced schedule's pieces of a batch of valid `lengths` cut into `parts` shares (mla_decode.schedule),
    per sequence ((first tile, end tile), ...), for Tiling.pieces."""
    s = make_schedule(torch.tensor(lengths), parts, max(lengths, default=0), tile_rows)
    return tuple(tuple(s.piece_tiles(p, b) for p in range(int(s.first_part(b)), int(s.last_part(b)) + 1))
                 for b in range(len(lengths)))


P_LOG2_BIAS = 8  # the wgmma kernel stores P as 2^8 p (p <= 1): e4m3 keeps its normal range for small p
# The worst sequence's relative L2 against "+Q+P" that kernels rounding P so are held to on random-normal data: their
# FP8 scores still move a few of P's roundings (tests/test_negative_controls.py has the measurements)
E4M3_P_RANDOM_BOUND = 1.4e-2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _walk(n: int, tiling: Tiling) -> list[tuple[int, int]]:
    """The row ranges [lo, hi) of a sequence of n rows that a kernel walks apart: the tiling's splits that hold rows,
    or its pieces (one of no row: an empty range)."""
    tile = tiling.block_n
    if tiling.pieces is not None:
        return [(lo * tile, max(lo * tile, min(hi * tile, n))) for lo, hi in tiling.pieces]
    per_split = _ceil_div(_ceil_div(n, tiling.num_splits), tile) * tile
    return [(lo, min(lo + per_split, n)) for lo in range(0, n, per_split)]


def e4m3_p_attention(logits: torch.Tensor, values: torch.Tensor, tiling: Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows' attention over one sequence with P rounded as the wgmma kernels round it: logits (rows, n) float64
    in log2 units, -inf where a row does not see a position (causal), values (n, 512) float64 -> (out (rows, 512),
    log2-sum-exp (rows,)) float64; tiling: the sequence's walk (Tiling.of_sequence). A row that has seen nothing yet
    keeps p = 0 (the kernels' guard), one that sees nothing gets zeros and -inf."""
    rows = logits.shape[0]
    tile = tiling.block_n
    partials, lses = [], []
    for lo, hi in _walk(logits.shape[1], tiling):
        tiles = _ceil_div(hi - lo, tile)
        padded = torch.full((rows, tiles * tile), -math.inf, dtype=logits.dtype, device=logits.device)
        padded[:, :hi - lo] = logits[:, lo:hi]
        running = padded.view(rows, tiles, tile).amax(dim=-1).cummax(dim=-1).values  # the maximum after each tile
        base = torch.where(running == -math.inf, 0.0, running)  # what P is taken against
        split_base = base[:, -1:] if tiles else torch.zeros((rows, 1), dtype=logits.dtype, device=logits.device)
        row_base = base.repeat_interleave(tile, dim=-1)[:, :hi - lo]
        stored = _round_e4m3(torch.exp2(logits[:, lo:hi] - row_base + P_LOG2_BIAS))
        weights = stored * torch.exp2(row_base - split_base)  # the rescales of later tiles
        row_sum = torch.exp2(logits[:, lo:hi] - split_base + P_LOG2_BIAS).sum(dim=-1, keepdim=True)
        seen = row_sum > 0
        partials.append(torch.where(seen, weights @ values[lo:hi] / row_sum.clamp(min=1e-300), 0.0))
        lses.append(torch.where(seen, split_base + torch.log2(row_sum) - P_LOG2_BIAS, -math.inf))
    if (tiling.num_splits == 1 and tiling.pieces is None) or (tiling.pieces is not None and len(lses) == 1):
        return partials[0], lses[0][:, 0]
    lse = torch.stack(lses)  # (splits, rows, 1)
    top = lse.amax(dim=0)
    merge = torch.exp2(lse - torch.where(top == -math.inf, 0.0, top))
    partial = torch.stack(partials).to(tiling.partial_dtype).double()
    total = merge.sum(dim=0)
    out = (merge * partial).sum(dim=0) / torch.where(total > 0, total, 1.0)
    return out, torch.where(total > 0, top + torch.log2(total), -math.inf)[:, 0]


@torch.no_grad()
def kernel_emulation(data: input_t, emulation: str, kv_format: str = "fp8",
                     tiling: Tiling | None = None) -> torch.Tensor:
    """float64 attention over the dequantized `kv_format` cache with the roundings `emulation` names (EMULATIONS):
    (total_q, 16, 512) float64, what a kernel that rounds just those computes before its output's bf16 rounding.
    tiling: the kernel's walk, for "+Q+P" (default: one split of 64-row tiles)."""
    if emulation not in EMULATIONS:
        raise ValueError(f"emulation: expected one of {EMULATIONS}, got {emulation!r}")
    q, kv_data, qo_indptr, kv_indptr, config = data
    if config["q_seq_len"] != 1:
        raise ValueError(f"kernel_emulation: one query token per sequence, not q_seq_len {config['q_seq_len']}")
    kv, scale = kv_data[kv_format]
    keys = (kv[:, 0].double() * scale.double() if kv_format == "fp8" else
            dequantize_mxfp4(kv, scale, torch.float64)[:, 0])  # (total_kv, 576)
    qd = q.double()
    if emulation != "cache":
        q8, q_scale = round_q_per_head(q)
        qd = q8.double() / q_scale.double()
    out = torch.zeros((q.shape[0], NUM_HEADS, V_HEAD_DIM), dtype=torch.float64, device=q.device)
    bounds = kv_indptr.tolist()
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if hi <= lo:
            continue
        scores = qd[b] @ keys[lo:hi].T * config["sm_scale"]  # (16, n)
        if emulation == "+Q+P":
            walk = (tiling or Tiling()).of_sequence(b)
            out[b] = e4m3_p_attention(scores * math.log2(math.e), keys[lo:hi, :V_HEAD_DIM], walk)[0]
        else:
            out[b] = torch.softmax(scores, dim=-1) @ keys[lo:hi, :V_HEAD_DIM]
    return out


# (backend, KV format, precision) -> the emulation (EMULATIONS) of what that kernel rounds (the triton fast FP8 and
# MXFP4 kernels: "+Q+P" where their plan takes the Hopper kernel, emulation_of)
EMULATION_OF = {("cuda", "fp8", "fast"): "+Q+P", ("cuda", "fp8", "precise"): "cache", ("cuda", "mxfp4", "fast"): "+Q+P",
                ("triton", "fp8", "fast"): "+Q", ("triton", "fp8", "precise"): "cache",
                ("triton", "mxfp4", "fast"): "cache", ("triton", "mxfp4", "precise"): "cache",
                ("torch", "fp8", "fast"): "cache", ("torch", "fp8", "precise"): "cache",
                ("torch", "mxfp4", "fast"): "cache", ("torch", "mxfp4", "precise"): "cache"}


def emulation_of(data: input_t, backend: str, kv_format: str, precision: str) -> tuple[str, Tiling | None]:
    """What that backend's kernel rounds on `data` (through custom_kernel): its EMULATIONS name and, where it rounds P
    (the cuda wgmma kernel; the triton backend's Hopper kernel, triton/hopper.py, where its plan takes it), its walk:
    the splits of the plan the leaderboard adapter makes for `data` (fixed splits: the backends' default, and what
    the adapter asks for on the config's uniform promise)."""
    emulation = EMULATION_OF[(backend, kv_format, precision)]
    if emulation == "cache" and not (backend == "triton" and precision == "fast"):
        return emulation, None
    q, kv_data, _, _, config = data  # the split plan's length as the adapter sizes it
    if config["q_seq_len"] != 1:
        raise ValueError(f"emulation_of: one query token per sequence, not q_seq_len {config['q_seq_len']}")
    kv_seq_len = config["kv_seq_len"]
    seq_len = kv_seq_len if kv_seq_len is not None else -(-kv_data[kv_format][0].shape[0] // q.shape[0])
    if backend == "triton":
        from mla_decode.triton import triton_plan, triton_target

        plan = triton_plan(q.shape[0], seq_len, triton_target(q.device), kv_format)
        if not plan.hopper:
            return emulation, None
        return "+Q+P", Tiling(plan.num_splits, plan.block_n, torch.float32)
    import mla_decode.cuda as C

    return emulation, Tiling(num_splits=C.launch_splits(C.LaunchKey(q.device, q.shape[0], seq_len, kv_format, False)))


def emulate(data: input_t, backend: str, kv_format: str, precision: str) -> torch.Tensor:
    """kernel_emulation of what that backend's kernel rounds on `data` (emulation_of)."""
    emulation, tiling = emulation_of(data, backend, kv_format, precision)
    return kernel_emulation(data, emulation, kv_format, tiling)
