"""MLA decode over serving shapes: our library's paged plan beside FlashMLA and FlashInfer, in one process, one GPU.

    python3 bench/serving.py [--spec serving.yml] [--rows 1x1k-h16-q1,...] [--methods ...] [--iters 50]
                             [--json PATH] [--markdown PATH] [--dry-run]
    bash bench/run_serving_h200.sh     # on the H200 through the device tool, carry [".peers"]

Per row of serving.yml (batch, kv, heads, q_len, page, seed), one paged cache: random BF16 rows in pages of `page`
rows handed out in a shuffled order, its FP8 twin (e4m3fn, one per-tensor scale) and its MXFP4 twin (E2M1 codes, an
E8M0 scale per 32 values), made where a method reads them; the queries (batch, q_len, heads, 576) bf16; sequence b
holds kv - (7 * b) % page rows. Every method reads those same pages through the same block table (FlashInfer through
its CSR form of it). q_len > 1 is causal: query token t of sequence b sees the first len_b - q_len + 1 + t slots.

Methods (columns of the compact table; one that cannot run here is skipped, with the reason):
  ours    mla_decode.plan(..., backend="cuda" | "triton") made once outside the timing; the timed call is its run()
          into preallocated out and lse. FP8 (fast and precise) and MXFP4 caches.
  peers   FlashMLA (vLLM's fork; the prebuilt modules in .peers/flashmla): BF16 and dense FP8, pages of 64, its
          metadata made once per row outside the timing; its FP8 kernel reads Q in e4m3 with one per-tensor scale,
          quantized outside the timing. FlashInfer's BatchMLAPagedAttentionWrapper (fa3): BF16 and FP8 caches,
          plan() once per row outside the timing.
  floor   the memory-only walk of the FP8 pages through the block table (floor_kernels.MemWalk): the fastest of a
          sweep over split counts and tile heights.
Timing as leaderboard.py's (the bench harness's, utils.Timer.leaderboard): per call synchronize, flush the L2, CUDA
event, the call, event, synchronize; the median of --iters calls after one checked call and --warmup more.
Columns: median µs; KV GB/s (bytes of the format read over the median) and % of the HBM read ceiling measured at the
start of the run; TFLOPS (2 * q_len * heads * the sum of the lengths * (576 + 512) FLOPs, the score and value
products with no causal saving, over the median); the ratio to the fastest peer that passed; the worst query token's
relative L2 error of the output and the largest LSE error against a float64 attention over the exactly dequantized
cache the method read, with the same causal rule (bounds per cache format: SERVING_BOUNDS).
--dry-run: two tiny rows on the CPU (wall clock, no flush); Triton rows run there only under TRITON_INTERPRET=1.
The exit status is 1 when a row is FAIL or ERROR (the outputs are written first).
The check and timing rules, the tables and the outputs are the bench harness's (bench/harness.py); this file is the
serving grid: its rows, their paged caches and float64 truth, the methods and their peers, and its columns
(ServingResult, LAYOUT).
"""

import argparse
import dataclasses
import importlib
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]  # the bench package (its harness) and the harness's modules by name

import torch  # noqa: E402
import yaml  # noqa: E402

import mla_decode  # noqa: E402
import reference  # noqa: E402
from bench import harness  # noqa: E402
from bench.harness import BYTES_PER_ROW, Context, Method, Prepared, Unavailable, measure_read_ceiling, select  # noqa: E402
from mla_decode.triton import triton_plan, triton_target  # noqa: E402
from utils import get_device  # noqa: E402

SPEC = ROOT / "serving.yml"
FLASHMLA_DIR = ROOT / ".peers" / "flashmla"  # the prebuilt modules of ../shared/peers/flashmla/prebuilt
FLASHMLA_SOURCE = "vLLM's FlashMLA fork at 46d64a8, prebuilt"  # the commit vLLM pins (flashmla/README.md there)
FLASHMLA_MODULES = {"bf16": "_flashmla_C", "fp8": "_flashmla_extension_C"}  # by the cache format each decodes
FLASHMLA_PAGE = 64  # the only page size its kernels take
QK_DIM, V_DIM, ROPE_DIM = reference.QK_HEAD_DIM, reference.V_HEAD_DIM, reference.QK_ROPE_HEAD_DIM  # 576, 512, 64
NUM_KV_HEADS = reference.NUM_KV_HEADS  # MLA's one latent head
SOFTMAX_SCALE = reference.SM_SCALE  # 1 / sqrt(576), every method's
FP8 = torch.float8_e4m3fn
LENGTH_STEP = 7  # sequence b holds kv - (LENGTH_STEP * b) % page rows: lengths off the page size, the longest kv
# How a row's lengths spread: "near" kv (the LENGTH_STEP rule), "uniform" (every one kv), "normal" (mean kv, sd
# kv / 2, as FlashMLA's own test draws a varlen batch), "lognormal" (median kv, sigma LOGNORMAL_SIGMA: 2% of sequences
# past 16 x kv), "one-long" (one sequence of kv beside ONE_LONG_OTHERS rows each), "range" (1 to kv, evenly in log).
SPREADS = ("near", "uniform", "normal", "lognormal", "one-long", "range")
LOGNORMAL_SIGMA = 1.4
ONE_LONG_OTHERS = 1024
# Two tiny rows (the second with partly filled pages, more heads and MTP); kept small for Triton's interpreter, whose
# time grows with q_len x heads.
DRY_RUN_SHAPES = ({"batch": 2, "kv": 100, "heads": 16, "q_len": 1, "page": 64, "seed": 11},
                  {"batch": 3, "kv": 70, "heads": 32, "q_len": 2, "page": 64, "seed": 12})
