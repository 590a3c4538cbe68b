"""The cuda backend on a device: whether it serves a problem there, the facts of the GPU and its library that the plan
reads, and CudaDecode, a problem's plan and its one launch."""

import ctypes
import functools
import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from .build import DecodeCall, library
from .plan import (
    CUT,
    CUTS,
    MAX_UNITS,
    MIN_SHARE,
    PACK_MAX_BATCH,
    SCHEDULE,
    SCHEDULES,
    DeviceFacts,
    LaunchKey,
    balanced_parts,
    fill_slack,
    page_divisor,
    plan_splits,
    plan_unit_rows,
    query_units,
    split_rows,
    unit_ctas_per_sm,
)

if TYPE_CHECKING:  # the package imports nothing of mla_decode at run time
    from ..contract import Problem

V_HEAD_DIM = 512  # value width (DV in the source)
KV_FORMATS = ("fp8", "mxfp4", "bf16")  # the caches these kernels read, in the order of DecodeCall's kv_format
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}  # the caches' dtypes where they have one
# The caches only the Hopper (wgmma) kernel reads, each with the library's export that says whether it has it
HOPPER_FORMATS = {"mxfp4": "mla_supports_mxfp4", "bf16": "mla_supports_bf16"}
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 and ldmatrix; the e4m3 cvt is native from sm_89, emulated before


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def unusable_reason(device: torch.device, kv_format: str = "fp8", precise: bool = False) -> str | None:
    """None when the cuda backend reads `kv_format` ("fp8", "mxfp4" or "bf16") on `device` in the fast or the precise
    mode (an NVIDIA GPU of capability >= 8.0 whose kernel library builds with the machine's nvcc, once per machine;
    MXFP4 and BF16 only with the Hopper kernel, so not in the precise mode), else why not."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"cuda backend: needs an NVIDIA GPU; device is {device}"
    if capability(device) < MIN_CAPABILITY:
        return f"cuda backend: needs compute capability >= 8.0, this GPU has {capability(device)}"
    if kv_format in HOPPER_FORMATS and precise:
        return (f"cuda backend: the precise mode reads the FP8 cache only (its mma.sync kernel has no "
                f"{kv_format.upper()} path)")
    try:
        lib = library(capability(device), precise)
    except RuntimeError as e:
        return str(e)
    if kv_format in HOPPER_FORMATS and not getattr(lib, HOPPER_FORMATS[kv_format])():
        return (f"cuda backend: reads {kv_format.upper()} only with its Hopper (sm_90a) kernel; this GPU has "
                f"capability {capability(device)}")
    return None


def device_facts(device: torch.device, precise: bool) -> DeviceFacts:
    """What the plan reads of `device` and of its kernel library in that mode (built and loaded by now: called where
    the backend serves the device)."""
    lib = library(capability(device), precise)
    return DeviceFacts(torch.cuda.get_device_properties(device).multi_processor_count, lib.mla_unit_ctas_per_sm,
                       lib.mla_max_unit_rows(), lib.mla_bf16_ctas_per_sm())


def launch_splits(key: LaunchKey) -> int:
    """The splits per sequence of the launch plan of `key` on its GPU (plan_splits)."""
    return plan_splits(key, device_facts(key.device, key.precise))


def cuda_unusable_reason(problem: "Problem") -> str | None:
    """None when the cuda backend serves `problem` (an mla_decode.contract.Problem): any head count, the FP8 cache
    (MXFP4 on Hopper, fast mode), on an NVIDIA GPU whose kernels build, in at most MAX_UNITS units of the plan's rows;
    else why not."""
    if problem.kv_format not in KV_FORMATS:
        return f"cuda backend: reads the FP8, MXFP4 and BF16 caches, not {problem.kv_format}"
    want = KV_DTYPES.get(problem.kv_format)
    if want is not None and problem.kv_dtype != want:
        return f"cuda backend: reads {want} {problem.kv_format} caches, not {problem.kv_dtype}"
    precise = problem.precision == "precise"
    reason = unusable_reason(problem.device, problem.kv_format, precise)
    if reason is not None:
        return reason
    rows = plan_unit_rows(problem, device_facts(problem.device, precise))  # known once the library is
    units = query_units(problem, rows)
    if units > MAX_UNITS:
        return (f"cuda backend: batch x ceil(q_len x heads / {rows}) = {units} units of query rows, more than the "
                f"grid's {MAX_UNITS}")
    return None


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def current_raw_stream(device_index: int) -> int:
    """The current stream's handle on that GPU, through the private call Triton and Inductor make:
    torch.cuda.current_stream(device).cuda_stream builds a Stream object each call, several times the host time of
    the raw handle (docs/design-notes.md)."""
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


SCHEDULE_IN_CALL, SCHEDULE_GIVEN = 1, 2  # DecodeCall's schedule (common.cuh): made by mla_decode, or by mla_schedule
ITEM_FIELDS = 4  # a schedule item: {b, first tile, end tile, index << 16 | count} (schedule.cuh)


def schedule_words(parts: int, max_items: int) -> int:
    """int32 words of a balanced schedule (schedule.cuh): max_items items of ITEM_FIELDS, then part_first (parts +
    1,)."""
    return max_items * ITEM_FIELDS + parts + 1


def expect_schedule(schedule: torch.Tensor, want: tuple[int]) -> None:
    """A ValueError unless `schedule` is int32 of the plan's schedule shape `want` ((schedule_words,)): one of another
    plan would send the kernels to another part_first, past the tensor's end."""
    if schedule.shape != want or schedule.dtype != torch.int32:
        raise ValueError(f"cuda backend: schedule: expected this balanced plan's make_schedule, {want} int32; got "
                         f"{tuple(schedule.shape)} {schedule.dtype}")


