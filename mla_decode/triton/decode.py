"""The triton backend's launch: TritonDecode, a problem's plan made once (the partials' workspace, the grids and
meta-arguments, the compiled kernels' launchers after a first run) and run many times.
"""

import threading
from typing import NamedTuple

import torch

from ..contract import V_HEAD_DIM, Problem, caller_key
from ..schedule import SCHEDULES
from .common import TritonTarget, tl, triton, triton_launch_options
from .hopper import hopper_split_kernel
from .kernels import ITEM_FIELDS, mla_combine_kernel, mla_schedule_kernel, mla_split_kernel
from .plan import TritonPlan, balanced_parts, query_groups, resident_programs, triton_key

BALANCED_BLOCK_DV = 128  # the balanced combine's output columns a program: 4 programs a query row, each over its pieces
SCHEDULE_MAX_BLOCK = 1024  # the schedule kernel's sequences a round (its one program loops over the batch in these)


class TritonWorkspace(NamedTuple):
    """One caller's buffers (contract.caller_key: its thread and queue): the partials and, for a balanced plan, the
    schedule a run makes."""

    part_o: torch.Tensor  # (slots, query rows, 512) fp32: a split's or a piece's normalized output
    part_lse: torch.Tensor  # (slots, query rows) fp32: its log2-sum-exp
    schedule: torch.Tensor  # balanced: (max_items * 4 + batch + parts + 1,) int32, as make_schedule returns; else empty
    part_o_ptr: int
    part_lse_ptr: int


