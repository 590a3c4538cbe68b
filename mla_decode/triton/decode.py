"""The triton backend's launch: TritonDecode, a problem's plan made once (the partials' workspace, the grids and
meta-arguments, the compiled kernels' launchers after a first run) and run many times.
"""

import threading

import torch

from ..contract import V_HEAD_DIM, Problem, caller_key
from .common import TritonTarget, tl, triton, triton_launch_options
from .hopper import hopper_split_kernel
from .kernels import mla_combine_kernel, mla_split_kernel
from .plan import TritonPlan, query_groups, triton_key


class TritonDecode:
    """The triton backend's plan for a problem: its launch key, the split partials' workspace, grids, meta-arguments
    and, after the first run on a GPU, the compiled kernels' launchers, called with addresses (Triton's JIT dispatch
    costs host time on every call). run() reads nothing back and allocates nothing after a caller's first run: each
    (thread, stream) that runs the plan gets its own partials (caller_key). `target` and `plan`: as triton_key takes
    them."""

    def __init__(self, problem: Problem, target: TritonTarget | None = None, plan: TritonPlan | tuple | None = None):
        self.key = key = triton_key(problem, target, plan)
        self.qk_scale = problem.qk_scale
        target, plan = key.target, key.plan
        splits = plan.num_splits
        nvidia, interpreted = target.vendor == "nvidia", target.vendor == "interpreter"
        splits_p2 = triton.next_power_of_2(splits)
        block_dv = min(V_HEAD_DIM, max(16, 8192 // splits_p2))  # a (splits, block_dv) fp32 tile: 64 registers/thread
        query_rows = key.q_len * key.num_heads  # a sequence's, folded token-major as q lays them out
        self.parts_shape = (key.batch * splits if splits > 1 else 0, query_rows)
        self._workspaces: dict[tuple[int, int], tuple] = {}
        self._lock = threading.Lock()
        # Q's FP8 maximum: the cache's FP8 type (448 e4m3fn, 240 fnuz), E4M3 against MXFP4 codes; none otherwise
        fp8_max = (float(torch.finfo(key.kv_dtype).max) if key.kv_format == "fp8" else
                   float(torch.finfo(torch.float8_e4m3fn).max) if plan.scaled_scores or plan.hopper else 0.0)
        dot_dtype = tl.float32 if interpreted else tl.bfloat16 if key.kv_format == "bf16" else tl.float16
        if plan.hopper:
            split_consts = dict(NUM_SPLITS=splits, PAGE_SIZE=key.page_size, FP8_MAX=fp8_max, WRITE_LSE=key.write_lse,
                                NUM_HEADS=key.num_heads, Q_LEN=key.q_len, CAUSAL=key.causal and key.q_len > 1,
                                PRECISE=key.precise, MXFP4=key.kv_format == "mxfp4")
        else:
            split_consts = dict(NUM_SPLITS=splits, BLOCK_N=plan.block_n, PAGE_SIZE=key.page_size,
                                KV_FORMAT=key.kv_format, PRECISE=key.precise, DOT_DTYPE=dot_dtype, FP8_MAX=fp8_max,
                                USE_ASM=nvidia, ROUND_FP8=interpreted, USE_PDL=nvidia and splits > 1,
                                SCALED_SCORES=plan.scaled_scores, WRITE_LSE=key.write_lse,
                                CHUNKED_PAGES=plan.chunked_pages, NUM_HEADS=key.num_heads, Q_LEN=key.q_len,
                                CAUSAL=key.causal and key.q_len > 1, V_CAST_FIRST=plan.v_cast_first,
                                BLOCK_H=plan.block_h)
        self.split_kernel = hopper_split_kernel if plan.hopper else mla_split_kernel
        combine_consts = dict(NUM_SPLITS=splits, SPLITS_P2=splits_p2, BLOCK_DV=block_dv, PAGE_SIZE=key.page_size,
                              USE_PDL=nvidia, WRITE_LSE=key.write_lse, NUM_HEADS=key.num_heads, Q_LEN=key.q_len)
        self.split_grid = (splits, query_groups(key.q_len, key.num_heads, plan.block_h), key.batch)
        self.combine_grid = (key.batch * query_rows, V_HEAD_DIM // block_dv, 1)
        # constexprs in the kernels' parameter order: the compiled kernels take them after the other arguments
        self.split_consts, self.combine_consts = tuple(split_consts.values()), tuple(combine_consts.values())
        self.split_meta = dict(split_consts, **triton_launch_options(target, plan.num_warps, plan.num_stages))
        self.combine_meta = dict(combine_consts, **triton_launch_options(target, 4, pdl=nvidia))
        self.split_run = self.combine_run = None

    def workspace(self) -> tuple:
        """The calling thread's partials on its current stream, (part_o (parts, query rows, 512) fp32, part_lse
        (parts, query rows) fp32, their addresses), made at its first run."""
        key = caller_key(self.key.device)
        found = self._workspaces.get(key)
        if found is None:
            parts, rows = self.parts_shape
            part_o = torch.empty((parts, rows, V_HEAD_DIM), dtype=torch.float32, device=self.key.device)
            part_lse = torch.empty((parts, rows), dtype=torch.float32, device=self.key.device)
            with self._lock:
                found = self._workspaces.setdefault(key, (part_o, part_lse, part_o.data_ptr(), part_lse.data_ptr()))
        return found

    def run(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor | None, seqs: torch.Tensor,
            table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """q (batch, q_len, num_heads, 576) bf16; kv (num_rows, width) in the key's format, scale as it has it (fp8
        (1,) fp32, mxfp4 (num_rows, >= 18) E8M0 with the key's row stride, bf16 None); seqs: cache_seqlens (batch,)
        (paged) or kv_indptr (batch + 1,) (ragged); table (batch, max_pages) or None; out (batch, q_len, num_heads,
        512) bf16 and lse (batch, num_heads, q_len) fp32 (None when the key does not write it)."""
        scale = kv if scale is None else scale  # bf16: an unused pointer
        table = seqs if table is None else table  # ragged: an unused pointer
        kv_rows, scale_stride = kv.shape[0], self.key.scale_stride
        max_pages = table.shape[-1] if self.key.page_size else 0
        q_ptr, kv_ptr, scale_ptr, seq_ptr, table_ptr = (q.data_ptr(), kv.data_ptr(), scale.data_ptr(), seqs.data_ptr(),
                                                        table.data_ptr())
        if (q_ptr | kv_ptr | seq_ptr | table_ptr) % 16:
            # A cache one byte off a boundary gives wrong FP8 scores in a kernel compiled for aligned ones (H200,
            # Triton 3.6), so none is compiled for such inputs.
            raise ValueError(f"triton backend: q, the KV cache ({kv.dtype}), the sequence lengths or offsets and the "
                             "page table must start on 16-byte boundaries")
        out_ptr, lse_ptr = out.data_ptr(), 0 if lse is None else lse.data_ptr()
        aligned = scale_ptr % 16 == 0 and lse_ptr % 16 == 0  # read or written element by element: any address
        work_o, work_lse, part_o, part_lse = self.workspace()
        if self.split_run is not None and aligned:
            self.split_run(q_ptr, kv_ptr, scale_ptr, scale_stride, seq_ptr, table_ptr, max_pages, kv_rows, out_ptr,
                           lse_ptr, part_o, part_lse, self.qk_scale, *self.split_consts)
            if self.combine_run is not None:
                self.combine_run(seq_ptr, max_pages, kv_rows, out_ptr, lse_ptr, part_o, part_lse,
                                 *self.combine_consts)
            return
        if self.key.kv_format == "mxfp4":  # the kernel reads the codes and the E8M0 scales as bytes
            kv, scale = kv.view(torch.uint8), scale.view(torch.uint8)
        lse = out if lse is None else lse  # not written: an unused pointer
        split = self.split_kernel[self.split_grid](q, kv, scale, scale_stride, seqs, table, max_pages, kv_rows, out,
                                                   lse, work_o, work_lse, self.qk_scale, **self.split_meta)
        combine = None
        if self.key.plan.num_splits > 1:
            combine = mla_combine_kernel[self.combine_grid](seqs, max_pages, kv_rows, out, lse, work_o, work_lse,
                                                             **self.combine_meta)
        if aligned and split is not None and (combine is not None or self.key.plan.num_splits == 1):
            # the compiled kernels' launchers, with their grids bound once
            self.split_run = split[self.split_grid]
            self.combine_run = combine[self.combine_grid] if combine is not None else None
