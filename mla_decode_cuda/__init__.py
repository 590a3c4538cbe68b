"""The cuda backend of submission.py (NVIDIA; FP8 KV, and MXFP4 on Hopper): the CUDA kernels in csrc/, built at first
use with the machine's nvcc and called through ctypes. submission.py imports this package the first time it considers
the cuda backend; where it is not installed (a copy of submission.py alone) NVIDIA GPUs get the Triton kernel.

Why beside the Triton kernel: Triton 3.6 feeds the transposed V operand of the FP8 kernel with one-byte shared
loads (256 LDS.U8 per thread per tile in its SASS) and runs at the 255-register limit with spills, so each SM
holds 2 programs that spend ~4 us per 64-row tile. Here the layouts are ours. One source, two split kernels:
- Hopper (sm_90a, built with MLA_WGMMA; csrc/wgmma.cuh): one warpgroup per CTA, two CTAs per SM, two 64-row cp.async
  stages each (a grid of one CTA per SM: three stages).
  S^T = K Q^T by warpgroup MMAs with both FP8 operands in shared memory (the tile as the 64-row M side, Q quantized
  to e4m3 per head in the CTA as the 16-wide N side); P = 2^8 * softmax numerators in e4m3; O^T = V^T P^T with
  V^T as register fragments (ldmatrix.trans of the FP8 rows plus byte permutes, no conversion) and P^T from shared
  memory. The tile sits in the 128-/64-byte swizzled K-major layouts wgmma reads: a layout with 16-byte pieces
  1 KB apart halved the cp.async copy rate (562 vs 305 us for the copies alone at 256x8192).
  MXFP4 (same kernel, MX = true): the codes are copied as they lie, each tile is dequantized once into one e5m2
  tile (E2M1 x 2^k is exact in e5m2 for |k| <= 13; a table lookup by byte permutes), and the products read it as
  e5m2 x e4m3. Measured (H200, bench.py --methods cuda-fp8,cuda-mxfp4,triton-mxfp4): geomean 44.9 us against 42.7
  for FP8 in the same run and 82.5 for the Triton MXFP4 kernel; 369 vs 327 us at 256x8192: half the bytes buy
  nothing here, the kernel is bound by its instructions (the dequantization adds ~1 per value).
- Other GPUs (sm_80+; csrc/mma_sync.cuh): mma.sync m16n8k16 in fp16, one CTA of 8 warps per SM, 4, 3 or 2 stages as
  the GPU's shared memory allows (the launcher picks); ldmatrix reads the FP8 tile for both products (e4m3 -> fp16
  by the hardware cvt from sm_89); Q in fp16 registers. On Hopper mma.sync has no FP8 form (ptxas emulates it with
  conversions), hence the wgmma kernel there.
Splits: one launch. With more than one split per sequence the grid is launched cooperatively and its CTAs merge
their own partials behind a per-sequence barrier (csrc/merge.cuh; a second combine kernel, even overlapped by PDL,
cost ~1 us more at batch 4). Measured on the H200 (`bash bench/run_h200.sh`, BENCHMARKS.md): wgmma 4x1024 10.1,
4x8192 16.5, 32x1024 16.4, 32x8192 52.3, 64x1024 21.5, 64x8192 87.0, 256x1024 50.9, 256x8192 286.3 us (geomean
37.4; the mma.sync kernel 56.4-56.8 before the wgmma kernel's last changes). Accuracy: FP8 Q and P cost
worst-sequence rel-L2 ~0.03-0.037 against fp32 attention over the FP8 cache (the fp16 mma.sync kernel 1.7e-3);
against the BF16 truth 0.032-0.044, inside the 0.08 bound.

Nothing here imports submission.py: the few problem constants it needs are its own.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

NUM_HEADS = 16  # query heads (H in the source)
V_HEAD_DIM = 512  # value width (DV in the source)
LOG2E = 1.4426950408889634  # the kernels' softmax runs in the log2 domain
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 and ldmatrix; the e4m3 cvt is native from sm_89, emulated before
WGMMA_CAPABILITY = (9, 0)  # built for sm_90a: the wgmma kernel
BLOCK_N = 64  # KV rows per tile (BN in the source)
MAX_SPLITS = 512  # MAX_SPLITS in the source: the merge takes powers of two up to this
LAUNCH_CACHE_LIMIT = 64  # launch plans kept (cleared when full); the leaderboard uses 8 shapes
CSRC = Path(__file__).resolve().parent / "csrc"  # the sources built (bench/tune_cuda.py points it at patched copies)
MAIN_SOURCE = "mla_decode.cu"  # the one translation unit; it includes the .cuh files beside it

log = logging.getLogger("mla_decode")  # submission.py's logger

_LIBS: dict = {}  # (device capability, precise) -> ctypes library, or the build error (str) when it could not be built
_LAUNCH: dict = {}  # launch_key(...) -> Launch


def find_nvcc() -> str | None:
    """$CUDA_HOME/bin/nvcc (or $CUDA_PATH's), else the one on PATH, else /usr/local/cuda/bin/nvcc; None if none."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    found = shutil.which("nvcc")
    candidates += [found] if found else []
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def source_files(csrc: Path) -> list[Path]:
    """Every file of the library's source: the .cu and the .cuh files of `csrc`."""
    return sorted(p for p in Path(csrc).iterdir() if p.suffix in (".cu", ".cuh"))


def build_library(nvcc: str, arch: str, wgmma: bool, csrc: Path | None = None) -> str:
    """Path of the library built from `csrc` (default CSRC) for sm_<arch> (the wgmma kernel or the mma.sync one) in
    MLA_CUDA_CACHE (default ~/.cache/mla_decode), keyed by a hash of every source file, the flags and the nvcc; built
    there once per machine. nvcc compiles the sources where they lie, so its messages name the real files and lines.
    A RuntimeError carries nvcc's message when it cannot be built."""
    csrc = Path(csrc or CSRC)
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-diag-suppress", "177",
             f"-DMLA_WGMMA={int(wgmma)}", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    digest = hashlib.sha256("\0".join([nvcc, *flags]).encode())
    for path in source_files(csrc):
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    cache = os.environ.get("MLA_CUDA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mla_decode")
    path = os.path.join(cache, f"libmla_decode_sm{arch}_{digest.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = os.path.join(tmp, "lib.so")
            cmd = [nvcc, *flags, "-I", str(csrc), "-o", built, str(csrc / MAIN_SOURCE)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"cuda backend: nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
            os.replace(built, path)  # atomic: concurrent builders each install a complete file
    return path


def library(capability: tuple[int, int], precise: bool = False):
    """The kernel library for this capability, built once per machine (see build_library) and loaded: the wgmma
    kernel on Hopper (sm_90a), or the mma.sync one where that cannot be built (an nvcc older than 12.0; with a
    warning), on other GPUs, and in the precise mode everywhere (its score product is an fp16 MMA on the exactly
    converted FP8 tile with fp32 sums, where the wgmma kernel's fp8 x fp8 MMA keeps ~14 bits of each sum of
    products). A RuntimeError carries nvcc's message when neither can be built."""
    key = (capability, precise)
    lib = _LIBS.get(key)
    if isinstance(lib, str):
        raise RuntimeError(lib)
    if lib is not None:
        return lib
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("cuda backend: no nvcc found (set CUDA_HOME or put nvcc on PATH)")
    arch = f"{capability[0]}{capability[1]}"
    try:
        if capability == WGMMA_CAPABILITY and not precise:
            try:
                path = build_library(nvcc, arch + "a", wgmma=True)
            except RuntimeError as e:
                log.warning("MLA decode: the Hopper (wgmma) kernel did not build, using the mma.sync one: %s", e)
                path = build_library(nvcc, arch, wgmma=False)
        else:
            path = build_library(nvcc, arch, wgmma=False)
    except RuntimeError as e:
        _LIBS[key] = str(e)
        raise
    lib = ctypes.CDLL(path)
    lib.mla_decode.restype = ctypes.c_int
    lib.mla_decode.argtypes = [ctypes.c_void_p]  # the address of a DecodeCall
    lib.mla_decode_call_layout.restype = None
    lib.mla_decode_call_layout.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.mla_limit_shared_memory.restype = ctypes.c_int
    lib.mla_limit_shared_memory.argtypes = [ctypes.c_int]
    for name in ("mla_ctas_per_sm", "mla_supports_mxfp4"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    _LIBS[key] = lib
    return lib


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def unusable_reason(device: torch.device, kv_format: str = "fp8", precise: bool = False) -> str | None:
    """None when the cuda backend reads `kv_format` ("fp8" or "mxfp4") on `device` in the fast or the precise mode
    (an NVIDIA GPU of capability >= 8.0 whose kernel library builds with the machine's nvcc, once per machine; MXFP4
    only with the Hopper kernel, so not in the precise mode), else why not."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"cuda backend: needs an NVIDIA GPU; device is {device}"
    if capability(device) < MIN_CAPABILITY:
        return f"cuda backend: needs compute capability >= 8.0, this GPU has {capability(device)}"
    if kv_format == "mxfp4" and precise:
        return "cuda backend: the precise mode reads the FP8 cache only (its mma.sync kernel has no MXFP4 path)"
    try:
        lib = library(capability(device), precise)
    except RuntimeError as e:
        return str(e)
    if kv_format == "mxfp4" and not lib.mla_supports_mxfp4():
        return (f"cuda backend: reads MXFP4 only with its Hopper (sm_90a) kernel; this GPU has capability "
                f"{capability(device)}")
    return None


def cuda_plan(batch: int, seq_len: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """Splits per sequence: the largest power of two with batch x splits <= the CTAs that fit at once (ctas_per_sm x
    SMs; the merge's barrier needs them all resident), at most MAX_SPLITS and at least one 64-row tile per split;
    then, while a second CTA per SM would be needed (batch x splits > SMs), halved as long as a split would hold fewer
    than 4 tiles (a CTA's fixed cost, its Q and its partial output, outweighs so little work). Measured on the H200
    (132 SMs, the fused merge, splits 1..64 per shape, leaderboard timing), the wgmma kernel (2 CTAs per SM) is
    fastest, or within 3%, at the counts this picks: 16 at 4x1024 (11.3 us; 12.2 at 8), 32 at 4x8192 (18.9; 20.6 at
    64), 4 at 32x1024 (18.9; 19.5 at 8), 8 at 32x8192 (54.9; 55.2 at 4), 4 at 64x1024 (25.0; 25.6 at 2) and 64x8192,
    1 at batch 256; rechecked with a later kernel: 4x8192 at 64 18.8 (17.0 at 32), 32x1024 at 8 17.7 (17.4 at 4),
    32x8192 at 4 54.2 (53.1 at 8). Two warpgroups per CTA alone on its SM (alternate tiles; 64x8192 in 2 splits,
    32x8192 in 4) were faster until the copies asked L2 for whole lines, then slower (89.4 against 87.5 and 54.4
    against 53.1 us), and were removed. The mma.sync kernel (1 CTA per SM) was best at 16, 32, 4, 4, 2, 2, 1, 1 (what
    this picks for it; measured with an earlier two-kernel merge)."""
    tiles = max(1, seq_len // BLOCK_N)
    limit = max(1, min(ctas_per_sm * num_sms // max(batch, 1), tiles, MAX_SPLITS))
    splits = 1 << (limit.bit_length() - 1)
    while splits > 1 and batch * splits > num_sms and tiles // splits < 4:
        splits //= 2
    return splits


class DecodeCall(ctypes.Structure):
    """mla_decode's one argument (csrc/common.cuh, struct DecodeCall: the same fields in the same order). A plan
    holds one with its own fields set (workspace, batch, splits, format); a call sets its inputs' and passes the
    address: one converted argument instead of 16."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "kv", "kv_scale", "kv_block_scales", "kv_indptr", "out",
                                                       "part_o", "part_lse", "sync", "stream")]
                + [(name, ctypes.c_int) for name in ("scale_stride", "kv_format", "batch", "total_kv", "num_splits")]
                + [("qk_scale", ctypes.c_float)])


class Launch(NamedTuple):
    """One plan: its DecodeCall (and the call's address), the library's entry point, the device's index, and the
    workspace the call points into, kept alive here: part_o (batch * splits, 16, 512) bf16 and part_lse (batch *
    splits, 16) fp32, the splits' partials, and sync (batch,) int32, the per-sequence barrier's arrival counts (all
    empty with one split)."""

    call: DecodeCall
    address: int
    decode: object  # lib.mla_decode
    device_index: int
    part_o: torch.Tensor
    part_lse: torch.Tensor
    sync: torch.Tensor


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def current_raw_stream(device_index: int) -> int:
    """The current stream's handle on that GPU. torch.cuda.current_stream(device).cuda_stream builds a Stream object:
    4.5 us of host time per call on the H200's host, against 0.2 for the raw handle (the private call Triton and
    Inductor make)."""
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class LaunchKey(NamedTuple):
    """What a launch plan depends on. run() takes it; submission.py computes it once per kind of call."""

    device: torch.device
    batch: int
    seq_len: int  # the split plan's sequence length: kv_seq_len, or total_kv / batch where that is None
    kv_format: str
    precise: bool


def launch_key(device: torch.device, batch: int, total_kv: int, kv_seq_len: int | None, kv_format: str,
               precise: bool = False) -> LaunchKey:
    seq_len = kv_seq_len if kv_seq_len is not None else -(-total_kv // max(batch, 1))
    return LaunchKey(device, batch, seq_len, kv_format, precise)


def plan_splits(key: LaunchKey) -> int:
    """The splits per sequence of the launch plan of `key` (cuda_plan on its GPU, with its kernel's CTAs per SM)."""
    lib = library(capability(key.device), key.precise)
    return cuda_plan(key.batch, key.seq_len, torch.cuda.get_device_properties(key.device).multi_processor_count,
                     lib.mla_ctas_per_sm())


def _new_launch(key: LaunchKey) -> Launch:
    device, batch = key.device, key.batch
    lib = library(capability(device), key.precise)
    splits = plan_splits(key)
    rows = batch * splits if splits > 1 else 0
    part_o = torch.empty((rows, NUM_HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=device)
    part_lse = torch.empty((rows, NUM_HEADS), dtype=torch.float32, device=device)
    sync = torch.zeros((batch if splits > 1 else 0,), dtype=torch.int32, device=device)
    call = DecodeCall(part_o=part_o.data_ptr(), part_lse=part_lse.data_ptr(), sync=sync.data_ptr(), batch=batch,
                      num_splits=splits, kv_format=int(key.kv_format == "mxfp4"))
    launch = Launch(call, ctypes.addressof(call), lib.mla_decode, device.index, part_o, part_lse, sync)
    if len(_LAUNCH) >= LAUNCH_CACHE_LIMIT:
        _LAUNCH.clear()
    _LAUNCH[key] = launch
    return launch


def run(key: LaunchKey, q, kv, scale, kv_indptr, qk_scale: float) -> torch.Tensor:
    """The decode by the launch plan of `key` (launch_key of these inputs; built at its first call), inputs as forward
    takes them; qk_scale = sm_scale * log2(e). The host path a call repeats: one dictionary lookup, the output's
    allocation, the DecodeCall's input fields and one ctypes call."""
    launch = _LAUNCH.get(key)
    if launch is None:
        launch = _new_launch(key)
    q_ptr, kv_ptr, indptr_ptr = q.data_ptr(), kv.data_ptr(), kv_indptr.data_ptr()
    if (q_ptr | kv_ptr | indptr_ptr) % 16:
        raise ValueError(f"cuda backend: q, the KV cache ({kv.dtype}) and kv_indptr must start on 16-byte boundaries")
    out = q.new_empty((q.shape[0], NUM_HEADS, V_HEAD_DIM))  # q is bf16; new_empty parses no dtype or device
    call = launch.call
    call.q, call.kv, call.kv_indptr, call.out = q_ptr, kv_ptr, indptr_ptr, out.data_ptr()
    if call.kv_format:
        call.kv_block_scales, call.scale_stride = scale.data_ptr(), scale.stride(0)
    else:
        call.kv_scale = scale.data_ptr()
    call.total_kv, call.qk_scale = kv.shape[0], qk_scale
    call.stream = current_raw_stream(launch.device_index)
    err = launch.decode(launch.address)
    if err:
        raise RuntimeError(f"cuda backend: launch failed with cudaError {err}")
    return out


def forward(q, kv, scale, qo_indptr, kv_indptr, config, kv_format: str, precise: bool = False) -> torch.Tensor:
    """The decode on an NVIDIA GPU, inputs as submission.validate returns them (all on one GPU, the current one):
      q:         (batch, 16, 576) bfloat16, contiguous, 16-byte aligned
      kv, scale: kv_format "fp8": kv (total_kv, 1, 576) float8_e4m3fn, scale (1,) float32 (the cache holds kv *
                 scale); "mxfp4": kv (total_kv, 1, 288) E2M1 codes (float4_e2m1fn_x2 or uint8), scale
                 (>= total_kv, >= 18) E8M0 block scales (float8_e8m0fnu or uint8, any row stride); kv 16-byte aligned
      qo_indptr: (batch + 1,) int32 = [0, 1, ..., batch] (not read: one query row per sequence)
      kv_indptr: (batch + 1,) int32, 16-byte aligned; sequence b owns KV rows kv_indptr[b]:kv_indptr[b+1]
      config:    sm_scale, and kv_seq_len (None, or the length of every sequence / the maximum) for the split plan
      precise:   the mma.sync kernel's fp16 score product (see library); FP8 cache only
    Output: (batch, 16, 512) bfloat16. One ctypes call launches the split kernel (which merges the splits too) on the
    current stream; the workspace (partials, the per-sequence barrier's counters) is cached by launch_key: calls with
    the same key must be issued in order on one stream."""
    key = launch_key(q.device, q.shape[0], kv.shape[0], config["kv_seq_len"], kv_format, precise)
    return run(key, q, kv, scale, kv_indptr, float(config["sm_scale"]) * LOG2E)
