"""The triton backend on the CPU: its kernels through Triton's interpreter (tiny sizes; conftest.py turns it on where
there is no GPU), its plans, the launch's arguments and the Hopper kernel's MXFP4 PTX. The kernels are reached through
the library's ragged plan (the leaderboard's layout, with a chosen split plan) and through custom_kernel;
tests/test_library.py has the paged layout, tests/test_triton_gpu.py the real compiler on a GPU.
"""

import itertools
import os

import pytest
import torch

import mla_decode
import reference as R
from mla_decode.schedule import make_schedule, part_first, schedule_items
from testkit.attention import (
    TRITON_REL_L2,
    assert_matches,
    nan_outside,
    triton_reference,
)
from testkit.calls import ragged_decode
from testkit.emulation import round_q_per_head
from testkit.inputs import generate_shifted_input, shifted
from testkit.paged import LSE_BOUND, OUT_BOUND, errors, make_paged_case, paged_reference, ragged_twin

CPU = torch.device("cpu")
CASES = {  # name: (KV lengths, plan (num_splits, block_n, num_warps, num_stages) or None for triton_plan, schedule
    # or None for the default): the fixed splits a plan names, and the balanced schedule's pieces of tiles of the
    # plan's block_n rows
    "varlen_0_1_odd": ([5, 0, 1, 70, 33], (1, 64, 4, 3), "fixed"),
    "splits3_varlen": ([130, 0, 1, 67], (3, 64, 4, 3), "fixed"),
    "splits4_one_seq": ([200], (4, 64, 4, 3), "fixed"),
    "splits_more_than_tiles": ([9, 64], (8, 64, 4, 3), "fixed"),
    "default_plan": ([100, 37], None, None),
    "balanced_varlen_0_1_odd": ([5, 0, 1, 70, 33], None, "balanced"),
    "balanced_tiles_of_32": ([130, 0, 1, 67, 300], (1, 32, 4, 3), "balanced"),
    "balanced_tiles_of_128": ([130, 0, 1, 67, 300], (1, 128, 4, 3), "balanced"),
}
NAN_OUTSIDE_LENGTHS = [5, 1, 0, 70, 3, 9]  # the last one past kv_indptr[-1] (testkit.attention.nan_outside)
# Data where a softmax without its max subtraction overflows and a merge that weighs the splits wrongly shows:
# name -> (KV lengths, testkit.inputs.generate_shifted_input's shift and sink; shift None: one sequence's q all zero,
# so its scores are all equal).
HOSTILE = {"shift100": ([8191, 1, 0, 33], 100.0, False), "shift30": ([1, 0, 257, 33], 30.0, False),
           "sink30": ([8191, 1, 0, 33], 30.0, True), "equal_scores": ([1, 0, 257, 33], None, False)}
INVALID = {  # kv_indptr over KV lengths [10, 20, 5, 7] (total_kv 42) -> the sequences that must be NaN
    "end_before_start": ([0, 10, 5, 30, 42], [1]),
    "end_past_total_kv": ([0, 10, 30, 35, 50], [3]),
    "negative_start": ([-3, 10, 30, 35, 42], [0]),
}
# The MXFP4 score product by tl.dot_scaled (gfx950's plan, forced here): Triton's interpreter runs it from 3.9 on.
SCALED_PLAN = (2, 64, 4, 1, True)
SCALED_CASES = {"varlen_0_1_odd": [5, 0, 1, 70, 33], "one_long": [8191, 1, 0, 33]}

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                       or mla_decode.triton.common.triton is None,
                                       reason="needs triton under its interpreter (a CPU-only machine)")


@pytest.fixture
def triton_backend(monkeypatch):
    import submission

    monkeypatch.setenv("MLA_BACKEND", "triton")
    monkeypatch.delenv("MLA_PRECISION", raising=False)
    return submission


# --- interpreted -------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_matches_fp32_and_passes_the_gate(kv_format, case):
    lens, plan, schedule = CASES[case]
    data = R.generate_varlen_input(lens, seed=len(lens) * 7 + sum(lens), device=CPU)
    out = ragged_decode(data, kv_format, "triton", plan=plan, schedule=schedule)
    assert out.shape == (len(lens), 16, 512) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "NaN/Inf in the output"
    assert all((out[b] == 0).all() for b, n in enumerate(lens) if n == 0), "empty sequence not zeros"
    assert_matches(data, out, triton_reference(data, kv_format), TRITON_REL_L2, kv_format=kv_format)


@needs_interpreter
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
def test_interpreted_custom_kernel(triton_backend, monkeypatch, kv_format):
    """Through the leaderboard's custom_kernel: the aiter-era scales (ties to even, unpadded), then the same kind of
    input with another sm_scale (a decision of its own), then q off a 16-byte boundary (refused by name)."""
    monkeypatch.setenv("MLA_KV_FORMAT", kv_format)
    data = R.generate_varlen_input([3, 66], seed=5, device=CPU, ties="even", padded_scales=False)
    assert_matches(data, triton_backend.custom_kernel(data), triton_reference(data, kv_format), TRITON_REL_L2)
    q, kv_data, qo, kvp, config = R.generate_varlen_input([70, 66], seed=5, device=CPU, ties="even",
                                                          padded_scales=False)
    first, second = (q, kv_data, qo, kvp, config), (q, kv_data, qo, kvp, dict(config, sm_scale=0.01))
    triton_backend.custom_kernel(first)
    exact = triton_reference(second, kv_format)
    assert R.worst_row_relative_l2(triton_reference(first, kv_format), exact) > 10 * TRITON_REL_L2
    assert_matches(second, triton_backend.custom_kernel(second), exact, TRITON_REL_L2)
    with pytest.raises(ValueError, match="must start on 16-byte boundaries"):
        triton_backend.custom_kernel((shifted(q), kv_data, qo, kvp, config))