STATUS_WIDTH = 7  # "skipped", the longest status, in the progress lines


class Bound(NamedTuple):
    out: float  # the worst query token's relative L2 error of the output (all its heads)
    lse: float  # the largest absolute LSE error


# Against float64 attention over the cache the method read (its KV quantization excluded) with the exact bf16 Q.
# Measured in a float64 emulation on randn data (lengths 1k-32k, 16 and 128 heads, q_len 1 and 2): Q rounded to e4m3
# (per head or per tensor, as our fast kernels and FlashMLA's FP8 kernel read it) costs up to 2.7e-2 on the output and
# 8e-3 on the LSE, e4m3 softmax weights (the wgmma kernel) 0.7e-2 more on the output; the FP8 MMAs' sums move the LSE
# by up to 1.1e-2 on the H200 (tests/test_library_gpu.py's GPU_BOUNDS); bf16 products and output cost ~2e-3 on the
# output and < 1e-5 on the LSE. A sequence of a few positions (uneven.yml's normal rows clamp lengths at q_len) has
# the LSE of its top score, whose e4m3 Q error does not average out: up to 9.4e-2 for ours and 1.0e-1 for FlashMLA's
# FP8 kernel on an H100 (docs/2026-12-06-persistent-h100.md). The bounds sit 2x or more above those and far below the
# 1.0 of a zero or unwritten output.
SERVING_BOUNDS = {"bf16": Bound(1e-2, 1e-3), "fp8": Bound(8e-2, 2e-1), "mxfp4": Bound(8e-2, 2e-1)}


@dataclasses.dataclass(frozen=True)
class ServingShape:
    """One row of serving.yml. Its sequences' lengths come from lengths() alone (Case, the byte and FLOP counts and
    the reference read them there), so a row may carry a length distribution of its own as one more field."""

    batch: int
    kv: int  # the longest sequence's length ("near"); the mean ("normal"); the median ("lognormal"); see SPREADS
    heads: int  # query heads sharing the latent KV head
    q_len: int  # query tokens per sequence (2: MTP)
    page: int  # rows per page
    seed: int
    spread: str = "near"  # how the lengths spread about kv: SPREADS

    @property
    def name(self) -> str:
        kv = f"{self.kv // 1024}k" if self.kv % 1024 == 0 else str(self.kv)
        tag = "" if self.spread == "near" else f"-{self.spread}"
        return f"{self.batch}x{kv}-h{self.heads}-q{self.q_len}{tag}"

    @property
    def causal(self) -> bool:
        return self.q_len > 1

    def lengths(self) -> list[int]:
        """Each sequence's rows, by the row's spread (SPREADS), at least q_len (a causal token sees a row)."""
        rng = random.Random(self.seed)
        if self.spread == "near":
            lens = [self.kv - (LENGTH_STEP * b) % self.page for b in range(self.batch)]
        elif self.spread == "uniform":
            lens = [self.kv] * self.batch
        elif self.spread == "normal":
            lens = [round(rng.gauss(self.kv, self.kv / 2)) for _ in range(self.batch)]
        elif self.spread == "lognormal":
            lens = [round(self.kv * math.exp(rng.gauss(0.0, LOGNORMAL_SIGMA))) for _ in range(self.batch)]
        elif self.spread == "one-long":
            lens = [self.kv] + [ONE_LONG_OTHERS] * (self.batch - 1)
        else:  # "range": 1 to kv, evenly in log
            lens = [round(self.kv ** (b / max(1, self.batch - 1))) for b in range(self.batch)]
        return [max(self.q_len, n) for n in lens]


# ---------------------------------------------------------------------------------------------------------
# One row's inputs and their float64 truth
# ---------------------------------------------------------------------------------------------------------


