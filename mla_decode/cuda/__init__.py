"""The cuda backend (NVIDIA): the CUDA kernels in csrc/, built at first use with the machine's nvcc and called
through ctypes. mla_decode imports it the first time it considers the cuda backend; the leaderboard file alone has
no such package and runs the Triton kernel on NVIDIA.

One source, two split kernels, each for the ragged and the paged layout (docs/design-notes.md has the measurements
behind each choice):
- Hopper (sm_90a, MLA_WGMMA; csrc/wgmma.cuh): one warpgroup per CTA, two CTAs per SM. S^T = K Q^T by warpgroup
  MMAs with both FP8 operands in shared memory (the tile as the 64-row M side, Q in e4m3 per head as the N side);
  P = 2^8 * the softmax numerators in e4m3; O^T = V^T P^T with V^T from ldmatrix.trans of the FP8 rows. MXFP4: each
  tile of codes is dequantized once into an e5m2 tile (exact), read as e5m2 x e4m3. Units of 64 rows (FP8;
  csrc/wgmma64.cuh): two warpgroups on pairs of tiles, one CTA per SM, the scores as S = Q K^T (the 64 heads as the M
  side), the value product as above.
- Other GPUs (sm_80+; csrc/mma_sync.cuh): mma.sync m16n8k16 in fp16 with fp32 sums, Q in registers; also the
  precise mode on Hopper.
A CTA serves a unit of 16 query rows (heads of one token), or in the Hopper kernel 32 where the heads come in 32s
and 64 (the FP8 cache) where they come in 64s (unit_rows). With more than one split per sequence the grid is
launched cooperatively and its CTAs merge their own partials behind a barrier per unit (csrc/merge.cuh): one launch
per call.
Nothing here imports the rest of mla_decode: the few constants it needs are its own.
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

QUERY_ROWS = 16  # query rows per CTA (a unit, H in the source), 16 heads of one token: heads come in multiples of it
WIDE_QUERY_ROWS = 32  # the Hopper kernel's units where the heads come in multiples of 32 (unit_rows)
WIDEST_QUERY_ROWS = 64  # the Hopper 64-row kernel's units (the FP8 cache; one CTA of two warpgroups per SM)
# plan_unit_rows: the tiles a 32-row CTA walks at least, and where the 16-row plan splits too (a merge either way)
WIDE_MIN_TILES, WIDE_MERGED_MIN_TILES = 16, 8
# plan_unit_rows: the tiles a 64-row CTA walks at least, or at least where the 16-row plan splits too
WIDEST_MIN_TILES, WIDEST_MERGED_MIN_TILES = 16, 4
V_HEAD_DIM = 512  # value width (DV in the source)
KV_FORMATS = ("fp8", "mxfp4")  # the caches these kernels read
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 and ldmatrix; the e4m3 cvt is native from sm_89, emulated before
WGMMA_CAPABILITY = (9, 0)  # built for sm_90a: the wgmma kernel
BLOCK_N = 64  # KV rows per tile (BN in the source)
# cuda_plan: the tiles a split keeps at least where its CTAs would not all fit one per SM; and the splits that FP8
# pages under BLOCK_N rows keep regardless in 16-row units (their rows are looked up one by one: more CTAs in flight
# hide the lookups, until the unit's merge of that many partials costs more)
SPLIT_MIN_TILES, GATHERED_KEEP_SPLITS = 4, 8
MAX_SPLITS = 512  # MAX_SPLITS in the source: the merge takes powers of two up to this
MAX_UNITS = 65535  # the grid's y dimension: units of query rows (batch x q_len x heads / unit_rows)
CSRC = Path(__file__).resolve().parent / "csrc"  # the sources built (bench/tune_cuda.py points it at patched copies)
MAIN_SOURCE = "mla_decode.cu"  # the one translation unit; it includes the .cuh files beside it

log = logging.getLogger("mla_decode")

_LIBS: dict = {}  # (device capability, precise) -> ctypes library, or the build error (str) when it could not be built


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
    lib.mla_limit_wide_ctas.restype = None
    lib.mla_limit_wide_ctas.argtypes = [ctypes.c_int]  # CTAs of the 64-row kernel's one-split grid, for tests
    for name in ("mla_supports_mxfp4", "mla_max_unit_rows"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    lib.mla_unit_ctas_per_sm.restype = ctypes.c_int
    lib.mla_unit_ctas_per_sm.argtypes = [ctypes.c_int]  # a unit's rows
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


def cuda_plan(batch: int, seq_len: int, num_sms: int, ctas_per_sm: int = 1, keep_splits: int = 1) -> int:
    """Splits per unit (`batch` units of 16, 32 or 64 query rows): the largest power of two with batch x splits <= the
    CTAs that fit at once (ctas_per_sm x SMs; the merge's barrier needs them all resident), at most MAX_SPLITS and at
    least one 64-row tile per split; then, while a second CTA per SM would be needed (batch x splits > SMs) and there
    are more than `keep_splits`, halved as long as a split would hold fewer than SPLIT_MIN_TILES tiles (a CTA's fixed
    cost, its Q and its partial output, outweighs so little work). The sweeps behind it are in docs/design-notes.md
    (units of 16 rows) and, for keep_splits, docs/2026-12-02-paged-gap.md (section 9)."""
    tiles = max(1, seq_len // BLOCK_N)
    limit = max(1, min(ctas_per_sm * num_sms // max(batch, 1), tiles, MAX_SPLITS))
    splits = 1 << (limit.bit_length() - 1)
    while splits > keep_splits and batch * splits > num_sms and tiles // splits < SPLIT_MIN_TILES:
        splits //= 2
    return splits


class DecodeCall(ctypes.Structure):
    """mla_decode's one argument (csrc/common.cuh, struct DecodeCall: the same fields in the same order). A plan
    holds one with its own fields set (workspace, batch, splits, format, layout); a run sets its inputs' and passes
    the address: one converted argument instead of 27."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "kv", "kv_scale", "kv_block_scales", "seqs", "block_table",
                                                       "out", "lse", "part_o", "part_lse", "sync", "stream")]
                + [(name, ctypes.c_int) for name in ("scale_stride", "kv_format", "batch", "total_kv", "num_splits",
                                                     "page_size", "max_pages", "num_heads", "q_len", "causal")]
                + [("qk_scale", ctypes.c_float), ("unit_rows", ctypes.c_int), ("page_mul", ctypes.c_uint),
                   ("page_shift", ctypes.c_int), ("guess_rows", ctypes.c_int)])


