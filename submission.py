#!POPCORN leaderboard amd-mixed-mla
#!POPCORN gpu MI355X
"""MLA decode (DeepSeek-R1 forward_absorb): 16 query heads share one latent KV head.

Contract (the leaderboard's input_t, see task.py):
  q:         (total_q, 16, 576) bfloat16, total_q = batch * q_seq_len, q_seq_len = 1 (single-token decode)
  kv_data:   "fp8":   (kv (total_kv, 1, 576) float8_e4m3fn (e4m3fnuz on gfx942), scale (1,) float32)
             "mxfp4": (kv (total_kv, 1, 288) float4_e2m1fn_x2 or uint8, two E2M1 codes a byte, low nibble =
                       even element; scales E8M0 (rows >= total_kv, cols >= 18), padded (M_pad, 24) or (M, 18))
             "bf16":  (total_kv, 1, 576) bfloat16 (not read by any backend)
             keys use all 576 dims, values the first 512
  qo_indptr: (batch + 1,) int32; kv_indptr: (batch + 1,) int32, sequence b owns KV rows
             kv_indptr[b]:kv_indptr[b+1] (0 = first, non-decreasing, last <= total_kv)
  config:    batch_size, num_heads (16), num_kv_heads (1), qk_head_dim (576), v_head_dim (512), q_seq_len (1),
             kv_seq_len (every sequence's length in a uniform batch; None or the maximum otherwise; when
             batch * kv_seq_len == total_kv every sequence has exactly kv_seq_len rows), sm_scale
Output: (total_q, 16, 512) bfloat16. A sequence with no KV rows gives zeros.

Backends (MLA_BACKEND=auto|aiter|cuda|triton|torch, default auto; a forced one that is unavailable fails):
  aiter   AMD GPU with aiter importable (auto picks it on ROCm): FP8 Q + FP8 KV, persistent mla_decode_fwd
  cuda    NVIDIA GPU with nvcc (auto picks it where it reads the format: FP8 anywhere, MXFP4 on Hopper): our
          CUDA kernels (wgmma on Hopper, mma.sync elsewhere), built at the first call
  triton  any GPU with triton (auto: NVIDIA where the cuda backend cannot run, AMD without aiter): our split-KV kernel
  torch   anywhere: fp32 math over the dequantized cache in bounded chunks
KV format (MLA_KV_FORMAT=fp8|mxfp4, default fp8) selects which cache the cuda, triton and torch backends read.
MLA_VALIDATE=1 adds the host-side check of the indptr contents (a device sync) on every backend; the torch
backend always does it. GPU kernels never read outside the cache whatever the indptr holds: a sequence whose
range is invalid gets NaN rows.
"""

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile

import torch

TRITON_IMPORT_ERROR = None
try:
    import triton
    import triton.language as tl
except ImportError as e:  # no triton here: the triton backend is unavailable (select_backend says why)
    triton = None
    TRITON_IMPORT_ERROR = e

NUM_HEADS = 16
NUM_KV_HEADS = 1
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576
V_HEAD_DIM = KV_LORA_RANK  # 512
MXFP4_BLOCK = 32
MXFP4_BLOCKS_PER_ROW = QK_HEAD_DIM // MXFP4_BLOCK  # 18
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP4X2_DTYPES = tuple(d for d in (getattr(torch, "float4_e2m1fn_x2", None), torch.uint8) if d is not None)
E8M0_DTYPES = tuple(d for d in (getattr(torch, "float8_e8m0fnu", None), torch.uint8) if d is not None)
BACKENDS = ("aiter", "cuda", "triton", "torch")
KV_FORMATS = ("fp8", "mxfp4")
CONFIG_KEYS = ("batch_size", "num_heads", "num_kv_heads", "qk_head_dim", "v_head_dim", "q_seq_len", "kv_seq_len",
               "sm_scale")

log = logging.getLogger("mla_decode")


# ---------------------------------------------------------------------------------------------------------
# Validation: shapes, dtypes and config, without reading device memory (no host sync)
# ---------------------------------------------------------------------------------------------------------


def _expect(cond: bool, field: str, expected: str, got) -> None:
    if not cond:
        raise ValueError(f"{field}: expected {expected}, got {got}")


