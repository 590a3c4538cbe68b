"""The offline AMD compile check: every Triton kernel of a submission file built for AMD GPUs on a CPU, through the
submission's own launch paths, with the numbers and the gates that say whether it can run there.

    python tools/amd_check.py [--triton DIR|env ...] [--targets gfx950,gfx942] [--submission FILE]
                              [--shapes 4x1024,...] [--modes fp8-fast,...] [--library 4x1024x16,...]
                              [--library-every-triton] [--json PATH]

For each Triton (`--triton`: a folder holding a Triton package, such as the runner's 3.6.0 installed with `pip install
--target`, or `env`, the one this Python imports) and each target it starts worker processes (Triton 3.6 carries
state from one AMD target to the next inside a process). The worker puts an offline driver in place of Triton's: it
answers for an AMD GPU of that architecture (its CU count and LDS size) and launches nothing. In the submission it
loads, the backend choice answers "triton" (where the triton backend takes the problem: the CPU has no GPU to choose
by) and every TritonDecode is made for that target (`TritonDecode(problem, target=...)`); the rest is the file's own
code. Then it calls, twice each (the JIT, then the compiled kernels' bound launchers), on CPU tensors of the real
shapes and dtypes (never written: the driver launches nothing):
  - the leaderboard adapter, custom_kernel, for every leaderboard shape (`--shapes`) and mode of a leaderboard cache
    format (fp8 fast and precise, mxfp4: MLA_KV_FORMAT / MLA_PRECISION, MLA_BACKEND=triton): the ragged Problem it
    makes, no LSE;
  - the library call, mla_decode_with_kvcache, with return_lse=True, on a PAGED cache for every mode, the bf16
    cache included, and each `--library` case: batch x kv length x page size (0: a ragged cache, by plan_ragged's
    run_ragged) [x q_len x heads]; each with the library's default schedule (fixed splits) and with the balanced
    one (a plan with backend_options {"schedule": "balanced"}: the schedule kernel, the split kernel over its pieces,
    the combine over theirs). By default page sizes 1, 16, 64 and 48 on a small batch, whose splits meet in the
    combine, 16 on a large one of one split, whose split kernel writes the LSE itself, a ragged cache, and the
    serving shapes (MTP, 32 and 128 heads; 8 heads with q_len 3, whose last group of 16 rows is part masked)
    (LIBRARY_CASES); with the first `--triton` only (the runner's in `make amd-check`: that keeps the check's time in
    bounds; --library-every-triton: all);
  - the aiter path's Q quantizer where it uses Triton (gfx950, whose FP8 is e4m3fn).
So the JIT specializes, packs the launch options and compiles exactly as on the GPU: an option the target's backend
refuses, a conversion it cannot lower and an LDS size over the GPU's (Triton's own load check, with the driver's
figure) fail here.

Per compiled kernel it prints VGPRs (arch + acc), SGPRs, scratch, LDS against the limit, waves per SIMD and the
matrix (MFMA) and FP8/FP4 conversion instructions. It fails (exit status 1) on: an error anywhere in a launch path;
LLVM error output; scratch in the fast FP8, the MXFP4 or the bf16 split kernel; LDS over the target's; a fast FP8
score product not on FP8 MFMAs; a bf16 kernel's products not all on bf16 MFMAs; an MXFP4 score product by
tl.dot_scaled (gfx950) not on scaled MFMAs or under 2 waves per SIMD. A paged or LSE-writing kernel is held to the
gates of its ragged twin (the leaderboard's kernel of its format and mode); where it has fewer waves per SIMD, more
scratch or VGPR_NOTE more VGPRs than that twin, a NOTE line says so (not a failure).

Each (Triton, target) runs in two worker processes, the leaderboard's cases and the library's, `--jobs` at a time
(default: the CPUs), the slowest first; their results are merged into one table.

It uses Triton internals (the driver's interface, the JIT's caches, `asm["amdgcn"]`) as Triton 3.6.0 and 3.9.0 have
them; `make amd-check` runs it with both.
"""

import argparse
import concurrent.futures
import contextlib
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class AmdGpu(NamedTuple):
    name: str
    cus: int
    lds_bytes: int  # per CU, which one workgroup may take whole
    fp8: str  # the torch dtype of its FP8 cache (aiter.dtypes.fp8)


