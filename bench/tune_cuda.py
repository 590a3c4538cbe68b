"""Experiments on the cuda backend's kernel, on one GPU in one process (one device call).

    python3 bench/tune_cuda.py ab --variant now= --variant s4=STAGES_ALONE:4 --variant x=STAGES_SHARED:2@16 \
        --source base=/tmp/base/mla_decode/cuda/csrc [--shapes 4x1k,4x8k] [--format fp8] [--iters 40] \
        [--page 64] [--precision fast]
    python3 bench/tune_cuda.py timeline [--variant ...] [--shapes 4x1k,4x8k] [--runs 9] [--clock] [--page 64]
    python3 bench/tune_cuda.py ab --source ... --serving serving_heads.yml [--rows 32x32k-h128-q1,...] [--iters 10]
    python3 bench/tune_cuda.py phases [--source ...] --serving serving_heads.yml [--rows ...] [--runs 5]

Shapes are task.yml's benchmarks (leaderboard.py's --shapes), with their seeds.

A variant is the kernel library built from a temporary copy of mla_decode/cuda/csrc with some of its integer
constants replaced (`NAME=CONST:VALUE;CONST:VALUE`, every `constexpr int CONST = ...;` line of the .cu/.cuh files) and
optionally a forced split count (`@SPLITS`); `--source NAME=DIR` builds a frozen copy of the csrc folder instead (e.g.
`mkdir /tmp/base && git archive HEAD mla_decode/cuda/csrc | tar x -C /tmp/base`). Each variant has its own library
cache and its own plans (submission's custom_kernel decisions, each holding a CudaDecode of the variant's library and
split count), swapped into mla_decode.cuda's build and plan modules and submission around its calls. Nothing here is
read by the submission or the tests' GPU runs.

ab: every variant's output is checked with reference.check_implementation, then timed the leaderboard's way
(utils.Timer, as leaderboard.py times: L2 flushed, events around the one call; median of --iters after 2 warm-up calls),
variants interleaved per shape so that drift hits them alike; prints µs per shape and variant and the geometric means.
--page N times the paged kernels instead: the library's plan run (mla_decode.plan(...).run(...), a plan per variant
and shape) over the input's cache re-laid in shuffled pages of N rows, as leaderboard.py's paged rows are;
--in-order keeps the pages in the cache's order. --serving SPEC times rows of a serving spec instead (serving.yml's
layout; --rows picks them by name): the library's plan and run as bench/serving.py's cuda method makes them,
whatever unit the plan picks, each checked against serving.py's float64 truth. Both make their plans with the
variant active, so a forced split count applies to them too.

timeline: thread 0 of every CTA records %globaltimer at the MARKS, the `// TUNE: name` lines of the sources; prints,
for the median of --runs flushed launches, the min / median / max over CTAs of each mark in µs after the first CTA
entered (the timer ticks every ~0.26 µs on the H200). --clock records %clock64 instead: cycles after each CTA's own
entry, exact per phase (clocks of different SMs are not comparable). Rows past a split's tiles stay empty; the
handoff's marks exist only with more than one split. --page N stamps the paged plan run, as ab times it.

phases: the 64-row kernel's pair loop (split_kernel64) on serving rows, its `// TUNE: pair-*` lines stamped: threads 0
and 128 of every CTA add the %clock64 cycles since the previous stamp to that phase (the top barrier, the scores with
the next pair's copies, the softmax, the value products) over all their pairs; prints each warpgroup's cycles per pair
in each phase (summed over CTAs) for the median of --runs flushed calls, and that call's µs (the stamps slow the loop:
read the shares). Rows whose plan takes other units run no 64-row CTA and say so.
"""

import argparse
import ctypes
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import mla_decode  # noqa: E402
import reference as R  # noqa: E402
import submission as S  # noqa: E402
from bench import leaderboard, serving  # noqa: E402
from mla_decode.cuda import build, plan  # noqa: E402
from utils import Timer, clear_l2_cache  # noqa: E402

PLAN = plan.cuda_plan


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