def _expect_tensor(x, field: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{field}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _expect_pair(x, field: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"{field}: expected a (tensor, scale) pair, got {type(x).__name__}")
    return _expect_tensor(x[0], f"{field}[0]"), _expect_tensor(x[1], f"{field}[1]")


def _expect_int(x, field: str, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{field}: expected an int{' or None' if allow_none else ''}, got {type(x).__name__}")


# (batch, config items) that passed _validate_config: the check is a pure function of them, and skipping it for
# a config seen before saves most of validate()'s host time (each call brings a new but equal dict).
_VALID_CONFIGS: set = set()


def _validate_config(config, batch: int) -> None:
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, got {type(config).__name__}")
    try:
        seen = (batch, tuple(config.items()))
        if seen in _VALID_CONFIGS:
            return
    except TypeError:  # an unhashable value: check it every time
        seen = None
    missing = [k for k in CONFIG_KEYS if k not in config]
    _expect(not missing, "config", f"keys {list(CONFIG_KEYS)}", f"a dict missing {missing}")
    for key, want in (("num_heads", NUM_HEADS), ("num_kv_heads", NUM_KV_HEADS), ("qk_head_dim", QK_HEAD_DIM),
                      ("v_head_dim", V_HEAD_DIM), ("q_seq_len", 1)):
        _expect_int(config[key], f"config[{key!r}]")
        _expect(config[key] == want, f"config[{key!r}]", str(want), config[key])
    _expect_int(config["batch_size"], "config['batch_size']")
    _expect(config["batch_size"] == batch, "config['batch_size']", f"{batch} (len(qo_indptr) - 1)",
            config["batch_size"])
    _expect_int(config["kv_seq_len"], "config['kv_seq_len']", allow_none=True)
    _expect(config["kv_seq_len"] is None or config["kv_seq_len"] >= 0, "config['kv_seq_len']", "None or >= 0",
            config["kv_seq_len"])
    sm = config["sm_scale"]
    _expect(isinstance(sm, (int, float)) and not isinstance(sm, bool) and math.isfinite(sm) and sm > 0,
            "config['sm_scale']", "a positive finite float", repr(sm))
    if seen is not None and len(_VALID_CONFIGS) < 256:
        _VALID_CONFIGS.add(seen)


def _validate_indptr(x, field: str, length: int | None, device: torch.device) -> torch.Tensor:
    x = _expect_tensor(x, field)
    _expect(x.dtype == torch.int32, f"{field}.dtype", "torch.int32", x.dtype)
    _expect(x.dim() == 1 and x.shape[0] >= 2, f"{field}.shape", "(batch + 1,) with batch >= 1", tuple(x.shape))
    if length is not None:
        _expect(x.shape[0] == length, f"{field}.shape", f"({length},) like qo_indptr", tuple(x.shape))
    _expect(x.device == device, f"{field}.device", f"{device} (q's device)", x.device)
    _expect(x.is_contiguous(), field, "a contiguous tensor", "a strided view")
    return x


def _validate_kv(kv_data, kv_format: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (kv, scale) of the format that will be read."""
    if not isinstance(kv_data, dict):
        raise TypeError(f"kv_data: expected a dict of KV formats, got {type(kv_data).__name__}")
    _expect(kv_format in kv_data, "kv_data", f"a {kv_format!r} entry", f"keys {sorted(kv_data)}")
    field = f"kv_data[{kv_format!r}]"
    kv, scale = _expect_pair(kv_data[kv_format], field)
    width = QK_HEAD_DIM if kv_format == "fp8" else QK_HEAD_DIM // 2
    dtypes = FP8_DTYPES if kv_format == "fp8" else FP4X2_DTYPES
    _expect(kv.dim() == 3 and kv.shape[1] == NUM_KV_HEADS and kv.shape[2] == width, f"{field}[0].shape",
            f"(total_kv, {NUM_KV_HEADS}, {width})", tuple(kv.shape))
    _expect(kv.dtype in dtypes, f"{field}[0].dtype", f"one of {dtypes}", kv.dtype)
    _expect(kv.is_contiguous(), f"{field}[0]", "a contiguous tensor", "a strided view")
    _expect(kv.device == device and scale.device == device, f"{field} device", f"{device} (q's device)",
            (kv.device, scale.device))
    if kv_format == "fp8":
        _expect(scale.dtype == torch.float32, f"{field}[1].dtype", "torch.float32", scale.dtype)
        _expect(scale.numel() == 1, f"{field}[1].shape", "(1,)", tuple(scale.shape))
    else:
        _expect(scale.dtype in E8M0_DTYPES, f"{field}[1].dtype", f"one of {E8M0_DTYPES}", scale.dtype)
        _expect(scale.dim() == 2 and scale.shape[0] >= kv.shape[0] and scale.shape[1] >= MXFP4_BLOCKS_PER_ROW,
                f"{field}[1].shape", f"(>= {kv.shape[0]}, >= {MXFP4_BLOCKS_PER_ROW}) E8M0 block scales",
                tuple(scale.shape))
        _expect(scale.stride(1) == 1, f"{field}[1]", "unit stride along blocks", scale.stride())
    return kv, scale


def _signature(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)  # shape and strides settle contiguity too


# Signatures of inputs that passed the checks below: they read only these attributes (never tensor contents), so an
# input with the same signature passes them again. Saves most of validate()'s host time on repeated shapes.
_VALID_INPUTS: set = set()


def validate(data, kv_format: str) -> tuple:
    """Checks everything that can be checked without a device sync; returns
    (q, kv, kv_scale, qo_indptr, kv_indptr, config) for the chosen KV format."""
    if not (isinstance(data, (tuple, list)) and len(data) == 5):
        raise TypeError("data: expected (q, kv_data, qo_indptr, kv_indptr, config)")
    q, kv_data, qo_indptr, kv_indptr, config = data
    try:
        kv, scale = kv_data[kv_format]
        seen = (kv_format, *map(_signature, (q, qo_indptr, kv_indptr, kv, scale)))
    except (TypeError, KeyError, ValueError, AttributeError):  # not a valid input: the checks below say why
        seen = None
    if seen is not None and seen in _VALID_INPUTS:
        _validate_config(config, qo_indptr.shape[0] - 1)
        return q, kv, scale, qo_indptr, kv_indptr, config
    q = _expect_tensor(q, "q")
    _expect(q.dtype == torch.bfloat16, "q.dtype", "torch.bfloat16", q.dtype)
    _expect(q.dim() == 3 and q.shape[1] == NUM_HEADS and q.shape[2] == QK_HEAD_DIM, "q.shape",
            f"(total_q, {NUM_HEADS}, {QK_HEAD_DIM})", tuple(q.shape))
    _expect(q.is_contiguous(), "q", "a contiguous tensor", "a strided view")
    qo_indptr = _validate_indptr(qo_indptr, "qo_indptr", None, q.device)
    kv_indptr = _validate_indptr(kv_indptr, "kv_indptr", qo_indptr.shape[0], q.device)
    batch = qo_indptr.shape[0] - 1
    _validate_config(config, batch)
    _expect(q.shape[0] == batch, "q.shape[0]", f"{batch} (batch x q_seq_len)", q.shape[0])
    kv, scale = _validate_kv(kv_data, kv_format, q.device)
    if seen is not None and len(_VALID_INPUTS) < 256:
        _VALID_INPUTS.add(seen)
    return q, kv, scale, qo_indptr, kv_indptr, config


def validate_indptr_contents(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, total_kv: int,
                             kv_seq_len: int | None) -> list[int]:
    """Host-side check of the indptr contents (a device sync). Returns the KV lengths."""
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    _expect(qo == list(range(len(qo))), "qo_indptr", "[0, 1, ..., batch] (one query per sequence)", qo[:8])
    _expect(kvp[0] == 0, "kv_indptr[0]", "0", kvp[0])
    lens = [b - a for a, b in zip(kvp[:-1], kvp[1:], strict=True)]
    _expect(min(lens) >= 0, "kv_indptr", "non-decreasing values", kvp[:8])
    _expect(kvp[-1] <= total_kv, "kv_indptr[-1]", f"<= total_kv = {total_kv}", kvp[-1])
    if kv_seq_len is not None:
        _expect(max(lens) <= kv_seq_len, "config['kv_seq_len']", f">= the longest sequence ({max(lens)})",
                kv_seq_len)
        # Plans are reused without reading kv_indptr on this promise (see _aiter_plan_key).
        if len(lens) * kv_seq_len == total_kv:
            _expect(min(lens) == kv_seq_len, "kv_indptr", f"every length == config['kv_seq_len'] = {kv_seq_len} "
                    "(batch * kv_seq_len == total_kv declares a uniform batch)", f"lengths {lens[:8]}")
    return lens


# ---------------------------------------------------------------------------------------------------------
# Backend selection: one place, env override, fails loudly when a forced backend is unavailable
# ---------------------------------------------------------------------------------------------------------


_ANNOUNCED: set = set()  # (device, MLA_BACKEND, choice) already logged


@functools.cache
def _aiter_importable() -> bool:  # cached: a failed import searches sys.path again on every call (~40 us)
    try:
        import aiter  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_usable(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def select_backend(device: torch.device, kv_format: str | None = None) -> str:
    """MLA_BACKEND if set (and usable here), else the best backend available on `device` for `kv_format` (default:
    select_kv_format()); logged once."""
    kv_format = kv_format or select_kv_format()
    forced = os.environ.get("MLA_BACKEND", "auto")
    if forced not in BACKENDS + ("auto",):
        raise ValueError(f"MLA_BACKEND: expected one of {BACKENDS + ('auto',)}, got {forced!r}")
    if forced == "aiter" and not _aiter_importable():
        raise RuntimeError("MLA_BACKEND=aiter: the aiter package (ROCm/aiter, built from source) is not importable")
    if forced == "triton" and triton is None:
        raise RuntimeError(f"MLA_BACKEND=triton: triton does not import: {TRITON_IMPORT_ERROR!r}")
    if forced == "triton" and not _triton_usable(device):
        raise RuntimeError(f"MLA_BACKEND=triton: needs a GPU (or TRITON_INTERPRET=1); device is {device}")
    if forced == "cuda":
        reason = cuda_unusable_reason(device, kv_format)
        if reason is not None:
            raise RuntimeError(f"MLA_BACKEND=cuda: {reason}")
    if forced != "auto":
        choice = forced
    elif device.type == "cuda" and torch.version.hip is not None and _aiter_importable():
        choice = "aiter"
    elif device.type == "cuda" and _cuda_auto_usable(device, kv_format):
        choice = "cuda"
    elif device.type == "cuda" and _triton_usable(device):
        choice = "triton"
    else:
        choice = "torch"
    if (device, forced, choice) not in _ANNOUNCED:
        _ANNOUNCED.add((device, forced, choice))
        log.info("MLA decode on %s: %s backend (MLA_BACKEND=%s)", device, choice, forced)
    return choice


@functools.cache
def _cuda_auto_usable(device: torch.device, kv_format: str) -> bool:
    """For auto: the cuda backend where it builds and reads `kv_format`; where it does not build (no nvcc, an nvcc
    too old for this GPU), the triton backend, with the reason logged as a warning (once per format). MLA_BACKEND=cuda
    raises the reason instead. Cached: called on every decode."""
    reason = cuda_unusable_reason(device)
    if reason is not None and device.type == "cuda" and torch.version.hip is None:
        log.warning("MLA decode: using the triton backend, not cuda: %s", reason)
    return reason is None and cuda_unusable_reason(device, kv_format) is None


def select_kv_format() -> str:
    fmt = os.environ.get("MLA_KV_FORMAT", "fp8")
    if fmt not in KV_FORMATS:  # not _expect: its message would be formatted on every call
        raise ValueError(f"MLA_KV_FORMAT: expected one of {KV_FORMATS}, got {fmt!r}")
    return fmt


# ---------------------------------------------------------------------------------------------------------
# aiter backend
# ---------------------------------------------------------------------------------------------------------


# The call this backend makes, as (arguments passed by position, arguments passed by keyword) per function. The
# leading arguments go by position the way the official reference calls aiter on the leaderboard's runner, the rest
# by keyword. The version guard (_aiter_api) checks these names against each function's signature before any call.
_AITER_DECODE_ARGS = (
    ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q"),
    ("page_size", "nhead_kv", "sm_scale", "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
     "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale", "intra_batch_mode"))
_AITER_INFO_ARGS = (
    ("batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype"),
    ("is_sparse", "fast_mode", "intra_batch_mode"))
_AITER_METADATA_ARGS = (
    ("seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k", "num_heads_k",
     "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map",
     "reduce_partial_map"),
    ("page_size", "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode", "max_split_per_batch",
     "intra_batch_mode", "dtype_q", "dtype_kv"))
AITER_VERSION_NEEDED = ("ROCm/aiter main from 2026-02-02 (commit 739c63177e) or newer, built from source (the "
                        "leaderboard's runner pins f3be04a12a, 2026-03-04); the PyPI wheel amd-aiter 0.1.7.post2.dev18 "
                        "(2025-11) is too old, and so is main between 2026-07-13 (fede90f463) and 2026-07-14 "
                        "(028756633e)")
AITER_KV_GRANULARITY = 16  # KV pages (= tokens at page size 1) per unit of the work split, as the reference uses
AITER_PLAN_LIMIT = 64  # plans kept (least recently created evicted first); the leaderboard uses a handful of shapes

# (mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1) -> the problems found in their signatures
# (empty: this call fits). Keyed on the function objects, so an aiter replaced in-process is inspected again.
_AITER_VERDICTS: dict[tuple, tuple[str, ...]] = {}
_AITER_PLANS: dict[tuple, "_AiterPlan"] = {}


def _aiter_signature_problems(fn, name: str, args: tuple[tuple[str, ...], tuple[str, ...]]) -> list[str]:
    import inspect

    positional, keywords = args
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a compiled op with no Python signature: nothing to check here
        return []
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return []  # an opaque (*args, **kwargs) wrapper: nothing to check here
    head = tuple(p.name for p in params[:len(positional)])
    if head != positional:
        return [f"{name} takes ({', '.join(head)}, ...) by position where this call passes "
                f"({', '.join(positional)}, ...)"]
    try:
        sig.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        return [f"{name}: {e}"]
    return []


def _aiter_api() -> tuple[tuple, torch.dtype]:
    """((mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1), aiter.dtypes.fp8) of an aiter whose
    signatures take this backend's call; otherwise a RuntimeError naming the aiter version needed, before any kernel
    runs. The verdict is cached per set of functions."""
    import aiter

    try:
        import aiter.mla

        fns = (aiter.mla.mla_decode_fwd, aiter.get_mla_metadata_info_v1, aiter.get_mla_metadata_v1)
        fp8 = aiter.dtypes.fp8
    except (ImportError, AttributeError) as e:
        fns, fp8, problems = None, None, (f"{type(e).__name__}: {e}",)
    else:
        problems = _AITER_VERDICTS.get(fns)
        if problems is None:
            found = []
            for fn, name, args in zip(
                    fns, ("aiter.mla.mla_decode_fwd", "aiter.get_mla_metadata_info_v1", "aiter.get_mla_metadata_v1"),
                    (_AITER_DECODE_ARGS, _AITER_INFO_ARGS, _AITER_METADATA_ARGS), strict=True):
                found += _aiter_signature_problems(fn, name, args)
            problems = _AITER_VERDICTS[fns] = tuple(found)
    if problems:
        version = getattr(aiter, "__version__", None) or "of unknown version"
        raise RuntimeError(f"aiter backend: the installed aiter ({version}, {getattr(aiter, '__file__', None)}) "
                           f"cannot take this backend's call: {'; '.join(problems)}. It needs {AITER_VERSION_NEEDED}. "
                           "Or run another backend: MLA_BACKEND=triton or MLA_BACKEND=torch.")
    return fns, fp8


# Q's dynamic per-tensor FP8 quantization for the aiter path, bit for bit reference.quantize_fp8: scale =
# max(amax|q|, 1e-12) / fp8 max in fp32, q_fp8 = q / scale rounded to nearest even (|q / scale| <= fp8 max x (1 +
# 2^-23) rounds to fp8 max, so the reference's clamp before the cast changes nothing). With triton (a GPU, or the
# interpreter) two small kernels: per 4096-element block its max |q|, then every block reduces those maxima to the
# scale and quantizes itself. Without, torch: vector_norm, then the scale in one addcdiv (amax / fp8 max + 1e-12 /
# fp8 max: the addend is below half an ulp of the quotient whenever the quotient is >= 2^-24, max|q| >= 2.7e-5, and
# the quotient below half an ulp of the addend when max|q| < 4.7e-20, an all-zero q included; in between the scale
# exceeds the reference's by at most 1e-12 / fp8 max), then the division. The triton form is the default because on
# a GPU torch's reduction alone costs more than both triton kernels (bench/q_quant.py times the two forms).
Q_QUANT_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _q_absmax_kernel(q_ptr, partial_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(q_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(partial_ptr + tl.program_id(0), tl.max(tl.abs(x), axis=0))

    @triton.jit
    def _q_quantize_kernel(q_ptr, partial_ptr, num_partials, q8_ptr, scale_ptr, n, fp8_max,
                           BLOCK: tl.constexpr, PARTIALS: tl.constexpr):
        parts = tl.load(partial_ptr + tl.arange(0, PARTIALS), mask=tl.arange(0, PARTIALS) < num_partials, other=0.0)
        scale = tl.math.div_rn(tl.maximum(tl.max(parts, axis=0), 1e-12), fp8_max)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(q_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        q8 = tl.math.div_rn(x, scale).to(q8_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q8_ptr + offs, q8, mask=offs < n)


class QQuantizer:
    """q (batch, 16, 576) bf16, contiguous -> self.q_fp8 (same shape, `fp8`) and self.scale (1,) float32, on the
    device, into buffers allocated once: q ~= q_fp8 * scale. Calls must be ordered on one stream. The Triton form
    where it can run (allow_triton=False: the torch form; self.blocks == 0 tells which)."""

    def __init__(self, batch: int, fp8: torch.dtype, device: torch.device, allow_triton: bool = True):
        self.q_fp8 = torch.empty((batch, NUM_HEADS, QK_HEAD_DIM), dtype=fp8, device=device)
        self.scale = torch.empty(1, dtype=torch.float32, device=device)
        self.fp8_max = torch.finfo(fp8).max  # 448 for e4m3fn (gfx950), 240 for e4m3fnuz (gfx942)
        # The triton kernels for e4m3fn (gfx950) only: e4m3fnuz (gfx942) casts are neither in Triton's interpreter
        # nor on NVIDIA GPUs, so nothing here could test them.
        triton_ok = allow_triton and fp8 == torch.float8_e4m3fn and _triton_usable(device)
        self.blocks = triton.cdiv(self.q_fp8.numel(), Q_QUANT_BLOCK) if triton_ok else 0
        if self.blocks:
            self.partials = torch.empty(self.blocks, dtype=torch.float32, device=device)
            self.consts = (Q_QUANT_BLOCK, triton.next_power_of_2(self.blocks))  # BLOCK, PARTIALS
            self.compiled = None  # the two kernels as compiled for a 16-byte aligned q (not under the interpreter)
        else:
            self._use_torch()

    def _use_torch(self) -> None:
        device = self.q_fp8.device
        self.blocks = 0
        self.amax = torch.empty((), dtype=torch.float32, device=device)
        self.fp8_max_t = torch.full((1,), self.fp8_max, dtype=torch.float32, device=device)
        self.scale_floor = torch.full((1,), 1e-12, dtype=torch.float32, device=device) / self.fp8_max_t

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if self.blocks:
            n, grid = self.q_fp8.numel(), (self.blocks, 1, 1)  # compiled kernels take the grid as a 3-tuple
            absmax_args = (q, self.partials, n)
            quantize_args = (q, self.partials, self.blocks, self.q_fp8, self.scale, n, self.fp8_max)
            aligned = q.data_ptr() % 16 == 0
            try:
                if self.compiled is not None and aligned:  # launched directly: the JIT's dispatch costs host time
                    self.compiled[0][grid](*absmax_args, self.consts[0])
                    self.compiled[1][grid](*quantize_args, *self.consts)
                else:
                    absmax = _q_absmax_kernel[grid](*absmax_args, BLOCK=self.consts[0])
                    quantize = _q_quantize_kernel[grid](*quantize_args, BLOCK=self.consts[0], PARTIALS=self.consts[1])
                    if aligned and absmax is not None and quantize is not None:
                        self.compiled = (absmax, quantize)
                return self.q_fp8
            except Exception as e:  # a triton that cannot build or launch them here: the torch form, for good
                log.warning("MLA decode: Q quantization falls back to torch ops: the triton kernels failed: %s", e)
                self._use_torch()
        torch.linalg.vector_norm(q, float("inf"), dtype=torch.float32, out=self.amax)  # max |q|, exact
        torch.addcdiv(self.scale_floor, self.amax, self.fp8_max_t, out=self.scale)
        # fp32 division (the scale is a 1-element tensor, not a 0-dim one: it sets the computation's dtype)
        torch.div(q, self.scale, out=self.q_fp8)
        return self.q_fp8


class _AiterPlan:
    """What one shape of call needs besides its inputs, allocated once. The six metadata buffers live and die
    together here: work_metadata_ptrs holds the raw device addresses of work_indptr and work_info_set."""

    __slots__ = ("refill", "filled", "metadata", "kv_indices", "kv_last_page_lens", "q_quant", "kv_lens", "empty_rows",
                 "kv_indptr_safe", "cummax_index", "indptr_changed", "invalid")

    def __init__(self, info_fn, fp8: torch.dtype, batch: int, total_kv: int, device: torch.device,
                 uniform_len: int | None):
        info = info_fn(batch, 1, NUM_HEADS, fp8, fp8, is_sparse=False, fast_mode=True, intra_batch_mode=False)
        if len(info) != 6:
            raise RuntimeError(f"aiter.get_mla_metadata_info_v1 returned {len(info)} buffer specs, expected 6")
        # (work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map)
        self.metadata = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info)
        # True: the lengths are not proven by the key, run get_mla_metadata_v1 on every call
        self.refill = refill = uniform_len is None
        self.filled = False
        # Page size 1: page b of the cache is token b; the persistent kernels never read the last-page lengths, ones
        # are the honest value (the non-persistent kernel would read them).
        self.kv_indices = torch.arange(total_kv, dtype=torch.int32, device=device)  # (total_kv,)
        self.kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)  # (batch,)
        self.q_quant = QQuantizer(batch, fp8, device)
        self.kv_lens = torch.empty(batch, dtype=torch.int32, device=device) if refill else None
        self.empty_rows = torch.empty(batch, dtype=torch.bool, device=device) if refill else None
        # The kv_indptr aiter sees: for a uniform plan the one its key proves, arange(batch + 1) * L, so the plan never
        # depends on a caller's data; otherwise the caller's, clamped into [0, total_kv] and made non-decreasing.
        self.kv_indptr_safe = torch.arange(batch + 1, dtype=torch.int32, device=device) * (uniform_len or 0)
        self.cummax_index = torch.empty(batch + 1, dtype=torch.int64, device=device) if refill else None
        self.indptr_changed = torch.empty(batch + 1, dtype=torch.bool, device=device) if refill else None
        self.invalid = torch.zeros((), dtype=torch.bool, device=device) if refill else None


def _aiter_plan_key(fns: tuple, fp8: torch.dtype, q: torch.Tensor, kv: torch.Tensor, config: dict) -> tuple:
    """The whole key of a plan: the aiter functions, the device, every shape and dtype the plan depends on, and the
    sequence-length facts.

    The rule. A plan's metadata (the work split) is computed by get_mla_metadata_v1 from the sequence lengths in
    kv_indptr. It may be reused WITHOUT reading kv_indptr only when the key proves the lengths are those it was built
    from: config["kv_seq_len"] = L is by contract every sequence's length in a uniform batch, else None or the
    maximum; the sequences tile the cache (kv_indptr[-1] == total_kv, as in every input the leaderboard and
    reference.py generate); so batch * L == total_kv (L > 0) forces every length to equal L, and (batch, total_kv, L)
    determines the metadata. Any other batch (L None, or batch * L != total_kv) gets a plan keyed "lengths read on
    device" whose metadata get_mla_metadata_v1 refills from the current kv_indptr on every call, on the device, with
    no host sync. So two batches with the same batch and total_kv but different lengths never share metadata: at
    most one of them is uniform, and a non-uniform one is always refilled.
    """
    batch, total_kv, kv_seq_len = q.shape[0], kv.shape[0], config["kv_seq_len"]
    uniform = kv_seq_len is not None and kv_seq_len > 0 and batch * kv_seq_len == total_kv
    lengths = ("uniform", kv_seq_len) if uniform else ("lengths read on device",)
    return (fns, fp8, q.device, q.dtype, tuple(q.shape), kv.dtype, tuple(kv.shape), batch, total_kv, lengths)


def _aiter_plan(fns: tuple, fp8: torch.dtype, q: torch.Tensor, kv: torch.Tensor, config: dict) -> _AiterPlan:
    key = _aiter_plan_key(fns, fp8, q, kv, config)
    plan = _AITER_PLANS.get(key)
    if plan is None:
        if len(_AITER_PLANS) >= AITER_PLAN_LIMIT:
            del _AITER_PLANS[next(iter(_AITER_PLANS))]
        lengths = key[-1]
        plan = _AITER_PLANS[key] = _AiterPlan(fns[1], fp8, q.shape[0], kv.shape[0], q.device,
                                              uniform_len=lengths[1] if lengths[0] == "uniform" else None)
    return plan


def _aiter_fill_metadata(metadata_fn, plan: _AiterPlan, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                         fp8: torch.dtype, total_kv: int) -> None:
    """get_mla_metadata_v1 reads the lengths from the device indptrs and writes the six buffers in place (the v1.2
    persistent split, fast_mode=True); kv_indptr counts pages, which are tokens at page size 1.

    aiter trusts kv_indptr: a range past total_kv or a decreasing one would send its kernel outside kv_indices. A
    uniform plan uses the kv_indptr its key proves (set at creation). A refilled one gets the caller's clamped into
    [0, total_kv] and made non-decreasing on the device (equal to it whenever it is valid), and plan.invalid records
    on the device whether they differ: the whole output is then NaN (one invalid range can move the others), never
    garbage and never a read outside the cache."""
    if plan.refill:
        torch.clamp(kv_indptr, 0, total_kv, out=plan.kv_indptr_safe)
        torch.cummax(plan.kv_indptr_safe, 0, out=(plan.kv_indptr_safe, plan.cummax_index))
        torch.ne(kv_indptr, plan.kv_indptr_safe, out=plan.indptr_changed)
        torch.any(plan.indptr_changed, out=plan.invalid)
    work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map = plan.metadata
    metadata_fn(qo_indptr, plan.kv_indptr_safe, plan.kv_last_page_lens, NUM_HEADS // NUM_KV_HEADS, NUM_KV_HEADS, True,
                work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
                page_size=1, kv_granularity=AITER_KV_GRANULARITY, max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True,
                max_split_per_batch=-1, intra_batch_mode=False, dtype_q=fp8, dtype_kv=fp8)
    plan.filled = True


def _aiter_forward(q, kv, scale, qo_indptr, kv_indptr, config) -> torch.Tensor:
    """FP8 Q x FP8 KV through aiter's persistent MLA decode: one aiter.mla.mla_decode_fwd call writing `o`.

    Inputs (validated by the dispatcher, all on one device, any device: the real aiter refuses a non-ROCm one, a
    stand-in in the tests does not):
      q:         (batch, 16, 576) bfloat16, contiguous (q_seq_len = 1)
      kv:        (total_kv, 1, 576) FP8, contiguous; must be aiter.dtypes.fp8 (e4m3fn on gfx950, e4m3fnuz on gfx942)
      scale:     (1,) float32; the cache holds kv * scale
      qo_indptr: (batch + 1,) int32 = [0, 1, ..., batch]; kv_indptr: (batch + 1,) int32, token offsets
      config:    sm_scale (a Python float is passed), kv_seq_len (None, or the length of every sequence / the max)
    Output: o (batch, 16, 512) bfloat16, contiguous, allocated here (the only per-call allocation besides aiter's
    own split scratch); mla_decode_fwd's return value is that scratch, not the result.

    Page size 1, on purpose. The KV is viewed (total_kv, 1, 1, 576) with kv_indptr in tokens, kv_indices =
    arange(total_kv) and kv_last_page_lens = ones. On gfx950 every dispatched MLA decode kernel ignores the page
    size (the project's aiter contract, SPEC.md section 1: the disassembled mla_a8w8_qh16_qseqlen1_gqaratio16_ps,
    our kernel, loads log2(page_size) and overwrites it with 0 before its only use, so a KV row is page_id x page
    stride with no in-page term, in every version of that blob from 2025-11 to 2026-08; aiter issues #2996 and
    #3095, sglang PR #25556). With page_size 2 the kernel would attend to the even tokens only, half the cache, and
    the leaderboard's loose check (5% of elements may miss) would still pass it (~4% mismatched at kv 1024; the
    strict gate catches it: tests/test_aiter_backend.py); its apparent speed-up is reading half the data. The extra
    index traffic of page size 1 is 4 B per 576 B token.

    FP8 Q. The fp8 x fp8 persistent kernel (qh16, qseqlen1) is the one the official reference runs; fp8 Q needs both
    scales as float32 device tensors. Q gets a dynamic per-tensor scale, amax / fp8 max computed on the device (no
    .item(), no host sync), so any finite bf16 q quantizes without NaN or saturation (|q| > 448 included).

    Plans. Per shape (see _aiter_plan_key for the reuse rule) the Q quantizer (QQuantizer: the FP8 Q and its scale),
    kv_indices, kv_last_page_lens and the six metadata buffers are allocated once and kept in _AITER_PLANS; the six
    buffers stay alive together (work_metadata_ptrs holds raw addresses of work_indptr and work_info_set, and the
    kernel walks the work list through those addresses). Calls must be ordered on one stream: the next call reuses
    the scratch.
    """
    fns, fp8 = _aiter_api()
    _expect(kv.dtype == fp8, "kv_data['fp8'][0].dtype", f"aiter.dtypes.fp8 = {fp8} (this GPU's FP8)", kv.dtype)
    batch, total_kv = q.shape[0], kv.shape[0]
    if total_kv == 0:  # no sequence has a KV row
        return torch.zeros((batch, NUM_HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    plan = _aiter_plan(fns, fp8, q, kv, config)
    if plan.refill or not plan.filled:
        _aiter_fill_metadata(fns[2], plan, qo_indptr, kv_indptr, fp8, total_kv)
    q_fp8 = plan.q_quant(q)  # (batch, 16, 576) fp8, scale plan.q_quant.scale (1,) float32
    o = q.new_empty((batch, NUM_HEADS, V_HEAD_DIM))  # q is bf16
    work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map = plan.metadata
    fns[0](q_fp8, kv.view(total_kv, 1, NUM_KV_HEADS, QK_HEAD_DIM), o, qo_indptr, plan.kv_indptr_safe, plan.kv_indices,
           plan.kv_last_page_lens, 1,
           page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=float(config["sm_scale"]),
           work_meta_data=work_metadata_ptrs, work_indptr=work_indptr, work_info_set=work_info_set,
           reduce_indptr=reduce_indptr, reduce_final_map=reduce_final_map, reduce_partial_map=reduce_partial_map,
           q_scale=plan.q_quant.scale, kv_scale=scale, intra_batch_mode=False)
    if plan.refill:
        # Lengths unknown on the host: a sequence with no KV rows gives zeros whatever the kernel wrote for it.
        torch.sub(plan.kv_indptr_safe[1:], plan.kv_indptr_safe[:-1], out=plan.kv_lens)
        torch.eq(plan.kv_lens, 0, out=plan.empty_rows)
        o.masked_fill_(plan.empty_rows.view(batch, 1, 1), 0.0)
        o.masked_fill_(plan.invalid, torch.nan)
    return o


# ---------------------------------------------------------------------------------------------------------
# triton backend: one split-KV flash-decoding kernel for both KV formats (KV_FORMAT constexpr) + an LSE combine
#
# Program (split, b) walks its share of sequence b's KV rows in tiles of BLOCK_N rows, each tile read from HBM
# once for all 16 heads. Scores are computed transposed, S^T (BLOCK_N x 16) = K (BLOCK_N x 576) @ Q^T, so the
# KV rows are the MMA's M dimension: on Hopper that is wgmma (M >= 64) with Q^T resident in shared memory,
# where 16 heads as M would mean mma.sync with Q held in registers (255 registers and spills in the sm_90
# build). The output is accumulated transposed as well, O^T (512 x 16) += V^T (512 x BLOCK_N) @ P^T, in four
# 128-row chunks so that each converted operand dies early. Softmax is online, in fp32 and in the log2 domain.
# Both builds sit at the 255-register limit (sm_90 SASS, block_n 64: the FP8 one spills ~46 words per tile),
# which with ~90-110 KB of shared memory allows 2 programs per SM; the loop is latency-bound, not HBM-bound
# (a lone program takes ~4 us per 64-row FP8 tile; 256x8192 reads its 1.2 GB at ~2 TB/s, not 4.5).
#
# Q and the score dot, by KV format (measured on the H200 with bench/tune_triton.py):
#   fp8:   Q is quantized in-kernel to FP8 E4M3 with one scale per head (448 / max|q_h|), and S^T is an
#          fp8 x fp8 wgmma straight from the shared-memory tile (no conversion, no register operand); the
#          per-tensor KV scale, sm_scale * log2(e) and 1 / (Q scale) are applied once to the fp32 scores.
#          V^T is the same tile, converted fp8 -> fp16 by the hardware cvt. Against fp16 Q (bf16 -> fp16,
#          fp8 -> fp16 KV for both dots) this was 1.3-1.4x faster on the kv-8192 shapes (256x8192: 586 vs 831 us,
#          64x8192: 161 vs 229 us) for an error vs the BF16 truth of rel-L2 0.030-0.044 instead of 0.015-0.031
#          (the strict gate is 0.08): the error of FP8 Q that aiter's path also has.
#   mxfp4: FP8 wgmma cannot take the per-32 block scales, so K is dequantized in registers: E2M1 code m ->
#          e4m3 bits (m << 2, sign -> bit 7) = value * 2^-6 (exact), the hardware cvt to fp16, times the block
#          scale 2^(e-127) as fp16; Q is bf16 -> fp32 * sm_scale * log2(e) -> fp16; fp16 dots, fp32 accumulate.
#          The 2^6 goes into the fp32 score scale and the output. V^T is a second read of the same rows (an L2
#          hit), dequantized again: one register tile feeding both dots was slower (967 vs 893 us at 256x8192).
# fp16 limits (documented, not hidden): |q| * sm_scale * log2(e) < 65504 on the mxfp4 path (|q| < ~1.1e6);
# MXFP4 block scales 2^-14 .. 2^15 are exact, smaller ones lose low bits (fp16 subnormals), larger ones give
# inf -> NaN; V (fp16 after the cvt) is exact for every fp8 value. Under TRITON_INTERPRET=1 (CPU) the fp16
# dots run on fp32 operands (DOT_DTYPE; the interpreter's bf16 dots are wrong, fp32 keeps the CPU check
# exact) and the MXFP4 decode uses the same bit recipe in plain Triton ops instead of inline PTX.
# ---------------------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634

if triton is not None:
    # 4 packed bytes ($4) -> the e4m3 bytes of their low nibbles (even elements) and high nibbles (odd elements)
    # -> f16x2 pairs: $0, $1 = even elements of bytes 0-1, 2-3; $2, $3 = odd elements.
    _MXFP4_PTX = tl.constexpr("""{
    .reg .b32 lo, hi, t, u;
    .reg .b16 l0, l1, h0, h1;
    shl.b32 t, $4, 2;
    shl.b32 u, $4, 4;
    and.b32 t, t, 0x1C1C1C1C;
    and.b32 u, u, 0x80808080;
    or.b32 lo, t, u;
    shr.b32 t, $4, 2;
    and.b32 t, t, 0x1C1C1C1C;
    and.b32 u, $4, 0x80808080;
    or.b32 hi, t, u;
    mov.b32 {l0, l1}, lo;
    mov.b32 {h0, h1}, hi;
    cvt.rn.f16x2.e4m3x2 $0, l0;
    cvt.rn.f16x2.e4m3x2 $1, l1;
    cvt.rn.f16x2.e4m3x2 $2, h0;
    cvt.rn.f16x2.e4m3x2 $3, h1;
    }""")

    @triton.jit
    def _e2m1_as_fp16(codes):
        """E2M1 codes (uint8, 0..15) -> value * 2^-6 in fp16, the PTX recipe in plain Triton ops."""
        bits = ((codes & 7) << 2) | ((codes & 8) << 4)
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @triton.jit
    def _kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
                 TRANS: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
        """Columns COL0:COL0+WIDTH of the KV rows n0 + arange(BLOCK_N), (BLOCK_N, WIDTH), or their transpose in
        DOT_DTYPE when TRANS (the V^T operand). fp8: the raw e4m3 tile (the score dot takes it as is);
        mxfp4: the values * 2^-6 in DOT_DTYPE. Rows with row_ok False read as 0."""
        BLOCK_N: tl.constexpr = row_ok.shape[0]
        r = tl.arange(0, BLOCK_N)
        if KV_FORMAT == "fp8":
            c = tl.arange(0, WIDTH)
            x = tl.load(kv_ptr + tl.cast(n0, tl.int64) * 576 + COL0 + r[:, None] * 576 + c[None, :],
                        mask=row_ok[:, None], other=0.0)
            if TRANS:  # the same load as the K operand: Triton reads both from one shared-memory tile
                x = tl.trans(x).to(DOT_DTYPE)
            return x
        else:
            NB: tl.constexpr = WIDTH // 32
            tile = kv_ptr + tl.cast(n0, tl.int64) * 288 + COL0 // 2
            c = tl.arange(0, WIDTH // 2)
            if TRANS:  # another cache modifier keeps this read apart from the K read (no CSE): see above
                packed = tl.load(tile + r[:, None] * 288 + c[None, :], mask=row_ok[:, None], other=0,
                                 cache_modifier=".ca")
            else:
                packed = tl.load(tile + r[:, None] * 288 + c[None, :], mask=row_ok[:, None], other=0)
            sbytes = tl.load(kscale_ptr + tl.cast(n0, tl.int64) * kscale_stride + r[:, None] * kscale_stride
                             + (COL0 // 32 + tl.arange(0, NB))[None, :], mask=row_ok[:, None], other=127)
            bscale = tl.exp2(sbytes.to(tl.float32) - 127.0).to(tl.float16)
            if USE_ASM:
                even, odd = tl.inline_asm_elementwise(_MXFP4_PTX, "=r,=r,=r,=r,r", [packed],
                                                      dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            else:
                even = _e2m1_as_fp16(packed & 0xF)
                odd = _e2m1_as_fp16(packed >> 4)
            x = tl.join(even, odd).reshape(BLOCK_N, NB, 32) * bscale[:, :, None]
            x = x.reshape(BLOCK_N, WIDTH).to(DOT_DTYPE)
            if TRANS:
                x = tl.trans(x)
            return x

    @triton.jit
    def _q_cols(q_ptr, b, q_scale, COL0: tl.constexpr, WIDTH: tl.constexpr, Q_DTYPE: tl.constexpr):
        """Q^T rows COL0:COL0+WIDTH of sequence b, (WIDTH, 16), times the per-head q_scale (16,), as Q_DTYPE
        (fp8 values are clamped to the E4M3 range)."""
        d = COL0 + tl.arange(0, WIDTH)
        x = tl.load(q_ptr + b * (16 * 576) + tl.arange(0, 16)[None, :] * 576 + d[:, None])
        x = x.to(tl.float32) * q_scale[None, :]
        if Q_DTYPE == tl.float8e4nv:
            x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        return x.to(Q_DTYPE)

    @triton.jit
    def _store_chunk(ptr, acc, inv, valid, COL0: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """Writes the (128, 16) O^T chunk acc * inv to ptr[h * 512 + COL0 + d]; NaN where not valid."""
        d = COL0 + tl.arange(0, acc.shape[0])
        o = tl.where(valid, acc * inv[None, :], float("nan"))
        tl.store(ptr + tl.arange(0, 16)[None, :] * 512 + d[:, None], o.to(OUT_DTYPE))

    @triton.jit
    def _mla_split_kernel(q_ptr, kv_ptr, kscale_ptr, kscale_stride, kv_indptr_ptr, out_ptr, part_o_ptr,
                          part_lse_ptr, total_kv, qk_scale, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                          KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
                          USE_PDL: tl.constexpr):
        split = tl.program_id(0)
        b = tl.program_id(1)
        if USE_PDL:  # let the combine launch (and wait in gdc_wait) while this grid's last wave runs
            tl.extra.cuda.gdc_launch_dependents()
        start = tl.load(kv_indptr_ptr + b)
        end = tl.load(kv_indptr_ptr + b + 1)
        valid = (start >= 0) & (end >= start) & (end <= total_kv)
        start = tl.where(valid, start, 0)  # an invalid range reads nothing; its rows become NaN
        end = tl.where(valid, end, 0)
        per_split = tl.cdiv(tl.cdiv(end - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, end)

        heads = tl.arange(0, 16)
        if KV_FORMAT == "fp8":  # FP8 Q, one scale per head; the fp32 scores get kv_scale * qk_scale / q_scale
            q_row = q_ptr + b * (16 * 576) + heads[:, None] * 576
            q_max = tl.maximum(tl.max(tl.abs(tl.load(q_row + tl.arange(0, 512)[None, :]).to(tl.float32)), 1),
                               tl.max(tl.abs(tl.load(q_row + 512 + tl.arange(0, 64)[None, :]).to(tl.float32)), 1))
            q_scale = 448.0 / tl.maximum(q_max, 1e-30)
            q_dtype: tl.constexpr = tl.float8e4nv
            out_scale = tl.load(kscale_ptr)
            s_scale = out_scale * qk_scale / q_scale
        else:  # fp16 Q pre-scaled by sm_scale * log2(e); MXFP4's 2^6 goes into the scores and the output
            q_scale = tl.full([16], qk_scale, tl.float32)
            q_dtype: tl.constexpr = DOT_DTYPE
            out_scale = 64.0
            s_scale = tl.full([16], 64.0, tl.float32)
        q0 = _q_cols(q_ptr, b, q_scale, 0, 128, q_dtype)
        q1 = _q_cols(q_ptr, b, q_scale, 128, 128, q_dtype)
        q2 = _q_cols(q_ptr, b, q_scale, 256, 128, q_dtype)
        q3 = _q_cols(q_ptr, b, q_scale, 384, 128, q_dtype)
        q_rope = _q_cols(q_ptr, b, q_scale, 512, 64, q_dtype)

        m_i = tl.full([16], float("-inf"), tl.float32)
        l_i = tl.zeros([16], tl.float32)
        acc0 = tl.zeros([128, 16], tl.float32)
        acc1 = tl.zeros([128, 16], tl.float32)
        acc2 = tl.zeros([128, 16], tl.float32)
        acc3 = tl.zeros([128, 16], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            row_ok = n0 + tl.arange(0, BLOCK_N) < hi
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 0, 128, False, KV_FORMAT, DOT_DTYPE,
                                USE_ASM), q0)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 128, 128, False, KV_FORMAT,
                                DOT_DTYPE, USE_ASM), q1, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 256, 128, False, KV_FORMAT,
                                DOT_DTYPE, USE_ASM), q2, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 384, 128, False, KV_FORMAT,
                                DOT_DTYPE, USE_ASM), q3, s)
            s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 512, 64, False, KV_FORMAT,
                                DOT_DTYPE, USE_ASM), q_rope, s)
            s = tl.where(row_ok[:, None], s * s_scale[None, :], float("-inf"))  # (BLOCK_N, 16), log2 units
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.exp2(s - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
            p = p.to(DOT_DTYPE)
            acc0 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 0, 128, True, KV_FORMAT,
                                   DOT_DTYPE, USE_ASM), p, acc0 * alpha[None, :])
            acc1 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 128, 128, True, KV_FORMAT,
                                   DOT_DTYPE, USE_ASM), p, acc1 * alpha[None, :])
            acc2 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 256, 128, True, KV_FORMAT,
                                   DOT_DTYPE, USE_ASM), p, acc2 * alpha[None, :])
            acc3 = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 384, 128, True, KV_FORMAT,
                                   DOT_DTYPE, USE_ASM), p, acc3 * alpha[None, :])

        inv = tl.where(l_i > 0, out_scale / l_i, 0.0)  # an empty sequence or split gives zeros
        if NUM_SPLITS == 1:
            dst = out_ptr + b * (16 * 512)
            _store_chunk(dst, acc0, inv, valid, 0, tl.bfloat16)
            _store_chunk(dst, acc1, inv, valid, 128, tl.bfloat16)
            _store_chunk(dst, acc2, inv, valid, 256, tl.bfloat16)
            _store_chunk(dst, acc3, inv, valid, 384, tl.bfloat16)
        else:  # normalized partial output and its log2-sum-exp; the combine weighs them
            part = b * NUM_SPLITS + split
            dst = part_o_ptr + part * (16 * 512)
            _store_chunk(dst, acc0, inv, True, 0, tl.float32)
            _store_chunk(dst, acc1, inv, True, 128, tl.float32)
            _store_chunk(dst, acc2, inv, True, 256, tl.float32)
            _store_chunk(dst, acc3, inv, True, 384, tl.float32)
            tl.store(part_lse_ptr + part * 16 + heads, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")))

    @triton.jit
    def _mla_combine_kernel(kv_indptr_ptr, out_ptr, part_o_ptr, part_lse_ptr, total_kv, NUM_SPLITS: tl.constexpr,
                            SPLITS_P2: tl.constexpr, BLOCK_DV: tl.constexpr, USE_PDL: tl.constexpr):
        bh = tl.program_id(0)  # b * 16 + head
        b = bh // 16
        dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        start = tl.load(kv_indptr_ptr + b)
        end = tl.load(kv_indptr_ptr + b + 1)
        valid = (start >= 0) & (end >= start) & (end <= total_kv)
        sp = tl.arange(0, SPLITS_P2)
        row = (b * NUM_SPLITS + sp) * 16 + bh % 16
        if USE_PDL:  # everything above overlapped the split kernel; the partials are read only after it
            tl.extra.cuda.gdc_wait()
        lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
        o = tl.load(part_o_ptr + row[:, None] * 512 + dv[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
        denom = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
        res = tl.where(valid, res, float("nan"))
        tl.store(out_ptr + bh * 512 + dv, res.to(tl.bfloat16))


def triton_plan(batch: int, seq_len: int, num_sms: int, kv_format: str) -> tuple[int, int, int, int]:
    """The launch plan (num_splits, block_n, num_warps, num_stages) for `batch` sequences of about `seq_len` KV
    rows on `num_sms` SMs.

    Measured on the H200 (bench/tune_triton.py, leaderboard timing; all 8 shapes x splits 1..64, and
    (block_n, warps, stages) among (64, 4, 2|3), (128, 8, 2), (64, 8, 2), (32, 4, 2|3), (64, 4, 1)):
    - a program holds 230-255 registers x 128 threads and 90-110 KB of shared memory: 2 fit an SM. The fastest
      split count at every shape put batch x splits near 2 programs per SM (~256 on 132 SMs): 16 at 4x1024
      (where one 64-row tile per split caps it), 32 (FP8) or 64 (MXFP4) at 4x8192 (28.7 vs 31.5 us and 35.4 vs
      33.6 us), 4-8 at 32x1024, 8 at 32x8192, 4 at batch 64, 1-2 at batch 256. More splits only add partials
      (32 KB of fp32 each, written and read back) and waves: 64x8192 FP8 161 us at 4 splits, 188 at 16, 268 at 64.
    - block_n 64, 4 warps, 3 stages won or tied everywhere: 2 stages were 1-9% slower; 8 warps with block_n 64
      or 128 were 1.3-1.5x slower at batch >= 64 (the 16-column score tile is then split across warpgroups or
      registers spill); block_n 32 (mma.sync scores) was only tried with fp16 Q, within +-10% of block_n 64.
    """
    block_n = 64
    max_splits = 32 if kv_format == "fp8" else 64
    want = max(1, 2 * num_sms // max(batch, 1))
    splits = 1 << (min(want, max(1, seq_len // block_n), max_splits).bit_length() - 1)  # a power of 2, rounded down
    return splits, block_n, 4, 3


_TRITON_LAUNCH: dict = {}
LAUNCH_CACHE_LIMIT = 64  # launch plans kept per backend (cleared when full); the leaderboard uses 8 shapes


class _TritonLaunch:
    """Everything a call needs besides its tensors: the plan, the split partials' workspace, grids, meta-args,
    and (after the first call on a GPU) the compiled kernels, launched directly: Triton's JIT dispatch costs
    host time on every call that the leaderboard's L2 flush does not always hide. Under the interpreter the
    JIT returns no kernel and every call takes the JIT path. Calls of the same shapes share the partials'
    workspace: calls on concurrent streams must be serialized by the caller (the leaderboard's are)."""

    def __init__(self, plan, part_o, part_lse, split_grid, split_consts, split_meta, combine_grid, combine_consts,
                 combine_meta):
        self.plan, self.part_o, self.part_lse = plan, part_o, part_lse
        self.split_grid, self.combine_grid = split_grid, combine_grid
        # constexprs in the kernels' parameter order: the compiled kernels take them after the other arguments
        self.split_consts, self.combine_consts = tuple(split_consts.values()), tuple(combine_consts.values())
        self.split_meta = dict(split_consts, **split_meta)
        self.combine_meta = dict(combine_consts, **combine_meta)
        self.split_kernel = self.combine_kernel = None

    def launch(self, q, kv, scale, kv_indptr, out, qk_scale) -> None:
        split_args = (q, kv, scale, scale.stride(0), kv_indptr, out, self.part_o, self.part_lse, kv.shape[0], qk_scale)
        combine_args = (kv_indptr, out, self.part_o, self.part_lse, kv.shape[0])
        if self.split_kernel is None:  # first call: the JIT compiles, launches and returns the kernel
            self.split_kernel = _mla_split_kernel[self.split_grid](*split_args, **self.split_meta)
            if self.plan[0] > 1:
                self.combine_kernel = _mla_combine_kernel[self.combine_grid](*combine_args, **self.combine_meta)
            return
        # the compiled kernels take every parameter in order, constexprs included
        self.split_kernel[self.split_grid](*split_args, *self.split_consts)
        if self.plan[0] > 1:
            self.combine_kernel[self.combine_grid](*combine_args, *self.combine_consts)


def _triton_launch(q, kv, scale, kv_indptr, config, kv_format: str, plan: tuple | None) -> _TritonLaunch:
    """The launch for one (device, shapes, dtypes, strides, 16-byte alignments, format, plan): built on the first
    call, then looked up (no allocation, no host sync). The plan reads kv_seq_len, or total_kv / batch when it
    is None, on the host: never the device's kv_indptr."""
    batch = q.shape[0]
    key = (q.device, q.shape, kv.shape, kv.dtype, scale.shape, scale.dtype, scale.stride(0), kv_format,
           config["kv_seq_len"], plan, tuple(t.data_ptr() % 16 == 0 for t in (q, kv, scale, kv_indptr)))
    launch = _TRITON_LAUNCH.get(key)
    if launch is not None:
        return launch
    on_gpu = q.device.type == "cuda"
    if plan is None:
        seq_len = config["kv_seq_len"] if config["kv_seq_len"] is not None else -(-kv.shape[0] // batch)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if on_gpu else 132
        plan = triton_plan(batch, seq_len, num_sms, kv_format)
    nvidia = on_gpu and torch.version.hip is None
    splits, block_n, num_warps, num_stages = plan
    splits_p2 = triton.next_power_of_2(splits)
    block_dv = min(V_HEAD_DIM, max(16, 8192 // splits_p2))  # a (splits, block_dv) fp32 tile: 64 registers/thread
    workspace_rows = batch * splits if splits > 1 else 0
    split_consts = dict(NUM_SPLITS=splits, BLOCK_N=block_n, KV_FORMAT=kv_format,
                        DOT_DTYPE=tl.float16 if on_gpu else tl.float32, USE_ASM=nvidia, USE_PDL=nvidia and splits > 1)
    combine_consts = dict(NUM_SPLITS=splits, SPLITS_P2=splits_p2, BLOCK_DV=block_dv, USE_PDL=nvidia)
    launch = _TritonLaunch(
        plan=plan,
        part_o=torch.empty((workspace_rows, NUM_HEADS, V_HEAD_DIM), dtype=torch.float32, device=q.device),
        part_lse=torch.empty((workspace_rows, NUM_HEADS), dtype=torch.float32, device=q.device),
        split_grid=(splits, batch, 1),
        split_consts=split_consts,
        split_meta=dict(num_warps=num_warps, num_stages=num_stages),
        combine_grid=(batch * NUM_HEADS, V_HEAD_DIM // block_dv, 1),  # compiled kernels take 3-D grids
        combine_consts=combine_consts,
        combine_meta=dict(num_warps=4, launch_pdl=nvidia),
    )
    if len(_TRITON_LAUNCH) >= LAUNCH_CACHE_LIMIT:
        _TRITON_LAUNCH.clear()
    _TRITON_LAUNCH[key] = launch
    return launch


def _triton_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format: str,
                    plan: tuple | None = None) -> torch.Tensor:
    """`plan` (num_splits, block_n, num_warps, num_stages) overrides triton_plan (tests, bench/tune_triton.py)."""
    launch = _triton_launch(q, kv, scale, kv_indptr, config, kv_format, plan)
    if kv_format == "mxfp4":
        kv, scale = kv.view(torch.uint8), scale.view(torch.uint8)
    out = torch.empty((q.shape[0], NUM_HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    launch.launch(q, kv, scale, kv_indptr, out, float(config["sm_scale"]) * LOG2E)
    return out


# ---------------------------------------------------------------------------------------------------------
# cuda backend (NVIDIA; FP8 KV, and MXFP4 on Hopper): CUDA kernels built at first use with the machine's nvcc,
# called through ctypes
#
# Why beside the Triton kernel: Triton 3.6 feeds the transposed V operand of the FP8 kernel with one-byte shared
# loads (256 LDS.U8 per thread per tile in its SASS) and runs at the 255-register limit with spills, so each SM
# holds 2 programs that spend ~4 us per 64-row tile. Here the layouts are ours. One source, two split kernels:
# - Hopper (sm_90a, built with MLA_WGMMA): one warpgroup per CTA, two CTAs per SM, two 64-row cp.async stages each
#   (a grid of one CTA per SM: three stages).
#   S^T = K Q^T by warpgroup MMAs with both FP8 operands in shared memory (the tile as the 64-row M side, Q quantized
#   to e4m3 per head in the CTA as the 16-wide N side); P = 2^8 * softmax numerators in e4m3; O^T = V^T P^T with
#   V^T as register fragments (ldmatrix.trans of the FP8 rows plus byte permutes, no conversion) and P^T from shared
#   memory. The tile sits in the 128-/64-byte swizzled K-major layouts wgmma reads: a layout with 16-byte pieces
#   1 KB apart halved the cp.async copy rate (562 vs 305 us for the copies alone at 256x8192).
#   MXFP4 (same kernel, MX = true): the codes are copied as they lie, each tile is dequantized once into one e5m2
#   tile (E2M1 x 2^k is exact in e5m2 for |k| <= 13; a table lookup by byte permutes), and the products read it as
#   e5m2 x e4m3. Measured (H200, 2026-11-30, bench.py --methods cuda-fp8,cuda-mxfp4,triton-mxfp4): geomean 44.9 us
#   against 42.7 for FP8 in the same run and 82.5 for the Triton MXFP4 kernel; 369 vs 327 us at 256x8192: half the
#   bytes buy nothing here, the kernel is bound by its instructions (the dequantization adds ~1 per value).
# - Other GPUs (sm_80+): mma.sync m16n8k16 in fp16, one CTA of 8 warps per SM, 4, 3 or 2 stages as the GPU's shared
#   memory allows (the launcher picks); ldmatrix reads the FP8 tile for both products (e4m3 -> fp16 by the hardware
#   cvt from sm_89); Q in fp16 registers. On Hopper mma.sync has no FP8 form (ptxas emulates it with conversions),
#   hence the wgmma kernel there.
# Splits: one launch. With more than one split per sequence the grid is launched cooperatively and its CTAs merge
# their own partials behind a per-sequence barrier (a second combine kernel, even overlapped by PDL, cost ~1 us more
# at batch 4). Measured on the H200 (2026-11-30 14:01 UTC, `bash bench/run_h200.sh`, BENCHMARKS.md): wgmma 4x1024
# 10.1, 4x8192 16.5, 32x1024 16.4, 32x8192 52.3, 64x1024 21.5, 64x8192 87.0, 256x1024 50.9, 256x8192 286.3 us
# (geomean 37.4; the mma.sync kernel 56.4-56.8 in earlier runs, before the changes of that day). Accuracy: FP8
# Q and P cost worst-sequence rel-L2 ~0.03-0.037 against fp32 attention over the FP8 cache (the fp16 mma.sync kernel
# 1.7e-3); against the BF16 truth 0.032-0.044, inside the 0.08 bound.
# ---------------------------------------------------------------------------------------------------------

CUDA_MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 and ldmatrix; the e4m3 cvt is native from sm_89, emulated before
CUDA_WGMMA_CAPABILITY = (9, 0)  # built for sm_90a: the wgmma kernel
CUDA_BLOCK_N = 64  # KV rows per tile (BN in the source)
CUDA_MAX_SPLITS = 512  # MAX_SPLITS in the source: the merge takes powers of two up to this
_CUDA_SRC = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// Two split kernels with one interface: with MLA_WGMMA (built for sm_90a) warpgroup MMAs on FP8 operands, else
// mma.sync in fp16 (sm_80 and later). The merge of the splits and the launcher are shared.
// split_kernel<STAGES, MX>: grid (num_splits, batch) of CTAs of NTHREADS threads; q (batch, 16, 576) bf16; kv
// (total_kv, 576) e4m3; kv_scale (1,) fp32; kv_indptr (batch + 1,) int32; out (batch, 16, 512) bf16.
// num_splits == 1: each CTA writes its rows of out. Otherwise each writes part_o (batch * num_splits, 16, 512) bf16,
// its normalised partial output, and part_lse (batch * num_splits, 16) fp32, their log2-sum-exp; the CTAs of a
// sequence meet at a barrier (`sync`: per sequence a count of arrivals over all launches, zero before the first) and
// each merges 1 / num_splits of the sequence's outputs. The grid is launched cooperatively, so all its CTAs are
// resident and the wait cannot hang.
namespace mla {

constexpr int H = 16;                  // query heads
constexpr int D = 576;                 // key width = bytes per FP8 row
constexpr int DV = 512;                // value width
constexpr int BN = 64;                 // KV rows per tile

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// v rounded to bf16, stored as 4 consecutive values (8-byte aligned dst).
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* dst, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// The rows [lo, hi) of the cache that split `split` of sequence b attends to: splits of whole 64-row tiles,
// ntiles of them. An invalid kv_indptr range reads nothing (valid = false; its output rows become NaN).
struct SplitRange {
  int lo, hi, ntiles;
  bool valid;
};

__device__ __forceinline__ SplitRange split_range(const int* kv_indptr, int b, int split, int num_splits,
                                                  int total_kv) {
  int start = kv_indptr[b], end = kv_indptr[b + 1];
  const bool valid = start >= 0 && end >= start && end <= total_kv;
  if (!valid) start = end = 0;
  const int per_split = ((end - start + num_splits - 1) / num_splits + BN - 1) / BN * BN;
  const int lo = start + split * per_split;
  const int hi = min(lo + per_split, end);
  return {lo, hi, hi > lo ? (hi - lo + BN - 1) / BN : 0, valid};
}

// The per-sequence barrier of the splits: sync[b] counts the arrivals of sequence b's CTAs over every launch (it
// only grows, wrapping at 2^32, a multiple of every power-of-two split count). A launch of S splits starts from a
// multiple of S (every earlier launch on this workspace had S splits and completed) and its CTAs wait until the
// count reaches the next one. Each CTA reads the count when it starts (arrival_base: off the barrier's path; its
// own arrival has not happened, so the count is below the next multiple), then thread 0 adds its arrival with
// release semantics after the CTA's barrier (publishing the CTA's partial stores) and polls with acquire loads (so
// the other CTAs' partials are visible after the closing barrier). The last arrival is itself what the others
// wait for: against a count that the last arrival reset before advancing a generation word (two more round trips
// on the barrier's path), 4x1024 10.7 -> 10.1 us, 4x8192 17.0 -> 16.3, 32x1024 17.3 -> 16.5 (H200, A/B twice).
__device__ __forceinline__ unsigned arrival_base(const unsigned* sync, int b, int num_splits) {
  unsigned count = 0;
  if (num_splits > 1 && threadIdx.x == 0)
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(count) : "l"(sync + b) : "memory");
  return count & ~static_cast<unsigned>(num_splits - 1);
}

__device__ __forceinline__ void wait_for_splits(unsigned* sync, int b, int num_splits, unsigned base) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned target = base + static_cast<unsigned>(num_splits);
    unsigned now;
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync + b) : "memory");
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(sync + b) : "memory");
    } while (static_cast<int>(now - target) < 0);
  }
  __syncthreads();
}

// The merge of one sequence's splits: out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). Split
// `split` of S merges its 2048 / S of the sequence's 2048 quads (4 columns of one head) with 128 threads, and every
// thread issues all its 16 loads (8-byte quads of the bf16 partials, L2 only: other SMs wrote them) before using any:
// one round trip. The partials are bf16 because the merge is a convex combination (its error stays at the bf16
// output's) and half the bytes shorten the handoff: fp32 partials took 0.3-0.7 us more at the split shapes (H200).
// S < 16: a thread merges W = 16 / S neighbouring quads over all S splits. S >= 16: W = 1, and the S / 16 threads
// of a quad (neighbouring lanes) take 16 splits each, then combine their (max, sum, acc) by shuffles. S must be a
// power of two (every thread then has exactly its G = 16 / W splits; merge_splits dispatches on W).
constexpr int MERGE_THREADS = 128;
constexpr int MERGE_LOADS = 16;
constexpr int MAX_SPLITS = 512;        // a quad's threads stay within one warp (S / 16 <= 32)
template <int W>
__device__ __forceinline__ void merge_quads(const float* lse, const __nv_bfloat16* po, __nv_bfloat16* out,
                                            int num_splits, int split, bool valid) {
  constexpr int G = MERGE_LOADS / W;  // splits per thread
  const int log_splits = __ffs(num_splits) - 1;
  const int log_per_quad = max(log_splits - (__ffs(G) - 1), 0);  // threads per quad: num_splits / G (W == 1) or 1
  const int per_quad = 1 << log_per_quad;
  const int quad = (split << (11 - log_splits)) + (threadIdx.x >> log_per_quad) * W;  // 2048 quads per sequence
  const int h = quad / (DV / 4), col = quad % (DV / 4) * 4, s0 = (threadIdx.x & (per_quad - 1)) * G;
  const float* lse_s0 = lse + s0 * H + h;  // split s0 + j at j * H
  const uint2* po_s0 = reinterpret_cast<const uint2*>(po + (static_cast<size_t>(s0) * H + h) * DV + col);
  float l[G];
  uint2 o[G][W];  // 4 bf16
#pragma unroll
  for (int j = 0; j < G; ++j) {  // G splits from s0, all present: num_splits is G x per_quad
    l[j] = __ldcg(lse_s0 + j * H);
#pragma unroll
    for (int w = 0; w < W; ++w) o[j][w] = __ldcg(po_s0 + j * (H * DV / 4) + w);
  }
  float mx = -INFINITY, wsum = 0.f;
  float4 acc[W];
#pragma unroll
  for (int j = 0; j < G; ++j) mx = fmaxf(mx, l[j]);
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mx != -INFINITY) {  // else only empty splits (their partials hold zeros)
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const float wt = exp2f(l[j] - mx);
      wsum += wt;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o[j][w].x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o[j][w].y));
        acc[w].x += wt * lo.x;
        acc[w].y += wt * lo.y;
        acc[w].z += wt * hi.x;
        acc[w].w += wt * hi.y;
      }
    }
  }
  for (int lane = 1; lane < per_quad; lane <<= 1) {
    const float omx = __shfl_xor_sync(0xffffffffu, mx, lane), ows = __shfl_xor_sync(0xffffffffu, wsum, lane);
    const float nm = fmaxf(mx, omx);
    const float a = nm == -INFINITY ? 0.f : exp2f(mx - nm), c = nm == -INFINITY ? 0.f : exp2f(omx - nm);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      acc[w].x = acc[w].x * a + __shfl_xor_sync(0xffffffffu, acc[w].x, lane) * c;
      acc[w].y = acc[w].y * a + __shfl_xor_sync(0xffffffffu, acc[w].y, lane) * c;
      acc[w].z = acc[w].z * a + __shfl_xor_sync(0xffffffffu, acc[w].z, lane) * c;
      acc[w].w = acc[w].w * a + __shfl_xor_sync(0xffffffffu, acc[w].w, lane) * c;
    }
    wsum = wsum * a + ows * c;
    mx = nm;
  }
  if (threadIdx.x & (per_quad - 1)) return;
  const float scale = (wsum > 0.f ? 1.f / wsum : 0.f) * (valid ? 1.f : NAN);  // every split empty: zeros