@needs_interpreter
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("keep", range(len(NAN_OUTSIDE_LENGTHS) - 1))
def test_interpreted_reads_no_row_outside_a_sequence(kv_format, keep, schedule):
    """Every cache row outside sequence `keep` is NaN (those past kv_indptr[-1] too), two splits or the balanced
    schedule's pieces: its output stays within the kernel bound of the fp32 computation on the clean cache."""
    clean = R.generate_varlen_input(NAN_OUTSIDE_LENGTHS, seed=keep, device=CPU)
    data, _ = nan_outside(clean, kv_format, keep, 1)
    exact = triton_reference(clean, kv_format)[keep]
    out = ragged_decode(data, kv_format, "triton", plan=(2, 64, 4, 3), schedule=schedule)
    assert torch.isfinite(out[keep]).all(), "a row outside the sequence was read"
    assert R.worst_row_relative_l2(out[keep][None], exact[None]) < TRITON_REL_L2


@needs_interpreter
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("case", sorted(SCALED_CASES) + ["shift100", "nan_outside"])
def test_interpreted_scaled_mxfp4_scores(case, schedule):
    """gfx950's MXFP4 kernel (tl.dot_scaled scores), over 2 splits or the balanced schedule's pieces: within the
    kernel bound of fp32 with E4M3 Q, and the strict gate; skipped where the interpreter lacks dot_scaled (Triton <
    3.9)."""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter has no dot_scaled")
    if case == "shift100":
        data = generate_shifted_input([8191, 1, 0, 33], seed=9, shift=100.0, device=CPU)
    elif case == "nan_outside":
        clean = R.generate_varlen_input(NAN_OUTSIDE_LENGTHS, seed=2, device=CPU)
        data, _ = nan_outside(clean, "mxfp4", 3, 1)
        exact = triton_reference(clean, "mxfp4", scaled_scores=True)[3]
        out = ragged_decode(data, "mxfp4", "triton", plan=SCALED_PLAN, schedule=schedule)
        assert torch.isfinite(out[3]).all(), "a row outside the sequence was read"
        assert R.worst_row_relative_l2(out[3][None], exact[None]) < TRITON_REL_L2
        return
    else:
        data = R.generate_varlen_input(SCALED_CASES[case], seed=4, device=CPU)
    out = ragged_decode(data, "mxfp4", "triton", plan=SCALED_PLAN, schedule=schedule)
    assert_matches(data, out, triton_reference(data, "mxfp4", scaled_scores=True), TRITON_REL_L2, kv_format="mxfp4")


@needs_interpreter
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_interpreted_hostile_data(case, kv_format, schedule):
    """Shifted logits, a sink, all-equal scores, lengths 0 and 1 beside 8191, through the default plan (splits on
    the long sequences, or the balanced schedule's pieces): the online softmax's max subtraction and the combine's
    weights are what keep these within the kernel bound."""
    lens, shift, sink = HOSTILE[case]
    if shift is None:
        data = R.generate_varlen_input(lens, seed=9, device=CPU)
        data[0][2].zero_()
    else:
        data = generate_shifted_input(lens, seed=9, shift=shift, sink=sink, device=CPU)
    out = ragged_decode(data, kv_format, "triton", schedule=schedule)
    assert torch.isfinite(out).all(), "NaN/Inf in the output"
    error = R.worst_row_relative_l2(out, triton_reference(data, kv_format))
    assert error < TRITON_REL_L2, f"worst sequence {error:.3e} against fp32 (bound {TRITON_REL_L2:g})"


@needs_interpreter
@pytest.mark.parametrize("splits,schedule", [(1, "fixed"), (2, "fixed"), (1, "balanced")])
@pytest.mark.parametrize("case", sorted(INVALID))
def test_interpreted_invalid_ranges_give_nan_rows(case, splits, schedule):
    """The balanced schedule judges a ragged range without the cache's rows (one past them costs its tiles, in
    pieces the combine merges): the split kernel reads none of it, and the sequence comes out NaN as with splits."""
    indptr, bad = INVALID[case]
    q, kv_data, qo, _, config = R.generate_varlen_input([10, 20, 5, 7], seed=3, device=CPU)
    data = (q, kv_data, qo, torch.tensor(indptr, dtype=torch.int32), dict(config, kv_seq_len=None))
    out = ragged_decode(data, "fp8", "triton", plan=(splits, 64, 4, 3), schedule=schedule)
    for b in range(4):
        assert (torch.isnan(out[b]).all() if b in bad else torch.isfinite(out[b]).all()), b


@needs_interpreter
def test_interpreted_q_quantization_is_reference_quantize_fp8():
    """QQuantizer's two triton kernels (the aiter path's Q, e4m3fn) against reference.quantize_fp8, bit for bit, for
    largest |q| from 0 to near the bf16 maximum (no range where the torch form's one-kernel scale differs)."""
    from q_quant_ref import AMAXES, assert_quantized_as_the_reference, scaled_q

    for batch in (1, 3):
        quant = mla_decode.aiter_backend.QQuantizer(batch, torch.float8_e4m3fn, CPU)
        assert quant.blocks > 0
        for amax in AMAXES:
            assert_quantized_as_the_reference(scaled_q(batch, amax), quant, torch.float8_e4m3fn, exact=True)


# --- the balanced schedule (issue 51) ---------------------------------------------------------------------------
# Uneven batches: lengths 0, 1, odd and round beside longer ones; one long sequence among short ones; a heavy tail.
SPREADS = {
    "edges": [0, 1, 63, 64, 65, 127, 1001, 0, 500, 3],
    "one-long": [3000] + [70] * 9,
    "lognormal": [int(x) for x in torch.exp(torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.2 + 5.5)],
}
# The schedule kernel alone: the spreads, a batch past its block of sequences, one sequence cut into every part
SCHEDULE_SPREADS = dict(SPREADS, wide=[int(x) for x in torch.exp(torch.randn(
    1500, generator=torch.Generator().manual_seed(6)) * 1.5 + 5.0)], alone=[65536])
SMALL_GRID = mla_decode.triton.common.INTERPRETER_TARGET._replace(num_sms=2)  # 4 parts: pieces of many tiles


