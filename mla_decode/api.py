"""The call: arguments checked at the door (before any kernel runs), the backend chosen, the plan made and run.

Layouts:
  q:             (batch, q_len, num_heads, 576) bfloat16, contiguous
  paged:  kv_cache (num_pages, page_size, 1, 576) FP8 | bfloat16, or (num_pages, page_size, 1, 288) MXFP4 codes;
          block_table (batch, max_pages) int32: sequence b's i-th page is kv_cache[block_table[b, i]];
          cache_seqlens (batch,) int32: sequence b owns its first cache_seqlens[b] slots, in table order
  ragged: kv_cache (num_rows, 1, width); kv_indptr (batch + 1,) int32: sequence b owns rows kv_indptr[b] ..
          kv_indptr[b + 1] - 1 (the leaderboard's contiguous cache)
  kv_scale:      FP8: (1,) float32, kv ~= kv_fp8 * kv_scale; MXFP4: E8M0 block scales (uint8 or float8_e8m0fnu),
                 paged (num_pages, page_size, 1, 18) contiguous, ragged (>= num_rows, >= 18) with unit stride along
                 a row; BF16: None
  out:           (batch, q_len, num_heads, 512) bfloat16
  lse:           (batch, num_heads, q_len) float32, the natural log of each softmax denominator (scores scaled)
Causal (q_len > 1): query token t of sequence b sees the first cache_seqlens[b] - q_len + 1 + t slots. A query that
sees nothing gives out 0 and lse -inf. The GPU kernels never follow a page outside [0, num_pages) or read past a
sequence's length: a sequence whose length is invalid comes out NaN (out and lse), and so does every query token
that would read a page outside the cache (with q_len 1 or without causal, the whole sequence; causal tokens that
stop before it keep their values); check_contents=True (a host sync) raises instead, naming the argument and the
sequence, and the torch backend always does.
"""

from typing import NamedTuple

import torch

from .backends import make_backend_plan, select_backend
from .contract import (
    DEFAULT_SOFTMAX_SCALE,
    E8M0_DTYPES,
    MXFP4_BLOCKS_PER_ROW,
    PLAN_CACHE_LIMIT,
    PRECISIONS,
    QK_HEAD_DIM,
    ROW_WIDTH,
    V_HEAD_DIM,
    Device,
    Problem,
    expect,
    expect_choice,
    expect_int,
    expect_on_device,
    expect_softmax_scale,
    expect_tensor,
    kv_format_of,
    kv_format_of_dtype,
    remember,
)
from .torch_backend import sequence_rows


def version_of(x: torch.Tensor) -> int | None:
    """x's version counter (bumped by every in-place write), or None for an inference-mode tensor, which has none."""
    try:
        return x._version
    except RuntimeError:
        return None


class StepSchedule(NamedTuple):
    """DecodePlan.schedule's work-balanced schedule of one step's lengths, for run(schedule=) in every layer of the
    step. Tied to the tensor it was made from and that tensor's version: a run with another lengths tensor, or after
    the lengths were written in place, is refused (make a new one each step, or capture both in one CUDA graph). An
    inference-mode tensor has no version: only the tensor is checked then."""

    seqs: torch.Tensor  # the cache_seqlens or kv_indptr it was made from
    version: int | None  # seqs' version counter when it was made (None: an inference tensor, which has none)
    items: torch.Tensor | None  # the backend's schedule; None where the backend cuts the work in each call


