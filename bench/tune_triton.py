"""Tune and check the triton backend on one GPU, in one process (one device call).

    PYTHONUNBUFFERED=1 python bench/tune_triton.py [--out DIR] [--formats fp8,mxfp4] [--shapes 4x1024,...]
        [--configs 64:4:3,64:4:2] [--splits 1,2,4,...] [--reps 30]
    MLA_TUNE_MODULE=path/to/variant.py ... times a variant of submission.py (its plan_ragged) instead

For every leaderboard shape (batch x kv), KV format, launch config (block_n:num_warps:num_stages) and split
count (fixed splits: the adapter's plan for the leaderboard's uniform batches): checks the output against fp32
attention over what the kernel reads (testkit.attention; rel-L2, no NaN) and times the library's ragged plan's run
the leaderboard's way (utils.Timer.leaderboard: L2 flushed before each call, CUDA events around the one call;
median). Then, for the default plan (triton_plan): check_implementation
against the BF16
truth, the flushed time, the back-to-back time without a flush (utils.Timer.back_to_back: wall time of a loop of
calls and one synchronize, per call) and the host time of one call (utils.Timer.host: median CPU time to return).
Writes every record to DIR/tune.jsonl and prints a short table last. On Hopper with Triton 3.6 the fast FP8 configs of
4 warps run the Hopper kernel (mla_decode/triton/hopper.py), whose e4m3 P is ~1e-2 from fp32: give --max-rel 2e-2.
"""

import argparse
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference as R  # noqa: E402
from testkit.attention import triton_reference as kernel_reference  # noqa: E402
from testkit.calls import ragged_call  # noqa: E402
from utils import Timer  # noqa: E402

# MLA_TUNE_MODULE=path/x.py times a variant of submission.py (an experiment kept out of the repository)
if os.environ.get("MLA_TUNE_MODULE"):
    _spec = importlib.util.spec_from_file_location("mla_variant", os.environ["MLA_TUNE_MODULE"])
    S = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(S)
else:
    import mla_decode as S  # noqa: E402

SHAPES = ((4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192))
CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 8, 2), (64, 8, 2))
SPLITS = (1, 2, 4, 8, 16, 32, 64)
KERNEL_REL_L2 = 5e-3  # vs fp32 attention over what the kernel reads: bf16 output rounding is ~2-3e-3


def _compile_worker(jobs: list) -> int:
    """Compiles (fmt, plan) variants by running them once on a tiny input with the same dtypes, strides and
    divisibility as the real ones (Triton's cache key); the main process then loads them from the disk cache."""
    data = R.generate_varlen_input([16, 16], seed=0)
    for fmt, plan in jobs:
        try:
            ragged_call(data, fmt, plan=plan, library=S, schedule="fixed")[1]()
        except Exception:  # reported by the main process when it runs the variant
            pass
    torch.cuda.synchronize()
    return len(jobs)


