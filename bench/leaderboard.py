"""Benchmark of our MLA decode backends against every installed peer, in one process, beside the roofline.

    python3 bench/leaderboard.py [--json PATH] [--markdown PATH] [--shapes 4x1024,256x8192] [--iters 50]
                           [--methods triton-fp8,flashinfer-bf16,...] [--dry-run]
    bash bench/run_h200.sh     # on the H200 through the device tool, carry [".peers"]: FlashInfer, then this

Why one process: the read ceiling, the launch cost, our kernels and the peers are then measured on the same
GPU, clocks and software, so the ratios between them mean something.

What it measures, per shape of task.yml's benchmarks (inputs from reference.generate_input, randn, the
leaderboard's seeds) and per method (a row; one that cannot run here is printed as skipped, with the reason):
  leaderboard latency  as the leaderboard's eval.py (utils.Timer.leaderboard), for each call: synchronize, flush
                       L2 (utils.clear_l2_cache), CUDA event, the whole call, event, synchronize; median (and
                       mean) of --iters calls after one checked call and --warmup more. The flush keeps the GPU
                       busy (utils.FLUSH_TARGET_S) while the host enqueues the call, so host cost stays hidden, as
                       on the leaderboard.
  back-to-back         --iters calls in a tight loop without a flush, synchronize at the end, wall time / calls:
                       what a serving loop sees; it exposes host overhead (Python, launches, syncs).
  host, host fresh     the host's part of one call (utils.Timer.host): CPU wall time from before the call to its
                       return, no synchronize after it, median; `host` over --iters calls on the same input,
                       `host fresh` over --fresh-iters calls each on a new input of the same shape (a new seed),
                       as leaderboard mode makes them (new tensors: no cached plan or pointer helps). The
                       memory-only walks have no fresh figure (they are floors of the same bytes).
  KV GB/s, % ceiling   bytes of the KV format the method reads (BF16 1152 B/row, FP8 576, MXFP4 288 + 18 scale
                       bytes) / median time, against the HBM read ceiling measured first in the same run.
  floor µs             those bytes / the ceiling: no kernel reading that format can be faster.
  vs best peer         median / the fastest peer's median on that shape (peers: FlashInfer, the torch eager
                       reference); below 1 is faster than every peer.
  rel-L2, check        against reference.ref_kernel (BF16 truth); a row whose first output fails
                       reference.check_implementation (with the bound of the format it reads) is FAIL.
Anchors measured first: the HBM read ceiling (a Triton int32 sum over --ceiling-gib GiB, best of a few tile
configs, and torch's sum), and an empty launch timed both ways (an empty Triton kernel, a one-element torch op).
The memory-only walks (memwalk-*) read exactly our kernel's bytes in its split-KV tile pattern with no math; the
best of a small sweep over split counts and tile heights (our kernel's own plan among them, timed and noted) is
each shape's practical floor.

--dry-run runs the same code path on two tiny shapes on whatever device there is (the CPU: wall-clock timing,
no flush); Triton rows run there only under TRITON_INTERPRET=1. tests/test_bench.py runs it.
The exit status is 1 when any row is FAIL or ERROR (the outputs are written first).
"""

import argparse
import dataclasses
import datetime
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# The harness's top-level modules (reference, submission, utils) are imported by name, as the harness does, and
# floor_kernels from this package (bench).
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
import yaml  # noqa: E402

import mla_decode  # noqa: E402
import reference  # noqa: E402
import submission  # noqa: E402
from mla_decode.triton import triton_plan, triton_target  # noqa: E402
from utils import Timer, get_device, l2_flush, scoped_env  # noqa: E402

# KV bytes one decode must read per cache row, by format (the FP8 per-tensor scale is 4 bytes in all).
BYTES_PER_ROW = {"bf16": 2 * reference.QK_HEAD_DIM, "fp8": reference.QK_HEAD_DIM,
                 "mxfp4": reference.QK_HEAD_DIM // 2 + reference.QK_HEAD_DIM // reference.MXFP4_BLOCK}
DRY_RUN_SHAPES = ((2, 64, 11), (3, 37, 12))  # (batch, kv length, seed): tiny, and one length not a tile multiple
MEMWALK_SPLITS = (1, 2, 4, 8, 16, 32, 64)
MEMWALK_BLOCK_N = (32, 64)
FI_WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented starting point for the float workspace
PAGE_SIZES = (64, 16, 1)  # the paged rows' page sizes
# (backend, format, precision, the method name's tag) of the library's paged rows
PAGED_KERNELS = (("cuda", "fp8", "fast", ""), ("cuda", "fp8", "precise", "-precise"), ("cuda", "mxfp4", "fast", ""),
                 ("triton", "fp8", "fast", ""))
MXFP4_SCALES = 18  # E8M0 scales per row


class Unavailable(Exception):
    """A method cannot run on this machine (no GPU, package missing, backend not built): the row is skipped."""


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    kv: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.kv}"


@dataclasses.dataclass
class Prepared:
    """A method made ready for one input: `fn` is the timed call; `check(output)` -> (ok, rel_l2 or None, msg);
    `fresh(data)`, where the method has it, makes the same call on another input (its set-up, such as a plan, done
    there, outside the timing)."""
    fn: Callable[[], object]
    check: Callable[[object], tuple[bool, float | None, str]]
    fresh: Callable[[tuple], Callable[[], object]] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # method-specific details, kept in the JSON


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "ours", "peer" (the best peer per shape is the reference for ratios) or "floor"
    kv_format: str  # the cache format it reads: its KV bytes are counted in that format
    label: str
    prepare: Callable[["Context", Shape, tuple, torch.Tensor], Prepared]


