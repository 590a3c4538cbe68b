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
The check and timing rules, the tables and the outputs are the bench harness's (bench/harness.py); this file is the
leaderboard's grid: its shapes, their inputs, the methods and their peers, and its columns (Row, LAYOUT).
"""

import argparse
import dataclasses
import hashlib
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# The harness's top-level modules (reference, submission, utils) are imported by name, as the harness does, and
# the bench harness and floor_kernels from this package (bench).
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
import yaml  # noqa: E402

import mla_decode  # noqa: E402
import reference  # noqa: E402
import submission  # noqa: E402
from bench import harness  # noqa: E402
from bench.harness import BYTES_PER_ROW, Context, Method, Prepared, Unavailable, measure_read_ceiling, select  # noqa: E402
from mla_decode.triton import triton_plan, triton_target  # noqa: E402
from utils import get_device, scoped_env  # noqa: E402

DRY_RUN_SHAPES = ((2, 64, 11), (3, 37, 12))  # (batch, kv length, seed): tiny, and one length not a tile multiple
PAGE_SIZES = (64, 16, 1)  # the paged rows' page sizes
# (backend, format, precision, the method name's tag) of the library's paged rows
PAGED_KERNELS = (("cuda", "fp8", "fast", ""), ("cuda", "fp8", "precise", "-precise"), ("cuda", "mxfp4", "fast", ""),
                 ("triton", "fp8", "fast", ""))


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    kv: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.kv}"


@dataclasses.dataclass(kw_only=True)
class Row(harness.Result):
    """One method on one leaderboard shape: the harness's columns, the back-to-back and host timings, the floor."""
    batch: int
    kv: int
    back_to_back_us: float | None = None
    host_us: float | None = None
    host_fresh_us: float | None = None
    floor_us: float | None = None

    def derive(self, ceiling_gbps: float, best_peer_us: float | None) -> None:
        self.floor_us = self.kv_bytes / ceiling_gbps / 1e3
        super().derive(ceiling_gbps, best_peer_us)


LAYOUT = harness.Layout(
    detail=(("µs median", "median_us", ".1f"), ("µs mean", "mean_us", ".1f"), ("b2b µs", "back_to_back_us", ".1f"),
            ("host µs", "host_us", ".1f"), ("host fresh µs", "host_fresh_us", ".1f"), ("KV GB/s", "gbps", ".0f"),
            ("% ceil", "pct_ceiling", ".0f"), ("floor µs", "floor_us", ".1f"), ("vs peer", "vs_best_peer", ".2f"),
            ("rel-L2", "rel_l2", ".1e")),
    geomeans=(("geomean_us", "median_us"), ("geomean_mean_us", "mean_us"),
              ("geomean_back_to_back_us", "back_to_back_us"), ("geomean_host_us", "host_us"),
              ("geomean_host_fresh_us", "host_fresh_us"), ("geomean_vs_best_peer", "vs_best_peer"),
              ("geomean_floor_us", "floor_us")),
    compact_rows=(("host µs", "geomean_host_us"), ("host fresh µs", "geomean_host_fresh_us")),
)


# ---------------------------------------------------------------------------------------------------------
# Methods: one function each that turns an input into a timed call and a check
# ---------------------------------------------------------------------------------------------------------


def _check_attention(data: tuple, expected: torch.Tensor, kv_format: str) -> Callable[[object], harness.Verdict]:
    """A check for an attention output: the harness's check_implementation with the bound of `kv_format`, and
    rel-L2 against the BF16 truth computed once per shape."""

    def check(out) -> harness.Verdict:
        ok, msg = reference.check_implementation(data, out, kv_format)
        same_shape = isinstance(out, torch.Tensor) and out.shape == expected.shape
        return harness.Verdict(ok, msg, reference.relative_l2(out, expected) if same_shape else None)

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
        run_kwargs = harness.fi_scales(kv_format, scale)
    total_kv = kv.shape[0]
    page = ctx.args.fi_page_size
    pages = _flashinfer_pages(kv_indptr, total_kv, page)
    note = f"page {page}"
    if pages is None:  # a layout that is not whole pages: page size 1 always fits
        page, note = 1, f"page 1 (the cache is not in whole pages of {page})"
        pages = _flashinfer_pages(kv_indptr, total_kv, page)
    page_indptr, page_indices, kv_lens = pages
    wrapper = ctx.fi_wrapper()
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
        sweep = harness.memwalk_sweep(ctx, kv_format, walked, kv_indptr, pages, max_len, expected_sum, extra=(ours,))
        prepared = harness.fastest_walk(sweep, expected_sum)
        ours_us = next(t for t, s, b, _ in sweep if (s, b) == ours)
        prepared.note += f"; at our kernel's plan (splits {ours[0]}, BLOCK_N {ours[1]}): {ours_us:.1f} µs"
        prepared.extra |= {"our_plan": list(ours), "our_plan_us": ours_us}
        return prepared

    return prepare


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
        rows = scale.view(torch.uint8)[:total, :harness.MXFP4_SCALES]
        paged_scale = torch.empty((num_pages, page, 1, harness.MXFP4_SCALES), dtype=torch.uint8, device=kv.device)
        paged_scale[order.to(kv.device)] = rows.reshape(num_pages, page, 1, harness.MXFP4_SCALES)
        scale = paged_scale.view(scale.dtype)
    needed = (lens + page - 1) // page
    table = torch.zeros((len(lens), max(1, int(needed.max()))), dtype=torch.int32)
    for b in range(len(lens)):
        first = int(starts[b]) // page
        table[b, :needed[b]] = order[first:first + int(needed[b])].to(torch.int32)
    batch = q.shape[0]
    return Paged(q.view(batch, 1, *q.shape[1:]), cache, scale, table.to(kv.device), lens.to(torch.int32).to(kv.device))


