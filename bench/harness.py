"""The bench harness: what bench/leaderboard.py and bench/serving.py share. Each bench supplies its grid (the shapes,
the inputs of a shape, its methods and their peers) and its columns; this module does the rest the same way for both:

  Context            the device, the options, the timer (utils.Timer), Triton's and FlashInfer's availability
  Prepared, Method   a method made ready for one input (the timed call, its check, notes) and its name in the grid
  measure()          one method on one input: skipped, ERROR, or its first output checked (ok or FAIL), then timed
  Result             one method on one shape: the times and the derived columns (KV GB/s, % of the read ceiling, the
                     ratio to the fastest peer that passed); each bench extends it with its own columns
  measure_read_ceiling(), memwalk_sweep()  the HBM read ceiling and the memory-only walks (bench/floor_kernels.py)
  Layout, Run        the per-method geometric means, the detail and compact tables, the JSON rewritten after every
                     shape, the Markdown section, the console report and the exit status

The benches put the repository root on sys.path before importing this module (it imports reference and utils by
name, as the leaderboard's harness does).
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import NamedTuple

import torch

import reference
from utils import Timer, l2_flush, scoped_env

MXFP4_SCALES = reference.QK_HEAD_DIM // reference.MXFP4_BLOCK  # 18 E8M0 scales per row
# KV bytes one decode must read per cache row, by format (the FP8 per-tensor scale is 4 bytes in all).
BYTES_PER_ROW = {"bf16": 2 * reference.QK_HEAD_DIM, "fp8": reference.QK_HEAD_DIM,
                 "mxfp4": reference.QK_HEAD_DIM // 2 + MXFP4_SCALES}
MEMWALK_SPLITS = (1, 2, 4, 8, 16, 32, 64)
MEMWALK_BLOCK_N = (32, 64)
FI_WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented starting point for the float workspace


class Unavailable(Exception):
    """A method cannot run on this machine (no GPU, package missing, backend not built): the row is skipped."""


class Verdict(NamedTuple):
    ok: bool
    message: str
    rel_l2: float | None = None  # the output's relative L2 error (serving: the worst query token's)
    lse_err: float | None = None  # the largest absolute LSE error, where the method writes an LSE


@dataclasses.dataclass
class Prepared:
    """A method made ready for one input: `fn` is the timed call and `check(output)` its verdict; `fresh(data)`,
    where the method has it, makes the same call on another input (its set-up, such as a plan, done there, outside
    the timing); `env` is set around every call."""
    fn: Callable[[], object]
    check: Callable[[object], Verdict]
    fresh: Callable[[tuple], Callable[[], object]] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # method-specific details, kept in the JSON


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "ours", "peer" (the fastest passing peer per shape is the reference for ratios) or "floor"
    kv_format: str  # the cache format it reads: its bytes (and bounds) are that format's
    label: str
    prepare: Callable[..., Prepared]  # the bench's inputs of one shape -> Prepared


@dataclasses.dataclass(kw_only=True)
class Result:
    """One method on one shape of a bench's grid; each bench adds the columns of its own."""
    shape: str
    method: str
    kind: str
    kv_format: str
    kv_rows: int  # the sum of the sequences' lengths
    kv_bytes: int  # those rows in the format read
    status: str = "skipped"
    reason: str = ""
    note: str = ""
    median_us: float | None = None
    mean_us: float | None = None
    min_us: float | None = None
    gbps: float | None = None
    pct_ceiling: float | None = None
    vs_best_peer: float | None = None
    rel_l2: float | None = None
    check: str = ""
    extra: dict = dataclasses.field(default_factory=dict)
    times_us: list[float] = dataclasses.field(default_factory=list)

    def take(self, verdict: Verdict) -> None:
        """Keeps the check's verdict (its status is set once the timing is done)."""
        self.rel_l2, self.check = verdict.rel_l2, verdict.message

    def derive(self, ceiling_gbps: float, best_peer_us: float | None) -> None:
        """KV GB/s, % of the read ceiling and the ratio to the fastest peer that passed on the same shape."""
        if self.median_us is None:
            return
        self.gbps = self.kv_bytes / self.median_us / 1e3
        self.pct_ceiling = 100 * self.gbps / ceiling_gbps
        if best_peer_us is not None:
            self.vs_best_peer = self.median_us / best_peer_us


# ---------------------------------------------------------------------------------------------------------
# The run's context: device, options, timer, lazily imported peers
# ---------------------------------------------------------------------------------------------------------