@dataclasses.dataclass
class Row:
    shape: str
    batch: int
    kv: int
    method: str
    kind: str
    kv_format: str
    kv_rows: int
    status: str = "skipped"
    reason: str = ""
    note: str = ""
    median_us: float | None = None
    mean_us: float | None = None
    min_us: float | None = None
    back_to_back_us: float | None = None
    host_us: float | None = None
    host_fresh_us: float | None = None
    kv_bytes: int = 0
    gbps: float | None = None
    pct_ceiling: float | None = None
    floor_us: float | None = None
    vs_best_peer: float | None = None
    rel_l2: float | None = None
    check: str = ""
    extra: dict = dataclasses.field(default_factory=dict)
    times_us: list[float] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# The run's context: device, options, measured anchors, lazily imported peers
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


# ---------------------------------------------------------------------------------------------------------
# Methods: one function each that turns an input into a timed call and a check
# ---------------------------------------------------------------------------------------------------------


def _check_attention(data: tuple, expected: torch.Tensor, kv_format: str):
    """A check for an attention output: the harness's check_implementation with the bound of `kv_format`, and
    rel-L2 against the BF16 truth computed once per shape."""

    def check(out) -> tuple[bool, float | None, str]:
        ok, msg = reference.check_implementation(data, out, kv_format)
        same_shape = isinstance(out, torch.Tensor) and out.shape == expected.shape
        return ok, reference.relative_l2(out, expected) if same_shape else None, msg

    return check


def _ours(backend: str, kv_format: str, precision: str = "fast"):
    """submission.custom_kernel with MLA_BACKEND, MLA_KV_FORMAT and MLA_PRECISION forced;
    submission.leaderboard_backend decides whether the backend can run here, with its own message."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        env = {"MLA_BACKEND": backend, "MLA_KV_FORMAT": kv_format, "MLA_PRECISION": precision}
        with scoped_env(env):
            try:
                submission.leaderboard_backend(ctx.device)
            except RuntimeError as e:
                raise Unavailable(str(e)) from e
        def call(inputs: tuple) -> Callable[[], object]:
            return lambda: submission.custom_kernel(inputs)

        return Prepared(fn=call(data), check=_check_attention(data, expected, kv_format), env=env, fresh=call)

    return prepare


def _torch_reference(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
    def call(inputs: tuple) -> Callable[[], object]:
        return lambda: reference.ref_kernel(inputs)

    return Prepared(fn=call(data), check=_check_attention(data, expected, "bf16"), fresh=call)


def _flashinfer_pages(kv_indptr: torch.Tensor, total_kv: int, page: int):
    """FlashInfer's CSR page table over our contiguous cache: sequence b owns pages kv_indptr[b] / page, ...
    Needs every sequence to start on a page boundary and the cache to be whole pages; returns None otherwise."""
    starts = kv_indptr[:-1].cpu().long()
    lens = (kv_indptr[1:] - kv_indptr[:-1]).cpu().long()
    if total_kv % page or bool((starts % page).any()):
        return None
    pages_per_seq = (lens + page - 1) // page
    page_indptr = torch.zeros(lens.numel() + 1, dtype=torch.long)
    page_indptr[1:] = torch.cumsum(pages_per_seq, 0)
    total_pages = int(page_indptr[-1])
    first_page = torch.repeat_interleave(starts // page, pages_per_seq)
    offset_in_seq = torch.arange(total_pages) - torch.repeat_interleave(page_indptr[:-1], pages_per_seq)
    return page_indptr.int(), (first_page + offset_in_seq).int(), lens.int()


def _flashinfer_call(ctx: Context, data: tuple, kv_format: str) -> tuple[Callable[[], object], str]:
    """(the timed run() on data, a note): plan() done here, outside the timing."""
    fi = ctx.flashinfer()
    q, kv_data, qo_indptr, kv_indptr, config = data
    if kv_format == "bf16":
        kv, run_kwargs = kv_data["bf16"], {}
    else:
        kv, scale = kv_data["fp8"]
        if kv.dtype != torch.float8_e4m3fn:
            raise Unavailable(f"FlashInfer reads float8_e4m3fn KV; this device's FP8 cache is {kv.dtype}")
        run_kwargs = {"ckv_scale": scale.item(), "kpe_scale": scale.item()}
    total_kv = kv.shape[0]
    page = ctx.args.fi_page_size
    pages = _flashinfer_pages(kv_indptr, total_kv, page)
    note = f"page {page}"
    if pages is None:  # a layout that is not whole pages: page size 1 always fits
        page, note = 1, f"page 1 (the cache is not in whole pages of {page})"
        pages = _flashinfer_pages(kv_indptr, total_kv, page)
    page_indptr, page_indices, kv_lens = pages
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(ctx.fi_workspace(), backend=ctx.args.fi_backend)
    metadata = fi.mla.MLAPlanMetadata.csr(qo_indptr.cpu(), page_indptr, page_indices.to(ctx.device), kv_lens)
    wrapper.plan(metadata=metadata, num_heads=reference.NUM_HEADS, head_dim_ckv=reference.KV_LORA_RANK,
                 head_dim_kpe=reference.QK_ROPE_HEAD_DIM, page_size=page, causal=False,
                 sm_scale=config["sm_scale"], q_data_type=q.dtype, kv_data_type=kv.dtype)
    kv_pages = kv.view(total_kv // page, page, reference.QK_HEAD_DIM)
    return (lambda: wrapper.run(query=q, kv_cache=kv_pages, **run_kwargs)), note


def _flashinfer(kv_format: str):
    """FlashInfer's MLA decode (PEERS.md's setup): plan() once per input, outside timing; run() is the timed call.
    Query packed (total_q, 16, 576); KV a paged view (pages, page, 576) of the same cache; FP8 with its
    per-tensor scale as ckv_scale = kpe_scale."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        fn, note = _flashinfer_call(ctx, data, kv_format)
        return Prepared(fn=fn, check=_check_attention(data, expected, kv_format), note=note,
                        fresh=lambda inputs: _flashinfer_call(ctx, inputs, kv_format)[0])

    return prepare