#pragma unroll
  for (int w = 0; w < W; ++w)
    store_bf16x4(out + h * DV + col + 4 * w,
                 make_float4(acc[w].x * scale, acc[w].y * scale, acc[w].z * scale, acc[w].w * scale));
}

// When the splits of sequence b have all written their partials, split `split` merges its share (num_splits: a
// power of two, 2 .. MAX_SPLITS; the launcher checks); valid: split_range's verdict on b's range (false: NaN rows).
__device__ __forceinline__ void merge_splits(unsigned* sync, unsigned base, int b, int split, int num_splits,
                                             bool valid, __nv_bfloat16* out, const __nv_bfloat16* part_o,
                                             const float* part_lse) {
  wait_for_splits(sync, b, num_splits, base);
  if (threadIdx.x >= MERGE_THREADS) return;
  const float* lse = part_lse + static_cast<size_t>(b) * num_splits * H;
  const __nv_bfloat16* po = part_o + static_cast<size_t>(b) * num_splits * H * DV;
  __nv_bfloat16* o = out + static_cast<size_t>(b) * H * DV;
  switch (num_splits) {
    case 2: merge_quads<8>(lse, po, o, num_splits, split, valid); break;
    case 4: merge_quads<4>(lse, po, o, num_splits, split, valid); break;
    case 8: merge_quads<2>(lse, po, o, num_splits, split, valid); break;
    default: merge_quads<1>(lse, po, o, num_splits, split, valid);
  }
}

