"""float64 emulations of what each fast kernel rounds, and which kernel rounds what: the bounds the tests hold the GPU
kernels to (with their negative controls) come from these."""

import math
from typing import NamedTuple

import torch

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
    partial_dtype before the log-sum-exp merge (with more than one split)."""

    num_splits: int = 1
    block_n: int = 64
    partial_dtype: torch.dtype = torch.bfloat16


P_LOG2_BIAS = 8  # the wgmma kernel stores P as 2^8 p (p <= 1): e4m3 keeps its normal range for small p
# The worst sequence's relative L2 against "+Q+P" that kernels rounding P so are held to on random-normal data: their
# FP8 scores still move a few of P's roundings (tests/test_negative_controls.py has the measurements)
E4M3_P_RANDOM_BOUND = 1.4e-2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def e4m3_p_attention(logits: torch.Tensor, values: torch.Tensor, tiling: Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows' attention over one sequence with P rounded as the wgmma kernels round it: logits (rows, n) float64
    in log2 units, -inf where a row does not see a position (causal), values (n, 512) float64 -> (out (rows, 512),
    log2-sum-exp (rows,)) float64. A row that has seen nothing yet keeps p = 0 (the kernels' guard), one that sees
    nothing gets zeros and -inf."""
    rows, n = logits.shape
    tile = tiling.block_n
    per_split = _ceil_div(_ceil_div(n, tiling.num_splits), tile) * tile
    tiles_per_split = per_split // tile
    splits = _ceil_div(_ceil_div(n, tile), tiles_per_split)  # those with rows
    padded = torch.full((rows, splits * per_split), -math.inf, dtype=logits.dtype, device=logits.device)
    padded[:, :n] = logits
    tile_max = padded.view(rows, splits, tiles_per_split, tile).amax(dim=-1)
    running = tile_max.cummax(dim=-1).values  # (rows, splits, tiles_per_split): the maximum after each tile
    base = torch.where(running == -math.inf, 0.0, running)  # what P is taken against
    split_base = base[..., -1:]
    row_base = base.repeat_interleave(tile, dim=-1).view(rows, -1)[:, :n]
    row_split_base = split_base.expand(-1, -1, per_split).reshape(rows, -1)[:, :n]
    stored = _round_e4m3(torch.exp2(logits - row_base + P_LOG2_BIAS))
    weights = stored * torch.exp2(row_base - row_split_base)  # the rescales of later tiles
    unrounded = torch.exp2(logits - row_split_base + P_LOG2_BIAS)
    partials, lses = [], []
    for split in range(splits):
        cols = slice(split * per_split, min((split + 1) * per_split, n))
        row_sum = unrounded[:, cols].sum(dim=-1, keepdim=True)
        seen = row_sum > 0
        partials.append(torch.where(seen, weights[:, cols] @ values[cols] / row_sum.clamp(min=1e-300), 0.0))
        lses.append(torch.where(seen, split_base[:, split] + torch.log2(row_sum) - P_LOG2_BIAS, -math.inf))
    if tiling.num_splits == 1:
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
            out[b] = e4m3_p_attention(scores * math.log2(math.e), keys[lo:hi, :V_HEAD_DIM], tiling or Tiling())[0]
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
    the splits of the plan the leaderboard adapter makes for `data`."""
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