# The check's own knowledge of the GPUs, independent of the submission's tables (so a wrong table there fails here).
TARGETS = {
    "gfx950": AmdGpu("MI355X", 256, 160 * 1024, "float8_e4m3fn"),
    "gfx942": AmdGpu("MI300X", 304, 64 * 1024, "float8_e4m3fnuz"),
}
SHAPES = ((4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192))  # task.yml
# The library's calls (batch, kv length, page size; 0: a ragged cache), each page size a walk of its own in the split
# kernel: pages that divide a tile of BLOCK_N = 64 rows (1, 16), that a tile divides (64), and neither (48: a table
# read per row). Each on a small batch (many splits: the combine writes the LSE), and 16 on a large one too (one split
# on both targets: the split kernel writes the LSE itself), and a ragged cache. Then the serving shapes, with q_len and
# heads as the fourth and fifth figures: MTP (q_len 2 and 4, causal) and 32 and 128 heads, pages of 64.
LIBRARY_CASES = ((4, 1024, 1), (4, 1024, 16), (4, 1024, 64), (4, 1024, 48), (512, 4096, 16), (4, 1024, 0),
                 (4, 1024, 64, 2, 16), (8, 4096, 64, 4, 32), (16, 4096, 64, 1, 128), (4, 1024, 64, 3, 8))
# The library's calls run with its default schedule (fixed splits, the cut the leaderboard's uniform batches take
# too), then with the balanced schedule: the first names no option, so that the default is what is checked
SCHEDULES = ("fixed", "balanced")
# mode -> (KV format, precision); the leaderboard serves the first three (its LEADERBOARD_KV_FORMATS), the library all.
MODES = {"fp8-fast": ("fp8", "fast"), "fp8-precise": ("fp8", "precise"), "mxfp4": ("mxfp4", "fast"),
         "bf16": ("bf16", "fast")}
KERNELS = ("mla_split_kernel", "mla_combine_kernel", "mla_schedule_kernel", "_q_absmax_kernel", "_q_quantize_kernel")
WAVE = 64
VGPR_NOTE = 16  # VGPRs over a ragged twin's that earn a NOTE when the waves per SIMD stay
# LLVM's and Triton's error lines, as they print them to the process's stderr (Triton 3.9 prints such errors for
# code it could not lower and still returns a binary).
LLVM_ERROR = re.compile(r"LLVM ERROR|error:|couldn't allocate", re.IGNORECASE)


class Cases(NamedTuple):
    """What a worker runs: the leaderboard's shapes, the modes, the library's cases (batch, kv length, page size)."""

    shapes: tuple
    modes: tuple
    library: tuple

    def argv(self) -> list[str]:
        return [f"--shapes={_unshapes(self.shapes)}", f"--modes={','.join(self.modes)}",
                f"--library={_unshapes(self.library)}"]


# --- the worker: one Triton, one target ---------------------------------------------------------------------


class _Launcher:
    """Triton's launcher for one compiled kernel, as the offline driver makes it: records each launch."""

    def __init__(self, kernel_hash: str, launches: list):
        self.kernel_hash, self.launches = kernel_hash, launches

    def __call__(self, grid0, grid1, grid2, *rest):
        self.launches.append((self.kernel_hash, (grid0, grid1, grid2)))


def _offline_driver(arch: str, gpu: AmdGpu, launches: list):
    """A Triton driver for an AMD GPU that is not there: the target, device 0, the GPU's LDS and CU count for the
    load checks, and launchers that record instead of launching."""
    from triton.backends.compiler import GPUTarget

    class Utils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": gpu.lds_bytes, "multiprocessor_count": gpu.cus, "warpSize": WAVE,
                    "max_num_regs": 512}

        @staticmethod
        def load_binary(name, kernel, shared, device):
            return None, name, 0, 0, 1024  # module, function, registers, spills, threads per workgroup

    class OfflineAmdDriver:
        def __init__(self):
            self.utils = Utils()

        @classmethod
        def is_active(cls):
            return False

        def get_current_target(self):
            return GPUTarget("hip", arch, WAVE)

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("the offline driver runs nothing")

        def launcher_cls(self, src, metadata):
            return _Launcher(metadata.hash, launches)

    return OfflineAmdDriver()