#if MLA_WGMMA
constexpr int NTHREADS = 128;          // one warpgroup
constexpr int NWARPS = 4;              // per warpgroup
constexpr int CTAS_PER_SM = 2;
// Tiles per CTA in shared memory: 2 when two CTAs share an SM, 3 when the grid leaves each CTA an SM of its own.
// A split's first STAGES - 1 tiles are requested before the loop and the next when one lands: more at once delays
// the first (DRAM interleaves every request in flight), so with 4 stages (3 tiles requested at once) 4x8192 and
// 32x1024 took 18.7 and 18.9 us against 17.5 and 17.7 with 3 (H200; requesting all 4 at once: 20.0 and 20.1).
constexpr int STAGES_SHARED = 2;
constexpr int STAGES_ALONE = 3;
// MXFP4: stages of codes (18 KB) beside the one dequantized tile, 3 whether alone or not (5 alone: 19.6 us at
// 4x8192 and 19.7 at 32x1024, against 18.5 and 18.8 with 3).
constexpr int MX_STAGES = 3;
// Tile layout, wgmma's K-major swizzled layouts: dims 0..511 as four 8 KB blocks of [64 rows][128 bytes] with the
// 16-byte units of row r permuted by u ^ (r % 8) (128-byte swizzle), dims 512..575 as [64 rows][64 bytes] with
// u ^ ((r / 2) % 4) (64-byte swizzle). Each 128-byte line of a row lands in one 128-byte line of shared memory
// (a layout with 16-byte pieces 1 KB apart halved the copy rate), and ldmatrix on 8 rows of a unit is conflict-free.
constexpr int SW128_BLOCK = BN * 128;
constexpr int ROPE_OFFSET = 4 * SW128_BLOCK;
constexpr int TILE = BN * D;
constexpr int QCHUNK = H * 16;         // Q and P: [chunk][16 heads][16 bytes]
constexpr int SMEM_Q = H * D;
constexpr int SMEM_P = H * BN;
constexpr int SMEM_RED = NWARPS * H * 4;
// MXFP4 (MX = true): the stages hold a tile's E2M1 codes as they lie in memory ([64 rows][288 bytes]); each tile
// is dequantized once into one FP8 tile (e5m2, exact) at offset 0, which the products read as above.
constexpr bool SUPPORTS_MXFP4 = true;
constexpr int MX_ROW = D / 2;          // bytes of codes per row, two values per byte, low nibble first
constexpr int MX_STAGE = BN * MX_ROW;
constexpr int MX_BLOCKS = D / 32;      // E8M0 scales per row
template <int STAGES, bool MX>
constexpr int smem_bytes() {
  return (MX ? TILE + STAGES * MX_STAGE : STAGES * TILE) + SMEM_Q + SMEM_P + SMEM_RED + H * 4;
}
constexpr float P_BIAS = 8.f;          // P is stored as 2^8 * p (p <= 1): e4m3 keeps its normal range for small p

