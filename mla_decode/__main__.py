"""python -m mla_decode (or mla-decode): the environment, what each backend serves here and why not, then one decode
of an uneven batch on the best device here, checked against the float64 truth and timed.

python -m mla_decode bench [--batch N --seqlen N --heads N ... | --grid FILE]: times decodes on the default backend
beside a memory walk over the same cache bytes (a floor no decode can beat).
"""

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable

import torch
import yaml

from . import __version__
from .api import DecodePlan, make_problem
from .backends import BACKEND_REGISTRY, cuda_package, select_backend
from .contract import MXFP4_BLOCKS_PER_ROW, ROW_WIDTH, V_HEAD_DIM, Problem
from .torch_backend import dequantized_rows, sequence_rows

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "mxfp4": torch.uint8}
# (label, problem settings): the problems a serving engine asks first, each backend's verdict printed for each
COMMON_PROBLEMS = (("fp8 16 heads", {"kv_format": "fp8", "num_heads": 16}),
                   ("bf16 16 heads", {"kv_format": "bf16", "num_heads": 16}),
                   ("mxfp4 16 heads", {"kv_format": "mxfp4", "num_heads": 16}),
                   ("fp8 128 heads MTP 2", {"kv_format": "fp8", "num_heads": 128, "q_len": 2}),
                   ("bf16 8 heads", {"kv_format": "bf16", "num_heads": 8}))
CHECK_LENGTHS = (300, 1, 0, 77, 1000)  # the checked decode's batch: uneven, with lengths 0 and 1
CHECK_REL_L2 = 0.06  # above the fast mode's e4m3 rounding of Q (~3e-2 against float64), far below a wrong result
PAGE_SIZE = 16


