"""Where the host time of one custom_kernel call goes, with repeated and with fresh inputs.

The leaderboard hides the host path behind its flush, a serving loop does not: this splits one call into its stages
(validate, select_backend, the backend's forward) and times each on the CPU's clock (median µs, the GPU idle when
each call starts), for the same input every call ("repeated") and for a new input of the same shape every call
("fresh", as leaderboard mode generates them). The "gc off" columns repeat the fresh case with Python's garbage
collector disabled around the timed call, to tell a collection triggered by the input generation's allocations
from work the call itself does.

Usage:  python3 bench/host_path.py [--backends cuda,triton] [--shapes 4x1024,256x8192] [--iters 30] [--json P]
        python3 bench/host_path.py --dry-run      # the CPU: the torch backend on a tiny shape
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference as R  # noqa: E402
import submission as S  # noqa: E402
from utils import scoped_env  # noqa: E402

STAGES = ("validate", "select_backend", "forward", "call")


def forward_of(backend: str):
    """The backend's forward as custom_kernel calls it, on validate's outputs."""
    precise = S.select_precision() == "precise"
    if backend == "cuda":
        return lambda q, kv, scale, qo, kvp, config, fmt: S._cuda_package()[0].forward(q, kv, scale, qo, kvp, config,
                                                                                        fmt, precise)
    if backend == "triton":
        return lambda q, kv, scale, qo, kvp, config, fmt: S._triton_forward(q, kv, scale, qo, kvp, config, fmt,
                                                                            precise=precise)
    if backend == "torch":
        return S._torch_forward
    raise ValueError(f"--backends: no stage split for {backend!r}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_stages(data, backend: str, fmt: str, gc_off: bool) -> dict[str, float]:
    """µs of each stage of one call, then of the whole call on the same input (its output discarded)."""
    device = data[0].device
    forward = forward_of(backend)
    sync(device)
    if gc_off:
        gc.disable()
    try:
        t0 = time.perf_counter()
        args = S.validate(data, fmt)
        t1 = time.perf_counter()
        S.select_backend(device, fmt)
        t2 = time.perf_counter()
        forward(*args, fmt)
        t3 = time.perf_counter()
        sync(device)
        t4 = time.perf_counter()
        S.custom_kernel(data)
        t5 = time.perf_counter()
    finally:
        gc.enable()
    return {"validate": (t1 - t0) * 1e6, "select_backend": (t2 - t1) * 1e6, "forward": (t3 - t2) * 1e6,
            "call": (t5 - t4) * 1e6}


def measure(backend: str, fmt: str, batch: int, kv_len: int, iters: int, device: torch.device) -> dict:
    """Per scenario, the median µs of each stage; MLA_BACKEND and MLA_KV_FORMAT are set by the caller."""
    S.select_backend(device, fmt)  # raises where the backend cannot run
    data = R.generate_varlen_input([kv_len] * batch, seed=1, device=device)
    S.custom_kernel(data)  # first call: builds, compiles, plans
    result = {}
    for scenario, fresh, gc_off in (("repeated", False, False), ("fresh", True, False), ("fresh gc off", True, True)):
        samples = []
        for i in range(iters):
            inputs = R.generate_varlen_input([kv_len] * batch, seed=2 + i, device=device) if fresh else data
            samples.append(time_stages(inputs, backend, fmt, gc_off))
            del inputs
        result[scenario] = {stage: statistics.median(s[stage] for s in samples) for stage in STAGES}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="cuda,triton")
    p.add_argument("--shapes", default="4x1024,64x1024,256x8192")
    p.add_argument("--format", default="fp8", choices=S.KV_FORMATS)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--dry-run", action="store_true", help="the CPU: the torch backend on 2x64, 3 calls")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() and not args.dry_run else torch.device("cpu")
    backends, shapes, iters = args.backends.split(","), args.shapes.split(","), args.iters
    if args.dry_run:
        backends, shapes, iters = ["torch"], ["2x64"], 3
    results = {}
    print(f"host µs per stage (median of {iters}); device {device}")
    print(f"{'backend':8} {'shape':9} {'scenario':13} " + " ".join(f"{s:>14}" for s in STAGES))
    for backend in backends:
        for shape in shapes:
            batch, kv_len = (int(x) for x in shape.split("x"))
            try:
                with torch.no_grad(), scoped_env({"MLA_BACKEND": backend, "MLA_KV_FORMAT": args.format}):
                    result = measure(backend, args.format, batch, kv_len, iters, device)
            except (RuntimeError, ValueError) as e:
                print(f"{backend:8} {shape:9} skipped: {str(e).splitlines()[0][:100]}")
                continue
            results[f"{backend} {shape}"] = result
            for scenario, stages in result.items():
                print(f"{backend:8} {shape:9} {scenario:13} " + " ".join(f"{stages[s]:14.1f}" for s in STAGES))
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "iters": iters, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