def precompile(variants: list, workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    chunks = [variants[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        done = sum(pool.map(_compile_worker, [c for c in chunks if c]))
    print(f"precompiled {done} variants with {workers} processes in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--formats", default="fp8,mxfp4")
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    ap.add_argument("--configs", default=",".join(":".join(map(str, c)) for c in CONFIGS))
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-rel", type=float, default=KERNEL_REL_L2, help="rel-L2 vs tests' kernel_reference")
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling the variants up front")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "tune.jsonl", "a")
    props = torch.cuda.get_device_properties(0)
    import triton

    print(f"device {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton "
          f"{triton.__version__}; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    configs = [tuple(map(int, c.split(":"))) for c in args.configs.split(",")]
    split_list = [int(s) for s in args.splits.split(",")]
    summary = []
    timer = Timer(torch.device("cuda"))
    variants = {(fmt, (sp, *c)) for fmt in args.formats.split(",") for c in configs for sp in split_list}
    if args.jobs > 1:
        precompile(sorted(variants), args.jobs)
    for batch, kv_len in shapes:
        data = R.generate_input(batch, 1, kv_len, seed=1000 + batch + kv_len)
        for fmt in args.formats.split(","):
            ref32 = kernel_reference(data, fmt)
            best = (math.inf, None)
            for block_n, warps, stages in configs:
                for splits in split_list:
                    if splits > 1 and kv_len // splits < block_n:
                        continue
                    plan = (splits, block_n, warps, stages)

                    fn = ragged_call(data, fmt, plan=plan, library=S, schedule="fixed")[1]
                    t0 = time.perf_counter()
                    try:
                        out = fn()
                        torch.cuda.synchronize()
                    except Exception as e:  # a config that does not compile or launch (e.g. out of resources)
                        rec = dict(shape=[batch, kv_len], fmt=fmt, plan=plan, error=repr(e)[:300])
                        print(rec)
                        log.write(json.dumps(rec) + "\n")
                        continue
                    first_s = time.perf_counter() - t0
                    rel = R.relative_l2(out, ref32)
                    nan = bool(out.isnan().any())
                    us = statistics.median(timer.leaderboard(fn, args.reps))
                    rec = dict(shape=[batch, kv_len], fmt=fmt, plan=plan, us=us, rel_l2_deq=rel, nan=nan,
                               first_call_s=first_s)
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    ok = rel < args.max_rel and not nan
                    print(f"{batch:4d}x{kv_len:<5d} {fmt:5s} plan={plan} {us:8.1f} us rel={rel:.2e}"
                          f"{'' if ok else '  BAD'} (first call {first_s:.1f}s)")
                    if ok and us < best[0]:
                        best = (us, plan)
            # the default plan: strict gate vs the BF16 truth, flushed, back-to-back and host time
            os.environ["MLA_KV_FORMAT"] = fmt

            decode, fn_default = ragged_call(data, fmt, library=S, schedule="fixed")
            out = fn_default()
            ok, msg = R.check_implementation(data, out)
            plan = decode.impl.key.plan
            us = statistics.median(timer.leaderboard(fn_default, args.reps))
            b2b, host = timer.back_to_back(fn_default, 200), timer.host(fn_default, 200)
            rec = dict(shape=[batch, kv_len], fmt=fmt, default_plan=plan, us=us, b2b_us=b2b, host_us=host,
                       check=ok, check_msg=msg, rel_l2_deq=R.relative_l2(out, ref32), best_us=best[0],
                       best_plan=best[1])
            log.write(json.dumps(rec) + "\n")
            log.flush()
            summary.append(rec)
            print(f"DEFAULT {batch}x{kv_len} {fmt} plan={plan} {us:.1f} us (best {best[0]:.1f} {best[1]}), "
                  f"b2b {b2b:.1f} us, host {host:.1f} us; check {ok}: {msg}")
        data = ref32 = out = None  # free this shape's tensors
        torch.cuda.empty_cache()

    print("\nshape       fmt    default_us  best_us  best_plan          b2b_us  host_us  check  rel_l2_vs_bf16")
    for r in summary:
        rel = r["check_msg"].split("rel_l2=")[1].split()[0] if "rel_l2=" in r["check_msg"] else "?"
        print(f"{r['shape'][0]:4d}x{r['shape'][1]:<6d} {r['fmt']:6s} {r['us']:10.1f} {r['best_us']:8.1f}  "
              f"{str(r['best_plan']):18s} {r['b2b_us']:7.1f} {r['host_us']:8.1f}  {str(r['check']):5s}  {rel}")
    for fmt in args.formats.split(","):
        rows = [r for r in summary if r["fmt"] == fmt]
        if rows:
            g = math.exp(sum(math.log(r["us"]) for r in rows) / len(rows))
            gb = math.exp(sum(math.log(r["best_us"]) for r in rows) / len(rows))
            print(f"geomean {fmt}: default {g:.1f} us, best-per-shape {gb:.1f} us over {len(rows)} shapes")


if __name__ == "__main__":
    main()