class Workspace(NamedTuple):
    """One caller's partials, counters and schedule items, with its own DecodeCall: a plan keeps one per (thread,
    stream), so callers on two streams or two threads never share a partial or a counter."""

    call: DecodeCall
    address: int
    items: int  # the address of its own schedule items, which a run without a given schedule fills
    buffers: tuple  # the tensors the call points into, kept alive with it


class CudaDecode:
    """The cuda backend's plan for a problem: the kernel library, the unit rows, the schedule ("balanced", the
    default (plan.SCHEDULE): the work-balanced schedule of schedule.cuh, made on the GPU from the lengths, persistent
    CTAs over its parts and a combine kernel after them; or "fixed": num_splits equal splits a unit, faster on a
    uniform batch: BENCHMARKS.md; min_share, its least share in KV tiles; cut, how it cuts: "fill" (the default),
    "pack" or "line", mla_decode.schedule.CUTS; slack, the fill and pack cuts' overfill of a part that keeps a
    sequence whole, in KV tiles (default plan.fill_slack)), and a DecodeCall with the plan's fields set. The workspace
    (the pieces' partials, part_o (pieces, unit_rows, 512) bf16 and part_lse (pieces, unit_rows) fp32, the fixed
    splits' per-unit counters (units,) int32 and the balanced schedule (schedule_words,) int32) is made once per
    (thread, stream) that runs the plan. run() sets the inputs' fields and makes one ctypes call: no host read; no
    allocation after a stream's first run."""

    def __init__(self, problem: "Problem", unit_rows: int | None = None, schedule: str = SCHEDULE,
                 min_share: int = MIN_SHARE, cut: str = CUT, slack: int | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"backend_options: schedule {schedule!r}: expected one of {SCHEDULES}")
        if not isinstance(min_share, int) or min_share < 1:
            raise ValueError(f"backend_options: min_share {min_share!r}: expected an int >= 1 (the balanced "
                             "schedule's least share, in KV tiles)")
        if cut not in CUTS:
            raise ValueError(f"backend_options: cut {cut!r}: expected one of {CUTS}")
        if cut == "pack" and problem.batch > PACK_MAX_BATCH:
            raise ValueError(f"backend_options: cut 'pack' takes batches of at most {PACK_MAX_BATCH} sequences, "
                             f"got {problem.batch}: pass cut 'fill'")
        if slack is not None and (not isinstance(slack, int) or slack < 0):
            raise ValueError(f"backend_options: slack {slack!r}: expected an int >= 0 (the fill cut's overfill of a "
                             "part that keeps a sequence whole, in KV tiles)")
        device, batch = problem.device, problem.batch
        precise = problem.precision == "precise"
        facts = device_facts(device, precise)
        self.balanced = balanced = schedule == "balanced"
        rows = plan_unit_rows(problem, facts, unit_rows)
        units = query_units(problem, rows)
        if units > MAX_UNITS:
            raise ValueError(f"cuda backend: {units} units of {rows} query rows, more than the grid's {MAX_UNITS}")
        self.key = LaunchKey(device, units, problem.max_seqlen, problem.kv_format, precise, rows, problem.page_size)
        lib = library(capability(device), precise)
        self.decode, self.schedule_call = lib.mla_decode, lib.mla_schedule
        self.device, self.device_index = device, (device.index if device.index is not None
                                                  else torch.cuda.current_device())
        groups = units // batch
        if balanced:
            ctas = unit_ctas_per_sm(facts, rows, problem.kv_format)
            self.num_splits, self.parts = 1, balanced_parts(facts.sms, ctas, groups)
            self.max_items = self.parts + batch
            self.pieces = self.max_items * groups
            self.schedule_shape = (schedule_words(self.parts, self.max_items),)
        else:
            self.num_splits, self.parts, self.max_items = plan_splits(self.key, facts), 0, 0
            self.pieces = units * self.num_splits if self.num_splits > 1 else 0
            self.schedule_shape = (0,)
        page_mul, page_shift = page_divisor(problem.page_size) if problem.page_size else (0, 0)
        # The split the kernel's first table reads guess at (guess_entries): a sequence of the plan's length.
        guess_rows = split_rows(min(problem.max_seqlen, problem.max_pages * problem.page_size), self.num_splits)
        # the plan's own fields; each workspace's call is a copy of it pointing into that workspace
        self.call = DecodeCall(batch=batch, num_splits=self.num_splits, kv_format=KV_FORMATS.index(problem.kv_format),
                               page_size=problem.page_size, max_pages=problem.max_pages, num_heads=problem.num_heads,
                               q_len=problem.q_len, causal=int(problem.causal and problem.q_len > 1),
                               qk_scale=problem.qk_scale, unit_rows=rows, page_mul=page_mul, page_shift=page_shift,
                               guess_rows=guess_rows, schedule=SCHEDULE_IN_CALL if balanced else 0,
                               parts=self.parts, max_items=self.max_items, min_share=min_share,
                               cut=CUTS.index(cut),
                               slack=fill_slack(problem.kv_format, rows) if slack is None else slack)
        self.units, self.rows = units, rows
        self._workspaces: dict[tuple[int, int], Workspace] = {}
        self._lock = threading.Lock()

    def _new_workspace(self) -> Workspace:
        device, rows = self.device, self.rows
        part_o = torch.empty((self.pieces, rows, V_HEAD_DIM), dtype=torch.bfloat16, device=device)
        part_lse = torch.empty((self.pieces, rows), dtype=torch.float32, device=device)
        sync = torch.zeros((self.units if self.num_splits > 1 else 0,), dtype=torch.int32, device=device)
        items = torch.empty(self.schedule_shape, dtype=torch.int32, device=device)
        call = DecodeCall.from_buffer_copy(self.call)
        call.part_o, call.part_lse, call.sync = part_o.data_ptr(), part_lse.data_ptr(), sync.data_ptr()
        call.items = items.data_ptr()
        return Workspace(call, ctypes.addressof(call), call.items, (part_o, part_lse, sync, items))

    def workspace(self, stream: int) -> Workspace:
        """The workspace of this thread on `stream` (a raw handle), made at its first run: callers on two streams
        or two threads never share a partial or a counter."""
        key = (threading.get_ident(), stream)
        found = self._workspaces.get(key)
        if found is None:
            with self._lock:
                found = self._workspaces.setdefault(key, self._new_workspace())
        return found

    def make_schedule(self, seqs: torch.Tensor) -> torch.Tensor:
        """The balanced schedule of `seqs` (cache_seqlens (batch,) when paged, kv_indptr (batch + 1,) when ragged,
        int32 on the plan's device) made on the current stream: (schedule_words,) int32, the items (max_items, 4) and
        then part_first (parts + 1,), for run(schedule=) in every layer of a step. Reads no length on the host."""
        if not self.balanced:
            raise ValueError("cuda backend: this plan cuts fixed splits (schedule='fixed'); it takes no schedule")
        items = torch.empty(self.schedule_shape, dtype=torch.int32, device=seqs.device)
        call = DecodeCall.from_buffer_copy(self.call)
        call.seqs, call.items, call.stream = seqs.data_ptr(), items.data_ptr(), current_raw_stream(self.device_index)
        call.schedule = SCHEDULE_GIVEN
        err = self.schedule_call(ctypes.addressof(call))
        if err:
            raise RuntimeError(f"cuda backend: the schedule's launch failed with cudaError {err}")
        return items

    def run(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor | None, seqs: torch.Tensor,
            table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
            schedule: torch.Tensor | None = None) -> None:
        """q (batch, q_len, num_heads, 576) bf16; kv (num_rows, width) FP8 or MXFP4 codes or BF16, scale (1,) fp32,
        (num_rows, >= 18) E8M0 or (BF16) None; seqs: cache_seqlens (batch,) (paged) or kv_indptr (batch + 1,)
        (ragged); table (batch, max_pages) or None; out (batch, q_len, num_heads, 512) bf16; lse (batch, num_heads,
        q_len) fp32 or None; schedule: make_schedule's items for these seqs, or None (a balanced plan then makes its
        own in the call). q, kv, seqs and table start on 16-byte boundaries."""
        q_ptr, kv_ptr, seqs_ptr = q.data_ptr(), kv.data_ptr(), seqs.data_ptr()
        table_ptr = 0 if table is None else table.data_ptr()
        if (q_ptr | kv_ptr | seqs_ptr | table_ptr) % 16:
            raise ValueError(f"cuda backend: q, the KV cache ({kv.dtype}), the sequence lengths or offsets and the "
                             "page table must start on 16-byte boundaries")
        stream = current_raw_stream(self.device_index)
        work = self.workspace(stream)
        call = work.call
        call.q, call.kv, call.seqs, call.block_table = q_ptr, kv_ptr, seqs_ptr, table_ptr
        call.out, call.lse = out.data_ptr(), 0 if lse is None else lse.data_ptr()
        if self.key.kv_format == "mxfp4":
            call.kv_block_scales, call.scale_stride = scale.data_ptr(), scale.stride(0)
        elif self.key.kv_format == "fp8":
            call.kv_scale = scale.data_ptr()  # bf16 has none: the plan's 0, never read
        call.total_kv = kv.shape[0]
        call.stream = stream
        if self.balanced:
            if schedule is None:
                call.schedule, call.items = SCHEDULE_IN_CALL, work.items
            else:
                expect_schedule(schedule, self.schedule_shape)
                call.schedule, call.items = SCHEDULE_GIVEN, schedule.data_ptr()
        err = self.decode(work.address)
        if err:
            raise RuntimeError(f"cuda backend: launch failed with cudaError {err}")
