"""The offline AMD compile check: every Triton kernel of a submission file built for AMD GPUs on a CPU, through the
submission's own launch path, with the numbers and the gates that say whether it can run there.

    python tools/amd_check.py [--triton DIR|env ...] [--targets gfx950,gfx942] [--submission FILE]
                              [--shapes 4x1024,...] [--modes fp8-fast,...] [--json PATH]

For each Triton (`--triton`: a folder holding a Triton package, such as the runner's 3.6.0 installed with `pip install
--target`, or `env`, the one this Python imports) and each target it starts one worker process (Triton 3.6 carries
state from one AMD target to the next inside a process). The worker puts an offline driver in place of Triton's: it
answers for an AMD GPU of that architecture (its CU count and LDS size) and launches nothing. Then it runs the
triton backend's launch path (`_triton_run` on a `TritonKey` for that target, twice: the JIT, then the compiled
kernels' bound launchers) for every leaderboard shape and mode, and the aiter path's Q quantizer where it uses
Triton (gfx950, whose FP8 is e4m3fn), on CPU tensors of the real shapes and dtypes (never written: the driver
launches nothing). So the JIT specializes, packs the launch options and compiles exactly as on the GPU: an option
the target's backend refuses, a conversion it cannot lower and an LDS size over the GPU's (Triton's own load check,
with the driver's figure) fail here.

Per compiled kernel it prints VGPRs (arch + acc), SGPRs, scratch, LDS against the limit, waves per SIMD and the
matrix (MFMA) and FP8/FP4 conversion instructions. It fails (exit status 1) on: an error anywhere in a launch path;
LLVM error output; scratch in the fast FP8 or the MXFP4 split kernel; LDS over the target's; a
fast FP8 score product not on FP8 MFMAs; an MXFP4 score product by tl.dot_scaled (gfx950) not on scaled MFMAs or
under 2 waves per SIMD.

It uses Triton internals (the driver's interface, the JIT's caches, `asm["amdgcn"]`) as Triton 3.6.0 and 3.9.0 have
them; `make amd-check` runs it with both.
"""

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
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
MODES = {"fp8-fast": ("fp8", False), "fp8-precise": ("fp8", True), "mxfp4": ("mxfp4", False)}
KERNELS = ("_mla_split_kernel", "_mla_combine_kernel", "_q_absmax_kernel", "_q_quantize_kernel")
WAVE = 64
# LLVM's and Triton's error lines, as they print them to the process's stderr (Triton 3.9 prints such errors for
# code it could not lower and still returns a binary).
LLVM_ERROR = re.compile(r"LLVM ERROR|error:|couldn't allocate", re.IGNORECASE)


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