class Case:
    """A row's inputs on the device: the queries, the lengths and block table, and the cache in each format (made at
    first use), pages handed out in a shuffled order. The slots past a sequence's length in its last page hold random
    finite rows, as a serving cache's do: never NaN, which would fail a peer that loads whole pages and masks only the
    scores (0 x NaN) for what no server feeds it; the library's own tests poison those slots."""

    def __init__(self, shape: ServingShape, device: torch.device):
        self.shape, self.device = shape, device
        self.lens = shape.lengths()
        needed = [-(-n // shape.page) for n in self.lens]
        self.num_pages = sum(needed)
        order = torch.randperm(self.num_pages, generator=torch.Generator().manual_seed(shape.seed))
        table = torch.zeros((shape.batch, max(needed)), dtype=torch.int32)  # past a sequence's pages: page 0, unread
        taken = 0
        for b, k in enumerate(needed):
            table[b, :k] = order[taken:taken + k]
            taken += k
        self.block_table = table.to(device)  # (batch, max_pages) int32: sequence b's i-th page
        self.cache_seqlens = torch.tensor(self.lens, dtype=torch.int32, device=device)  # (batch,) int32
        self._generator = torch.Generator(device=device).manual_seed(shape.seed)
        self.q = torch.randn((shape.batch, shape.q_len, shape.heads, QK_DIM), generator=self._generator,
                             device=device, dtype=torch.bfloat16)  # (batch, q_len, heads, 576)
        self._caches: dict[str, tuple] = {}
        self._references: dict[str, tuple] = {}

    @property
    def kv_rows(self) -> int:
        return sum(self.lens)

    def cache(self, kv_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv_cache, kv_scale) in the library's paged layout: bf16 (num_pages, page, 1, 576) and None; fp8
        (num_pages, page, 1, 576) e4m3fn and its (1,) float32 scale; mxfp4 (num_pages, page, 1, 288) E2M1 codes and
        (num_pages, page, 1, 18) E8M0 scales. The FP8 and MXFP4 caches quantize the BF16 one."""
        if kv_format not in self._caches:
            pages = (self.num_pages, self.shape.page, NUM_KV_HEADS)
            if kv_format == "bf16":
                rows = torch.randn((self.num_pages * self.shape.page, QK_DIM), generator=self._generator,
                                   device=self.device, dtype=torch.bfloat16)
                self._caches["bf16"] = (rows.view(*pages, QK_DIM), None)
            else:
                rows = self.cache("bf16")[0].view(-1, QK_DIM)
                if kv_format == "fp8":
                    kv, scale = reference.quantize_fp8(rows, FP8)
                    self._caches["fp8"] = (kv.view(*pages, QK_DIM), scale)
                else:
                    codes, scales = reference.quantize_mxfp4(rows, ties="even", padded=False)
                    self._caches["mxfp4"] = (codes.view(*pages, QK_DIM // 2), scales.view(*pages, harness.MXFP4_SCALES))
        return self._caches[kv_format]

    def owned_rows(self, b: int) -> torch.Tensor:
        """The cache rows sequence b owns, in order, (len_b,) int64."""
        n, page = self.lens[b], self.shape.page
        pages = self.block_table[b, :-(-n // page)].long()
        return (pages[:, None] * page + torch.arange(page, device=self.device)).flatten()[:n]

    def dequantized(self, kv_format: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the `kv_format` cache, exactly dequantized: (n, 576) float64."""
        kv, scale = self.cache(kv_format)
        if kv_format == "bf16":
            return kv.view(-1, QK_DIM)[rows].double()
        flat = kv.view(torch.uint8).view(-1, kv.shape[-1])  # (num_rows, bytes per row): torch indexes no fp4 dtype
        if kv_format == "fp8":
            return flat[rows].view(FP8).double() * scale.double()
        return reference.dequantize_mxfp4(flat[rows], scale.view(torch.uint8).view(-1, harness.MXFP4_SCALES)[rows],
                                          torch.float64)

    def reference(self, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 attention of the bf16 queries over the exactly dequantized rows each sequence owns in the
        `kv_format` cache, causal for q_len > 1: (out (batch, q_len, heads, 512), lse (batch, heads, q_len), natural
        log). Computed once per format, on the device."""
        if kv_format not in self._references:
            batch, q_len, heads = self.shape.batch, self.shape.q_len, self.shape.heads
            out = torch.empty((batch, q_len, heads, V_DIM), dtype=torch.float64, device=self.device)
            lse = torch.empty((batch, heads, q_len), dtype=torch.float64, device=self.device)
            token = torch.arange(q_len, device=self.device).repeat_interleave(heads)  # of each (token, head) row
            for b, n in enumerate(self.lens):
                keys = self.dequantized(kv_format, self.owned_rows(b))  # (n, 576)
                scores = self.q[b].reshape(q_len * heads, QK_DIM).double() @ keys.T * SOFTMAX_SCALE
                if self.shape.causal:  # token t sees the first n - q_len + 1 + t slots
                    hidden = torch.arange(n, device=self.device)[None, :] >= (n - q_len + 1 + token)[:, None]
                    scores.masked_fill_(hidden, -math.inf)
                lse_b = torch.logsumexp(scores, dim=-1)  # (q_len * heads,)
                out[b] = (torch.exp(scores - lse_b[:, None]) @ keys[:, :V_DIM]).view(q_len, heads, V_DIM)
                lse[b] = lse_b.view(q_len, heads).T
            self._references[kv_format] = (out, lse)
        return self._references[kv_format]

    def fp8_word_sum(self) -> int:
        """The sum of every int32 word of the FP8 rows the sequences own (a memory walk that reads exactly those rows
        finds it modulo floor_kernels.WRAP)."""
        kv, _ = self.cache("fp8")
        words = kv.view(torch.uint8).view(-1, QK_DIM).view(torch.int32)  # (num_rows, 144)
        return sum(words[self.owned_rows(b)].sum(dtype=torch.int64).item() for b in range(self.shape.batch))


def attention_check(case: Case, kv_format: str, canonical: Callable[[object], tuple[torch.Tensor, torch.Tensor]]
                    ) -> Callable[[object], harness.Verdict]:
    """A method's check: `canonical` turns its result into (out (batch, q_len, heads, 512), lse (batch, heads,
    q_len)); both are held to case.reference(kv_format) within SERVING_BOUNDS[kv_format] (NaN fails)."""
    bound = SERVING_BOUNDS[kv_format]

    def check(result) -> harness.Verdict:
        out, lse = canonical(result)
        ref_out, ref_lse = case.reference(kv_format)
        if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
            return harness.Verdict(False, f"shapes: out {tuple(out.shape)}, lse {tuple(lse.shape)}; expected "
                                          f"{tuple(ref_out.shape)}, {tuple(ref_lse.shape)}")
        rel = reference.worst_row_relative_l2(out.flatten(0, 1), ref_out.flatten(0, 1))  # per (sequence, token)
        lse_err = (lse.double() - ref_lse).abs().max().item()
        message = (f"worst token rel-L2 {rel:.2e} (bound {bound.out:g}), LSE max abs err {lse_err:.2e} (bound "
                   f"{bound.lse:g}), against float64 over the {kv_format} cache")
        return harness.Verdict(rel <= bound.out and lse_err <= bound.lse, message, rel, lse_err)

    return check


# ---------------------------------------------------------------------------------------------------------
# Methods: each turns a case into a timed call and its check
# ---------------------------------------------------------------------------------------------------------


class ServingContext(Context):
    """The harness's context (device, timer, Triton, FlashInfer and its workspace) and FlashMLA's modules."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        super().__init__(args, device)
        self._flashmla_reasons: dict[str, str | None] = {}

    def flashmla(self, kv_format: str):
        """torch.ops namespace of the FlashMLA module that decodes a `kv_format` cache, or Unavailable with the
        reason (checked once per module)."""
        module = FLASHMLA_MODULES[kv_format]
        if module not in self._flashmla_reasons:
            self._flashmla_reasons[module] = self._import_flashmla(module)
        if self._flashmla_reasons[module]:
            raise Unavailable(self._flashmla_reasons[module])
        return getattr(torch.ops, module)

    def _import_flashmla(self, module: str) -> str | None:
        if self.device.type != "cuda" or torch.version.hip is not None:
            return "FlashMLA needs an NVIDIA GPU"
        capability = torch.cuda.get_device_capability(self.device)
        if capability != (9, 0):
            return f"FlashMLA's dense decode needs sm_90; this GPU is sm_{capability[0]}{capability[1]}"
        if not FLASHMLA_DIR.is_dir():
            return (f"no {FLASHMLA_DIR.relative_to(ROOT)}/: copy the prebuilt modules of "
                    "../shared/peers/flashmla/prebuilt there (bench/README.md)")
        if str(FLASHMLA_DIR) not in sys.path:
            sys.path.append(str(FLASHMLA_DIR))
        try:
            importlib.import_module(module)  # registers torch.ops.<module>
        except Exception as e:  # an ABI or CUDA mismatch fails in many ways: report it, skip the rows
            return f"import {module} failed: {type(e).__name__}: {e}"
        return None


def as_returned(result: tuple) -> tuple:
    """A result that already is (out (batch, q_len, heads, 512), lse (batch, heads, q_len)), as ours and FlashMLA's
    are."""
    return result[0], result[1]


def _ours(backend: str, kv_format: str, precision: str = "fast", block_h: int | None = None,
          hopper_rows: int | None = None, unit_rows: int | None = None, schedule: str | None = None,
          **schedule_options):
    """The library's plan (made here, outside the timing) and its run into preallocated out and lse. Whatever the
    plans' rules would choose: block_h (triton), triton_plan's plan for the portable kernel's programs of that many
    query rows (TritonPlan.block_h); hopper_rows (triton), its plan for the Hopper kernel's BF16 programs of that many
    (the last group masked); unit_rows (cuda), the backend option, query rows a CTA; schedule (cuda, triton), the
    backend option, "fixed" splits (cuda: what the methods not named balanced take) or "balanced" (its step schedule
    made outside the timing); schedule_options, the balanced schedule's other backend options (cut, min_share)."""

    def prepare(ctx: ServingContext, case: Case) -> Prepared:
        shape = case.shape
        kv, scale = case.cache(kv_format)
        options, rows = None, shape.q_len * shape.heads
        if block_h is not None and rows % block_h:
            raise Unavailable(f"{rows} query rows a sequence do not make groups of {block_h}")
        if unit_rows is not None:  # a unit the kernel does not take: the plan's ValueError, below
            options = {"unit_rows": unit_rows}
        # the methods not named balanced time the cuda backend's fixed splits, whatever the plan's default
        chosen = schedule if schedule is not None or backend != "cuda" else "fixed"
        if chosen is not None:
            options = {**(options or {}), "schedule": chosen, **schedule_options}
        try:
            if block_h is not None or hopper_rows is not None:
                plan = triton_plan(shape.batch, max(case.lens), triton_target(ctx.device), kv_format, rows,
                                   shape.heads, block_h=block_h or hopper_rows)
                if hopper_rows is not None and not plan.hopper:
                    raise Unavailable("the triton plan takes the portable kernel on this GPU or Triton")
                options = {**(options or {}), "plan": plan if hopper_rows else plan._replace(hopper=False)}
            decode = mla_decode.plan(shape.batch, shape.page, case.block_table.shape[1], kv.dtype, ctx.device,
                                     num_heads=shape.heads, q_len=shape.q_len, causal=shape.causal, backend=backend,
                                     precision=precision, max_seqlen=max(case.lens),
                                     kv_scale_dtype=torch.uint8 if scale is None else scale.dtype,
                                     backend_options=options)
        except RuntimeError as e:  # the backend cannot serve this shape or format here (BackendUnavailable)
            raise Unavailable(str(e)) from e
        except ValueError as e:  # the kernel does not take units of unit_rows for this shape
            if unit_rows is None:
                raise
            raise Unavailable(str(e)) from e
        out = torch.empty((shape.batch, shape.q_len, shape.heads, V_DIM), dtype=torch.bfloat16, device=ctx.device)
        lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=ctx.device)
        # the step's schedule, made once outside the timing as FlashMLA's metadata is: engines make it once a step
        step = decode.schedule(case.cache_seqlens) if schedule == "balanced" else None
        return Prepared(fn=lambda: decode.run(case.q, kv, case.block_table, case.cache_seqlens, scale, out=out,
                                              lse=lse, schedule=step),
                        check=attention_check(case, kv_format, as_returned),
                        note="plan" + (" and the step's schedule" if step is not None else "")
                             + " outside the timing, out and lse preallocated")

    return prepare


