"""Experiments on the cuda backend's kernel, on one GPU in one process (one device call).

    python3 bench/tune_cuda.py ab --variant now= --variant s4=STAGES_ALONE:4 --variant x=STAGES_SHARED:2@16 \
        --module base=/tmp/base.py [--shapes 4x1k,4x8k] [--format fp8] [--iters 40]
    python3 bench/tune_cuda.py timeline [--variant ...] [--shapes 4x1k,4x8k] [--runs 9] [--clock]

Shapes are task.yml's benchmarks (bench.py's --shapes), with their seeds.

A variant is the current submission with some of its CUDA source's integer constants replaced
(`NAME=CONST:VALUE;CONST:VALUE`, every `constexpr int CONST = ...;` line of the source) and optionally a forced split
count (`@SPLITS`); `--module NAME=PATH` times a frozen copy of submission.py instead (e.g. `git show
HEAD:submission.py > /tmp/base.py`). Nothing here is read by the submission or the tests' GPU runs.

ab: every variant's output is checked with reference.check_implementation, then timed the leaderboard's way
(bench.py's Timer: L2 flushed, events around the one call; median of --iters after 2 warm-up calls), variants
interleaved per shape so that drift hits them alike; prints µs per shape and variant and the geometric means.

timeline: thread 0 of every CTA records %globaltimer at the MARKS patched into the source; prints, for the median of
--runs flushed launches, the min / median / max over CTAs of each mark in µs after the first CTA entered (the
timer ticks every ~0.26 µs on the H200). --clock records %clock64 instead: cycles after each CTA's own entry, exact
per phase (clocks of different SMs are not comparable). Rows past a split's tiles stay empty; the handoff's marks
exist only with more than one split.
"""

import argparse
import ctypes
import importlib.util
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import bench  # noqa: E402
import reference as R  # noqa: E402
import submission as S  # noqa: E402
from utils import clear_l2_cache  # noqa: E402

PLAN = S.cuda_plan
SOURCE = S._CUDA_SRC


def parse_variant(text: str) -> tuple[str, dict[str, int], int | None]:
    """'NAME=CONST:VALUE;CONST:VALUE@SPLITS' -> (name, {const: value}, splits or None); 'NAME=' is the source as is."""
    name, sep, spec = text.partition("=")
    if not name or not sep:
        raise ValueError(f"--variant {text!r}: expected NAME=[CONST:VALUE[;CONST:VALUE...]][@SPLITS]")
    spec, _, splits = spec.partition("@")
    consts = {}
    for item in filter(None, spec.split(";")):
        const, _, value = item.partition(":")
        consts[const.strip()] = int(value)
    return name, consts, int(splits) if splits else None


def patched_source(source: str, consts: dict[str, int]) -> str:
    """The source with every `constexpr int CONST = ...;` line of each constant set to its value."""
    lines = source.splitlines(keepends=True)
    for const, value in consts.items():
        hits = [i for i, line in enumerate(lines) if line.startswith(f"constexpr int {const} = ")]
        if not hits:
            raise ValueError(f"no `constexpr int {const} = ...;` line in the CUDA source")
        for i in hits:
            comment = lines[i].split("//", 1)[1] if "//" in lines[i] else ""
            lines[i] = f"constexpr int {const} = {value};" + (f"  //{comment}" if comment else "\n")
    return "".join(lines)


class Variant:
    """One configuration of the cuda backend: its source, library cache, launch cache and split plan, swapped
    into the submission module by activate() (the module's caches are per variant, so nothing is rebuilt)."""

    def __init__(self, name: str, source: str, splits: int | None):
        self.name, self.source, self.splits = name, source, splits
        self.libs: dict = {}
        self.launches: dict = {}

    def activate(self) -> None:
        S._CUDA_SRC, S._CUDA_LIBS, S._CUDA_LAUNCH = self.source, self.libs, self.launches
        S.cuda_plan = (lambda *args: self.splits) if self.splits else PLAN

    def __call__(self, data):
        self.activate()
        return S.custom_kernel(data)


def load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"mla_variant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_ab(args, variants: dict) -> None:
    timer = bench.Timer(torch.device("cuda"))
    results = {name: [] for name in variants}
    for shape in args.shapes:
        batch, kv_len = shape.batch, shape.kv
        data = R.generate_input(batch, 1, kv_len, seed=shape.seed)
        cells = []
        for name, fn in variants.items():
            out = fn(data)
            ok, _ = R.check_implementation(data, out)
            fn(data)
            us = statistics.median(timer.leaderboard(lambda fn=fn, data=data: fn(data), args.iters))
            results[name].append(us)
            cells.append(f"{name} {us:7.1f}{'' if ok else ' FAIL'}")
        print(f"{batch}x{kv_len}: " + "  ".join(cells), flush=True)
    print(f"geomean {args.format}: " + "  ".join(
        f"{name} {math.prod(r) ** (1 / len(r)):.1f}" for name, r in results.items()), flush=True)


