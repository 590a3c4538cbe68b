"""Where a balanced decode's time goes, on one GPU: for a few serving rows, the schedule's pieces (how many, the
largest in tiles, the most a sequence has), and the time of the fixed splits, the balanced call (schedule made in the
call), the balanced run with a schedule made before, the schedule alone, and, with --no-merge, the balanced run of a
library whose combine kernel returns at once (wrong outputs: timing only). --sequence-cost N builds the library
with the schedule's SEQUENCE_COST set to N (the kernels' cut only: the CPU reference keeps its own). --kernels adds
each kernel's own time in the balanced call with its schedule given (torch.profiler, device time a call).
--variants "cut=fill;min_share=8;cut=fill,min_share=8" also times the balanced run (schedule given) of plans with
those backend options (cut, min_share: ints where they parse), with their pieces. --count SMS runs on the CPU
alone: for each row and option set, the pieces of the CPU references' cut (mla_decode.schedule) on a GPU of SMS SMs
(two CTAs an SM in units of 16 and 32 rows, one in units of 64; units of 64 rows where the heads come in 64s, else 16,
as the plan picks them on the probe's rows): pieces, the most a sequence has, the largest part's load (tiles plus
PIECE_COST a piece) and the parts used.

    python3 bench/schedule_probe.py [--rows 128x4096-h16-q1,8x32768-h16-q1-range] [--no-merge] [--sequence-cost 4]
                                    [--kernels] [--variants "cut=fill;min_share=8"] [--count 132]
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mla_decode  # noqa: E402
import mla_decode.cuda.build as B  # noqa: E402
from testkit.paged import make_paged_case  # noqa: E402


def lengths(batch: int, kv: int, spread: str) -> list[int]:
    if spread == "range":  # 1 to kv, evenly in log (bench/serving.py's "range")
        return [round(kv ** (b / max(1, batch - 1))) for b in range(batch)]
    if spread == "normal":
        gen = torch.Generator().manual_seed(0)
        return [int(x) for x in (torch.randn(batch, generator=gen) * kv / 2 + kv).clamp(1, 4 * kv)]
    if spread == "one-long":
        return [kv] + [1024] * (batch - 1)
    if spread != "uniform":
        raise ValueError(f"spread {spread!r}: expected uniform, normal, one-long or range")
    return [kv] * batch


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def kernel_times(fn, iters: int = 20) -> str:
    """Each CUDA kernel's device time per call of fn, by torch.profiler: 'name us, ...'."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("<")[0].split("(")[0].removeprefix("void ").removeprefix("mla::")
            times[name] = times.get(name, 0.0) + event.time_range.elapsed_us() / iters
    return ", ".join(f"{name} {t:.1f}" for name, t in sorted(times.items(), key=lambda kv: -kv[1]))


def parse_row(row: str) -> tuple[int, int, int, list[int]]:
    """'32x65536-h16-q1-one-long' -> (batch, heads, q_len, the lengths)."""
    fields = row.split("-")
    batch, kv = (int(x) for x in fields[0].split("x"))
    spread = "-".join(fields[3:]) or "uniform"  # "one-long" holds a dash
    return batch, int(fields[1][1:]), int(fields[2][1:]), lengths(batch, kv, spread)