// Byte offset of the 16-byte unit `ch` (dims 16*ch..16*ch+15) of row r in a tile.
__device__ __forceinline__ int tile_offset(int r, int ch) {
  return ch < 32 ? (ch >> 3) * SW128_BLOCK + r * 128 + (((ch & 7) ^ (r & 7)) << 4)
                 : ROPE_OFFSET + r * 64 + ((((ch - 32) ^ (r >> 1)) & 3) << 4);
}

// Shared-memory matrix descriptor: start address, leading / stride byte offsets, layout (0 none, 1 128-byte swizzle,
// 2 64-byte swizzle). Adding (bytes >> 4) moves the start address (addresses stay below 256 KB: no carry out).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint64_t layout) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (layout << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < 8; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 16, fp32) (+)= A (64 x 32 e4m3, or e5m2 with A_E5M2, shared, K-major) * B (32 x 16 e4m3, shared, K-major).
template <bool A_E5M2>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t da, uint64_t db, int accumulate) {
#define MLA_WGMMA_SS(ATYPE)                                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                                         \
               "wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE                                                  \
               ".e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"                                              \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "l"(da), "l"(db), "r"(accumulate))
  if constexpr (A_E5M2) MLA_WGMMA_SS("e5m2"); else MLA_WGMMA_SS("e4m3");
#undef MLA_WGMMA_SS
}

// D (64 x 16, fp32) += A (64 x 32 e4m3 or e5m2, registers) * B (32 x 16 e4m3, shared, K-major).
template <bool A_E5M2>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db) {
#define MLA_WGMMA_RS(ATYPE)                                                                                         \
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE                                                  \
               ".e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1;\n"                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
  if constexpr (A_E5M2) MLA_WGMMA_RS("e5m2"); else MLA_WGMMA_RS("e4m3");
#undef MLA_WGMMA_RS
}

__device__ __forceinline__ uint32_t prmt_sign(uint32_t a, uint32_t b, uint32_t sel) {  // prmt with sign replication
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One MXFP4 block (32 values: 16 bytes of E2M1 codes, low nibble first, and its E8M0 scale byte) -> 32 e5m2 bytes,
// exactly: E2M1 x 2^k is an e5m2 value for |k| <= 13. A table of the 8 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6, with
// k added to the nonzero exponents) indexed by byte permutes; the sign bits are spread by a permute in sign-
// replication mode. Scales below 2^-13 flush the block to zero (|values| < 2^-12), above 2^13 are clamped.
__device__ __forceinline__ void dequant_block(uint4 codes, uint32_t scale, uint4& lo, uint4& hi) {
  const int k = static_cast<int>(scale) - 127;
  const uint32_t step = static_cast<uint32_t>(min(k, 13) * 4);  // k in the e5m2 exponent field (bits 2..6)
  uint32_t lut0 = 0x3E3C3800u + step * 0x01010100u, lut1 = 0x46444240u + step * 0x01010101u;
  if (k < -13) lut0 = lut1 = 0u;
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // values 8i..8i+7: nibble j of w[i] is value 8i + j, its bit 3 the sign
    const uint32_t t = w[i] << 4;  // byte j of t holds the sign of value 2j as its top bit, byte j of w value 2j+1's
    o[2 * i] = __byte_perm(lut0, lut1, w[i] & 0x7777u) | (prmt_sign(t, w[i], 0xD9C8u) & 0x80808080u);
    o[2 * i + 1] = __byte_perm(lut0, lut1, (w[i] >> 16) & 0x7777u) | (prmt_sign(t, w[i], 0xFBEAu) & 0x80808080u);
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint16_t to_e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint8_t to_e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// Position of tile row r in the k order of the value product: its A fragments (ldmatrix.trans + byte permutes)
// hold, at k = 4*t4 + j of each 16-row half, row 8*(j >> 1) + 2*t4 + (j & 1).
__device__ __forceinline__ int p_position(int r) {
  const int q = r & 15;
  return (r & ~15) + 4 * ((q & 7) >> 1) + 2 * (q >> 3) + (q & 1);
}

// Reduces v[e] (head heads[e]) over a tile's 64 rows: over the lanes of equal t4 (shuffles), then over the 4
// warps through `red` ([16 heads][4 warps]); every thread gets the results for its heads. op: max or sum.
template <typename Op>
__device__ __forceinline__ void reduce_rows(float (&v)[4], const int* heads, float* red, int warp, int g, Op op) {
#pragma unroll
  for (int e = 0; e < 4; ++e)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v[e] = op(v[e], __shfl_xor_sync(0xffffffffu, v[e], o));
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) red[heads[e] * NWARPS + warp] = v[e];
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float4 r = reinterpret_cast<const float4*>(red)[heads[e]];
    v[e] = op(op(r.x, r.y), op(r.z, r.w));
  }
}

