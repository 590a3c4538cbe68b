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
The cuda and triton backends need q, the cache and kv_indptr to start on 16-byte boundaries (torch's allocations
do) and refuse others.

Backends (MLA_BACKEND=auto|aiter|cuda|triton|torch, default DEFAULT_BACKEND below; a forced one that is
unavailable fails):
  aiter   AMD GPU with aiter importable (auto picks it on ROCm): FP8 Q + FP8 KV, persistent mla_decode_fwd
  cuda    NVIDIA GPU with nvcc and this repo's mla_decode_cuda package installed (auto picks it where it reads the
          format: FP8 anywhere, MXFP4 on Hopper): our CUDA kernels (wgmma on Hopper, mma.sync elsewhere), built at
          the first call; this file alone runs the triton backend on NVIDIA
  triton  any GPU with triton (auto: NVIDIA where the cuda backend cannot run, AMD without aiter): our split-KV kernel
  torch   anywhere: fp32 math over the dequantized cache in bounded chunks
KV format (MLA_KV_FORMAT=fp8|mxfp4, default DEFAULT_KV_FORMAT below) selects which cache the cuda, triton and
torch backends read.
Precision (MLA_PRECISION=fast|precise, default DEFAULT_PRECISION below): "fast" takes the FP8 cache's score
product as an fp8 x fp8 MMA, whose sums lose accuracy under a large common logit offset; "precise" takes it in
fp16 with fp32 sums, at some speed (select_precision). aiter has only the fast form.
MLA_VALIDATE=1 adds the host-side check of the indptr contents (a device sync) on every backend; the torch
backend always does it. GPU kernels never read outside the cache whatever the indptr holds: a sequence whose
range is invalid gets NaN rows.
"""

import functools
import logging
import math
import os
from typing import NamedTuple

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
BACKEND_CHOICES = BACKENDS + ("auto",)
KV_FORMATS = ("fp8", "mxfp4")
PRECISIONS = ("fast", "precise")
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: their score scale is sm_scale * log2(e)
CONFIG_KEYS = ("batch_size", "num_heads", "num_kv_heads", "qk_head_dim", "v_head_dim", "q_seq_len", "kv_seq_len",
               "sm_scale")

# What runs when MLA_BACKEND / MLA_KV_FORMAT / MLA_PRECISION are unset, as on the leaderboard (it sets no
# environment variables): edit these to submit another backend ("triton", "torch"), the MXFP4 cache ("mxfp4") or
# the precise score product ("precise"; select_precision says what it costs).
DEFAULT_BACKEND = "auto"
DEFAULT_KV_FORMAT = "fp8"
DEFAULT_PRECISION = "fast"

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


def _expect_pair(x, field: str, first: str, second: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"{field}: expected a (tensor, scale) pair, got {type(x).__name__}")
    return _expect_tensor(x[0], first), _expect_tensor(x[1], second)


def _expect_on_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"q and {name} are on different devices ({device}, {x.device})")


def _expect_int(x, field: str, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{field}: expected an int{' or None' if allow_none else ''}, got {type(x).__name__}")


def qk_scale_of(config: dict) -> float:
    """The kernels' score scale: sm_scale * log2(e)."""
    return float(config["sm_scale"]) * LOG2E


def _validate_config(config, batch: int) -> None:
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, got {type(config).__name__}")
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


def _validate_indptr(x, field: str, length: int | None, device: torch.device) -> torch.Tensor:
    x = _expect_tensor(x, field)
    _expect(x.dtype == torch.int32, f"{field}.dtype", "torch.int32", x.dtype)
    _expect(x.dim() == 1 and x.shape[0] >= 2, f"{field}.shape", "(batch + 1,) with batch >= 1", tuple(x.shape))
    if length is not None:
        _expect(x.shape[0] == length, f"{field}.shape", f"({length},) like qo_indptr", tuple(x.shape))
    _expect_on_device(x, field, device)
    _expect(x.is_contiguous(), field, "a contiguous tensor", "a strided view")
    return x


# What the two elements of each KV format's (tensor, scale) pair are, as the validation messages name them.
_KV_NAMES = {"fp8": ("the FP8 cache (kv_data['fp8'][0])", "the FP8 scale (kv_data['fp8'][1])"),
             "mxfp4": ("the MXFP4 cache (kv_data['mxfp4'][0])", "the MXFP4 block scales (kv_data['mxfp4'][1])")}