def interpreter_target(sms: int) -> mla_decode.triton.TritonTarget:
    """The interpreter's target (an H200's plans) with `sms` SMs: 2 x sms parts."""
    return mla_decode.triton.common.INTERPRETER_TARGET._replace(num_sms=sms)


def reference_schedule(lengths: torch.Tensor, parts: int, capacity: int, tile_rows: int,
                       max_items: int, min_share: int = 1) -> torch.Tensor:
    """What make_schedule returns, by the CPU reference: schedule_items' rows, flat, each sequence's first item, then
    part_first."""
    s = make_schedule(lengths, parts, capacity, tile_rows, min_share)
    b = torch.arange(lengths.shape[0])
    counts = s.last_part(b) - s.first_part(b) + 1
    first = torch.cumsum(counts, 0) - counts
    return torch.cat([schedule_items(s, max_items).flatten(), first.int(), part_first(s)])


@needs_interpreter
@pytest.mark.parametrize("sms,block_n,min_share", [(1, 64, 1), (3, 64, 1), (132, 64, 1), (66, 32, 1), (132, 64, 9)])
@pytest.mark.parametrize("layout", ["paged", "ragged"])
@pytest.mark.parametrize("spread", sorted(SCHEDULE_SPREADS) + ["invalid"])
def test_the_schedule_kernel_lists_the_reference_pieces(spread, layout, sms, block_n, min_share):
    """make_schedule (mla_schedule_kernel, one program) lists exactly schedule_items' pieces of the CPU reference, in
    tiles of the plan's block_n rows, each sequence's first item and part_first, for 2 to 264 parts, batches within
    one block of the kernel and past it (1500), one sequence cut into every part, and with a least share (parts past
    the line's end). Invalid lengths (negative, past the table; ragged: a range that ends before it starts, or starts
    below 0) cost their fixed unit alone; a ragged range past the cache is judged without it, as the cuda schedule
    judges it."""
    if spread == "invalid":
        lens, indptr = [-5, 0, 10**6, 64, 200], [-3, 10, 5, 300, 400, 401]
    else:
        lens = SCHEDULE_SPREADS[spread]
        indptr = [0, *itertools.accumulate(lens)]
    page = 16
    max_pages = max(max(lens), 1) // page + 1 if spread != "invalid" else 40  # 640 rows: 10**6 is past them
    problem = mla_decode.api.make_problem(len(lens), torch.float8_e4m3fn, "cpu", layout=layout, page_size=page,
                                          max_pages=max_pages, max_seqlen=max(max(lens), 1))
    decode = mla_decode.triton.TritonDecode(problem, interpreter_target(sms), (1, block_n, 4, 3), "balanced",
                                            min_share)
    assert decode.parts == 2 * sms and decode.max_items == decode.parts + len(lens)
    if layout == "paged":
        seqs, lengths, capacity = torch.tensor(lens, dtype=torch.int32), torch.tensor(lens), max_pages * page
    else:
        seqs = torch.tensor(indptr, dtype=torch.int32)
        starts, ends = seqs[:-1].long(), seqs[1:].long()
        lengths = torch.where((starts >= 0) & (ends >= starts), ends - starts, -1)  # invalid: no tile
        capacity = 2 ** 40
    made = decode.make_schedule(seqs)
    want = reference_schedule(lengths, decode.parts, capacity, block_n, decode.max_items, min_share)
    assert made.dtype == torch.int32 and torch.equal(made, want)


def balanced_plan(case, target=None, **options) -> mla_decode.DecodePlan:
    """The triton backend's paged plan for `case`, balanced unless options say otherwise; target: the interpreter's
    (264 parts) or another's."""
    batch, q_len, heads = case.q.shape[:3]
    problem = mla_decode.api.make_problem(batch, case.kv_cache.dtype, "cpu", layout="paged", page_size=case.page_size,
                                          max_pages=case.block_table.shape[1], num_heads=heads, q_len=q_len,
                                          causal=case.causal, scale_dtype=None if case.kv_scale is None
                                          else case.kv_scale.dtype)
    options = {"schedule": "balanced", **options}
    if target is not None:
        options["target"] = target
    return mla_decode.DecodePlan(problem, "triton", backend_options=options)


def paged_truth(case, precision: str = "fast") -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 truth with Q as the portable kernel rounds it: e4m3 per head for the fast FP8 product."""
    q = None
    if case.kv_format == "fp8" and precision == "fast":
        values, scale = round_q_per_head(case.q)
        q = values.double() / scale.double()
    return paged_reference(case, q=q)


def assert_meets_truth(case, out, lse, truth=None) -> None:
    """out and lse within the library's CPU bounds of the truth (paged_truth's, or `truth`)."""
    out_error, lse_error = errors(out, lse, *(paged_truth(case) if truth is None else truth))
    assert out_error < OUT_BOUND and lse_error < LSE_BOUND, f"out {out_error:.2e}, lse {lse_error:.2e}"


# (spread, KV format, page size, SMs of the target, least share): 264 parts (pieces of a tile or none) and 4 or 6
# (pieces of many tiles; with pages of two tiles, pieces that start inside a page, whose chunked walk must keep each
# tile in one page); a least share of 7 tiles leaves most of 264 parts without a piece
BALANCED_CASES = [("edges", "fp8", 16, 132, 1), ("one-long", "fp8", 64, 132, 1), ("lognormal", "fp8", 128, 2, 1),
                  ("edges", "fp8", 1, 3, 1), ("one-long", "mxfp4", 128, 2, 1), ("lognormal", "mxfp4", 16, 132, 1),
                  ("edges", "mxfp4", 64, 3, 1), ("edges", "bf16", 64, 132, 1), ("one-long", "bf16", 1, 3, 1),
                  ("lognormal", "bf16", 128, 2, 1), ("one-long", "fp8", 16, 132, 7)]


@needs_interpreter
@pytest.mark.parametrize("spread,kv_format,page_size,sms,min_share", BALANCED_CASES)
def test_balanced_decodes_meet_the_truth(spread, kv_format, page_size, sms, min_share):
    """The balanced schedule's pieces over shuffled pages with every unowned slot poisoned (a piece that read past its
    tiles or another's gives NaN or misses the truth): the float64 truth within the library's CPU bounds, and the
    fixed splits' output within them."""
    case = make_paged_case(kv_format, page_size, SPREADS[spread], seed=page_size + len(spread))
    decode = balanced_plan(case, interpreter_target(sms), min_share=min_share)
    assert decode.impl.balanced and decode.impl.parts == 2 * sms
    out = torch.full((*case.q.shape[:3], 512), float("nan"), dtype=torch.bfloat16)  # poisoned
    out, lse = decode.run(*case.args(), out=out)
    assert_meets_truth(case, out, lse)
    fixed_out, fixed_lse = balanced_plan(case, schedule="fixed").run(*case.args())
    assert errors(out, lse, fixed_out.double(), fixed_lse.double())[0] < OUT_BOUND


