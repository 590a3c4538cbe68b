"""Where the host time of one custom_kernel call goes, with repeated and with fresh inputs, and an A/B against another
submission file in the same process.

The leaderboard hides the host path behind its flush, a serving loop does not. This times one call on the CPU's clock
(median µs, the GPU idle when each call starts: a synchronize before it), split into its two halves, dispatch (the
settings, the lookup of the input's kind, on its first call validation and the backend's choice) and forward (the
backend's launch), and whole ("call"). Three scenarios:
  repeated  the same input every call;
  fresh     a new input of the same shape before every call (as leaderboard mode generates them);
  control   a new input generated before every call, then the call made on the repeated input: the work of
            "repeated" in the host state that generating an input leaves. If control is as slow as fresh, the extra
            time of fresh is the host's state, not work the call does for a new input.
With --baseline FILE, that file is loaded as a second module and its custom_kernel is timed in the same samples, in
alternating order ("baseline" column): host speed varies by up to 1.7x between processes on the H200's host, so
only such an A/B shows a change of a few µs.

Usage:  python3 bench/host_path.py [--backends cuda,triton] [--shapes 4x1024,256x8192] [--iters 30]
                                   [--baseline old_submission.py] [--json P]
        python3 bench/host_path.py --dry-run      # the CPU: the torch backend on a tiny shape
"""

import argparse
import importlib.util
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

SCENARIOS = ("repeated", "fresh", "control")


def load_baseline(path: Path):
    """Another submission file as a module of its own (it shares this process's torch, triton and packages)."""
    spec = importlib.util.spec_from_file_location("baseline_submission", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_stages(data) -> dict[str, float]:
    """µs of dispatch and of forward, one call."""
    t0 = time.perf_counter()
    dispatched = S.dispatch(data)
    t1 = time.perf_counter()
    S.forward(*dispatched)
    t2 = time.perf_counter()
    return {"dispatch": (t1 - t0) * 1e6, "forward": (t2 - t1) * 1e6}


def time_call(custom_kernel, data) -> float:
    t0 = time.perf_counter()
    custom_kernel(data)
    return (time.perf_counter() - t0) * 1e6


def measure(batch: int, kv_len: int, iters: int, device: torch.device, baseline) -> dict:
    """Per scenario, the median µs of each column; MLA_BACKEND and MLA_KV_FORMAT are set by the caller. Each column
    of a sample is timed on its own input, prepared as its scenario says, in an order that rotates between samples."""
    repeated = R.generate_varlen_input([kv_len] * batch, seed=1, device=device)
    methods = {"stages": time_stages, "call": lambda data: {"call": time_call(S.custom_kernel, data)}}
    if baseline is not None:
        baseline.custom_kernel(repeated)  # first call: builds, compiles, plans
        methods["baseline"] = lambda data: {"baseline": time_call(baseline.custom_kernel, data)}
    S.custom_kernel(repeated)
    result, seed = {}, 2
    for scenario in SCENARIOS:
        samples: dict[str, list[float]] = {}
        for i in range(iters):
            names = list(methods)
            for name in names[i % len(names):] + names[:i % len(names)]:
                data = repeated
                if scenario != "repeated":
                    fresh = R.generate_varlen_input([kv_len] * batch, seed=seed, device=device)
                    seed += 1
                    data = fresh if scenario == "fresh" else repeated
                sync(device)
                for column, us in methods[name](data).items():
                    samples.setdefault(column, []).append(us)
                data = fresh = None
        sync(device)
        result[scenario] = {column: statistics.median(values) for column, values in samples.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="cuda,triton")
    p.add_argument("--shapes", default="4x1024,64x1024,256x8192")
    p.add_argument("--format", default="fp8", choices=S.LEADERBOARD_KV_FORMATS)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--baseline", type=Path, help="another submission file, timed in the same samples")
    p.add_argument("--dry-run", action="store_true", help="the CPU: the torch backend on 2x64, 3 calls")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() and not args.dry_run else torch.device("cpu")
    backends, shapes, iters = args.backends.split(","), args.shapes.split(","), args.iters
    if args.dry_run:
        backends, shapes, iters = ["torch"], ["2x64"], 3
    baseline = load_baseline(args.baseline) if args.baseline else None
    columns = ("dispatch", "forward", "call") + (("baseline",) if baseline else ())
    results = {}
    against = f"; baseline {args.baseline}" if baseline else ""
    print(f"host µs per call (median of {iters}); device {device}{against}")
    print(f"{'backend':8} {'shape':9} {'scenario':9} " + " ".join(f"{c:>9}" for c in columns))
    for backend in backends:
        for shape in shapes:
            batch, kv_len = (int(x) for x in shape.split("x"))
            try:
                with torch.no_grad(), scoped_env({"MLA_BACKEND": backend, "MLA_KV_FORMAT": args.format}):
                    S.leaderboard_backend(device, args.format)  # raises where the backend cannot run
                    result = measure(batch, kv_len, iters, device, baseline)
            except (RuntimeError, ValueError) as e:
                print(f"{backend:8} {shape:9} skipped: {str(e).splitlines()[0][:100]}")
                continue
            results[f"{backend} {shape}"] = result
            for scenario, row in result.items():
                print(f"{backend:8} {shape:9} {scenario:9} " + " ".join(f"{row[c]:9.1f}" for c in columns))
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "iters": iters, "baseline": str(args.baseline),
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
