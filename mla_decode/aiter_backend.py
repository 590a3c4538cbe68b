"""The aiter backend (AMD): FP8 Q x FP8 KV through ROCm/aiter's MLA decode, for the (q_len, heads) shapes of
AITER_SHAPES: 16 heads with one query token (the leaderboard's; three variants), and 16 heads with 2 or 4 causal query
tokens (MTP) and 128 heads with 1 or 2, each through aiter's non-persistent kernel with one split per sequence. It
hands aiter token indices at page size 1 whatever the cache's page size: on gfx950 aiter's MLA decode kernels ignore
the page size (docs/aiter-contract.md), so a paged cache is expanded to its tokens on the device. aiter returns no
LSE here: a call that asks for one goes to another backend. Every fact it relies on in aiter is in
docs/aiter-contract.md; it has run only against the stand-in of tests/aiter_standin.py.
"""

import functools
from typing import NamedTuple

import torch

from .contract import (
    NUM_KV_HEADS,
    PLAN_CACHE_LIMIT,
    QK_HEAD_DIM,
    V_HEAD_DIM,
    Problem,
    expect,
    log,
    remember,
)
from .triton.common import TritonTarget, round_to_e4m3, tl, triton, triton_interpreted, triton_target

AITER_HEADS = 16  # the qh16 kernels: the leaderboard's shape, q_len AITER_Q_LEN, runs every variant
AITER_Q_LEN = 1
# (q_len, heads) -> the FP8 Q x FP8 KV kernel aiter runs for it here (hsa/gfx950/mla/mla_asm.csv, picked in
# csrc/py_itfs_cu/asm_mla.cu; the same names in hsa/gfx942/mla/mla_asm.csv). docs/aiter-contract.md, "q_len 2 and 4,
# 128 heads", says why these and no others: every shape but (1, 16) runs AITER_SINGLE_VARIANT, aiter's non-persistent
# stage 1 with one split per sequence, because the runner's persistent split can leave a split of fewer than q_len rows
# (NaN; fixed in aiter b564a7367b, after the runner's commit), and q_len > 1 must be causal: those kernels mask.
AITER_SHAPES = {
    (1, 16): "mla_a8w8_qh16_qseqlen1_gqaratio16_ps",  # persistent (fp8_ps); each variant names its own
    (2, 16): "mla_a8w8_qh16_qseqlen2_gqaratio16",
    (4, 16): "mla_a8w8_qh64_qseqlen4_gqaratio16",  # 4 tokens x 16 heads in one 64-row tile
    (1, 128): "mla_a8w8_qh128_m32x4_n16x2_msk1",
    (2, 128): "mla_a8w8_qh128_m32x4_n16x2_msk1",  # one 128-row tile per token
}
AITER_SINGLE_VARIANT = "fp8_nps"  # the only variant of a shape other than (AITER_Q_LEN, AITER_HEADS)


@functools.cache
def aiter_importable() -> bool:  # cached: a failed import searches sys.path again on every call
    try:
        import aiter  # noqa: F401
    except ImportError:
        return False
    return True


def aiter_unusable_reason(problem: Problem) -> str | None:
    """None when the aiter backend takes this problem (aiter importable, the FP8 cache, the fast mode, a (q_len,
    heads) of AITER_SHAPES, causal where q_len > 1, no LSE asked), else why not; its signatures are checked when a
    plan is made (_aiter_api)."""
    if not aiter_importable():
        return "the aiter package (ROCm/aiter, built from source) is not importable"
    if problem.precision == "precise":
        return "aiter's kernels take FP8 Q (no precise mode); use precision='fast'"
    if problem.kv_format != "fp8":
        return f"aiter reads the FP8 cache only, not {problem.kv_format} (the triton backend reads the others)"
    if (problem.q_len, problem.num_heads) not in AITER_SHAPES:
        return (f"aiter backend: serves q_len 1, 2 or 4 with 16 heads and q_len 1 or 2 with 128 heads (aiter's FP8 "
                f"decode kernels whose masking and layout its sources establish), not q_len {problem.q_len} with "
                f"{problem.num_heads} heads; other multiples of 16 heads aiter folds into 16-head groups only in its "
                "persistent path at q_len 1, not mapped here (docs/aiter-contract.md)")
    if problem.q_len > 1 and not problem.causal:
        return (f"aiter backend: aiter's q_len {problem.q_len} decode kernels mask causally (the runner's aiter has no "
                "unmasked one); pass causal=True or use another backend")
    if problem.return_lse:
        return "aiter backend: its decode calls here return no LSE; pass return_lse=False"
    return None