@contextlib.contextmanager
def _stderr_to(path: Path):
    """The process's fd 2 (where LLVM prints) into `path` for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _load_submission(path: Path):
    spec = importlib.util.spec_from_file_location("submission_under_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fp4x2_e8m0():
    """The runner's MXFP4 dtypes (reference.py's): float4_e2m1fn_x2 codes and float8_e8m0fnu scales where torch has
    them, else bytes."""
    import torch

    return (getattr(torch, "float4_e2m1fn_x2", torch.uint8), getattr(torch, "float8_e8m0fnu", torch.uint8))


def _leaderboard_input(batch: int, kv_len: int, kv_format: str, fp8):
    """custom_kernel's data for a leaderboard shape, as the runner makes it (reference.py): CPU tensors allocated and
    never written but for the index arrays (nothing reads the rest)."""
    import torch

    total_kv = batch * kv_len
    q = torch.empty((batch, 16, 576), dtype=torch.bfloat16)
    if kv_format == "fp8":
        kv_data = {"fp8": (torch.empty((total_kv, 1, 576), dtype=fp8), torch.ones(1))}
    else:  # the runner's layout: scales padded to (256-row multiple, 24)
        codes, scales = _fp4x2_e8m0()
        kv_data = {"mxfp4": (torch.empty((total_kv, 1, 288), dtype=codes),
                             torch.empty((-(-total_kv // 256) * 256, 24), dtype=scales))}
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
    kv_indptr = torch.arange(0, total_kv + 1, kv_len, dtype=torch.int32)
    config = {"batch_size": batch, "num_heads": 16, "num_kv_heads": 1, "qk_head_dim": 576, "v_head_dim": 512,
              "q_seq_len": 1, "kv_seq_len": kv_len, "sm_scale": 576 ** -0.5}
    return q, kv_data, qo_indptr, kv_indptr, config


def _library_call(S, batch: int, kv_len: int, kv_format: str, precision: str, page_size: int, fp8, q_len: int = 1,
                  num_heads: int = 16, schedule: str = SCHEDULES[0]) -> None:
    """The library's call on a cache of `page_size` rows a page (0: ragged) holding `batch` sequences of up to kv_len
    rows, q_len tokens (causal) of num_heads heads each, with the LSE, on CPU tensors of its layouts (api.py's
    docstring), never written: twice, through one plan. schedule: the default's (mla_decode_with_kvcache, no backend
    option) or another, asked of a plan by backend_options."""
    import torch

    width = {"fp8": 576, "mxfp4": 288, "bf16": 576}[kv_format]
    codes, e8m0 = _fp4x2_e8m0()
    kv_dtype = {"fp8": fp8, "mxfp4": codes, "bf16": torch.bfloat16}[kv_format]
    q = torch.empty((batch, q_len, num_heads, 576), dtype=torch.bfloat16)
    causal = q_len > 1
    if page_size:
        max_pages = -(-kv_len // page_size)
        page = (batch * max_pages, page_size)  # room for every sequence
    else:
        page = (batch * kv_len,)
    kv_cache = torch.empty((*page, 1, width), dtype=kv_dtype)
    kv_scale = {"fp8": torch.ones(1), "mxfp4": torch.empty((*page, 1, 18), dtype=e8m0), "bf16": None}[kv_format]
    options = None if schedule == SCHEDULES[0] else {"schedule": schedule}
    if page_size:
        block_table = torch.empty((batch, max_pages), dtype=torch.int32)
        cache_seqlens = torch.full((batch,), kv_len, dtype=torch.int32)
        decode = None if options is None else S.plan(
            batch, page_size, max_pages, kv_dtype, q.device, num_heads=num_heads, q_len=q_len, causal=causal,
            precision=precision, return_lse=True, kv_scale_dtype=e8m0, backend_options=options)
        for _ in range(2):  # the JIT, then the bound launchers of the compiled kernels (the call keeps its plan)
            if decode is None:
                S.mla_decode_with_kvcache(q, kv_cache, block_table, cache_seqlens, kv_scale, precision=precision,
                                          causal=causal, return_lse=True)
            else:
                decode.run(q, kv_cache, block_table, cache_seqlens, kv_scale)
    else:
        decode = S.plan_ragged(batch, kv_dtype, q.device, kv_len, num_heads=num_heads, q_len=q_len, causal=causal,
                               precision=precision, return_lse=True, kv_scale_dtype=e8m0, backend_options=options)
        kv_indptr = torch.arange(0, batch * kv_len + 1, kv_len, dtype=torch.int32)
        for _ in range(2):
            decode.run_ragged(q, kv_cache, kv_indptr, kv_scale.view(-1, 18) if kv_format == "mxfp4" else kv_scale)


def _on_amd_target(S, amd_target, plans: list) -> None:
    """Makes the loaded submission plan for `amd_target` on the CPU: its backend choice answers "triton" wherever the
    triton backend takes the problem (as on a GPU), and every TritonDecode is made for `amd_target`, into `plans`."""
    import torch

    class AmdTritonDecode(S.TritonDecode):
        def __init__(self, problem, target=None, plan=None, **options):
            super().__init__(problem, target=amd_target, plan=plan, **options)
            plans.append(self)

    # The registry's triton record, its plans made for amd_target
    record = next(r for r in S.BACKEND_REGISTRY if r.name == "triton")._replace(make_plan=AmdTritonDecode)

    def select_backend(problem, backend="auto"):
        reason = S.triton_unusable_reason(problem._replace(device=torch.device("cuda")))  # as on a GPU
        if reason is not None:
            raise S.BackendUnavailable("triton", reason)
        return S.Selection(record, ())

    S.select_backend = select_backend


@contextlib.contextmanager
def _environ(**values: str):
    """os.environ with `values` set for the duration."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _llvm_error(line: str) -> str:
    """An LLVM error line, short: its message, and the source places of its MLIR location (file:line:col, innermost
    first), which come before it."""
    at = line.find("error:")
    message = line[at:] if at >= 0 else line
    places = [f"{Path(f).name}:{n}:{c}" for f, n, c in re.findall(r'"([^"]+)":(\d+):(\d+)', line[:max(at, 0)])]
    return message[:200] + (f" at {', '.join(dict.fromkeys(places))}" if places else "")