def best_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def environment(device: torch.device) -> list[str]:
    """Lines naming the versions and the device the backends are judged on."""
    try:
        import triton

        triton_line = triton.__version__
    except ImportError:
        triton_line = "not installed (the triton backend is off)"
    package, missing = cuda_package()
    nvcc = package.build.find_nvcc() if package is not None else None
    lines = [f"mla_decode {__version__}, python {platform.python_version()}, torch {torch.__version__} "
             f"(CUDA {torch.version.cuda}, HIP {torch.version.hip})", f"triton: {triton_line}",
             f"nvcc: {nvcc or missing or 'not found (the cuda backend is off)'}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch = props.gcnArchName if torch.version.hip else "sm_{}{}".format(*torch.cuda.get_device_capability(device))
        lines.append(f"device: {device} {props.name}, {arch}, {props.multi_processor_count} SMs/CUs, "
                     f"{props.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("device: cpu (no GPU visible to torch)")
    return lines


def problem_for(device: torch.device, kv_format: str, num_heads: int, q_len: int = 1, batch: int = 8,
                max_seqlen: int = 4096, page_size: int = 64) -> Problem:
    return make_problem(batch, KV_DTYPES[kv_format], device, layout="paged", page_size=page_size,
                        max_pages=-(-max_seqlen // page_size), num_heads=num_heads, q_len=q_len, causal=q_len > 1)


def verdicts(device: torch.device) -> list[str]:
    """Per backend, the common problems it serves on `device`, and why not for the others; then auto's pick."""
    problems = [(label, problem_for(device, **settings)) for label, settings in COMMON_PROBLEMS]
    lines = []
    for record in BACKEND_REGISTRY:
        refused: dict[str, list[str]] = {}  # reason -> the problems refused for it
        serves = []
        for label, problem in problems:
            reason = record.unusable_reason(problem)
            if reason is None:
                serves.append(label)
            else:
                refused.setdefault(reason, []).append(label)
        lines.append(f"  {record.name:7s} serves: {', '.join(serves) or 'none of these'}")
        lines += [f"          not {', '.join(labels)}: {reason}" for reason, labels in refused.items()]
    picks = ", ".join(f"{label} -> {select_backend(problem).backend}" for label, problem in problems)
    lines.append(f"  auto picks: {picks}")
    return lines


class Batch:
    """A paged batch of fresh random data: `lengths` per sequence, pages handed out shuffled, NaN in every cache
    slot no sequence owns (a kernel that reads one shows it)."""

    def __init__(self, lengths: list[int], kv_format: str, num_heads: int, q_len: int, page_size: int,
                 device: torch.device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        batch, max_pages = len(lengths), max(1, -(-max(lengths) // page_size))
        num_pages = batch * max_pages
        width = ROW_WIDTH[kv_format]
        self.lengths, self.kv_format = lengths, kv_format
        self.q = torch.randn((batch, q_len, num_heads, 576), generator=gen).bfloat16().to(device)
        self.block_table = torch.randperm(num_pages, generator=gen).int().view(batch, max_pages).to(device)
        self.cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        owned = torch.arange(max_pages * page_size)[None, :] < torch.tensor(lengths)[:, None]  # (batch, slots)
        slot_owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
        pages = self.block_table.cpu().long()
        slot_owned[(pages[:, :, None] * page_size + torch.arange(page_size)).view(batch, -1)[owned]] = True
        if kv_format == "mxfp4":
            codes = torch.randint(0, 256, (num_pages * page_size, width), generator=gen, dtype=torch.uint8)
            scales = torch.randint(118, 130, (num_pages * page_size, MXFP4_BLOCKS_PER_ROW), generator=gen,
                                   dtype=torch.uint8)
            scales[~slot_owned] = 255  # E8M0's NaN
            self.kv_cache = codes.view(num_pages, page_size, 1, width).to(device)
            self.kv_scale = scales.view(num_pages, page_size, 1, MXFP4_BLOCKS_PER_ROW).to(device)
        else:
            rows = torch.randn((num_pages * page_size, width), generator=gen)
            rows[~slot_owned] = float("nan")
            self.kv_scale = torch.full((1,), 0.5, device=device) if kv_format == "fp8" else None
            self.kv_cache = rows.to(KV_DTYPES[kv_format]).view(num_pages, page_size, 1, width).to(device)

    def args(self) -> tuple:
        return self.q, self.kv_cache, self.block_table, self.cache_seqlens, self.kv_scale

    def kv_bytes(self) -> int:
        """The cache bytes a decode must read: every owned row with its scales."""
        row = self.kv_cache.shape[-1] * self.kv_cache.element_size()
        if self.kv_format == "mxfp4":
            row += MXFP4_BLOCKS_PER_ROW
        return sum(self.lengths) * row

    def truth(self, plan: DecodePlan) -> torch.Tensor:
        """The float64 decode of the dequantized rows: (batch, q_len, heads, 512), 0 where a token sees nothing."""
        p = plan.problem
        kv = self.kv_cache.view(-1, self.kv_cache.shape[-1])
        scale = self.kv_scale.view(-1, MXFP4_BLOCKS_PER_ROW) if self.kv_format == "mxfp4" else self.kv_scale
        rows_of = sequence_rows(p, self.cache_seqlens, self.block_table, kv.shape[0])
        out = torch.zeros((p.batch, p.q_len, p.num_heads, V_HEAD_DIM), dtype=torch.float64)
        for b, rows in enumerate(rows_of):
            keys = dequantized_rows(kv, scale, rows, self.kv_format).double().cpu()
            q = self.q[b].double().cpu()  # (q_len, heads, 576)
            for t in range(p.q_len):
                seen = rows.shape[0] - (p.q_len - 1 - t if p.causal else 0)
                if seen <= 0:
                    continue
                weights = torch.softmax(q[t] @ keys[:seen].T * p.softmax_scale, dim=-1)
                out[b, t] = weights @ keys[:seen, :V_HEAD_DIM]
        return out


def time_call(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean µs of one call over `iters` calls after two warm-ups."""
    fn()
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) * 1e6 / iters


def checked_decode(device: torch.device, kv_format: str = "fp8") -> tuple[str, bool]:
    """One decode of CHECK_LENGTHS on the auto backend against the float64 truth: (the line to print, passed)."""
    batch = Batch(list(CHECK_LENGTHS), kv_format, 16, 1, PAGE_SIZE, device)
    plan = DecodePlan(problem_for(device, kv_format, 16, batch=len(CHECK_LENGTHS), max_seqlen=max(CHECK_LENGTHS),
                                  page_size=PAGE_SIZE))
    out = torch.full((len(CHECK_LENGTHS), 1, 16, V_HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    plan.run(*batch.args(), out=out)
    truth = batch.truth(plan)
    rel_l2 = ((out.double().cpu() - truth).norm() / truth.norm()).item()  # NaN anywhere fails the bound
    passed = rel_l2 <= CHECK_REL_L2
    us = time_call(lambda: plan.run(*batch.args(), out=out), device, 20 if device.type == "cuda" else 3)
    return (f"decode: {plan.backend} backend, {kv_format} cache, lengths {list(CHECK_LENGTHS)}, 16 heads: rel-L2 "
            f"{rel_l2:.1e} against float64 (bound {CHECK_REL_L2}) {'ok' if passed else 'FAILED'}; {us:.1f} us, "
            f"{batch.kv_bytes() / us / 1e3:.2f} GB/s of cache"), passed


def spread_lengths(batch: int, mean: int, spread: str, q_len: int, seed: int) -> list[int]:
    """Uniform: every length `mean`; normal: normal(mean, mean / 2) per sequence, at least q_len (as FlashMLA's own
    test draws a varlen batch)."""
    if spread == "uniform":
        return [mean] * batch
    rng = random.Random(seed)
    return [max(q_len, int(rng.gauss(mean, mean / 2))) for _ in range(batch)]


def progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:40s}")
    sys.stderr.flush()


def bench(rows: list[dict], device: torch.device, backend: str, iters: int) -> list[str]:
    """One line per row: its decode's µs and GB/s on `backend`, and the memory walk's µs over the same bytes."""
    lines = [f"{'batch':>5} {'kv':>6} {'heads':>5} {'q_len':>5} {'format':>6} {'spread':>7} {'backend':>7} "
             f"{'us':>9} {'GB/s':>7} {'walk us':>9} {'us/walk':>7}"]
    for i, row in enumerate(rows):
        progress(i, len(rows), f"{row}")
        lengths = spread_lengths(row["batch"], row["kv"], row["spread"], row["q_len"], row["seed"])
        batch = Batch(lengths, row["format"], row["heads"], row["q_len"], row["page"], device, row["seed"])
        problem = make_problem(row["batch"], KV_DTYPES[row["format"]], device, layout="paged",
                               page_size=row["page"], max_pages=batch.block_table.shape[1], num_heads=row["heads"],
                               q_len=row["q_len"], causal=row["q_len"] > 1, max_seqlen=max(lengths))
        plan = DecodePlan(problem, backend)
        out = torch.empty((row["batch"], row["q_len"], row["heads"], V_HEAD_DIM), dtype=torch.bfloat16, device=device)
        us = time_call(lambda: plan.run(*batch.args(), out=out), device, iters)  # noqa: B023 (called here)
        walked = torch.empty(batch.kv_bytes() // 4, dtype=torch.int32, device=device)
        walk_us = time_call(lambda: walked.sum(), device, iters)  # noqa: B023
        lines.append(f"{row['batch']:>5} {row['kv']:>6} {row['heads']:>5} {row['q_len']:>5} {row['format']:>6} "
                     f"{row['spread']:>7} {plan.backend:>7} {us:>9.1f} {batch.kv_bytes() / us / 1e3:>7.1f} "
                     f"{walk_us:>9.1f} {us / walk_us:>7.2f}")
    progress(len(rows), len(rows), "done")
    sys.stderr.write("\n")
    return lines


def grid_rows(args: argparse.Namespace) -> list[dict]:
    """The rows to bench: the grid file's (serving.yml's form: a `rows` list of batch, kv, heads, q_len, page, seed;
    format and spread default to the command line's), or the one shape of the command line."""
    defaults = {"batch": args.batch, "kv": args.seqlen, "heads": args.heads, "q_len": args.q_len,
                "page": args.page_size, "format": args.kv_format, "spread": args.spread, "seed": 0}
    if args.grid is None:
        return [defaults]
    with open(args.grid) as f:
        return [{**defaults, **row} for row in yaml.safe_load(f)["rows"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command")
    b = sub.add_parser("bench", help="time decodes on the default backend beside a memory walk")
    b.add_argument("--batch", type=int, default=32)
    b.add_argument("--seqlen", type=int, default=4096, help="the mean KV length")
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--q-len", type=int, default=1)
    b.add_argument("--page-size", type=int, default=64)
    b.add_argument("--kv-format", choices=tuple(KV_DTYPES), default="fp8")
    b.add_argument("--spread", choices=("uniform", "normal"), default="normal",
                   help="lengths all --seqlen, or normal(seqlen, seqlen / 2) per sequence")
    b.add_argument("--grid", help="a YAML grid file of rows (serving.yml's form)")
    b.add_argument("--backend", default="auto")
    b.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    device = best_device()
    if args.command == "bench":
        print("\n".join(environment(device) + bench(grid_rows(args), device, args.backend, args.iters)))
        return 0
    print("\n".join(environment(device) + ["backends:"] + verdicts(device)))
    line, passed = checked_decode(device)
    print(line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