template <int STAGES, bool MX>
__global__ void __launch_bounds__(NTHREADS, CTAS_PER_SM)
split_kernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
             const float* __restrict__ kv_scale_ptr, const uint8_t* __restrict__ kv_block_scales, int scale_stride,
             const int* __restrict__ kv_indptr, __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ part_o,
             float* __restrict__ part_lse, unsigned* __restrict__ sync, int total_kv, int num_splits,
             float qk_scale) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  uint8_t* ks = MX ? smem + TILE : smem;  // the stages (MX: after the dequantized tile)
  uint8_t* qs = MX ? smem + TILE + STAGES * MX_STAGE : smem + STAGES * TILE;
  uint8_t* ps = qs + SMEM_Q;
  float* red = reinterpret_cast<float*>(ps + SMEM_P);
  float* qscale = red + NWARPS * H;

  const int split = blockIdx.x, b = blockIdx.y;
  const SplitRange range = split_range(kv_indptr, b, split, num_splits, total_kv);
  const unsigned base = arrival_base(sync, b, num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles;
  const bool valid = range.valid;

  // Copy plan: thread tid copies units c = tid + NTHREADS * it of a tile, row c / 36, unit c % 36: its global
  // bytes lie c * 16 bytes after the tile's first row (one warp reads 512 contiguous bytes); its shared offsets are
  // the same for every tile. Rows past hi are zero-filled, never read. The copies ask L2 for whole 128-byte lines
  // (.L2::128B): 256x8192 took 285-286 us against 321-325 without (H200, A/B in one run; 64 or 256 bytes: no gain).
  // MXFP4: a tile's 64 x 288 bytes of codes are contiguous, and land as they are (unit c at byte 16 c).
  constexpr int COPIES = (MX ? MX_STAGE : TILE) / 16 / NTHREADS;
  constexpr int ROW_UNITS = MX ? MX_ROW / 16 : D / 16;
  const uint32_t ks_addr = smem_u32(ks);
  uint32_t soff[COPIES];
#pragma unroll
  for (int it = 0; it < COPIES; ++it) {
    const int c = tid + NTHREADS * it;
    soff[it] = MX ? c * 16 : tile_offset(c / (D / 16), c % (D / 16));
  }
  auto load_tile = [&](int i) {
    const uint32_t dst = ks_addr + (i % STAGES) * (MX ? MX_STAGE : TILE);
    const int n0 = lo + i * BN;
    const uint8_t* src = kv + static_cast<size_t>(n0) * (MX ? MX_ROW : D) + tid * 16;
    const int rows = hi - n0;
    if (rows >= BN) {
#pragma unroll
      for (int it = 0; it < COPIES; ++it)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst + soff[it]),
                     "l"(src + it * NTHREADS * 16));
    } else {
#pragma unroll
      for (int it = 0; it < COPIES; ++it) {
        const bool in = (tid + NTHREADS * it) / ROW_UNITS < rows;
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst + soff[it]),
                     "l"(in ? src + it * NTHREADS * 16 : kv), "r"(in ? 16 : 0));
      }
    }
  };
  // Q -> e4m3 with one scale per head (its amax maps to 448), in the [chunk][head][16] layout of the score
  // product's B operand; the head's scale, sm_scale * log2(e) and the KV scale multiply the scores. Q's loads are
  // issued before the first tiles' copies so they do not queue behind them.
  constexpr int QPAIRS = D / 64;  // bf16 pairs per lane and head
  __nv_bfloat162 qv[H / NWARPS][QPAIRS];
#pragma unroll
  for (int j = 0; j < H / NWARPS; ++j) {
    const __nv_bfloat162* src =
        reinterpret_cast<const __nv_bfloat162*>(q + (static_cast<size_t>(b) * H + warp + j * NWARPS) * D);
#pragma unroll
    for (int i = 0; i < QPAIRS; ++i) qv[j][i] = src[lane + 32 * i];
  }
  // One cp.async group per tile (empty past the last).
  auto load_group = [&](int i) {
    if (i < ntiles) load_tile(i);
    asm volatile("cp.async.commit_group;\n");
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) load_group(i);
  const float kv_scale = MX ? 1.f : *kv_scale_ptr;
  // MXFP4: this thread dequantizes blocks c = tid + 128 j (j < 9) of each tile, row c / 18, block c % 18; their
  // E8M0 scales are loaded one tile ahead, into registers (rows past hi: 127, a scale of 1 over zero codes).
  constexpr int MX_JOBS = MX ? BN * MX_BLOCKS / NTHREADS : 1;
  uint32_t next_scales[MX_JOBS];
  auto load_scales = [&](int i) {
#pragma unroll
    for (int j = 0; j < MX_JOBS; ++j) {
      const int c = tid + NTHREADS * j, n = lo + i * BN + c / MX_BLOCKS;
      next_scales[j] = i < ntiles && n < hi ? kv_block_scales[static_cast<size_t>(n) * scale_stride + c % MX_BLOCKS]
                                            : 127u;
    }
  };
  if constexpr (MX) load_scales(0);
#pragma unroll
  for (int j = 0; j < H / NWARPS; ++j) {
    const int h = warp + j * NWARPS;
    float2 v[QPAIRS];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < QPAIRS; ++i) {
      v[i] = __bfloat1622float2(qv[j][i]);
      amax = fmaxf(amax, fmaxf(fabsf(v[i].x), fabsf(v[i].y)));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? 448.f / amax : 1.f;
#pragma unroll
    for (int i = 0; i < QPAIRS; ++i) {
      const int d = 2 * (lane + 32 * i);
      *reinterpret_cast<uint16_t*>(qs + (d >> 4) * QCHUNK + h * 16 + (d & 15)) = to_e4m3x2(v[i].x * inv, v[i].y * inv);
    }
    if (lane == 0) qscale[h] = (amax > 0.f ? amax / 448.f : 1.f) * qk_scale * kv_scale;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // This thread's score columns (heads) are 2*t4, 2*t4 + 1, 8 + 2*t4, 9 + 2*t4 (accumulator pairs 0/1 and 4/5 for
  // row g of the warp's 16 rows, 2/3 and 6/7 for row g + 8).
  const int heads[4] = {2 * t4, 2 * t4 + 1, 8 + 2 * t4, 9 + 2 * t4};
  const uint64_t pdesc = desc(smem_u32(ps), QCHUNK, 128, 0);
  const uint64_t qdesc = desc(smem_u32(qs), QCHUNK, 128, 0);
  // Fixed per thread: where its P bytes go (rows warp*16 + g and + 8) and where its ldmatrix rows start.
  const int k0 = p_position(warp * 16 + g), k1 = p_position(warp * 16 + g + 8);
  uint8_t* const p0dst = ps + (k0 >> 4) * QCHUNK + (k0 & 15);
  uint8_t* const p1dst = ps + (k1 >> 4) * QCHUNK + (k1 & 15);
  const uint32_t voff[2] = {lane * 128u + ((warp ^ (lane & 7)) << 4), lane * 128u + (((4 + warp) ^ (lane & 7)) << 4)};
  float qsc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) qsc[e] = qscale[heads[e]];

  float m[4], l[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) m[e] = -INFINITY, l[e] = 0.f;
  float acc[8][8];  // O^T: [64-dim block][accumulator]: dims 64*mb + 16*warp + 2g (+1 for rows g + 8)
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[mb][e] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // tile i is visible to the tensor cores; every warp is done with tile i - 1
    load_group(i + STAGES - 1);
    uint32_t kt = ks_addr + (i % STAGES) * TILE;
    if constexpr (MX) {  // codes + scales -> the e5m2 tile at offset 0 (free: every warp is done with tile i - 1)
      uint32_t scales[MX_JOBS];
#pragma unroll
      for (int j = 0; j < MX_JOBS; ++j) scales[j] = next_scales[j];
      load_scales(i + 1);
      const uint8_t* codes = ks + (i % STAGES) * MX_STAGE;
#pragma unroll
      for (int j = 0; j < MX_JOBS; ++j) {
        const int c = tid + NTHREADS * j, r = c / MX_BLOCKS, blk = c % MX_BLOCKS;
        uint4 lo16, hi16;
        dequant_block(*reinterpret_cast<const uint4*>(codes + c * 16), scales[j], lo16, hi16);
        *reinterpret_cast<uint4*>(smem + tile_offset(r, 2 * blk)) = lo16;
        *reinterpret_cast<uint4*>(smem + tile_offset(r, 2 * blk + 1)) = hi16;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      kt = smem_u32(smem);
    }
    const int n0 = lo + i * BN;

    // S^T (64 rows x 16 heads) = K (64 x 576) Q^T: 18 k32 steps, both operands from shared memory.
    float s[8];
    wg_fence();
    const uint64_t k128 = desc(kt, 16, 1024, 1), k64 = desc(kt + ROPE_OFFSET, 16, 512, 2);
#pragma unroll
    for (int st = 0; st < D / 32; ++st) {
      const uint64_t da =
          st < 16 ? k128 + (((st >> 2) * SW128_BLOCK + (st & 3) * 32) >> 4) : k64 + (((st - 16) * 32) >> 4);
      wgmma_ss<MX>(s, da, qdesc + ((2 * st * QCHUNK) >> 4), st);
    }
    wg_commit();
    wg_wait0();
    fence_acc(s);

    // Online softmax over the tile, log2 domain; rows past hi are masked.
    const int r0 = warp * 16 + g;
    const bool in0 = n0 + r0 < hi, in1 = n0 + r0 + 8 < hi;
    float mx[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;  // accumulator of head e at row g; a + 2 at row g + 8
      s[a] = in0 ? s[a] * qsc[e] : -INFINITY;
      s[a + 2] = in1 ? s[a + 2] * qsc[e] : -INFINITY;
      mx[e] = fmaxf(s[a], s[a + 2]);
    }
    reduce_rows(mx, heads, red, warp, g, [](float x, float y) { return fmaxf(x, y); });
    float alpha[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mn = fmaxf(m[e], mx[e]);
      const float base = mn == -INFINITY ? 0.f : mn;
      alpha[e] = ex2(m[e] - base);
      m[e] = mn;
      const int a = (e & 1) + (e >> 1) * 4;
      const float p0 = ex2(s[a] - (base - P_BIAS)), p1 = ex2(s[a + 2] - (base - P_BIAS));
      l[e] = l[e] * alpha[e] + (p0 + p1);  // this thread's share; summed across the CTA at the end
      p0dst[heads[e] * 16] = to_e4m3(p0);
      p1dst[heads[e] * 16] = to_e4m3(p1);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    // Rescale only when a running max moved somewhere in the warp (rare after the first tiles).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f || alpha[2] != 1.f || alpha[3] != 1.f)) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int a = (e & 1) + (e >> 1) * 4;
          acc[mb][a] *= alpha[e];
          acc[mb][a + 2] *= alpha[e];
        }
      }
    }
    __syncthreads();  // P is complete

    // O^T (512 dims x 16 heads) += V^T (512 x 64) P^T: A from registers. ldmatrix.trans of a chunk's 8-row blocks
    // as b16 gives lane (g, t4) bytes V[r + 2t4][2g], V[r + 2t4][2g+1], V[r + 2t4 + 1][2g], V[r + 2t4 + 1][2g+1] of
    // block r; byte permutes of blocks r and r + 8 give the fragment of A row g (dim 2g) and row g + 8 (dim 2g+1).
#pragma unroll
    for (int kk = 0; kk < BN / 32; ++kk) {
      uint32_t a[8][4];
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        uint32_t vb[4];
        ldsm_x4_trans(vb, kt + (mb >> 1) * SW128_BLOCK + kk * 32 * 128 + voff[mb & 1]);
        a[mb][0] = __byte_perm(vb[0], vb[1], 0x6420);
        a[mb][1] = __byte_perm(vb[0], vb[1], 0x7531);
        a[mb][2] = __byte_perm(vb[2], vb[3], 0x6420);
        a[mb][3] = __byte_perm(vb[2], vb[3], 0x7531);
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) fence_acc(acc[mb]);
      wg_fence();
      const uint64_t db = pdesc + ((2 * kk * QCHUNK) >> 4);
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) wgmma_rs<MX>(acc[mb], a[mb], db);
    }
    wg_commit();
    wg_wait0();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb) fence_acc(acc[mb]);
  }
  asm volatile("cp.async.wait_group 0;\n");

  // Row sums across the warp's rows and the warps (every warp holds the same m).
  __syncthreads();  // every warp has read red in its last tile
  reduce_rows(l, heads, red, warp, g, [](float x, float y) { return x + y; });
  float scale[4];  // kv_scale / the sum (no rows: zeros)
#pragma unroll
  for (int e = 0; e < 4; ++e) scale[e] = l[e] > 0.f ? __fdividef(kv_scale, l[e]) : 0.f;
  const size_t part = static_cast<size_t>(b) * num_splits + split;
  if (num_splits > 1 && tid < 32 && g == 0) {  // first: not queued behind the partial's stores. l carries 2^8
#pragma unroll
    for (int e = 0; e < 4; ++e)
      part_lse[part * H + heads[e]] = l[e] > 0.f ? m[e] + __log2f(l[e]) - P_BIAS : -INFINITY;
  }
  // The output (or partial) goes through shared memory (the stages are free: no copies or products pending) so
  // that each warp store writes whole 128-byte lines; from the fragments, each store wrote four 64-byte pieces and
  // the 32 stores took ~1500 cycles per CTA. Rows padded by 4 floats: the fragments' float2 writes take 2 wavefronts.
  constexpr int OUT_ROW = DV + 4;
  static_assert(H * OUT_ROW * 4 <= TILE, "the staged output fits the first tile's bytes");
  float* staged = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int dim = 64 * mb + 16 * warp + 2 * g;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int a = (e & 1) + (e >> 1) * 4;
      *reinterpret_cast<float2*>(staged + heads[e] * OUT_ROW + dim) =
          make_float2(acc[mb][a] * scale[e], acc[mb][a + 2] * scale[e]);
    }
  }
  __syncthreads();
  const int col = 4 * tid;
#pragma unroll 4
  for (int h = 0; h < H; ++h) {
    float4 v = *reinterpret_cast<const float4*>(staged + h * OUT_ROW + col);
    if (num_splits == 1 && !valid) v = make_float4(NAN, NAN, NAN, NAN);
    store_bf16x4((num_splits == 1 ? out + static_cast<size_t>(b) * H * DV : part_o + part * H * DV) + h * DV + col, v);
  }
  if (num_splits > 1) merge_splits(sync, base, b, split, num_splits, valid, out, part_o, part_lse);
}

#else  // mma.sync, fp16