class DecodePlan:
    """A decode planned for one problem (every shape, dtype and setting of a call but the data) on one backend: its
    workspace allocated, its split plan made. run() checks its arguments against the plan, then launches; on the
    cuda and triton backends it allocates nothing when out (and lse) are given, makes no host sync and reads no
    length or table on the host, so a CUDA graph can capture it (after one run outside the capture, which compiles
    the kernels) and replay it with new lengths and tables of the same shapes. Runs of one plan share its workspace:
    issue them in order on one queue."""

    def __init__(self, problem: Problem, backend: str = "auto", check_contents: bool = False,
                 backend_options: dict | None = None):
        selection = select_backend(problem, backend)
        self.problem, self.backend, self.passed_over = problem, selection.backend, selection.passed_over
        self.check_contents = check_contents and self.backend != "torch"  # the torch backend always checks
        self.impl = make_backend_plan(selection.record, problem, backend_options or {})
        self._switch_device = problem.device.type == "cuda" and torch.cuda.device_count() > 1

    def _outputs(self, q: torch.Tensor, out, lse) -> tuple:
        p = self.problem
        if out is None:
            out = q.new_empty((p.batch, p.q_len, p.num_heads, V_HEAD_DIM))
        else:
            _expect_buffer(out, "out", (p.batch, p.q_len, p.num_heads, V_HEAD_DIM), torch.bfloat16, p.device)
        if not p.return_lse:
            expect(lse is None, "lse", "None (the plan was made with return_lse=False)", type(lse).__name__)
        elif lse is None:
            lse = torch.empty((p.batch, p.num_heads, p.q_len), dtype=torch.float32, device=q.device)
        else:
            _expect_buffer(lse, "lse", (p.batch, p.num_heads, p.q_len), torch.float32, p.device)
        return out, lse

    def schedule(self, seqs: torch.Tensor) -> StepSchedule:
        """The work-balanced schedule of a step's lengths: cache_seqlens (batch,) int32 for a paged plan, kv_indptr
        (batch + 1,) int32 for a ragged one. Made on the GPU (no host read; capturable), once a step, and passed to
        run(schedule=) in every layer. Backends that cut the work in each call give one that holds no items."""
        p = self.problem
        name, shape = ("cache_seqlens", (p.batch,)) if p.layout == "paged" else ("kv_indptr", (p.batch + 1,))
        _expect_buffer(seqs, name, shape, torch.int32, p.device)
        make = getattr(self.impl, "make_schedule", None)
        items = make(seqs) if make is not None and getattr(self.impl, "balanced", False) else None
        return StepSchedule(seqs, version_of(seqs), items)

    def _schedule_items(self, schedule: StepSchedule | None, seqs: torch.Tensor) -> torch.Tensor | None:
        if schedule is None:
            return None
        expect(isinstance(schedule, StepSchedule), "schedule", "this plan's schedule() of the same lengths",
               type(schedule).__name__)
        expect(schedule.seqs is seqs, "schedule", "one made from the lengths tensor passed here",
               "one made from another tensor")
        version = version_of(seqs)
        expect(version is None or schedule.version is None or schedule.version == version, "schedule",
               "one made after the lengths were last written",
               "a stale one (the lengths were written since)")
        return schedule.items

    def launch(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor | None, seqs: torch.Tensor,
               table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
               items: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """run's launch, on arguments it does not check: as the backends take them (TritonDecode.run), for a caller
        that checked them once per kind of call (the leaderboard adapter). items: a StepSchedule's."""
        if self.check_contents:
            sequence_rows(self.problem, seqs, table, kv.shape[0])
        extra = {} if items is None else {"schedule": items}
        if self._switch_device and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):  # ctypes, Triton and aiter launch on the current device
                self.impl.run(q, kv, scale, seqs, table, out, lse, **extra)
        else:
            self.impl.run(q, kv, scale, seqs, table, out, lse, **extra)
        return out, lse

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
            kv_scale: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None,
            schedule: StepSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode of a paged cache (the module's docstring gives the layouts) -> (out, lse); lse is None when
        the plan was made with return_lse=False. out, lse: buffers to write (else allocated); schedule: this
        plan's schedule(cache_seqlens) of this step (else the call makes its own)."""
        p = self.problem
        expect(p.layout == "paged", "run", "kv_indptr (this plan is ragged: run_ragged)", "block_table")
        _expect_q(q, p)
        kv, scale = _expect_cache(kv_cache, kv_scale, p, (p.page_size,))
        _expect_buffer(block_table, "block_table", (p.batch, p.max_pages), torch.int32, p.device)
        _expect_buffer(cache_seqlens, "cache_seqlens", (p.batch,), torch.int32, p.device)
        items = self._schedule_items(schedule, cache_seqlens)
        return self.launch(q, kv, scale, cache_seqlens, block_table, *self._outputs(q, out, lse), items)

    def run_ragged(self, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_scale: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None,
                   schedule: StepSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode of a ragged cache: sequence b owns rows kv_indptr[b] .. kv_indptr[b + 1] - 1 of kv_cache
        (num_rows, 1, width) -> (out, lse). schedule: this plan's schedule(kv_indptr), as run's."""
        expect(self.problem.layout == "ragged", "run_ragged",
               "block_table and cache_seqlens (this plan is paged: run)", "kv_indptr")
        kv, scale = expect_ragged_inputs(self.problem, q, kv_cache, kv_indptr, kv_scale)
        items = self._schedule_items(schedule, kv_indptr)
        return self.launch(q, kv, scale, kv_indptr, None, *self._outputs(q, out, lse), items)


class CacheNames(NamedTuple):
    """What the checks call the cache and its scale: the library's argument names, or the caller's (the leaderboard
    adapter names the competition tuple's fields)."""

    kv: str = "kv_cache"
    scale: str = "kv_scale"


ARGUMENT_NAMES = CacheNames()


def expect_ragged_inputs(p: Problem, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                         kv_scale: torch.Tensor | None,
                         names: CacheNames = ARGUMENT_NAMES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """run_ragged's checks of its inputs against a ragged problem -> (kv, scale) as the kernels read them."""
    _expect_q(q, p)
    kv, scale = _expect_cache(kv_cache, kv_scale, p, (), names)
    _expect_buffer(kv_indptr, "kv_indptr", (p.batch + 1,), torch.int32, p.device)
    return kv, scale


def _expect_buffer(x, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    # Every run checks five of these: a good tensor passes before any message is formatted
    if (isinstance(x, torch.Tensor) and x.shape == shape and x.dtype == dtype and x.device == device
            and x.is_contiguous()):
        return
    expect_tensor(x, name)
    expect(tuple(x.shape) == shape, f"{name}.shape", str(shape), tuple(x.shape))
    expect(x.dtype == dtype, f"{name}.dtype", str(dtype), x.dtype)
    expect_on_device(x, name, device)
    expect(x.is_contiguous(), name, "a contiguous tensor", "a strided view")


def _expect_q(q, p: Problem) -> None:
    _expect_buffer(q, "q", (p.batch, p.q_len, p.num_heads, QK_HEAD_DIM), torch.bfloat16, p.device)


def _expect_cache(kv_cache, kv_scale, p: Problem, page: tuple, names: CacheNames = ARGUMENT_NAMES) -> tuple:
    """(kv, scale): the cache as rows (num_rows, width) and its scale as the kernels read it, after the checks."""
    width = ROW_WIDTH[p.kv_format]
    tail = (*page, 1, width)  # after num_pages (paged) or num_rows (ragged)
    # Like _expect_buffer: a good cache and scale pass before any message is formatted
    if not (isinstance(kv_cache, torch.Tensor) and kv_cache.shape[1:] == tail and kv_cache.dim() == 1 + len(tail)
            and kv_cache.dtype == p.kv_dtype and kv_cache.device == p.device and kv_cache.is_contiguous()):
        expect_tensor(kv_cache, names.kv)
        expect(kv_cache.dim() == 1 + len(tail) and tuple(kv_cache.shape[1:]) == tail, f"{names.kv}.shape",
               f"({'num_pages' if page else 'num_rows'}, {', '.join(map(str, tail))})", tuple(kv_cache.shape))
        expect(kv_cache.dtype == p.kv_dtype, f"{names.kv}.dtype", f"{p.kv_dtype} (the plan's)", kv_cache.dtype)
        expect_on_device(kv_cache, names.kv, p.device)
        expect(kv_cache.is_contiguous(), names.kv, "a contiguous tensor", "a strided view")
    kv = kv_cache.view(-1, width)
    if p.kv_format == "bf16":
        expect(kv_scale is None, names.scale, "None for a bfloat16 cache", type(kv_scale).__name__)
        return kv, None
    if not (isinstance(kv_scale, torch.Tensor) and kv_scale.device == p.device and kv_scale.dtype == p.scale_dtype):
        expect_tensor(kv_scale, names.scale)
        expect_on_device(kv_scale, names.scale, p.device)
        expect(kv_scale.dtype == p.scale_dtype, f"{names.scale}.dtype", f"{p.scale_dtype} (the plan's)", kv_scale.dtype)
    if p.kv_format == "fp8":
        expect(kv_scale.numel() == 1, f"{names.scale}.shape", "(1,) float32", tuple(kv_scale.shape))
        return kv, kv_scale
    rows = kv.shape[0]
    if page:
        want = (*kv_cache.shape[:-1], MXFP4_BLOCKS_PER_ROW)
        good = kv_scale.shape == want and kv_scale.is_contiguous()
        if not good:
            expect(good, names.scale, f"E8M0 block scales of shape {want}, contiguous", f"{tuple(kv_scale.shape)}")
        return kv, kv_scale.view(rows, MXFP4_BLOCKS_PER_ROW)
    expect(kv_scale.dim() == 2 and kv_scale.shape[0] >= rows and kv_scale.shape[1] >= MXFP4_BLOCKS_PER_ROW
           and kv_scale.stride(1) == 1 and kv_scale.stride(0) == p.scale_stride, names.scale,
           f"(>= {rows}, >= {MXFP4_BLOCKS_PER_ROW}) E8M0 block scales, unit stride along a row, row stride "
           f"{p.scale_stride}",
           f"shape {tuple(kv_scale.shape)}, strides {kv_scale.stride()}")
    return kv, kv_scale


def _scale_dtype(kv_format: str, scale_dtype: torch.dtype | None, name: str) -> torch.dtype | None:
    if kv_format == "fp8":
        return torch.float32
    if kv_format == "bf16":
        return None
    expect(scale_dtype in E8M0_DTYPES, f"{name}.dtype", f"one of {E8M0_DTYPES}", scale_dtype)
    return scale_dtype


def make_problem(batch_size: int, kv_dtype: torch.dtype, device: Device, *, layout: str, page_size: int = 0,
                 max_pages: int = 0, num_heads: int = 16, q_len: int = 1, max_seqlen: int | None = None,
                 softmax_scale: float | None = None,
                 causal: bool = False, precision: str = "fast", return_lse: bool = True,
                 scale_dtype: torch.dtype | None = torch.uint8, scale_stride: int | None = None,
                 names: CacheNames = ARGUMENT_NAMES) -> Problem:
    """The Problem of a plan, every argument checked (a ValueError or TypeError naming it; the scale's dtype by
    `names`)."""
    expect_int(batch_size, "batch_size", 1)
    expect_int(num_heads, "num_heads", 1)
    expect_int(q_len, "q_len", 1)
    if layout == "paged":
        expect_int(page_size, "page_size", 1)
        expect_int(max_pages, "max_pages", 1)
        max_seqlen = page_size * max_pages if max_seqlen is None else max_seqlen
    expect_int(max_seqlen, "max_seqlen", 0)
    kv_format = kv_format_of_dtype(kv_dtype)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the current GPU, as tensors made on "cuda" say it
        device = torch.device("cuda", torch.cuda.current_device())
    expect_choice(precision, "precision", PRECISIONS)
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise TypeError("causal, return_lse: expected bools")
    softmax_scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else expect_softmax_scale(softmax_scale)
    scale_dtype = _scale_dtype(kv_format, scale_dtype, names.scale)
    if kv_format != "mxfp4":
        scale_stride = 0
    elif scale_stride is None:
        scale_stride = MXFP4_BLOCKS_PER_ROW
    return Problem(device, batch_size, q_len, num_heads, kv_format, kv_dtype, scale_dtype, scale_stride, layout,
                   page_size if layout == "paged" else 0, max_pages if layout == "paged" else 0, max_seqlen, causal,
                   softmax_scale, precision, return_lse)


def plan(batch_size: int, page_size: int, max_pages: int, kv_dtype: torch.dtype, device: Device, *, num_heads: int = 16,
         q_len: int = 1, max_seqlen: int | None = None, softmax_scale: float | None = None, causal: bool = False,
         backend: str = "auto", precision: str = "fast", return_lse: bool = True,
         kv_scale_dtype: torch.dtype = torch.uint8, check_contents: bool = False,
         backend_options: dict | None = None) -> DecodePlan:
    """A plan for paged decodes of `batch_size` sequences: block_table (batch_size, max_pages), pages of page_size
    rows, a cache of kv_dtype (float8_e4m3fn / e4m3fnuz, bfloat16, or uint8 / float4_e2m1fn_x2 for MXFP4 codes with
    kv_scale_dtype block scales). max_seqlen: the longest sequence to size the split plan for (default: what the
    table holds; the cuda kernels' first table reads are fastest for sequences of that length). precision: "fast"
    (FP8 score products where the backend has them) or "precise" (fp16 or wider). backend: "auto" or one of
    mla_decode.BACKENDS (a RuntimeError where it cannot serve the plan). backend_options: passed to the backend's plan
    (the triton backend's {"plan": TritonPlan}, the cuda backend's {"unit_rows": 16, 32 or 64}; both take
    {"schedule": "fixed" or "balanced"}: the cuda backend's default is "balanced", the triton backend's "fixed")."""
    problem = make_problem(batch_size, kv_dtype, device, layout="paged", page_size=page_size, max_pages=max_pages,
                           num_heads=num_heads, q_len=q_len, max_seqlen=max_seqlen, softmax_scale=softmax_scale,
                           causal=causal, precision=precision, return_lse=return_lse, scale_dtype=kv_scale_dtype)
    return DecodePlan(problem, backend, check_contents, backend_options)


def plan_ragged(batch_size: int, kv_dtype: torch.dtype, device: Device, max_seqlen: int, *, num_heads: int = 16,
                q_len: int = 1, softmax_scale: float | None = None, causal: bool = False, backend: str = "auto",
                precision: str = "fast", return_lse: bool = True, kv_scale_dtype: torch.dtype = torch.uint8,
                kv_scale_stride: int | None = None, check_contents: bool = False,
                backend_options: dict | None = None) -> DecodePlan:
    """A plan for ragged decodes (run_ragged): sequence b owns rows kv_indptr[b] .. kv_indptr[b + 1] - 1 of a cache
    (num_rows, 1, width); max_seqlen sizes the split plan. kv_scale_stride: the MXFP4 scales' row stride (default
    18). backend_options: passed to the backend's plan (the leaderboard adapter's aiter variant and triton plan)."""
    problem = make_problem(batch_size, kv_dtype, device, layout="ragged", num_heads=num_heads, q_len=q_len,
                           max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=causal, precision=precision,
                           return_lse=return_lse, scale_dtype=kv_scale_dtype, scale_stride=kv_scale_stride)
    return DecodePlan(problem, backend, check_contents, backend_options)


class _CallKey(NamedTuple):
    problem: Problem
    backend: str
    check_contents: bool


_PLANS: dict = {}


def mla_decode_with_kvcache(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            cache_seqlens: torch.Tensor, kv_scale: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False, backend: str = "auto",
                            precision: str = "fast", *, return_lse: bool = True, max_seqlen: int | None = None,
                            check_contents: bool = False, out: torch.Tensor | None = None,
                            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MLA decode over a paged cache in one call -> (out, lse): the module's docstring gives the layouts, plan() the
    settings. The plan is made at the first call of each kind and kept (bounded); its runs share a workspace, so
    calls of one kind must be issued in order on one queue."""
    q = expect_tensor(q, "q")
    kv_cache = expect_tensor(kv_cache, "kv_cache")
    block_table = expect_tensor(block_table, "block_table")
    expect(q.dim() == 4, "q.shape", "(batch, q_len, num_heads, 576)", tuple(q.shape))
    expect(kv_cache.dim() == 4, "kv_cache.shape", "(num_pages, page_size, 1, width)", tuple(kv_cache.shape))
    expect(block_table.dim() == 2, "block_table.shape", "(batch, max_pages)", tuple(block_table.shape))
    kv_format = kv_format_of(kv_cache)
    scale_dtype = kv_scale.dtype if kv_format == "mxfp4" and isinstance(kv_scale, torch.Tensor) else None
    problem = make_problem(q.shape[0], kv_cache.dtype, q.device, layout="paged", page_size=kv_cache.shape[1],
                           max_pages=block_table.shape[1], num_heads=q.shape[2], q_len=q.shape[1],
                           max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=causal, precision=precision,
                           return_lse=return_lse, scale_dtype=scale_dtype)
    key = _CallKey(problem, backend, check_contents)
    decode = _PLANS.get(key)
    if decode is None:
        decode = remember(_PLANS, key, DecodePlan(problem, backend, check_contents), PLAN_CACHE_LIMIT)
    return decode.run(q, kv_cache, block_table, cache_seqlens, kv_scale, out=out, lse=lse)