def copy_sources(src: Path, dst: Path) -> Path:
    """A copy of the csrc folder `src` (its .cu and .cuh files) as the new folder `dst`."""
    dst.mkdir(parents=True)
    for path in build.source_files(src):
        shutil.copy2(path, dst / path.name)
    return dst


def patch_constants(csrc: Path, consts: dict[str, int]) -> None:
    """Sets every `constexpr int CONST = ...;` line of the sources in `csrc` (a copy) to the constant's value."""
    files = {path: path.read_text().splitlines(keepends=True) for path in build.source_files(csrc)}
    for const, value in consts.items():
        hits = [(path, i) for path, lines in files.items() for i, line in enumerate(lines)
                if line.startswith(f"constexpr int {const} = ")]
        if not hits:
            raise ValueError(f"no `constexpr int {const} = ...;` line in the CUDA sources")
        for path, i in hits:
            line = files[path][i]
            comment = line.split("//", 1)[1] if "//" in line else ""
            files[path][i] = f"constexpr int {const} = {value};" + (f"  //{comment}" if comment else "\n")
    for path, lines in files.items():
        path.write_text("".join(lines))


class Variant:
    """One configuration of the cuda backend: its sources, library cache, plans and split plan, swapped in by
    activate(): the sources and libraries into mla_decode.cuda.build, the split plan into mla_decode.cuda.plan, the
    plans as submission's _DISPATCH (custom_kernel's decision per kind of input, whose plan is a CudaDecode holding
    the library and split count it was made with). The caches are per variant, so nothing is rebuilt or planned
    again."""

    def __init__(self, name: str, csrc: Path, splits: int | None):
        self.name, self.csrc, self.splits = name, csrc, splits
        self.libs: dict = {}
        self.dispatch: dict = {}
        self.checked = False
        self.paged_plan = None  # paged(): the plan of the last paged call

    def activate(self) -> None:
        build.CSRC, build._LIBS, S._DISPATCH = self.csrc, self.libs, self.dispatch
        plan.cuda_plan = (lambda *args: self.splits) if self.splits else PLAN

    def __call__(self, data):
        self.activate_checked()
        return S.custom_kernel(data)

    def activate_checked(self) -> None:
        """activate(), and the library's DecodeCall layout checked at the first use."""
        self.activate()
        if not self.checked:
            self.check_layout()

    def check_layout(self) -> None:
        """The variant's library, built now for this GPU and loaded: the load refuses one whose DecodeCall is not the
        one mla_decode.cuda passes (build.check_decode_call; a --source copied from before a change to the struct
        would read garbage), here naming the variant."""
        try:
            build.library(torch.cuda.get_device_capability())
        except build.DecodeCallMismatch as e:
            raise SystemExit(f"variant {self.name!r} ({self.csrc}): {e}") from None
        self.checked = True

    def paged(self, paged, batch: int, kv_len: int, precision: str = "fast"):
        """The paged call of this variant's library on `paged` (leaderboard.Paged): a plan made now (kept as
        self.paged_plan), its run returned."""
        self.activate_checked()
        decode = mla_decode.plan(batch, paged.kv_cache.shape[1], paged.block_table.shape[1], paged.kv_cache.dtype,
                                 paged.q.device, backend="cuda", precision=precision, max_seqlen=kv_len,
                                 kv_scale_dtype=paged.kv_scale.dtype, backend_options={"schedule": "fixed"})
        self.paged_plan = decode
        return lambda: decode.run(paged.q, paged.kv_cache, paged.block_table, paged.cache_seqlens, paged.kv_scale)

    def num_splits(self, paged: bool = False) -> int:
        """The split count of the variant's plan: the paged plan's, or the leaderboard call's (after a call: its
        one kind of input so far)."""
        if paged:
            return self.paged_plan.impl.num_splits
        (decision,) = self.dispatch.values()
        return decision.plan.impl.num_splits