def _inputs(S, batch: int, kv_len: int, kv_format: str, fp8):
    """CPU tensors of a leaderboard call's shapes and dtypes, allocated and never written (nothing reads them)."""
    import torch

    total_kv = batch * kv_len
    q = torch.empty((batch, S.NUM_HEADS, S.QK_HEAD_DIM), dtype=torch.bfloat16)
    kv_indptr = torch.arange(0, total_kv + 1, kv_len, dtype=torch.int32)
    if kv_format == "fp8":
        kv, scale = torch.empty((total_kv, 1, S.QK_HEAD_DIM), dtype=fp8), torch.ones(1)
    else:  # the runner's layout: scales padded to (256-row multiple, 24)
        kv = torch.empty((total_kv, 1, S.QK_HEAD_DIM // 2), dtype=torch.uint8)
        scale = torch.empty((-(-total_kv // 256) * 256, 24), dtype=torch.uint8)
    config = {"kv_seq_len": kv_len, "sm_scale": S.QK_HEAD_DIM ** -0.5}
    return q, kv, scale, kv_indptr, config


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
    """The ways one compiled kernel fails the check."""
    c = kernel["constexprs"]
    failed = []
    if kernel["lds"] > gpu.lds_bytes:
        failed.append(f"LDS {kernel['lds']} B over the {gpu.name}'s {gpu.lds_bytes} B")
    if kernel["name"] == "_mla_split_kernel":
        fast_fp8 = c.get("KV_FORMAT") == "fp8" and not c.get("PRECISE")
        if (fast_fp8 or c.get("KV_FORMAT") == "mxfp4") and kernel["scratch"]:
            failed.append(f"{kernel['scratch']} B of scratch (register spills) in the {c.get('KV_FORMAT')} kernel")
        if fast_fp8 and not any(re.search("fp8|f8f6f4", m) for m in kernel["mfma"]):
            failed.append(f"the fast FP8 score product is not on FP8 MFMAs (MFMAs: {kernel['mfma'] or 'none'})")
        if c.get("SCALED_SCORES"):
            if not any(m.startswith("v_mfma_scale") for m in kernel["mfma"]):
                failed.append(f"the MXFP4 scores are not on scaled MFMAs (MFMAs: {kernel['mfma'] or 'none'})")
            if (kernel["waves_per_simd"] or 0) < 2:
                failed.append(f"{kernel['waves_per_simd']} wave per SIMD in the scaled MXFP4 kernel (2 wanted)")
    return failed


def run_worker(arch: str, submission: Path, shapes, modes) -> dict:
    os.environ.pop("TRITON_INTERPRET", None)
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
    cpu = torch.device("cpu")
    cases, errors = [], []
    llvm_log = Path(tempfile.mkdtemp(prefix="amd-check-")) / "stderr"

    def one_case(label: str, fn) -> None:
        first = len(launches)
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
            problem = (problem + "; " if problem else "") + f"LLVM error output: {noise[0][:200]} ({len(noise)} lines)"
        if problem:
            errors.append(f"{label}: {problem}")
        cases.append({"case": label, "kernels": sorted({h for h, _ in launches[first:]}), "error": problem})

    for mode in modes:
        kv_format, precise = MODES[mode]
        for batch, kv_len in shapes:
            def run(batch=batch, kv_len=kv_len, kv_format=kv_format, precise=precise):
                q, kv, scale, kv_indptr, config = _inputs(S, batch, kv_len, kv_format, fp8)
                key = S._triton_key(q, kv, scale, config, kv_format, precise, None)._replace(target=target)
                for _ in range(2):  # the JIT, then the bound launchers of the compiled kernels
                    S._triton_run(key, q, kv, scale, kv_indptr, S.qk_scale_of(config))
            one_case(f"triton {mode} {batch}x{kv_len}", run)
    if gpu.fp8 == "float8_e4m3fn":  # the aiter path's Q quantizer runs Triton for e4m3fn only (see QQuantizer)
        for batch in sorted({b for b, _ in shapes}):
            def quantize(batch=batch):
                quantizer = S.QQuantizer(batch, fp8, cpu, target=target)
                q = torch.empty((batch, S.NUM_HEADS, S.QK_HEAD_DIM), dtype=torch.bfloat16)
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


# --- the parent: one worker per (Triton, target), one table ------------------------------------------------


def _describe(kernel: dict) -> str:
    """What a compiled kernel is, but for its split count (which changes none of its figures but the combine's)."""
    c = kernel["constexprs"]
    if kernel["name"] == "_mla_split_kernel":
        mode = c.get("KV_FORMAT", "?") + (" precise" if c.get("PRECISE") and c.get("KV_FORMAT") == "fp8" else "") + (
            " dot_scaled" if c.get("SCALED_SCORES") else "")
        return f"split {mode}, block_n {c.get('BLOCK_N')}, {kernel['num_warps']} warps, {kernel['num_stages']} stages"
    if kernel["name"] == "_mla_combine_kernel":
        return f"combine, block_dv {c.get('BLOCK_DV')}"
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
        rows.setdefault(cells, set()).add(k["constexprs"].get("NUM_SPLITS"))
    lines = [f"## {result['target']} ({gpu['name']}: {gpu['cus']} CUs, {gpu['lds_bytes']} B LDS), "
             f"Triton {result['triton']}",
             "| kernel | splits | VGPR arch+acc (total) | SGPR | scratch B | LDS B | waves/SIMD | MFMA "
             "| FP8/FP4 cvt | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cells, splits in rows.items():
        counts = ", ".join(str(n) for n in sorted(x for x in splits if x is not None)) or "-"
        lines.append("| " + " | ".join((cells[0], counts) + cells[1:]) + " |")
    for error in result["errors"]:
        lines.append(f"FAIL {error}")
    return "\n".join(lines)


def _triton_env(triton: str) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if triton != "env":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(triton).resolve()), env.get("PYTHONPATH")) if p)
    return env


def _worker(triton: str, arch: str, submission: Path, shapes, modes) -> tuple[dict | None, str | None]:
    """(the worker's result, None), or (None, why it died)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", arch, "--out", str(out), "--submission",
               str(submission), "--shapes", ",".join(f"{b}x{n}" for b, n in shapes), "--modes", ",".join(modes)]
        proc = subprocess.run(cmd, env=_triton_env(triton), capture_output=True, text=True)
        if proc.returncode or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            return None, f"{arch} with Triton from {triton}: the worker died (exit {proc.returncode}):\n{tail}"
        return json.loads(out.read_text()), None


def run_all(tritons, targets, submission: Path, shapes, modes, jobs: int) -> tuple[list[dict], list[str]]:
    """One worker process per (Triton, target), `jobs` at a time; the results in that order."""
    runs = [(triton, arch) for triton in tritons for arch in targets]
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(lambda run: _worker(*run, submission, shapes, modes), runs))
    results, failures = [], []
    for result, died in done:
        if died:
            failures.append(died)
            continue
        results.append(result)
        print(report(result), flush=True)
        print(flush=True)
        arch, version = result["target"], result["triton"]
        failures += [f"{arch}, Triton {version}: {e}" for e in result["errors"]]
        failures += [f"{arch}, Triton {version}: {_describe(k)}: {f}" for k in result["kernels"] for f in k["failed"]]
        if not result["kernels"]:
            failures.append(f"{arch}, Triton {version}: no kernel was compiled")
    return results, failures


def _shapes(text: str):
    return tuple(tuple(int(x) for x in s.split("x")) for s in text.split(",") if s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", action="append", metavar="DIR|env",
                    help="a folder holding the Triton package to compile with, or env (this Python's); repeatable")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {tuple(TARGETS)}")
    ap.add_argument("--submission", type=Path, default=ROOT / "submission.py")
    ap.add_argument("--shapes", type=_shapes, default=SHAPES, help="batch x kv length, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {tuple(MODES)}")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="workers at a time (default: the CPUs)")
    ap.add_argument("--worker", metavar="TARGET", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    targets = [t for t in args.targets.split(",") if t]
    for name, given, known in (("--modes", modes, MODES), ("--targets", targets, TARGETS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"{name}: unknown {unknown}; expected some of {tuple(known)}")
    if args.worker:
        args.out.write_text(json.dumps(run_worker(args.worker, args.submission.resolve(), args.shapes, modes)))
        return 0
    results, failures = run_all(args.triton or ["env"], targets, args.submission.resolve(), args.shapes, modes,
                                args.jobs)
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
