"""DRAM bytes one call reads, counted by Nsight Compute, against the bytes it must read (its cache format plus Q):
the proof that each KV byte is read once from HBM.

    python3 bench/ncu_bytes.py [--shape 256x8192] [--paths triton-fp8,triton-mxfp4,...] [--json PATH]

For each path it runs itself under `ncu --clock-control none --profile-from-start off --metrics dram__bytes_read.sum
--csv` (the clocks left alone); the child makes the input, warms the path up (compiles, caches the plan), and brackets
one call with cudaProfilerStart/Stop, so only that call's kernels are counted. Prints one row per path: the kernels'
DRAM bytes read, summed, the bytes the call must read (its cache: FP8 576 B a row + the scale, MXFP4 288 + 18 B a row;
Q: 16 x 576 bf16 per sequence), and their ratio.
"""

import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import mla_decode  # noqa: E402
import reference as R  # noqa: E402
import submission as S  # noqa: E402
from mla_decode.triton import triton_plan, triton_target  # noqa: E402

# name -> (backend, KV format, precision, plan override: None (submission.custom_kernel), or "scaled": the library's
# ragged triton plan with the scaled MXFP4 score product forced)
PATHS = {"triton-fp8": ("triton", "fp8", "fast", None), "triton-mxfp4": ("triton", "mxfp4", "fast", None),
         "triton-mxfp4-dot_scaled": ("triton", "mxfp4", "fast", "scaled"), "cuda-fp8": ("cuda", "fp8", "fast", None),
         "cuda-mxfp4": ("cuda", "mxfp4", "fast", None)}


def must_read(batch: int, kv: int, kv_format: str) -> int:
    cache = batch * kv * (R.QK_HEAD_DIM if kv_format == "fp8" else R.QK_HEAD_DIM // 2 + R.QK_HEAD_DIM // 32)
    return cache + batch * R.NUM_HEADS * R.QK_HEAD_DIM * 2


def child(path: str, batch: int, kv: int) -> None:
    """Under ncu: one profiled call of `path`."""
    backend, kv_format, precision, override = PATHS[path]
    os.environ.update(MLA_BACKEND=backend, MLA_KV_FORMAT=kv_format, MLA_PRECISION=precision)
    data = R.generate_input(batch, 1, kv, seed=batch + kv)
    q, kv_data, _, kvp, config = data
    if override == "scaled":
        codes, scales = kv_data["mxfp4"]
        plan = triton_plan(batch, kv, triton_target(q.device), "mxfp4")._replace(num_stages=1, scaled_scores=True)
        decode = mla_decode.plan_ragged(batch, codes.dtype, q.device, kv, backend="triton", precision=precision,
                                        softmax_scale=config["sm_scale"], return_lse=False,
                                        kv_scale_dtype=scales.dtype, kv_scale_stride=scales.stride(0),
                                        backend_options={"plan": plan})
        q4 = q.view(batch, 1, R.NUM_HEADS, R.QK_HEAD_DIM)

        def call():
            return decode.run_ragged(q4, codes, kvp, scales)[0]
    else:
        def call():
            return S.custom_kernel(data)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def measure(path: str, batch: int, kv: int) -> dict:
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--metrics", "dram__bytes_read.sum",
           "--csv", sys.executable, __file__, "--child", path, "--shape", f"{batch}x{kv}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    text = proc.stdout[proc.stdout.find('"ID"'):] if '"ID"' in proc.stdout else ""
    rows = [r for r in csv.DictReader(io.StringIO(text)) if r.get("Metric Name") == "dram__bytes_read.sum"]
    if proc.returncode or not rows:
        return {"path": path, "error": (proc.stderr or proc.stdout)[-600:]}
    scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    kernels = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1))
               for r in rows]
    read = sum(b for _, b in kernels)
    need = must_read(batch, kv, PATHS[path][1])
    return {"path": path, "kernels": kernels, "dram_bytes_read": read, "must_read": need, "ratio": read / need}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="256x8192")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    batch, kv = (int(x) for x in args.shape.split("x"))
    if args.child:
        child(args.child, batch, kv)
        return
    results = [measure(path, batch, kv) for path in args.paths.split(",")]
    print(f"DRAM bytes read by one call at {args.shape} (ncu dram__bytes_read.sum, summed over its kernels)")
    print("| path | kernels | DRAM bytes read | must read (cache + Q) | ratio |\n|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['path']} | error: {' '.join(r['error'].split())[:200]} | | | |")
            continue
        names = ", ".join(sorted({name.split("(")[0] for name, _ in r["kernels"]}))
        print(f"| {r['path']} | {names} | {r['dram_bytes_read']:,.0f} | {r['must_read']:,} | {r['ratio']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