def live_items(items: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A schedule's listed pieces, (pieces, 4), and the most pieces one sequence has."""
    live = items.view(-1, 4)[items.view(-1, 4)[:, 0] >= 0]
    return live, int((live[:, 3] & 0xFFFF).max())


def probe(row: str, kernels: bool, variants: list[dict]) -> None:
    batch, heads, q_len, lens = parse_row(row)
    case = make_paged_case("fp8", 64, lens, seed=1, device="cuda", q_len=q_len, num_heads=heads)

    def plan(schedule: str, **options):
        return mla_decode.plan(batch, 64, case.block_table.shape[1], case.kv_cache.dtype, "cuda", num_heads=heads,
                               q_len=q_len, causal=q_len > 1, backend="cuda", kv_scale_dtype=case.kv_scale.dtype,
                               backend_options={"schedule": schedule, **options})

    fixed, balanced = plan("fixed"), plan("balanced")
    step = balanced.schedule(case.cache_seqlens)
    live, most = live_items(step.items[:balanced.impl.max_items * 4].cpu())
    out = torch.empty((batch, q_len, heads, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device="cuda")
    t_fixed = timed(lambda: fixed.run(*case.args(), out=out, lse=lse))
    t_call = timed(lambda: balanced.run(*case.args(), out=out, lse=lse))
    t_given = timed(lambda: balanced.run(*case.args(), out=out, lse=lse, schedule=step))
    t_sched = timed(lambda: balanced.schedule(case.cache_seqlens))
    print(f"{row}: rows {balanced.impl.rows} fixed rows {fixed.impl.rows} splits {fixed.impl.num_splits} | parts "
          f"{balanced.impl.parts} pieces {live.shape[0]} (max {balanced.impl.max_items}) largest "
          f"{int((live[:, 2] - live[:, 1]).max())} tiles, most a sequence {most} | fixed {t_fixed:.1f} "
          f"balanced {t_call:.1f} given {t_given:.1f} schedule alone {t_sched:.1f} us", flush=True)
    if kernels:
        print(f"  kernels, schedule given (us a call): "
              f"{kernel_times(lambda: balanced.run(*case.args(), out=out, lse=lse, schedule=step))}", flush=True)
    for options in variants:
        other = plan("balanced", **options)
        other_step = other.schedule(case.cache_seqlens)
        other_live, other_most = live_items(other_step.items[:other.impl.max_items * 4].cpu())
        t = timed(lambda p=other, s=other_step: p.run(*case.args(), out=out, lse=lse, schedule=s))
        print(f"  {options}: pieces {other_live.shape[0]}, most a sequence {other_most}, given {t:.1f} us",
              flush=True)


def count(row: str, sms: int, variants: list[dict]) -> None:
    """The CPU references' cut of `row` for the plan's defaults and each option set (--count)."""
    from mla_decode.cuda.plan import CUT, MIN_SHARE, balanced_parts, fill_slack
    from mla_decode.schedule import PIECE_COST, fill_schedule, make_schedule, pack_schedule, part_first, schedule_items
    batch, heads, q_len, lens = parse_row(row)
    lens = torch.tensor(lens)
    rows = 64 if heads % 64 == 0 else 16
    parts = balanced_parts(sms, 1 if rows == 64 else 2, q_len * heads // rows)
    cells = []
    for options in [{}, *variants]:
        cut, least = options.get("cut", CUT), options.get("min_share", MIN_SHARE)
        if cut in ("fill", "pack"):  # the FP8 plan's slack, or the option's
            walk = fill_schedule if cut == "fill" else pack_schedule
            slack = options.get("slack", fill_slack("fp8", rows))
            flat = walk(lens, parts, int(lens.max()), min_share=least, slack=slack)
            items, starts = flat[:-(parts + 1)].view(-1, 4), flat[-(parts + 1):]
        else:
            s = make_schedule(lens, parts, int(lens.max()), min_share=least)
            items, starts = schedule_items(s, parts + batch), part_first(s)
        live, most = live_items(items)
        loads = [int((live[a:b, 2] - live[a:b, 1]).sum()) + PIECE_COST * (b - a)
                 for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]
        cells.append(f"{options or 'default'}: {live.shape[0]} / {most} / {max(loads)} / "
                     f"{sum(1 for load in loads if load)}")
    print(f"{row} (parts {parts}; pieces / most a sequence / largest load / parts used): " + " | ".join(cells))


def variant(text: str) -> dict:
    """'cut=fill,min_share=8' -> {'cut': 'fill', 'min_share': 8}."""
    pairs = (pair.split("=", 1) for pair in text.split(","))
    return {key: int(value) if value.isdigit() else value for key, value in pairs}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="128x4096-h16-q1,128x4096-h16-q2,128x4096-h128-q1,8x32768-h16-q1-range,"
                                      "32x65536-h16-q1-one-long,128x4096-h16-q1-normal")
    p.add_argument("--no-merge", action="store_true")
    p.add_argument("--sequence-cost", type=int)
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--variants", default="", help="backend options to time besides the defaults: "
                                                  "'key=value,key=value;...'")
    p.add_argument("--count", type=int, metavar="SMS", help="count the CPU references' pieces only")
    args = p.parse_args()
    variants = [variant(v) for v in args.variants.split(";") if v]
    if args.count:
        for row in args.rows.split(","):
            count(row, args.count, variants)
        return 0
    patches = []  # (file, text, replacement)
    if args.no_merge:
        marker = "  const int* const starts = part_first(c);"
        patches.append(("merge.cuh", marker, "  return;\n" + marker))
        print("library: the merge returns at once (timing only)")
    if args.sequence_cost is not None:
        patches.append(("schedule.cuh", "constexpr int SEQUENCE_COST = 1;",
                        f"constexpr int SEQUENCE_COST = {args.sequence_cost};"))
        print(f"library: SEQUENCE_COST {args.sequence_cost}")
    if patches:
        tmp = Path(tempfile.mkdtemp())
        for f in B.source_files(B.CSRC):
            shutil.copy(f, tmp / f.name)
        for name, text, replacement in patches:
            source = (tmp / name).read_text()
            assert source.count(text) == 1, (name, text)
            (tmp / name).write_text(source.replace(text, replacement))
        B.CSRC = tmp
    for row in args.rows.split(","):
        probe(row, args.kernels, variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