def compute_units(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def aiter_auto_reason(problem: Problem) -> str | None:
    """aiter_unusable_reason, and for auto also: the leaderboard's shapes that AITER_VARIANTS sends to the triton
    backend (ROCM_TRITON, keyed by batch and max_seqlen, which the leaderboard adapter sets to the config's
    kv_seq_len); and the one-split shapes (all of AITER_SHAPES but the leaderboard's) where that kernel's grid, a
    workgroup a sequence (a token at 128 heads), is smaller than the GPU's CU count: the triton kernel splits the KV
    across the CUs there. Neither was timed (no AMD GPU has run this project); a grid that leaves most CUs idle is
    the risk avoided."""
    reason = aiter_unusable_reason(problem)
    if reason is not None:
        return reason
    if (problem.q_len, problem.num_heads) == (AITER_Q_LEN, AITER_HEADS):
        if aiter_variant(problem.batch, problem.max_seqlen) == ROCM_TRITON:
            return (f"aiter backend (auto): AITER_VARIANTS runs the triton backend for batch {problem.batch} x "
                    f"{problem.max_seqlen} (backend='aiter' takes it anyway)")
        return None
    workgroups = problem.batch * (problem.q_len if problem.num_heads > AITER_HEADS else 1)
    num_cus = compute_units(problem.device)
    if workgroups < num_cus:
        return (f"aiter backend (auto): its one-split kernel for q_len {problem.q_len} x {problem.num_heads} heads "
                f"runs {workgroups} workgroups on {num_cus} CUs; the triton kernel splits the KV (backend='aiter' "
                "takes it anyway)")
    return None



# The call this backend makes, as (arguments passed by position, arguments passed by keyword) per function. The
# leading arguments go by position the way the official reference calls aiter on the leaderboard's runner, the rest
# by keyword. The version guard (_aiter_api) checks these names against each function's signature before any call.
_AITER_DECODE_ARGS = (
    ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q"),
    ("page_size", "nhead_kv", "sm_scale", "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
     "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale", "intra_batch_mode"))
_AITER_INFO_ARGS = (
    ("batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype"),
    ("is_sparse", "fast_mode", "intra_batch_mode"))
_AITER_METADATA_ARGS = (
    ("seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k", "num_heads_k",
     "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map",
     "reduce_partial_map"),
    ("page_size", "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode", "max_split_per_batch",
     "intra_batch_mode", "dtype_q", "dtype_kv"))
# The other call form (fp8_nps), checked the same way when a plan first needs it (see _aiter_call_form):
# mla_decode_fwd non-persistent, one split per sequence, no work buffers.
_AITER_SINGLE_ARGS = (
    _AITER_DECODE_ARGS[0],
    ("page_size", "nhead_kv", "sm_scale", "num_kv_splits", "num_kv_splits_indptr", "q_scale", "kv_scale",
     "intra_batch_mode"))
AITER_VERSION_NEEDED = ("ROCm/aiter main from 2026-02-02 (commit 739c63177e) or newer, built from source (the "
                        "leaderboard's runner pins f3be04a12a, 2026-03-04); the PyPI wheel amd-aiter 0.1.7.post2.dev18 "
                        "(2025-11) is too old, and so is main between 2026-07-13 (fede90f463) and 2026-07-14 "
                        "(028756633e)")
AITER_KV_GRANULARITY = 16  # KV pages (= tokens at page size 1) per unit of the work split, as the reference uses

# (mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1) -> the problems found in their signatures
# (empty: this call fits). Keyed on the function objects, so an aiter replaced in-process is inspected again.
_AITER_VERDICTS: dict[tuple, tuple[str, ...]] = {}
_AITER_PLANS: dict["AiterKey", "_AiterPlan"] = {}


def _aiter_signature_problems(fn, name: str, args: tuple[tuple[str, ...], tuple[str, ...]]) -> list[str]:
    import inspect

    positional, keywords = args
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a compiled op with no Python signature: nothing to check here
        return []
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return []  # an opaque (*args, **kwargs) wrapper: nothing to check here
    head = tuple(p.name for p in params[:len(positional)])
    if head != positional:
        return [f"{name} takes ({', '.join(head)}, ...) by position where this call passes "
                f"({', '.join(positional)}, ...)"]
    try:
        sig.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        return [f"{name}: {e}"]
    return []


def _aiter_api() -> tuple[tuple, torch.dtype]:
    """((mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1), aiter.dtypes.fp8) of an aiter whose
    signatures take this backend's call; otherwise a RuntimeError naming the aiter version needed, before any kernel
    runs. The verdict is cached per set of functions."""
    import aiter

    try:
        import aiter.mla

        fns = (aiter.mla.mla_decode_fwd, aiter.get_mla_metadata_info_v1, aiter.get_mla_metadata_v1)
        fp8 = aiter.dtypes.fp8
    except (ImportError, AttributeError) as e:
        fns, fp8, problems = None, None, (f"{type(e).__name__}: {e}",)
    else:
        problems = _AITER_VERDICTS.get(fns)
        if problems is None:
            found = []
            for fn, name, args in zip(
                    fns, ("aiter.mla.mla_decode_fwd", "aiter.get_mla_metadata_info_v1", "aiter.get_mla_metadata_v1"),
                    (_AITER_DECODE_ARGS, _AITER_INFO_ARGS, _AITER_METADATA_ARGS), strict=True):
                found += _aiter_signature_problems(fn, name, args)
            problems = _AITER_VERDICTS[fns] = tuple(found)
    if problems:
        version = getattr(aiter, "__version__", None) or "of unknown version"
        raise RuntimeError(f"aiter backend: the installed aiter ({version}, {getattr(aiter, '__file__', None)}) "
                           f"cannot take this backend's call: {'; '.join(problems)}. It needs {AITER_VERSION_NEEDED}. "
                           "Or run another backend: MLA_BACKEND=triton or MLA_BACKEND=torch.")
    return fns, fp8


class AiterVariant(NamedTuple):
    """One way to run the aiter path. Every variant reads every KV row at page size 1, scales Q dynamically where
    it is FP8, and computes the same attention; they differ in kernels, launches and host work. The persistent
    calls use get_mla_metadata_v1's fast_mode (the v1.2 split): v1.1 sizes its buffers batch x CUs rows, fp32
    partials of 2.1 GB at batch 256 on an MI355X (docs/aiter-contract.md).

      q:         "fp8": Q quantized per tensor on the device (QQuantizer: 2 launches), the a8w8 kernels;
                 "bf16": Q passed as given to the a16w8 persistent kernel, mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps
                 (a 4-row Q tile: the C++ pads max_seqlen_q 1 to 4 to pick it; Q itself is not padded, as in
                 aiter's own op_tests/test_mla_persistent.py, which runs it with (batch, 16, 576) Q at qlen 1)
      call:      "decode_fwd": aiter.mla.mla_decode_fwd, persistent: stage 1 + mla_reduce_v1 (2 launches); aiter
                 allocates the fp32 partials (up to 16.7 MB) on every call;
                 "single": mla_decode_fwd non-persistent with one split per sequence (num_kv_splits=1): with FP8 Q
                 it returns after stage 1, mla_a8w8_qh16_qseqlen1_gqaratio16, which writes o (1 launch; NEWEST
                 adds a fill of its split counts); one workgroup per sequence, so few workgroups at small batch.
                 FP8 Q only: there is no non-persistent a16w8 kernel. An aiter whose signature does not take it
                 runs "decode_fwd" at q_len 1 x 16 heads instead, warned once.
    """

    q: str
    call: str

    @property
    def launches(self) -> int:
        """Kernels per call on the runner's aiter, for a plan whose lengths are proven (every leaderboard input)."""
        return (2 if self.q == "fp8" else 0) + (1 if self.call == "single" else 2)


# name -> variant; launches per call (AiterVariant.launches) in the comments
AITER_VARIANT_SPECS = {
    "fp8_ps": AiterVariant("fp8", "decode_fwd"),  # 4: today's path, the reference's
    "fp8_nps": AiterVariant("fp8", "single"),  # 3: AITER_SINGLE_VARIANT, the only one of the other shapes
    "a16w8_ps": AiterVariant("bf16", "decode_fwd"),  # 2: no Q quantization
}
AITER_DEFAULT_VARIANT = "fp8_ps"  # shapes not in AITER_VARIANTS (a batch of other lengths, kv_seq_len None)
# In AITER_VARIANTS, a shape that auto runs on the triton backend instead of aiter (where a measurement says it wins);
# a forced MLA_BACKEND=aiter runs AITER_DEFAULT_VARIANT there.
ROCM_TRITON = "triton"
_NOT_MEASURED = "default: today's path; no MI355X measurement of the variants exists (bench/aiter_sweep.py makes one)"
# The choice per leaderboard shape on ROCm, (batch, kv_seq_len) -> (variant or ROCM_TRITON, where the choice came
# from). Edit it before submitting (bench/aiter_sweep.py prints a replacement); MLA_AITER_VARIANT=<name> overrides it
# for local runs.
AITER_VARIANTS = {
    (4, 1024): ("fp8_ps", _NOT_MEASURED),
    (4, 8192): ("fp8_ps", _NOT_MEASURED),
    (32, 1024): ("fp8_ps", _NOT_MEASURED),
    (32, 8192): ("fp8_ps", _NOT_MEASURED),
    (64, 1024): ("fp8_ps", _NOT_MEASURED),
    (64, 8192): ("fp8_ps", _NOT_MEASURED),
    (256, 1024): ("fp8_ps", _NOT_MEASURED),
    (256, 8192): ("fp8_ps", _NOT_MEASURED),
}


def aiter_variant(batch: int, kv_seq_len: int | None, forced: str | None = None) -> str:
    """The variant for this shape (or ROCM_TRITON): `forced` if given (the leaderboard adapter's
    MLA_AITER_VARIANT: an aiter variant; the backend is chosen before, by select_backend), else
    AITER_VARIANTS[(batch, kv_seq_len)], else AITER_DEFAULT_VARIANT. Any other name is an error naming where it came
    from."""
    if forced:
        field, name, names = "MLA_AITER_VARIANT", forced, tuple(AITER_VARIANT_SPECS)
    else:
        field, (name, *_) = f"AITER_VARIANTS[{(batch, kv_seq_len)}]", AITER_VARIANTS.get(
            (batch, kv_seq_len), (AITER_DEFAULT_VARIANT,))
        names = tuple(AITER_VARIANT_SPECS) + (ROCM_TRITON,)
    if name not in names:
        raise ValueError(f"{field}: expected one of {names}, got {name!r}")
    return name


def _aiter_call_form(fns: tuple, call: str) -> bool:
    """Whether the installed mla_decode_fwd's signature takes call form `call` (the problems logged once per
    function where not; the plan then runs "decode_fwd", which _aiter_api checked)."""
    if call == "decode_fwd":
        return True
    key = (call, fns[0])
    problems = _AITER_VERDICTS.get(key)
    if problems is None:
        problems = _AITER_VERDICTS[key] = tuple(
            _aiter_signature_problems(fns[0], "aiter.mla.mla_decode_fwd", _AITER_SINGLE_ARGS))
        if problems:
            log.warning("MLA decode: the installed aiter cannot take the %r call form (%s); running "
                        "mla_decode_fwd persistent instead", call, "; ".join(problems))
    return not problems


# Q's dynamic per-tensor FP8 quantization for the aiter path, bit for bit reference.quantize_fp8: scale =
# max(amax|q|, 1e-12) / fp8 max in fp32, q_fp8 = q / scale rounded to nearest even (|q / scale| <= fp8 max x (1 +
# 2^-23) rounds to fp8 max, so the reference's clamp before the cast changes nothing). With triton (a GPU, or the
# interpreter) two small kernels: per 4096-element block its max |q|, then every block reduces those maxima to the
# scale and quantizes itself. Without, torch: vector_norm, then the scale in one addcdiv (amax / fp8 max + 1e-12 /
# fp8 max: the addend is below half an ulp of the quotient whenever the quotient is >= 2^-24, max|q| >= 2.7e-5, and
# the quotient below half an ulp of the addend when max|q| < 4.7e-20, an all-zero q included; in between the scale
# exceeds the reference's by at most 1e-12 / fp8 max), then the division. The triton form is the default because on
# a GPU torch's reduction alone costs more than both triton kernels (bench/q_quant.py times the two forms).
Q_QUANT_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _q_absmax_kernel(q_ptr, partial_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(q_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(partial_ptr + tl.program_id(0), tl.max(tl.abs(x), axis=0))

    @triton.jit
    def _q_quantize_kernel(q_ptr, partial_ptr, num_partials, q8_ptr, scale_ptr, n, fp8_max,
                           BLOCK: tl.constexpr, PARTIALS: tl.constexpr, ROUND_FP8: tl.constexpr):
        parts = tl.load(partial_ptr + tl.arange(0, PARTIALS), mask=tl.arange(0, PARTIALS) < num_partials, other=0.0)
        scale = tl.math.div_rn(tl.maximum(tl.max(parts, axis=0), 1e-12), fp8_max)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.math.div_rn(tl.load(q_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), scale)
        if ROUND_FP8:  # |x| <= 448 (1 + 2^-23), which rounds to 448
            x = round_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
        q8 = x.to(q8_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q8_ptr + offs, q8, mask=offs < n)


class QQuantizer:
    """q (batch, heads, 576) bf16, contiguous (batch: query rows, batch x q_len) -> self.q_fp8 (same shape, `fp8`) and
    self.scale (1,) float32, on the device, into buffers allocated once: q ~= q_fp8 * scale. Calls must be issued in
    order on one queue. The Triton form where it can run (allow_triton=False: the torch form; self.blocks == 0 tells
    which). `target`: the Triton target the kernels are built for (default: triton_target(device) where Triton runs;
    tools/amd_check.py names an AMD one)."""

    def __init__(self, batch: int, fp8: torch.dtype, device: torch.device, allow_triton: bool = True,
                 target: TritonTarget | None = None, heads: int = AITER_HEADS):
        self.q_fp8 = torch.empty((batch, heads, QK_HEAD_DIM), dtype=fp8, device=device)
        self.scale = torch.empty(1, dtype=torch.float32, device=device)
        self.fp8_max = torch.finfo(fp8).max  # 448 for e4m3fn (gfx950), 240 for e4m3fnuz (gfx942)
        if target is None and triton is not None and (device.type == "cuda" or triton_interpreted()):
            target = triton_target(device)
        # The triton kernels for e4m3fn (gfx950) only: e4m3fnuz (gfx942) casts are neither in Triton's interpreter
        # nor on NVIDIA GPUs, so nothing here could test them.
        triton_ok = allow_triton and fp8 == torch.float8_e4m3fn and target is not None
        self.blocks = triton.cdiv(self.q_fp8.numel(), Q_QUANT_BLOCK) if triton_ok else 0
        if self.blocks:
            self.partials = torch.empty(self.blocks, dtype=torch.float32, device=device)
            # BLOCK, PARTIALS, ROUND_FP8 (the interpreter's fp8 cast needs help, see round_to_e4m3)
            self.consts = (Q_QUANT_BLOCK, triton.next_power_of_2(self.blocks), target.vendor == "interpreter")
            self.addresses = (self.partials.data_ptr(), self.q_fp8.data_ptr(), self.scale.data_ptr())
            self.launchers = None  # the compiled kernels' launchers for a 16-byte aligned q (not under the interpreter)
        else:
            self._use_torch()

    def _launch_jit(self, q: torch.Tensor, aligned: bool) -> None:
        """The two kernels through Triton's JIT (compiled at the first call); for an aligned q on a GPU, their
        compiled kernels' launchers are kept, to be called with addresses: the JIT's dispatch, and its launcher's
        data_ptr() call and pointer query per tensor, cost host time on every call."""
        n, grid = self.q_fp8.numel(), (self.blocks, 1, 1)  # compiled kernels take the grid as a 3-tuple
        absmax = _q_absmax_kernel[grid](q, self.partials, n, BLOCK=self.consts[0])
        quantize = _q_quantize_kernel[grid](q, self.partials, self.blocks, self.q_fp8, self.scale, n, self.fp8_max,
                                            BLOCK=self.consts[0], PARTIALS=self.consts[1], ROUND_FP8=self.consts[2])
        if aligned and absmax is not None and quantize is not None:
            self.launchers = (absmax[grid], quantize[grid])

    @property
    def launches(self) -> int:
        """Kernels per call: the triton form's two, or the torch form's three."""
        return 2 if self.blocks else 3

    def _use_torch(self) -> None:
        device = self.q_fp8.device
        self.blocks = 0
        self.amax = torch.empty((), dtype=torch.float32, device=device)
        self.fp8_max_t = torch.full((1,), self.fp8_max, dtype=torch.float32, device=device)
        self.scale_floor = torch.full((1,), 1e-12, dtype=torch.float32, device=device) / self.fp8_max_t

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if self.blocks:
            q_ptr = q.data_ptr()
            try:
                if self.launchers is not None and q_ptr % 16 == 0:  # what the compiled kernels were specialized on
                    absmax, quantize = self.launchers
                    partials, q_fp8, scale = self.addresses
                    n = self.q_fp8.numel()
                    absmax(q_ptr, partials, n, self.consts[0])
                    quantize(q_ptr, partials, self.blocks, q_fp8, scale, n, self.fp8_max, *self.consts)
                else:
                    self._launch_jit(q, q_ptr % 16 == 0)
                return self.q_fp8
            except Exception as e:  # a triton that cannot build or launch them here: the torch form, for good
                log.warning("MLA decode: Q quantization falls back to torch ops: the triton kernels failed: %s", e)
                self._use_torch()
        torch.linalg.vector_norm(q, float("inf"), dtype=torch.float32, out=self.amax)  # max |q|, exact
        torch.addcdiv(self.scale_floor, self.amax, self.fp8_max_t, out=self.scale)
        # fp32 division (the scale is a 1-element tensor, not a 0-dim one: it sets the computation's dtype)
        torch.div(q, self.scale, out=self.q_fp8)
        return self.q_fp8


class _AiterPlan:
    """What one shape of call needs besides its inputs, allocated once, for one variant (AITER_VARIANT_SPECS).
    The six metadata buffers (persistent calls) live and die together here: work_metadata_ptrs holds the raw
    device addresses of work_indptr and work_info_set."""

    __slots__ = ("variant", "call", "q_dtype", "refill", "filled", "metadata", "decode_kwargs", "kv_indices",
                 "kv_last_page_lens", "q_quant", "kv_lens", "empty_rows", "kv_indptr_safe", "cummax_index",
                 "indptr_changed", "invalid", "token_offsets")

    def __init__(self, fns: tuple, fp8: torch.dtype, variant: str, batch: int, total_kv: int, device: torch.device,
                 uniform_len: int | None, q_len: int = AITER_Q_LEN, heads: int = AITER_HEADS):
        spec = AITER_VARIANT_SPECS[variant]
        self.variant = variant
        self.call = spec.call if _aiter_call_form(fns, spec.call) else "decode_fwd"
        if (q_len, heads) != (AITER_Q_LEN, AITER_HEADS) and self.call != "single":
            # persistent q_len > 1 can leave a split shorter than q_len (NaN at the runner's commit), and the
            # persistent 128-head kernels differ between commits: docs/aiter-contract.md
            raise RuntimeError(f"aiter backend: q_len {q_len} with {heads} heads runs only mla_decode_fwd "
                               f"non-persistent (variant {AITER_SINGLE_VARIANT!r}), which the installed aiter does "
                               f"not take (variant {variant!r}, call form {self.call!r})")
        self.q_dtype = fp8 if spec.q == "fp8" else torch.bfloat16
        self.q_quant = QQuantizer(batch * q_len, fp8, device, heads=heads) if spec.q == "fp8" else None
        self.metadata = None
        if self.call == "single":  # one split per sequence
            self.decode_kwargs = {"num_kv_splits": 1, "num_kv_splits_indptr": torch.arange(
                batch + 1, dtype=torch.int32, device=device)}
        else:
            info = fns[1](batch, 1, AITER_HEADS, self.q_dtype, fp8, is_sparse=False, fast_mode=True,
                          intra_batch_mode=False)
            if len(info) != 6:
                raise RuntimeError(f"aiter.get_mla_metadata_info_v1 returned {len(info)} buffer specs, expected 6")
            # (work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map)
            self.metadata = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info)
            self.decode_kwargs = dict(zip(("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                                           "reduce_final_map", "reduce_partial_map"), self.metadata, strict=True))
        # True: the lengths are not proven by the key, run get_mla_metadata_v1 on every call
        self.refill = refill = uniform_len is None
        self.filled = False
        # Page size 1: page b of the cache is token b; the persistent kernels never read the last-page lengths, the
        # non-persistent one does: ones are the honest value.
        self.kv_indices = torch.arange(total_kv, dtype=torch.int32, device=device)  # (total_kv,)
        self.kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)  # (batch,)
        self.kv_lens = torch.empty(batch, dtype=torch.int32, device=device) if refill else None
        # the query tokens that see no KV row, zeroed after the kernel: (batch,) for one token a sequence (empty
        # sequences), (batch, q_len) for causal tokens (token t sees the first length - q_len + 1 + t rows)
        shape = (batch,) if q_len == 1 else (batch, q_len)
        self.empty_rows = torch.empty(shape, dtype=torch.bool, device=device) if refill else None
        # t - (q_len - 1) for the causal tokens t of a sequence: length + this <= 0 sees nothing
        self.token_offsets = torch.arange(1 - q_len, 1, dtype=torch.int32, device=device) if q_len > 1 else None
        # The kv_indptr aiter sees: for a uniform plan the one its key proves, arange(batch + 1) * L, so the plan never
        # depends on a caller's data; otherwise the caller's, clamped into [0, total_kv] and made non-decreasing.
        self.kv_indptr_safe = torch.arange(batch + 1, dtype=torch.int32, device=device) * (uniform_len or 0)
        self.cummax_index = torch.empty(batch + 1, dtype=torch.int64, device=device) if refill else None
        self.indptr_changed = torch.empty(batch + 1, dtype=torch.bool, device=device) if refill else None
        self.invalid = torch.zeros((), dtype=torch.bool, device=device) if refill else None


class AiterKey(NamedTuple):
    """The whole key of an aiter plan (_aiter_plan_key says when a plan may be reused)."""

    fns: tuple  # (mla_decode_fwd, get_mla_metadata_info_v1, get_mla_metadata_v1) of the aiter checked (_aiter_api)
    fp8: torch.dtype  # aiter.dtypes.fp8
    device: torch.device
    q_shape: tuple
    q_dtype: torch.dtype
    kv_shape: tuple
    kv_dtype: torch.dtype
    variant: str  # a name of AITER_VARIANT_SPECS
    uniform_len: int | None  # every sequence's length, proven by the shapes (see _aiter_plan_key); None: read on
    # the device at every call
    q_len: int = AITER_Q_LEN  # query tokens per sequence: q_shape[0] is batch x q_len

    @property
    def batch(self) -> int:
        return self.q_shape[0] // self.q_len

    @property
    def heads(self) -> int:
        return self.q_shape[1]

    @property
    def total_kv(self) -> int:
        return self.kv_shape[0]


_VARIANT_NOT_APPLICABLE: set = set()  # (variant, q_len, heads) already logged


def _shape_variant(variant: str | None, q_len: int, heads: int) -> str | None:
    """`variant` for the leaderboard's shape (q_len 1, 16 heads); for any other shape AITER_SINGLE_VARIANT, the only
    one it has (AITER_SHAPES), logged once where another was asked for (AITER_VARIANTS and MLA_AITER_VARIANT choose
    among the ways to run q_len 1 x 16 heads; the leaderboard adapter passes the table's name whatever the shape)."""
    if (q_len, heads) == (AITER_Q_LEN, AITER_HEADS):
        return variant
    if variant not in (None, AITER_SINGLE_VARIANT, ROCM_TRITON) and (variant, q_len, heads) not in \
            _VARIANT_NOT_APPLICABLE:
        _VARIANT_NOT_APPLICABLE.add((variant, q_len, heads))
        log.info("MLA decode: aiter runs q_len %d with %d heads as %r only (one split per sequence); variant %r "
                 "applies to q_len 1 with 16 heads", q_len, heads, AITER_SINGLE_VARIANT, variant)
    return AITER_SINGLE_VARIANT


def _aiter_plan_key(fns: tuple, fp8: torch.dtype, q: torch.Tensor, kv: torch.Tensor, kv_seq_len: int | None,
                    variant: str | None = None, q_len: int = AITER_Q_LEN) -> AiterKey:
    """The whole key of a plan: the aiter functions, the device, every shape and dtype the plan depends on, the
    variant (default aiter_variant's; its ROCM_TRITON means AITER_DEFAULT_VARIANT here; AITER_SINGLE_VARIANT for every
    shape but q_len 1 x 16 heads) and the sequence-length facts. q (batch x q_len, heads, 576), a sequence's q_len
    tokens consecutive; kv (total_kv, 576) or (total_kv, 1, 576).

    The rule. A plan's metadata (the work split) is computed by get_mla_metadata_v1 from the sequence lengths in
    kv_indptr. It may be reused WITHOUT reading kv_indptr only when the key proves the lengths are those it was built
    from. kv_seq_len = L is the leaderboard's promise (its config) that every sequence of a uniform batch has L rows,
    else None or the maximum; the sequences tile the cache (kv_indptr[-1] == total_kv, as in every input the
    leaderboard and reference.py generate); so batch * L == total_kv (L > 0) forces every length to equal L, and
    (batch, total_kv, L) determines the metadata. Any other batch (L None, or batch * L != total_kv) gets a plan keyed
    "lengths read on device" (uniform_len None) whose metadata get_mla_metadata_v1 refills from the current kv_indptr
    on every call, on the device, with no host sync. So two batches with the same batch and total_kv but different
    lengths never share metadata: at most one of them is uniform, and a non-uniform one is always refilled. The
    library's calls make no such promise (kv_seq_len None): they are always refilled. With q_len > 1 the lengths are
    always read on the device: the tokens that see no row are zeroed from them.
    """
    batch, total_kv = q.shape[0] // q_len, kv.shape[0]
    uniform = q_len == 1 and kv_seq_len is not None and kv_seq_len > 0 and batch * kv_seq_len == total_kv
    variant = _shape_variant(variant, q_len, q.shape[1]) or aiter_variant(batch, kv_seq_len)
    return AiterKey(fns, fp8, q.device, tuple(q.shape), q.dtype, tuple(kv.shape), kv.dtype,
                    AITER_DEFAULT_VARIANT if variant == ROCM_TRITON else variant, kv_seq_len if uniform else None,
                    q_len)


def _aiter_plan(key: AiterKey) -> _AiterPlan:
    plan = _AITER_PLANS.get(key)
    if plan is None:
        plan = remember(_AITER_PLANS, key, _AiterPlan(key.fns, key.fp8, key.variant, key.batch, key.total_kv,
                                                       key.device, uniform_len=key.uniform_len, q_len=key.q_len,
                                                       heads=key.heads), PLAN_CACHE_LIMIT)
    return plan


def _aiter_safe_indptr(plan: _AiterPlan, kv_indptr: torch.Tensor, total_kv: int) -> None:
    """aiter trusts kv_indptr: a range past total_kv or a decreasing one would send its kernel outside kv_indices. A
    uniform plan uses the kv_indptr its key proves (set at creation). A refilled one gets the caller's clamped into
    [0, total_kv] and made non-decreasing on the device (equal to it whenever it is valid), and plan.invalid records
    on the device whether they differ: the whole output is then NaN (one invalid range can move the others), never
    garbage and never a read outside the cache."""
    torch.clamp(kv_indptr, 0, total_kv, out=plan.kv_indptr_safe)
    torch.cummax(plan.kv_indptr_safe, 0, out=(plan.kv_indptr_safe, plan.cummax_index))
    torch.ne(kv_indptr, plan.kv_indptr_safe, out=plan.indptr_changed)
    torch.any(plan.indptr_changed, out=plan.invalid)


def _aiter_fill_metadata(metadata_fn, plan: _AiterPlan, qo_indptr: torch.Tensor, fp8: torch.dtype) -> None:
    """get_mla_metadata_v1 reads the lengths from plan.kv_indptr_safe on the device and writes the six buffers in
    place (fast_mode: the v1.2 persistent split); kv_indptr counts pages, which are tokens at page size 1."""
    work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map = plan.metadata
    metadata_fn(qo_indptr, plan.kv_indptr_safe, plan.kv_last_page_lens, AITER_HEADS // NUM_KV_HEADS, NUM_KV_HEADS, True,
                work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
                page_size=1, kv_granularity=AITER_KV_GRANULARITY, max_seqlen_qo=1, uni_seqlen_qo=1,
                fast_mode=True, max_split_per_batch=-1, intra_batch_mode=False, dtype_q=plan.q_dtype,
                dtype_kv=fp8)
    plan.filled = True


def aiter_key(q: torch.Tensor, kv: torch.Tensor, kv_seq_len: int | None, variant: str | None = None,
              q_len: int = AITER_Q_LEN) -> AiterKey:
    """The plan key of these validated inputs (q (batch x q_len, heads, 576)), after the installed aiter's check
    (_aiter_api) and the cache's dtype against its FP8."""
    fns, fp8 = _aiter_api()
    expect(kv.dtype == fp8, "the FP8 cache's dtype", f"aiter.dtypes.fp8 = {fp8} (this GPU's FP8)", kv.dtype)
    return _aiter_plan_key(fns, fp8, q, kv, kv_seq_len, variant, q_len)


def aiter_forward(key: AiterKey, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, qo_indptr: torch.Tensor,
                  kv_indptr: torch.Tensor, sm_scale: float, out: torch.Tensor,
                  kv_indices: torch.Tensor | None = None) -> None:
    """Q x FP8 KV through aiter's MLA decode into `out`, by the key's variant (AITER_VARIANT_SPECS says what each
    launches; today's, "fp8_ps", is FP8 Q into one persistent aiter.mla.mla_decode_fwd call).

    Inputs (validated at the door, all on one device, any device: the real aiter refuses a non-ROCm one, a stand-in
    in the tests does not), with q_len = key.q_len query tokens a sequence and heads = key.heads (AITER_SHAPES):
      q:          (batch x q_len, heads, 576) bfloat16, contiguous: sequence b's token t is row b x q_len + t, as
                  aiter's q (total_q, nhead, 576) lies
      kv:         (total_kv, 576) or (total_kv, 1, 576) FP8, contiguous; aiter.dtypes.fp8 (e4m3fn on gfx950, fnuz
                  on gfx942)
      scale:      (1,) float32; the cache holds kv * scale
      qo_indptr:  (batch + 1,) int32 = [0, q_len, ..., batch x q_len]; kv_indptr: (batch + 1,) int32, offsets into
                  kv_indices
      kv_indices: the tokens of the sequences in order, int32 (None: arange(total_kv), the rows as they lie)
      out:        (batch x q_len, heads, 512) bfloat16, contiguous, written in place; mla_decode_fwd's return value is
                  its scratch, not the result
    With q_len > 1 the kernel masks causally (token t sees the first length - q_len + 1 + t rows); a token that sees
    no row comes out zero here, whatever the kernel wrote for it.
    Page size 1, on purpose: the KV is viewed (total_kv, 1, 1, 576) with kv_indptr in tokens and
    kv_last_page_lens = ones. On gfx950 every dispatched MLA decode kernel ignores the page size, so page size 2
    would attend to the even tokens only (docs/aiter-contract.md, "Page size 1, on purpose"); the index traffic of
    page size 1 is 4 B per 576 B token.

    FP8 Q (the "fp8_*" variants) gets a dynamic per-tensor scale computed on the device (QQuantizer: no host sync),
    so any finite bf16 q quantizes without saturation; a16w8_ps passes the bf16 Q as it is. The plan of a key (the
    Q quantizer, the indices, the six metadata buffers that live and die together) is made once and kept in
    _AITER_PLANS; calls must run in order on one queue: the next reuses them.
    """
    batch, q_len, total_kv = key.batch, key.q_len, kv.shape[0]
    if total_kv == 0 or (kv_indices is not None and kv_indices.shape[0] == 0):  # no sequence has a KV row
        out.zero_()  # before any plan: aiter is not called at all (not even its metadata info function)
        return
    plan = _aiter_plan(key)
    indices = plan.kv_indices if kv_indices is None else kv_indices
    fns, fp8 = key.fns, key.fp8
    if plan.refill:
        _aiter_safe_indptr(plan, kv_indptr, indices.shape[0])
    if plan.metadata is not None and (plan.refill or not plan.filled):
        _aiter_fill_metadata(fns[2], plan, qo_indptr, fp8)
    if plan.q_quant is None:
        q_in, q_scale = q, None
    else:
        q_in, q_scale = plan.q_quant(q), plan.q_quant.scale  # (batch x q_len, heads, 576) fp8, (1,) float32
    kv_pages = kv.view(total_kv, 1, NUM_KV_HEADS, QK_HEAD_DIM)
    # mla_decode_fwd: persistent ("decode_fwd") or one split per sequence ("single")
    fns[0](q_in, kv_pages, out, qo_indptr, plan.kv_indptr_safe, indices, plan.kv_last_page_lens, q_len,
           page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=sm_scale, q_scale=q_scale, kv_scale=scale,
           intra_batch_mode=False, **plan.decode_kwargs)
    if plan.refill:
        # Lengths unknown on the host: a sequence with no KV rows gives zeros whatever the kernel wrote for it.
        torch.sub(plan.kv_indptr_safe[1:], plan.kv_indptr_safe[:-1], out=plan.kv_lens)
        if q_len == 1:
            torch.eq(plan.kv_lens, 0, out=plan.empty_rows)
        else:  # causal: token t sees length - q_len + 1 + t rows
            torch.le(plan.kv_lens[:, None] + plan.token_offsets, 0, out=plan.empty_rows)
        out.view(batch, q_len, -1).masked_fill_(plan.empty_rows.view(batch, q_len, 1), 0.0)
        out.masked_fill_(plan.invalid, torch.nan)


class AiterDecode:
    """The aiter backend's plan for a problem (a (q_len, heads) of AITER_SHAPES, causal where q_len > 1, the FP8
    cache). Ragged: kv_indptr over the rows as they lie, as the leaderboard's call. Paged: every run expands the pages
    to token indices on the device (page size 1 for aiter). A sequence whose length falls outside its table comes out
    NaN; one with a page outside the cache in its first `length` slots reads nothing and comes out NaN at q_len 1,
    and at q_len > 1 reads page 0 there instead and comes out NaN in the tokens that see that slot (the others keep
    their values). `variant`: a name of AITER_VARIANT_SPECS (default: aiter_variant's; AITER_SINGLE_VARIANT for
    every shape but q_len 1 x 16 heads); `kv_seq_len`: the leaderboard's uniform-length promise (_aiter_plan_key),
    ragged only."""

    def __init__(self, problem: Problem, variant: str | None = None, kv_seq_len: int | None = None):
        # A paged plan hands aiter its own token indptr: a uniform-length key would replace it with arange * L and
        # send the kernel through kv_indices it never wrote (reads outside the cache).
        expect(problem.layout == "ragged" or kv_seq_len is None, "kv_seq_len",
               "None for a paged plan (the uniform-length promise is the ragged layout's)", kv_seq_len)
        batch, device = problem.batch, problem.device
        self.problem, self.variant, self.kv_seq_len = problem, variant, kv_seq_len
        self.keys: dict = {}  # the cache's shape -> AiterKey (its dtype is the plan's)
        self.qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * problem.q_len
        if problem.layout == "paged":
            page, slots = problem.page_size, problem.page_size * problem.max_pages
            position = torch.arange(slots, dtype=torch.int32, device=device)
            self.position, self.page_column, self.in_page = position, position // page, position % page
            # t - (q_len - 1) for the tokens t of a sequence: token t reads the first length + this slots
            self.token_offsets = torch.arange(1 - problem.q_len, 1, dtype=torch.int32, device=device)
            self.kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
            self.kv_indices = torch.empty(batch * slots + 1, dtype=torch.int32, device=device)  # + a dump slot

    def _key(self, q, kv) -> AiterKey:
        key = self.keys.get(kv.shape)
        if key is None:
            key = remember(self.keys, kv.shape, aiter_key(q, kv, self.kv_seq_len, self.variant, self.problem.q_len),
                           PLAN_CACHE_LIMIT)
        return key

    def _tokens(self, seqs: torch.Tensor, table: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Writes the token indptr and indices of the pages; returns which query tokens are valid, (batch, q_len)
        bool. A slot whose page lies outside the cache is read from page 0 where the sequence keeps its length."""
        page, slots = self.problem.page_size, self.in_page.shape[0]
        lens_ok = (seqs >= 0) & (seqs <= slots)
        lens = torch.where(lens_ok, seqs, 0)
        pages = table.index_select(1, self.page_column)  # (batch, slots): each slot's page
        used = self.position[None, :] < lens[:, None]
        pages_ok = (pages >= 0) & (pages < num_pages)
        bad = used & ~pages_ok
        if self.problem.q_len == 1:
            valid = (lens_ok & ~bad.any(dim=1))[:, None]
            lens = torch.where(valid[:, 0], lens, 0)  # a sequence with a page outside the cache reads nothing
        else:  # causal token t reads the first length - q_len + 1 + t slots: valid while they hold no bad one
            first_bad = torch.where(bad, self.position[None, :], slots).amin(dim=1)  # slots: none
            valid = lens_ok[:, None] & (lens[:, None] + self.token_offsets <= first_bad[:, None])
        torch.cumsum(lens, 0, out=self.kv_indptr[1:])
        tokens = torch.where(pages_ok, pages, 0) * page + self.in_page
        dest = torch.where(self.position[None, :] < lens[:, None], self.kv_indptr[:-1, None] + self.position,
                           self.kv_indices.shape[0] - 1)
        self.kv_indices.scatter_(0, dest.flatten().long(), tokens.flatten().to(torch.int32))
        return valid

    def run(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, seqs: torch.Tensor,
            table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """As TritonDecode.run; lse must be None (aiter_unusable_reason refuses return_lse). q (batch, q_len, heads,
        576) and out (batch, q_len, heads, 512) are handed to aiter as the (batch x q_len, heads, ...) they are."""
        p = self.problem
        rows = p.batch * p.q_len
        q3, out3 = q.view(rows, p.num_heads, QK_HEAD_DIM), out.view(rows, p.num_heads, V_HEAD_DIM)
        key = self._key(q3, kv)
        if p.layout == "ragged":
            aiter_forward(key, q3, kv, scale, self.qo_indptr, seqs, p.softmax_scale, out3)
            return
        valid = self._tokens(seqs, table, kv.shape[0] // p.page_size)
        aiter_forward(key, q3, kv, scale, self.qo_indptr, self.kv_indptr, p.softmax_scale, out3,
                      self.kv_indices[:-1])
        out3.view(p.batch, p.q_len, -1).masked_fill_(~valid.view(p.batch, p.q_len, 1), torch.nan)