def _asm_figures(asm: str) -> dict:
    def field(pattern):
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else None

    def counts(pattern):
        found: dict = {}
        for name in re.findall(pattern, asm):
            found[name] = found.get(name, 0) + 1
        return dict(sorted(found.items()))

    return {"vgpr": field(r"; NumVgprs: (\d+)"), "agpr": field(r"; NumAgprs: (\d+)"),
            "total_vgpr": field(r"; TotalNumVgprs: (\d+)"), "sgpr": field(r"\.sgpr_count:\s+(\d+)"),
            "scratch": field(r"; ScratchSize: (\d+)"), "spills": field(r"\.vgpr_spill_count:\s+(\d+)"),
            "waves_per_simd": field(r"; Occupancy: (\d+)"), "mfma": counts(r"\bv_mfma\w*"),
            "cvt": counts(r"\bv_cvt\w*(?:fp8|bf8|fp4|f8|scale)\w*")}


def _gates(arch: str, gpu: AmdGpu, kernel: dict) -> list[str]:
    """The ways one compiled kernel fails the check (a paged kernel's are its ragged twin's)."""
    c = kernel["constexprs"]
    failed = []
    if kernel["lds"] > gpu.lds_bytes:
        failed.append(f"LDS {kernel['lds']} B over the {gpu.name}'s {gpu.lds_bytes} B")
    if kernel["name"] == "mla_split_kernel":
        kv_format = c.get("KV_FORMAT")
        fast_fp8 = kv_format == "fp8" and not c.get("PRECISE")
        if (fast_fp8 or kv_format in ("mxfp4", "bf16")) and kernel["scratch"]:
            failed.append(f"{kernel['scratch']} B of scratch (register spills) in the {kv_format} kernel")
        if fast_fp8 and not any(re.search("fp8|f8f6f4", m) for m in kernel["mfma"]):
            failed.append(f"the fast FP8 score product is not on FP8 MFMAs (MFMAs: {kernel['mfma'] or 'none'})")
        if kv_format == "bf16" and not (kernel["mfma"] and all("bf16" in m for m in kernel["mfma"])):
            failed.append(f"the bf16 products are not all on bf16 MFMAs (MFMAs: {kernel['mfma'] or 'none'})")
        if c.get("SCALED_SCORES"):
            if not any(m.startswith("v_mfma_scale") for m in kernel["mfma"]):
                failed.append(f"the MXFP4 scores are not on scaled MFMAs (MFMAs: {kernel['mfma'] or 'none'})")
            if (kernel["waves_per_simd"] or 0) < 2:
                failed.append(f"{kernel['waves_per_simd']} wave per SIMD in the scaled MXFP4 kernel (2 wanted)")
    return failed


