"""Reference for MLA decode (DeepSeek-R1 forward_absorb), portable: runs on CUDA, ROCm or the CPU.

Layout (input_t in task.py):
  q:         (total_q, 16, 576) bfloat16, absorbed query; total_q = batch * q_seq_len
  kv_data:   the same KV cache in three formats, all derived from one bf16 tensor:
    "bf16":  (total_kv, 1, 576) bfloat16: keys use all 576 dims, values the first 512
    "fp8":   (kv_fp8 (total_kv, 1, 576), scale (1,) float32): kv ~= kv_fp8 * scale, dynamic per-tensor,
             float8_e4m3fnuz on gfx942 and float8_e4m3fn everywhere else
    "mxfp4": (kv_fp4x2 (total_kv, 1, 288), scale_e8m0 (ceil(total_kv/256)*256, 24)): block-32 MXFP4 as
             aiter's dynamic_mxfp4_quant at the leaderboard runner's commit writes it (see quantize_mxfp4)
  qo_indptr: (batch + 1,) int32; kv_indptr: (batch + 1,) int32
  config:    sizes, sm_scale = 1/sqrt(576), q_seq_len, kv_seq_len (the length of every sequence of a
             uniform batch; None or the maximum for a variable-length batch)
Output: (total_q, 16, 512) bfloat16.

ref_kernel is the BF16 ground truth (bf16 q against bf16 KV, fp32 math); check_implementation applies the
leaderboard's loose rule and a strict per-sequence relative-L2 gate that rejects e.g. an all-zero output.
"""

import math
import os

import torch

from task import input_t, output_t
from utils import get_device, leaderboard_match

NUM_HEADS = 16
NUM_KV_HEADS = 1
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576
V_HEAD_DIM = KV_LORA_RANK  # 512
SM_SCALE = 1.0 / math.sqrt(QK_HEAD_DIM)

MXFP4_BLOCK = 32
MXFP4_SCALE_ROW_ALIGN = 256  # the runner's aiter pads scale rows to a multiple of 256 ...
MXFP4_SCALE_COL_ALIGN = 8  # ... and scale columns (blocks per row) to a multiple of 8
MXFP4_SCALE_PAD_BYTE = 0xFF  # E8M0 NaN: a consumer that reads the padding produces NaN, never a plausible value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rows of KV converted to fp32 at a time: bounds the reference's and the quantizers' extra memory
# (65536 rows x 576 x 4 B = 151 MB per temporary) so batch 256 x kv 8192 fits a 24 GiB CPU machine.
CHUNK_ROWS = 1 << 16

# Strict gate: relative L2 error ||out - ref|| / ||ref|| against the BF16 ground truth, per sequence (one query
# row, 16 x 512 values), the worst sequence compared with a bound chosen by the KV format the submission reads
# (MLA_KV_FORMAT, default fp8). Per sequence, because a global norm is dominated by the short sequences (whose
# outputs are ~0.8 in size against ~0.05 at kv 1024) and would hide a sequence left unwritten. Measured worst
# sequence on randn data, fp32 attention over each dequantized cache (tests/test_reference.py re-measures it),
# lengths 1..8192: FP8 KV 0.040 with bf16 Q and 0.047 with FP8 Q; MXFP4 KV 0.160; bf16 output rounding 0.002.
# Each bound is 1.6-1.7x the worst measured error and far below the 1.0 of a zero or unwritten sequence or the
# ~0.7+ of attending to half the cache.
REL_L2_BOUND = {"bf16": 0.01, "fp8": 0.08, "mxfp4": 0.25}
LEADERBOARD_RTOL = 1e-1
LEADERBOARD_ATOL = 1e-1
LEADERBOARD_MAX_MISMATCH = 0.05


