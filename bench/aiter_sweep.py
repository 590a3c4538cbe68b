"""Times every variant of the aiter path and the triton backend on the leaderboard's shapes, prints one table and the
AITER_VARIANTS table to paste into mla_decode/aiter_backend.py (a shape can go to triton), and draws the chart.

    python3 bench/aiter_sweep.py [--shapes 4x1024,256x8192] [--variants fp8_ps,a16w8_ps] [--iters 50]
                                 [--min-gain 0.03] [--no-triton] [--json PATH] [--chart PNG]
    python3 bench/aiter_sweep.py --dry-run     # the CPU, against tests/aiter_standin.py and the Triton interpreter:
                                               # tiny shapes, wall clock

On a ROCm GPU with aiter (an MI355X, for the leaderboard's choice), for each shape of task.yml's benchmarks
(reference.generate_input, the leaderboard's seeds) and each variant of AITER_VARIANT_SPECS (in
mla_decode/aiter_backend.py; run through submission.py, which tools/bundle.py generates from the package):
  check      the first call's output through reference's check (the leaderboard's rule and the strict gate,
             the BF16 truth computed once per shape): a variant that fails or raises is never recommended
  median µs  the leaderboard's timing of one whole custom_kernel call (MLA_BACKEND=aiter, MLA_AITER_VARIANT set
             to the variant): synchronize, flush L2, event, the call, event, synchronize; median of --iters calls
             after --warmup untimed ones (utils.Timer, as the leaderboard's eval.py)
  ran as     the call form the plan actually runs: fp8_nps on an aiter whose mla_decode_fwd does not take the
             one-split call runs it persistent ("decode_fwd (fallback)")
and the triton backend's paths (TRITON_PATHS: MLA_BACKEND=triton in each KV format and precision, checked with
that format's bound), and, per shape, the Q quantization alone (QQuantizer, the FP8 variants' first two launches)
timed the same way and compared bit for bit with reference.quantize_fp8.

The recommendation per shape is the fastest variant that passed (the triton backend on the FP8 cache in the fast
mode, which computes what the aiter variants compute, among them, as ROCM_TRITON; the other triton paths change
the cache or the precision and are shown, never recommended), unless it beats the default (today's path,
AITER_DEFAULT_VARIANT) by less than --min-gain (then the default stays: noise is not a reason to switch). It is
printed as the AITER_VARIANTS block to paste into mla_decode/aiter_backend.py (then `make bundle` regenerates
submission.py), each entry saying where its choice came from. The exit status is 1 when any row is FAIL or ERROR
(everything is printed first).

The chart (--chart, matplotlib): median µs per shape and path, log scale, with the FP8 read floor (the FP8 cache's
bytes over the read ceiling leaderboard.py's kernels measure first on the same GPU).

--dry-run installs the stand-in aiter of tests/aiter_standin.py (the runner's signatures), runs Triton's
interpreter, and runs two tiny shapes on the CPU with wall-clock timing, no flush: it exercises the whole script
(tests/test_aiter_sweep.py runs it), and its numbers mean nothing.
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]  # the harness's top-level modules, imported by name as the harness does
if "--dry-run" in sys.argv[1:]:  # before triton is first imported: the triton rows run in its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import reference  # noqa: E402
import submission  # noqa: E402
from bench import chart, leaderboard  # noqa: E402  (leaderboard's shapes, scoped_env, timer, read ceiling: one of each)
from utils import Timer, get_device  # noqa: E402

# The triton backend's paths: row name -> (KV format, precision). Only ROCM_TRITON (the FP8 cache, the fast mode) can
# be recommended for a shape.
TRITON_PATHS = {submission.ROCM_TRITON: ("fp8", "fast"), "triton-fp8-precise": ("fp8", "precise"),
                "triton-mxfp4": ("mxfp4", "fast")}


def leaderboard_times(fn: Callable[[], object], device: torch.device, iters: int) -> list[float]:
    """µs of each of `iters` calls timed as the leaderboard does (the only timing this script uses)."""
    return Timer(device).leaderboard(fn, iters)


@dataclasses.dataclass
class Row:
    shape: str
    variant: str
    status: str = "ERROR"  # OK, FAIL or ERROR
    reason: str = ""
    ran_as: str = ""
    launches: int | None = None
    median_us: float | None = None
    min_us: float | None = None
    times_us: list[float] = dataclasses.field(default_factory=list)


def install_standin() -> str:
    """The dry run's aiter: the stand-in of tests/aiter_standin.py at the runner's commit, in sys.modules; and the
    tests' patch of Triton's interpreter (tests/triton_interpreter.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import triton_interpreter
    from aiter_standin import StandinAiter

    triton_interpreter.patch()
    sys.modules.update(StandinAiter("RUNNER").modules)
    return "stand-in aiter (tests/aiter_standin.py, RUNNER signatures)"


def aiter_ran_as(variant: str) -> Callable[[tuple], str]:
    """data -> the call form the plan of this input under `variant` runs (after the first call built it)."""

    def ran_as(data: tuple) -> str:
        q, kv_data, _, _, config = data
        plan = submission._AITER_PLANS[submission.aiter_key(q, kv_data["fp8"][0], config["kv_seq_len"], variant)]
        wanted = submission.AITER_VARIANT_SPECS[plan.variant].call
        return plan.call if plan.call == wanted else f"{plan.call} (fallback)"

    return ran_as


def measured_row(row: Row, env: dict, data: tuple, expected: torch.Tensor, kv_format: str, ran_as_of, device,
                 args) -> Row:
    """`row` filled for custom_kernel under `env`: its first output checked against the BF16 truth with the bound
    of `kv_format`, ran_as_of(data) -> what the plan runs, then --warmup calls and the leaderboard's timing of
    --iters. An exception (a path this machine cannot run) makes it ERROR, never recommended."""
    with leaderboard.scoped_env(env):
        try:
            ok, msg = reference.check_against(data, submission.custom_kernel(data), expected, kv_format)
            row.ran_as = ran_as_of(data)
            for _ in range(args.warmup):
                submission.custom_kernel(data)
            row.times_us = leaderboard_times(lambda: submission.custom_kernel(data), device, args.iters)
        except Exception as e:
            row.reason = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            return row
    row.median_us, row.min_us = statistics.median(row.times_us), min(row.times_us)
    row.status, row.reason = ("OK", "") if ok else ("FAIL", msg)
    return row


def sweep_variant(shape, variant: str, data: tuple, expected: torch.Tensor, device, args) -> Row:
    row = Row(shape.name, variant, launches=submission.AITER_VARIANT_SPECS[variant].launches)
    return measured_row(row, {"MLA_BACKEND": "aiter", "MLA_AITER_VARIANT": variant}, data, expected, "fp8",
                        aiter_ran_as(variant), device, args)


def sweep_triton(shape, name: str, data: tuple, expected: torch.Tensor, device, args) -> Row:
    """One of TRITON_PATHS: custom_kernel with the triton backend forced."""
    kv_format, precision = TRITON_PATHS[name]
    row = Row(shape.name, name)

    def triton_ran_as(data: tuple) -> str:
        decision = submission.dispatch(data)[0]  # under the row's settings: the decision custom_kernel ran
        plan = decision.plan.impl.key.plan  # the triton backend's launch plan (TritonDecode.key)
        row.launches = 1 + (plan.num_splits > 1)
        return f"triton, {plan.num_splits} splits"

    env = {"MLA_BACKEND": "triton", "MLA_KV_FORMAT": kv_format, "MLA_PRECISION": precision}
    return measured_row(row, env, data, expected, kv_format, triton_ran_as, device, args)


def sweep_q_quant(shape, data: tuple, device, args) -> dict:
    """The Q quantization alone, as the FP8 variants run it, timed the same way; bit-exact vs the reference?"""
    fp8 = submission._aiter_api()[1]
    q = data[0]
    quant = submission.QQuantizer(q.shape[0], fp8, device)
    q8 = quant(q)
    want, want_scale = reference.quantize_fp8(q, fp8)
    exact = torch.equal(q8.view(torch.uint8), want.view(torch.uint8)) and torch.equal(quant.scale, want_scale)
    times = leaderboard_times(lambda: quant(q), device, args.iters)
    return {"shape": shape.name, "form": "triton" if quant.blocks else "torch", "launches": quant.launches,
            "median_us": statistics.median(times), "min_us": min(times), "exact": exact, "times_us": times}


def recommend(rows: list[Row], shapes, min_gain: float, label: str) -> dict:
    """(batch, kv) -> (variant, where the choice came from): the fastest variant that passed its check, unless the
    default passed too and is within `min_gain` of it; the default where nothing passed (it runs anyway)."""
    default = submission.AITER_DEFAULT_VARIANT
    candidates = set(submission.AITER_VARIANT_SPECS) | {submission.ROCM_TRITON}
    chosen = {}
    for shape in shapes:
        ok = {r.variant: r for r in rows if r.shape == shape.name and r.status == "OK" and r.variant in candidates}
        key = (shape.batch, shape.kv)
        if not ok:
            chosen[key] = (default, f"{label}: no variant passed its check")
            continue
        best = min(ok.values(), key=lambda r: r.median_us)
        if default not in ok:
            chosen[key] = (best.variant, f"{label}: {best.median_us:.1f} us; {default} failed its check")
        elif best.variant != default and best.median_us <= ok[default].median_us * (1 - min_gain):
            chosen[key] = (best.variant, f"{label}: {best.median_us:.1f} us; {default} {ok[default].median_us:.1f} us")
        else:
            other = f"; best other {best.variant} {best.median_us:.1f} us" if best.variant != default else ""
            chosen[key] = (default, f"{label}: {ok[default].median_us:.1f} us{other}")
    return chosen


def render_table(chosen: dict) -> str:
    """The AITER_VARIANTS block for mla_decode/aiter_backend.py (two lines an entry, within its 120-column
    limit)."""
    lines = ["AITER_VARIANTS = {"]
    for (batch, kv), (variant, source) in chosen.items():
        key = f"    ({batch}, {kv}): ("
        lines += [f"{key}{json.dumps(variant)},", f"{' ' * len(key)}{json.dumps(source)}),"]
    return "\n".join(lines + ["}"])


def render_rows(rows: list[Row], quants: list[dict]) -> str:
    out = ["| shape | path | ran as | launches | median µs | min µs | check |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = (f"{r.median_us:.1f} | {r.min_us:.1f}" if r.median_us is not None else "- | -")
        out.append(f"| {r.shape} | {r.variant} | {r.ran_as or '-'} | {r.launches} | {timed} | "
                   f"{r.status}{': ' + r.reason if r.reason else ''} |")
    out += ["", "| shape | Q quantization alone | launches | median µs | min µs | = reference.quantize_fp8 |",
            "|---|---|---|---|---|---|"]
    for qq in quants:
        out.append(f"| {qq['shape']} | {qq['form']} | {qq['launches']} | {qq['median_us']:.1f} | "
                   f"{qq['min_us']:.1f} | {'yes' if qq['exact'] else 'NO'} |")
    return "\n".join(out)


def draw_chart(rows: list[Row], shapes, floors: dict, out: Path, title: str) -> None:
    """bench/chart.py's bars: each path's median µs per shape, the FP8 read floor beside them."""
    times = {(r.shape, r.variant): r.median_us for r in rows if r.status == "OK"}
    out.parent.mkdir(parents=True, exist_ok=True)
    chart.draw([s.name for s in shapes], times, floors, out, title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", help="comma-separated BATCHxKV of task.yml's benchmarks (e.g. 4x1024,256x8k)")
    p.add_argument("--variants", help=f"comma-separated subset of {', '.join(submission.AITER_VARIANT_SPECS)}")
    p.add_argument("--iters", type=int, help="timed calls per row (default 50; 3 with --dry-run)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (checked) call (default 5; 1 dry run)")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="a variant replaces the default only when its median is this fraction faster (0.03)")
    p.add_argument("--json", type=Path, help="write every row (and each call's time) here")
    p.add_argument("--chart", type=Path, help="draw the median µs of every path per shape here (PNG; matplotlib)")
    p.add_argument("--no-triton", action="store_true", help="time the aiter variants only")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU against the stand-in aiter")
    args = p.parse_args(argv)
    args.iters = args.iters if args.iters is not None else (3 if args.dry_run else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    variants = list(submission.AITER_VARIANT_SPECS)
    if args.variants:
        variants = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in variants if v not in submission.AITER_VARIANT_SPECS]
        if unknown:
            p.error(f"--variants: {unknown} not in {list(submission.AITER_VARIANT_SPECS)}")
    if submission.AITER_DEFAULT_VARIANT not in variants:  # the baseline every recommendation is measured against
        variants.insert(0, submission.AITER_DEFAULT_VARIANT)
    args.variant_list = variants
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        device, aiter_label = torch.device("cpu"), install_standin()
        available = [leaderboard.Shape(*s) for s in leaderboard.DRY_RUN_SHAPES]
    else:
        device = get_device()
        if device.type != "cuda" or torch.version.hip is None:
            raise SystemExit("aiter_sweep.py needs a ROCm GPU with aiter; use --dry-run to exercise it on the CPU")
        import aiter

        aiter_label = f"aiter {getattr(aiter, '__version__', '(no version)')} at {aiter.__file__}"
        available = leaderboard.leaderboard_shapes()
    shapes = leaderboard.select_shapes(available, args.shapes)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    date = datetime.date.today().isoformat()
    print(f"aiter_sweep on {gpu}, {aiter_label}: {len(shapes)} shapes x {len(args.variant_list)} variants, "
          f"median of {args.iters}", flush=True)
    rows, quants = [], []
    for shape in shapes:
        # reference.generate_input's data, on the device the sweep runs on (the CPU for a dry run anywhere)
        data = reference.generate_varlen_input([shape.kv] * shape.batch, shape.seed, device=device)
        expected = reference.ref_kernel(data)
        runs = [(variant, sweep_variant) for variant in args.variant_list]
        runs += [] if args.no_triton else [(name, sweep_triton) for name in TRITON_PATHS]
        for name, sweep_one in runs:
            rows.append(row := sweep_one(shape, name, data, expected, device, args))
            timed = f"{row.median_us:9.1f} µs" if row.median_us is not None else ""
            print(f"  {shape.name:>9} {name:<20} {row.status:<5} {timed} {row.reason}", flush=True)
        quants.append(sweep_q_quant(shape, data, device, args))
        submission._AITER_PLANS.clear()  # a shape's plans go with it: their buffers are sized for that shape
        del data, expected
        if device.type == "cuda":
            torch.cuda.empty_cache()
    chosen = recommend(rows, shapes, args.min_gain, f"aiter_sweep {date} {gpu}")
    ceiling = leaderboard.measure_read_ceiling(leaderboard.Context(argparse.Namespace(
        ceiling_gib=1 / 1024 if args.dry_run else 4, iters=args.iters), device))
    floors = {s.name: s.batch * s.kv * leaderboard.BYTES_PER_ROW["fp8"] / ceiling["gbps"] / 1e3 for s in shapes}
    if args.chart:
        draw_chart(rows, shapes, floors, args.chart, f"aiter_sweep {date}, {gpu}: µs per call")
        print(f"chart: {args.chart}")
    print("\n" + render_rows(rows, quants))
    print("\n# Paste into mla_decode/aiter_backend.py (replacing AITER_VARIANTS), then run `make bundle`:\n"
          + render_table(chosen))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "meta": {"date": date, "device": gpu, "aiter": aiter_label, "iters": args.iters, "warmup": args.warmup,
                     "min_gain": args.min_gain, "dry_run": args.dry_run, "env": {k: v for k, v in os.environ.items()
                                                                              if k.startswith("MLA_")}},
            "rows": [dataclasses.asdict(r) for r in rows], "q_quant": quants, "read_ceiling": ceiling,
            "fp8_floor_us": floors,
            "recommended": [[batch, kv, variant, source] for (batch, kv), (variant, source) in chosen.items()],
        }, indent=1))
    bad = [r for r in rows if r.status != "OK"] + [q for q in quants if not q["exact"]]
    for r in rows:
        if r.status != "OK":
            print(f"{r.status}: {r.shape} {r.variant}: {r.reason}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