constexpr int NWARPS = 8;
constexpr int NTHREADS = NWARPS * 32;
constexpr int CTAS_PER_SM = 1;
constexpr bool SUPPORTS_MXFP4 = false;
constexpr int TOKW = BN / NWARPS;      // score columns (tile rows) per warp: one m16n8 tile
constexpr int VCOLS = DV / NWARPS;     // output columns per warp
constexpr int KROW = D + 16;           // smem bytes per tile row: 8 consecutive rows hit distinct banks (ldmatrix)
constexpr int QROW = D + 8;            // halves per row of the fp16 Q staging
constexpr int PROW = BN + 8;           // halves per P row
constexpr int KSTEPS = D / 16;         // k16 steps of the score product
constexpr int SMEM_Q = H * QROW * 2;
constexpr int SMEM_P = H * PROW * 2;
constexpr int SMEM_RED = NWARPS * H * 4;
template <int STAGES, bool MX>
constexpr int smem_bytes() { return STAGES * BN * KROW + SMEM_Q + SMEM_P + SMEM_RED; }

__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 bytes (low byte first) -> f16x2 by the hardware cvt.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int STAGES, bool MX>  // MX: not supported here (the launcher never instantiates it)
__global__ void __launch_bounds__(NTHREADS, 1)
split_kernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
             const float* __restrict__ kv_scale_ptr, const uint8_t* __restrict__ kv_block_scales, int scale_stride,
             const int* __restrict__ kv_indptr, __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ part_o,
             float* __restrict__ part_lse, unsigned* __restrict__ sync, int total_kv, int num_splits,
             float qk_scale) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ks = smem;
  uint8_t* const tail = smem + STAGES * BN * KROW;
  __half* qs = reinterpret_cast<__half*>(tail);
  __half* ps = reinterpret_cast<__half*>(tail + SMEM_Q);
  float* red = reinterpret_cast<float*>(tail + SMEM_Q + SMEM_P);

  const int split = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const SplitRange range = split_range(kv_indptr, b, split, num_splits, total_kv);
  const unsigned base = arrival_base(sync, b, num_splits);
  const int lo = range.lo, hi = range.hi, ntiles = range.ntiles;
  const bool valid = range.valid;

  auto load_tile = [&](int i) {  // rows past hi are zero-filled, never read
    uint8_t* dst = ks + (i % STAGES) * BN * KROW;
    const int n0 = lo + i * BN;
    for (int c = tid; c < BN * (D / 16); c += NTHREADS) {
      const int r = c / (D / 16), col = (c % (D / 16)) * 16;
      const int n = n0 + r;
      const uint8_t* src = kv + static_cast<size_t>(n < hi ? n : lo) * D + col;
      const uint32_t d = smem_u32(dst + r * KROW + col);
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n < hi ? 16 : 0));
    }
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < ntiles) load_tile(i);
    asm volatile("cp.async.commit_group;\n");
  }

  // Q -> fp16 * sm_scale * log2(e) (bf16 has 8 significant bits, fp16 11; |q| < ~1e6), then into registers as the
  // A operand of every k16 step. Within each 16-dim chunk, lane t4 takes dims 4*t4 + {0,1} as the k-pair t4*2 and
  // 4*t4 + {2,3} as the k-pair t4*2 + 8: the products run over that permutation of the dims, the same for K (whose
  // ldmatrix fragments come out in exactly this order).
  const float kv_scale = *kv_scale_ptr;
  for (int c = tid; c < H * D / 2; c += NTHREADS) {
    const int h = c / (D / 2), j = c % (D / 2);
    const float2 v = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(q + static_cast<size_t>(b) * H * D)[c]);
    *reinterpret_cast<__half2*>(qs + h * QROW + 2 * j) = __floats2half2_rn(v.x * qk_scale, v.y * qk_scale);
  }
  __syncthreads();
  uint32_t qa[KSTEPS][4];
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    const __half* r0 = qs + g * QROW + s * 16 + 4 * t4;
    const __half* r1 = r0 + 8 * QROW;
    qa[s][0] = *reinterpret_cast<const uint32_t*>(r0);
    qa[s][1] = *reinterpret_cast<const uint32_t*>(r1);
    qa[s][2] = *reinterpret_cast<const uint32_t*>(r0 + 2);
    qa[s][3] = *reinterpret_cast<const uint32_t*>(r1 + 2);
  }

  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads g and g + 8
  float acc[VCOLS / 8][4];  // [2 * group + parity]: even / odd columns of 16-column group `group`
#pragma unroll
  for (int j = 0; j < VCOLS / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();  // tile i is visible; every warp is done with tile i - 1 (its stage, P and red)
    if (i + STAGES - 1 < ntiles) load_tile(i + STAGES - 1);
    asm volatile("cp.async.commit_group;\n");
    const uint8_t* kt = ks + (i % STAGES) * BN * KROW;
    const int n0 = lo + i * BN;

    // S (16 heads x this warp's 8 rows): ldmatrix gives lane (g, t4) bytes 4*t4..4*t4+3 of a 16-byte chunk of
    // row g: the B fragment of that chunk's k16 step. Four accumulators keep four mma chains in flight.
    float s4[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) s4[a][0] = s4[a][1] = s4[a][2] = s4[a][3] = 0.f;
    const uint8_t* krow = kt + (warp * TOKW + (lane & 7)) * KROW + (lane >> 3) * 16;
#pragma unroll
    for (int c4 = 0; c4 < KSTEPS / 4; ++c4) {
      uint32_t kb[4];
      ldsm_x4(kb, smem_u32(krow + c4 * 64));
#pragma unroll
      for (int a = 0; a < 4; ++a)
        mma_f16(s4[a], qa[c4 * 4 + a], e4m3x2_to_f16x2(kb[a]), e4m3x2_to_f16x2(kb[a] >> 16));
    }
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = (s4[0][e] + s4[1][e]) + (s4[2][e] + s4[3][e]);

    // Online softmax over the tile, log2 domain; rows past hi are masked.
    const int row = n0 + warp * TOKW + t4 * 2;
    s[0] = row < hi ? s[0] * kv_scale : -INFINITY;
    s[1] = row + 1 < hi ? s[1] * kv_scale : -INFINITY;
    s[2] = row < hi ? s[2] * kv_scale : -INFINITY;
    s[3] = row + 1 < hi ? s[3] * kv_scale : -INFINITY;
    float mx0 = fmaxf(s[0], s[1]), mx1 = fmaxf(s[2], s[3]);
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if (t4 == 0) {
      red[warp * H + g] = mx0;
      red[warp * H + g + 8] = mx1;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      mx0 = fmaxf(mx0, red[w * H + g]);
      mx1 = fmaxf(mx1, red[w * H + g + 8]);
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float base0 = mn0 == -INFINITY ? 0.f : mn0, base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = exp2f(s[0] - base0), p1 = exp2f(s[1] - base0);
    const float p2 = exp2f(s[2] - base1), p3 = exp2f(s[3] - base1);
    *reinterpret_cast<uint32_t*>(ps + g * PROW + warp * TOKW + t4 * 2) = pack_half2(p0, p1);
    *reinterpret_cast<uint32_t*>(ps + (g + 8) * PROW + warp * TOKW + t4 * 2) = pack_half2(p2, p3);
    l0 = l0 * alpha0 + (p0 + p1);  // this thread's share; summed across the CTA at the end
    l1 = l1 * alpha1 + (p2 + p3);
#pragma unroll
    for (int j = 0; j < VCOLS / 8; ++j) {
      acc[j][0] *= alpha0;
      acc[j][1] *= alpha0;
      acc[j][2] *= alpha1;
      acc[j][3] *= alpha1;
    }
    __syncthreads();  // P is complete

    // O (16 x this warp's 64 columns) += P (16 x 64) V (64 x 64). ldmatrix.trans of the FP8 rows as b16 gives lane
    // (g, t4) the bytes V[2t4][d], V[2t4][d+1], V[2t4+1][d], V[2t4+1][d+1] with d = group base + 2g: bytes 0 and 2
    // form the B fragment of the even column tile (column g = dim d), bytes 1 and 3 that of the odd one (d + 1).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4];
      ldsm_x4(pa, smem_u32(ps + (lane & 15) * PROW + kk * 16 + (lane >> 4) * 8));
      const uint8_t* vrow =
          kt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KROW + warp * VCOLS + (lane >> 4) * 16;
#pragma unroll
      for (int gp = 0; gp < VCOLS / 32; ++gp) {  // pairs of 16-column groups
        uint32_t vb[4];
        ldsm_x4_trans(vb, smem_u32(vrow + gp * 32));
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const uint32_t lo_rows = vb[2 * h2], hi_rows = vb[2 * h2 + 1];
          float* even = acc[(gp * 2 + h2) * 2];
          float* odd = acc[(gp * 2 + h2) * 2 + 1];
          mma_f16(even, pa, e4m3x2_to_f16x2(__byte_perm(lo_rows, 0, 0x0020)),
                  e4m3x2_to_f16x2(__byte_perm(hi_rows, 0, 0x0020)));
          mma_f16(odd, pa, e4m3x2_to_f16x2(__byte_perm(lo_rows, 0, 0x0031)),
                  e4m3x2_to_f16x2(__byte_perm(hi_rows, 0, 0x0031)));
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n");

  // Row sums across the quad and the warps (every warp holds the same m0, m1).
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  __syncthreads();  // every warp has read red in its last tile
  if (t4 == 0) {
    red[warp * H + g] = l0;
    red[warp * H + g + 8] = l1;
  }
  __syncthreads();
  l0 = l1 = 0.f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) {
    l0 += red[w * H + g];
    l1 += red[w * H + g + 8];
  }
  const float inv0 = l0 > 0.f ? kv_scale / l0 : 0.f, inv1 = l1 > 0.f ? kv_scale / l1 : 0.f;  // no rows: zeros
  // Group `grp` holds dims base + 4*t4 + {0, 1, 2, 3} as (even c0, odd c0, even c1, odd c1) for head g (c2, c3: g + 8).
  const size_t part = static_cast<size_t>(b) * num_splits + split;
#pragma unroll
  for (int grp = 0; grp < VCOLS / 16; ++grp) {
    const float* ev = acc[2 * grp];
    const float* od = acc[2 * grp + 1];
    const int col = warp * VCOLS + grp * 16 + 4 * t4;
    float4 v0 = make_float4(ev[0] * inv0, od[0] * inv0, ev[1] * inv0, od[1] * inv0);
    float4 v1 = make_float4(ev[2] * inv1, od[2] * inv1, ev[3] * inv1, od[3] * inv1);
    if (num_splits == 1) {
      if (!valid) v0 = v1 = make_float4(NAN, NAN, NAN, NAN);
      __nv_bfloat16* o = out + static_cast<size_t>(b) * H * DV + col;
      store_bf16x4(o + g * DV, v0);
      store_bf16x4(o + (g + 8) * DV, v1);
    } else {
      __nv_bfloat16* o = part_o + part * H * DV + col;
      store_bf16x4(o + g * DV, v0);
      store_bf16x4(o + (g + 8) * DV, v1);
    }
  }
  if (num_splits > 1 && warp == 0 && t4 == 0) {
    part_lse[part * H + g] = l0 > 0.f ? m0 + log2f(l0) : -INFINITY;
    part_lse[part * H + g + 8] = l1 > 0.f ? m1 + log2f(l1) : -INFINITY;
  }
  if (num_splits > 1) merge_splits(sync, base, b, split, num_splits, valid, out, part_o, part_lse);
}

#endif  // MLA_WGMMA

}  // namespace mla

// Split kernel CTAs that fit on one SM (the split heuristic's unit of parallelism), and whether this build reads
// the MXFP4 cache.
extern "C" int mla_ctas_per_sm() { return mla::CTAS_PER_SM; }
extern "C" int mla_supports_mxfp4() { return mla::SUPPORTS_MXFP4 ? 1 : 0; }

// A limit below the GPU's shared memory per block, for tests: the mma.sync kernel then runs with the stages that
// GPUs with less shared memory get (0: none). Returns the stages it will run with on the current device (0 in the
// wgmma build, which has one configuration per grid: Hopper has 227 KB per block).
#if MLA_WGMMA
extern "C" int mla_limit_shared_memory(int) { return 0; }
#else
static int smem_limit_for_tests = 0;
// As many stages as fit the shared memory per block (or the limit for tests): 4 (169 KB) on sm_90 and sm_100, 3 on
// sm_80 (163 KB), 2 on sm_86, sm_89 and sm_120 (99 KB).
static int mma_sync_stages(int smem_per_block) {
  const int limit = smem_limit_for_tests ? min(smem_limit_for_tests, smem_per_block) : smem_per_block;
  return limit >= mla::smem_bytes<4, false>() ? 4 : limit >= mla::smem_bytes<3, false>() ? 3 : 2;
}
extern "C" int mla_limit_shared_memory(int bytes) {
  smem_limit_for_tests = bytes;
  int dev = 0, smem_per_block = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return mma_sync_stages(smem_per_block);
}
#endif

struct SplitArgs {
  const __nv_bfloat16* q;
  const uint8_t* kv;
  const float* kv_scale;
  const uint8_t* kv_block_scales;
  int scale_stride;
  const int* kv_indptr;
  __nv_bfloat16* out;
  __nv_bfloat16* part_o;
  float* part_lse;
  unsigned* sync;
  int batch, total_kv, num_splits;
  float qk_scale;
};