def _flashmla(kv_format: str):
    """FlashMLA's dense decode as vLLM calls it (../shared/peers/flashmla/bench_flashmla.py): the split schedule from
    the lengths made once per row outside the timing (vLLM makes it once per step); the (token, head) pairs of a
    sequence packed as the rows of its one latent head. BF16: fwd_kvcache_mla on the bf16 q. FP8: fwd_kvcache_mla_fp8
    reads Q in e4m3 with one per-tensor scale (descale_q), quantized here, outside the timing."""

    def prepare(ctx: ServingContext, case: Case) -> Prepared:
        ops = ctx.flashmla(kv_format)
        shape = case.shape
        if shape.page != FLASHMLA_PAGE:
            raise Unavailable(f"FlashMLA reads pages of {FLASHMLA_PAGE} rows only, not {shape.page}")
        kv, scale = case.cache(kv_format)
        rows_per_kv_head = shape.q_len * shape.heads // NUM_KV_HEADS
        seqlens, table = case.cache_seqlens, case.block_table
        if kv_format == "bf16":
            meta, splits = ops.get_mla_decoding_metadata(seqlens, rows_per_kv_head, NUM_KV_HEADS, shape.heads, False,
                                                         None)
            return Prepared(fn=lambda: ops.fwd_kvcache_mla(case.q, kv, V_DIM, seqlens, table, SOFTMAX_SCALE,
                                                           shape.causal, meta, splits, False, None),
                            check=attention_check(case, kv_format, as_returned), note="metadata outside the timing")
        meta, splits = ops.get_mla_decoding_metadata_dense_fp8(seqlens, rows_per_kv_head, NUM_KV_HEADS)
        q8, descale_q = reference.quantize_fp8(case.q, FP8)  # (batch, q_len, heads, 576) e4m3, (1,) float32
        return Prepared(fn=lambda: ops.fwd_kvcache_mla_fp8(q8, kv, V_DIM, seqlens, table, SOFTMAX_SCALE, shape.causal,
                                                           meta, splits, descale_q, scale),
                        check=attention_check(case, kv_format, as_returned),
                        note="metadata and Q's e4m3 quantization (per tensor) outside the timing")

    return prepare