# The marks in the order they are passed: (name, anchor in the source, whether the stamp goes before or after it).
# "tile" stamps tile i landing (i < TILE_MARKS: that many slots); the four after it time the phases of tile 0's
# math; the handoff's marks (synced .. lse) lie in the merge, shared with the mma.sync kernel (stamped there too).
MARKS = [
    ("entry", "  extern __shared__ __align__(1024) uint8_t smem[];\n", "after"),
    ("start", "  const bool valid = range.valid;\n", "after"),  # kv_indptr read
    ("issued", "  for (int i = 0; i < STAGES - 1; ++i) load_group(i);\n", "after"),  # Q loads, first tiles' copies
    ("Q", "  // This thread's score columns (heads) are", "before"),  # Q converted into shared memory
    ("tile", "    __syncthreads();  // tile i is visible to the tensor cores; every warp is done with tile i - 1\n",
     "after"),
    ("scored", "    fence_acc(s);\n", "after"),  # tile 0's scores
    ("maxed", "    reduce_rows(mx, heads, red, warp, g, [](float x, float y) { return fmaxf(x, y); });\n", "after"),
    ("P", "    __syncthreads();  // P is complete\n", "after"),
    ("PV", "    wg_commit();\n    wg_wait0();\n#pragma unroll\n"
     "    for (int mb = 0; mb < 8; ++mb) fence_acc(acc[mb]);\n", "after"),  # tile 0's O += V^T P^T
    ("loop", "  // Row sums across the warp's rows", "before"),
    ("staged", "  const int col = 4 * tid;\n", "before"),  # row sums, output (or partial) in shared memory
    ("partial", "  if (num_splits > 1) merge_splits(", "before"),  # its stores issued
    ("synced", "  if (threadIdx.x == 0) {\n    const unsigned target", "before"),
    ("arrived", 'red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync + b) : "memory");\n', "after"),
    ("barrier", "  if (threadIdx.x >= MERGE_THREADS) return;\n  const float* lse", "before"),
    ("lse", "  if (mx != -INFINITY) {  // else only", "before"),  # the merge's loads landed
    ("merged", "  if (num_splits > 1) merge_splits(sync, base, b, split, num_splits, valid, out, part_o, part_lse);\n",
     "after"),
]
TILE_MARKS = 5
TILE0_MARKS = ("scored", "maxed", "P", "PV")
HANDOFF_MARKS = ("synced", "arrived", "barrier", "lse", "merged")
IN_MERGE = ("synced", "arrived", "barrier", "lse")


def _mark_slots() -> tuple[dict[str, int], int]:
    """Each mark's first slot in a CTA's row of stamps (tile takes TILE_MARKS), and the row's length."""
    slots, k = {}, 0
    for name, _, _ in MARKS:
        slots[name] = k
        k += TILE_MARKS if name == "tile" else 1
    return slots, k


MARK_SLOTS, SLOTS = _mark_slots()


def timeline_source(source: str, clock: bool = False) -> str:
    """The wgmma kernel's source with the MARKS' stamps (%globaltimer, or %clock64 with clock) and an export of them
    (mla_timeline_get)."""
    block = f"static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x) * {SLOTS}"
    decl = f"__device__ unsigned long long mla_timeline[16384 * {SLOTS}];\nconstexpr int TILE_MARKS = {TILE_MARKS};\n"
    # The shared merge comes before the wgmma kernel's section, the mma.sync kernel after it (not stamped).
    start, end = source.index("\n#if MLA_WGMMA\n"), source.index("\n#else  // mma.sync")
    parts = {"head": source[:start], "kernel": source[start:end]}
    parts["head"] = parts["head"].replace("namespace mla {\n", "namespace mla {\n" + decl, 1)
    timer = "clock64" if clock else "globaltimer"
    for name, anchor, where in MARKS:
        part = "head" if name in IN_MERGE else "kernel"
        text = parts[part]
        if text.count(anchor) != 1:
            raise ValueError(f"timeline mark {name!r}: its anchor is not in the source exactly once: {anchor!r}")
        slot = MARK_SLOTS[name]
        guard, index = "", str(slot)
        if name == "tile":
            guard, index = "i < TILE_MARKS && ", f"{slot} + i"
        elif name in TILE0_MARKS:
            guard = "i == 0 && "
        stamp = (f"if ({guard}threadIdx.x == 0) {{ unsigned long long t_; asm volatile(\"mov.u64 %0, %%{timer};\""
                 f" : \"=l\"(t_)); mla_timeline[{block} + {index}] = t_; }}\n")
        parts[part] = text.replace(anchor, anchor + stamp if where == "after" else stamp + anchor, 1)
    export = ('\nextern "C" int mla_timeline_get(void* dst) {\n  return static_cast<int>(cudaMemcpyFromSymbol(dst, '
              'mla::mla_timeline, sizeof(mla::mla_timeline)));\n}\n')
    return parts["head"] + parts["kernel"] + source[end:] + export