@needs_interpreter
@pytest.mark.parametrize("sms", [132, 2])
@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
def test_balanced_ragged_decodes_meet_the_truth(kv_format, sms):
    """The ragged layout (the leaderboard's) cut by the schedule kernel from kv_indptr: the paged case's truth."""
    lens = SPREADS["edges"]
    case = make_paged_case(kv_format, 16, lens, seed=sms)
    kv, scale, indptr = ragged_twin(case)
    decode = mla_decode.plan_ragged(len(lens), kv.dtype, "cpu", max(lens), backend="triton",
                                    kv_scale_dtype=torch.uint8 if scale is None else scale.dtype,
                                    backend_options={"target": interpreter_target(sms), "schedule": "balanced"})
    assert decode.impl.balanced
    assert_meets_truth(case, *decode.run_ragged(case.q, kv, indptr, scale))


@needs_interpreter
@pytest.mark.parametrize("q_len,num_heads,block_h", [(2, 16, 16), (2, 32, 32), (3, 8, 16), (1, 128, 16),
                                                     (4, 16, 64)])
def test_balanced_serving_shapes(q_len, num_heads, block_h):
    """MTP (causal: a token's limit inside a piece, tokens that see nothing), groups of query rows that split a
    sequence's rows several ways (every group runs the same cut, parts = programs / groups) and the last group part
    masked, programs of 16 to 64 query rows: the float64 truth."""
    case = make_paged_case("fp8", 16, [0, 1, 3, 130, 300, 64], seed=q_len * num_heads + block_h, q_len=q_len,
                           num_heads=num_heads)
    decode = balanced_plan(case, plan=(1, 64, 4, 3, False, True, True, block_h))
    groups = -(-q_len * num_heads // block_h)
    assert decode.impl.split_grid == (decode.impl.parts, groups, 1)  # persistent: a program a part
    target = mla_decode.triton.common.INTERPRETER_TARGET
    assert decode.impl.parts == mla_decode.triton.plan.balanced_parts(
        target, groups, mla_decode.triton.plan.resident_programs(target, "fp8", hopper=False))
    assert_meets_truth(case, *decode.run(*case.args()))


@needs_interpreter
def test_a_step_schedule_serves_every_layer_and_a_stale_one_is_refused():
    """DecodePlan.schedule's items (the schedule kernel, once a step) serve every layer's run bit for bit as the run
    that makes its own; a schedule of other lengths, of another plan, or stale, is refused, and so are lengths off a
    16-byte boundary; a plan of fixed splits makes none and takes none."""
    case = make_paged_case("fp8", 64, SPREADS["one-long"], seed=2)
    decode = balanced_plan(case, SMALL_GRID)
    step = decode.schedule(case.cache_seqlens)
    assert step.items.shape == (decode.impl.max_items * 4 + case.q.shape[0] + decode.impl.parts + 1,)
    alone = decode.run(*case.args())
    for _ in range(2):  # the layers of a step
        assert all(torch.equal(a, b) for a, b in zip(decode.run(*case.args(), schedule=step), alone, strict=True))
    with pytest.raises(ValueError, match="schedule: expected one made from the lengths tensor passed here"):
        decode.run(*case.args()[:3], case.cache_seqlens.clone(), case.kv_scale, schedule=step)
    other = balanced_plan(case).schedule(case.cache_seqlens)  # 264 parts: items of another length
    with pytest.raises(ValueError, match="expected this balanced plan's make_schedule"):
        decode.impl.run(case.q, case.kv_cache.view(-1, 576), case.kv_scale, case.cache_seqlens, case.block_table,
                        alone[0].clone(), alone[1].clone(), schedule=other.items)
    with pytest.raises(ValueError, match="must start on 16-byte boundaries"):  # as run refuses them
        decode.schedule(shifted(case.cache_seqlens))
    case.cache_seqlens[1] -= 1  # the next step's lengths, written in place
    with pytest.raises(ValueError, match="stale"):
        decode.run(*case.args(), schedule=step)
    fixed = balanced_plan(case, schedule="fixed")
    assert fixed.schedule(case.cache_seqlens).items is None
    with pytest.raises(ValueError, match="takes no schedule"):
        fixed.impl.make_schedule(case.cache_seqlens)


def test_the_schedule_option_is_checked_and_names_itself():
    problem = mla_decode.api.make_problem(2, torch.float8_e4m3fn, "cpu", layout="paged", page_size=16, max_pages=4)
    with pytest.raises(ValueError, match="backend_options: schedule 'even': expected one of \\('fixed', 'balanced'\\)"):
        mla_decode.triton.TritonDecode(problem, schedule="even")


@needs_interpreter
@pytest.mark.parametrize("fault", ["dropped", "twice", "count", "part_first"])
def test_a_planted_schedule_fault_fails_the_bounds(fault):
    """The step's schedule with one fault planted: a piece's last tile dropped, the next piece of its sequence
    starting a tile early (a tile taken twice), every piece of a sequence counting one more (the combine merges
    a slot no piece of it wrote; the workspace poisoned, as a fresh one may hold anything), or part_first one item
    late (each part's first piece handed to the part before; the first piece to none): each fails the bounds the
    correct schedule meets."""
    case = make_paged_case("fp8", 64, SPREADS["one-long"], seed=4)
    decode = balanced_plan(case, SMALL_GRID)
    step = decode.schedule(case.cache_seqlens)
    truth = paged_truth(case)
    assert_meets_truth(case, *decode.run(*case.args(), schedule=step), truth)
    work = decode.impl.workspace()
    work.part_o.fill_(float("nan"))
    work.part_lse.fill_(float("nan"))
    items = step.items[:decode.impl.max_items * 4].view(-1, 4)  # a view: the faults land in the step's schedule
    count, index = items[:, 3] & 0xFFFF, items[:, 3] >> 16
    k = int(((items[:, 2] - items[:, 1] >= 2) & (index < count - 1)).nonzero()[0])  # a piece with one after it
    if fault == "dropped":
        items[k, 2] -= 1
    elif fault == "twice":
        items[k + 1, 1] -= 1
    elif fault == "count":
        items[items[:, 0] == items[k, 0], 3] += 1
    else:
        starts = step.items[-decode.impl.parts - 1:]
        starts.copy_((starts + 1).clamp(max=int(starts[-1])))
    out = torch.full((*case.q.shape[:3], 512), float("nan"), dtype=torch.bfloat16)
    bad = errors(*decode.run(*case.args(), out=out, schedule=step), *truth)
    assert bad[0] > OUT_BOUND or bad[1] > LSE_BOUND, bad


@needs_interpreter
def test_the_adapter_takes_fixed_splits_on_uniform_and_uneven_batches(triton_backend, monkeypatch):
    """custom_kernel on triton: a uniform batch (batch x kv_seq_len == the cache's rows) takes fixed splits by the
    config's promise, an uneven one by the default (test_cuda's adapter test shows the options asked for). Both meet
    the kernel bound."""
    monkeypatch.setenv("MLA_KV_FORMAT", "fp8")
    for lens, balanced in (([70] * 3, False), ([3, 140, 0], False)):
        data = R.generate_varlen_input(lens, seed=len(lens) + balanced, device=CPU)
        out = triton_backend.custom_kernel(data)
        decision = triton_backend.dispatch(data)[0]
        assert decision.backend == "triton" and decision.plan.impl.balanced == balanced, lens
        assert_matches(data, out, triton_reference(data, "fp8"), TRITON_REL_L2)


def test_balanced_parts_fill_the_resident_programs():
    from mla_decode.triton import common as C
    from mla_decode.triton import plan as P

    h200 = C.TritonTarget("nvidia", "sm_90", 132, 227 * 1024)
    gfx950, gfx942 = C.amd_triton_target("gfx950", 256), C.amd_triton_target("gfx942", 304)
    two = P.resident_programs(h200, "fp8", hopper=True)
    assert two == P.resident_programs(h200, "bf16", hopper=False) == 2
    assert P.resident_programs(h200, "bf16", hopper=True) == 1  # the Hopper kernel's BF16 tiles: one an SM
    assert P.resident_programs(gfx950, "mxfp4", False) == 2 and P.resident_programs(gfx942, "fp8", False) == 1
    assert P.balanced_parts(h200, 1, two) == 264 and P.balanced_parts(h200, 8, two) == 33  # 128 heads, 16-row groups
    assert P.balanced_parts(h200, 1, 1) == 132  # one wave of the BF16 Hopper kernel, not two
    assert P.balanced_parts(gfx950, 1, P.resident_programs(gfx950, "fp8", False)) == 512  # 2 programs a CU
    assert P.balanced_parts(gfx942, 1, P.resident_programs(gfx942, "fp8", False)) == 304
    assert P.balanced_parts(h200._replace(num_sms=1000), 1, two) == P.MAX_PARTS
    assert P.balanced_parts(h200, 1000, two) == 1


def test_plan_splits_fill_the_sms(monkeypatch):
    from mla_decode.triton import common as C
    from mla_decode.triton import plan as P

    h200 = C.TritonTarget("nvidia", "sm_90", 132, 227 * 1024)
    # where this Triton has the Gluon the Hopper kernel is written for (else its reason, and the portable kernel)
    assert P.triton_plan(4, 1024, h200, "fp8").hopper == (P.HOPPER_KERNEL_REASON is None)
    monkeypatch.setattr(P, "HOPPER_KERNEL_REASON", None)  # the rule as on the H200's Triton
    assert P.triton_plan(4, 1024, h200, "fp8") == (16, 64, 4, 3, False, True, True, 16, True)  # a 64-row tile a split
    assert not P.triton_plan(4, 1024, h200, "mxfp4").scaled_scores  # no scaled MMA: the Hopper kernel expands codes
    assert P.triton_plan(4, 8192, h200, "fp8").num_splits == 32
    assert P.triton_plan(4, 8192, h200, "mxfp4").num_splits == 32  # the Hopper kernel's MXFP4, as FP8
    assert P.triton_plan(4, 8192, C.INTERPRETER_TARGET, "mxfp4").num_splits == 64  # the portable kernel's
    assert P.triton_plan(32, 8192, h200, "fp8").num_splits == 8
    assert P.triton_plan(64, 8192, h200, "mxfp4").num_splits == 4
    assert P.triton_plan(256, 8192, h200, "fp8").num_splits == 1
    assert P.triton_plan(3, 10, h200, "fp8").num_splits == 1
    assert P.triton_plan(1, 0, h200, "fp8").num_splits == 1
    # the interpreter plans as an H200 but for the Hopper kernel (Gluon), which only compiles for the GPU
    assert P.triton_plan(4, 8192, C.INTERPRETER_TARGET, "fp8") == P.triton_plan(4, 8192, h200, "fp8")._replace(
        hopper=False)
    # the Hopper kernel: the FP8 cache on sm_90, fast or precise, the MXFP4 one, fast, and the BF16 one; 16 rows a
    # program for FP8 and MXFP4, whatever the heads (a forced block_h keeps the portable kernel)
    assert P.triton_plan(64, 8192, h200, "fp8", 128, 128)[2:] == (4, 3, False, True, True, 16, True)
    assert P.triton_plan(64, 8192, h200, "fp8", 128, 128, precise=True)[2:] == (4, 3, False, True, False, 16, True)
    assert P.triton_plan(64, 8192, h200, "mxfp4", 128, 128).hopper
    assert P.triton_plan(64, 8192, h200, "bf16", 128, 128).hopper
    assert P.triton_plan(64, 8192, h200, "bf16", 128, 128, precise=True).hopper  # the same products
    # BF16: programs of the fewest of 16, 32 and 64 query rows that hold a sequence's, two warpgroups above 16
    for query_rows, rows in ((1, 16), (8, 16), (16, 16), (24, 32), (32, 32), (40, 64), (128, 64), (256, 64)):
        plan = P.triton_plan(64, 8192, h200, "bf16", query_rows, query_rows)
        assert (plan.hopper, plan.block_h, plan.num_warps) == (True, rows, 4 if rows == 16 else 8), query_rows
    # a BF16 program holds an SM's shared memory: the splits fill one program an SM, not two
    assert P.HOPPER_BF16_PROGRAMS_PER_SM == 1
    assert P.triton_plan(8, 8192, h200, "bf16").num_splits * 8 <= h200.num_sms < P.triton_plan(8, 8192, h200,
                                                                                               "fp8").num_splits * 8
    for portable in (dict(kv_format="mxfp4", precise=True), dict(block_h=32)):
        assert not P.triton_plan(64, 8192, h200, **dict(dict(kv_format="fp8"), **portable)).hopper, portable
    # V converted in pairs before its transpose: the fast FP8 kernel only
    assert not P.triton_plan(4, 8192, h200, "fp8", precise=True).v_cast_first
    assert not P.triton_plan(4, 8192, h200, "mxfp4").v_cast_first
    # 32 query rows a program (8 warps) for the fast FP8 kernel where heads come in 32s and a program walks 32 tiles
    # or more, or 32-row programs unsplit are more than a wave; else 16 (the last arguments: q_len x heads, heads)
    other_nvidia = h200._replace(arch="sm_100")  # an NVIDIA GPU without the Hopper kernel: the H200 but for its arch

    def rows_plan(batch, seq_len, query_rows, num_heads, target=other_nvidia, kv_format="fp8", precise=False):
        plan = P.triton_plan(batch, seq_len, target, kv_format, query_rows, num_heads, precise)
        return plan.num_splits, plan.num_warps, plan.block_h

    assert rows_plan(64, 8192, 128, 128) == (1, 8, 32)  # 128 tiles a program
    assert rows_plan(16, 4096, 256, 128) == (2, 8, 32)  # 32 tiles over 2 splits
    assert rows_plan(40, 1024, 256, 128) == (1, 8, 32)  # 16 tiles, but 320 programs unsplit: more than 2 x 132
    assert rows_plan(32, 1024, 256, 128) == (1, 4, 16)  # 16 tiles in 256 programs
    assert rows_plan(8, 8192, 128, 128) == (4, 4, 16)  # 32 rows: 16 tiles over 8 splits
    assert rows_plan(32, 1024, 128, 128) == (1, 4, 16)  # 32 rows: 8 tiles over 2 splits
    assert rows_plan(64, 8192, 32, 16) == (2, 4, 16)  # 16 heads: a 32-row group would span tokens
    for narrow in (dict(kv_format="mxfp4"), dict(precise=True), dict(target=C.amd_triton_target("gfx950", 256)),
                   dict(target=C.INTERPRETER_TARGET)):
        assert rows_plan(64, 8192, 128, 128, **narrow)[1:] == (4, 16), narrow
    # a caller's first fields, the others the plan's own: the precise kernel keeps the byte transpose
    problem = mla_decode.api.make_problem(4, torch.float8_e4m3fn, "cpu", layout="ragged", max_seqlen=8192,
                                          precision="precise")
    assert P.triton_key(problem, h200, (2, 64, 4, 3)).plan == (2, 64, 4, 3, False, True, False, 16, True)
    assert P.triton_key(problem._replace(precision="fast"), h200, (2, 64, 4, 3)).plan.v_cast_first
    # a caller's first fields: the Hopper kernel where they fit it, else the portable kernel; a whole plan that asks
    # for the Hopper kernel with other warps is refused by name
    fast = problem._replace(precision="fast")
    assert P.triton_key(fast, h200, (2, 64, 4, 3)).plan.hopper
    assert not P.triton_key(fast, h200, (2, 64, 8, 3)).plan.hopper
    assert not P.triton_key(fast, h200, (2, 64, 4, 3, False, True, True, 32)).plan.hopper
    with pytest.raises(ValueError, match="Hopper kernel"):
        P.triton_key(fast, h200, P.TritonPlan(2, 64, 8, 3, hopper=True))
    assert P.triton_key(fast._replace(kv_format="mxfp4", kv_dtype=torch.uint8), h200, (2, 64, 4, 3)).plan.hopper
    bf16 = fast._replace(kv_format="bf16", kv_dtype=torch.bfloat16)
    assert P.triton_key(bf16, h200, (2, 64, 4, 3)).plan.hopper
    assert P.triton_key(bf16, h200, P.TritonPlan(2, 64, 8, 2, block_h=64, hopper=True)).plan.hopper
    for wrong in (P.TritonPlan(2, 64, 4, 2, block_h=64, hopper=True), P.TritonPlan(2, 64, 8, 2, block_h=128,
                                                                                       hopper=True)):
        with pytest.raises(ValueError, match="Hopper kernel"):  # warps other than its rows', or rows beyond 64
            P.triton_key(bf16, h200, wrong)
    with pytest.raises(ValueError, match="Hopper kernel"):  # FP8 takes 16 rows only
        P.triton_key(fast, h200, P.TritonPlan(2, 64, 8, 3, block_h=64, hopper=True))
    # ... or for a call it cannot serve: another format, cache dtype, precision or GPU
    for other, target in ((problem._replace(kv_format="mxfp4", kv_dtype=torch.uint8), h200),
                          (fast._replace(kv_dtype=torch.float8_e4m3fnuz), h200),
                          (fast, h200._replace(arch="sm_100")), (fast, C.INTERPRETER_TARGET)):
        with pytest.raises(ValueError, match="Hopper kernel"):
            P.triton_key(other, target, P.TritonPlan(2, 64, 4, 3, hopper=True))
        assert not P.triton_key(other, target, (2, 64, 4, 3)).plan.hopper
    mxfp4 = fast._replace(kv_format="mxfp4", kv_dtype=torch.uint8)
    with pytest.raises(ValueError, match="no scaled"):
        P.triton_key(mxfp4, h200, P.TritonPlan(2, 64, 4, 3, scaled_scores=True, hopper=True))
    # a target whose MMAs take E2M1 codes and E8M0 scales plans the scaled product, not the Hopper kernel (the GPU
    # test of the scaled path adds the H200 to them)
    monkeypatch.setattr(P, "SCALED_MFMA_ARCHS", ("sm_90",))
    plan = P.triton_plan(4, 1024, h200, "mxfp4")
    assert plan.scaled_scores and not plan.hopper


WORD = 0xFFFFFFFF


def _signed(x: int) -> int:
    return x - (1 << 32) if x >> 31 else x


def run_ptx(ptx: str, registers: dict[str, int]) -> dict[str, int]:
    """Straight-line PTX of an inline-asm block on 32-bit integers (the opcodes of the Hopper kernel's MXFP4
    expansion and tables): operands $n and named registers from `registers`, immediates; -> the registers after it
    (predicates as 0 or 1)."""
    regs = dict(registers)
    for line in ptx.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, operands = line.split(None, 1)
        dst, *src = (x.strip() for x in operands.split(","))
        a = [int(x, 0) & WORD if x[0].isdigit() else regs[x] for x in src]
        if op == "prmt.b32":  # bytes 0-3 of a, 4-7 of b, picked by c's low 4 nibbles; nibble bit 3: sign-replicate
            pool, r = a[0] | a[1] << 32, 0
            for i in range(4):
                sel = a[2] >> 4 * i & 0xF
                byte = pool >> 8 * (sel & 7) & 0xFF
                r |= (0xFF * (byte >> 7) if sel & 8 else byte) << 8 * i
        else:
            r = {"and.b32": lambda x, y: x & y, "or.b32": lambda x, y: x | y, "shl.b32": lambda x, y: x << y,
                 "shr.b32": lambda x, y: x >> y, "shr.s32": lambda x, y: _signed(x) >> y, "not.b32": lambda x: ~x,
                 "sub.s32": lambda x, y: x - y, "mad.lo.s32": lambda x, y, z: x * y + z,
                 "setp.gt.u32": lambda x, y: int(x > y), "selp.b32": lambda x, y, p: x if p else y}[op](*a) & WORD
        regs[dst] = r
    return regs


def _e2m1_magnitudes(k: int) -> torch.Tensor:
    """The 8 E2M1 magnitudes (the contract's codes 0..7) times 2^k."""
    return torch.tensor(R.E2M1_VALUES) * 2.0 ** k


def _e5m2_table(k: int) -> tuple[int, int]:
    """The E5M2 bytes of the E2M1 magnitudes times 2^k, by torch, as the two table words."""
    table = _e2m1_magnitudes(k).to(torch.float8_e5m2).view(torch.uint8).tolist()
    return int.from_bytes(bytes(table[:4]), "little"), int.from_bytes(bytes(table[4:]), "little")


def _table_errors(ptx: str) -> list[int]:
    """The E8M0 bytes for which the tables PTX gives other words than: the exact E5M2 tables at scales 2^-13 ..
    2^13, zeros below (the block flushed), NaN bytes above and for the E8M0 NaN (255)."""
    from mla_decode.triton import hopper as H

    errors = []
    for e8m0 in range(256):
        k = e8m0 - 127
        out = run_ptx(ptx, {"$2": e8m0})
        want = (_e5m2_table(k) if abs(k) <= H.E5M2_EXACT_SCALES else (0, 0) if k < 0 else (0x7F7F7F7F, 0x7F7F7F7F))
        if (out["$0"], out["$1"]) != want:
            errors.append(e8m0)
    return errors


def _expansion_errors(ptx: str, k: int, words: list[int]) -> int:
    """Code words whose expansion by `ptx` with the tables PTX's words at block scale 2^k is not exactly the E2M1
    values times 2^k, in order, as E5M2."""
    from mla_decode.triton import hopper as H

    magnitudes = _e2m1_magnitudes(k)
    tables = run_ptx(H.E8M0_TO_E5M2_TABLES_PTX, {"$2": k + 127})
    errors = 0
    for w in words:
        out = run_ptx(ptx, {"$2": w, "$3": tables["$0"], "$4": tables["$1"]})
        got = torch.tensor(list(out["$0"].to_bytes(4, "little") + out["$1"].to_bytes(4, "little")),
                           dtype=torch.uint8).view(torch.float8_e5m2).float()
        codes = [w >> 4 * j & 0xF for j in range(8)]  # value j: nibble j, low nibble first
        want = torch.stack([magnitudes[c & 7] * (-1 if c & 8 else 1) for c in codes])
        errors += not torch.equal(got, want)
    return errors


def test_the_hopper_kernels_mxfp4_expansion_is_exact():
    """The Hopper kernel's E2M1 -> E5M2 PTX, run on the CPU with its tables: every code word (random ones and each
    code in all 8 places) gives the exact values in order at every block scale it takes (2^-13 .. 2^13); the signs'
    permutes swapped, or the second half's magnitudes in both words, fail it."""
    from mla_decode.triton import hopper as H

    gen = torch.Generator().manual_seed(0)
    words = [int(x) & WORD for x in torch.randint(0, 2 ** 32, (48,), generator=gen, dtype=torch.int64)]
    words += [c * 0x11111111 for c in range(16)]
    for k in range(-H.E5M2_EXACT_SCALES, H.E5M2_EXACT_SCALES + 1):
        assert _expansion_errors(H.E2M1_TO_E5M2_PTX, k, words) == 0, k
    ptx = H.E2M1_TO_E5M2_PTX
    signs_swapped = ptx.replace("0xD9C8", "SIGNS").replace("0xFBEA", "0xD9C8").replace("SIGNS", "0xFBEA")
    second_half_twice = ptx.replace("shr.b32 m, m, 16;", "").replace("prmt.b32 $0, $3, $4, m;",
                                                                     "shr.b32 m, m, 16; prmt.b32 $0, $3, $4, m;")
    for planted in (signs_swapped, second_half_twice):
        assert planted != H.E2M1_TO_E5M2_PTX and _expansion_errors(planted, 0, words) > 0


def test_the_hopper_kernels_mxfp4_tables():
    """The Hopper kernel's E8M0 -> tables PTX on the CPU for all 256 scale bytes: torch's E5M2 tables at 2^-13 ..
    2^13, zeros below, NaN above and for 255. The exact range one short at the top, or the ends' sign test read
    unsigned (the flushed blocks then NaN), fail it."""
    from mla_decode.triton import hopper as H

    ptx = H.E8M0_TO_E5M2_TABLES_PTX
    assert _table_errors(ptx) == []
    top = f"setp.gt.u32 out, kk, {2 * H.E5M2_EXACT_SCALES};"
    one_short = ptx.replace(top, f"setp.gt.u32 out, kk, {2 * H.E5M2_EXACT_SCALES - 1};")
    unsigned_ends = ptx.replace("shr.s32 end, kk, 31;", "shr.b32 end, kk, 31;")
    assert top in ptx and _table_errors(one_short) == [127 + H.E5M2_EXACT_SCALES]
    assert "shr.s32" in ptx and _table_errors(unsigned_ends) == list(range(127 - H.E5M2_EXACT_SCALES))


def test_the_hopper_kernel_takes_what_its_launch_passes(monkeypatch):
    """TritonDecode passes the split kernel's constexprs by position after the other arguments: for a Hopper plan
    they are the Gluon kernel's, in its order, and the other arguments are the portable kernel's (read from the
    source: the kernel is defined only with the Triton it is written for)."""
    import ast
    import inspect

    from mla_decode.triton import common as C
    from mla_decode.triton import decode as D
    from mla_decode.triton import hopper as H
    from mla_decode.triton import kernels as K
    from mla_decode.triton import plan as P

    def parameters(name):
        tree = ast.parse(inspect.getsource(H if name.startswith("hopper") else K))
        (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
        return [a.arg for a in fn.args.args]

    monkeypatch.setattr(P, "HOPPER_KERNEL_REASON", None)  # a plan as on the H200's Triton
    problem = mla_decode.api.make_problem(4, torch.float8_e4m3fn, "cpu", layout="ragged", max_seqlen=8192)
    h200 = C.TritonTarget("nvidia", "sm_90", 132, 227 * 1024)
    plan = P.triton_plan(4, 8192, h200, "fp8")
    assert plan.hopper
    decode = D.TritonDecode(problem, h200, plan)
    hopper, portable = parameters("hopper_split_kernel"), parameters("mla_split_kernel")
    runtime = len(hopper) - len(decode.split_consts)
    assert hopper[runtime:] == list(decode.split_meta)[:len(decode.split_consts)]
    assert hopper[:runtime] == [p for p in portable if not p.isupper()]


def test_amd_plans_fit_the_lds_and_fill_the_cus():
    """gfx950 (MI355X, 256 CUs, 2 programs a CU, 160 KB LDS) keeps 3 stages for FP8; gfx942 (MI300X, 304 CUs, 1 a
    CU, 64 KiB) takes 2, whose modelled LDS fits; MXFP4 takes the scaled scores at 1 stage on gfx950, 2 stages of
    the dequantizing kernel on gfx942 (3 spill); AMD takes no launch_pdl."""
    from mla_decode.triton import common as C
    from mla_decode.triton import plan as P

    mi355, mi300 = C.amd_triton_target("gfx950", 256), C.amd_triton_target("gfx942", 304)
    # AMD walks pages of whole tiles row by row: the chunked walk does not compile for gfx950 with Triton 3.6
    assert P.triton_plan(4, 8192, mi355, "fp8") == (32, 64, 4, 3, False, False, False, 16, False)
    assert P.triton_plan(32, 8192, mi355, "fp8").num_splits == 16  # 2 x 256 / 32
    assert P.triton_plan(32, 8192, mi300, "fp8") == (8, 64, 4, 2, False, False, False, 16, False)  # 304 / 32 = 9 -> 8
    # MXFP4: the scaled MFMA at 2 waves (gfx950), dequantized K (CDNA3)
    assert P.triton_plan(4, 8192, mi355, "mxfp4") == (64, 64, 4, 1, True, False, False, 16, False)
    assert P.triton_plan(4, 8192, mi300, "mxfp4") == (64, 64, 4, 2, False, False, False, 16, False)
    for target in (mi355, mi300):
        for kv_format in ("fp8", "mxfp4"):
            plan = P.triton_plan(64, 1024, target, kv_format)
            assert P.split_kernel_shared_bytes(plan.block_n, plan.num_stages, kv_format) <= target.shared_bytes
        assert "launch_pdl" not in C.triton_launch_options(target, 4, 3, pdl=True)
    assert C.triton_launch_options(C.TritonTarget("nvidia", "sm_90", 132, 227 * 1024), 4, pdl=True) == {
        "num_warps": 4, "launch_pdl": True}
    assert C.amd_triton_target("gfx1100", 48).shared_bytes == 64 * 1024  # an unknown one: the smallest LDS