def _validate_kv(kv_data, kv_format: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (kv, scale) of the format that will be read."""
    if not isinstance(kv_data, dict):
        raise TypeError(f"kv_data: expected a dict of KV formats, got {type(kv_data).__name__}")
    _expect(kv_format in kv_data, "kv_data", f"a {kv_format!r} entry", f"keys {sorted(kv_data)}")
    kv_name, scale_name = _KV_NAMES[kv_format]
    kv, scale = _expect_pair(kv_data[kv_format], f"kv_data[{kv_format!r}]", kv_name, scale_name)
    width = QK_HEAD_DIM if kv_format == "fp8" else QK_HEAD_DIM // 2
    dtypes = FP8_DTYPES if kv_format == "fp8" else FP4X2_DTYPES
    _expect(kv.dim() == 3 and kv.shape[1] == NUM_KV_HEADS and kv.shape[2] == width, f"{kv_name}.shape",
            f"(total_kv, {NUM_KV_HEADS}, {width})", tuple(kv.shape))
    _expect(kv.dtype in dtypes, f"{kv_name}.dtype", f"one of {dtypes}", kv.dtype)
    _expect(kv.is_contiguous(), kv_name, "a contiguous tensor", "a strided view")
    _expect_on_device(kv, kv_name, device)
    _expect_on_device(scale, scale_name, device)
    if kv_format == "fp8":
        _expect(scale.dtype == torch.float32, f"{scale_name}.dtype", "torch.float32", scale.dtype)
        _expect(scale.numel() == 1, f"{scale_name}.shape", "(1,)", tuple(scale.shape))
    else:
        _expect(scale.dtype in E8M0_DTYPES, f"{scale_name}.dtype", f"one of {E8M0_DTYPES}", scale.dtype)
        _expect(scale.dim() == 2 and scale.shape[0] >= kv.shape[0] and scale.shape[1] >= MXFP4_BLOCKS_PER_ROW,
                f"{scale_name}.shape", f"(>= {kv.shape[0]}, >= {MXFP4_BLOCKS_PER_ROW}) E8M0 block scales",
                tuple(scale.shape))
        _expect(scale.stride(1) == 1, scale_name, "unit stride along blocks", scale.stride())
    return kv, scale


def validate(data, kv_format: str) -> tuple:
    """Checks everything that can be checked without a device sync; returns
    (q, kv, kv_scale, qo_indptr, kv_indptr, config) for the chosen KV format."""
    if not (isinstance(data, (tuple, list)) and len(data) == 5):
        raise TypeError("data: expected (q, kv_data, qo_indptr, kv_indptr, config)")
    q, kv_data, qo_indptr, kv_indptr, config = data
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
# Bounded caches: every cache of this module is a dict of plans keyed by named facts, kept to a limit by _remember
# ---------------------------------------------------------------------------------------------------------

DISPATCH_LIMIT = 256  # kinds of call (dispatch); the leaderboard makes 8 or so
AITER_PLAN_LIMIT = 64  # aiter plans; the leaderboard uses a handful of shapes
LAUNCH_CACHE_LIMIT = 64  # Triton launch plans; the leaderboard uses 8 shapes


def _remember(cache: dict, key, value, limit: int):
    """cache[key] = value, after evicting the oldest entries (a dict keeps insertion order) until fewer than `limit`
    remain; returns value."""
    while cache and len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


# ---------------------------------------------------------------------------------------------------------
# Backend selection: one place, env override, fails loudly when a forced backend is unavailable
# ---------------------------------------------------------------------------------------------------------


_ANNOUNCED: set = set()  # (device, MLA_BACKEND, choice, KV format, precise) already logged


@functools.cache
def _env_keys(names: tuple[str, ...]) -> tuple:
    return tuple(map(os.environ.encodekey, names))


def _env_values(names: tuple[str, ...]) -> tuple:
    """os.environ's values of `names`, as it stores them (bytes on POSIX), None where unset. os.environ.get costs ~1.5
    us for an unset name (Mapping.get raises and catches a KeyError inside os.environ's __getitem__) and a call reads
    several, while CPython's os.environ keeps its values in a dict, _data, under encoded keys, which this reads in
    ~0.1 us a name: the same values, since os.environ's own methods write that dict."""
    environ = os.environ
    try:
        return tuple(map(environ._data.get, _env_keys(names)))
    except AttributeError:  # not CPython's os._Environ: no such dict
        return tuple(map(environ.get, names))


def _env(name: str) -> str | None:
    """os.environ.get(name), at the cost of _env_values."""
    (value,) = _env_values((name,))
    return value if value is None or isinstance(value, str) else os.environ.decodevalue(value)


def _setting(name: str, default: str) -> str:
    value = _env(name)
    return default if value is None else value


@functools.cache
def _aiter_importable() -> bool:  # cached: a failed import searches sys.path again on every call (~40 us)
    try:
        import aiter  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_usable(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or _env("TRITON_INTERPRET") == "1")


def _aiter_unusable_reason(device: torch.device, kv_format: str, precise: bool) -> str | None:
    """None when the aiter backend takes this call (aiter importable, the FP8 cache, the fast mode), else why not;
    its signatures are checked at the first call (_aiter_api)."""
    if not _aiter_importable():
        return "the aiter package (ROCm/aiter, built from source) is not importable"
    if precise:
        return "aiter's kernels take FP8 Q (no precise mode); use MLA_PRECISION=fast"
    if kv_format != "fp8":
        return f"aiter reads the FP8 cache only, not {kv_format} (the triton backend reads MXFP4)"
    return None


def _triton_unusable_reason(device: torch.device, kv_format: str, precise: bool) -> str | None:
    if triton is None:
        return f"triton does not import: {TRITON_IMPORT_ERROR!r}"
    if not _triton_usable(device):
        return f"needs a GPU (or TRITON_INTERPRET=1); device is {device}"
    return None


@functools.cache
def _cuda_auto_usable(device: torch.device, kv_format: str, precise: bool) -> bool:
    """For auto: the cuda backend where it builds and reads `kv_format` in that precision; where it does not (the
    mla_decode_cuda package not installed, no nvcc, an nvcc too old for this GPU), the triton backend, with the reason
    logged as a warning (once per format and precision). MLA_BACKEND=cuda raises the reason instead. Cached: called on
    every decode."""
    reason = cuda_unusable_reason(device)
    if reason is not None and device.type == "cuda" and torch.version.hip is None:
        log.warning("MLA decode: using the triton backend, not cuda: %s", reason)
    return reason is None and cuda_unusable_reason(device, kv_format, precise) is None


CUDA_PACKAGE_MISSING = ("cuda backend: the mla_decode_cuda package is not installed: install the repo "
                        "(pip install -e .) for the CUDA kernels")


@functools.cache
def _cuda_package():
    """(the mla_decode_cuda module, None), or (None, why it cannot be imported): the cuda backend lives in that
    package of this repo, imported the first time the backend is considered. A copy of this file alone (the
    leaderboard's upload) has no such package: NVIDIA GPUs then get the triton backend."""
    try:
        import mla_decode_cuda
    except ImportError as e:
        if e.name == "mla_decode_cuda":
            return None, CUDA_PACKAGE_MISSING
        return None, f"cuda backend: the mla_decode_cuda package failed to import: {e}"
    return mla_decode_cuda, None


def cuda_unusable_reason(device: torch.device, kv_format: str = "fp8", precise: bool = False) -> str | None:
    """None when the cuda backend reads `kv_format` on `device` in that precision (mla_decode_cuda.unusable_reason:
    an NVIDIA GPU of capability >= 8.0 whose kernels build with the machine's nvcc; MXFP4 only on Hopper and not in
    the precise mode), else why not (the package's absence included)."""
    package, missing = _cuda_package()
    return missing if package is None else package.unusable_reason(device, kv_format, precise)


def _cuda_unusable_for_auto(device: torch.device, kv_format: str, precise: bool) -> str | None:
    return None if _cuda_auto_usable(device, kv_format, precise) else cuda_unusable_reason(device, kv_format, precise)


class BackendChoice(NamedTuple):
    """One backend as select_backend weighs it."""

    name: str
    unusable_reason: object  # (device, kv_format, precise) -> None when it runs this call there, else why not
    auto_on: object  # device -> whether auto considers it on that device
    forced_reason: object = None  # unusable_reason for MLA_BACKEND=name, where it differs (cuda: not cached)


def _on_rocm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None


def _on_nvidia(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


# auto's order of preference: the first that auto considers on the device and that can run the call wins.
BACKEND_PREFERENCE = (
    BackendChoice("aiter", _aiter_unusable_reason, _on_rocm),
    BackendChoice("cuda", _cuda_unusable_for_auto, _on_nvidia, cuda_unusable_reason),
    BackendChoice("triton", _triton_unusable_reason, lambda device: device.type == "cuda"),
    BackendChoice("torch", lambda device, kv_format, precise: None, lambda device: True),
)


def select_backend(device: torch.device, kv_format: str | None = None, precision: str | None = None) -> str:
    """MLA_BACKEND if set (and able to run `kv_format` in `precision` here: else a RuntimeError saying why), else the
    first of BACKEND_PREFERENCE that auto considers on `device` and that can (kv_format default: select_kv_format();
    precision default: select_precision()); the choice and the reasons the ones before it were passed over are logged
    once."""
    kv_format = kv_format or select_kv_format()
    forced = _setting("MLA_BACKEND", DEFAULT_BACKEND)
    if forced not in BACKEND_CHOICES:
        source = "MLA_BACKEND" if "MLA_BACKEND" in os.environ else "DEFAULT_BACKEND"
        raise ValueError(f"{source}: expected one of {BACKEND_CHOICES}, got {forced!r}")
    precise = (precision or select_precision()) == "precise"
    passed_over = []
    for backend in BACKEND_PREFERENCE:
        if forced == backend.name:
            reason = (backend.forced_reason or backend.unusable_reason)(device, kv_format, precise)
            if reason is not None:
                raise RuntimeError(f"MLA_BACKEND={forced}: {reason}")
            choice = forced
            break
        if forced == "auto" and backend.auto_on(device):
            reason = backend.unusable_reason(device, kv_format, precise)
            if reason is None:
                choice = backend.name
                break
            passed_over.append(f"{backend.name}: {reason}")
    if (device, forced, choice, kv_format, precise) not in _ANNOUNCED:
        _ANNOUNCED.add((device, forced, choice, kv_format, precise))
        log.info("MLA decode on %s: %s backend (MLA_BACKEND=%s, %s KV, %s)%s", device, choice, forced, kv_format,
                 "precise" if precise else "fast", "; passed over: " + "; ".join(passed_over) if passed_over else "")
    return choice


def select_kv_format() -> str:
    fmt = _setting("MLA_KV_FORMAT", DEFAULT_KV_FORMAT)
    if fmt not in KV_FORMATS:  # not _expect: its message would be formatted on every call
        source = "MLA_KV_FORMAT" if "MLA_KV_FORMAT" in os.environ else "DEFAULT_KV_FORMAT"
        raise ValueError(f"{source}: expected one of {KV_FORMATS}, got {fmt!r}")
    return fmt


def select_precision() -> str:
    """MLA_PRECISION if set, else DEFAULT_PRECISION. "fast": the FP8 cache's score product is an fp8 x fp8 MMA (Q
    rounded to e4m3 per head); Hopper's FP8 MMA keeps ~14 bits of a sum of products, so a large common logit
    offset (a product far above the rest) costs accuracy. "precise": that product in fp16 (exact e4m3 -> fp16 K,
    Q scaled exactly by a power of two) with fp32 accumulation, at some speed: the triton backend's fp16 dot,
    the cuda backend's mma.sync kernel; the torch backend is fp32 either way; aiter has no such kernel."""
    precision = _setting("MLA_PRECISION", DEFAULT_PRECISION)
    if precision not in PRECISIONS:
        source = "MLA_PRECISION" if "MLA_PRECISION" in os.environ else "DEFAULT_PRECISION"
        raise ValueError(f"{source}: expected one of {PRECISIONS}, got {precision!r}")
    return precision


# ---------------------------------------------------------------------------------------------------------
# Triton targets: what the Triton kernels (the triton backend's, the aiter path's Q quantizer) depend on per device
# ---------------------------------------------------------------------------------------------------------


class TritonTarget(NamedTuple):
    """What the triton backend's plans and launch options depend on besides the input, read once per device
    (triton_target)."""

    vendor: str  # "nvidia", "amd", or "interpreter" (TRITON_INTERPRET=1 on the CPU)
    arch: str  # "sm_90", "gfx950", "gfx942", ...; "cpu" under the interpreter
    num_sms: int  # SMs (NVIDIA) or CUs (AMD) that the split count fills
    shared_bytes: int  # shared memory (LDS on AMD) one program may use


# LDS per CU by AMD architecture (the CDNA3 and CDNA4 ISA guides); an architecture not listed is assumed to have the
# smallest. torch's device properties on ROCm do not report the LDS size.
AMD_LDS_BYTES = {"gfx950": 160 * 1024, "gfx942": 64 * 1024, "gfx941": 64 * 1024, "gfx940": 64 * 1024,
                 "gfx90a": 64 * 1024}
# Programs of the split kernel resident per SM or CU, which the split count aims to fill. NVIDIA: 2 fit an H200 SM
# (~255 registers x 128 threads, ~90-110 KB of shared memory; triton_plan's measurements). AMD: the waves per SIMD
# of the offline compile with the runner's Triton 3.6.0 (tools/amd_check.py: gfx950 FP8 2, gfx942 1), a 4-warp
# program being one wave on each of a CU's 4 SIMDs.
PROGRAMS_PER_SM = {"gfx950": 2, "gfx942": 1}
# AMD architectures whose MFMAs take E2M1 operands with E8M0 block scales (CDNA4), on which the MXFP4 score product
# is tl.dot_scaled on the codes as they lie (tools/amd_check.py: v_mfma_scale_f32_16x16x128_f8f6f4); elsewhere Triton
# would emulate it, and the dequantizing kernel stays.
SCALED_MFMA_ARCHS = ("gfx950",)
NVIDIA_PROGRAMS_PER_SM = 2
INTERPRETER_TARGET = TritonTarget("interpreter", "cpu", 132, 228 * 1024)  # plans as on an H200


def amd_triton_target(arch: str, num_cus: int) -> TritonTarget:
    """An AMD GPU's target from its architecture ("gfx950") and CU count (tools/amd_check.py builds them so)."""
    return TritonTarget("amd", arch, num_cus, AMD_LDS_BYTES.get(arch, 64 * 1024))


@functools.cache
def triton_target(device: torch.device) -> TritonTarget:
    if device.type != "cuda":
        return INTERPRETER_TARGET
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return amd_triton_target(props.gcnArchName.split(":")[0], props.multi_processor_count)  # "gfx950:sramecc+"
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return TritonTarget("nvidia", f"sm_{props.major}{props.minor}", props.multi_processor_count, shared)


def triton_launch_options(target: TritonTarget, num_warps: int, num_stages: int | None = None,
                          pdl: bool = False) -> dict:
    """The launch options Triton's JIT takes on `target`: AMD's backend refuses NVIDIA's launch_pdl (a KeyError when
    the arguments are packed), so it is named only on NVIDIA."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if target.vendor == "nvidia":
        options["launch_pdl"] = pdl
    return options


if triton is not None:

    @triton.jit
    def _round_to_e4m3(x):
        """fp32 x (|x| <= 448) rounded to the nearest E4M3 value, ties to even, still fp32: its cast to fp8 is then
        exact. Only for Triton's interpreter (ROUND_FP8), whose fp32 -> fp8 cast loses the carry of a mantissa that
        rounds up into the exponent in half the binades (126.2 -> 64, not 128) and rounds ties up; compiled
        kernels cast with the hardware's round-to-nearest-even."""
        bits = x.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6
        ulp = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): three mantissa bits
        magnitude = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23 rounds to an integer
        return (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # sign


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
# The other call forms of the variants below, checked the same way when a plan first needs one (see
# _aiter_call_form): mla_decode_fwd non-persistent (one split per sequence, no work buffers), and stage 1 and the
# reduce called directly, every argument by position as aiter/mla.py calls them at the runner's commit.
_AITER_SINGLE_ARGS = (
    _AITER_DECODE_ARGS[0],
    ("page_size", "nhead_kv", "sm_scale", "num_kv_splits", "num_kv_splits_indptr", "q_scale", "kv_scale",
     "intra_batch_mode"))
_AITER_STAGE1_ARGS = (
    ("Q", "KV", "qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_lens", "num_kv_splits_indptr",
     "work_meta_data", "work_indptr", "work_info_set", "max_seqlen_q", "page_size", "nhead_kv", "softmax_scale",
     "splitData", "splitLse", "output", "q_scale", "kv_scale"), ())
_AITER_REDUCE_ARGS = (
    ("partial_output", "partial_lse", "reduce_indptr", "reduce_final_map", "reduce_partial_map", "max_seqlen_q",
     "final_output", "final_lse"), ())
AITER_VERSION_NEEDED = ("ROCm/aiter main from 2026-02-02 (commit 739c63177e) or newer, built from source (the "
                        "leaderboard's runner pins f3be04a12a, 2026-03-04); the PyPI wheel amd-aiter 0.1.7.post2.dev18 "
                        "(2025-11) is too old, and so is main between 2026-07-13 (fede90f463) and 2026-07-14 "
                        "(028756633e)")
AITER_KV_GRANULARITY = 16  # KV pages (= tokens at page size 1) per unit of the work split, as the reference uses

# (mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1) -> the problems found in their signatures
# (empty: this call fits). Keyed on the function objects, so an aiter replaced in-process is inspected again.
_AITER_VERDICTS: dict[tuple, tuple[str, ...]] = {}
_AITER_PLANS: dict["AiterKey", "_AiterPlan"] = {}


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


class AiterVariant(NamedTuple):
    """One way to run the aiter path. Every variant reads every KV row at page size 1, scales Q dynamically where
    it is FP8, and computes the same attention; they differ in kernels, launches and host work.

      q:         "fp8": Q quantized per tensor on the device (QQuantizer: 2 launches), the a8w8 kernels;
                 "bf16": Q passed as given to the a16w8 persistent kernel, mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps
                 (a 4-row Q tile: the C++ pads max_seqlen_q 1 to 4 to pick it; Q itself is not padded, as in
                 aiter's own op_tests/test_mla_persistent.py, which runs it with (batch, 16, 576) Q at qlen 1)
      call:      "decode_fwd": aiter.mla.mla_decode_fwd, persistent: stage 1 + mla_reduce_v1 (2 launches); aiter
                 allocates the fp32 partials (up to 16.7 MB) on every call;
                 "direct": aiter.mla_decode_stage1_asm_fwd + aiter.mla_reduce_v1 called here (2 launches) with
                 the partials allocated once per plan; an aiter whose signatures do not take the runner's call
                 (NEWEST: stage 1 gained `lse`, the reduce `num_kv_splits`) runs "decode_fwd" instead, warned once;
                 "single": mla_decode_fwd non-persistent with one split per sequence (num_kv_splits=1): with FP8 Q
                 it returns after stage 1, mla_a8w8_qh16_qseqlen1_gqaratio16, which writes o (1 launch; NEWEST
                 adds a fill of its split counts); one workgroup per sequence, so few workgroups at small batch.
                 FP8 Q only: there is no non-persistent a16w8 kernel.
      fast_mode: get_mla_metadata_v1's fast_mode for the persistent calls (True: the v1.2 split, today's; False:
                 v1.1, with work and partial buffers of batch x CUs rows: fp32 partials of 2.1 GB at batch 256 on
                 an MI355X, held by a "direct" plan, allocated per call by mla_decode_fwd); None for "single".
    """

    q: str
    call: str
    fast_mode: bool | None

    @property
    def launches(self) -> int:
        """Kernels per call on the runner's aiter, for a plan whose lengths are proven (every leaderboard input)."""
        return (2 if self.q == "fp8" else 0) + (1 if self.call == "single" else 2)


# name -> variant; launches per call (AiterVariant.launches) in the comments
AITER_VARIANT_SPECS = {
    "fp8_ps": AiterVariant("fp8", "decode_fwd", True),  # 4: today's path
    "fp8_ps_nofast": AiterVariant("fp8", "decode_fwd", False),  # 4
    "fp8_direct": AiterVariant("fp8", "direct", True),  # 4, no per-call allocation of the partials
    "fp8_direct_nofast": AiterVariant("fp8", "direct", False),  # 4
    "fp8_nps": AiterVariant("fp8", "single", None),  # 3
    "a16w8_ps": AiterVariant("bf16", "decode_fwd", True),  # 2: no Q quantization
    "a16w8_ps_nofast": AiterVariant("bf16", "decode_fwd", False),  # 2
    "a16w8_direct": AiterVariant("bf16", "direct", True),  # 2
    "a16w8_direct_nofast": AiterVariant("bf16", "direct", False),  # 2
}
AITER_DEFAULT_VARIANT = "fp8_ps"  # shapes not in AITER_VARIANTS (a batch of other lengths, kv_seq_len None)
# In AITER_VARIANTS, a shape that auto runs on the triton backend instead of aiter (where a measurement says it wins);
# a forced MLA_BACKEND=aiter runs AITER_DEFAULT_VARIANT there.
ROCM_TRITON = "triton"
_NOT_MEASURED = "default: today's path; no MI355X measurement of the variants exists (bench/aiter_sweep.py makes one)"
# The choice per leaderboard shape on ROCm, (batch, kv_seq_len) -> (variant or ROCM_TRITON, where the choice came
# from). Edit it before submitting (bench/aiter_sweep.py prints a replacement); MLA_AITER_VARIANT=<name> overrides it
# for local runs.
AITER_VARIANTS = {
    (4, 1024): ("fp8_ps", _NOT_MEASURED),
    (4, 8192): ("fp8_ps", _NOT_MEASURED),
    (32, 1024): ("fp8_ps", _NOT_MEASURED),
    (32, 8192): ("fp8_ps", _NOT_MEASURED),
    (64, 1024): ("fp8_ps", _NOT_MEASURED),
    (64, 8192): ("fp8_ps", _NOT_MEASURED),
    (256, 1024): ("fp8_ps", _NOT_MEASURED),
    (256, 8192): ("fp8_ps", _NOT_MEASURED),
}


def aiter_variant(batch: int, kv_seq_len: int | None) -> str:
    """The variant for this shape (or ROCM_TRITON): MLA_AITER_VARIANT if set, else AITER_VARIANTS[(batch,
    kv_seq_len)], else AITER_DEFAULT_VARIANT. Any other name is an error naming where it came from."""
    forced = _env("MLA_AITER_VARIANT")
    if forced:
        field, name = "MLA_AITER_VARIANT", forced
    else:
        field, (name, *_) = f"AITER_VARIANTS[{(batch, kv_seq_len)}]", AITER_VARIANTS.get(
            (batch, kv_seq_len), (AITER_DEFAULT_VARIANT,))
    if name not in AITER_VARIANT_SPECS and name != ROCM_TRITON:
        raise ValueError(f"{field}: expected one of {tuple(AITER_VARIANT_SPECS) + (ROCM_TRITON,)}, got {name!r}")
    return name


def _aiter_call_form(fns: tuple, call: str) -> tuple | None:
    """The aiter functions call form `call` uses, or None where the installed aiter's signatures do not take it
    (the problems logged once per set of functions; the plan then runs "decode_fwd", which _aiter_api checked)."""
    import aiter

    if call == "decode_fwd":
        return fns[:1]
    if call == "single":
        targets = ((fns[0], "aiter.mla.mla_decode_fwd", _AITER_SINGLE_ARGS),)
    else:
        targets = ((getattr(aiter, "mla_decode_stage1_asm_fwd", None), "aiter.mla_decode_stage1_asm_fwd",
                    _AITER_STAGE1_ARGS),
                   (getattr(aiter, "mla_reduce_v1", None), "aiter.mla_reduce_v1", _AITER_REDUCE_ARGS))
    key = (call,) + tuple(fn for fn, _, _ in targets)
    problems = _AITER_VERDICTS.get(key)
    if problems is None:
        problems = _AITER_VERDICTS[key] = tuple(
            problem for fn, name, args in targets
            for problem in (_aiter_signature_problems(fn, name, args) if fn is not None else [f"no {name}"]))
        if problems:
            log.warning("MLA decode: the installed aiter cannot take the %r call form (%s); running "
                        "mla_decode_fwd persistent instead", call, "; ".join(problems))
    return None if problems else tuple(fn for fn, _, _ in targets)


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
                           BLOCK: tl.constexpr, PARTIALS: tl.constexpr, ROUND_FP8: tl.constexpr):
        parts = tl.load(partial_ptr + tl.arange(0, PARTIALS), mask=tl.arange(0, PARTIALS) < num_partials, other=0.0)
        scale = tl.math.div_rn(tl.maximum(tl.max(parts, axis=0), 1e-12), fp8_max)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.math.div_rn(tl.load(q_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), scale)
        if ROUND_FP8:  # |x| <= 448 (1 + 2^-23), which rounds to 448
            x = _round_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
        q8 = x.to(q8_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q8_ptr + offs, q8, mask=offs < n)


class QQuantizer:
    """q (batch, 16, 576) bf16, contiguous -> self.q_fp8 (same shape, `fp8`) and self.scale (1,) float32, on the
    device, into buffers allocated once: q ~= q_fp8 * scale. Calls must be issued in order on one queue. The Triton form
    where it can run (allow_triton=False: the torch form; self.blocks == 0 tells which). `target`: the Triton target the
    kernels are built for (default: triton_target(device) where Triton runs; tools/amd_check.py names an AMD one)."""

    def __init__(self, batch: int, fp8: torch.dtype, device: torch.device, allow_triton: bool = True,
                 target: TritonTarget | None = None):
        self.q_fp8 = torch.empty((batch, NUM_HEADS, QK_HEAD_DIM), dtype=fp8, device=device)
        self.scale = torch.empty(1, dtype=torch.float32, device=device)
        self.fp8_max = torch.finfo(fp8).max  # 448 for e4m3fn (gfx950), 240 for e4m3fnuz (gfx942)
        if target is None and _triton_usable(device):
            target = triton_target(device)
        # The triton kernels for e4m3fn (gfx950) only: e4m3fnuz (gfx942) casts are neither in Triton's interpreter
        # nor on NVIDIA GPUs, so nothing here could test them.
        triton_ok = allow_triton and fp8 == torch.float8_e4m3fn and target is not None
        self.blocks = triton.cdiv(self.q_fp8.numel(), Q_QUANT_BLOCK) if triton_ok else 0
        if self.blocks:
            self.partials = torch.empty(self.blocks, dtype=torch.float32, device=device)
            # BLOCK, PARTIALS, ROUND_FP8 (the interpreter's fp8 cast needs help, see _round_to_e4m3)
            self.consts = (Q_QUANT_BLOCK, triton.next_power_of_2(self.blocks), target.vendor == "interpreter")
            self.addresses = (self.partials.data_ptr(), self.q_fp8.data_ptr(), self.scale.data_ptr())
            self.launchers = None  # the compiled kernels' launchers for a 16-byte aligned q (not under the interpreter)
        else:
            self._use_torch()

    def _launch_jit(self, q: torch.Tensor, aligned: bool) -> None:
        """The two kernels through Triton's JIT (compiled at the first call); for an aligned q on a GPU, their
        compiled kernels' launchers are kept, to be called with addresses: the JIT's dispatch, and its launcher's
        data_ptr() call and pointer query per tensor, cost host time on every call."""
        n, grid = self.q_fp8.numel(), (self.blocks, 1, 1)  # compiled kernels take the grid as a 3-tuple
        absmax = _q_absmax_kernel[grid](q, self.partials, n, BLOCK=self.consts[0])
        quantize = _q_quantize_kernel[grid](q, self.partials, self.blocks, self.q_fp8, self.scale, n, self.fp8_max,
                                            BLOCK=self.consts[0], PARTIALS=self.consts[1], ROUND_FP8=self.consts[2])
        if aligned and absmax is not None and quantize is not None:
            self.launchers = (absmax[grid], quantize[grid])

    @property
    def launches(self) -> int:
        """Kernels per call: the triton form's two, or the torch form's three."""
        return 2 if self.blocks else 3

    def _use_torch(self) -> None:
        device = self.q_fp8.device
        self.blocks = 0
        self.amax = torch.empty((), dtype=torch.float32, device=device)
        self.fp8_max_t = torch.full((1,), self.fp8_max, dtype=torch.float32, device=device)
        self.scale_floor = torch.full((1,), 1e-12, dtype=torch.float32, device=device) / self.fp8_max_t

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if self.blocks:
            q_ptr = q.data_ptr()
            try:
                if self.launchers is not None and q_ptr % 16 == 0:  # what the compiled kernels were specialized on
                    absmax, quantize = self.launchers
                    partials, q_fp8, scale = self.addresses
                    n = self.q_fp8.numel()
                    absmax(q_ptr, partials, n, self.consts[0])
                    quantize(q_ptr, partials, self.blocks, q_fp8, scale, n, self.fp8_max, *self.consts)
                else:
                    self._launch_jit(q, q_ptr % 16 == 0)
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
    """What one shape of call needs besides its inputs, allocated once, for one variant (AITER_VARIANT_SPECS).
    The six metadata buffers (persistent calls) live and die together here: work_metadata_ptrs holds the raw
    device addresses of work_indptr and work_info_set."""

    __slots__ = ("variant", "call", "fns", "q_dtype", "fast_mode", "refill", "filled", "metadata", "decode_kwargs",
                 "partials", "kv_indices", "kv_last_page_lens", "q_quant", "kv_lens", "empty_rows", "kv_indptr_safe",
                 "cummax_index", "indptr_changed", "invalid")

    def __init__(self, fns: tuple, fp8: torch.dtype, variant: str, batch: int, total_kv: int, device: torch.device,
                 uniform_len: int | None):
        spec = AITER_VARIANT_SPECS[variant]
        self.variant = variant
        form = _aiter_call_form(fns, spec.call)  # the functions the call form uses, or None: it does not fit
        self.call, self.fns = (spec.call, form) if form is not None else ("decode_fwd", fns[:1])
        self.q_dtype = fp8 if spec.q == "fp8" else torch.bfloat16
        self.q_quant = QQuantizer(batch, fp8, device) if spec.q == "fp8" else None
        self.fast_mode = spec.fast_mode is not False
        self.metadata = self.partials = None
        if self.call == "single":  # one split per sequence
            self.decode_kwargs = {"num_kv_splits": 1, "num_kv_splits_indptr": torch.arange(
                batch + 1, dtype=torch.int32, device=device)}
        else:
            info = fns[1](batch, 1, NUM_HEADS, self.q_dtype, fp8, is_sparse=False, fast_mode=self.fast_mode,
                          intra_batch_mode=False)
            if len(info) != 6:
                raise RuntimeError(f"aiter.get_mla_metadata_info_v1 returned {len(info)} buffer specs, expected 6")
            # (work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map)
            self.metadata = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info)
            self.decode_kwargs = dict(zip(("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                                           "reduce_final_map", "reduce_partial_map"), self.metadata, strict=True))
        if self.call == "direct":  # stage 1's fp32 partial outputs and LSEs, one row per reduce_partial_map slot
            slots = self.metadata[5].shape[0]
            self.partials = (torch.empty((slots, 1, NUM_HEADS, V_HEAD_DIM), dtype=torch.float32, device=device),
                             torch.empty((slots, 1, NUM_HEADS, 1), dtype=torch.float32, device=device))
        # True: the lengths are not proven by the key, run get_mla_metadata_v1 on every call
        self.refill = refill = uniform_len is None
        self.filled = False
        # Page size 1: page b of the cache is token b; the persistent kernels never read the last-page lengths, the
        # non-persistent one does: ones are the honest value.
        self.kv_indices = torch.arange(total_kv, dtype=torch.int32, device=device)  # (total_kv,)
        self.kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)  # (batch,)
        self.kv_lens = torch.empty(batch, dtype=torch.int32, device=device) if refill else None
        self.empty_rows = torch.empty(batch, dtype=torch.bool, device=device) if refill else None
        # The kv_indptr aiter sees: for a uniform plan the one its key proves, arange(batch + 1) * L, so the plan never
        # depends on a caller's data; otherwise the caller's, clamped into [0, total_kv] and made non-decreasing.
        self.kv_indptr_safe = torch.arange(batch + 1, dtype=torch.int32, device=device) * (uniform_len or 0)
        self.cummax_index = torch.empty(batch + 1, dtype=torch.int64, device=device) if refill else None
        self.indptr_changed = torch.empty(batch + 1, dtype=torch.bool, device=device) if refill else None
        self.invalid = torch.zeros((), dtype=torch.bool, device=device) if refill else None


class AiterKey(NamedTuple):
    """The whole key of an aiter plan (_aiter_plan_key says when a plan may be reused)."""

    fns: tuple  # (mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1) of the aiter checked (_aiter_api)
    fp8: torch.dtype  # aiter.dtypes.fp8
    device: torch.device
    q_shape: tuple
    q_dtype: torch.dtype
    kv_shape: tuple
    kv_dtype: torch.dtype
    variant: str  # a name of AITER_VARIANT_SPECS
    uniform_len: int | None  # every sequence's length, proven by the shapes (see _aiter_plan_key); None: read on
    # the device at every call

    @property
    def batch(self) -> int:
        return self.q_shape[0]

    @property
    def total_kv(self) -> int:
        return self.kv_shape[0]


def _aiter_plan_key(fns: tuple, fp8: torch.dtype, q: torch.Tensor, kv: torch.Tensor, config: dict,
                    variant: str | None = None) -> AiterKey:
    """The whole key of a plan: the aiter functions, the device, every shape and dtype the plan depends on, the
    variant (default aiter_variant's; its ROCM_TRITON means AITER_DEFAULT_VARIANT here) and the sequence-length facts.

    The rule. A plan's metadata (the work split) is computed by get_mla_metadata_v1 from the sequence lengths in
    kv_indptr. It may be reused WITHOUT reading kv_indptr only when the key proves the lengths are those it was built
    from: config["kv_seq_len"] = L is by contract every sequence's length in a uniform batch, else None or the
    maximum; the sequences tile the cache (kv_indptr[-1] == total_kv, as in every input the leaderboard and
    reference.py generate); so batch * L == total_kv (L > 0) forces every length to equal L, and (batch, total_kv, L)
    determines the metadata. Any other batch (L None, or batch * L != total_kv) gets a plan keyed "lengths read on
    device" (uniform_len None) whose metadata get_mla_metadata_v1 refills from the current kv_indptr on every call, on
    the device, with no host sync. So two batches with the same batch and total_kv but different lengths never share
    metadata: at most one of them is uniform, and a non-uniform one is always refilled.
    """
    batch, total_kv, kv_seq_len = q.shape[0], kv.shape[0], config["kv_seq_len"]
    uniform = kv_seq_len is not None and kv_seq_len > 0 and batch * kv_seq_len == total_kv
    variant = variant or aiter_variant(batch, kv_seq_len)
    return AiterKey(fns, fp8, q.device, tuple(q.shape), q.dtype, tuple(kv.shape), kv.dtype,
                    AITER_DEFAULT_VARIANT if variant == ROCM_TRITON else variant, kv_seq_len if uniform else None)


def _aiter_plan(key: AiterKey) -> _AiterPlan:
    plan = _AITER_PLANS.get(key)
    if plan is None:
        plan = _remember(_AITER_PLANS, key, _AiterPlan(key.fns, key.fp8, key.variant, key.batch, key.total_kv,
                                                       key.device, uniform_len=key.uniform_len), AITER_PLAN_LIMIT)
    return plan


def _aiter_safe_indptr(plan: _AiterPlan, kv_indptr: torch.Tensor, total_kv: int) -> None:
    """aiter trusts kv_indptr: a range past total_kv or a decreasing one would send its kernel outside kv_indices. A
    uniform plan uses the kv_indptr its key proves (set at creation). A refilled one gets the caller's clamped into
    [0, total_kv] and made non-decreasing on the device (equal to it whenever it is valid), and plan.invalid records
    on the device whether they differ: the whole output is then NaN (one invalid range can move the others), never
    garbage and never a read outside the cache."""
    torch.clamp(kv_indptr, 0, total_kv, out=plan.kv_indptr_safe)
    torch.cummax(plan.kv_indptr_safe, 0, out=(plan.kv_indptr_safe, plan.cummax_index))
    torch.ne(kv_indptr, plan.kv_indptr_safe, out=plan.indptr_changed)
    torch.any(plan.indptr_changed, out=plan.invalid)


def _aiter_fill_metadata(metadata_fn, plan: _AiterPlan, qo_indptr: torch.Tensor, fp8: torch.dtype) -> None:
    """get_mla_metadata_v1 reads the lengths from plan.kv_indptr_safe on the device and writes the six buffers in
    place (the plan's fast_mode: True the v1.2 persistent split, False v1.1); kv_indptr counts pages, which are
    tokens at page size 1."""
    work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map = plan.metadata
    metadata_fn(qo_indptr, plan.kv_indptr_safe, plan.kv_last_page_lens, NUM_HEADS // NUM_KV_HEADS, NUM_KV_HEADS, True,
                work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
                page_size=1, kv_granularity=AITER_KV_GRANULARITY, max_seqlen_qo=1, uni_seqlen_qo=1,
                fast_mode=plan.fast_mode, max_split_per_batch=-1, intra_batch_mode=False, dtype_q=plan.q_dtype,
                dtype_kv=fp8)
    plan.filled = True


def _aiter_key(q, kv, config, variant: str | None = None) -> AiterKey:
    """The plan key of these validated inputs, after the installed aiter's check (_aiter_api) and the cache's dtype
    against its FP8."""
    fns, fp8 = _aiter_api()
    if kv.dtype != fp8:
        _expect(False, "kv_data['fp8'][0].dtype", f"aiter.dtypes.fp8 = {fp8} (this GPU's FP8)", kv.dtype)
    return _aiter_plan_key(fns, fp8, q, kv, config, variant)


def _aiter_forward(q, kv, scale, qo_indptr, kv_indptr, config, key: AiterKey | None = None) -> torch.Tensor:
    """Q x FP8 KV through aiter's MLA decode, by the variant aiter_variant picks for the shape (AITER_VARIANT_SPECS
    says what each launches; today's, "fp8_ps", is FP8 Q into one persistent aiter.mla.mla_decode_fwd call).

    Inputs (validated by the dispatcher, all on one device, any device: the real aiter refuses a non-ROCm one, a
    stand-in in the tests does not):
      q:         (batch, 16, 576) bfloat16, contiguous (q_seq_len = 1)
      kv:        (total_kv, 1, 576) FP8, contiguous; must be aiter.dtypes.fp8 (e4m3fn on gfx950, e4m3fnuz on gfx942)
      scale:     (1,) float32; the cache holds kv * scale
      qo_indptr: (batch + 1,) int32 = [0, 1, ..., batch]; kv_indptr: (batch + 1,) int32, token offsets
      config:    sm_scale (a Python float is passed), kv_seq_len (None, or the length of every sequence / the max)
    Output: o (batch, 16, 512) bfloat16, contiguous, allocated here (the only per-call allocation besides aiter's
    own scratch in mla_decode_fwd); mla_decode_fwd's return value is that scratch, not the result.

    Page size 1, on purpose. The KV is viewed (total_kv, 1, 1, 576) with kv_indptr in tokens, kv_indices =
    arange(total_kv) and kv_last_page_lens = ones. On gfx950 every dispatched MLA decode kernel ignores the page
    size (docs/aiter-contract.md, "Page size 1, on purpose": the disassembled mla_a8w8_qh16_qseqlen1_gqaratio16_ps,
    our kernel, loads log2(page_size) and overwrites it with 0 before its only use, so a KV row is page_id x page
    stride with no in-page term, in every version of that blob from 2025-11 to 2026-08; aiter issues #2996 and
    #3095, sglang PR #25556). With page_size 2 the kernel would attend to the even tokens only, half the cache, and
    the leaderboard's loose check (5% of elements may miss) would still pass it (~4% mismatched at kv 1024; the
    strict gate catches it: tests/test_aiter_backend.py); its apparent speed-up is reading half the data. The extra
    index traffic of page size 1 is 4 B per 576 B token.

    FP8 Q (the "fp8_*" variants). The fp8 x fp8 kernels need both scales as float32 device tensors. Q gets a
    dynamic per-tensor scale, amax / fp8 max computed on the device (no .item(), no host sync), so any finite bf16 q
    quantizes without NaN or saturation (|q| > 448 included). The "a16w8_*" variants pass the bf16 Q as it is.

    Plans. Per shape and variant (see _aiter_plan_key for the reuse rule) the Q quantizer (QQuantizer: the FP8 Q
    and its scale), kv_indices, kv_last_page_lens, the six metadata buffers and, for "direct", the fp32 partials
    are allocated once and kept in _AITER_PLANS; the six buffers stay alive together (work_metadata_ptrs holds raw
    addresses of work_indptr and work_info_set, and the kernel walks the work list through those addresses). Calls
    must run on the device in the order they are issued: the next call reuses the scratch.

    `key`: the plan's key (_aiter_key, made once per kind of input by dispatch); None: made here.
    """
    if key is None:
        key = _aiter_key(q, kv, config)
    batch, total_kv = q.shape[0], kv.shape[0]
    if total_kv == 0:  # no sequence has a KV row
        return torch.zeros((batch, NUM_HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    plan = _aiter_plan(key)
    fns, fp8 = key.fns, key.fp8
    if plan.refill:
        _aiter_safe_indptr(plan, kv_indptr, total_kv)
    if plan.metadata is not None and (plan.refill or not plan.filled):
        _aiter_fill_metadata(fns[2], plan, qo_indptr, fp8)
    if plan.q_quant is None:
        q_in, q_scale = q, None
    else:
        q_in, q_scale = plan.q_quant(q), plan.q_quant.scale  # (batch, 16, 576) fp8, (1,) float32
    o = q.new_empty((batch, NUM_HEADS, V_HEAD_DIM))  # q is bf16
    kv_pages = kv.view(total_kv, 1, NUM_KV_HEADS, QK_HEAD_DIM)
    sm_scale = float(config["sm_scale"])
    if plan.call == "direct":
        stage1, reduce = plan.fns
        work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map = \
            plan.metadata
        stage1(q_in, kv_pages, qo_indptr, plan.kv_indptr_safe, plan.kv_indices, plan.kv_last_page_lens, None,
               work_metadata_ptrs, work_indptr, work_info_set, 1, 1, NUM_KV_HEADS, sm_scale, *plan.partials, o,
               q_scale, scale)
        reduce(*plan.partials, reduce_indptr, reduce_final_map, reduce_partial_map, 1, o, None)
    else:  # mla_decode_fwd: persistent ("decode_fwd") or one split per sequence ("single")
        plan.fns[0](q_in, kv_pages, o, qo_indptr, plan.kv_indptr_safe, plan.kv_indices, plan.kv_last_page_lens, 1,
                    page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=sm_scale, q_scale=q_scale, kv_scale=scale,
                    intra_batch_mode=False, **plan.decode_kwargs)
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
#   fp8:   Q is quantized in-kernel to the cache's FP8 type with one scale per head (fp8 max / max|q_h|, as an
#          IEEE quotient: 448 for e4m3fn, 240 for gfx942's e4m3fnuz), and S^T is an
#          fp8 x fp8 wgmma straight from the shared-memory tile (no conversion, no register operand); the
#          per-tensor KV scale, sm_scale * log2(e) and 1 / (Q scale) are applied once to the fp32 scores.
#          V^T is the same tile, converted fp8 -> fp16 by the hardware cvt. Against fp16 Q (bf16 -> fp16,
#          fp8 -> fp16 KV for both dots) this was 1.3-1.4x faster on the kv-8192 shapes (256x8192: 586 vs 831 us,
#          64x8192: 161 vs 229 us) for an error vs the BF16 truth of rel-L2 0.030-0.044 instead of 0.015-0.031
#          (the strict gate is 0.08): the error of FP8 Q that aiter's path also has.
#   mxfp4: on gfx950 (SCALED_MFMA_ARCHS) S^T is tl.dot_scaled on the tile's E2M1 codes and E8M0 scales as they
#          lie against Q in E4M3 per head (the scaled MFMA; TritonPlan.scaled_scores); V^T as below. Elsewhere:
#          FP8 wgmma cannot take the per-32 block scales, so K is dequantized in registers: E2M1 code m ->
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

if triton is not None:
    # The problem's sizes as the kernels see them (a jit function reads only constexpr globals).
    _HEADS = tl.constexpr(NUM_HEADS)
    _QK_DIM = tl.constexpr(QK_HEAD_DIM)  # a query/key row: 576
    _V_DIM = tl.constexpr(V_HEAD_DIM)  # a value/output row: the first 512
    _ROPE_DIM = tl.constexpr(QK_ROPE_HEAD_DIM)  # the rope dims after them: 64
    _FP4_ROW_BYTES = tl.constexpr(QK_HEAD_DIM // 2)  # an MXFP4 row: two codes a byte, 288
    _MX_BLOCK = tl.constexpr(MXFP4_BLOCK)  # values per E8M0 scale: 32

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
    def _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
                  CACHE: tl.constexpr):
        """Columns COL0:COL0+WIDTH of the MXFP4 rows n0 + arange(BLOCK_N) as they lie: their E2M1 codes, (BLOCK_N,
        WIDTH / 2) bytes, two a byte, and their E8M0 block scales, (BLOCK_N, WIDTH / 32) bytes; rows with row_ok
        False read as code 0, scale 127 (1.0). CACHE: the loads' cache modifier."""
        r = tl.arange(0, row_ok.shape[0])
        codes = tl.load(kv_ptr + tl.cast(n0, tl.int64) * _FP4_ROW_BYTES + COL0 // 2 + r[:, None] * _FP4_ROW_BYTES
                        + tl.arange(0, WIDTH // 2)[None, :], mask=row_ok[:, None], other=0, cache_modifier=CACHE)
        scales = tl.load(kscale_ptr + tl.cast(n0, tl.int64) * kscale_stride + r[:, None] * kscale_stride
                         + (tl.arange(0, WIDTH // _MX_BLOCK) + COL0 // _MX_BLOCK)[None, :], mask=row_ok[:, None],
                         other=127)
        return codes, scales

    @triton.jit
    def _kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
                 TRANS: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
        """Columns COL0:COL0+WIDTH of the KV rows n0 + arange(BLOCK_N), (BLOCK_N, WIDTH), or their transpose when
        TRANS (the V^T operand), in DOT_DTYPE. fp8: the cache's own FP8 tile (itself for the fast score product);
        mxfp4: the values * 2^-6. Rows with row_ok False read as 0."""
        BLOCK_N: tl.constexpr = row_ok.shape[0]
        r = tl.arange(0, BLOCK_N)
        if KV_FORMAT == "fp8":
            c = tl.arange(0, WIDTH)
            x = tl.load(kv_ptr + tl.cast(n0, tl.int64) * _QK_DIM + COL0 + r[:, None] * _QK_DIM + c[None, :],
                        mask=row_ok[:, None], other=0.0)
            if TRANS:  # the same load as the K operand: Triton reads both from one shared-memory tile
                x = tl.trans(x)
            return x.to(DOT_DTYPE)  # fp8 -> fp16 is exact; to the cache's FP8 type (the fast product) no conversion
        else:
            NB: tl.constexpr = WIDTH // _MX_BLOCK
            # another cache modifier keeps the V read apart from the K read (no CSE): see above
            packed, sbytes = _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, COL0, WIDTH,
                                       ".ca" if TRANS else "")
            bscale = tl.exp2(sbytes.to(tl.float32) - 127.0).to(tl.float16)
            if USE_ASM:
                even, odd = tl.inline_asm_elementwise(_MXFP4_PTX, "=r,=r,=r,=r,r", [packed],
                                                      dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            else:
                even = _e2m1_as_fp16(packed & 0xF)
                odd = _e2m1_as_fp16(packed >> 4)
            x = tl.join(even, odd).reshape(BLOCK_N, NB, _MX_BLOCK) * bscale[:, :, None]
            x = x.reshape(BLOCK_N, WIDTH).to(DOT_DTYPE)
            if TRANS:
                x = tl.trans(x)
            return x

    @triton.jit
    def _mx_scores(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, COL0: tl.constexpr, WIDTH: tl.constexpr, q_t,
                   acc):
        """acc + K[:, COL0:COL0+WIDTH] @ q_t, (BLOCK_N, 16) fp32: the MXFP4 rows' E2M1 codes and E8M0 block scales
        as they lie, against q_t (WIDTH, 16) E4M3, by tl.dot_scaled (gfx950: the scaled MFMA); acc None: 0. Rows
        with row_ok False read as 0."""
        codes, scales = _mx_bytes(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, COL0, WIDTH, "")
        return tl.dot_scaled(codes, scales, "e2m1", q_t, None, "e4m3", acc)

    @triton.jit
    def _q_cols(q_ptr, b, q_scale, COL0: tl.constexpr, WIDTH: tl.constexpr, Q_DTYPE: tl.constexpr,
                FP8_MAX: tl.constexpr, ROUND_FP8: tl.constexpr):
        """Q^T rows COL0:COL0+WIDTH of sequence b, (WIDTH, 16), times the per-head q_scale (16,), as Q_DTYPE; FP8_MAX
        > 0: Q_DTYPE is an FP8 type of that largest value, to which the values are clamped."""
        d = COL0 + tl.arange(0, WIDTH)
        x = tl.load(q_ptr + b * (_HEADS * _QK_DIM) + tl.arange(0, _HEADS)[None, :] * _QK_DIM + d[:, None])
        x = x.to(tl.float32) * q_scale[None, :]
        if FP8_MAX > 0:
            x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
            if ROUND_FP8:
                x = _round_to_e4m3(x)
        return x.to(Q_DTYPE)

    @triton.jit
    def _store_chunk(ptr, acc, inv, valid, COL0: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """Writes the (128, 16) O^T chunk acc * inv to ptr[h * 512 + COL0 + d]; NaN where not valid."""
        d = COL0 + tl.arange(0, acc.shape[0])
        o = tl.where(valid, acc * inv[None, :], float("nan"))
        tl.store(ptr + tl.arange(0, _HEADS)[None, :] * _V_DIM + d[:, None], o.to(OUT_DTYPE))

    @triton.jit
    def _mla_split_kernel(q_ptr, kv_ptr, kscale_ptr, kscale_stride, kv_indptr_ptr, out_ptr, part_o_ptr,
                          part_lse_ptr, total_kv, qk_scale, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                          KV_FORMAT: tl.constexpr, PRECISE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                          FP8_MAX: tl.constexpr, USE_ASM: tl.constexpr, ROUND_FP8: tl.constexpr,
                          USE_PDL: tl.constexpr, SCALED_SCORES: tl.constexpr):
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

        heads = tl.arange(0, _HEADS)
        FP8_Q: tl.constexpr = (KV_FORMAT == "fp8" and not PRECISE) or SCALED_SCORES
        q_fp8_max: tl.constexpr = FP8_MAX if FP8_Q else 0.0
        if KV_FORMAT == "fp8" or SCALED_SCORES:  # one Q scale per head; the fp32 scores get qk_scale / q_scale
            q_row = q_ptr + b * (_HEADS * _QK_DIM) + heads[:, None] * _QK_DIM
            q_max = tl.maximum(
                tl.max(tl.abs(tl.load(q_row + tl.arange(0, _V_DIM)[None, :]).to(tl.float32)), 1),
                tl.max(tl.abs(tl.load(q_row + _V_DIM + tl.arange(0, _ROPE_DIM)[None, :]).to(tl.float32)), 1))
            if not FP8_Q:  # DOT_DTYPE Q scaled by a power of two (exact) so its largest |q| lies in [2^14, 2^15)
                q_scale = tl.exp2(14.0 - tl.floor(tl.log2(tl.maximum(q_max, 1e-30))))
                q_dtype: tl.constexpr = DOT_DTYPE
            else:  # FP8 Q: the cache's FP8 type (an fp8 x fp8 MMA on the tile as it lies), or E4M3 against the
                # MXFP4 codes and their E8M0 scales (a scaled MMA, tl.dot_scaled). The scale is the IEEE quotient
                # (div_rn): NVIDIA's `/` is an ulp off at times, which moves the Q values at an E4M3 tie a whole step
                # (a sequence 1.06e-2 off its model at 256x8192 on the H200).
                q_scale = tl.math.div_rn(tl.full([_HEADS], FP8_MAX, tl.float32), tl.maximum(q_max, 1e-30))
                q_dtype: tl.constexpr = kv_ptr.dtype.element_ty if KV_FORMAT == "fp8" else tl.float8e4nv
            if KV_FORMAT == "fp8":  # the per-tensor KV scale, on the scores and the output
                out_scale = tl.load(kscale_ptr)
                s_scale = out_scale * qk_scale / q_scale
            else:  # dot_scaled's scores are exact values; the dequantized V carries 2^-6 (_kv_cols)
                out_scale = 64.0
                s_scale = qk_scale / q_scale
        else:  # fp16 Q pre-scaled by sm_scale * log2(e); MXFP4's 2^6 goes into the scores and the output
            q_scale = tl.full([_HEADS], qk_scale, tl.float32)
            q_dtype: tl.constexpr = DOT_DTYPE
            out_scale = 64.0
            s_scale = tl.full([_HEADS], 64.0, tl.float32)
        q0 = _q_cols(q_ptr, b, q_scale, 0, 128, q_dtype, q_fp8_max, ROUND_FP8)
        q1 = _q_cols(q_ptr, b, q_scale, 128, 128, q_dtype, q_fp8_max, ROUND_FP8)
        q2 = _q_cols(q_ptr, b, q_scale, 256, 128, q_dtype, q_fp8_max, ROUND_FP8)
        q3 = _q_cols(q_ptr, b, q_scale, 384, 128, q_dtype, q_fp8_max, ROUND_FP8)
        q_rope = _q_cols(q_ptr, b, q_scale, _V_DIM, _ROPE_DIM, q_dtype, q_fp8_max, ROUND_FP8)

        if KV_FORMAT == "fp8" and not PRECISE:
            K_DTYPE: tl.constexpr = kv_ptr.dtype.element_ty
        else:
            K_DTYPE: tl.constexpr = DOT_DTYPE
        m_i = tl.full([_HEADS], float("-inf"), tl.float32)
        l_i = tl.zeros([_HEADS], tl.float32)
        acc0 = tl.zeros([128, _HEADS], tl.float32)
        acc1 = tl.zeros([128, _HEADS], tl.float32)
        acc2 = tl.zeros([128, _HEADS], tl.float32)
        acc3 = tl.zeros([128, _HEADS], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            row_ok = n0 + tl.arange(0, BLOCK_N) < hi
            if SCALED_SCORES:
                s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 0, 128, q0, None)
                s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 128, 128, q1, s)
                s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 256, 128, q2, s)
                s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 384, 128, q3, s)
                s = _mx_scores(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, _V_DIM, _ROPE_DIM, q_rope, s)
            else:
                s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 0, 128, False, KV_FORMAT,
                                    K_DTYPE, USE_ASM), q0)
                s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 128, 128, False, KV_FORMAT,
                                    K_DTYPE, USE_ASM), q1, s)
                s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 256, 128, False, KV_FORMAT,
                                    K_DTYPE, USE_ASM), q2, s)
                s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, 384, 128, False, KV_FORMAT,
                                    K_DTYPE, USE_ASM), q3, s)
                s = tl.dot(_kv_cols(kv_ptr, kscale_ptr, kscale_stride, n0, row_ok, _V_DIM, _ROPE_DIM, False,
                                    KV_FORMAT, K_DTYPE, USE_ASM), q_rope, s)
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
            dst = out_ptr + b * (_HEADS * _V_DIM)
            _store_chunk(dst, acc0, inv, valid, 0, tl.bfloat16)
            _store_chunk(dst, acc1, inv, valid, 128, tl.bfloat16)
            _store_chunk(dst, acc2, inv, valid, 256, tl.bfloat16)
            _store_chunk(dst, acc3, inv, valid, 384, tl.bfloat16)
        else:  # normalized partial output and its log2-sum-exp; the combine weighs them
            part = b * NUM_SPLITS + split
            dst = part_o_ptr + part * (_HEADS * _V_DIM)
            _store_chunk(dst, acc0, inv, True, 0, tl.float32)
            _store_chunk(dst, acc1, inv, True, 128, tl.float32)
            _store_chunk(dst, acc2, inv, True, 256, tl.float32)
            _store_chunk(dst, acc3, inv, True, 384, tl.float32)
            tl.store(part_lse_ptr + part * _HEADS + heads, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")))

    @triton.jit
    def _mla_combine_kernel(kv_indptr_ptr, out_ptr, part_o_ptr, part_lse_ptr, total_kv, NUM_SPLITS: tl.constexpr,
                            SPLITS_P2: tl.constexpr, BLOCK_DV: tl.constexpr, USE_PDL: tl.constexpr):
        bh = tl.program_id(0)  # b * 16 + head
        b = bh // _HEADS
        dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        start = tl.load(kv_indptr_ptr + b)
        end = tl.load(kv_indptr_ptr + b + 1)
        valid = (start >= 0) & (end >= start) & (end <= total_kv)
        sp = tl.arange(0, SPLITS_P2)
        row = (b * NUM_SPLITS + sp) * _HEADS + bh % _HEADS
        if USE_PDL:  # everything above overlapped the split kernel; the partials are read only after it
            tl.extra.cuda.gdc_wait()
        lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
        o = tl.load(part_o_ptr + row[:, None] * _V_DIM + dv[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
        denom = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
        res = tl.where(valid, res, float("nan"))
        tl.store(out_ptr + bh * _V_DIM + dv, res.to(tl.bfloat16))


class TritonPlan(NamedTuple):
    num_splits: int  # programs per sequence, each over a contiguous share of its KV rows
    block_n: int  # KV rows per tile
    num_warps: int
    num_stages: int  # Triton's software pipeline: num_stages - 1 tiles in flight in shared memory
    scaled_scores: bool = False  # MXFP4: the score product by tl.dot_scaled on the codes (else dequantized K)


def split_kernel_shared_bytes(block_n: int, num_stages: int, kv_format: str) -> int:
    """A model of the split kernel's shared memory: num_stages - 1 buffered KV tiles plus 2 KB of scratch for the
    reductions. It matches the offline gfx950/gfx942 compiles with Triton 3.6.0 exactly for FP8 at block_n 64
    (3 stages 75,776 B, 2 stages 38,912 B); tools/amd_check.py checks every plan's real figure against the target's
    limit."""
    row_bytes = QK_HEAD_DIM if kv_format == "fp8" else QK_HEAD_DIM // 2 + MXFP4_BLOCKS_PER_ROW
    return (num_stages - 1) * block_n * row_bytes + 2048


def triton_plan(batch: int, seq_len: int, target: TritonTarget, kv_format: str) -> TritonPlan:
    """The launch plan for `batch` sequences of about `seq_len` KV rows on `target`.

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
    On AMD the same rule fills the CUs with the resident programs the offline compile reports (PROGRAMS_PER_SM),
    and the stages are the most (3 at most) whose tiles fit the target's LDS (gfx942's 64 KiB holds 2); MXFP4 takes
    2, since with 3 the AMD builds spill (Triton 3.6.0: 248 B of scratch on gfx950, 192-228 B on gfx942; with 2 none,
    394 and 403 VGPRs, 1 wave per SIMD as with 3). On gfx950 MXFP4's scores are tl.dot_scaled on the codes
    (SCALED_MFMA_ARCHS) with 1 stage: 212 VGPRs and 2 waves per SIMD, where 2 stages take 334 VGPRs and 1 wave, and
    8 warps at 2 stages 238 and 2 waves of one program (Triton 3.6.0, offline). Untimed on any AMD GPU.
    """
    block_n, num_warps = 64, 4
    max_splits = 32 if kv_format == "fp8" else 64
    amd = target.vendor == "amd"
    per_sm = PROGRAMS_PER_SM.get(target.arch, 1) if amd else NVIDIA_PROGRAMS_PER_SM
    want = max(1, per_sm * target.num_sms // max(batch, 1))
    splits = 1 << (min(want, max(1, seq_len // block_n), max_splits).bit_length() - 1)  # a power of 2, rounded down
    scaled = kv_format == "mxfp4" and target.arch in SCALED_MFMA_ARCHS
    stage_choices = (1,) if scaled else (2,) if amd and kv_format == "mxfp4" else (3, 2)
    stages = next((s for s in stage_choices if split_kernel_shared_bytes(block_n, s, kv_format) <= target.shared_bytes),
                  1)
    return TritonPlan(splits, block_n, num_warps, stages, scaled)


class TritonKey(NamedTuple):
    """What a triton launch depends on. The compiled kernels are specialized on the cache's and its scale's dtypes
    and the scale's row stride; the plan reads kv_seq_len, or total_kv / batch when it is None, on the host: never
    the device's kv_indptr."""

    device: torch.device
    target: TritonTarget
    batch: int
    kv_shape: tuple
    kv_dtype: torch.dtype
    scale_shape: tuple
    scale_dtype: torch.dtype
    scale_stride: int
    kv_format: str
    precise: bool
    kv_seq_len: int | None
    plan: TritonPlan | None  # None: triton_plan's


_TRITON_LAUNCH: dict = {}


class _TritonLaunch:
    """Everything a call needs besides its tensors, for one TritonKey: the plan, the split partials' workspace, grids,
    meta-args, and (after the first call on a GPU whose scales too are 16-byte aligned) the compiled kernels'
    launchers, called with the tensors' addresses: Triton's JIT dispatch, and its launcher's per-tensor data_ptr()
    call and pointer query, cost host time on every call that the leaderboard's L2 flush hides but a serving loop
    pays. Under the interpreter the JIT returns no kernel and every call takes the JIT path. Calls of the same shapes
    share the partials' workspace: calls on concurrent queues must be serialized by the caller (the leaderboard's
    are)."""

    def __init__(self, key: TritonKey):
        target = key.target
        plan = key.plan
        if plan is None:
            seq_len = key.kv_seq_len if key.kv_seq_len is not None else -(-key.kv_shape[0] // key.batch)
            plan = triton_plan(key.batch, seq_len, target, key.kv_format)
        self.plan = plan
        splits = plan.num_splits
        nvidia, interpreted = target.vendor == "nvidia", target.vendor == "interpreter"
        splits_p2 = triton.next_power_of_2(splits)
        block_dv = min(V_HEAD_DIM, max(16, 8192 // splits_p2))  # a (splits, block_dv) fp32 tile: 64 registers/thread
        workspace_rows = key.batch * splits if splits > 1 else 0
        self.part_o = torch.empty((workspace_rows, NUM_HEADS, V_HEAD_DIM), dtype=torch.float32, device=key.device)
        self.part_lse = torch.empty((workspace_rows, NUM_HEADS), dtype=torch.float32, device=key.device)
        self.workspace = (self.part_o.data_ptr(), self.part_lse.data_ptr())
        # Q's FP8 maximum: the cache's FP8 type (448 e4m3fn, 240 fnuz), E4M3 against MXFP4 codes; none for fp16 Q
        fp8_max = (float(torch.finfo(key.kv_dtype).max) if key.kv_format == "fp8" else
                   float(torch.finfo(torch.float8_e4m3fn).max) if plan.scaled_scores else 0.0)
        split_consts = dict(NUM_SPLITS=splits, BLOCK_N=plan.block_n, KV_FORMAT=key.kv_format, PRECISE=key.precise,
                            DOT_DTYPE=tl.float32 if interpreted else tl.float16, FP8_MAX=fp8_max, USE_ASM=nvidia,
                            ROUND_FP8=interpreted, USE_PDL=nvidia and splits > 1, SCALED_SCORES=plan.scaled_scores)
        combine_consts = dict(NUM_SPLITS=splits, SPLITS_P2=splits_p2, BLOCK_DV=block_dv, USE_PDL=nvidia)
        self.split_grid = (splits, key.batch, 1)  # compiled kernels take 3-D grids
        self.combine_grid = (key.batch * NUM_HEADS, V_HEAD_DIM // block_dv, 1)
        # constexprs in the kernels' parameter order: the compiled kernels take them after the other arguments
        self.split_consts, self.combine_consts = tuple(split_consts.values()), tuple(combine_consts.values())
        self.split_meta = dict(split_consts, **triton_launch_options(target, plan.num_warps, plan.num_stages))
        self.combine_meta = dict(combine_consts, **triton_launch_options(target, 4, pdl=nvidia))
        self.split_run = self.combine_run = None

    def launch(self, q, kv, scale, kv_indptr, out, qk_scale) -> None:
        total_kv, scale_stride = kv.shape[0], scale.stride(0)
        q_ptr, kv_ptr, scale_ptr, indptr_ptr = q.data_ptr(), kv.data_ptr(), scale.data_ptr(), kv_indptr.data_ptr()
        if (q_ptr | kv_ptr | indptr_ptr) % 16:
            # Measured on the H200 (Triton 3.6): the FP8 kernel compiled for a cache one byte off a boundary gives
            # wrong scores (rel-L2 0.35), so none is compiled for such inputs; the cuda backend refuses them too.
            raise ValueError(f"triton backend: q, the KV cache ({kv.dtype}) and kv_indptr must start on 16-byte "
                             "boundaries")
        aligned = scale_ptr % 16 == 0  # the scales are read element by element: the JIT compiles for any address
        if self.split_run is not None and aligned:
            part_o, part_lse = self.workspace
            out_ptr = out.data_ptr()
            self.split_run(q_ptr, kv_ptr, scale_ptr, scale_stride, indptr_ptr, out_ptr, part_o, part_lse, total_kv,
                           qk_scale, *self.split_consts)
            if self.combine_run is not None:
                self.combine_run(indptr_ptr, out_ptr, part_o, part_lse, total_kv, *self.combine_consts)
            return
        if self.split_meta["KV_FORMAT"] == "mxfp4":  # the kernel reads the codes and the E8M0 scales as bytes
            kv, scale = kv.view(torch.uint8), scale.view(torch.uint8)
        split = _mla_split_kernel[self.split_grid](q, kv, scale, scale_stride, kv_indptr, out, self.part_o,
                                                   self.part_lse, total_kv, qk_scale, **self.split_meta)
        combine = None
        if self.plan.num_splits > 1:
            combine = _mla_combine_kernel[self.combine_grid](kv_indptr, out, self.part_o, self.part_lse, total_kv,
                                                             **self.combine_meta)
        if aligned and split is not None and (combine is not None or self.plan.num_splits == 1):
            # the compiled kernels' launchers, with their grids bound once
            self.split_run = split[self.split_grid]
            self.combine_run = combine[self.combine_grid] if combine is not None else None


def _triton_key(q, kv, scale, config, kv_format: str, precise: bool, plan: TritonPlan | None) -> TritonKey:
    return TritonKey(q.device, triton_target(q.device), q.shape[0], tuple(kv.shape), kv.dtype, tuple(scale.shape),
                     scale.dtype, scale.stride(0), kv_format, precise, config["kv_seq_len"],
                     None if plan is None else TritonPlan(*plan))


def _triton_launch(key: TritonKey) -> _TritonLaunch:
    """The launch for one key: built on the first call, then looked up (no allocation, no host sync)."""
    launch = _TRITON_LAUNCH.get(key)
    if launch is None:
        launch = _remember(_TRITON_LAUNCH, key, _TritonLaunch(key), LAUNCH_CACHE_LIMIT)
    return launch


def _triton_run(key: TritonKey, q, kv, scale, kv_indptr, qk_scale: float) -> torch.Tensor:
    """The decode by the launch of `key` (_triton_key of these inputs); qk_scale = sm_scale * log2(e)."""
    launch = _triton_launch(key)
    out = q.new_empty((q.shape[0], NUM_HEADS, V_HEAD_DIM))  # q is bf16; new_empty parses no dtype or device
    launch.launch(q, kv, scale, kv_indptr, out, qk_scale)
    return out


def _triton_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format: str, *, precise: bool = False,
                    plan: tuple | None = None) -> torch.Tensor:
    """The triton backend on validated inputs. `precise`: the FP8 cache's score product in DOT_DTYPE (see
    select_precision); MXFP4's always is. `plan` (a TritonPlan, or its first 4 or all 5 fields) overrides triton_plan
    (tests, bench/tune_triton.py)."""
    key = _triton_key(q, kv, scale, config, kv_format, precise, plan)
    return _triton_run(key, q, kv, scale, kv_indptr, qk_scale_of(config))


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


@functools.cache
def _several_gpus() -> bool:
    """Whether inputs can be on another GPU than the current one (asking for the current one costs host time)."""
    return torch.cuda.device_count() > 1


class _Dispatch(NamedTuple):
    """custom_kernel's decision for one kind of input, made once after validate and select_backend (_new_dispatch),
    then looked up by the input's kind (see dispatch)."""

    backend: str
    kv_format: str
    check_contents: bool  # MLA_VALIDATE=1 on a GPU backend: the indptr contents checked on the host (a device sync)
    several_gpus: bool  # the input's GPU may not be the current one, on which the launches go
    launch_key: tuple | None  # the cuda or triton backend's launch key, the aiter backend's plan key (torch: None)
    run: object  # (q, kv, kv_scale, qo_indptr, kv_indptr, config) -> output: the chosen backend's plan, run


# What a call's choices read besides its input: the environment (a changed variable is another kind of call) and the
# DEFAULT_* constants.
_SETTING_VARIABLES = ("MLA_BACKEND", "MLA_KV_FORMAT", "MLA_PRECISION", "MLA_VALIDATE", "MLA_AITER_VARIANT",
                      "TRITON_INTERPRET")
_KV_FORMAT_OF: dict = {}  # those settings -> the KV format they select (select_kv_format)
_DISPATCH: dict = {}  # (settings, every input attribute validate reads, the config's items) -> _Dispatch


def _new_dispatch(q, kv, scale, config, kv_format: str) -> _Dispatch:
    precision = select_precision()
    device = q.device
    backend = select_backend(device, kv_format, precision)
    precise = precision == "precise"
    aiter_key = None
    if backend == "aiter":
        variant = aiter_variant(q.shape[0], config["kv_seq_len"])
        if variant == ROCM_TRITON and _setting("MLA_BACKEND", DEFAULT_BACKEND) == "auto":  # measured faster here
            backend = "triton"
            log.info("MLA decode: %s x %s runs the triton backend (AITER_VARIANTS)", q.shape[0], config["kv_seq_len"])
        else:
            aiter_key = _aiter_key(q, kv, config, variant)
    qk_scale = qk_scale_of(config)
    if backend == "cuda":
        package = _cuda_package()[0]
        launch_key = package.launch_key(device, q.shape[0], kv.shape[0], config["kv_seq_len"], kv_format, precise)

        def run(q, kv, scale, qo_indptr, kv_indptr, config):
            return package.run(launch_key, q, kv, scale, kv_indptr, qk_scale)
    elif backend == "triton":
        launch_key = _triton_key(q, kv, scale, config, kv_format, precise, None)

        def run(q, kv, scale, qo_indptr, kv_indptr, config):
            return _triton_run(launch_key, q, kv, scale, kv_indptr, qk_scale)
    elif backend == "aiter":
        launch_key = aiter_key

        def run(q, kv, scale, qo_indptr, kv_indptr, config):
            return _aiter_forward(q, kv, scale, qo_indptr, kv_indptr, config, launch_key)
    else:
        launch_key = None

        def run(q, kv, scale, qo_indptr, kv_indptr, config):
            return _torch_forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format)
    return _Dispatch(backend, kv_format, check_contents=backend != "torch" and _env("MLA_VALIDATE") == "1",
                     several_gpus=device.type == "cuda" and _several_gpus(), launch_key=launch_key, run=run)


def dispatch(data) -> tuple:
    """(decision, q, kv, kv_scale, qo_indptr, kv_indptr, config): custom_kernel's first half, everything before a
    backend runs. The first call of a kind (the settings, each tensor's shape, dtype, device and contiguity, the
    scale's strides, the config's items and their types) validates it and picks the backend; later calls of that
    kind look the decision up: validate reads nothing else, so an input of the same kind passes it again."""
    settings = (_env_values(_SETTING_VARIABLES), DEFAULT_BACKEND, DEFAULT_KV_FORMAT, DEFAULT_PRECISION)
    kv_format = _KV_FORMAT_OF.get(settings)
    if kv_format is None:
        kv_format = _remember(_KV_FORMAT_OF, settings, select_kv_format(), DISPATCH_LIMIT)  # raises on a bad value
    try:
        if not isinstance(data, (tuple, list)):
            raise TypeError
        q, kv_data, qo_indptr, kv_indptr, config = data
        kv, scale = kv_data[kv_format]
        # Contiguity is all validate asks of the strides, but of the scale's (the MXFP4 scales' row stride is read);
        # the config's value types tell 6.0 from 6, which compare and hash equal.
        key = (settings, q.shape, q.dtype, q.device, q.is_contiguous(), qo_indptr.shape, qo_indptr.dtype,
               qo_indptr.device, qo_indptr.is_contiguous(), kv_indptr.shape, kv_indptr.dtype, kv_indptr.device,
               kv_indptr.is_contiguous(), kv.shape, kv.dtype, kv.device, kv.is_contiguous(), scale.shape,
               scale.stride(), scale.dtype, scale.device, tuple(config.items()), tuple(map(type, config.values())))
        decision = _DISPATCH.get(key)
    except (TypeError, ValueError, KeyError, AttributeError):  # not a valid input: validate says why
        key = decision = None
    if decision is None:
        q, kv, scale, qo_indptr, kv_indptr, config = validate(data, kv_format)
        decision = _new_dispatch(q, kv, scale, config, kv_format)
        if key is not None:
            _remember(_DISPATCH, key, decision, DISPATCH_LIMIT)
    return decision, q, kv, scale, qo_indptr, kv_indptr, config


def forward(decision: _Dispatch, q, kv, scale, qo_indptr, kv_indptr, config) -> torch.Tensor:
    """custom_kernel's second half: the decided backend's plan, run on dispatch's outputs."""
    if decision.several_gpus and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # ctypes, Triton and aiter launch on the current device
            return forward(decision, q, kv, scale, qo_indptr, kv_indptr, config)
    if decision.check_contents:
        validate_indptr_contents(qo_indptr, kv_indptr, kv.shape[0], config["kv_seq_len"])
    return decision.run(q, kv, scale, qo_indptr, kv_indptr, config)


def custom_kernel(data):
    """data = (q, kv_data, qo_indptr, kv_indptr, config) -> (total_q, 16, 512) bfloat16."""
    return forward(*dispatch(data))