def _flashinfer(kv_format: str):
    """FlashInfer's MLA decode (BatchMLAPagedAttentionWrapper, --fi-backend): plan() once per row outside the timing
    over the CSR form of the block table; the queries packed (batch * q_len, heads, 576), q_len rows per sequence;
    FP8 with the per-tensor scale as ckv_scale = kpe_scale; the natural-log LSE into preallocated buffers. A shape
    its plan refuses (a ValueError, as its _BackendPlanUnsupportedError is) is skipped with the reason."""

    def prepare(ctx: ServingContext, case: Case) -> Prepared:
        fi = ctx.flashinfer()
        shape = case.shape
        kv, scale = case.cache(kv_format)
        lens = torch.tensor(case.lens, dtype=torch.int32)  # the plan reads its metadata on the host
        page_indptr, indices = harness.fi_csr_pages(case.block_table, lens, shape.page, ctx.device)
        qo_indptr = torch.arange(shape.batch + 1, dtype=torch.int32) * shape.q_len
        wrapper = ctx.fi_wrapper()
        try:
            wrapper.plan(metadata=fi.mla.MLAPlanMetadata.csr(qo_indptr, page_indptr, indices, lens),
                         num_heads=shape.heads, head_dim_ckv=V_DIM, head_dim_kpe=ROPE_DIM, page_size=shape.page,
                         causal=shape.causal, sm_scale=SOFTMAX_SCALE, q_data_type=torch.bfloat16,
                         kv_data_type=kv.dtype, lse_mode="basee")
        except ValueError as e:
            raise Unavailable(f"FlashInfer's plan refuses this shape: {harness.first_line(e)}") from e
        tokens = shape.batch * shape.q_len
        q = case.q.view(tokens, shape.heads, QK_DIM)
        kv_pages = kv.view(case.num_pages, shape.page, QK_DIM)
        out = torch.empty((tokens, shape.heads, V_DIM), dtype=torch.bfloat16, device=ctx.device)
        lse = torch.empty((tokens, shape.heads), dtype=torch.float32, device=ctx.device)
        scales = harness.fi_scales(kv_format, scale)

        def canonical(result: tuple) -> tuple:
            o, lse_rows = result  # (batch * q_len, heads, 512), (batch * q_len, heads)
            return (o.view(shape.batch, shape.q_len, shape.heads, V_DIM),
                    lse_rows.view(shape.batch, shape.q_len, shape.heads).transpose(1, 2))

        return Prepared(fn=lambda: wrapper.run(query=q, kv_cache=kv_pages, out=out, lse=lse, return_lse=True,
                                               return_lse_base_on_e=True, **scales),
                        check=attention_check(case, kv_format, canonical),
                        note=f"plan outside the timing, {ctx.args.fi_backend}")

    return prepare