def run_ab_serving(args, variants: dict) -> None:
    """ab over serving rows (args.serving): each variant's plan of the row (serving.py's cuda method), checked, then
    timed the leaderboard's way, variants interleaved per row."""
    device = torch.device("cuda")
    timer, results = Timer(device), {name: [] for name in variants}
    ctx = SimpleNamespace(device=device)  # all the cuda method's prepare reads of its context
    for shape in args.serving:
        case, cells = serving.Case(shape, device), []
        for name, variant in variants.items():
            variant.activate_checked()
            prepared = serving._ours("cuda", args.format)(ctx, case)
            verdict = prepared.check(prepared.fn())
            us = statistics.median(timer.leaderboard(prepared.fn, args.iters))
            results[name].append(us)
            cells.append(f"{name} {us:8.1f}{'' if verdict.ok else ' FAIL'}")
        print(f"{shape.name}: " + "  ".join(cells), flush=True)
    print(f"geomean {args.format} serving rows: " + "  ".join(
        f"{name} {math.prod(r) ** (1 / len(r)):.1f}" for name, r in results.items()), flush=True)


def run_ab(args, variants: dict) -> None:
    timer = Timer(torch.device("cuda"))
    results = {name: [] for name in variants}
    for shape in args.shapes:
        batch, kv_len = shape.batch, shape.kv
        data = R.generate_input(batch, 1, kv_len, seed=shape.seed)
        paged = leaderboard._paged(data, args.format, args.page, shuffled=not args.in_order) if args.page else None
        cells = []
        for name, variant in variants.items():
            call = (variant.paged(paged, batch, kv_len, args.precision) if paged
                    else lambda variant=variant, data=data: variant(data))
            out = call()
            ok, _ = R.check_implementation(data, out[0].view(batch, *out[0].shape[2:]) if paged else out)
            call()
            us = statistics.median(timer.leaderboard(call, args.iters))
            results[name].append(us)
            cells.append(f"{name} {us:7.1f}{'' if ok else ' FAIL'}")
        print(f"{batch}x{kv_len}: " + "  ".join(cells), flush=True)
    print(f"geomean {args.format} {args.precision}{f' pages of {args.page}' if args.page else ''}: " + "  ".join(
        f"{name} {math.prod(r) ** (1 / len(r)):.1f}" for name, r in results.items()), flush=True)


# The marks in the order they are passed, each stamped on the line after its `// TUNE: name` line, in the wgmma
# kernel (wgmma.cuh) or, for the handoff's IN_MERGE marks, in the merge shared with the mma.sync kernel (merge.cuh;
# stamped there too). "tile" stamps tile i landing (i < TILE_MARKS: that many slots); the four after it time the
# phases of tile 0's math.
MARKS = ("entry", "start", "issued", "Q", "tile", "scored", "maxed", "P", "PV", "loop", "staged", "partial", "synced",
         "arrived", "barrier", "lse", "merged")
TILE_MARKS = 5
TILE0_MARKS = ("scored", "maxed", "P", "PV")
HANDOFF_MARKS = ("synced", "arrived", "barrier", "lse", "merged")
IN_MERGE = ("synced", "arrived", "barrier", "lse")
DECLARED_IN = "common.cuh"  # the stamps' buffer is declared at its `namespace mla {`, before every stamp


def mark_file(name: str) -> str:
    return "merge.cuh" if name in IN_MERGE else "wgmma.cuh"


def _mark_slots() -> tuple[dict[str, int], int]:
    """Each mark's first slot in a CTA's row of stamps (tile takes TILE_MARKS), and the row's length."""
    slots, k = {}, 0
    for name in MARKS:
        slots[name] = k
        k += TILE_MARKS if name == "tile" else 1
    return slots, k


MARK_SLOTS, SLOTS = _mark_slots()


