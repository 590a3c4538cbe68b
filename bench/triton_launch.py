"""What one Triton launch costs on the host, by the path it takes: most of the triton backend's host time.

On a GPU, the triton backend's split kernel as the 4x1024 FP8 ragged plan launches it (its real argument list: 13
arguments, 11 constexprs), timed on the CPU's clock over back-to-back launches (median µs per launch of --samples
samples of --launches launches each, a synchronize between samples), by path:
  jit            mla_split_kernel[grid](tensors, constexprs by keyword): Triton's JIT dispatch (argument binding,
                 the specialization key, the cache lookup), then the launcher
  compiled       compiled[grid](tensors, constexprs): the compiled kernel's runner, made per launch
  runner         the runner made once, called with the tensors
  runner ints    the runner made once, called with the tensors' addresses (what the backend does): the launcher's
                 data_ptr() call and pointer query per tensor skipped
  raw launcher   the launcher alone (compiled.run with the current queue's handle, no hooks): what is left of any
                 Triton launch from Python. submission.py cannot call it: the leaderboard refuses a file naming the
                 API that gives that handle
and for scale: an empty Triton kernel through its runner, q.new_empty of the output, the plan's launch (TritonDecode
.run: split and combine), its checked run (run_ragged, which allocates the output), and custom_kernel with the triton
backend. The kernel itself is reached as mla_decode.triton.kernels.mla_split_kernel: what is timed is its launch.

Usage:  python3 bench/triton_launch.py [--launches 20] [--samples 50] [--json P]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference as R  # noqa: E402
import submission as S  # noqa: E402
from mla_decode.triton import kernels as K  # noqa: E402
from testkit.calls import ragged_call  # noqa: E402
from utils import scoped_env  # noqa: E402

if K.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(x_ptr, n, BLOCK: tl.constexpr):  # Triton resolves `tl` among the module's globals
        pass


def per_launch_us(fn, launches: int, samples: int) -> float:
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / launches)
    torch.cuda.synchronize()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or K.triton is None:
        print("triton_launch: needs a CUDA GPU and triton")
        return 1
    data = R.generate_input(4, 1, 1024, seed=4220)
    q, kv_data, qo, kvp, config = data
    kv, scale = kv_data["fp8"]
    decode, checked_run = ragged_call(data, "fp8", schedule="fixed")  # the leaderboard's uniform batch: fixed splits
    launch = decode.impl  # the plan's TritonDecode
    q4, out = q.view(4, 1, 16, -1), q.new_empty((4, 1, 16, 512))
    part_o, part_lse = launch.workspace()[:2]
    tensors = (q4, kv, scale, 0, kvp, kvp, 0, kv.shape[0], out, out, part_o, part_lse, kvp, launch.qk_scale)
    addresses = tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in tensors)
    grid = launch.split_grid
    compiled = K.mla_split_kernel[grid](*tensors, **launch.split_meta)
    runner = compiled[grid]
    empty = empty_kernel[(1, 1, 1)](out, 1, BLOCK=16)
    empty_runner = empty[(1, 1, 1)]
    stream = torch.cuda.current_stream().cuda_stream

    def raw():
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *addresses, *launch.split_consts)

    rows = {
        "jit": lambda: K.mla_split_kernel[grid](*tensors, **launch.split_meta),
        "compiled": lambda: compiled[grid](*tensors, *launch.split_consts),
        "runner": lambda: runner(*tensors, *launch.split_consts),
        "runner ints": lambda: runner(*addresses, *launch.split_consts),
        "raw launcher": raw,
        "empty kernel, runner": lambda: empty_runner(out, 1, 16),
        "q.new_empty (the output)": lambda: q.new_empty((4, 1, 16, 512)),
        "TritonDecode.run (2 launches)": lambda: launch.run(q4, kv, scale, kvp, None, out, None),
        "run_ragged (checks, output, 2 launches)": checked_run,
    }
    results = {}
    with scoped_env({"MLA_BACKEND": "triton", "MLA_KV_FORMAT": "fp8"}):
        S.custom_kernel(data)
        rows["custom_kernel (triton)"] = lambda: S.custom_kernel(data)
        print(f"host µs per launch (median of {args.samples} x {args.launches} back to back); "
              f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
        for name, fn in rows.items():
            try:
                fn()
                results[name] = per_launch_us(fn, args.launches, args.samples)
                print(f"{name:36} {results[name]:8.2f}", flush=True)
            except Exception as e:  # a path this triton does not have
                results[name] = None
                print(f"{name:36} n/a: {type(e).__name__}: {str(e)[:100]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