def _memwalk(ctx: ServingContext, case: Case) -> Prepared:
    """The memory-only walk of the FP8 pages through the block table: the fastest verified configuration of the
    harness's memwalk_sweep (split count x tile height)."""
    fk = ctx.floor_kernels()
    kv, scale = case.cache("fp8")
    expected_sum = case.fp8_word_sum() % fk.WRAP
    pages = (case.block_table, case.cache_seqlens, case.shape.page)
    sweep = harness.memwalk_sweep(ctx, "fp8", {"fp8": (kv, scale)}, None, pages, max(case.lens), expected_sum)
    return harness.fastest_walk(sweep, expected_sum)


METHODS = (
    Method("cuda-fp8", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache (wgmma), fixed splits",
           _ours("cuda", "fp8")),
    Method("cuda-fp8-precise", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, precise (mma.sync)",
           _ours("cuda", "fp8", "precise")),
    Method("cuda-mxfp4", "ours", "mxfp4", "mla_decode plan, backend cuda, MXFP4 cache", _ours("cuda", "mxfp4")),
    Method("triton-fp8", "ours", "fp8", "mla_decode plan, backend triton, FP8 cache", _ours("triton", "fp8")),
    Method("triton-fp8-precise", "ours", "fp8", "mla_decode plan, backend triton, FP8 cache, precise",
           _ours("triton", "fp8", "precise")),
    Method("triton-mxfp4", "ours", "mxfp4", "mla_decode plan, backend triton, MXFP4 cache", _ours("triton", "mxfp4")),
    Method("triton-fp8-rows16", "ours", "fp8", "mla_decode plan, backend triton, FP8 cache, the portable kernel with "
           "16 query rows a program (block_h), 4 warps", _ours("triton", "fp8", block_h=16)),
    Method("triton-fp8-rows32", "ours", "fp8", "mla_decode plan, backend triton, FP8 cache, the portable kernel with "
           "32 query rows a program (block_h), 8 warps", _ours("triton", "fp8", block_h=32)),
    Method("cuda-fp8-rows16", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, 16 query rows a CTA "
           "(unit_rows)", _ours("cuda", "fp8", unit_rows=16)),
    Method("cuda-fp8-rows32", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, 32 query rows a CTA "
           "(unit_rows)", _ours("cuda", "fp8", unit_rows=32)),
    Method("cuda-fp8-rows64", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, units of 64 query rows "
           "(wgmma64)", _ours("cuda", "fp8", unit_rows=64)),
    Method("cuda-fp8-balanced", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, the work-balanced "
           "schedule (backend option schedule)", _ours("cuda", "fp8", schedule="balanced")),
    Method("cuda-fp8-balanced-line", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, the work-balanced "
           "schedule with the line cut (backend option cut)", _ours("cuda", "fp8", schedule="balanced", cut="line")),
    *(Method(f"cuda-{fmt}-balanced-pack", "ours", fmt, f"mla_decode plan, backend cuda, {fmt.upper()} cache, the "
             "work-balanced schedule with the pack cut (backend option cut)",
             _ours("cuda", fmt, schedule="balanced", cut="pack")) for fmt in ("fp8", "bf16")),
    Method("cuda-fp8-balanced-least16", "ours", "fp8", "mla_decode plan, backend cuda, FP8 cache, the work-balanced "
           "schedule with a least share of 16 tiles (backend option min_share)",
           _ours("cuda", "fp8", schedule="balanced", min_share=16)),
    Method("cuda-mxfp4-balanced", "ours", "mxfp4", "mla_decode plan, backend cuda, MXFP4 cache, the work-balanced "
           "schedule (backend option schedule)", _ours("cuda", "mxfp4", schedule="balanced")),
    Method("cuda-bf16", "ours", "bf16", "mla_decode plan, backend cuda, BF16 cache (wgmma, bf16 operands)",
           _ours("cuda", "bf16")),
    Method("cuda-bf16-balanced", "ours", "bf16", "mla_decode plan, backend cuda, BF16 cache, the work-balanced "
           "schedule (backend option schedule)", _ours("cuda", "bf16", schedule="balanced")),
    *(Method(f"cuda-bf16-rows{rows}", "ours", "bf16", f"mla_decode plan, backend cuda, BF16 cache, {rows} query rows "
             "a CTA (unit_rows), the work-balanced schedule",
             _ours("cuda", "bf16", unit_rows=rows, schedule="balanced")) for rows in (16, 32, 64)),
    Method("triton-bf16", "ours", "bf16", "mla_decode plan, backend triton, BF16 cache", _ours("triton", "bf16")),
    *(Method(f"triton-bf16-rows{rows}", "ours", "bf16", f"mla_decode plan, backend triton, BF16 cache, the Hopper "
             f"kernel with {rows} query rows a program", _ours("triton", "bf16", hopper_rows=rows))
      for rows in (16, 32, 64)),
    *(Method(f"triton-{fmt}-balanced", "ours", fmt, f"mla_decode plan, backend triton, {fmt.upper()} cache, the "
             "work-balanced schedule (backend option schedule)", _ours("triton", fmt, schedule="balanced"))
      for fmt in ("fp8", "bf16")),
    Method("flashmla-bf16", "peer", "bf16", f"FlashMLA ({FLASHMLA_SOURCE}) fwd_kvcache_mla, BF16 cache",
           _flashmla("bf16")),
    Method("flashmla-fp8", "peer", "fp8",
           f"FlashMLA ({FLASHMLA_SOURCE}) fwd_kvcache_mla_fp8, FP8 cache, e4m3 Q (per tensor)", _flashmla("fp8")),
    Method("flashinfer-bf16", "peer", "bf16", "FlashInfer BatchMLAPagedAttentionWrapper, BF16 cache",
           _flashinfer("bf16")),
    Method("flashinfer-fp8", "peer", "fp8", "FlashInfer BatchMLAPagedAttentionWrapper, FP8 cache (per-tensor scale)",
           _flashinfer("fp8")),
    Method("memwalk-fp8", "floor", "fp8", "memory-only walk of the FP8 pages (576 B/row), no math", _memwalk),
)


