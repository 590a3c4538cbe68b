"""Hostile and exact inputs in the competition's tuple (reference.input_from's): logits shifted by a common offset
or an attention sink, where softmax's shift invariance keeps the truth and the kernels' precision shows; and grid
data, on which every fast kernel's roundings are exact, so a 1% bug stands out; and a tensor's copy off a 16-byte
boundary (shifted), which the kernels' wide loads refuse."""

import itertools

import torch

from reference import (
    KV_LORA_RANK,
    NUM_HEADS,
    NUM_KV_HEADS,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    generate_varlen_input,
    input_from,
)
from task import input_t
from utils import get_device

# The logit shifts of generate_shifted_input: every score gets q[..., 575] * k[..., 575] * sm_scale.
SHIFT_KEY_VALUE = 24.0  # k[..., 575]: 24 x sm_scale = 1, so q[..., 575] = the shift in logits


def generate_shifted_input(kv_lens: list[int], seed: int, shift: float, sink: bool = False,
                           device: torch.device | None = None) -> input_t:
    """generate_varlen_input's data with large logits, which softmax's shift invariance makes harmless for the
    exact result: q[..., 575] = shift and k[..., 575] = SHIFT_KEY_VALUE, so every logit of a sequence grows by
    `shift`. With sink=True only the first key of each sequence gets k[..., 575] = SHIFT_KEY_VALUE (the others
    0): one key `shift` above the rest, an attention sink."""
    q, kv_data, _, _, _ = generate_varlen_input(kv_lens, seed, device=device)
    q, kv = q.clone(), kv_data["bf16"].clone()
    q[..., QK_HEAD_DIM - 1] = shift
    if sink:
        kv[:, :, QK_HEAD_DIM - 1] = 0.0
        firsts = [end - n for end, n in zip(itertools.accumulate(kv_lens), kv_lens, strict=True) if n]
        kv[firsts, :, QK_HEAD_DIM - 1] = SHIFT_KEY_VALUE
    else:
        kv[:, :, QK_HEAD_DIM - 1] = SHIFT_KEY_VALUE
    return input_from(q, kv, kv_lens)


# generate_grid_input. Queries are GRID_Q_UNIT = bf16(24 / log2(e)) times small integers, so that each logit in log2
# units, log2(e) * sm_scale * q.k, lies within 6.3e-4 x its size of an integer. A head's q holds +1 at
# GRID_Q_TERMS / 2 rope dims and -1 at as many, where every key holds 0 or 1: its logits are integers in
# [-GRID_Q_TERMS / 2, GRID_Q_TERMS / 2], so 2^(logit - max) >= 2^-8 is a power of two to within 0.4%, which an FP8
# P (with or without a bias, whatever its split's running maximum) or an fp16 P keeps exactly. Its largest |q|, 4
# units in dim 575 (where every key is 0), makes 448 / max|q_h| x q exactly e4m3 (112 x {0, +-1, +-4}), with one
# scale per head or per tensor. The keys' dims 0..511, the values, are +-1 with odds 1 in GRID_VALUE_ODDS each, else 0.
GRID_Q_UNIT = 16.625
GRID_Q_TERMS = 8
GRID_VALUE_ODDS = 32
# The bound on grid data of every fast kernel's worst sequence against the emulation of what it rounds: a bf16
# rounding of the output alone is ~2e-3 there. Measured on the H200: 1.7-2.4e-3 for every GPU kernel, >= 1.09e-2
# with sm_scale x 1.01 (tests/test_negative_controls.py holds each kernel to it, with the planted bugs failing it).
GRID_REL_L2_BOUND = 5e-3


def generate_grid_input(kv_lens: list[int], seed: int, device: torch.device | None = None) -> input_t:
    """Input on which the fast kernels' own roundings are exact (GRID_Q_UNIT's comment): the FP8 and MXFP4 caches
    hold the bf16 keys exactly, and Q's e4m3 rounding and P's e4m3 or fp16 rounding lose nothing, so what a fast
    kernel computes differs from the exact attention only by its accumulations and its bf16 outputs, and a 1% error
    in sm_scale or in the output stands out."""
    device = get_device() if device is None else device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    batch, total_kv = len(kv_lens), int(sum(kv_lens))
    rope = QK_ROPE_HEAD_DIM - 1  # dims 512..574
    where = KV_LORA_RANK + torch.rand((batch, NUM_HEADS, rope), generator=gen, device=device).argsort(dim=-1)
    signs = torch.ones((batch, NUM_HEADS, GRID_Q_TERMS), dtype=torch.bfloat16, device=device)
    signs[..., GRID_Q_TERMS // 2:] = -1
    q = torch.zeros((batch, NUM_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16, device=device)
    q.scatter_(-1, where[..., :GRID_Q_TERMS], signs)
    q[..., QK_HEAD_DIM - 1] = 8 * torch.randint(0, 2, (batch, NUM_HEADS), generator=gen, device=device) - 4
    draw = torch.randint(0, GRID_VALUE_ODDS, (total_kv, NUM_KV_HEADS, QK_HEAD_DIM), generator=gen, device=device,
                         dtype=torch.uint8)
    kv = (draw == 0).to(torch.bfloat16) - (draw == 1).to(torch.bfloat16)
    kv[..., KV_LORA_RANK:] = (draw[..., KV_LORA_RANK:] % 2).to(torch.bfloat16)
    kv[..., QK_HEAD_DIM - 1] = 0.0
    return input_from(q * GRID_Q_UNIT, kv, kv_lens)


def shifted(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """A contiguous copy of t that starts `elements` elements past a 16-byte boundary (of a dtype copy_ takes)."""
    return torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)[elements:].view(t.shape).copy_(t)