def _kernel_plan(ctx: Context, data: tuple, kv_format: str) -> tuple[int, int]:
    """(splits, BLOCK_N) that our Triton kernel uses for this input (mla_decode's triton_plan), so the walk can also
    be timed in exactly our kernel's tile pattern."""
    q, _, _, _, config = data
    plan = triton_plan(q.shape[0], config["kv_seq_len"], triton_target(ctx.device), kv_format)
    return plan.num_splits, plan.block_n


def _memwalk(kv_format: str, page: int = 0):
    """The memory-only walk of the cache our kernel reads (page > 0: the same rows in shuffled pages of that many
    rows, through the page table, as _paged lays them out). The row is the fastest verified configuration of a
    small sweep (split count x tile height), so it is a floor for any split choice of the kernel; the sweep
    includes our kernel's own plan (mla_decode's triton_plan), whose time the note and the JSON also give."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        fk = ctx.floor_kernels()
        _, kv_data, _, kv_indptr, _ = data
        max_len = int((kv_indptr[1:] - kv_indptr[:-1]).max())
        expected_sum = fk.kv_checksum(kv_format, kv_data, kv_indptr)
        walked, pages = kv_data, None
        if page:
            paged = _paged(data, kv_format, page)
            walked = {kv_format: (paged.kv_cache, paged.kv_scale)}
            pages = (paged.block_table, paged.cache_seqlens, page)
        ours = _kernel_plan(ctx, data, kv_format)
        sweep = memwalk_sweep(ctx, kv_format, walked, kv_indptr, pages, max_len, expected_sum, extra=(ours,))
        _, splits, block_n, walk = min(sweep, key=lambda t: t[0])
        note = f"best of sweep: splits {splits}, BLOCK_N {block_n}"
        ours_us = next(t for t, s, b, _ in sweep if (s, b) == ours)
        note += f"; at our kernel's plan (splits {ours[0]}, BLOCK_N {ours[1]}): {ours_us:.1f} µs"
        extra = {"sweep": [{"splits": s, "block_n": b, "median_us": t} for t, s, b, _ in sweep],
                 "our_plan": list(ours), "our_plan_us": ours_us}
        return Prepared(fn=walk, check=checksum_check(walk, expected_sum), note=note, extra=extra)

    return prepare


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


def checksum_check(walk, expected_sum: int) -> Callable[[object], tuple[bool, float | None, str]]:
    """A memory walk's check: its checksum against the one torch computed over the same bytes."""

    def check(out) -> tuple[bool, float | None, str]:
        got = walk.checksum(out)
        return got == expected_sum, None, f"checksum {got:#010x} (expected {expected_sum:#010x})"

    return check


class Paged(NamedTuple):
    """An input's cache re-laid in pages: what the library's paged call and FlashInfer's paged wrapper take."""

    q: torch.Tensor  # (batch, 1, 16, 576)
    kv_cache: torch.Tensor  # (num_pages, page, 1, width)
    kv_scale: torch.Tensor | None  # fp8 (1,); mxfp4 (num_pages, page, 1, 18); bf16 None
    block_table: torch.Tensor  # (batch, max_pages) int32
    cache_seqlens: torch.Tensor  # (batch,) int32


def _paged(data: tuple, kv_format: str, page: int, seed: int = 0, shuffled: bool = True) -> Paged:
    """The input's `kv_format` cache as pages of `page` rows in a shuffled order (a serving engine's cache after a
    while; shuffled=False: in order, the contiguous cache's layout behind a table), the block table that finds each
    sequence's rows, and its lengths. Needs every sequence to start on a page boundary (the leaderboard's uniform
    batches of 1024 or 8192 rows do): else Unavailable."""
    q, kv_data, _, kv_indptr, _ = data
    kv, scale = (kv_data["bf16"], None) if kv_format == "bf16" else kv_data[kv_format]
    starts, lens = kv_indptr[:-1].cpu().long(), (kv_indptr[1:] - kv_indptr[:-1]).cpu().long()
    total = kv.shape[0]
    if total % page or bool((starts % page).any()):
        raise Unavailable(f"the input's sequences do not start on pages of {page} rows")
    num_pages, width = total // page, kv.shape[-1]
    order = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffled  # page i -> order[i]
             else torch.arange(num_pages))
    cache = torch.empty((num_pages, page, 1, width), dtype=kv.dtype, device=kv.device)
    cache.view(torch.uint8)[order.to(kv.device)] = kv.view(torch.uint8).view(num_pages, page, 1, -1)
    if kv_format == "mxfp4":
        rows = scale.view(torch.uint8)[:total, :MXFP4_SCALES]
        paged_scale = torch.empty((num_pages, page, 1, MXFP4_SCALES), dtype=torch.uint8, device=kv.device)
        paged_scale[order.to(kv.device)] = rows.reshape(num_pages, page, 1, MXFP4_SCALES)
        scale = paged_scale.view(scale.dtype)
    needed = (lens + page - 1) // page
    table = torch.zeros((len(lens), max(1, int(needed.max()))), dtype=torch.int32)
    for b in range(len(lens)):
        first = int(starts[b]) // page
        table[b, :needed[b]] = order[first:first + int(needed[b])].to(torch.int32)
    batch = q.shape[0]
    return Paged(q.view(batch, 1, *q.shape[1:]), cache, scale, table.to(kv.device), lens.to(torch.int32).to(kv.device))