def _fixed_splits(backend: str) -> dict | None:
    """The backend options of the leaderboard's uniform batches, as its adapter chooses them (mla_decode.leaderboard):
    the fixed splits, for the backends that cut a schedule."""
    return {"schedule": "fixed"} if backend in ("cuda", "triton") else None


def _ours_paged(backend: str, kv_format: str, page: int, precision: str = "fast"):
    """The library's paged call on the input's cache re-laid in shuffled pages (_paged), through a plan made once
    outside the timing (mla_decode.plan; max_seqlen the shape's length): the timed call is the plan's run, which
    allocates its output and LSE."""

    def prepare(ctx: Context, shape: Shape, data: tuple, expected: torch.Tensor) -> Prepared:
        paged = _paged(data, kv_format, page)
        try:
            decode = mla_decode.plan(shape.batch, page, paged.block_table.shape[1], paged.kv_cache.dtype, ctx.device,
                                     backend=backend, precision=precision, max_seqlen=shape.kv,
                                     kv_scale_dtype=torch.uint8 if paged.kv_scale is None else paged.kv_scale.dtype,
                                     backend_options=_fixed_splits(backend))
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
                                            kv_scale_dtype=scale.dtype, backend_options=_fixed_splits(backend))
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
    lens = p.cache_seqlens.cpu()
    page_indptr, indices = harness.fi_csr_pages(p.block_table, lens, page, ctx.device)
    wrapper = ctx.fi_wrapper()
    metadata = fi.mla.MLAPlanMetadata.csr(data[2].cpu(), page_indptr, indices, lens)
    wrapper.plan(metadata=metadata, num_heads=reference.NUM_HEADS, head_dim_ckv=reference.KV_LORA_RANK,
                 head_dim_kpe=reference.QK_ROPE_HEAD_DIM, page_size=page, causal=False,
                 sm_scale=config["sm_scale"], q_data_type=p.q.dtype, kv_data_type=p.kv_cache.dtype)
    q, kv_pages = p.q.view(p.q.shape[0], *p.q.shape[2:]), p.kv_cache.view(p.kv_cache.shape[0], page, -1)
    return lambda: wrapper.run(query=q, kv_cache=kv_pages, **harness.fi_scales(kv_format, p.kv_scale))


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


# ---------------------------------------------------------------------------------------------------------
# Anchors beside the harness's read ceiling: the cost of an empty launch, measured in this run
# ---------------------------------------------------------------------------------------------------------


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
# One row: the harness's check and timing, then back to back and the host's part of a call
# ---------------------------------------------------------------------------------------------------------


def fresh_calls(shape: Shape, bind: Callable[[tuple], Callable[[], object]]) -> Callable[[], Callable[[], object]]:
    """Makes, on each use, the call on a new input of the shape (the next seed, +13 each time, as leaderboard mode
    does), so that no call finds its input already seen."""
    seeds = itertools.count(shape.seed + 13, 13)
    return lambda: bind(reference.generate_input(shape.batch, 1, shape.kv, next(seeds)))


def _invoke(call: Callable[[], object]) -> object:
    return call()


def run_row(ctx: Context, method: Method, shape: Shape, data: tuple, expected: torch.Tensor) -> Row:
    kv_indptr = data[3]
    kv_rows = int(kv_indptr[-1] - kv_indptr[0])
    row = Row(shape=shape.name, batch=shape.batch, kv=shape.kv, method=method.name, kind=method.kind,
              kv_format=method.kv_format, kv_rows=kv_rows, kv_bytes=kv_rows * BYTES_PER_ROW[method.kv_format])

    def host_timings(prepared: Prepared) -> None:
        row.back_to_back_us = ctx.timer.back_to_back(prepared.fn, ctx.args.iters)
        row.host_us = ctx.timer.host(prepared.fn, ctx.args.iters)
        if prepared.fresh is not None:
            row.host_fresh_us = ctx.timer.host(_invoke, ctx.args.fresh_iters, setup=fresh_calls(shape, prepared.fresh))

    return harness.measure(ctx, row, lambda: method.prepare(ctx, shape, data, expected), host_timings)


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
    p.add_argument("--methods", help=f"comma-separated subset of {', '.join(m.name for m in METHODS)}")
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
    harness.fill_defaults(args, {"fresh_iters": (10, 2)})
    if args.iters < 1 or args.fresh_iters < 1 or args.warmup < 0:
        p.error("--iters and --fresh-iters must be >= 1, --warmup >= 0")
    return args