class TritonDecode:
    """The triton backend's plan for a problem: its launch key, how it cuts the work (schedule: "fixed", the default,
    the plan's num_splits equal splits of every sequence; or "balanced", opt-in (1.6x the cuda backend's geomean on
    the H100's uneven grid, BENCHMARKS.md), the
    work-balanced schedule of mla_decode/schedule.py, made on the device from the lengths by mla_schedule_kernel),
    the partials' workspace, grids,
    meta-arguments and, after the first run on a GPU, the compiled kernels' launchers, called with addresses
    (Triton's JIT dispatch costs host time on every call). run() reads nothing back and allocates nothing after a
    caller's first run: each caller (thread and queue: caller_key) gets its own partials and schedule.
    `target` and `plan`: as triton_key takes them (a balanced plan uses the plan's all but its num_splits)."""

    def __init__(self, problem: Problem, target: TritonTarget | None = None, plan: TritonPlan | tuple | None = None,
                 schedule: str = "fixed", min_share: int = 1):
        if schedule not in SCHEDULES:
            raise ValueError(f"backend_options: schedule {schedule!r}: expected one of {SCHEDULES}")
        if not isinstance(min_share, int) or min_share < 1:
            raise ValueError(f"backend_options: min_share {min_share!r}: expected an int >= 1 (the balanced "
                             "schedule's least share, in the plan's tiles)")
        self.min_share = min_share
        self.key = key = triton_key(problem, target, plan)
        self.qk_scale = problem.qk_scale
        target, plan = key.target, key.plan
        self.balanced = balanced = schedule == "balanced"
        groups = query_groups(key.q_len, key.num_heads, plan.block_h)
        # balanced: one share per resident program (parts), which walks its share's pieces; at most parts + batch
        # pieces (max_items), each a slot
        resident = resident_programs(target, key.kv_format, plan.hopper)
        self.parts = balanced_parts(target, groups, resident) if balanced else 0
        self.max_items = self.parts + key.batch if balanced else 0
        self.max_pages = problem.max_pages  # the table's width, which the schedule's valid lengths are judged by
        splits = 1 if balanced else plan.num_splits
        nvidia, interpreted = target.vendor == "nvidia", target.vendor == "interpreter"
        splits_p2 = triton.next_power_of_2(splits)
        # fixed: a (splits, block_dv) fp32 tile, 64 registers/thread
        block_dv = BALANCED_BLOCK_DV if balanced else min(V_HEAD_DIM, max(16, 8192 // splits_p2))
        query_rows = key.q_len * key.num_heads  # a sequence's, folded token-major as q lays them out
        self.parts_shape = (self.max_items if balanced else key.batch * splits if splits > 1 else 0, query_rows)
        # balanced: the items, each sequence's first item, then part_first (make_schedule)
        self.schedule_shape = (self.max_items * ITEM_FIELDS + key.batch + self.parts + 1,) if balanced else (0,)
        self._workspaces: dict[tuple[int, int], TritonWorkspace] = {}
        self._lock = threading.Lock()
        # Q's FP8 maximum: the cache's FP8 type (448 e4m3fn, 240 fnuz), E4M3 against MXFP4 codes; none otherwise
        fp8_max = (float(torch.finfo(key.kv_dtype).max) if key.kv_format == "fp8" else
                   float(torch.finfo(torch.float8_e4m3fn).max) if plan.scaled_scores or plan.hopper else 0.0)
        dot_dtype = tl.float32 if interpreted else tl.bfloat16 if key.kv_format == "bf16" else tl.float16
        merged = balanced or splits > 1  # a combine follows the split kernel
        if plan.hopper:
            split_consts = dict(NUM_SPLITS=splits, PAGE_SIZE=key.page_size, FP8_MAX=fp8_max, WRITE_LSE=key.write_lse,
                                NUM_HEADS=key.num_heads, Q_LEN=key.q_len, CAUSAL=key.causal and key.q_len > 1,
                                PRECISE=key.precise and key.kv_format == "fp8", MXFP4=key.kv_format == "mxfp4",
                                BF16=key.kv_format == "bf16", BALANCED=balanced, BLOCK_H=plan.block_h)
        else:
            split_consts = dict(NUM_SPLITS=splits, BLOCK_N=plan.block_n, PAGE_SIZE=key.page_size,
                                KV_FORMAT=key.kv_format, PRECISE=key.precise, DOT_DTYPE=dot_dtype, FP8_MAX=fp8_max,
                                USE_ASM=nvidia, ROUND_FP8=interpreted, USE_PDL=nvidia and merged,
                                SCALED_SCORES=plan.scaled_scores, WRITE_LSE=key.write_lse,
                                CHUNKED_PAGES=plan.chunked_pages, NUM_HEADS=key.num_heads, Q_LEN=key.q_len,
                                CAUSAL=key.causal and key.q_len > 1, V_CAST_FIRST=plan.v_cast_first,
                                BLOCK_H=plan.block_h, BALANCED=balanced)
        self.split_kernel = hopper_split_kernel if plan.hopper else mla_split_kernel
        combine_consts = dict(NUM_SPLITS=splits, SPLITS_P2=splits_p2, BLOCK_DV=block_dv, PAGE_SIZE=key.page_size,
                              USE_PDL=nvidia, WRITE_LSE=key.write_lse, NUM_HEADS=key.num_heads, Q_LEN=key.q_len,
                              BALANCED=balanced)
        # the schedule's tile is the split kernel's, so that a piece's bounds are whole tiles of its walk
        schedule_consts = dict(PAGE_SIZE=key.page_size, BLOCK_N=plan.block_n,
                               BLOCK_B=min(SCHEDULE_MAX_BLOCK, triton.next_power_of_2(max(key.batch, 16))))
        self.split_grid = (self.parts, groups, 1) if balanced else (splits, groups, key.batch)
        self.combine_grid = (key.batch * query_rows, V_HEAD_DIM // block_dv, 1) if merged else None
        # constexprs in the kernels' parameter order: the compiled kernels take them after the other arguments
        self.split_consts, self.combine_consts = tuple(split_consts.values()), tuple(combine_consts.values())
        self.schedule_consts = tuple(schedule_consts.values())
        self.split_meta = dict(split_consts, **triton_launch_options(target, plan.num_warps, plan.num_stages))
        self.combine_meta = dict(combine_consts, **triton_launch_options(target, 4, pdl=nvidia))
        self.schedule_meta = dict(schedule_consts, **triton_launch_options(target, 4))
        self.split_run = self.combine_run = self.schedule_run = None

    def workspace(self) -> TritonWorkspace:
        """The caller's partials and schedule (caller_key), made at its first run."""
        key = caller_key(self.key.device)
        found = self._workspaces.get(key)
        if found is None:
            parts, rows = self.parts_shape
            device = self.key.device
            part_o = torch.empty((parts, rows, V_HEAD_DIM), dtype=torch.float32, device=device)
            part_lse = torch.empty((parts, rows), dtype=torch.float32, device=device)
            schedule = torch.empty(self.schedule_shape, dtype=torch.int32, device=device)
            with self._lock:
                found = self._workspaces.setdefault(key, TritonWorkspace(part_o, part_lse, schedule,
                                                                         part_o.data_ptr(), part_lse.data_ptr()))
        return found

    def _launch_schedule(self, seqs: torch.Tensor, schedule: torch.Tensor) -> None:
        """mla_schedule_kernel, launched as the plan's other kernels are: the pieces of the lengths `seqs` into
        `schedule`."""
        items_at, parts_at = self.max_items * ITEM_FIELDS, self.max_items * ITEM_FIELDS + self.key.batch
        max_pages = self.max_pages if self.key.page_size else 0
        if self.schedule_run is not None:
            address = schedule.data_ptr()
            self.schedule_run(seqs.data_ptr(), max_pages, address, address + 4 * items_at, address + 4 * parts_at,
                              self.key.batch, self.parts, self.max_items, self.min_share, *self.schedule_consts)
            return
        made = mla_schedule_kernel[(1, 1, 1)](seqs, max_pages, schedule, schedule[items_at:], schedule[parts_at:],
                                              self.key.batch, self.parts, self.max_items, self.min_share,
                                              **self.schedule_meta)
        if made is not None:  # compiled (not interpreted): its launcher, with its grid bound once
            self.schedule_run = made[(1, 1, 1)]

    def make_schedule(self, seqs: torch.Tensor) -> torch.Tensor:
        """The balanced schedule of `seqs` (cache_seqlens (batch,) when paged, kv_indptr (batch + 1,) when ragged,
        int32 on the plan's device), made on the GPU in the caller's order of work for run(schedule=) in every layer
        of a step: (max_items * 4 + batch + parts + 1,) int32, the items (max_items, 4) {b, first tile, end tile,
        index << 16 | count} of mla_decode.schedule.schedule_items (tiles of the plan's block_n rows), then each
        sequence's first item (batch,), then mla_decode.schedule.part_first (parts + 1,): the split kernel's program p
        walks items part_first[p] .. part_first[p + 1] - 1. Reads no length on the host."""
        if not self.balanced:
            raise ValueError("triton backend: this plan cuts fixed splits (schedule='fixed'); it takes no schedule")
        if seqs.data_ptr() % 16:  # as run() refuses them: the compiled kernel assumes aligned lengths
            raise ValueError("triton backend: the sequence lengths or offsets must start on 16-byte boundaries")
        schedule = torch.empty(self.schedule_shape, dtype=torch.int32, device=seqs.device)
        self._launch_schedule(seqs, schedule)
        return schedule

    def run(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor | None, seqs: torch.Tensor,
            table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
            schedule: torch.Tensor | None = None) -> None:
        """q (batch, q_len, num_heads, 576) bf16; kv (num_rows, width) in the key's format, scale as it has it (fp8
        (1,) fp32, mxfp4 (num_rows, >= 18) E8M0 with the key's row stride, bf16 None); seqs: cache_seqlens (batch,)
        (paged) or kv_indptr (batch + 1,) (ragged); table (batch, max_pages) or None; out (batch, q_len, num_heads,
        512) bf16 and lse (batch, num_heads, q_len) fp32 (None when the key does not write it); schedule:
        make_schedule's for these seqs, or None (a balanced plan then makes its own in the call)."""
        work = self.workspace()
        if schedule is not None and (not self.balanced or schedule.shape != self.schedule_shape
                                     or schedule.dtype != torch.int32):
            raise ValueError(f"triton backend: schedule: expected this balanced plan's make_schedule, "
                             f"{self.schedule_shape} int32; got {tuple(schedule.shape)} {schedule.dtype}"
                             + ("" if self.balanced else " for a plan of fixed splits"))
        made = self.balanced and schedule is None  # the call makes its own schedule
        schedule = work.schedule if made else schedule if self.balanced else seqs  # fixed: an unused pointer
        scale = kv if scale is None else scale  # bf16: an unused pointer
        table = seqs if table is None else table  # ragged: an unused pointer
        kv_rows, scale_stride = kv.shape[0], self.key.scale_stride
        max_pages = table.shape[-1] if self.key.page_size else 0
        q_ptr, kv_ptr, scale_ptr, seq_ptr, table_ptr = (q.data_ptr(), kv.data_ptr(), scale.data_ptr(), seqs.data_ptr(),
                                                        table.data_ptr())
        items_ptr = schedule.data_ptr()
        if (q_ptr | kv_ptr | seq_ptr | table_ptr | items_ptr) % 16:
            # A cache one byte off a boundary gives wrong FP8 scores in a kernel compiled for aligned ones (H200,
            # Triton 3.6), so none is compiled for such inputs.
            raise ValueError(f"triton backend: q, the KV cache ({kv.dtype}), the sequence lengths or offsets, the "
                             "page table and the schedule must start on 16-byte boundaries")
        first_ptr = items_ptr + 4 * self.max_items * ITEM_FIELDS  # fixed: unused
        part_first_ptr = first_ptr + 4 * self.key.batch  # fixed: unused
        out_ptr, lse_ptr = out.data_ptr(), 0 if lse is None else lse.data_ptr()
        aligned = scale_ptr % 16 == 0 and lse_ptr % 16 == 0  # read or written element by element: any address
        if made:
            self._launch_schedule(seqs, schedule)
        if self.split_run is not None and aligned:
            self.split_run(q_ptr, kv_ptr, scale_ptr, scale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                           lse_ptr, work.part_o_ptr, work.part_lse_ptr, items_ptr, part_first_ptr, self.qk_scale,
                           *self.split_consts)
            if self.combine_run is not None:
                self.combine_run(seq_ptr, max_pages, kv_rows, out_ptr, lse_ptr, work.part_o_ptr, work.part_lse_ptr,
                                 items_ptr, first_ptr, *self.combine_consts)
            return
        if self.key.kv_format == "mxfp4":  # the kernel reads the codes and the E8M0 scales as bytes
            kv, scale = kv.view(torch.uint8), scale.view(torch.uint8)
        lse = out if lse is None else lse  # not written: an unused pointer
        items_at = self.max_items * ITEM_FIELDS
        first = schedule[items_at:] if self.balanced else seqs
        part_first = schedule[items_at + self.key.batch:] if self.balanced else seqs
        split = self.split_kernel[self.split_grid](q, kv, scale, scale_stride, seqs, table, max_pages, kv_rows, out,
                                                   lse, work.part_o, work.part_lse, schedule, part_first,
                                                   self.qk_scale, **self.split_meta)
        combine = None
        if self.combine_grid is not None:
            combine = mla_combine_kernel[self.combine_grid](seqs, max_pages, kv_rows, out, lse, work.part_o,
                                                             work.part_lse, schedule, first, **self.combine_meta)
        if aligned and split is not None and (combine is not None or self.combine_grid is None):
            # the compiled kernels' launchers, with their grids bound once
            self.split_run = split[self.split_grid]
            self.combine_run = combine[self.combine_grid] if combine is not None else None