class Context:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args = args
        self.device = device
        self.timer = Timer(device)
        self.triton_reason = self._triton_unusable_reason()
        self._flashinfer = None
        self._flashinfer_reason: str | None = None
        self._fi_workspace: torch.Tensor | None = None

    def _triton_unusable_reason(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"triton is not importable ({e})"
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton needs a GPU here (or TRITON_INTERPRET=1 to run its kernels on the CPU)"
        return None

    def floor_kernels(self):
        """bench/floor_kernels.py, imported only where Triton can run (the import compiles nothing)."""
        if self.triton_reason:
            raise Unavailable(self.triton_reason)
        from bench import floor_kernels
        return floor_kernels

    def flashinfer(self):
        """The flashinfer module, or Unavailable with the reason (checked once)."""
        if self._flashinfer is None and self._flashinfer_reason is None:
            self._flashinfer_reason = self._import_flashinfer()
        if self._flashinfer_reason:
            raise Unavailable(self._flashinfer_reason)
        return self._flashinfer

    def _import_flashinfer(self) -> str | None:
        if self.device.type != "cuda" or torch.version.hip is not None:
            return "FlashInfer needs an NVIDIA GPU"
        major, minor = torch.cuda.get_device_capability(self.device)
        if self.args.fi_backend == "fa3" and major != 9:
            return f"FlashInfer's fa3 backend needs an sm_90 GPU; this one is sm_{major}{minor}"
        try:
            import flashinfer
            import flashinfer.mla  # noqa: F401
        except Exception as e:  # an import can fail in many ways (ABI, missing FFI runtime): report, skip the rows
            return f"import flashinfer failed: {type(e).__name__}: {e}"
        self._flashinfer = flashinfer
        return None

    def fi_workspace(self) -> torch.Tensor:
        if self._fi_workspace is None:
            self._fi_workspace = torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._fi_workspace

    def fi_wrapper(self):
        """A new FlashInfer BatchMLAPagedAttentionWrapper (--fi-backend) over the shared workspace."""
        return self.flashinfer().mla.BatchMLAPagedAttentionWrapper(self.fi_workspace(), backend=self.args.fi_backend)


def fi_csr_pages(block_table: torch.Tensor, lens: torch.Tensor, page: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR form of a block table for sequences of `lens` (int32, on the host): (page_indptr (batch + 1,)
    int32 on the host, the pages each sequence reads, in order, on `device`)."""
    needed = (lens + page - 1) // page
    page_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    page_indptr[1:] = torch.cumsum(needed, 0)
    table = block_table.cpu()
    return page_indptr, torch.cat([table[b, :needed[b]] for b in range(len(lens))]).to(device)


def fi_scales(kv_format: str, scale: torch.Tensor | None) -> dict:
    """FlashInfer run()'s scales: the FP8 cache's per-tensor scale as ckv_scale = kpe_scale; none for BF16."""
    return {"ckv_scale": scale.item(), "kpe_scale": scale.item()} if kv_format == "fp8" else {}


# ---------------------------------------------------------------------------------------------------------
# Anchors: the HBM read ceiling; the memory-only walks
# ---------------------------------------------------------------------------------------------------------


def measure_read_ceiling(ctx: Context) -> dict:
    """GB/s of the fastest read-only kernel over a buffer far larger than L2: Triton tile configs and torch's
    sum (counting bytes read). The best is the ceiling that % and floors refer to."""
    nbytes = int(ctx.args.ceiling_gib * (1 << 30))
    iters = max(5, ctx.args.iters // 5)
    candidates = []
    try:
        fk = ctx.floor_kernels()
    except Unavailable as e:
        candidates.append({"kernel": "triton read-sum", "skipped": str(e)})
    else:
        for block, loads, warps in fk.READ_CONFIGS:
            reader = fk.ReadCeiling(nbytes, ctx.device, block, loads, warps)
            if not reader.verify():
                raise RuntimeError(f"read-ceiling kernel BLOCK={block} LOADS={loads}: wrong sum")
            us = statistics.median(ctx.timer.leaderboard(reader, iters))
            candidates.append({"kernel": f"triton read-sum BLOCK={block} LOADS={loads} warps={warps}",
                               "bytes": reader.nbytes, "median_us": us, "gbps": reader.nbytes / us / 1e3})
            del reader
    candidates.append(_torch_read(ctx, nbytes, iters))
    best = max((c for c in candidates if "gbps" in c), key=lambda c: c["gbps"])
    return {"gbps": best["gbps"], "kernel": best["kernel"], "candidates": candidates}


def _torch_read(ctx: Context, nbytes: int, iters: int) -> dict:
    x = torch.randint(-1000, 1000, (nbytes // 4,), dtype=torch.int32, device=ctx.device)
    us = statistics.median(ctx.timer.leaderboard(lambda: x.sum(dtype=torch.int64), iters))
    return {"kernel": "torch int32 sum", "bytes": x.numel() * 4, "median_us": us, "gbps": x.numel() * 4 / us / 1e3}


def memwalk_sweep(ctx: Context, kv_format: str, walked: dict, kv_indptr: torch.Tensor | None, pages: tuple | None,
                  max_len: int, expected_sum: int, extra: tuple = ()) -> list:
    """The memory-only walks (floor_kernels.MemWalk over `walked`, through `pages` where given) of every split count
    x tile height of the sweep and of the `extra` (splits, BLOCK_N) configurations, each checked against
    `expected_sum` (a mismatch raises) and timed: [(median µs, splits, BLOCK_N, walk)] in configuration order."""
    fk = ctx.floor_kernels()
    sweep_iters = max(3, ctx.args.iters // 5)
    configs = {(splits, block_n) for block_n in MEMWALK_BLOCK_N for splits in MEMWALK_SPLITS
               if splits == 1 or splits <= math.ceil(max_len / block_n)}  # no split without a tile to read
    sweep = []
    for splits, block_n in sorted(configs | set(extra)):
        walk = fk.MemWalk(kv_format, walked, kv_indptr, splits, block_n, pages)
        if walk.checksum(walk()) != expected_sum:
            raise RuntimeError(f"memwalk {kv_format} splits={splits} BLOCK_N={block_n}: checksum mismatch")
        sweep.append((statistics.median(ctx.timer.leaderboard(walk, sweep_iters)), splits, block_n, walk))
    return sweep


def fastest_walk(sweep: list, expected_sum: int) -> Prepared:
    """The memory-walk method of a sweep (memwalk_sweep): its fastest walk, checked by its checksum against the one
    torch computed over the same bytes, with the sweep kept in the JSON."""
    _, splits, block_n, walk = min(sweep, key=lambda t: t[0])

    def check(out) -> Verdict:
        got = walk.checksum(out)
        return Verdict(got == expected_sum, f"checksum {got:#010x} (expected {expected_sum:#010x})")

    return Prepared(fn=walk, check=check, note=f"best of sweep: splits {splits}, BLOCK_N {block_n}",
                    extra={"sweep": [{"splits": s, "block_n": b, "median_us": t} for t, s, b, _ in sweep]})


# ---------------------------------------------------------------------------------------------------------
# One method on one input: prepare, check the first output, warm up, time
# ---------------------------------------------------------------------------------------------------------


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def measure(ctx: Context, result: Result, prepare: Callable[[], Prepared],
            more: Callable[[Prepared], None] | None = None) -> Result:
    """`result` filled by one method on one input: skipped with the reason where prepare() finds that the method
    cannot run here, ERROR (its traceback printed) where anything raises, else ok or FAIL by the verdict on its first
    output, with the median, mean and best of --iters calls timed the leaderboard's way after --warmup more; then
    `more(prepared)`, the bench's further timings. Prepared.env is set around every call."""
    try:
        prepared = prepare()
        result.note, result.extra = prepared.note, prepared.extra
        with scoped_env(prepared.env):
            out = prepared.fn()
            ctx.timer.sync()
            verdict = prepared.check(out)
            result.take(verdict)
            del out
            for _ in range(ctx.args.warmup):
                prepared.fn()
            result.times_us = ctx.timer.leaderboard(prepared.fn, ctx.args.iters)
            if more is not None:
                more(prepared)
    except (Unavailable, NotImplementedError) as e:  # not available here, or a backend not built yet
        result.status, result.reason = "skipped", str(e) if isinstance(e, Unavailable) else first_line(e)
        return result
    except Exception as e:  # a method that raises is reported loudly (ERROR, exit status 1); the others still run
        traceback.print_exc()
        result.status, result.reason = "ERROR", first_line(e)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        return result
    result.status = "ok" if verdict.ok else "FAIL"
    result.median_us = statistics.median(result.times_us)
    result.mean_us = statistics.fmean(result.times_us)
    result.min_us = min(result.times_us)
    return result


# ---------------------------------------------------------------------------------------------------------
# Derived columns and the per-method summary
# ---------------------------------------------------------------------------------------------------------


def best_peers(results: list[Result]) -> dict[str, float]:
    """Per shape, the median µs of the fastest peer that passed its check."""
    best: dict[str, float] = {}
    for r in results:
        if r.kind == "peer" and r.status == "ok" and r.median_us < best.get(r.shape, math.inf):
            best[r.shape] = r.median_us
    return best


def add_derived(results: list[Result], ceiling_gbps: float) -> None:
    best_peer = best_peers(results)
    for r in results:
        r.derive(ceiling_gbps, best_peer.get(r.shape))


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


@dataclasses.dataclass(frozen=True)
class Layout:
    """A bench's columns: the detail table's numbers, the per-method geometric means of its summary, and the rows of
    those means that its compact table prints under the ratio to the best peer."""
    detail: tuple[tuple[str, str, str], ...]  # (header, Result attribute, format)
    geomeans: tuple[tuple[str, str], ...]  # (summary key, Result attribute), geometric mean over the timed shapes
    compact_rows: tuple[tuple[str, str], ...] = ()  # (row label, summary key), in µs
    method_keys: tuple[str, ...] = ("kind", "label")  # the Method fields each summary repeats


def summarize(results: list[Result], methods: list[Method], n_shapes: int, layout: Layout) -> dict:
    """Per method: geometric means over the shapes it was timed on (a FAIL row still counts its time; `failed` says
    how many did)."""
    out = {}
    for m in methods:
        timed = [r for r in results if r.method == m.name and r.median_us is not None]
        out[m.name] = {
            **{key: getattr(m, key) for key in layout.method_keys},
            "shapes_timed": len(timed),
            "shapes_total": n_shapes,
            "failed": sum(r.status == "FAIL" for r in timed),
            **{key: geomean([v for r in timed if (v := getattr(r, attr)) is not None])
               for key, attr in layout.geomeans},
        }
    return out


# ---------------------------------------------------------------------------------------------------------
# Tables: the detail table per shape, the compact table (printed last); text and Markdown
# ---------------------------------------------------------------------------------------------------------


def fmt_or_dash(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def detail_table(results: list[Result], layout: Layout, shape: str | None = None) -> list[list[str]]:
    """Method, status, the layout's numbers and a note (the reason of a skip or ERROR; a FAIL's check first) per
    result: of one shape, or of all with a shape column."""
    header = ["method", "status", *(h for h, _, _ in layout.detail), "note"]
    body = []
    for r in results:
        if shape is not None and r.shape != shape:
            continue
        note = r.reason if r.status in ("skipped", "ERROR") else r.note
        if r.status == "FAIL":
            note = f"{r.check}; {note}" if note else r.check
        cells = [r.method, r.status, *(fmt_or_dash(getattr(r, attr), spec) for _, attr, spec in layout.detail), note]
        body.append(cells if shape else [r.shape, *cells])
    return [header if shape else ["shape", *header], *body]


def compact_cell(r: Result) -> str:
    if r.status == "skipped":
        return "skip"
    if r.status == "ERROR":
        return "ERROR"
    return f"{r.median_us:.1f}" + ("!" if r.status == "FAIL" else "")


def compact_table(results: list[Result], summary: dict, shapes: list[tuple[str, int]], methods: list[Method],
                  ceiling_gbps: float, layout: Layout) -> list[list[str]]:
    """Shapes (name, KV rows) down, methods across, median µs (skip, ERROR, ! for a failed check), and the FP8 floor
    (the FP8 bytes over the ceiling); then the geometric means, their ratio to the best peer and the layout's rows."""
    by_key = {(r.shape, r.method): r for r in results}
    floors = {name: kv_rows * BYTES_PER_ROW["fp8"] / ceiling_gbps / 1e3 for name, kv_rows in shapes}
    table = [["shape", *(m.name for m in methods), "FP8 floor"]]
    for name, _ in shapes:
        table.append([name, *(compact_cell(by_key[(name, m.name)]) for m in methods), f"{floors[name]:.1f}"])
    geomeans, ratios = ["geomean"], ["vs best peer"]
    extra = [[label] for label, _ in layout.compact_rows]
    for m in methods:
        sm = summary[m.name]
        partial = "" if sm["shapes_timed"] in (0, sm["shapes_total"]) else f" ({sm['shapes_timed']}/{len(shapes)})"
        geomeans.append(fmt_or_dash(sm["geomean_us"], ".1f") + ("!" if sm["failed"] else "") + partial)
        ratios.append(fmt_or_dash(sm["geomean_vs_best_peer"], ".2f"))
        for row, (_, key) in zip(extra, layout.compact_rows, strict=True):
            row.append(fmt_or_dash(sm[key], ".1f"))
    return [*table, [*geomeans, f"{geomean(list(floors.values())):.1f}"], [*ratios, ""], *([*row, ""] for row in extra)]


TEXT_COLUMNS = ("shape", "method", "status", "note")  # left-aligned; the numbers are right-aligned


def render_text(table: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    left = [name in TEXT_COLUMNS for name in table[0]]
    lines = ["  ".join(cell.ljust(w) if is_left else cell.rjust(w)
                       for cell, w, is_left in zip(row, widths, left, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table[1:]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The run: its meta (device, versions, flush), the results, the JSON, Markdown and console report
# ---------------------------------------------------------------------------------------------------------


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "hip": torch.version.hip}
    for dist, module in (("triton", "triton"), ("flashinfer-python", "flashinfer"), ("aiter", "aiter")):
        mod = sys.modules.get(module)
        version = getattr(mod, "__version__", None) if mod else None
        if version is None:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = None
        out[module] = version
    return out


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()})", "sms": None, "l2_bytes": None}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "sms": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "capability": list(torch.cuda.get_device_capability())}


def flush_info(device: torch.device) -> dict | None:
    """The L2 flush this run times with (utils.l2_flush, measured on first use); None on the CPU (no flush)."""
    if device.type != "cuda":
        return None
    flush = l2_flush(torch.cuda.current_device())
    return {"bytes": flush.buffer.numel(), "passes": flush.passes, "ms": flush.seconds * 1e3}


def start(ctx: Context, script: str, argv: list[str] | None) -> dict:
    """Refuses a real run without a GPU; prints the device and the L2 flush; returns the meta every bench records:
    date, command (`python3 script` and argv, sys.argv's when None), device, versions, counts and flush."""
    if ctx.device.type != "cuda" and not ctx.args.dry_run:
        raise SystemExit("no GPU here: use --dry-run to exercise the script on the CPU")
    dev = device_info(ctx.device)
    sizes = f", {dev['sms']} SMs, L2 {dev['l2_bytes'] / 2**20:.0f} MiB" if dev["sms"] else ""
    print(f"device: {dev['name']}{sizes}")
    flush = flush_info(ctx.device)
    if flush:
        print(f"L2 flush: {flush['passes']} fills of {flush['bytes'] / 2**20:.0f} MiB, {flush['ms']:.2f} ms")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python3", script, *(sys.argv[1:] if argv is None else argv)]),
        "dry_run": ctx.args.dry_run,
        "device": dev,
        "versions": versions(),
        "iters": ctx.args.iters,
        "warmup": ctx.args.warmup,
        "ceiling_gib": ctx.args.ceiling_gib,
        "flush": flush,
    }


def markdown_title(meta: dict) -> str:
    """`date · device, SMs[ · dry run]`: the part of a run's Markdown heading that names the run."""
    dev = meta["device"]
    sms = f", {dev['sms']} SMs" if dev.get("sms") else ""
    return f"{meta['date']} · {dev['name']}{sms}{' · dry run' if meta['dry_run'] else ''}"


def markdown_meta(result: dict, version_keys: tuple[str, ...], versions_tail: str = "") -> list[str]:
    """The Command, Versions (those of version_keys that are known, then versions_tail), Timing (with the L2 flush)
    and read-ceiling lines of a run's Markdown section."""
    meta, ceiling = result["meta"], result["anchors"]["read_ceiling"]
    v, flush = meta["versions"], meta["flush"]
    version_text = ", ".join(f"{k} {v[k]}" for k in version_keys if v.get(k))
    return [
        f"- Command: `{meta['command']}`",
        f"- Versions: {version_text}{versions_tail}",
        f"- Timing: {meta['timing']}" + (f"; L2 flush {flush['passes']} fills of {flush['bytes'] / 2**20:.0f} MiB, "
                                         f"{flush['ms']:.2f} ms" if flush else ""),
        f"- HBM read ceiling: **{ceiling['gbps']:.0f} GB/s** ({ceiling['kernel']}, {meta['ceiling_gib']:g} GiB)",
    ]


class ShapeDone(NamedTuple):
    name: str
    kv_rows: int  # for the FP8 floor
    heading: str  # above its detail table on the console
    record: dict  # its entry in the JSON's "shapes"


class Run:
    """One run of a bench: the results as they come, the JSON rewritten after every shape (a run cut short still
    leaves what it measured), and at the end the tables, the Markdown and the exit status."""

    def __init__(self, ctx: Context, layout: Layout, methods: list[Method], n_shapes: int, meta: dict,
                 anchors: dict, results_key: str):
        self.ctx, self.layout, self.methods, self.n_shapes = ctx, layout, methods, n_shapes
        self.meta, self.anchors, self.results_key = meta, anchors, results_key
        self.results: list[Result] = []
        self.done: list[ShapeDone] = []

    def add(self, result: Result) -> None:
        self.results.append(result)

    def shape_done(self, shape: ShapeDone) -> None:
        """After a shape's results are in and the bench has let go of its inputs: cached memory freed, JSON written."""
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        self.done.append(shape)
        if self.ctx.args.json:
            self.ctx.args.json.parent.mkdir(parents=True, exist_ok=True)
            self.ctx.args.json.write_text(json.dumps(self.report(), indent=1))

    def report(self) -> dict:
        add_derived(self.results, self.anchors["read_ceiling"]["gbps"])
        return {
            "meta": self.meta | {"complete": len(self.done) == self.n_shapes},
            "anchors": self.anchors,
            "shapes": [s.record for s in self.done],
            "methods": summarize(self.results, self.methods, len(self.done), self.layout),
            self.results_key: [dataclasses.asdict(r) for r in self.results],
        }

    def finish(self, markdown_head: Callable[[dict], list[str]], legend: str) -> int:
        """Prints each shape's detail table; writes the Markdown (markdown_head(report), then the compact table, the
        methods and every row); prints the skips, errors and failures, the legend and the compact table. The exit
        status is 1 when a row is FAIL or ERROR."""
        result = self.report()
        ceiling = self.anchors["read_ceiling"]["gbps"]
        compact = compact_table(self.results, result["methods"], [(s.name, s.kv_rows) for s in self.done],
                                self.methods, ceiling, self.layout)
        for shape in self.done:
            print(shape.heading)
            print(render_text(detail_table(self.results, self.layout, shape.name)))
        if self.ctx.args.markdown:
            self.ctx.args.markdown.parent.mkdir(parents=True, exist_ok=True)
            tables = markdown_tables(result["methods"], self.results, compact, detail_table(self.results, self.layout))
            self.ctx.args.markdown.write_text("\n".join([*markdown_head(result), *tables]))
        print()
        for method, status, reason in sorted({(r.method, r.status, r.reason) for r in self.results
                                              if r.status in ("skipped", "ERROR")}):
            print(f"{status}: {method}: {reason}")
        failed = [f"{r.shape} {r.method}: {r.check}" for r in self.results if r.status == "FAIL"]
        for f in failed:
            print(f"FAIL: {f}")
        print(legend)
        print(render_text(compact))
        return 1 if failed or any(r.status == "ERROR" for r in self.results) else 0


def markdown_tables(summary: dict, results: list[Result], compact: list[list[str]], detail: list[list[str]]
                    ) -> list[str]:
    """The Markdown after a run's header: the compact table, the methods (those skipped or failed with their
    reasons) and every row, folded."""
    skipped = sorted({(r.method, r.reason) for r in results if r.status in ("skipped", "ERROR")})
    return [
        render_markdown(compact),
        "",
        *(f"- `{name}` ({m['kind']}): {m['label']}" for name, m in summary.items()),
        *(f"- `{m}` skipped or failed: {reason}" for m, reason in skipped),
        "",
        "<details><summary>Every row</summary>",
        "",
        render_markdown(detail),
        "",
        "</details>",
        "",
    ]


# The options whose default depends on --dry-run: (a real run's, a dry run's).
RUN_DEFAULTS = {"iters": (50, 3), "warmup": (5, 1), "ceiling_gib": (4.0, 1 / 1024)}


def fill_defaults(args: argparse.Namespace, more: dict[str, tuple] | None = None) -> None:
    """Each option of RUN_DEFAULTS (and of `more`, a bench's own) left unset on the command line gets the default of
    a real or of a dry run."""
    for name, (real, dry) in (RUN_DEFAULTS | (more or {})).items():
        if getattr(args, name) is None:
            setattr(args, name, dry if args.dry_run else real)


def select(available: list, names: str | None, what: str) -> list:
    """The items of `available` named in the comma-separated `names` (all when None), in that order."""
    if not names:
        return available
    by_name = {item.name: item for item in available}
    chosen = [n.strip() for n in names.split(",")]
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        raise SystemExit(f"--{what}: unknown {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in chosen]