def fp8_dtype(device: torch.device) -> torch.dtype:
    """The FP8 E4M3 flavour of a device: e4m3fnuz on gfx942 (MI300X), e4m3fn everywhere else."""
    if device.type == "cuda" and torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if arch.startswith("gfx942"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _row_chunks(n: int, chunk: int = CHUNK_ROWS):
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor FP8: scale = amax / finfo.max (float32, shape (1,)); x ~= x_fp8 * scale."""
    finfo = torch.finfo(dtype)
    amax = x.abs().amax().float().clamp(min=1e-12)
    # A tensor divisor: a Python number would make CUDA (and ROCm) multiply by its float32 reciprocal, up to an ulp
    # away from the quotient the CPU computes; the scale is then the same on every device.
    scale = (amax / amax.new_full((), finfo.max)).reshape(1)
    flat = x.reshape(x.shape[0], -1)
    out = torch.empty(flat.shape, dtype=dtype, device=x.device)
    for lo, hi in _row_chunks(flat.shape[0]):
        out[lo:hi] = (flat[lo:hi].float() / scale).clamp(finfo.min, finfo.max).to(dtype)
    return out.view(x.shape), scale


def _fp4x2_dtype() -> torch.dtype:
    return getattr(torch, "float4_e2m1fn_x2", torch.uint8)


def _e8m0_dtype() -> torch.dtype:
    return getattr(torch, "float8_e8m0fnu", torch.uint8)


def _mxfp4_encode_rows(x: torch.Tensor, ties: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, N) float -> packed codes (rows, N/2) uint8 and scale bytes (rows, N/32) uint8."""
    rows, n = x.shape
    blocks = x.float().reshape(rows, n // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # Round amax to a power of two "evenly": add 0x200000 to the fp32 bits and clear the mantissa.
    rounded_exp = ((amax.view(torch.int32) + 0x200000) >> 23) & 0xFF
    e = (rounded_exp - 127 - 2).clamp(-127, 127)  # 2 = largest E2M1 exponent; a zero block gives -127
    scale_bytes = (e + 127).to(torch.uint8)
    q = blocks * torch.exp2(-e.float()).unsqueeze(-1)  # exact: a power of two
    mag = q.abs()
    # E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}: count the midpoints at or below |q|. Ties go away from
    # zero (the runner's aiter) or to the even code (aiter from 2026-03-18).
    idx = torch.zeros(mag.shape, dtype=torch.uint8, device=x.device)
    midpoints = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    for k, m in enumerate(midpoints):
        lower_is_even = k % 2 == 0
        if ties == "away" or not lower_is_even:
            idx += (mag >= m).to(torch.uint8)
        else:
            idx += (mag > m).to(torch.uint8)
    sign = torch.signbit(q).to(torch.uint8) << 3  # -0.0 keeps its sign: code 0x8
    codes = (idx | sign).reshape(rows, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble = even element
    return packed, scale_bytes


def quantize_mxfp4(x: torch.Tensor, ties: str = "away", padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (block 32, E2M1 values, E8M0 scales) exactly as aiter's dynamic_mxfp4_quant(shuffle=False).

    x: (..., N) with N a multiple of 32, quantized as a 2-D (M, N) tensor, M = product of leading dims.
    Returns (packed (..., N/2) as float4_e2m1fn_x2, scales as float8_e8m0fnu). ties="away", padded=True is
    the leaderboard runner's aiter (commit f3be04a): scales (ceil(M/256)*256, ceil(N/32/8)*8), padding set to
    MXFP4_SCALE_PAD_BYTE. ties="even", padded=False is aiter from 2026-03-18: scales (M, N/32).
    """
    if ties not in ("away", "even"):
        raise ValueError(f"ties: expected 'away' or 'even', got {ties!r}")
    n = x.shape[-1]
    if n % MXFP4_BLOCK:
        raise ValueError(f"x.shape[-1]: expected a multiple of {MXFP4_BLOCK}, got {n}")
    flat = x.reshape(-1, n)
    m, nblocks = flat.shape[0], n // MXFP4_BLOCK
    packed = torch.empty((m, n // 2), dtype=torch.uint8, device=x.device)
    if padded:
        srows = -(-m // MXFP4_SCALE_ROW_ALIGN) * MXFP4_SCALE_ROW_ALIGN
        scols = -(-nblocks // MXFP4_SCALE_COL_ALIGN) * MXFP4_SCALE_COL_ALIGN
    else:
        srows, scols = m, nblocks
    scales = torch.full((srows, scols), MXFP4_SCALE_PAD_BYTE, dtype=torch.uint8, device=x.device)
    for lo, hi in _row_chunks(m):
        packed[lo:hi], scales[lo:hi, :nblocks] = _mxfp4_encode_rows(flat[lo:hi], ties)
    return packed.view(*x.shape[:-1], n // 2).view(_fp4x2_dtype()), scales.view(_e8m0_dtype())


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_mxfp4 for either scale layout (padded (M_pad, 24) or trimmed (M, 18))."""
    half = packed.shape[-1]
    codes8 = packed.view(torch.uint8).reshape(-1, half)
    m, n = codes8.shape[0], 2 * half
    nblocks = n // MXFP4_BLOCK
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    sbytes = scales.view(torch.uint8)
    if sbytes.dim() != 2 or sbytes.shape[0] < m or sbytes.shape[1] < nblocks:
        raise ValueError(f"scales: expected at least ({m}, {nblocks}) E8M0 bytes, got {tuple(sbytes.shape)}")
    out = torch.empty((m, n), dtype=dtype, device=packed.device)
    for lo, hi in _row_chunks(m):
        c = codes8[lo:hi]
        vals = torch.stack((table[(c & 0xF).long()], table[(c >> 4).long()]), dim=-1).reshape(hi - lo, nblocks, -1)
        s = torch.exp2(sbytes[lo:hi, :nblocks].float() - 127.0)  # byte 255 is NaN in E8M0; exp2 gives 2^128=inf
        s = torch.where(sbytes[lo:hi, :nblocks] == 255, torch.nan, s)
        out[lo:hi] = (vals * s.unsqueeze(-1)).reshape(hi - lo, n).to(dtype)
    return out.view(*packed.shape[:-1], n)


def _aiter_mxfp4_quant():
    """aiter's own quantizer where aiter imports (the leaderboard's runner); None elsewhere."""
    try:
        from aiter.utility.fp4_utils import dynamic_mxfp4_quant
    except ImportError:
        return None
    return dynamic_mxfp4_quant


def generate_input(batchsize: int, qseqlen: int, kvseqlen: int, seed: int) -> input_t:
    """Uniform batch on this machine's device: every sequence has qseqlen queries and kvseqlen KV rows."""
    return generate_varlen_input([kvseqlen] * batchsize, seed, qseqlen=qseqlen)


def generate_varlen_input(kv_lens: list[int], seed: int, qseqlen: int = 1, device: torch.device | None = None,
                          ties: str = "away", padded_scales: bool = True) -> input_t:
    """Input with per-sequence KV lengths (any, 0 included); config['kv_seq_len'] is the length when all are
    equal, else the maximum."""
    device = get_device() if device is None else device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    batch = len(kv_lens)
    total_q, total_kv = batch * qseqlen, int(sum(kv_lens))
    q = torch.randn((total_q, NUM_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    kv = torch.randn((total_kv, NUM_KV_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    return input_from(q, kv, kv_lens, qseqlen=qseqlen, ties=ties, padded_scales=padded_scales)


def input_from(q: torch.Tensor, kv: torch.Tensor, kv_lens: list[int], qseqlen: int = 1, ties: str = "away",
               padded_scales: bool = True) -> input_t:
    """The input tuple for q (batch * qseqlen, 16, 576) bf16 and kv (sum(kv_lens), 1, 576) bf16, sequence b owning
    kv_lens[b] consecutive rows: the FP8 and MXFP4 caches quantized from kv, the indptrs and the config."""
    device = q.device
    batch = len(kv_lens)
    total_kv = kv.shape[0]
    kv_fp8, kv_scale = quantize_fp8(kv, fp8_dtype(device))
    aiter_quant = _aiter_mxfp4_quant() if (ties, padded_scales) == ("away", True) else None
    if aiter_quant is not None:
        fp4, fp4_scale = aiter_quant(kv.reshape(total_kv, QK_HEAD_DIM))
        fp4 = fp4.view(total_kv, NUM_KV_HEADS, QK_HEAD_DIM // 2)
    else:
        fp4, fp4_scale = quantize_mxfp4(kv, ties=ties, padded=padded_scales)
    kv_data = {"bf16": kv, "fp8": (kv_fp8, kv_scale), "mxfp4": (fp4, fp4_scale)}
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * qseqlen
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(torch.tensor(kv_lens, dtype=torch.int64), 0).to(torch.int32)
    uniform = len(set(kv_lens)) <= 1
    config = {
        "batch_size": batch,
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "qk_head_dim": QK_HEAD_DIM,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "q_seq_len": qseqlen,
        "kv_seq_len": (kv_lens[0] if kv_lens else 0) if uniform else max(kv_lens),
        "sm_scale": SM_SCALE,
    }
    return q, kv_data, qo_indptr, kv_indptr, config


def attention_reference(q: torch.Tensor, kv: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        sm_scale: float, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-sequence softmax attention in compute_dtype; returns (total_q, heads, 512) in compute_dtype.

    q: (total_q, heads, 576); kv: (total_kv, 1, 576) in any float dtype (already dequantized). With more than
    one query row per sequence, query i of L sees the first n - L + 1 + i KV rows (causal, bottom-right). A
    sequence with no KV rows, or a query that sees none, gives zeros.
    """
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    out = torch.zeros((q.shape[0], q.shape[1], V_HEAD_DIM), dtype=compute_dtype, device=q.device)
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        n, lq = k1 - k0, q1 - q0
        if n <= 0 or lq <= 0:
            continue
        keys = kv[k0:k1, 0].to(compute_dtype)  # (n, 576)
        qs = q[q0:q1].to(compute_dtype)  # (lq, heads, 576)
        scores = torch.einsum("qhd,nd->qhn", qs, keys) * sm_scale
        if lq > 1:
            visible = torch.arange(n, device=q.device)[None, :] <= (n - lq + torch.arange(lq, device=q.device))[:, None]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if lq > 1:  # a query that sees no row (n < lq) gives zeros, as a sequence with no rows does
            probs = probs.masked_fill(~visible.any(dim=-1)[:, None, None], 0.0)
        out[q0:q1] = torch.einsum("qhn,nd->qhd", probs, keys[:, :V_HEAD_DIM])
    return out


@torch.no_grad()
def ref_kernel(data: input_t) -> output_t:
    """BF16 ground truth: bf16 q against bf16 KV, fp32 math, output bf16."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    return attention_reference(q, kv_data["bf16"], qo_indptr, kv_indptr, config["sm_scale"]).to(torch.bfloat16)


def kv_format_under_test() -> str:
    """The KV format the submission is told to read (MLA_KV_FORMAT, default fp8): selects the strict bound."""
    fmt = os.environ.get("MLA_KV_FORMAT", "fp8")
    if fmt not in REL_L2_BOUND:
        raise ValueError(f"MLA_KV_FORMAT: expected one of {sorted(REL_L2_BOUND)}, got {fmt!r}")
    return fmt


@torch.no_grad()
def relative_l2(output: torch.Tensor, expected: torch.Tensor) -> float:
    """||output - expected|| / ||expected|| over the whole tensor."""
    diff = (output.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp(min=1e-30)).item()


@torch.no_grad()
def worst_row_relative_l2(output: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest relative L2 error of one query row (all heads); a row whose reference is zero (a sequence
    with no KV) must itself be zero."""
    diff = (output.double() - expected.double()).flatten(1).norm(dim=1)
    return (diff / expected.double().flatten(1).norm(dim=1).clamp(min=1e-30)).max().item()


@torch.no_grad()
def check_implementation(data: input_t, output: output_t, kv_format: str | None = None) -> tuple[bool, str]:
    """The leaderboard's rule (rtol = atol = 0.1, at most 5% of elements may miss) and a strict gate it lacks:
    exact shape and dtype, no NaN/Inf, every sequence's relative L2 error under the bound of the KV format the
    submission read: `kv_format` (eval.py passes the submission's own select_kv_format()), else
    kv_format_under_test()."""
    return check_against(data, output, None, kv_format)


@torch.no_grad()
def check_against(data: input_t, output: output_t, expected: torch.Tensor | None,
                  kv_format: str | None = None) -> tuple[bool, str]:
    """check_implementation with the BF16 ground truth already computed (ref_kernel(data)), or None to compute it
    here: a caller that also reports error numbers runs the reference once."""
    q = data[0]
    expected_shape = (q.shape[0], NUM_HEADS, V_HEAD_DIM)
    if not isinstance(output, torch.Tensor):
        return False, f"output: expected a torch.Tensor, got {type(output).__name__}"
    if tuple(output.shape) != expected_shape:
        return False, f"output.shape: expected {expected_shape}, got {tuple(output.shape)}"
    if output.dtype != torch.bfloat16:
        return False, f"output.dtype: expected torch.bfloat16, got {output.dtype}"
    nonfinite = (~torch.isfinite(output)).sum().item()
    if nonfinite:
        return False, f"output has {nonfinite} NaN/Inf elements"
    if expected is None:
        expected = ref_kernel(data)
    fmt = kv_format or kv_format_under_test()
    if fmt not in REL_L2_BOUND:
        raise ValueError(f"kv_format: expected one of {sorted(REL_L2_BOUND)}, got {fmt!r}")
    ok_lb, ratio, max_abs = leaderboard_match(output, expected, LEADERBOARD_RTOL, LEADERBOARD_ATOL,
                                              LEADERBOARD_MAX_MISMATCH)
    rel = relative_l2(output, expected)
    worst = worst_row_relative_l2(output, expected) if output.numel() else 0.0
    bound = REL_L2_BOUND[fmt]
    msg = (f"rel_l2={rel:.3e}, worst sequence rel_l2={worst:.3e} (bound {bound:g} for {fmt} KV); leaderboard "
           f"rule: {100 * ratio:.2f}% mismatched (limit {100 * LEADERBOARD_MAX_MISMATCH:g}%), "
           f"max_abs_err={max_abs:.3e}")
    if not ok_lb:
        return False, "leaderboard rule failed: " + msg
    if not worst <= bound:
        return False, "strict gate failed: " + msg
    return True, msg