def _ours_paged(backend: str, kv_format: str, page: int, precision: str = "fast"):
    """The library's paged call on the input's cache re-laid in shuffled pages (_paged), through a plan made once
    outside the timing (mla_decode.plan; max_seqlen the shape's length): the timed call is the plan's run, which
    allocates its output and LSE."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        paged = _paged(data, kv_format, page)
        try:
            decode = mla_decode.plan(shape.batch, page, paged.block_table.shape[1], paged.kv_cache.dtype, ctx.device,
                                     backend=backend, precision=precision, max_seqlen=shape.kv,
                                     kv_scale_dtype=torch.uint8 if paged.kv_scale is None else paged.kv_scale.dtype)
        except RuntimeError as e:
            raise Unavailable(str(e)) from e
        check = _check_attention(data, expected, kv_format)

        def call(inputs: tuple) -> Callable[[], object]:
            p = paged if inputs is data else _paged(inputs, kv_format, page)
            return lambda: decode.run(p.q, p.kv_cache, p.block_table, p.cache_seqlens, p.kv_scale)

        return Prepared(fn=call(data), check=lambda out: check(out[0].view(shape.batch, *out[0].shape[2:])),
                        fresh=call, note=f"shuffled pages of {page}")

    return prepare


def _ours_ragged(backend: str, kv_format: str):
    """The library's ragged call on the input's contiguous cache, through a plan made once outside the timing
    (mla_decode.plan_ragged; max_seqlen the shape's length): the paged rows' contiguous twin, the same plan run (its
    output and LSE allocated per call), where the leaderboard call (cuda-fp8) writes no LSE."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        kv, scale = data[1][kv_format]
        try:
            decode = mla_decode.plan_ragged(shape.batch, kv.dtype, ctx.device, shape.kv, backend=backend,
                                            kv_scale_dtype=scale.dtype)
        except RuntimeError as e:
            raise Unavailable(str(e)) from e
        check = _check_attention(data, expected, kv_format)

        def call(inputs: tuple) -> Callable[[], object]:
            q, kv_data, _, kv_indptr, _ = inputs
            kv, scale = kv_data[kv_format]
            return lambda: decode.run_ragged(q.view(shape.batch, 1, *q.shape[1:]), kv, kv_indptr, scale)

        return Prepared(fn=call(data), check=lambda out: check(out[0].view(shape.batch, *out[0].shape[2:])),
                        fresh=call, note="the library's ragged plan run, LSE written")

    return prepare


def _flashinfer_paged_call(ctx: Context, data: tuple, kv_format: str, page: int) -> Callable[[], object]:
    fi = ctx.flashinfer()
    p = _paged(data, kv_format, page)
    config = data[4]
    if kv_format == "fp8" and p.kv_cache.dtype != torch.float8_e4m3fn:
        raise Unavailable(f"FlashInfer reads float8_e4m3fn KV; this device's FP8 cache is {p.kv_cache.dtype}")
    run_kwargs = {"ckv_scale": p.kv_scale.item(), "kpe_scale": p.kv_scale.item()} if kv_format == "fp8" else {}
    lens = p.cache_seqlens.cpu()
    needed = (lens + page - 1) // page
    page_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    page_indptr[1:] = torch.cumsum(needed, 0)
    table = p.block_table.cpu()
    indices = torch.cat([table[b, :needed[b]] for b in range(len(lens))]).to(ctx.device)
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(ctx.fi_workspace(), backend=ctx.args.fi_backend)
    metadata = fi.mla.MLAPlanMetadata.csr(data[2].cpu(), page_indptr, indices, lens)
    wrapper.plan(metadata=metadata, num_heads=reference.NUM_HEADS, head_dim_ckv=reference.KV_LORA_RANK,
                 head_dim_kpe=reference.QK_ROPE_HEAD_DIM, page_size=page, causal=False,
                 sm_scale=config["sm_scale"], q_data_type=p.q.dtype, kv_data_type=p.kv_cache.dtype)
    q, kv_pages = p.q.view(p.q.shape[0], *p.q.shape[2:]), p.kv_cache.view(p.kv_cache.shape[0], page, -1)
    return lambda: wrapper.run(query=q, kv_cache=kv_pages, **run_kwargs)


def _flashinfer_paged(kv_format: str, page: int):
    """FlashInfer's MLA decode over the same shuffled pages as _ours_paged: plan() once, outside the timing."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        return Prepared(fn=_flashinfer_paged_call(ctx, data, kv_format, page),
                        check=_check_attention(data, expected, kv_format), note=f"shuffled pages of {page}",
                        fresh=lambda inputs: _flashinfer_paged_call(ctx, inputs, kv_format, page))

    return prepare


METHODS = (
    Method("cuda-fp8", "ours", "fp8", "ours: MLA_BACKEND=cuda (CUDA kernel built at first use; auto's pick on NVIDIA)",
           _ours("cuda", "fp8")),
    Method("cuda-fp8-precise", "ours", "fp8", "ours: MLA_BACKEND=cuda MLA_PRECISION=precise (the mma.sync kernel)",
           _ours("cuda", "fp8", "precise")),
    Method("cuda-mxfp4", "ours", "mxfp4", "ours: MLA_BACKEND=cuda MLA_KV_FORMAT=mxfp4 (the Hopper kernel)",
           _ours("cuda", "mxfp4")),
    Method("triton-fp8", "ours", "fp8", "ours: MLA_BACKEND=triton MLA_KV_FORMAT=fp8", _ours("triton", "fp8")),
    Method("triton-fp8-precise", "ours", "fp8", "ours: MLA_BACKEND=triton MLA_PRECISION=precise (fp16 score dot)",
           _ours("triton", "fp8", "precise")),
    Method("triton-mxfp4", "ours", "mxfp4", "ours: MLA_BACKEND=triton MLA_KV_FORMAT=mxfp4", _ours("triton", "mxfp4")),
    Method("torch-fp8", "ours", "fp8", "ours: MLA_BACKEND=torch MLA_KV_FORMAT=fp8 (portable fallback)",
           _ours("torch", "fp8")),
    Method("aiter-fp8", "ours", "fp8", "ours: MLA_BACKEND=aiter (AMD, aiter importable)", _ours("aiter", "fp8")),
    Method("torch-ref", "peer", "bf16", "torch eager reference (reference.ref_kernel, BF16 KV)", _torch_reference),
    Method("flashinfer-bf16", "peer", "bf16", "FlashInfer MLA decode, BF16 KV, plan once, run timed",
           _flashinfer("bf16")),
    Method("flashinfer-fp8", "peer", "fp8", "FlashInfer MLA decode, FP8 KV (per-tensor scale), plan once, run timed",
           _flashinfer("fp8")),
    Method("memwalk-fp8", "floor", "fp8", "memory-only walk of the FP8 cache (576 B/row), no math", _memwalk("fp8")),
    Method("memwalk-mxfp4", "floor", "mxfp4", "memory-only walk of the MXFP4 cache (288 + 18 B/row), no math",
           _memwalk("mxfp4")),
    # The library's calls beside the leaderboard rows above: the contiguous cache through its ragged plan, and the
    # same rows in shuffled pages of 64, 16 or 1.
    *(Method(f"{backend}-fp8-ragged", "ours", "fp8", f"ours: mla_decode plan_ragged ({backend}), FP8, LSE written",
             _ours_ragged(backend, "fp8")) for backend in ("cuda", "triton", "torch")),
    *(Method(f"{backend}-{fmt}{tag}-p{page}", "ours", fmt,
             f"ours: mla_decode plan ({backend}, {precision}), {fmt} pages of {page}",
             _ours_paged(backend, fmt, page, precision))
      for backend, fmt, precision, tag in PAGED_KERNELS for page in PAGE_SIZES),
    *(Method(f"flashinfer-{fmt}-p{page}", "peer", fmt, f"FlashInfer MLA decode, {fmt} pages of {page}, plan once",
             _flashinfer_paged(fmt, page)) for fmt in ("bf16", "fp8") for page in PAGE_SIZES),
    *(Method(f"memwalk-fp8-p{page}", "floor", "fp8", f"memory-only walk of the FP8 cache in pages of {page}",
             _memwalk("fp8", page)) for page in PAGE_SIZES),
)
METHOD_BY_NAME = {m.name: m for m in METHODS}


# ---------------------------------------------------------------------------------------------------------
# Anchors: the HBM read ceiling and the cost of an empty launch, measured in this run
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


def measure_empty_launch(ctx: Context) -> list[dict]:
    """An empty Triton kernel and a one-element torch op, timed the leaderboard's way and back to back: the
    first is the GPU-side cost of one more launch in a call, the second the host's cost per launch."""
    one = torch.zeros(1, device=ctx.device)
    launches = [("torch one-element add_", lambda: one.add_(1))]
    try:
        fk = ctx.floor_kernels()
    except Unavailable as e:
        skipped = [{"launch": "empty Triton kernel", "skipped": str(e)}]
    else:
        skipped = []
        launches.insert(0, ("empty Triton kernel", lambda: fk.empty_launch(one)))
    results = []
    for name, fn in launches:
        fn()  # compile
        times = ctx.timer.leaderboard(fn, ctx.args.iters)
        results.append({"launch": name, "median_us": statistics.median(times),
                        "back_to_back_us": ctx.timer.back_to_back(fn, ctx.args.iters)})
    return results + skipped


# ---------------------------------------------------------------------------------------------------------
# One row: prepare, check the first output, warm up, time both ways
# ---------------------------------------------------------------------------------------------------------


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def fresh_calls(shape: Shape, bind: Callable[[tuple], Callable[[], object]]) -> Callable[[], Callable[[], object]]:
    """Makes, on each use, the call on a new input of the shape (the next seed, +13 each time, as leaderboard mode
    does), so that no call finds its input already seen."""
    seeds = itertools.count(shape.seed + 13, 13)
    return lambda: bind(reference.generate_input(shape.batch, 1, shape.kv, next(seeds)))


def _invoke(call: Callable[[], object]) -> object:
    return call()


def measured(ctx: Context, record, attempt: Callable[[], bool]):
    """`record` (a Row, or serving.py's Result) after attempt(), which prepares, checks and times a method into it:
    skipped with the reason where the method cannot run here, ERROR (its traceback printed) where it raises, else ok
    or FAIL by attempt's verdict, with the median, mean and best of the times_us it filled."""
    try:
        ok = attempt()
    except (Unavailable, NotImplementedError) as e:  # not available here, or a backend not built yet
        record.status, record.reason = "skipped", str(e) if isinstance(e, Unavailable) else first_line(e)
        return record
    except Exception as e:  # a method that raises is reported loudly (ERROR, exit status 1); the others still run
        traceback.print_exc()
        record.status, record.reason = "ERROR", first_line(e)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        return record
    record.status = "ok" if ok else "FAIL"
    record.median_us = statistics.median(record.times_us)
    record.mean_us = statistics.fmean(record.times_us)
    record.min_us = min(record.times_us)
    return record


def best_peers(records: list) -> dict[str, float]:
    """Per shape, the median µs of the fastest peer that passed its check."""
    best: dict[str, float] = {}
    for r in records:
        if r.kind == "peer" and r.status == "ok" and r.median_us < best.get(r.shape, math.inf):
            best[r.shape] = r.median_us
    return best


def run_row(ctx: Context, method: Method, shape: Shape, data: tuple, expected: torch.Tensor) -> Row:
    kv_indptr = data[3]
    row = Row(shape=shape.name, batch=shape.batch, kv=shape.kv, method=method.name, kind=method.kind,
              kv_format=method.kv_format, kv_rows=int(kv_indptr[-1] - kv_indptr[0]))
    row.kv_bytes = row.kv_rows * BYTES_PER_ROW[method.kv_format]

    def attempt() -> bool:
        prepared = method.prepare(ctx, shape, data, expected)
        row.note, row.extra = prepared.note, prepared.extra
        with scoped_env(prepared.env):
            out = prepared.fn()
            ctx.timer.sync()
            ok, row.rel_l2, row.check = prepared.check(out)
            del out
            for _ in range(ctx.args.warmup):
                prepared.fn()
            row.times_us = ctx.timer.leaderboard(prepared.fn, ctx.args.iters)
            row.back_to_back_us = ctx.timer.back_to_back(prepared.fn, ctx.args.iters)
            row.host_us = ctx.timer.host(prepared.fn, ctx.args.iters)
            if prepared.fresh is not None:
                row.host_fresh_us = ctx.timer.host(_invoke, ctx.args.fresh_iters,
                                                   setup=fresh_calls(shape, prepared.fresh))
        return ok

    return measured(ctx, row, attempt)


def add_derived(rows: list[Row], ceiling_gbps: float) -> None:
    """GB/s, % of the ceiling, floor and the ratio to the best peer that passed its check on the same shape."""
    best_peer = best_peers(rows)
    for r in rows:
        r.floor_us = r.kv_bytes / ceiling_gbps / 1e3
        if r.median_us is None:
            continue
        r.gbps = r.kv_bytes / r.median_us / 1e3
        r.pct_ceiling = 100 * r.gbps / ceiling_gbps
        if r.shape in best_peer:
            r.vs_best_peer = r.median_us / best_peer[r.shape]


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def summarize(rows: list[Row], methods: list[Method], n_shapes: int) -> dict:
    """Per method: geometric means of the median µs and of the ratio to the best peer, over the shapes it ran
    (a FAIL row still counts its time; `failed` says how many did)."""
    out = {}
    for m in methods:
        timed = [r for r in rows if r.method == m.name and r.median_us is not None]
        out[m.name] = {
            "kind": m.kind,
            "label": m.label,
            "shapes_timed": len(timed),
            "shapes_total": n_shapes,
            "failed": sum(r.status == "FAIL" for r in timed),
            "geomean_us": geomean([r.median_us for r in timed]),
            "geomean_mean_us": geomean([r.mean_us for r in timed]),
            "geomean_back_to_back_us": geomean([r.back_to_back_us for r in timed]),
            "geomean_host_us": geomean([r.host_us for r in timed]),
            "geomean_host_fresh_us": geomean([r.host_fresh_us for r in timed if r.host_fresh_us is not None]),
            "geomean_vs_best_peer": geomean([r.vs_best_peer for r in timed if r.vs_best_peer is not None]),
            "geomean_floor_us": geomean([r.floor_us for r in timed]),
        }
    return out


# ---------------------------------------------------------------------------------------------------------
# Reporting: the detailed table, the compact table (printed last), JSON and Markdown
# ---------------------------------------------------------------------------------------------------------


def fmt_or_dash(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


DETAIL_HEADER = ("method", "status", "µs median", "µs mean", "b2b µs", "host µs", "host fresh µs", "KV GB/s",
                 "% ceil", "floor µs", "vs peer", "rel-L2", "note")


def detail_cells(r: Row) -> tuple[str, ...]:
    note = r.reason if r.status in ("skipped", "ERROR") else r.note
    if r.status == "FAIL":
        note = f"{r.check}; {note}" if note else r.check
    numbers = ((r.median_us, ".1f"), (r.mean_us, ".1f"), (r.back_to_back_us, ".1f"), (r.host_us, ".1f"),
               (r.host_fresh_us, ".1f"), (r.gbps, ".0f"), (r.pct_ceiling, ".0f"), (r.floor_us, ".1f"),
               (r.vs_best_peer, ".2f"), (r.rel_l2, ".1e"))
    return (r.method, r.status, *(fmt_or_dash(v, spec) for v, spec in numbers), note)


def compact_cell(r: Row) -> str:
    if r.status == "skipped":
        return "skip"
    if r.status == "ERROR":
        return "ERROR"
    return f"{r.median_us:.1f}" + ("!" if r.status == "FAIL" else "")


def compact_table(rows: list[Row], summary: dict, shapes: list[Shape], methods: list[Method],
                  ceiling_gbps: float) -> list[list[str]]:
    """Shapes down, methods across, median µs, and the FP8 floor; then the geometric means, their ratio to the
    best peer, and the geometric means of the host time of one call (same input, fresh inputs)."""
    by_key = {(r.shape, r.method): r for r in rows}
    fp8_floor = {s.name: by_key[(s.name, methods[0].name)].kv_rows * BYTES_PER_ROW["fp8"] / ceiling_gbps / 1e3
                 for s in shapes}
    table = [["shape", *(m.name for m in methods), "FP8 floor"]]
    for s in shapes:
        table.append([s.name, *(compact_cell(by_key[(s.name, m.name)]) for m in methods), f"{fp8_floor[s.name]:.1f}"])
    gm = ["geomean"]
    ratio = ["vs best peer"]
    host = ["host µs"]
    host_fresh = ["host fresh µs"]
    for m in methods:
        sm = summary[m.name]
        partial = "" if sm["shapes_timed"] in (0, sm["shapes_total"]) else f" ({sm['shapes_timed']}/{len(shapes)})"
        gm.append(fmt_or_dash(sm["geomean_us"], ".1f") + ("!" if sm["failed"] else "") + partial)
        ratio.append(fmt_or_dash(sm["geomean_vs_best_peer"], ".2f"))
        host.append(fmt_or_dash(sm["geomean_host_us"], ".1f"))
        host_fresh.append(fmt_or_dash(sm["geomean_host_fresh_us"], ".1f"))
    gm.append(f"{geomean(list(fp8_floor.values())):.1f}")
    return [*table, gm, ratio + [""], host + [""], host_fresh + [""]]


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


def detail_table(rows: list[Row], shape: str | None = None) -> list[list[str]]:
    header = list(DETAIL_HEADER) if shape else ["shape", *DETAIL_HEADER]
    body = [list(detail_cells(r)) if shape else [r.shape, *detail_cells(r)]
            for r in rows if shape is None or r.shape == shape]
    return [header, *body]


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


def write_markdown(path: Path, result: dict, compact: list[list[str]], detail: list[list[str]]) -> None:
    meta, anchors = result["meta"], result["anchors"]
    v = meta["versions"]
    dev = meta["device"]
    sms = f", {dev['sms']} SMs" if dev.get("sms") else ""
    version_text = ", ".join(f"{k} {v[k]}" for k in ("torch", "cuda", "hip", "triton", "flashinfer", "aiter", "python")
                             if v.get(k))
    launch_text = "; ".join(
        f"{e['launch']}: " + (f"skipped ({e['skipped']})" if "skipped" in e else
                              f"{e['median_us']:.1f} µs after a flush, {e['back_to_back_us']:.1f} µs back to back")
        for e in anchors["empty_launch"])
    lines = [
        f"### {meta['date']} · {dev['name']}{sms}{' · dry run' if meta['dry_run'] else ''}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Versions: {version_text}; submission.py sha256 {meta['submission_sha256']}",
        f"- Timing: {meta['timing']}"
        + (f"; L2 flush {meta['flush']['passes']} fills of {meta['flush']['bytes'] / 2**20:.0f} MiB, "
           f"{meta['flush']['ms']:.2f} ms" if meta["flush"] else ""),
        f"- HBM read ceiling: **{anchors['read_ceiling']['gbps']:.0f} GB/s** ({anchors['read_ceiling']['kernel']}, "
        f"{meta['ceiling_gib']:g} GiB)",
        f"- Empty launch: {launch_text}",
        "",
        "Median µs per call (leaderboard timing); `!` = the row's output failed check_implementation; "
        "`FP8 floor` = FP8 KV bytes / ceiling; `host µs` / `host fresh µs`: geometric means of the host time of "
        "one call (CPU time to return) on one input / on a fresh input each call.",
        "",
        *markdown_tables(result["methods"], result["rows"], compact, detail),
    ]
    path.write_text("\n".join(lines))


def markdown_tables(methods: dict, rows: list[dict], compact: list[list[str]], detail: list[list[str]]) -> list[str]:
    """The markdown after a run's header (this bench's and bench/serving.py's): the compact table, the methods
    (those skipped or failed with their reasons) and every row, folded."""
    skipped = sorted({(r["method"], r["reason"]) for r in rows if r["status"] in ("skipped", "ERROR")})
    return [
        render_markdown(compact),
        "",
        *(f"- `{name}` ({m['kind']}): {m['label']}" for name, m in methods.items()),
        *(f"- `{m}` skipped or failed: {reason}" for m, reason in skipped),
        "",
        "<details><summary>Every row</summary>",
        "",
        render_markdown(detail),
        "",
        "</details>",
        "",
    ]


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def leaderboard_shapes() -> list[Shape]:
    spec = yaml.safe_load((ROOT / "task.yml").read_text())
    return [Shape(c["batchsize"], c["kvseqlen"], c["seed"]) for c in spec["benchmarks"]]


def select_shapes(available: list[Shape], names: str | None) -> list[Shape]:
    """--shapes BATCHxKV[,...]; KV may be written 1k or 8k."""
    if not names:
        return available
    by_size = {(s.batch, s.kv): s for s in available}
    chosen = []
    for name in names.split(","):
        batch, _, kv = name.strip().lower().partition("x")
        try:
            size = (int(batch), int(kv[:-1]) * 1024 if kv.endswith("k") else int(kv))
        except ValueError:
            size = None
        if size not in by_size:
            raise SystemExit(f"--shapes: {name!r} is not one of {[s.name for s in available]}")
        chosen.append(by_size[size])
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write every measurement (and each call's time) here")
    p.add_argument("--markdown", type=Path, help="write a BENCHMARKS.md section here")
    p.add_argument("--shapes", help="comma-separated BATCHxKV of task.yml's benchmarks (e.g. 4x1024,256x8192)")
    p.add_argument("--methods", help=f"comma-separated subset of {', '.join(METHOD_BY_NAME)}")
    p.add_argument("--iters", type=int, help="timed calls per row (default 50; 3 with --dry-run)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (checked) call (default 5; 1 dry run)")
    p.add_argument("--fresh-iters", type=int,
                   help="calls for the host time on fresh inputs, each on a newly generated input (default 10; "
                        "2 dry run)")
    p.add_argument("--ceiling-gib", type=float, help="buffer of the read-ceiling kernel (default 4; 1/1024 dry run)")
    p.add_argument("--fi-page-size", type=int, default=64, help="FlashInfer KV page size (64 measured faster than 1)")
    p.add_argument("--fi-backend", default="fa3", help="FlashInfer MLA backend (fa3: the Hopper template)")
    p.add_argument("--dry-run", action="store_true",
                   help="two tiny shapes on any device (CPU: wall-clock timing): exercises the whole code path")
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 3 if args.dry_run else 50
    if args.warmup is None:
        args.warmup = 1 if args.dry_run else 5
    if args.fresh_iters is None:
        args.fresh_iters = 2 if args.dry_run else 10
    if args.ceiling_gib is None:
        args.ceiling_gib = 1 / 1024 if args.dry_run else 4.0
    if args.iters < 1 or args.fresh_iters < 1 or args.warmup < 0:
        p.error("--iters and --fresh-iters must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = get_device()
    if device.type != "cuda" and not args.dry_run:
        raise SystemExit("no GPU here: use --dry-run to exercise the script on the CPU")
    methods = list(METHODS)
    if args.methods:
        names = [n.strip() for n in args.methods.split(",")]
        unknown = [n for n in names if n not in METHOD_BY_NAME]
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; choose from {list(METHOD_BY_NAME)}")
        methods = [METHOD_BY_NAME[n] for n in names]
    shapes = select_shapes([Shape(*s) for s in DRY_RUN_SHAPES] if args.dry_run else leaderboard_shapes(), args.shapes)
    ctx = Context(args, device)
    dev = device_info(device)
    sizes = f", {dev['sms']} SMs, L2 {dev['l2_bytes'] / 2**20:.0f} MiB" if dev["sms"] else ""
    print(f"device: {dev['name']}{sizes}")
    flush = flush_info(device)
    if flush:
        print(f"L2 flush: {flush['passes']} fills of {flush['bytes'] / 2**20:.0f} MiB, {flush['ms']:.2f} ms")

    read_ceiling = measure_read_ceiling(ctx)
    for c in read_ceiling["candidates"]:
        print(f"  read ceiling candidate {c['kernel']}: " + (f"skipped ({c['skipped']})" if "skipped" in c else
                                                            f"{c['gbps']:.0f} GB/s ({c['median_us']:.1f} µs)"))
    print(f"HBM read ceiling: {read_ceiling['gbps']:.0f} GB/s ({read_ceiling['kernel']})")
    empty = measure_empty_launch(ctx)
    for e in empty:
        print(f"  {e['launch']}: " + (f"skipped ({e['skipped']})" if "skipped" in e else
                                      f"{e['median_us']:.1f} µs after a flush, {e['back_to_back_us']:.1f} µs b2b"))

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python3", "bench/leaderboard.py", *(sys.argv[1:] if argv is None else argv)]),
        "dry_run": args.dry_run,
        "device": dev,
        "versions": versions(),
        "submission_sha256": hashlib.sha256((ROOT / "submission.py").read_bytes()).hexdigest()[:12],
        "iters": args.iters,
        "warmup": args.warmup,
        "ceiling_gib": args.ceiling_gib,
        "timing": (f"leaderboard: L2 flush, events around the whole call, median of {args.iters} calls after "
                   f"1 checked + {args.warmup} warm-up calls; back-to-back: mean of {args.iters} calls, no flush"
                   if device.type == "cuda" else
                   f"CPU wall clock, median of {args.iters} calls after 1 checked + {args.warmup} warm-up calls")
                  + f"; host: median CPU time to return, {args.iters} calls on one input, {args.fresh_iters} on "
                    f"fresh inputs",
        "flush": flush,
    }

    def results(done: list[Shape], rows: list[Row]) -> dict:
        add_derived(rows, read_ceiling["gbps"])
        return {
            "meta": meta | {"complete": len(done) == len(shapes)},
            "anchors": {"read_ceiling": read_ceiling, "empty_launch": empty},
            "shapes": [dataclasses.asdict(s) | {"name": s.name} for s in done],
            "methods": summarize(rows, methods, len(done)),
            "rows": [dataclasses.asdict(r) for r in rows],
        }

    rows: list[Row] = []
    done: list[Shape] = []
    for shape in shapes:
        data = reference.generate_input(shape.batch, 1, shape.kv, shape.seed)
        expected = reference.ref_kernel(data)
        for m in methods:
            row = run_row(ctx, m, shape, data, expected)
            rows.append(row)
            print(f"  {shape.name:>9} {m.name:<16} {row.status:<7} "
                  + (f"{row.median_us:9.1f} µs, b2b {row.back_to_back_us:.1f}, host {row.host_us:.1f}, host fresh "
                     f"{fmt_or_dash(row.host_fresh_us, '.1f')}" if row.median_us is not None else row.reason),
                  flush=True)
        del data, expected
        if device.type == "cuda":
            torch.cuda.empty_cache()
        done.append(shape)
        if args.json:  # after every shape, so a run cut short still leaves what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results(done, rows), indent=1))

    result = results(done, rows)
    compact = compact_table(rows, result["methods"], shapes, methods, read_ceiling["gbps"])
    for shape in shapes:
        print(f"\n== {shape.name} (batch {shape.batch}, kv {shape.kv}) ==")
        print(render_text(detail_table(rows, shape.name)))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        write_markdown(args.markdown, result, compact, detail_table(rows))
    problems = sorted({(r.method, r.status, r.reason) for r in rows if r.status in ("skipped", "ERROR")})
    print()
    for method, status, reason in problems:
        print(f"{status}: {method}: {reason}")
    failed = [f"{r.shape} {r.method}: {r.check}" for r in rows if r.status == "FAIL"]
    for f in failed:
        print(f"FAIL: {f}")
    print(f"\nmedian µs, leaderboard timing ({'' if device.type == 'cuda' else 'CPU, '}{args.iters} calls); "
          f"read ceiling {read_ceiling['gbps']:.0f} GB/s; ! = failed check")
    print(render_text(compact))
    return 1 if failed or any(r.status == "ERROR" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