# ---------------------------------------------------------------------------------------------------------
# One method on one row: the harness's check and timing, with the row's FLOPs and the LSE's error
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class ServingResult(harness.Result):
    """One method on one serving row: the harness's columns, the row's geometry, TFLOPS and the LSE's error."""
    batch: int
    kv: int
    heads: int
    q_len: int
    page: int
    flops: int
    tflops: float | None = None
    lse_err: float | None = None
    wall_s: float | None = None  # the whole of run_method: set-up, compiles, check and timing

    def take(self, verdict: harness.Verdict) -> None:
        super().take(verdict)
        self.lse_err = verdict.lse_err

    def derive(self, ceiling_gbps: float, best_peer_us: float | None) -> None:
        super().derive(ceiling_gbps, best_peer_us)
        if self.median_us is not None and self.kind != "floor":  # a walk does no math
            self.tflops = self.flops / self.median_us / 1e6


LAYOUT = harness.Layout(
    detail=(("µs median", "median_us", ".1f"), ("µs mean", "mean_us", ".1f"), ("KV GB/s", "gbps", ".0f"),
            ("% ceil", "pct_ceiling", ".0f"), ("TFLOPS", "tflops", ".1f"), ("vs peer", "vs_best_peer", ".2f"),
            ("rel-L2", "rel_l2", ".1e"), ("LSE err", "lse_err", ".1e")),
    geomeans=(("geomean_us", "median_us"), ("geomean_vs_best_peer", "vs_best_peer"), ("geomean_tflops", "tflops")),
    method_keys=("kind", "kv_format", "label"),
)


