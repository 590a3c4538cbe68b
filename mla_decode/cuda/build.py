"""The kernel library: csrc/ built with the machine's nvcc (once per machine and source), loaded through ctypes, and
DecodeCall, its one argument, checked against the C struct at load."""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

WGMMA_CAPABILITY = (9, 0)  # built for sm_90a: the wgmma kernel
CSRC = Path(__file__).resolve().parent / "csrc"  # the sources built (bench/tune_cuda.py points it at patched copies)
MAIN_SOURCE = "mla_decode.cu"  # the one translation unit; it includes the .cuh files beside it

log = logging.getLogger("mla_decode")

# (device capability, precise) -> ctypes library, or the RuntimeError that stopped its build or load (raised again)
_LIBS: dict = {}


class DecodeCall(ctypes.Structure):
    """mla_decode's one argument (csrc/common.cuh, struct DecodeCall: the same fields in the same order). A plan
    holds one with its own fields set (workspace, batch, splits, format, layout); a run sets its inputs' and passes
    the address: one converted argument instead of 31."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "kv", "kv_scale", "kv_block_scales", "seqs", "block_table",
                                                       "out", "lse", "part_o", "part_lse", "sync", "stream")]
                + [(name, ctypes.c_int) for name in ("scale_stride", "kv_format", "batch", "total_kv", "num_splits",
                                                     "page_size", "max_pages", "num_heads", "q_len", "causal")]
                + [("qk_scale", ctypes.c_float), ("unit_rows", ctypes.c_int), ("page_mul", ctypes.c_uint),
                   ("page_shift", ctypes.c_int), ("guess_rows", ctypes.c_int), ("items", ctypes.c_void_p)]
                + [(name, ctypes.c_int) for name in ("schedule", "parts", "max_items", "min_share",
                                                     "cut", "slack")])


class DecodeCallMismatch(RuntimeError):
    """A library whose DecodeCall is not this module's: it would read its arguments at other offsets."""


def decode_call_layout() -> list[int]:
    """DecodeCall's layout as mla_decode_call_layout reports the C struct's: each field's offset in order, then the
    size."""
    return [getattr(DecodeCall, name).offset for name, _ in DecodeCall._fields_] + [ctypes.sizeof(DecodeCall)]


def check_decode_call(lib: ctypes.CDLL) -> None:
    """Raises DecodeCallMismatch unless `lib`'s DecodeCall (its mla_decode_call_fields and mla_decode_call_layout) has
    DecodeCall's fields at DecodeCall's offsets and its size, naming the first field that differs. A library built
    from sources older or newer than this module (a stale cache, a frozen copy of csrc) fails here, not in a launch
    that reads garbage."""
    fields, layout_of = getattr(lib, "mla_decode_call_fields", None), getattr(lib, "mla_decode_call_layout", None)
    if fields is None or layout_of is None:
        raise DecodeCallMismatch("cuda backend: the kernel library does not report its DecodeCall's layout "
                                 "(no mla_decode_call_fields or mla_decode_call_layout)")
    names = [name for name, _ in DecodeCall._fields_]
    count = fields()
    theirs = (ctypes.c_int * (count + 1))()  # the offsets of its `count` fields, then its size
    layout_of(theirs)
    ours = decode_call_layout()
    for i, name in enumerate(names[:count]):
        if theirs[i] != ours[i]:
            raise DecodeCallMismatch(f"cuda backend: the kernel library's DecodeCall is not mla_decode.cuda's: field "
                                     f"{i} ({name}) lies at byte {theirs[i]} there, {ours[i]} here")
    if count != len(names):
        first = names[count] if count < len(names) else f"its field {len(names)}"
        raise DecodeCallMismatch(f"cuda backend: the kernel library's DecodeCall is not mla_decode.cuda's: it has "
                                 f"{count} fields, not {len(names)} (the first unmatched: {first})")
    if theirs[count] != ours[-1]:
        raise DecodeCallMismatch(f"cuda backend: the kernel library's DecodeCall is not mla_decode.cuda's: its size "
                                 f"is {theirs[count]} bytes there, {ours[-1]} here")


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


def _built(nvcc: str, capability: tuple[int, int], precise: bool) -> str:
    """The path of the library for this capability and mode (see library)."""
    arch = f"{capability[0]}{capability[1]}"
    if capability == WGMMA_CAPABILITY and not precise:
        try:
            return build_library(nvcc, arch + "a", wgmma=True)
        except RuntimeError as e:
            log.warning("MLA decode: the Hopper (wgmma) kernel did not build, using the mma.sync one: %s", e)
    return build_library(nvcc, arch, wgmma=False)


def _load(path: str):
    """The library at `path`, its DecodeCall checked (check_decode_call) and its exports typed."""
    lib = ctypes.CDLL(path)
    check_decode_call(lib)
    for name in ("mla_decode", "mla_schedule"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_void_p]  # the address of a DecodeCall
    lib.mla_decode_call_layout.restype = None
    lib.mla_decode_call_layout.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.mla_limit_shared_memory.restype = ctypes.c_int
    lib.mla_limit_shared_memory.argtypes = [ctypes.c_int]
    lib.mla_limit_wide_ctas.restype = None
    lib.mla_limit_wide_ctas.argtypes = [ctypes.c_int]  # CTAs of the 64-row kernel's one-split grid, for tests
    for name in ("mla_supports_mxfp4", "mla_supports_bf16", "mla_bf16_ctas_per_sm", "mla_max_unit_rows",
                 "mla_decode_call_fields"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    lib.mla_unit_ctas_per_sm.restype = ctypes.c_int
    lib.mla_unit_ctas_per_sm.argtypes = [ctypes.c_int]  # a unit's rows
    return lib


def library(capability: tuple[int, int], precise: bool = False) -> ctypes.CDLL:
    """The kernel library for this capability, built once per machine (see build_library) and loaded: the wgmma
    kernel on Hopper (sm_90a), or the mma.sync one where that cannot be built (an nvcc older than 12.0; with a
    warning), on other GPUs, and in the precise mode everywhere (its score product is an fp16 MMA on the exactly
    converted FP8 tile with fp32 sums, where the wgmma kernel's fp8 x fp8 MMA keeps ~14 bits of each sum of
    products). A RuntimeError carries nvcc's message when neither can be built, a DecodeCallMismatch the field where
    the loaded library's DecodeCall differs; either is remembered and raised again."""
    key = (capability, precise)
    lib = _LIBS.get(key)
    if isinstance(lib, RuntimeError):
        raise type(lib)(*lib.args)
    if lib is not None:
        return lib
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("cuda backend: no nvcc found (set CUDA_HOME or put nvcc on PATH)")
    try:
        lib = _load(_built(nvcc, capability, precise))
    except RuntimeError as e:
        _LIBS[key] = e
        raise
    _LIBS[key] = lib
    return lib