def markdown_head(result: dict) -> list[str]:
    """The run's BENCHMARKS.md heading, its setting (with submission.py's hash and the empty launch) and legend."""
    meta = result["meta"]
    launch_text = "; ".join(
        f"{e['launch']}: " + (f"skipped ({e['skipped']})" if "skipped" in e else
                              f"{e['median_us']:.1f} µs after a flush, {e['back_to_back_us']:.1f} µs back to back")
        for e in result["anchors"]["empty_launch"])
    return [
        f"### {harness.markdown_title(meta)}",
        "",
        *harness.markdown_meta(result, ("torch", "cuda", "hip", "triton", "flashinfer", "aiter", "python"),
                               f"; submission.py sha256 {meta['submission_sha256']}"),
        f"- Empty launch: {launch_text}",
        "",
        "Median µs per call (leaderboard timing); `!` = the row's output failed check_implementation; "
        "`FP8 floor` = FP8 KV bytes / ceiling; `host µs` / `host fresh µs`: geometric means of the host time of "
        "one call (CPU time to return) on one input / on a fresh input each call.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = get_device()
    methods = select(list(METHODS), args.methods, "methods")
    shapes = select_shapes([Shape(*s) for s in DRY_RUN_SHAPES] if args.dry_run else leaderboard_shapes(), args.shapes)
    ctx = Context(args, device)
    meta = harness.start(ctx, "bench/leaderboard.py", argv)
    read_ceiling = measure_read_ceiling(ctx)
    for c in read_ceiling["candidates"]:
        print(f"  read ceiling candidate {c['kernel']}: " + (f"skipped ({c['skipped']})" if "skipped" in c else
                                                            f"{c['gbps']:.0f} GB/s ({c['median_us']:.1f} µs)"))
    print(f"HBM read ceiling: {read_ceiling['gbps']:.0f} GB/s ({read_ceiling['kernel']})")
    empty = measure_empty_launch(ctx)
    for e in empty:
        print(f"  {e['launch']}: " + (f"skipped ({e['skipped']})" if "skipped" in e else
                                      f"{e['median_us']:.1f} µs after a flush, {e['back_to_back_us']:.1f} µs b2b"))
    meta |= {
        "submission_sha256": hashlib.sha256((ROOT / "submission.py").read_bytes()).hexdigest()[:12],
        "timing": (f"leaderboard: L2 flush, events around the whole call, median of {args.iters} calls after "
                   f"1 checked + {args.warmup} warm-up calls; back-to-back: mean of {args.iters} calls, no flush"
                   if device.type == "cuda" else
                   f"CPU wall clock, median of {args.iters} calls after 1 checked + {args.warmup} warm-up calls")
                  + f"; host: median CPU time to return, {args.iters} calls on one input, {args.fresh_iters} on "
                    f"fresh inputs",
    }
    anchors = {"read_ceiling": read_ceiling, "empty_launch": empty}
    run = harness.Run(ctx, LAYOUT, methods, len(shapes), meta, anchors, "rows")
    for shape in shapes:
        data = reference.generate_input(shape.batch, 1, shape.kv, shape.seed)
        expected = reference.ref_kernel(data)
        kv_rows = int(data[3][-1] - data[3][0])
        for m in methods:
            row = run_row(ctx, m, shape, data, expected)
            run.add(row)
            print(f"  {shape.name:>9} {m.name:<16} {row.status:<7} "
                  + (f"{row.median_us:9.1f} µs, b2b {row.back_to_back_us:.1f}, host {row.host_us:.1f}, host fresh "
                     f"{harness.fmt_or_dash(row.host_fresh_us, '.1f')}" if row.median_us is not None else row.reason),
                  flush=True)
        del data, expected
        heading = f"\n== {shape.name} (batch {shape.batch}, kv {shape.kv}) =="
        record = dataclasses.asdict(shape) | {"name": shape.name}
        run.shape_done(harness.ShapeDone(shape.name, kv_rows, heading, record))
    return run.finish(markdown_head, f"\nmedian µs, leaderboard timing ({'' if device.type == 'cuda' else 'CPU, '}"
                                     f"{args.iters} calls); read ceiling {read_ceiling['gbps']:.0f} GB/s; "
                                     "! = failed check")


if __name__ == "__main__":
    sys.exit(main())