def run_method(ctx: ServingContext, method: Method, case: Case) -> ServingResult:
    """One method on one row: skipped (with the reason) where it cannot run here, ERROR where it raises, else its
    first result checked (ok or FAIL) and then timed."""
    shape = case.shape
    result = ServingResult(shape=shape.name, batch=shape.batch, kv=shape.kv, heads=shape.heads, q_len=shape.q_len,
                           page=shape.page, method=method.name, kind=method.kind, kv_format=method.kv_format,
                           kv_rows=case.kv_rows, kv_bytes=case.kv_rows * BYTES_PER_ROW[method.kv_format],
                           flops=2 * shape.q_len * shape.heads * case.kv_rows * (QK_DIM + V_DIM))
    return harness.measure(ctx, result, lambda: method.prepare(ctx, case))


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def load_shapes(path: Path) -> list[ServingShape]:
    """The rows of a serving spec (serving.yml's layout), each checked: every sequence must hold at least one row."""
    shapes = []
    for entry in yaml.safe_load(path.read_text())["rows"]:
        try:
            shape = ServingShape(**entry)
        except TypeError as e:
            raise SystemExit(f"{path}: row {entry}: {e}") from e
        if min(shape.batch, shape.heads, shape.q_len, shape.page) < 1 or shape.kv < shape.page:
            raise SystemExit(f"{path}: row {entry}: expected batch, heads, q_len, page >= 1 and kv >= page")
        if shape.spread not in SPREADS:
            raise SystemExit(f"{path}: row {entry}: expected a spread of {SPREADS}")
        shapes.append(shape)
    names = [s.name for s in shapes]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: two rows share a name (batch x kv - heads - q_len): {names}")
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spec", type=Path, default=SPEC, help="the rows (default serving.yml)")
    p.add_argument("--rows", help="comma-separated subset of the spec's rows by name, e.g. 1x1k-h16-q1,8x32k-h16-q1")
    p.add_argument("--methods", help=f"comma-separated subset of {', '.join(m.name for m in METHODS)}")
    p.add_argument("--iters", type=int, help="timed calls per method and row (default 50; 3 with --dry-run)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (checked) call (default 5; 1 dry run)")
    p.add_argument("--ceiling-gib", type=float, help="buffer of the read-ceiling kernel (default 4; 1/1024 dry run)")
    p.add_argument("--fi-backend", default="fa3", help="FlashInfer's MLA backend (fa3: the Hopper template)")
    p.add_argument("--json", type=Path, help="write every measurement (and each call's time) here")
    p.add_argument("--markdown", type=Path, help="write a BENCHMARKS.md section here")
    p.add_argument("--dry-run", action="store_true", help="two tiny rows on any device (CPU: wall-clock timing)")
    args = p.parse_args(argv)
    harness.fill_defaults(args)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1, --warmup >= 0")
    return args


def markdown_head(result: dict) -> list[str]:
    """The run's BENCHMARKS.md heading, its setting and legend."""
    meta = result["meta"]
    return [
        f"### Serving grid · {harness.markdown_title(meta)}",
        "",
        *harness.markdown_meta(result, ("torch", "cuda", "triton", "flashinfer", "python")),
        "",
        "Median µs per call; shape = batch x KV length - heads - q_len (q_len 2 causal), pages of "
        f"{', '.join(str(p) for p in meta['pages'])} rows; `!` = the row failed its check (still timed); `FP8 floor` ="
        " FP8 KV bytes / ceiling.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_start = time.perf_counter()
    device = get_device()
    shapes = [ServingShape(**s) for s in DRY_RUN_SHAPES] if args.dry_run else load_shapes(args.spec)
    shapes = select(shapes, args.rows, "rows")
    methods = select(list(METHODS), args.methods, "methods")
    ctx = ServingContext(args, device)
    meta = harness.start(ctx, "bench/serving.py", argv)
    read_ceiling = measure_read_ceiling(ctx)
    print(f"HBM read ceiling: {read_ceiling['gbps']:.0f} GB/s ({read_ceiling['kernel']})", flush=True)
    meta |= {
        "pages": sorted({s.page for s in shapes}),
        "timing": (f"L2 flush, events around the call, median of {args.iters} calls after 1 checked + "
                   f"{args.warmup} warm-up calls" if device.type == "cuda" else
                   f"CPU wall clock, median of {args.iters} calls after 1 checked + {args.warmup} warm-up calls"),
        "bounds": {fmt: b._asdict() for fmt, b in SERVING_BOUNDS.items()},
    }
    run = harness.Run(ctx, LAYOUT, methods, len(shapes), meta, {"read_ceiling": read_ceiling}, "results")
    for shape in shapes:
        case = Case(shape, device)
        print(f"{shape.name}: batch {shape.batch}, kv {shape.kv}, {shape.heads} heads, q_len {shape.q_len}, "
              f"{case.num_pages} pages of {shape.page}", flush=True)
        for m in methods:
            method_start = time.perf_counter()
            r = run_method(ctx, m, case)
            r.wall_s = time.perf_counter() - method_start
            run.add(r)
            print(f"  {m.name:<20} {r.status:<{STATUS_WIDTH}} {r.wall_s:6.1f} s  "
                  + (f"{r.median_us:10.1f} µs  {r.check}" if r.median_us is not None else r.reason), flush=True)
        kv_rows = case.kv_rows
        del case
        record = dataclasses.asdict(shape) | {"name": shape.name, "kv_rows": kv_rows}
        run.shape_done(harness.ShapeDone(shape.name, kv_rows, f"\n== {shape.name} ==", record))
    return run.finish(markdown_head, f"\nmedian µs ({'' if device.type == 'cuda' else 'CPU, '}{args.iters} calls); "
                                     f"read ceiling {read_ceiling['gbps']:.0f} GB/s; ! = failed check; the run took "
                                     f"{time.perf_counter() - run_start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