// With more than one split the launch is cooperative: the merge's wait needs every CTA of the grid resident (the
// split plan keeps the grid within the CTAs that fit at once; a grid that cannot fit fails to launch, never hangs).
// The KV cache, read once per launch, is marked streaming in L2 for the launch (an access policy window over its
// first max_window bytes; none where the device has no windows): its lines are evicted before others. 64x1024
// 23.0 -> 21.3-21.5 us, the other shapes within +-0.4 (H200, three A/Bs); why 64x1024 alone (37.7 MB of cache,
// the split partials written after it) and not 4x8192 or 32x1024 (18.9 MB) was not pinned down.
template <int STAGES, bool MX>
static cudaError_t launch_split(int dev, cudaStream_t stream, const SplitArgs& a, int max_window) {
  constexpr int smem = mla::smem_bytes<STAGES, MX>();
  static thread_local unsigned configured = 0;  // devices whose dynamic shared-memory limit was raised
  if (!(configured & (1u << dev))) {
    const cudaError_t e =
        cudaFuncSetAttribute(mla::split_kernel<STAGES, MX>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    configured |= 1u << dev;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a.num_splits, a.batch);
  cfg.blockDim = dim3(mla::NTHREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (max_window > 0) {
    const size_t kv_bytes = static_cast<size_t>(a.total_kv) * (MX ? mla::D / 2 : mla::D);
    attrs[n].id = cudaLaunchAttributeAccessPolicyWindow;
    cudaAccessPolicyWindow& window = attrs[n++].val.accessPolicyWindow;
    window.base_ptr = const_cast<uint8_t*>(a.kv);
    window.num_bytes = kv_bytes < static_cast<size_t>(max_window) ? kv_bytes : static_cast<size_t>(max_window);
    window.hitRatio = 1.f;
    window.hitProp = cudaAccessPropertyStreaming;
    window.missProp = cudaAccessPropertyStreaming;
  }
  if (a.num_splits > 1) {
    attrs[n].id = cudaLaunchAttributeCooperative;
    attrs[n++].val.cooperative = 1;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, mla::split_kernel<STAGES, MX>, a.q, a.kv, a.kv_scale, a.kv_block_scales,
                            a.scale_stride, a.kv_indptr, a.out, a.part_o, a.part_lse, a.sync, a.total_kv,
                            a.num_splits, a.qk_scale);
}

// Launches the split kernel (which merges its splits itself) on `stream`. kv_format 0: kv is the FP8 cache
// (total_kv, 576) with kv_scale (1,) fp32; 1: kv is the MXFP4 codes (total_kv, 288) with kv_block_scales, E8M0
// bytes, row r's 18 at r * scale_stride. part_o, part_lse and sync as split_kernel's (unused with one split).
// C ABI (loaded with ctypes: no torch headers, seconds to build). Returns a cudaError_t.
extern "C" int mla_decode(const void* q, const void* kv, const void* kv_scale, const void* kv_block_scales,
                          int scale_stride, int kv_format, const void* kv_indptr, void* out, void* part_o,
                          void* part_lse, void* sync, int batch, int total_kv, int num_splits, float qk_scale,
                          void* stream) {
  static thread_local int sms[32] = {}, smem_per_block[32] = {}, max_window[32] = {};  // per device
  int dev = 0;
  cudaGetDevice(&dev);
  const bool splits_ok = num_splits >= 1 && num_splits <= mla::MAX_SPLITS && (num_splits & (num_splits - 1)) == 0;
  if (dev >= 32 || !splits_ok || (kv_format == 1 && !mla::SUPPORTS_MXFP4))
    return static_cast<int>(cudaErrorInvalidValue);
  if (sms[dev] == 0) {
    cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&smem_per_block[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaDeviceGetAttribute(&max_window[dev], cudaDevAttrMaxAccessPolicyWindowSize, dev);
  }
  const SplitArgs args = {static_cast<const __nv_bfloat16*>(q), static_cast<const uint8_t*>(kv),
                          static_cast<const float*>(kv_scale), static_cast<const uint8_t*>(kv_block_scales),
                          scale_stride, static_cast<const int*>(kv_indptr), static_cast<__nv_bfloat16*>(out),
                          static_cast<__nv_bfloat16*>(part_o), static_cast<float*>(part_lse),
                          static_cast<unsigned*>(sync), batch, total_kv, num_splits, qk_scale};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
#if MLA_WGMMA
  if (kv_format == 1)
    e = launch_split<mla::MX_STAGES, true>(dev, s, args, max_window[dev]);
  else if (batch * num_splits > sms[dev])
    e = launch_split<mla::STAGES_SHARED, false>(dev, s, args, max_window[dev]);
  else
    e = launch_split<mla::STAGES_ALONE, false>(dev, s, args, max_window[dev]);
#else
  switch (mma_sync_stages(smem_per_block[dev])) {
    case 4: e = launch_split<4, false>(dev, s, args, max_window[dev]); break;
    case 3: e = launch_split<3, false>(dev, s, args, max_window[dev]); break;
    default: e = launch_split<2, false>(dev, s, args, max_window[dev]);
  }
#endif
  return static_cast<int>(e);
}
"""
_CUDA_LIBS: dict = {}  # device capability -> ctypes library, or the build error (str) when it could not be built
_CUDA_LAUNCH: dict = {}


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    found = shutil.which("nvcc")
    candidates += [found] if found else []
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _build_cuda_library(nvcc: str, arch: str, wgmma: bool) -> str:
    """Path of the library built from _CUDA_SRC for sm_<arch> (the wgmma kernel or the mma.sync one) in
    MLA_CUDA_CACHE (default ~/.cache/mla_decode), keyed by a hash of the source, the target and the nvcc; built
    there once per machine. A RuntimeError carries nvcc's message when it cannot be built."""
    digest = hashlib.sha256(f"{_CUDA_SRC}{arch}{wgmma}{nvcc}".encode()).hexdigest()[:16]
    cache = os.environ.get("MLA_CUDA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mla_decode")
    path = os.path.join(cache, f"libmla_decode_sm{arch}_{digest}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cu = os.path.join(tmp, "mla_decode.cu")
            with open(cu, "w") as f:
                f.write(_CUDA_SRC)
            built = os.path.join(tmp, "lib.so")
            cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-diag-suppress", "177",
                   f"-DMLA_WGMMA={int(wgmma)}", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", built, cu]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"cuda backend: nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
            os.replace(built, path)  # atomic: concurrent builders each install a complete file
    return path


def _cuda_library(capability: tuple[int, int]):
    """The kernel library for this capability, built once per machine (see _build_cuda_library) and loaded: the
    wgmma kernel on Hopper (sm_90a), or the mma.sync one where that cannot be built (an nvcc older than 12.0; with
    a warning) and on other GPUs. A RuntimeError carries nvcc's message when neither can be built."""
    lib = _CUDA_LIBS.get(capability)
    if isinstance(lib, str):
        raise RuntimeError(lib)
    if lib is not None:
        return lib
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("cuda backend: no nvcc found (set CUDA_HOME or put nvcc on PATH)")
    arch = f"{capability[0]}{capability[1]}"
    try:
        if capability == CUDA_WGMMA_CAPABILITY:
            try:
                path = _build_cuda_library(nvcc, arch + "a", wgmma=True)
            except RuntimeError as e:
                log.warning("MLA decode: the Hopper (wgmma) kernel did not build, using the mma.sync one: %s", e)
                path = _build_cuda_library(nvcc, arch, wgmma=False)
        else:
            path = _build_cuda_library(nvcc, arch, wgmma=False)
    except RuntimeError as e:
        _CUDA_LIBS[capability] = str(e)
        raise
    lib = ctypes.CDLL(path)
    lib.mla_decode.restype = ctypes.c_int
    lib.mla_decode.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
                               + [ctypes.c_float, ctypes.c_void_p])
    lib.mla_limit_shared_memory.restype = ctypes.c_int
    lib.mla_limit_shared_memory.argtypes = [ctypes.c_int]
    for name in ("mla_ctas_per_sm", "mla_supports_mxfp4"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    _CUDA_LIBS[capability] = lib
    return lib


@functools.cache
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def cuda_unusable_reason(device: torch.device, kv_format: str = "fp8") -> str | None:
    """None when the cuda backend reads `kv_format` on `device` (an NVIDIA GPU of capability >= 8.0 whose kernel
    library builds with the machine's nvcc, once per machine; MXFP4 only with the Hopper kernel), else why not."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"cuda backend: needs an NVIDIA GPU; device is {device}"
    if _cuda_capability(device) < CUDA_MIN_CAPABILITY:
        return f"cuda backend: needs compute capability >= 8.0, this GPU has {_cuda_capability(device)}"
    try:
        lib = _cuda_library(_cuda_capability(device))
    except RuntimeError as e:
        return str(e)
    if kv_format == "mxfp4" and not lib.mla_supports_mxfp4():
        return (f"cuda backend: reads MXFP4 only with its Hopper (sm_90a) kernel; this GPU has capability "
                f"{_cuda_capability(device)}")
    return None


def cuda_plan(batch: int, seq_len: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """Splits per sequence: the largest power of two with batch x splits <= the CTAs that fit at once (ctas_per_sm x
    SMs; the merge's barrier needs them all resident), at most CUDA_MAX_SPLITS and at least one 64-row tile per split;
    then, while a second CTA per SM would be needed (batch x splits > SMs), halved as long as a split would hold fewer
    than 4 tiles (a CTA's fixed cost, its Q and its partial output, outweighs so little work). Measured on the H200
    (132 SMs, 2026-11-30 ~12:04 UTC, the fused merge, splits 1..64 per shape, leaderboard timing), the wgmma kernel (2
    CTAs per SM) is fastest, or within 3%, at the counts this picks: 16 at 4x1024 (11.3 us; 12.2 at 8), 32 at 4x8192
    (18.9; 20.6 at 64), 4 at 32x1024 (18.9; 19.5 at 8), 8 at 32x8192 (54.9; 55.2 at 4), 4 at 64x1024 (25.0; 25.6 at 2)
    and 64x8192, 1 at batch 256; rechecked at ~13:10 UTC with the current kernel: 4x8192 at 64 18.8 (17.0 at 32),
    32x1024 at 8 17.7 (17.4 at 4), 32x8192 at 4 54.2 (53.1 at 8). Two warpgroups per CTA alone on its SM (alternate
    tiles; 64x8192 in 2 splits, 32x8192 in 4) were faster until the copies asked L2 for whole lines, then slower (89.4
    against 87.5 and 54.4 against 53.1 us), and were removed. The mma.sync kernel (1 CTA per SM) was best at 16, 32, 4,
    4, 2, 2, 1, 1 (what this picks for it; measured with the earlier two-kernel merge)."""
    tiles = max(1, seq_len // CUDA_BLOCK_N)
    limit = max(1, min(ctas_per_sm * num_sms // max(batch, 1), tiles, CUDA_MAX_SPLITS))
    splits = 1 << (limit.bit_length() - 1)
    while splits > 1 and batch * splits > num_sms and tiles // splits < 4:
        splits //= 2
    return splits


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def _current_raw_stream(device: torch.device) -> int:
    """The current stream's handle. torch.cuda.current_stream(device).cuda_stream builds a Stream object: 4.5 us
    of host time per call on the H200's host, against 0.2 for the raw handle (the private call Triton and Inductor
    make)."""
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _cuda_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format: str) -> torch.Tensor:
    """Inputs as _triton_forward's: kv (total_kv, 1, 576) FP8 with scale (1,) fp32, or kv (total_kv, 1, 288) MXFP4
    codes with scale (>= total_kv, >= 18) E8M0 block scales (any row stride). One ctypes call launches the split
    kernel (which merges the splits too) on the current stream; the workspace (partials, the per-sequence barrier's
    counters) is cached by (device, batch, kv_seq_len, format)."""
    device = q.device
    lib = _cuda_library(_cuda_capability(device))
    batch = q.shape[0]
    seq_len = config["kv_seq_len"] if config["kv_seq_len"] is not None else -(-kv.shape[0] // max(batch, 1))
    key = (device, batch, seq_len, kv_format)
    launch = _CUDA_LAUNCH.get(key)
    if launch is None:
        splits = cuda_plan(batch, seq_len, torch.cuda.get_device_properties(device).multi_processor_count,
                           lib.mla_ctas_per_sm())
        rows = batch * splits if splits > 1 else 0
        launch = (splits, torch.empty((rows, NUM_HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=device),
                  torch.empty((rows, NUM_HEADS), dtype=torch.float32, device=device),
                  torch.zeros((batch if splits > 1 else 0,), dtype=torch.int32, device=device))
        if len(_CUDA_LAUNCH) >= LAUNCH_CACHE_LIMIT:
            _CUDA_LAUNCH.clear()
        _CUDA_LAUNCH[key] = launch
    splits, part_o, part_lse, sync = launch
    if (q.data_ptr() | kv.data_ptr() | kv_indptr.data_ptr()) % 16:
        raise ValueError(f"cuda backend: q, kv_data[{kv_format!r}][0] and kv_indptr must start on 16-byte boundaries")
    mxfp4 = kv_format == "mxfp4"
    out = q.new_empty((batch, NUM_HEADS, V_HEAD_DIM))  # q is bf16; new_empty parses no dtype or device
    err = lib.mla_decode(q.data_ptr(), kv.data_ptr(), None if mxfp4 else scale.data_ptr(),
                         scale.data_ptr() if mxfp4 else None, scale.stride(0) if mxfp4 else 0, int(mxfp4),
                         kv_indptr.data_ptr(), out.data_ptr(), part_o.data_ptr(), part_lse.data_ptr(),
                         sync.data_ptr(), batch, kv.shape[0], splits, float(config["sm_scale"]) * LOG2E,
                         _current_raw_stream(device))
    if err:
        raise RuntimeError(f"cuda backend: launch failed with cudaError {err}")
    return out


# ---------------------------------------------------------------------------------------------------------
# torch backend: portable, fp32 math, memory-bounded
# Q stays bf16 (widened to fp32, exact): quantizing it to FP8 as the aiter path must would add error
# (rel-L2 vs the BF16 truth 0.027-0.044 instead of 0.016-0.036, reference.py) and saves nothing here.
# ---------------------------------------------------------------------------------------------------------

# KV rows dequantized to fp32 at a time (65536 x 576 x 4 B = 151 MB): bounds memory whatever the batch.
TORCH_CHUNK_ROWS = 1 << 16
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequant_fp8_rows(kv: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return kv[lo:hi, 0].float() * scale.reshape(()).float()


def _dequant_mxfp4_rows(kv: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    codes = kv[lo:hi, 0].view(torch.uint8)  # (rows, 288)
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=kv.device)
    vals = torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1)  # low nibble first
    block_scale = torch.exp2(scale[lo:hi, :MXFP4_BLOCKS_PER_ROW].view(torch.uint8).float() - 127.0)
    return (vals.reshape(hi - lo, MXFP4_BLOCKS_PER_ROW, MXFP4_BLOCK) * block_scale.unsqueeze(-1)).reshape(hi - lo, -1)


def _attend(q: torch.Tensor, keys: torch.Tensor, sm_scale: float):
    """q (g, 16, 576) fp32, keys (g, n, 576) fp32 -> unnormalised output (g, 16, 512), row max, row sum."""
    scores = torch.bmm(q, keys.transpose(1, 2)) * sm_scale  # (g, 16, n)
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    return torch.bmm(p, keys[:, :, :V_HEAD_DIM]), m, p.sum(dim=-1, keepdim=True)


def _torch_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format: str) -> torch.Tensor:
    lens = validate_indptr_contents(qo_indptr, kv_indptr, kv.shape[0], config["kv_seq_len"])
    starts = kv_indptr.tolist()
    rows_fp32 = _dequant_fp8_rows if kv_format == "fp8" else _dequant_mxfp4_rows
    sm_scale = float(config["sm_scale"])
    # NaN until written, so a row the loop below misses fails every check instead of passing as zeros.
    out = torch.full((q.shape[0], NUM_HEADS, V_HEAD_DIM), torch.nan, dtype=torch.bfloat16, device=q.device)
    b, batch = 0, len(lens)
    while b < batch:
        n = lens[b]
        # Consecutive sequences of equal length are contiguous rows: attend to a group of them at once.
        g = 1
        while b + g < batch and lens[b + g] == n and (g + 1) * n <= TORCH_CHUNK_ROWS:
            g += 1
        if n == 0:
            out[b:b + g] = 0.0
        else:
            qg = q[b:b + g].float()
            acc = m = l = None
            # One pass for a group (g * n <= a chunk); a longer single sequence (g == 1) goes chunk by chunk.
            for lo in range(0, n, TORCH_CHUNK_ROWS):
                hi = min(lo + TORCH_CHUNK_ROWS, n)
                keys = rows_fp32(kv, scale, starts[b] + lo * g, starts[b] + hi * g).view(g, hi - lo, QK_HEAD_DIM)
                o, mc, lc = _attend(qg, keys, sm_scale)
                if acc is None:
                    acc, m, l = o, mc, lc
                else:  # merge chunks by log-sum-exp
                    m_new = torch.maximum(m, mc)
                    a, c = torch.exp(m - m_new), torch.exp(mc - m_new)
                    acc, l, m = acc * a + o * c, l * a + lc * c, m_new
            out[b:b + g] = (acc / l).to(torch.bfloat16)
        b += g
    return out


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


def custom_kernel(data):
    """data = (q, kv_data, qo_indptr, kv_indptr, config) -> (total_q, 16, 512) bfloat16."""
    kv_format = select_kv_format()
    q, kv, scale, qo_indptr, kv_indptr, config = validate(data, kv_format)
    backend = select_backend(q.device, kv_format)
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # ctypes, Triton and aiter launch on the current device
            return custom_kernel(data)
    if backend != "torch" and os.environ.get("MLA_VALIDATE") == "1":
        validate_indptr_contents(qo_indptr, kv_indptr, kv.shape[0], config["kv_seq_len"])
    if backend == "aiter":
        _expect(kv_format == "fp8", "MLA_KV_FORMAT", "fp8 with the aiter backend", repr(kv_format))
        return _aiter_forward(q, kv, scale, qo_indptr, kv_indptr, config)
    if backend == "cuda":
        return _cuda_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format)
    if backend == "triton":
        return _triton_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format)
    return _torch_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format)