def run_worker(arch: str, submission: Path, spec: Cases) -> dict:
    for name in ("TRITON_INTERPRET", "MLA_BACKEND", "MLA_KV_FORMAT", "MLA_PRECISION", "MLA_VALIDATE",
                 "MLA_AITER_VARIANT"):  # the submission's defaults, but where a case sets one
        os.environ.pop(name, None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="amd-check-cache-")  # compile, never reuse
    import torch
    import triton
    from triton.runtime.driver import driver

    gpu = TARGETS[arch]
    launches: list = []
    driver.set_active(_offline_driver(arch, gpu, launches))
    S = _load_submission(submission)
    fp8 = getattr(torch, gpu.fp8)
    target = S.amd_triton_target(arch, gpu.cus)  # as the submission sees such a GPU
    plans: list = []  # every TritonDecode made, in order
    _on_amd_target(S, target, plans)
    cpu = torch.device("cpu")
    cases, errors = [], []
    llvm_log = Path(tempfile.mkdtemp(prefix="amd-check-")) / "stderr"

    def one_case(label: str, fn, want: dict | None = None) -> None:
        """Runs fn; an error, LLVM error output, or (want: what its plans must be) a plan of another kind fails it."""
        first, first_plan, start = len(launches), len(plans), time.monotonic()
        try:
            with _stderr_to(llvm_log):
                fn()
            problem = None
        except Exception as e:  # the gate "an error in a launch path": reported by name, with where it came from
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb)
                          if f.filename == str(submission)), "")
            problem = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''} {where}"
        noise = [line for line in llvm_log.read_text(errors="replace").splitlines() if LLVM_ERROR.search(line)]
        if noise:
            shown = next((line for line in noise if "error:" in line), noise[0])
            llvm = f"LLVM error output: {_llvm_error(shown)} ({len(noise)} lines)"
            problem = f"{problem}; {llvm}" if problem else llvm
        made = [{"layout": "paged" if d.key.page_size else "ragged", "page_size": d.key.page_size,
                 "write_lse": d.key.write_lse, "kv_format": d.key.kv_format, "precise": d.key.precise,
                 "schedule": "balanced" if d.balanced else "fixed", "plan": d.key.plan._asdict()}
                for d in plans[first_plan:]]
        if want is not None and not problem:
            other = [m for m in made if any(m[k] != v for k, v in want.items())]
            if other or not made:
                got = ", ".join(f"{ {k: m[k] for k in want} }" for m in other) or "none"
                problem = f"the call's triton plans are not the kind it is for ({want}): {got}"
        if problem:
            errors.append(f"{label}: {problem}")
        cases.append({"case": label, "kernels": sorted({h for h, _ in launches[first:]}), "plans": made,
                      "error": problem, "seconds": round(time.monotonic() - start, 2)})

    shapes, modes, library = spec
    for mode in modes:  # the leaderboard's call: custom_kernel on the runner's ragged input
        kv_format, precision = MODES[mode]
        if kv_format not in getattr(S, "LEADERBOARD_KV_FORMATS", ("fp8", "mxfp4")):
            continue
        for batch, kv_len in shapes:
            def leaderboard(batch=batch, kv_len=kv_len, kv_format=kv_format, precision=precision):
                data = _leaderboard_input(batch, kv_len, kv_format, fp8)
                with _environ(MLA_BACKEND="triton", MLA_KV_FORMAT=kv_format, MLA_PRECISION=precision):
                    for _ in range(2):  # the JIT, then the bound launchers of the compiled kernels
                        S.custom_kernel(data)
            one_case(f"triton {mode} {batch}x{kv_len}", leaderboard, {"layout": "ragged", "write_lse": False,
                     "kv_format": kv_format, "precise": precision == "precise", "schedule": "fixed"})
    for mode in modes:  # the library's call, with the LSE
        kv_format, precision = MODES[mode]
        for (batch, kv_len, page_size, *serving), schedule in itertools.product(library, SCHEDULES):
            q_len, heads = serving or (1, 16)

            def library_call(batch=batch, kv_len=kv_len, kv_format=kv_format, precision=precision,
                             page_size=page_size, q_len=q_len, heads=heads, schedule=schedule):
                _library_call(S, batch, kv_len, kv_format, precision, page_size, fp8, q_len, heads, schedule)
            layout = f"page {page_size}" if page_size else "ragged"
            shape = " q_len {} x {} heads".format(*serving) if serving else ""
            cut = "" if schedule == SCHEDULES[0] else f" {schedule}"  # the default's label names none
            one_case(f"library {mode} {layout} lse {batch}x{kv_len}{shape}{cut}", library_call,
                     {"page_size": page_size, "write_lse": True, "kv_format": kv_format,
                      "precise": precision == "precise", "schedule": schedule})
    if gpu.fp8 == "float8_e4m3fn":  # the aiter path's Q quantizer runs Triton for e4m3fn only (see QQuantizer)
        for batch in sorted({b for b, _ in shapes}):
            def quantize(batch=batch):
                quantizer = S.QQuantizer(batch, fp8, cpu, target=target)
                q = torch.empty((batch, 16, 576), dtype=torch.bfloat16)
                for _ in range(2):
                    quantizer(q)
                if not quantizer.blocks:
                    raise RuntimeError("QQuantizer fell back to torch ops: its Triton kernels failed")
            one_case(f"Q quantizer batch {batch}", quantize)

    kernels = []
    for name in KERNELS:
        fn = getattr(S, name, None)
        for compiled in (fn.device_caches[0][0].values() if fn is not None and fn.device_caches else ()):
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            constexprs = {}
            for path, value in compiled.src.constants.items():  # keyed by argument position: (index,) tuples
                index = path[0] if isinstance(path, tuple) else path
                arg = fn.arg_names[index] if isinstance(index, int) else str(index)
                constexprs[arg] = value if isinstance(value, (int, float, str, bool)) else str(value)
            kernel = {"name": name, "hash": compiled.hash, "constexprs": constexprs,
                      "num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages,
                      "lds": compiled.metadata.shared, **_asm_figures(compiled.asm["amdgcn"])}
            kernel["cases"] = [c["case"] for c in cases if compiled.hash in c["kernels"]]
            kernel["failed"] = _gates(arch, gpu, kernel)
            kernels.append(kernel)
    return {"target": arch, "gpu": gpu._asdict(), "triton": triton.__version__, "triton_file": triton.__file__,
            "cases": cases, "errors": errors, "kernels": kernels}


