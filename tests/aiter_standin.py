"""A stand-in for ROCm/aiter's MLA decode API, for testing the aiter backend on the CPU.

Built from the recorded signatures in tests/data/aiter_signatures.json (docs/aiter-contract.md has the
semantics and where each fact was read). For a recorded version it creates the modules `aiter`,
`aiter.mla`, `aiter.ops`, `aiter.ops.attention` and `aiter.dtypes`, whose functions:

- take arguments exactly as the recorded signature does: each function carries an inspect.Signature built from the
  record and binds every call with it, so a wrong keyword, a missing argument or one too many fails with the
  TypeError Python would raise (and inspect.signature(fn) shows the recorded signature, as functools.wraps makes the
  real compiled ops do);
- enforce the checks docs/aiter-contract.md lists: dtypes (the arch's FP8 flavour only), contiguity
  and unit strides, head counts, float32 scales, a 4-D kv_buffer and a 3-D o (the unpacking ValueError), Python
  int/float scalars, powers of two, the six buffers' shapes and dtypes from the info function;
- model get_mla_metadata_v1's persistent split (v1.2, fast_mode=True, the only one the backend asks for): the kv
  indptr counts pages, sequences are cut into work items over CU_COUNT compute units, long ones into partials merged
  by a reduce; work_metadata_ptrs receives the "device addresses" (data_ptr) of work_indptr and work_info_set;
- model mla_decode_fwd as aiter/mla.py writes it, on top of the two ops it launches (the backend calls neither
  directly): mla_decode_stage1_asm_fwd (the C++ checks of csrc/py_itfs_cu/asm_mla.cu, the kernel lookup of
  hsa/gfx950/mla/mla_asm.csv for 16 and 128 heads, GFX950_KERNELS, then the kernel) and mla_reduce_v1. Persistent
  mode (16 heads, one query token) runs stage 1 then the reduce; non-persistent mode with FP8 Q and one split per
  sequence runs stage 1 alone, which writes o (NEWEST first fills its split counts: one more launch), for 16 heads
  with max_seqlen_q 1, 2 or 4 and 128 heads with any: the kernel takes max_seqlen_q query rows a sequence (qo_indptr
  in steps of it) and masks them causally, bottom-right (token t of q_len sees the first n - q_len + 1 + t of the n
  rows), as aiter's op_tests reference does; NEWEST's causal=False (the msk0 kernels) is not modelled. bf16 Q with
  FP8 KV exists in persistent mode only (the a16w8 kernel, looked up with max_seqlen_q padded to 4; Q is not
  padded). Every kernel run is appended to `launches`, by name, so tests count launches per call;
- model the dispatched gfx950 kernels as PAGE-SIZE-1-ONLY: each kv_indices entry is one KV row at page_id x page
  stride, whatever page_size says (docs/aiter-contract.md, "Page size 1, on purpose"). The persistent kernel walks the
  work list through the addresses in work_meta_data, as the kernel does, so buffers that were freed or come from
  different metadata fills fail; the reduce faults on partial slots stage 1 did not write, or maps of another
  fill. The non-persistent kernel reads kv_last_page_lens (only ones are modelled).
  Attention is computed in fp32 from exactly what the kernel is given: raw FP8 (or bf16) values, the softmax scale
  times q_scale * kv_scale (q_scale only for FP8 Q), the output times kv_scale, unsplit work written into `o` as bf16,
  split work into the fp32 partials and merged by log-sum-exp. A work item with no KV rows produces NaN (0/0), the
  pessimistic assumption for an empty sequence.

Only the paths the backend takes are modelled (the variants at 16 heads and one query per sequence; the
non-persistent one-split call at the other shapes of AITER_SHAPES); anything else raises NotImplementedError rather
than guess. The WHEEL's functions have its signatures but no
behaviour: the backend must refuse that version before calling anything. `aiter.utility` is deliberately absent,
so reference.py keeps its own MXFP4 quantizer while the stand-in is installed.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import json
import math
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import reference

SIGNATURES_PATH = Path(__file__).parent / "data" / "aiter_signatures.json"
# Labels of docs/aiter-contract.md's versions -> keys of signatures.json.
VERSIONS = {
    "RUNNER": "f3be04a12a0cfd6b5e2c7a94edc774f1bc24460d",  # pinned by the leaderboard's MI355X runner, 2026-03-04
    "MAR15": "856b644b061ed8f9697b7fca03c1b8f317b09859",  # last main commit before 2026-03-15
    "NEWEST": "e4048607a535ace3a2b51ded31b1c8c2d45c0879",  # newest main commit examined, 2026-08-22
    "WHEEL": "amd-aiter==0.1.7.post2.dev18",  # the PyPI wheel, main as of 2025-11-17
}
MODELLED = ("RUNNER", "MAR15", "NEWEST")
FP8_BY_ARCH = {"gfx950": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz}
TIGHT = 4e-3  # worst-row relative L2 vs fp32 attention over the same FP8 data: bf16 output rounding only
CU_COUNT = 16  # the stand-in GPU's compute units (S); an MI355X has 256, fewer keeps the CPU model fast
NUM_HEADS, QK_HEAD_DIM, V_HEAD_DIM = 16, 576, 512
# get_heuristic_kernel_mla's table for 16 and 128 query heads per KV head (hsa/gfx950/mla/mla_asm.csv at RUNNER; at
# NEWEST the same names for these keys, labelled causal=1): (Q type, KV type, heads, persistent, max_seqlen_q as looked
# up) -> kernel; anything else: "cannot get heuristic kernel". 128 heads look up qSeqLen 0 whatever max_seqlen_q is.
GFX950_KERNELS = {
    ("fp8", "fp8", 16, 1, 1): "mla_a8w8_qh16_qseqlen1_gqaratio16_ps",
    ("fp8", "fp8", 16, 0, 1): "mla_a8w8_qh16_qseqlen1_gqaratio16",
    ("fp8", "fp8", 16, 1, 2): "mla_a8w8_qh16_qseqlen2_gqaratio16_ps",
    ("fp8", "fp8", 16, 0, 2): "mla_a8w8_qh16_qseqlen2_gqaratio16",
    ("fp8", "fp8", 16, 1, 4): "mla_a8w8_qh64_qseqlen4_gqaratio16_ps",
    ("fp8", "fp8", 16, 0, 4): "mla_a8w8_qh64_qseqlen4_gqaratio16",
    ("fp8", "fp8", 128, 1, 0): "mla_a8w8_qh128_m32x4_n16x2_msk0_ps",
    ("fp8", "fp8", 128, 0, 0): "mla_a8w8_qh128_m32x4_n16x2_msk1",
    ("bf16", "fp8", 16, 1, 4): "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps",
    ("bf16", "bf16", 16, 1, 4): "mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps",
    ("bf16", "bf16", 16, 0, 1): "mla_dec_stage1_bf16_a16w16_subQ16_mqa16",
}
WORK_ROW = 8  # int32 per work item: batch, partial slot (-1: straight to o), q_start, q_end, kv_start, kv_end,
#               kv_offset, pad

_inside = [0]  # > 0 while a stand-in function runs (the tests' device-discipline modes ignore its own work)


def inside_standin() -> bool:
    return _inside[0] > 0


@contextlib.contextmanager
def _standin_running():
    _inside[0] += 1
    try:
        yield
    finally:
        _inside[0] -= 1


def load_signatures() -> dict:
    return json.loads(SIGNATURES_PATH.read_text())


class RecordedDefault:
    """A default recorded as an expression that cannot be evaluated here (e.g. MlaVersion.V32.value)."""

    def __init__(self, expr: str):
        self.expr = expr

    def __repr__(self) -> str:
        return self.expr


def recorded_signature(record: dict) -> inspect.Signature:
    kinds = {"positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
             "keyword_only": inspect.Parameter.KEYWORD_ONLY}
    params = []
    for p in record["params"]:
        if p["default"] is None:
            default = inspect.Parameter.empty
        else:
            try:
                default = ast.literal_eval(p["default"])
            except (ValueError, SyntaxError):
                default = RecordedDefault(p["default"])
        params.append(inspect.Parameter(p["name"], kinds[p["kind"]], default=default))
    return inspect.Signature(params)


@dataclass
class Recorded:
    """A tensor argument as the stand-in saw it; a copy of its values when small. Keeps no reference to it (a
    recorded call must not keep the caller's buffers alive)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    contiguous: bool
    data_ptr: int
    value: torch.Tensor | None

    @classmethod
    def of(cls, x):
        if not isinstance(x, torch.Tensor):
            return x
        small = x.numel() <= 4096
        return cls(tuple(x.shape), x.dtype, tuple(x.stride()), x.is_contiguous(), x.data_ptr(),
                   x.detach().clone() if small else None)


@dataclass
class Call:
    name: str
    n_positional: int
    keywords: tuple[str, ...]
    arguments: dict  # name -> the value, tensors as Recorded


def _expect(cond: bool, exc: type[Exception], msg: str) -> None:
    if not cond:
        raise exc(msg)


def _is_int(x) -> bool:
    return type(x) is int  # compiled ops reject numpy/torch integers (and we never pass bools for ints)


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check_index(t, name: str, length: int | None = None) -> None:
    _expect(isinstance(t, torch.Tensor), TypeError, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _expect(t.dtype == torch.int32, RuntimeError, f"{name} must be int32, got {t.dtype}")
    _expect(t.dim() == 1 and t.stride(0) == 1, RuntimeError, f"{name} must be 1-D with stride 1")
    if length is not None:
        _expect(t.shape[0] == length, RuntimeError, f"{name}: expected {length} entries, got {t.shape[0]}")


def _shape(spec) -> tuple[int, ...]:
    return (spec,) if isinstance(spec, int) else tuple(spec)


class StandinAiter:
    """One stand-in aiter: its modules, the calls it received, and its "device memory" registry."""

    def __init__(self, version: str, arch: str = "gfx950", functions: dict | None = None, cu_count: int = CU_COUNT,
                 round_p_to_fp8: bool = False, mask_shift: int = 0):
        self.version = version
        self.newest = version == "NEWEST"
        self.modelled = version in MODELLED
        self.functions = functions if functions is not None else load_signatures()[VERSIONS[version]]["functions"]
        self.fp8 = FP8_BY_ARCH[arch]
        self.cu_count = cu_count
        self.round_p_to_fp8 = round_p_to_fp8  # aiter's own torch model rounds the unnormalised P to fp8
        self.mask_shift = mask_shift  # a negative control: the causal limit moved by this many rows (0: aiter's)
        self.calls: list[Call] = []
        self.stats = {"work_direct": 0, "work_split": 0, "work_empty": 0, "metadata_fills": 0}
        self.launches: list[str] = []  # every kernel the stand-in GPU ran, by name, in order
        self._walked_fill = None  # the metadata fill whose work list the last persistent stage 1 walked
        self._partials_written = None  # (splitData address, splitLse address, slots written, fill) of that stage 1
        self._buffers: dict[int, tuple[weakref.ref, str, int]] = {}  # address -> (tensor, role, fill id)
        self._fill_id = 0
        self.modules = self._build_modules()

    # --- installation ---------------------------------------------------------------------------------------

    def install(self, monkeypatch) -> StandinAiter:
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def calls_to(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def _build_modules(self) -> dict[str, types.ModuleType]:
        root = types.ModuleType("aiter")
        root.__version__ = f"stand-in of {self.version}"
        root.__file__ = __file__
        root.__path__ = []  # a package with nothing on disk: `aiter.utility` and the like do not exist
        modules = {"aiter": root}
        for name in ("aiter.mla", "aiter.ops", "aiter.ops.attention", "aiter.dtypes"):
            modules[name] = types.ModuleType(name)
        root.mla, root.ops, root.dtypes = modules["aiter.mla"], modules["aiter.ops"], modules["aiter.dtypes"]
        modules["aiter.ops"].attention = modules["aiter.ops.attention"]
        dtypes = modules["aiter.dtypes"]
        dtypes.fp8, dtypes.bf16, dtypes.fp16, dtypes.fp32 = self.fp8, torch.bfloat16, torch.float16, torch.float32
        dtypes.i32, dtypes.u8 = torch.int32, torch.uint8
        impls = {"mla_decode_fwd": self._mla_decode_fwd, "get_mla_metadata_info_v1": self._metadata_info,
                 "get_mla_metadata_v1": self._metadata}
        for name, record in self.functions.items():
            impl = impls.get(name) if self.modelled else None
            fn = self._recorded_function(name, record, impl)
            for path in record["exported_as"]:
                module_name, _, attr = path.rpartition(".")
                if module_name in modules:
                    setattr(modules[module_name], attr, fn)
        return modules

    def _recorded_function(self, name: str, record: dict, impl):
        sig = recorded_signature(record)

        def fn(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # the TypeError the real function would raise
            bound.apply_defaults()
            with _standin_running():
                arguments = {k: Recorded.of(v) for k, v in bound.arguments.items()}
                self.calls.append(Call(name, len(args), tuple(kwargs), arguments))
                if impl is None:
                    raise NotImplementedError(f"stand-in {self.version}: {name} is not modelled for this version")
                return impl(**bound.arguments)

        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = record["module"]
        fn.__signature__ = sig
        return fn

    # --- get_mla_metadata_info_v1 -----------------------------------------------------------------------------

    def _metadata_info(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True,
                       num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
        for name, value in (("batch_size", batch_size), ("max_seqlen_qo", max_seqlen_qo),
                            ("num_head_qo", num_head_qo), ("num_kv_splits", num_kv_splits)):
            _expect(_is_int(value), TypeError, f"get_mla_metadata_info_v1: {name} must be a Python int")
        _expect(isinstance(q_dtype, torch.dtype) and isinstance(kv_dtype, torch.dtype), TypeError,
                "get_mla_metadata_info_v1: q_dtype and kv_dtype must be torch dtypes")
        assert num_head_qo % (8 if self.newest else 16) == 0, f"{num_head_qo=} not supported"
        s = self.cu_count
        nh = num_head_qo
        tiles = math.ceil(max_seqlen_qo * nh / 128) if nh == 16 else math.ceil(max_seqlen_qo * nh / 16)
        b = batch_size * (max_seqlen_qo if is_sparse else 1)
        tile_cnt = b * tiles
        _expect(fast_mode, NotImplementedError, "stand-in: only fast_mode=True (the v1.2 split) is modelled")
        max_work, max_split_tiles = (b + s - 1) * tiles, min(b + s - 1, 2 * (s - 1)) * tiles
        if intra_batch_mode:
            max_work = max_split_tiles = tile_cnt * num_kv_splits
        return ((2, torch.uint64), (s + 1, torch.int32), ((max_work, WORK_ROW), torch.int32),
                (tile_cnt + 1, torch.int32), ((tile_cnt, 2), torch.int32), (max_split_tiles, torch.int32))

    # --- get_mla_metadata_v1 ----------------------------------------------------------------------------------

    def _metadata(self, seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
                  is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                  reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1,
                  fast_mode=True, topk=-1, max_split_per_batch=-1, intra_batch_mode=False, dtype_q=None,
                  dtype_kv=None, **newer):
        _check_index(seqlens_qo_indptr, "seqlens_qo_indptr")
        batch = seqlens_qo_indptr.shape[0] - 1
        _check_index(seqlens_kv_indptr, "seqlens_kv_indptr", batch + 1)
        _check_index(kv_last_page_lens, "kv_last_page_lens", batch)
        for name, value in (("num_heads_per_head_k", num_heads_per_head_k), ("num_heads_k", num_heads_k),
                            ("page_size", page_size), ("kv_granularity", kv_granularity),
                            ("max_seqlen_qo", max_seqlen_qo), ("uni_seqlen_qo", uni_seqlen_qo), ("topk", topk),
                            ("max_split_per_batch", max_split_per_batch)):
            _expect(_is_int(value), TypeError, f"get_mla_metadata_v1: {name} must be a Python int, got {value!r}")
        _expect(isinstance(is_causal, bool), TypeError, "get_mla_metadata_v1: is_causal must be a bool")
        _expect(_power_of_two(page_size) and _power_of_two(kv_granularity), RuntimeError,
                "get_mla_metadata_v1: page_size and kv_granularity must be powers of 2")
        known = (self.fp8, torch.bfloat16, torch.float16)
        for name, dt in (("dtype_q", dtype_q), ("dtype_kv", dtype_kv)):
            if self.newest:
                assert dt is None or dt in known, f"Unsupported dtype {dt}"
            else:
                _expect(dt is None or isinstance(dt, torch.dtype), TypeError, f"{name} must be a torch dtype")
        if not (fast_mode and num_heads_k == 1 and num_heads_per_head_k == NUM_HEADS
                and max_seqlen_qo in (1, -1) and uni_seqlen_qo in (1, -1) and topk < 0
                and not newer.get("is_cp_round_robin", False)):
            raise NotImplementedError("stand-in: only the v1.2 (fast_mode=True) split of a 16-head, "
                                      "one-query-per-sequence decode is modelled")
        buffers = {"work_metadata_ptrs": work_metadata_ptrs, "work_indptr": work_indptr,
                   "work_info_set": work_info_set, "reduce_indptr": reduce_indptr,
                   "reduce_final_map": reduce_final_map, "reduce_partial_map": reduce_partial_map}
        specs = self._metadata_info(batch, 1, NUM_HEADS, dtype_q or self.fp8, dtype_kv or self.fp8, False,
                                    fast_mode, 32, intra_batch_mode)
        for (role, t), (shape, dtype) in zip(buffers.items(), specs, strict=True):
            _expect(isinstance(t, torch.Tensor), TypeError, f"get_mla_metadata_v1: {role} must be a tensor")
            _expect(t.dtype == dtype and tuple(t.shape) == _shape(shape) and t.is_contiguous(), RuntimeError,
                    f"get_mla_metadata_v1: {role} is {t.dtype} {tuple(t.shape)}, get_mla_metadata_info_v1 says "
                    f"{dtype} {_shape(shape)} for batch {batch}")

        qo = seqlens_qo_indptr.tolist()  # the stand-in's "device" reads
        _expect(qo == list(range(batch + 1)), NotImplementedError, "stand-in: one query per sequence only")
        kvp = seqlens_kv_indptr.tolist()
        pages = [b - a for a, b in zip(kvp[:-1], kvp[1:], strict=True)]
        last = kv_last_page_lens.tolist()
        items, slots = self._split(pages, kv_granularity, specs[2][0][0], _shape(specs[5][0])[0])

        work_indptr.copy_(torch.tensor([len(items) * i // self.cu_count for i in range(self.cu_count + 1)],
                                       dtype=torch.int32))
        rows = torch.full((work_info_set.shape[0], WORK_ROW), -1, dtype=torch.int32)
        for i, (b, start, end, slot) in enumerate(items):
            left = pages[b] - end
            kv_offset = (left - 1) * page_size + last[b] if left > 0 else 0  # tokens after kv_end
            rows[i] = torch.tensor([b, slot, qo[b], qo[b + 1], kvp[b] + start, kvp[b] + end, kv_offset, 0])
        work_info_set.copy_(rows)
        reduce_indptr.zero_()
        reduce_partial_map.fill_(-1)
        for b in range(batch):
            mine = slots.get(b, [])
            reduce_indptr[b + 1] = reduce_indptr[b] + len(mine)
            reduce_final_map[b] = torch.tensor([qo[b], qo[b + 1]], dtype=torch.int32)
            if mine:
                start = int(reduce_indptr[b])
                reduce_partial_map[start:start + len(mine)] = torch.tensor(mine, dtype=torch.int32)
        self._fill_id += 1
        for role, t in buffers.items():
            self._buffers[t.data_ptr()] = (weakref.ref(t), role, self._fill_id)
        work_metadata_ptrs.view(torch.int64).copy_(
            torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()], dtype=torch.int64))
        self.stats["metadata_fills"] += 1
        self._launch("get_mla_metadata_v1")

    def _split(self, pages: list[int], granularity: int, max_work: int, max_partials: int):
        """Work items (batch, start page, end page, partial slot or -1) over the CUs, and each split batch's
        partial slots. A batch longer than the per-CU budget is cut into granularity-aligned chunks."""
        total = sum(pages)
        budget = max(granularity, -(-math.ceil(total / self.cu_count) // granularity) * granularity)
        while True:
            items, slots, next_slot = [], {}, 0
            for b, n in enumerate(pages):
                chunks = [(lo, min(lo + budget, n)) for lo in range(0, n, budget)] or [(0, 0)]
                for lo, hi in chunks:
                    slot = -1
                    if len(chunks) > 1:
                        slot, next_slot = next_slot, next_slot + 1
                        slots.setdefault(b, []).append(slot)
                    items.append((b, lo, hi, slot))
            if len(items) <= max_work and next_slot <= max_partials:
                return items, slots
            budget *= 2

    # --- mla_decode_fwd, and the stage 1 kernel and reduce it launches ----------------------------------------

    def _launch(self, kernel: str) -> None:
        self.launches.append(kernel)

    def _deref(self, address: int, role: str):
        entry = self._buffers.get(address)
        tensor = entry[0]() if entry is not None else None
        if tensor is None or entry[1] != role or tensor.data_ptr() != address:
            raise RuntimeError(f"memory fault: work_meta_data holds the address of a {role} that is no longer alive "
                               "(the six metadata buffers must be kept alive together)")
        return tensor, entry[2]

    def _mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                        page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                        num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
                        reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                        kv_scale=None, intra_batch_mode=False, return_logits=False, return_lse=False, **newer):
        # Python level (aiter/mla.py)
        assert logit_cap <= 0, f"{logit_cap=} is not support yet"
        if kv_buffer.dtype != torch.uint8:
            _, _, _, qk_head_dim = kv_buffer.shape  # ValueError unless 4-D
        else:
            raise NotImplementedError("stand-in: byte KV is not modelled")
        if sm_scale is None:
            sm_scale = 1.0 / (qk_head_dim**0.5)
        total_s, nhead, v_head_dim = o.shape  # ValueError unless 3-D
        persistent = work_meta_data is not None
        if persistent and (nhead != NUM_HEADS or max_seqlen_q != 1):
            raise NotImplementedError("stand-in: persistent mode is modelled for 16 heads with max_seqlen_q 1 only "
                                      "(RUNNER's split can leave a tail of fewer than max_seqlen_q rows: NaN, fixed "
                                      "in b564a7367b; the persistent 128-head kernels differ between commits)")
        if not persistent and nhead not in (NUM_HEADS, 128):
            raise NotImplementedError("stand-in: non-persistent mode is modelled for 16 and 128 heads only")
        for name, value in (("cp_world_size", 1), ("g_kv_indptr", None)):
            _expect(newer.get(name, value) == value, NotImplementedError, f"stand-in: {name} is not modelled")
        # NEWEST's causal flag (default True) picks the masked kernels; the unmasked (msk0) ones are not modelled
        _expect(newer.get("causal", True) is True or max_seqlen_q == 1, NotImplementedError,
                "stand-in: causal=False (the msk0 kernels) is not modelled")
        device = q.device
        stage1_args = (q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, num_kv_splits_indptr)
        if work_meta_data is None:  # non-persistent
            if num_kv_splits is None or num_kv_splits_indptr is None:
                raise NotImplementedError("stand-in: get_meta_param's split heuristic is not modelled: pass "
                                          "num_kv_splits and num_kv_splits_indptr")
            self._kernel(q.dtype, kv_buffer.dtype, False, max_seqlen_q, nhead // nhead_kv)  # stage 1's lookup
            if not (num_kv_splits == 1 and q.dtype == self.fp8):
                raise NotImplementedError("stand-in: non-persistent mode is modelled for FP8 Q with one split only "
                                          "(stage 1 alone writes o; otherwise a Triton stage 2 follows)")
            logits = o.view((total_s, num_kv_splits, nhead, v_head_dim))  # bf16: stage 1 writes o itself
            attn_lse = torch.empty((total_s, num_kv_splits, nhead, 1), dtype=torch.float32, device=device)
            if self.newest:
                self._launch("fill valid_split_count")  # torch.full((bs,), num_kv_splits) before stage 1
            self._stage1(*stage1_args, None, None, None, max_seqlen_q, page_size, nhead_kv, sm_scale, logits,
                         attn_lse, o, q_scale=q_scale, kv_scale=kv_scale)
            return logits.view(total_s, nhead, v_head_dim), attn_lse
        partials = reduce_partial_map.size(0)  # AttributeError when None, as in aiter
        if num_kv_splits_indptr is not None:
            raise NotImplementedError("stand-in: num_kv_splits_indptr with work_meta_data makes the C++ run the "
                                      "non-persistent kernel over persistent buffers, which is not modelled")
        logits = torch.empty((partials * max_seqlen_q, 1, nhead, v_head_dim), dtype=torch.float32, device=device)
        attn_lse = torch.empty((partials * max_seqlen_q, 1, nhead, 1), dtype=torch.float32, device=device)
        final_lse = torch.empty((total_s, nhead), dtype=torch.float32, device=device) if return_lse else None
        self._stage1(*stage1_args, work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv,
                     sm_scale, logits, attn_lse, o, q_scale=q_scale, kv_scale=kv_scale)
        self._reduce(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map, max_seqlen_q, o,
                     final_lse, num_kv_splits=num_kv_splits)
        return logits, final_lse

    def _kernel(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, persistent: bool, max_seqlen_q: int,
                gqa: int = NUM_HEADS) -> str:
        """get_heuristic_kernel_mla (csrc/py_itfs_cu/asm_mla.cu, RUNNER): 128 heads look up qSeqLen 0; for 16 heads
        bf16 Q in persistent mode pads max_seqlen_q 1-4 to 4 for the lookup only (the kernel still gets max_seqlen_q,
        so Q is not padded), FP8 Q looks up 1, 2, and 4 for 3 or 4, and refuses more than 4."""
        names = {torch.bfloat16: "bf16", self.fp8: "fp8"}
        q_type, kv_type = names.get(q_dtype), names.get(kv_dtype)
        _expect(q_type is not None, TypeError, f"Q dtype must be bf16 or aiter.dtypes.fp8 ({self.fp8}), got {q_dtype}")
        _expect(kv_type is not None, TypeError,
                f"KV dtype must be bf16 or aiter.dtypes.fp8 ({self.fp8}), got {kv_dtype}")
        if gqa == 128:
            looked_up = 0
        elif q_type == "bf16":
            looked_up = 4 if persistent and max_seqlen_q <= 4 else max_seqlen_q
        else:
            _expect(max_seqlen_q <= 4, RuntimeError, "mla_decode_stage1_asm_fwd:only support fp8 mla decoding for "
                                                     "qo_len <= 4")
            looked_up = 4 if max_seqlen_q == 3 else max_seqlen_q
        kernel = GFX950_KERNELS.get((q_type, kv_type, gqa, int(persistent), looked_up))
        _expect(kernel is not None, RuntimeError, f"get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:"
                f"{q_type} kv_type:{kv_type} gqa:{gqa} ps:{int(persistent)} qseqlen:{looked_up}")
        return kernel

    def _stage1(self, Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens, num_kv_splits_indptr,
                work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv, softmax_scale,
                splitData, splitLse, output, q_scale=None, kv_scale=None):
        """mla_decode_stage1_asm_fwd: the C++ checks, the kernel lookup, then the kernel. Persistent (no
        num_kv_splits_indptr): walks the work list through the addresses in work_meta_data; unsplit work goes to
        `output` as bf16, split work to splitData/splitLse (fp32) at its partial slot. Non-persistent with one
        split: one workgroup per sequence writes `output`, reading kv_last_page_lens. Called by mla_decode_fwd only,
        with the partials it allocates."""
        for name, value in (("max_seqlen_q", max_seqlen_q), ("page_size", page_size), ("nhead_kv", nhead_kv)):
            _expect(_is_int(value), TypeError, f"mla_decode_stage1_asm_fwd: {name} must be a Python int, "
                                               f"got {type(value).__name__}")
        sm_ok = isinstance(softmax_scale, float) or (self.newest and isinstance(softmax_scale, int))
        _expect(sm_ok and not isinstance(softmax_scale, bool), TypeError,
                f"mla_decode_stage1_asm_fwd: softmax_scale must be a Python float, got {type(softmax_scale).__name__}")
        _expect(_power_of_two(page_size), RuntimeError, "page_size must be a power of 2")
        _expect(Q.is_contiguous(), RuntimeError, "Q must be contiguous")
        total_s, nhead, v_head_dim = output.shape
        _expect(Q.dim() == 3 and Q.shape[0] == total_s and Q.shape[1] == nhead, RuntimeError,
                f"Q must be (total_q, nhead, dim) like o, got {tuple(Q.shape)}")
        persistent = num_kv_splits_indptr is None
        kernel = self._kernel(Q.dtype, KV.dtype, persistent, max_seqlen_q, nhead // max(nhead_kv, 1))
        _expect(nhead_kv == 1 and KV.dim() == 4 and KV.shape[2] == 1, RuntimeError, "nhead_kv must be 1")
        _expect(Q.shape[2] == KV.shape[3] == QK_HEAD_DIM and v_head_dim == V_HEAD_DIM, RuntimeError,
                "Q.size(2) must equal KV.size(3) = 576 and o's last dim 512")
        _expect(output.dtype == torch.bfloat16 and output.is_contiguous(), RuntimeError, "o must be contiguous bf16")
        if Q.dtype == self.fp8:
            _expect(q_scale is not None and kv_scale is not None, RuntimeError,
                    "fp8 Q requires q_scale and kv_scale (RUNNER: a no-op assert, then a null pointer read)")
        for name, s in (("q_scale", q_scale), ("kv_scale", kv_scale)):
            if s is not None:
                _expect(isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.numel() >= 1, TypeError,
                        f"{name} must be a float32 tensor (a {getattr(s, 'dtype', type(s))} is misread)")
        batch = qo_indptr.shape[0] - 1
        _check_index(qo_indptr, "qo_indptr")
        _check_index(kv_indptr, "kv_indptr", batch + 1)
        _check_index(kv_page_indices, "kv_indices")
        _check_index(kv_last_page_lens, "kv_last_page_lens", batch)

        q_mult = float(q_scale.reshape(-1)[0]) if Q.dtype == self.fp8 else 1.0  # only element 0 is read
        kv_mult = float(kv_scale.reshape(-1)[0]) if (kv_scale is not None and KV.dtype == self.fp8) else 1.0
        scale = softmax_scale * q_mult * kv_mult
        qf = Q.float()
        if persistent:
            rows = self._work_list(work_meta_data, work_indptr, work_info_set)
        else:
            _expect(splitData.shape[1] == 1, NotImplementedError, "stand-in: one split per sequence only")
            splits = num_kv_splits_indptr.tolist()
            _expect(splits == list(range(batch + 1)), NotImplementedError,
                    "stand-in: num_kv_splits_indptr must give every sequence one split")
            kvp, last, qo = kv_indptr.tolist(), kv_last_page_lens.tolist(), qo_indptr.tolist()
            _expect(all(n == 1 for n in last), NotImplementedError,
                    "stand-in: the non-persistent kernel reads kv_last_page_lens; only ones (page size 1) modelled")
            # the kernel finds sequence b's tokens at b x stride_Q, stride_Q = Q.stride(0) x max_seqlen_q (asm_mla.cu)
            _expect(qo == [b * max_seqlen_q for b in range(batch + 1)] and total_s == batch * max_seqlen_q,
                    NotImplementedError, f"stand-in: the non-persistent kernel takes max_seqlen_q = {max_seqlen_q} "
                    f"query rows a sequence; qo_indptr {qo[:6]}... with {total_s} rows is not modelled")
            rows = [(b, -1, qo[b], qo[b + 1], kvp[b], kvp[b + 1]) for b in range(batch)]
        self._launch(kernel)
        written = set()
        for _batch, slot, q0, q1, k0, k1 in rows:
            out, part_lse = self._attend(qf[q0:q1], KV, kv_page_indices, k0, k1, scale, kv_mult, v_head_dim,
                                         1 if persistent else max_seqlen_q)
            if slot < 0:
                output[q0:q1] = out.to(output.dtype)
                self.stats["work_direct"] += 1
            else:
                r0, r1 = slot * max_seqlen_q, (slot + 1) * max_seqlen_q
                _expect(r1 <= splitData.shape[0] and r1 <= splitLse.shape[0], RuntimeError,
                        f"memory fault: partial slot {slot} lies past splitData ({splitData.shape[0]} rows)")
                splitData[r0:r1, 0] = out
                splitLse[r0:r1, 0] = part_lse
                written.add(slot)
                self.stats["work_split"] += 1
        if persistent:
            self._partials_written = (splitData.data_ptr(), splitLse.data_ptr(), written, self._walked_fill)

    def _work_list(self, work_meta_data, work_indptr, work_info_set) -> list[tuple]:
        """The persistent kernel's work list, read through the addresses in work_meta_data, as the kernel does."""
        _expect(work_meta_data.dtype == torch.uint64 and work_meta_data.numel() == 2, RuntimeError,
                "work_meta_data must be the (2,) uint64 buffer")
        addr_indptr, addr_info = work_meta_data.view(torch.int64).tolist()
        work_indptr_seen, fill = self._deref(addr_indptr, "work_indptr")
        work_info_seen, fill_info = self._deref(addr_info, "work_info_set")
        if work_indptr_seen.data_ptr() != work_indptr.data_ptr() or work_info_seen.data_ptr() != \
                work_info_set.data_ptr() or fill_info != fill:
            raise RuntimeError("mixed metadata: work_meta_data points at a work list other than the work_indptr / "
                               "work_info_set passed")
        self._walked_fill = fill
        bounds = work_indptr_seen.tolist()
        return [tuple(r[:6]) for r in work_info_seen[:bounds[-1]].tolist()]

    def _attend(self, qf, kv_buffer, indices, k0, k1, scale, kv_mult, v_head_dim, q_len=1):
        """fp32 attention of the query rows qf over KV rows kv_indices[k0:k1] -> (out, lse). Page size 1 only: each
        index is the row at page_id x page stride, no in-page offset whatever page_size says. No rows: NaN. With
        q_len > 1 (the non-persistent kernels here: qf is one sequence's q_len tokens) the mask is causal and
        bottom-right: token t sees the first n - q_len + 1 + t of the n rows, as aiter's op_tests reference masks
        (tril(diagonal = n - q_len)); a token that sees none: NaN, the pessimistic assumption."""
        _expect(0 <= k0 <= k1 <= indices.shape[0], RuntimeError,
                f"memory fault: a work item reads kv_indices[{k0}:{k1}] of {indices.shape[0]}")
        page_ids = indices[k0:k1].long()
        _expect(bool(((page_ids >= 0) & (page_ids < kv_buffer.shape[0])).all()), RuntimeError,
                "memory fault: a kv_indices entry lies outside kv_buffer")
        keys = kv_buffer[page_ids, 0, 0].float()  # (n, 576) raw FP8 (or bf16) values
        if keys.shape[0] == 0:
            self.stats["work_empty"] += 1
            return (torch.full((qf.shape[0], qf.shape[1], v_head_dim), torch.nan),
                    torch.full((qf.shape[0], qf.shape[1], 1), torch.nan))
        s = torch.einsum("qhd,nd->qhn", qf, keys) * scale
        if q_len > 1:
            _expect(qf.shape[0] == q_len, NotImplementedError, "stand-in: a causal tile is one sequence's tokens")
            n = keys.shape[0]
            limit = n - q_len + 1 + torch.arange(q_len) + self.mask_shift
            visible = torch.arange(n)[None, :] < limit[:, None]  # (q_len, n)
            s = s.masked_fill(~visible[:, None, :], -torch.inf)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        if self.round_p_to_fp8:
            p = p.to(self.fp8).float()
        return torch.einsum("qhn,nd->qhd", p, keys[:, :v_head_dim]) / denom * kv_mult, m + torch.log(denom)

    def _reduce(self, partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                max_seqlen_q, final_output, final_lse=None, num_kv_splits=None):
        """mla_reduce_v1, as mla_decode_fwd launches it: merges each tile's partials into final_output by
        log-sum-exp. It reads only the slots the preceding stage 1 wrote into these very buffers, with the work list of
        the same metadata fill (the stand-in faults otherwise: stale or foreign partials would be merged silently on a
        GPU)."""
        _expect(_is_int(max_seqlen_q), TypeError, "mla_reduce_v1: max_seqlen_q must be a Python int")
        _expect(num_kv_splits is None or _is_int(num_kv_splits), TypeError,
                "mla_reduce_v1: num_kv_splits must be a Python int")
        for role, t in (("reduce_indptr", reduce_indptr), ("reduce_final_map", reduce_final_map),
                        ("reduce_partial_map", reduce_partial_map)):
            _expect(t.dtype == torch.int32 and t.is_contiguous(), RuntimeError, f"{role} must be contiguous int32")
            entry = self._buffers.get(t.data_ptr())
            written = self._partials_written
            if entry is None or entry[0]() is None or entry[1] != role or written is None or entry[2] != written[3]:
                raise RuntimeError(f"mixed metadata: {role} was not filled together with the work list stage 1 "
                                   "walked")
        self._launch("mla_reduce_v1")
        ri, rfm, rpm = reduce_indptr.tolist(), reduce_final_map.tolist(), reduce_partial_map.tolist()
        for t in range(len(ri) - 1):
            locs = rpm[ri[t]:ri[t + 1]]
            if not locs:
                continue
            _expect(written[:2] == (partial_output.data_ptr(), partial_lse.data_ptr()) and set(locs) <= written[2],
                    RuntimeError, f"mla_reduce_v1 reads partial slots {locs} that stage 1 did not write there")
            q0, q1 = rfm[t]
            parts = torch.stack([partial_output[loc:loc + (q1 - q0), 0] for loc in locs])  # (k, q, h, 512)
            lses = torch.stack([partial_lse[loc:loc + (q1 - q0), 0] for loc in locs])  # (k, q, h, 1)
            weights = torch.softmax(lses, dim=0)
            final_output[q0:q1] = (weights * parts).sum(dim=0).to(final_output.dtype)
            if final_lse is not None:
                final_lse[q0:q1] = torch.logsumexp(lses, dim=0)[..., 0]


def make(lengths: list[int], seed: int, kv_seq_len="as generated", fp8: torch.dtype = torch.float8_e4m3fn):
    """The input the aiter tests run: reference.generate_varlen_input on the CPU; optionally another config
    kv_seq_len or the gfx942 FP8 (e4m3fnuz) cache."""
    data = reference.generate_varlen_input(lengths, seed, device=torch.device("cpu"))
    q, kv_data, qo_indptr, kv_indptr, config = data
    if fp8 != torch.float8_e4m3fn:
        kv_data = dict(kv_data, fp8=reference.quantize_fp8(kv_data["bf16"], fp8))
    if kv_seq_len != "as generated":
        config = dict(config, kv_seq_len=kv_seq_len)
    return q, kv_data, qo_indptr, kv_indptr, config


class HostReadsForbidden(TorchFunctionMode):
    """Fails on anything that reads a tensor on the host (a device sync on a GPU), outside the stand-in."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS and not inside_standin():
            raise AssertionError(f"host read (a device sync on a GPU): {func}")
        return func(*args, **(kwargs or {}))


def modified(version: str, function: str, edit) -> dict:
    """The recorded functions of `version` with edit(params) applied to `function`'s parameter list: a signature the
    backend must refuse or work around."""
    functions = copy.deepcopy(load_signatures()[VERSIONS[version]]["functions"])
    edit(functions[function]["params"])
    return functions


def drop(*names):
    """An edit for modified(): the parameters `names` removed."""
    return lambda params: params.__setitem__(slice(None), [p for p in params if p["name"] not in names])