def page_divisor(page_size: int) -> tuple[int, int]:
    """(page_mul, page_shift) with pos // page_size == (pos * page_mul) >> page_shift for every 0 <= pos < 2^31 (the
    kernels' page_of): page_shift = 31 + ceil(log2(page_size)) and page_mul = 2^page_shift / page_size rounded up,
    below 2^32. Exact because page_mul * page_size exceeds 2^page_shift by less than page_size <= 2^(page_shift -
    31)."""
    shift = 31 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


def split_rows(length: int, splits: int) -> int:
    """The positions of each of `splits` splits of a sequence of `length`: whole tiles (common.cuh's split_rows)."""
    per_split = -(-length // splits)
    return -(-per_split // BLOCK_N) * BLOCK_N


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def current_raw_stream(device_index: int) -> int:
    """The current stream's handle on that GPU. torch.cuda.current_stream(device).cuda_stream builds a Stream object:
    4.5 us of host time per call on the H200's host, against 0.2 for the raw handle (the private call Triton and
    Inductor make)."""
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class LaunchKey(NamedTuple):
    """What a launch's split plan depends on."""

    device: torch.device
    units: int  # CTAs per split: batch x q_len x num_heads / unit_rows
    seq_len: int  # the longest sequence the split plan is sized for
    kv_format: str
    precise: bool
    unit_rows: int = QUERY_ROWS  # its kernel's CTAs per SM (mla_unit_ctas_per_sm): 1 at 64 rows, else 2 or 1
    page_size: int = 0  # 0: ragged


def plan_splits(key: LaunchKey) -> int:
    """The splits per sequence of the launch plan of `key` (cuda_plan on its GPU, with the CTAs per SM of its units'
    kernel: the cooperative launch fails unless every CTA is resident)."""
    lib = library(capability(key.device), key.precise)
    gathered = (key.kv_format == "fp8" and not key.precise and key.unit_rows == QUERY_ROWS
                and 0 < key.page_size < BLOCK_N)
    return cuda_plan(key.units, key.seq_len, torch.cuda.get_device_properties(key.device).multi_processor_count,
                     lib.mla_unit_ctas_per_sm(key.unit_rows),
                     GATHERED_KEEP_SPLITS if gathered else 1)


def served_unit_rows(problem) -> list[int]:
    """The query rows a unit (a CTA) of `problem` can take: 16; in the fast mode's Hopper (wgmma) library (its
    mla_max_unit_rows) also 32 where the heads come in 32s and 64 where they come in 64s with the FP8 cache (the
    64-row kernel has no MXFP4 path: two dequantized tiles beside the 4 stages would not fit). A unit stays in one
    token."""
    if problem.precision != "fast" or problem.num_heads % WIDE_QUERY_ROWS:
        return [QUERY_ROWS]
    widest = library(capability(problem.device)).mla_max_unit_rows()
    wide = [WIDE_QUERY_ROWS] if widest >= WIDE_QUERY_ROWS else []
    if widest >= WIDEST_QUERY_ROWS and problem.num_heads % WIDEST_QUERY_ROWS == 0 and problem.kv_format == "fp8":
        wide.append(WIDEST_QUERY_ROWS)
    return [QUERY_ROWS, *wide]


def plan_unit_rows(problem, requested: int | None = None) -> int:
    """The query rows of a unit (a CTA) in `problem`'s plan, of served_unit_rows. 64 where served and a 64-row CTA,
    split as cuda_plan splits it, walks at least WIDEST_MIN_TILES tiles, or the unsplit 64-row grid fills the SMs, or
    it walks at least WIDEST_MERGED_MIN_TILES where the 16-row plan splits too. Else 32 where served, the 32-row grid
    has more CTAs than the GPU has SMs, and a 32-row CTA walks at least WIDE_MIN_TILES tiles (WIDE_MERGED_MIN_TILES
    where the 16-row plan splits too); else 16. Wider units read each KV tile for more rows and run the per-tile chain
    once for them, but their fixed cost (Q, the staged output, the merge) grows with the rows and they make fewer
    CTAs: with idle SMs or few tiles, 16 rows win. The rule picks, on each of the H200 rows measured in 16-, 32- and
    64-row units, the fastest (docs/2026-12-02-serving.md, sections 8, 10 and 12). requested: the plan's backend
    option, checked against served_unit_rows. Called where the backend serves the problem's device (CudaDecode, and
    cuda_unusable_reason after unusable_reason)."""
    served = served_unit_rows(problem)
    if requested is not None:
        if requested not in served:
            raise ValueError(f"backend_options: unit_rows {requested!r}: this problem's cuda kernel takes {served} "
                             f"query rows a CTA ({problem.num_heads} heads, {problem.kv_format}, "
                             f"{problem.precision} mode)")
        return requested
    if WIDE_QUERY_ROWS not in served:
        return QUERY_ROWS

    def plan(rows: int) -> tuple[int, int, int]:  # (units, splits, tiles a CTA) of the plan in units of `rows`
        units = query_units(problem, rows)
        # The ragged plan's splits (page_size 0): the unit rules were measured on them
        splits = plan_splits(LaunchKey(problem.device, units, problem.max_seqlen, problem.kv_format, False, rows))
        return units, splits, max(1, problem.max_seqlen // BLOCK_N) // splits

    sms = torch.cuda.get_device_properties(problem.device).multi_processor_count
    narrow_splits = plan(QUERY_ROWS)[1]
    if WIDEST_QUERY_ROWS in served:
        units, splits, tiles = plan(WIDEST_QUERY_ROWS)
        if (tiles >= WIDEST_MIN_TILES or (splits == 1 and units >= sms)
                or (tiles >= WIDEST_MERGED_MIN_TILES and narrow_splits > 1)):
            return WIDEST_QUERY_ROWS
    units, splits, tiles = plan(WIDE_QUERY_ROWS)
    if units * splits <= sms or tiles < WIDE_MERGED_MIN_TILES:
        return QUERY_ROWS
    return WIDE_QUERY_ROWS if tiles >= WIDE_MIN_TILES or narrow_splits > 1 else QUERY_ROWS


def query_units(problem, rows: int | None = None) -> int:
    """The CTAs a problem's query rows take per split: batch x q_len x num_heads / rows (the grid's y; default: the
    plan's, plan_unit_rows)."""
    return problem.batch * problem.q_len * problem.num_heads // (rows or plan_unit_rows(problem))


def cuda_unusable_reason(problem) -> str | None:
    """None when the cuda backend serves `problem` (an mla_decode.contract.Problem): a multiple of 16 heads, the
    FP8 cache (MXFP4 on Hopper, fast mode), on an NVIDIA GPU whose kernels build, in at most MAX_UNITS units of the
    plan's rows; else why not."""
    if problem.num_heads % QUERY_ROWS:
        return f"cuda backend: serves multiples of {QUERY_ROWS} heads, not {problem.num_heads}"
    if problem.kv_format not in KV_FORMATS:
        return f"cuda backend: reads the FP8 and MXFP4 caches, not {problem.kv_format}"
    if problem.kv_format == "fp8" and problem.kv_dtype != torch.float8_e4m3fn:
        return f"cuda backend: reads float8_e4m3fn caches, not {problem.kv_dtype}"
    reason = unusable_reason(problem.device, problem.kv_format, problem.precision == "precise")
    if reason is not None:
        return reason
    rows = plan_unit_rows(problem)  # known once the library is
    units = query_units(problem, rows)
    if units > MAX_UNITS:
        return (f"cuda backend: batch x q_len x heads / {rows} = {units} units of query rows, more than the grid's "
                f"{MAX_UNITS}")
    return None


class CudaDecode:
    """The cuda backend's plan for a problem: the kernel library, the unit rows and split count, the workspace (the
    splits' partials, part_o (units x splits, unit_rows, 512) bf16 and part_lse (units x splits, unit_rows) fp32, and
    the per-unit barrier's counters (units,) int32, all empty with one split) and one DecodeCall with the plan's
    fields set. run() sets the inputs' fields and makes one ctypes call: no allocation, no host read. Runs of one
    plan share its workspace: they must be issued in order on one stream."""

    def __init__(self, problem, unit_rows: int | None = None):
        device, batch = problem.device, problem.batch
        precise = problem.precision == "precise"
        rows = plan_unit_rows(problem, unit_rows)
        units = query_units(problem, rows)
        if units > MAX_UNITS:
            raise ValueError(f"cuda backend: {units} units of {rows} query rows, more than the grid's {MAX_UNITS}")
        self.key = LaunchKey(device, units, problem.max_seqlen, problem.kv_format, precise, rows, problem.page_size)
        self.decode = library(capability(device), precise).mla_decode
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.num_splits = splits = plan_splits(self.key)
        page_mul, page_shift = page_divisor(problem.page_size) if problem.page_size else (0, 0)
        # The split the kernel's first table reads guess at (guess_entries): a sequence of the plan's length.
        guess_rows = split_rows(min(problem.max_seqlen, problem.max_pages * problem.page_size), splits)
        parts = units * splits if splits > 1 else 0
        self.part_o = torch.empty((parts, rows, V_HEAD_DIM), dtype=torch.bfloat16, device=device)
        self.part_lse = torch.empty((parts, rows), dtype=torch.float32, device=device)
        self.sync = torch.zeros((units if splits > 1 else 0,), dtype=torch.int32, device=device)
        self.call = DecodeCall(part_o=self.part_o.data_ptr(), part_lse=self.part_lse.data_ptr(),
                               sync=self.sync.data_ptr(), batch=batch, num_splits=splits,
                               kv_format=int(problem.kv_format == "mxfp4"), page_size=problem.page_size,
                               max_pages=problem.max_pages, num_heads=problem.num_heads, q_len=problem.q_len,
                               causal=int(problem.causal and problem.q_len > 1), qk_scale=problem.qk_scale,
                               unit_rows=rows, page_mul=page_mul, page_shift=page_shift, guess_rows=guess_rows)
        self.address = ctypes.addressof(self.call)

    def run(self, q, kv, scale, seqs, table, out, lse) -> None:
        """q (batch, q_len, num_heads, 576) bf16; kv (num_rows, width) FP8 or MXFP4 codes, scale (1,) fp32 or
        (num_rows, >= 18) E8M0; seqs: cache_seqlens (batch,) (paged) or kv_indptr (batch + 1,) (ragged); table
        (batch, max_pages) or None; out (batch, q_len, num_heads, 512) bf16; lse (batch, num_heads, q_len) fp32 or
        None. q, kv, seqs and table start on 16-byte
        boundaries."""
        q_ptr, kv_ptr, seqs_ptr = q.data_ptr(), kv.data_ptr(), seqs.data_ptr()
        table_ptr = 0 if table is None else table.data_ptr()
        if (q_ptr | kv_ptr | seqs_ptr | table_ptr) % 16:
            raise ValueError(f"cuda backend: q, the KV cache ({kv.dtype}), the sequence lengths or offsets and the "
                             "page table must start on 16-byte boundaries")
        call = self.call
        call.q, call.kv, call.seqs, call.block_table = q_ptr, kv_ptr, seqs_ptr, table_ptr
        call.out, call.lse = out.data_ptr(), 0 if lse is None else lse.data_ptr()
        if call.kv_format:
            call.kv_block_scales, call.scale_stride = scale.data_ptr(), scale.stride(0)
        else:
            call.kv_scale = scale.data_ptr()
        call.total_kv = kv.shape[0]
        call.stream = current_raw_stream(self.device_index)
        err = self.decode(self.address)
        if err:
            raise RuntimeError(f"cuda backend: launch failed with cudaError {err}")