def _twin(kernel: dict) -> tuple | None:
    """What a split kernel's ragged twin shares with it: all but the layout, the LSE and the split count."""
    if kernel["name"] != "mla_split_kernel":
        return None
    c = kernel["constexprs"]
    return (c.get("KV_FORMAT"), bool(c.get("PRECISE")), bool(c.get("SCALED_SCORES")), c.get("BLOCK_N"),
            kernel["num_warps"], kernel["num_stages"])


def _one_split(kernel: dict) -> bool:
    """Whether a split kernel writes every output itself (one split; the balanced kernel writes partials too)."""
    return kernel["constexprs"].get("NUM_SPLITS") == 1 and not kernel["constexprs"].get("BALANCED")


def _twin_notes(kernels: list[dict]) -> list[str]:
    """Where a paged or LSE-writing split kernel has fewer waves per SIMD, more scratch or VGPR_NOTE more VGPRs than
    every compiled ragged twin without the LSE (the leaderboard's; of its own kind of store, one split or several,
    where there is one)."""
    ragged: dict = {}
    for k in kernels:
        if _twin(k) is not None and not k["constexprs"].get("PAGE_SIZE") and not k["constexprs"].get("WRITE_LSE"):
            ragged.setdefault(_twin(k), []).append(k)
    notes = []
    for k in kernels:
        c = k["constexprs"]
        if _twin(k) is None or not (c.get("PAGE_SIZE") or c.get("WRITE_LSE")):
            continue
        twins = ragged.get(_twin(k), [])
        one_split = _one_split(k)  # another store path: a twin of the same kind where there is one
        twins = [t for t in twins if _one_split(t) == one_split] or twins
        if not twins:
            continue
        worse = []
        for field, what, margin in (("waves_per_simd", "waves/SIMD", -1), ("scratch", "scratch B", 1),
                                    ("total_vgpr", "VGPRs", VGPR_NOTE)):
            twin = (max if margin > 0 else min)(t[field] or 0 for t in twins)  # worse than every twin
            if (k[field] or 0) >= twin + margin if margin > 0 else (k[field] or 0) <= twin + margin:
                worse.append(f"{what} {twin} -> {k[field]}")
        if worse:
            cut = "balanced" if c.get("BALANCED") else f"{c.get('NUM_SPLITS')} splits"
            notes.append(f"{_describe(k)}, {cut}: worse than its ragged twin: "
                         + ", ".join(worse))
    return notes


# --- the parent: one worker per (Triton, target), one table ------------------------------------------------