def add_timeline(csrc: Path, clock: bool = False) -> None:
    """Stamps the MARKS (%globaltimer, or %clock64 with clock) into the sources in `csrc` (a copy) and exports them
    (mla_timeline_get). A ValueError names a mark whose `// TUNE: name` line is missing, repeated or in another file."""
    texts = {path.name: path.read_text() for path in build.source_files(csrc)}
    block = f"static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x) * {SLOTS}"
    decl = f"__device__ unsigned long long mla_timeline[16384 * {SLOTS}];\nconstexpr int TILE_MARKS = {TILE_MARKS};\n"
    if texts[DECLARED_IN].count("namespace mla {\n") != 1:
        raise ValueError(f"{DECLARED_IN}: expected one `namespace mla {{` to declare the timeline at")
    texts[DECLARED_IN] = texts[DECLARED_IN].replace("namespace mla {\n", "namespace mla {\n" + decl)
    timer = "clock64" if clock else "globaltimer"
    for name in MARKS:
        anchor = re.compile(rf"^( *)// TUNE: {re.escape(name)}\n", re.MULTILINE)
        found = {file: len(anchor.findall(text)) for file, text in texts.items() if anchor.search(text)}
        if found != {mark_file(name): 1}:
            raise ValueError(f"timeline mark {name!r}: expected one `// TUNE: {name}` line, in {mark_file(name)}; "
                             f"found {found or 'none'}")
        slot = MARK_SLOTS[name]
        guard, index = "", str(slot)
        if name == "tile":
            guard, index = "i < TILE_MARKS && ", f"{slot} + i"
        elif name in TILE0_MARKS:
            guard = "i == 0 && "
        stamp = (f"if ({guard}threadIdx.x == 0) {{ unsigned long long t_; asm volatile(\"mov.u64 %0, %%{timer};\""
                 f" : \"=l\"(t_)); mla_timeline[{block} + {index}] = t_; }}\n")
        file = mark_file(name)
        texts[file] = anchor.sub(lambda m, stamp=stamp: m.group(0) + m.group(1) + stamp, texts[file])
    texts[build.MAIN_SOURCE] += ('\nextern "C" int mla_timeline_get(void* dst) {\n  return static_cast<int>('
                             'cudaMemcpyFromSymbol(dst, mla::mla_timeline, sizeof(mla::mla_timeline)));\n}\n')
    for file, text in texts.items():
        (csrc / file).write_text(text)