def run_timeline(args, variants: dict) -> None:
    slots = MARK_SLOTS
    for shape in args.shapes:
        batch, kv_len = shape.batch, shape.kv
        data = R.generate_input(batch, 1, kv_len, seed=shape.seed)
        for variant in variants.values():
            if not isinstance(variant, Variant):
                raise SystemExit("timeline: --module copies cannot be stamped; give --variant")
            stamped = Variant(variant.name, timeline_source(variant.source, args.clock), variant.splits)
            stamped(data)
            torch.cuda.synchronize()
            lib = stamped.libs[torch.cuda.get_device_capability()]
            splits = next(iter(stamped.launches.values()))[0]
            ctas, tiles = batch * splits, -(-kv_len // splits // S.CUDA_BLOCK_N)
            cols = []
            for name, _, _ in MARKS:
                if name == "tile":
                    cols += [(f"tile{k}", slots[name] + k) for k in range(min(tiles, TILE_MARKS))]
                elif splits > 1 or name not in HANDOFF_MARKS:
                    cols.append((name, slots[name]))
            last = slots["merged" if splits > 1 else "partial"]
            runs = []
            for _ in range(args.runs):
                buf = (ctypes.c_ulonglong * (16384 * SLOTS))()
                torch.cuda.synchronize()
                clear_l2_cache()
                torch.cuda.synchronize()
                stamped(data)
                torch.cuda.synchronize()
                if lib.mla_timeline_get(ctypes.cast(buf, ctypes.c_void_p)):
                    raise RuntimeError("mla_timeline_get failed")
                t = torch.tensor(buf[: ctas * SLOTS], dtype=torch.float64).view(ctas, SLOTS)
                entry = t[:, slots["entry"]]
                # clock64 is per SM: cycles since each CTA's own entry; globaltimer: us since the first CTA's
                rel = t - entry[:, None] if args.clock else (t - entry.min()) / 1000.0
                runs.append((rel[:, last].max().item(), rel))
            rel = sorted(runs, key=lambda r: r[0])[len(runs) // 2][1]
            unit = "cycles after each CTA's entry" if args.clock else "us after the first CTA's entry"
            print(f"{batch}x{kv_len} {variant.name}: {splits} splits, {ctas} CTAs, {tiles} tiles each; "
                  f"{unit}, min/median/max over CTAs (scored..PV: tile 0)")
            width = 20 if args.clock else 14
            print("  " + "  ".join(f"{name:>{width}}" for name, _ in cols))
            fmt = ".0f" if args.clock else "4.1f"
            print("  " + "  ".join(f"{rel[:, k].min():{fmt}}/{rel[:, k].median():{fmt}}/{rel[:, k].max():{fmt}}"
                                   .rjust(width) for _, k in cols), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("ab", "timeline"))
    parser.add_argument("--variant", action="append", default=[], help="NAME=[CONST:VALUE[;...]][@SPLITS]")
    parser.add_argument("--module", action="append", default=[], help="NAME=PATH of a copy of submission.py")
    parser.add_argument("--shapes", help="BATCHxKV[,...] among task.yml's benchmarks (default: all 8)")
    parser.add_argument("--format", choices=("fp8", "mxfp4"), default="fp8")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--clock", action="store_true", help="timeline in %%clock64 cycles per CTA")
    args = parser.parse_args(argv)
    args.shapes = bench.select_shapes(bench.leaderboard_shapes(), args.shapes)
    if not torch.cuda.is_available():
        raise SystemExit("tune_cuda.py needs an NVIDIA GPU")
    os.environ.update(MLA_BACKEND="cuda", MLA_KV_FORMAT=args.format)
    variants = {}
    for text in args.variant or ["now="]:
        name, consts, splits = parse_variant(text)
        variants[name] = Variant(name, patched_source(SOURCE, consts), splits)
    for text in args.module:
        name, _, path = text.partition("=")
        variants[name] = load_module(name, path).custom_kernel
    (run_ab if args.mode == "ab" else run_timeline)(args, variants)


if __name__ == "__main__":
    main()