def _describe(kernel: dict) -> str:
    """What a compiled kernel is, but for its split count (which changes none of its figures but the combine's)."""
    c = kernel["constexprs"]
    layout = (f"page {c['PAGE_SIZE']}" if c.get("PAGE_SIZE") else "ragged") + (" lse" if c.get("WRITE_LSE") else "")
    if (c.get("Q_LEN", 1), c.get("NUM_HEADS", 16)) != (1, 16):  # a serving shape's query rows
        layout += f", q_len {c.get('Q_LEN', 1)}{' causal' if c.get('CAUSAL') else ''} x {c.get('NUM_HEADS', 16)} heads"
    if c.get("BALANCED"):  # the schedule's pieces (their splits column: -)
        layout += ", balanced"
    if kernel["name"] == "mla_split_kernel":
        mode = c.get("KV_FORMAT", "?") + (" precise" if c.get("PRECISE") and c.get("KV_FORMAT") == "fp8" else "") + (
            " dot_scaled" if c.get("SCALED_SCORES") else "")
        return (f"split {mode}, {layout}, block_n {c.get('BLOCK_N')}, {kernel['num_warps']} warps, "
                f"{kernel['num_stages']} stages")
    if kernel["name"] == "mla_combine_kernel":
        return f"combine, {layout}, block_dv {c.get('BLOCK_DV')}"
    return kernel["name"].strip("_").replace("_kernel", "")


def _short(counts: dict) -> str:
    return ", ".join(f"{name} x{n}" for name, n in counts.items()) or "-"


def report(result: dict) -> str:
    """The worker's result as a Markdown table: one row per kind of kernel and figures, with the split counts it was
    compiled for."""
    gpu = result["gpu"]
    rows: dict = {}
    for k in sorted(result["kernels"], key=lambda k: (KERNELS.index(k["name"]), _describe(k))):
        verdict = "FAIL: " + "; ".join(k["failed"]) if k["failed"] else "pass"
        cells = (_describe(k), f"{k['vgpr']}+{k['agpr']} ({k['total_vgpr']})", str(k["sgpr"]), str(k["scratch"]),
                 f"{k['lds']} / {gpu['lds_bytes']}", str(k["waves_per_simd"]), _short(k["mfma"]), _short(k["cvt"]),
                 verdict)
        c = k["constexprs"]
        rows.setdefault(cells, set()).add(None if c.get("BALANCED") else c.get("NUM_SPLITS"))
    seconds = sum(c.get("seconds", 0) for c in result["cases"])
    lines = [f"## {result['target']} ({gpu['name']}: {gpu['cus']} CUs, {gpu['lds_bytes']} B LDS), "
             f"Triton {result['triton']}: {len(result['cases'])} calls, {seconds:.0f} s",
             "| kernel | splits | VGPR arch+acc (total) | SGPR | scratch B | LDS B | waves/SIMD | MFMA "
             "| FP8/FP4 cvt | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cells, splits in rows.items():
        counts = ", ".join(str(n) for n in sorted(x for x in splits if x is not None)) or "-"
        lines.append("| " + " | ".join((cells[0], counts) + cells[1:]) + " |")
    for note in result.get("notes", ()):
        lines.append(f"NOTE {note}")
    for error in result["errors"]:
        lines.append(f"FAIL {error}")
    return "\n".join(lines)


def _triton_env(triton: str) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if triton != "env":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(triton).resolve()), env.get("PYTHONPATH")) if p)
    return env