def run_timeline(args, variants: dict, workdir: Path) -> None:
    slots = MARK_SLOTS
    for shape in args.shapes:
        batch, kv_len = shape.batch, shape.kv
        data = R.generate_input(batch, 1, kv_len, seed=shape.seed)
        paged = leaderboard._paged(data, args.format, args.page, shuffled=not args.in_order) if args.page else None
        for variant in variants.values():
            csrc = copy_sources(variant.csrc, workdir / f"timeline_{batch}x{kv_len}_{variant.name}")
            add_timeline(csrc, args.clock)
            stamped = Variant(variant.name, csrc, variant.splits)
            call = stamped.paged(paged, batch, kv_len) if paged else lambda stamped=stamped, data=data: stamped(data)
            call()
            torch.cuda.synchronize()
            lib = stamped.libs[(torch.cuda.get_device_capability(), False)]  # the fast kernel's library
            splits = stamped.num_splits(paged is not None)
            ctas, tiles = batch * splits, -(-kv_len // splits // plan.BLOCK_N)
            cols = []
            for name in MARKS:
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
                call()
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
            layout = f", pages of {args.page}" if paged else ""
            print(f"{batch}x{kv_len}{layout} {variant.name}: {splits} splits, {ctas} CTAs, {tiles} tiles each; "
                  f"{unit}, min/median/max over CTAs (scored..PV: tile 0)")
            width = 20 if args.clock else 14
            print("  " + "  ".join(f"{name:>{width}}" for name, _ in cols))
            fmt = ".0f" if args.clock else "4.1f"
            print("  " + "  ".join(f"{rel[:, k].min():{fmt}}/{rel[:, k].median():{fmt}}/{rel[:, k].max():{fmt}}"
                                   .rjust(width) for _, k in cols), flush=True)


# phases: the stamps of the 64-row kernel's pair loop, in PHASES_IN: `// TUNE: pairs` before the loop (the sums start),
# each of PHASE_MARKS in the loop (the cycles since the previous stamp go to that phase; the first also counts a pair)
# and `// TUNE: pairs-done` after it (threads 0 and 128 write their warpgroup's sums).
PHASE_MARKS = ("pair-top", "pair-scores", "pair-softmax", "pair-values")
PHASES_IN = "wgmma64.cuh"
PHASE_SLOTS = len(PHASE_MARKS) + 1  # the phases' cycles, then the pairs walked
PHASE_CTAS = 16384  # the stamps' buffer: CTAs of a grid it holds (two warpgroups each)


def add_phases(csrc: Path) -> None:
    """Stamps the 64-row kernel's pair loop in the sources in `csrc` (a copy) with %clock64 phase sums and exports them
    (mla_phases_get, mla_phases_clear). A ValueError names an anchor that is missing or repeated."""
    path = csrc / PHASES_IN
    text = path.read_text()
    n = PHASE_SLOTS
    cta = "(blockIdx.y * gridDim.x + blockIdx.x) * 2 + (threadIdx.x >> 7)"
    stamps = {"pairs": f"unsigned long long ph_[{n}] = {{}};\nlong long pt_ = clock64();",
              "pairs-done": f"if ((threadIdx.x & 127) == 0)\n  for (int k_ = 0; k_ < {n}; ++k_) "
                            f"mla_phases[({cta}) * {n} + k_] = ph_[k_];"}
    for k, name in enumerate(PHASE_MARKS):
        count = f" ph_[{n - 1}] += 1;" if k == 0 else ""
        stamps[name] = f"{{ const long long t_ = clock64(); ph_[{k}] += t_ - pt_; pt_ = t_;{count} }}"
    if text.count("namespace mla {\n") != 1:
        raise ValueError(f"{PHASES_IN}: expected one `namespace mla {{` to declare the phase sums at")
    decl = f"__device__ unsigned long long mla_phases[{PHASE_CTAS} * 2 * {n}];\n"
    text = text.replace("namespace mla {\n", "namespace mla {\n" + decl)
    for name, stamp in stamps.items():
        anchor = re.compile(rf"^( *)// TUNE: {re.escape(name)}\n", re.MULTILINE)
        if len(anchor.findall(text)) != 1:
            raise ValueError(f"phase mark {name!r}: expected one `// TUNE: {name}` line in {PHASES_IN}")
        text = anchor.sub(lambda m, stamp=stamp: m.group(0) + "".join(m.group(1) + line + "\n"
                                                                     for line in stamp.split("\n")), text)
    path.write_text(text)
    main_source = csrc / build.MAIN_SOURCE
    main_source.write_text(main_source.read_text() + (
        '\n#if MLA_WGMMA\nextern "C" int mla_phases_get(void* dst) {\n'
        '  return static_cast<int>(cudaMemcpyFromSymbol(dst, mla::mla_phases, sizeof(mla::mla_phases)));\n}\n'
        'extern "C" int mla_phases_clear() {\n  void* p = nullptr;\n'
        '  const cudaError_t e = cudaGetSymbolAddress(&p, mla::mla_phases);\n'
        '  return static_cast<int>(e != cudaSuccess ? e : cudaMemset(p, 0, sizeof(mla::mla_phases)));\n}\n#endif\n'))


def run_phases(args, variants: dict, workdir: Path) -> None:
    device = torch.device("cuda")
    ctx = SimpleNamespace(device=device)
    names = ("top", "scores", "softmax", "values")
    for shape in args.serving:
        case = serving.Case(shape, device)
        for variant in variants.values():
            csrc = copy_sources(variant.csrc, workdir / f"phases_{shape.name}_{variant.name}")
            add_phases(csrc)
            stamped = Variant(variant.name, csrc, None)
            stamped.activate_checked()
            prepared = serving._ours("cuda", args.format)(ctx, case)
            prepared.fn()
            lib = stamped.libs[(torch.cuda.get_device_capability(), False)]
            runs = []
            for _ in range(args.runs):
                buf = (ctypes.c_ulonglong * (PHASE_CTAS * 2 * PHASE_SLOTS))()
                if lib.mla_phases_clear():
                    raise RuntimeError("mla_phases_clear failed")
                torch.cuda.synchronize()
                clear_l2_cache()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                prepared.fn()
                end.record()
                torch.cuda.synchronize()
                if lib.mla_phases_get(ctypes.cast(buf, ctypes.c_void_p)):
                    raise RuntimeError("mla_phases_get failed")
                sums = torch.tensor(buf[:], dtype=torch.float64).view(PHASE_CTAS, 2, PHASE_SLOTS)
                runs.append((start.elapsed_time(end) * 1e3, sums))
            us, sums = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            pairs = sums[:, :, -1].sum(dim=0)  # (2,): pairs walked, per warpgroup
            ctas = int((sums[:, 0, -1] > 0).sum())
            if not ctas:
                print(f"{shape.name} {variant.name}: {us:.1f} us, no 64-row CTA ran (the plan took other units)")
                continue
            per_pair = sums[:, :, :-1].sum(dim=0) / pairs[:, None]
            cells = "; ".join(f"warpgroup {w}: " + ", ".join(f"{name} {per_pair[w, k]:.0f}" for k, name in
                                                              enumerate(names)) + f" = {per_pair[w].sum():.0f}"
                              for w in range(2))
            print(f"{shape.name} {variant.name}: {us:.1f} us (stamped), {ctas} CTAs, {pairs[0] / ctas:.1f} pairs "
                  f"each; cycles per pair: {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("ab", "timeline", "phases"))
    parser.add_argument("--variant", action="append", default=[], help="NAME=[CONST:VALUE[;...]][@SPLITS]")
    parser.add_argument("--source", action="append", default=[], help="NAME=DIR of a copy of mla_decode/cuda/csrc")
    parser.add_argument("--shapes", help="BATCHxKV[,...] among task.yml's benchmarks (default: all 8)")
    parser.add_argument("--format", choices=("fp8", "mxfp4"), default="fp8")
    parser.add_argument("--precision", choices=("fast", "precise"), default="fast",
                        help="ab over the leaderboard shapes: precise times the mma.sync kernel (MLA_PRECISION)")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--page", type=int, help="time (ab) or stamp (timeline) the paged plan run over pages of "
                        "this many rows")
    parser.add_argument("--in-order", action="store_true", help="with --page: the pages in the cache's order, not "
                        "shuffled (what the table's scattered pages cost)")
    parser.add_argument("--serving", type=Path, help="ab, phases: rows of this serving spec (serving.yml's layout)")
    parser.add_argument("--rows", help="with --serving: the rows' names, comma-separated (default: all)")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--clock", action="store_true", help="timeline in %%clock64 cycles per CTA")
    args = parser.parse_args(argv)
    args.shapes = leaderboard.select_shapes(leaderboard.leaderboard_shapes(), args.shapes)
    if args.serving:
        if args.mode == "timeline" or args.page:
            raise SystemExit("--serving: ab or phases, and its rows bring their own pages (no --page)")
        args.serving = serving.select(serving.load_shapes(args.serving), args.rows, "rows")
    elif args.mode == "phases":
        raise SystemExit("phases: --serving SPEC (the 64-row kernel runs at 64 heads and more)")
    if not torch.cuda.is_available():
        raise SystemExit("tune_cuda.py needs an NVIDIA GPU")
    if args.precision != "fast" and (args.mode != "ab" or args.serving):
        raise SystemExit("--precision precise: ab over the leaderboard shapes only (the stamps are the fast kernel's)")
    os.environ.update(MLA_BACKEND="cuda", MLA_KV_FORMAT=args.format, MLA_PRECISION=args.precision)
    with tempfile.TemporaryDirectory(prefix="tune_cuda_") as tmp:
        workdir, variants = Path(tmp), {}
        for text in args.variant or ["now="]:
            name, consts, splits = parse_variant(text)
            csrc = copy_sources(build.CSRC, workdir / f"variant_{name}")
            patch_constants(csrc, consts)
            variants[name] = Variant(name, csrc, splits)
        for text in args.source:
            name, _, path = text.partition("=")
            variants[name] = Variant(name, Path(path), None)
        if args.mode == "ab":
            (run_ab_serving if args.serving else run_ab)(args, variants)
        elif args.mode == "phases":
            run_phases(args, variants, workdir)
        else:
            run_timeline(args, variants, workdir)


if __name__ == "__main__":
    main()