def _worker(triton: str, arch: str, submission: Path, cases: Cases) -> tuple[dict | None, str | None]:
    """(the worker's result, None), or (None, why it died)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", arch, "--out", str(out), "--submission",
               str(submission), *cases.argv()]
        proc = subprocess.run(cmd, env=_triton_env(triton), capture_output=True, text=True)
        if proc.returncode or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            return None, f"{arch} with Triton from {triton}: the worker died (exit {proc.returncode}):\n{tail}"
        return json.loads(out.read_text()), None


def run_all(tritons, targets, submission: Path, cases: Cases, jobs: int, library_every_triton: bool = False
            ) -> tuple[list[dict], list[str]]:
    """Worker processes, `jobs` at a time: per (Triton, target) one for the leaderboard's cases and one for the
    library's (with the first Triton only, unless library_every_triton), so that the CPUs share the work; the parts
    of one Triton and target merged into one result, in the order of `tritons` and `targets`."""
    runs = []
    for i, triton in enumerate(tritons):
        for arch in targets:
            library = cases.library if i == 0 or library_every_triton else ()
            if cases.shapes or not library:
                runs.append((i, triton, arch, cases._replace(library=())))
            if library:
                runs.append((i, triton, arch, Cases((), cases.modes, library)))
    # the longest first: gfx942's compiles are the slow ones, then the library's, then the later Tritons' (3.9)
    runs.sort(key=lambda run: (run[2] != "gfx942", not run[3].library, -run[0]))
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(lambda run: _worker(run[1], run[2], submission, run[3]), runs))
    merged: dict = {}
    failures = []
    in_order = sorted(zip(runs, done, strict=True), key=lambda x: (x[0][0], targets.index(x[0][2])))
    for (i, _, arch, _), (result, died) in in_order:
        if died:
            failures.append(died)
            continue
        whole = merged.setdefault((i, arch), result)
        if whole is not result:
            whole["cases"] += result["cases"]
            whole["errors"] += result["errors"]
            known = {k["hash"]: k for k in whole["kernels"]}
            for k in result["kernels"]:
                if k["hash"] in known:
                    known[k["hash"]]["cases"] += k["cases"]
                else:
                    whole["kernels"].append(k)
    results = list(merged.values())
    for result in results:
        result["notes"] = _twin_notes(result["kernels"])
        print(report(result), flush=True)
        print(flush=True)
        arch, version = result["target"], result["triton"]
        failures += [f"{arch}, Triton {version}: {e}" for e in result["errors"]]
        failures += [f"{arch}, Triton {version}: {_describe(k)}: {f}" for k in result["kernels"] for f in k["failed"]]
        if not result["kernels"]:
            failures.append(f"{arch}, Triton {version}: no kernel was compiled")
    return results, failures


def _shapes(text: str):
    """"4x1024,..." (or with a third figure, the library's page size) -> ((4, 1024), ...)."""
    return tuple(tuple(int(x) for x in s.split("x")) for s in text.split(",") if s)


def _unshapes(shapes) -> str:
    return ",".join("x".join(map(str, shape)) for shape in shapes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", action="append", metavar="DIR|env",
                    help="a folder holding the Triton package to compile with, or env (this Python's); repeatable")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {tuple(TARGETS)}")
    ap.add_argument("--submission", type=Path, default=ROOT / "submission.py")
    ap.add_argument("--shapes", type=_shapes, default=SHAPES,
                    help="the leaderboard's: batch x kv length, comma-separated (empty: none)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {tuple(MODES)}")
    ap.add_argument("--library", type=_shapes, default=LIBRARY_CASES,
                    help="the library call's: batch x kv length x page size (0: ragged) [x q_len x heads], "
                         "comma-separated (empty: none)")
    ap.add_argument("--library-every-triton", action="store_true",
                    help="the library's cases with every --triton (default: the first only)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="workers at a time (default: the CPUs)")
    ap.add_argument("--worker", metavar="TARGET", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    targets = [t for t in args.targets.split(",") if t]
    for name, given, known in (("--modes", modes, MODES), ("--targets", targets, TARGETS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"{name}: unknown {unknown}; expected some of {tuple(known)}")
    for name, given, sizes in (("--shapes", args.shapes, (2,)), ("--library", args.library, (3, 5))):
        if any(len(case) not in sizes or min(case) < 0 for case in given):
            forms = " or ".join("x".join("BNPLH"[:size]) for size in sizes)
            ap.error(f"{name}: expected {forms} of figures >= 0, got {_unshapes(given)}")
    if any(len(case) == 5 and (case[3] < 1 or case[4] < 1) for case in args.library):
        ap.error(f"--library: q_len >= 1 and heads >= 1 expected, got {_unshapes(args.library)}")
    cases = Cases(args.shapes, modes, args.library)
    if args.worker:
        args.out.write_text(json.dumps(run_worker(args.worker, args.submission.resolve(), cases)))
        return 0
    results, failures = run_all(args.triton or ["env"], targets, args.submission.resolve(), cases, args.jobs,
                                args.library_every_triton)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if failures:
        print(f"amd-check: FAIL ({len(failures)})")
        for failure in failures:
            print(f"  {failure}")
        return 1
    print(f"amd-check: pass ({sum(len(r['kernels']) for r in results)} kernels, "
          f"{', '.join(sorted({r['target'] + ' Triton ' + r['triton'] for r in results}))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
