"""The library's call, mla_decode_with_kvcache and its plans, on the CPU: the torch backend and the triton kernel under
Triton's interpreter, against the float64 truth over the exactly dequantized pages (testkit.paged), with every slot
no sequence owns poisoned, shuffled page tables, lengths 0, 1, odd and off the page size, the LSE, the bad
arguments' messages, and the bounds' negative controls. The same call on an NVIDIA GPU: tests/test_library_gpu.py."""

import math
import os
import re

import pytest
import torch

import mla_decode
from testkit.emulation import round_q_per_head
from testkit.paged import (
    BAD_CONTENTS,
    LSE_BOUND,
    OUT_BOUND,
    errors,
    make_paged_case,
    paged_reference,
    ragged_twin,
)

LENS = [0, 1, 77, 130, 64]
FORMATS = ["fp8", "mxfp4", "bf16"]
# The triton kernel runs on the CPU under Triton's interpreter (conftest.py turns it on where there is no GPU).
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                       or mla_decode.triton.common.triton is None,
                                       reason="needs triton under its interpreter (a CPU-only machine)")
CPU_BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def kernel_queries(case, backend: str, precision: str = "fast"):
    """The queries as the backend's kernel rounds them: the triton kernel's fast FP8 score product takes Q in e4m3
    per head (reference.round_q_per_head); everything else the bf16 Q exactly."""
    if backend == "triton" and precision == "fast" and case.kv_format == "fp8":
        values, scale = round_q_per_head(case.q)
        return values.double() / scale.double()
    return None


def check(case, out, lse, backend: str, precision: str = "fast", softmax_scale=None) -> str:
    ref_out, ref_lse = paged_reference(case, softmax_scale, kernel_queries(case, backend, precision))
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < OUT_BOUND and lse_error < LSE_BOUND, f"out {out_error:.2e}, lse {lse_error:.2e}"
    return f"out {out_error:.2e}, lse {lse_error:.2e}"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_paged_decode_matches_float64(backend, page_size, kv_format):
    case = make_paged_case(kv_format, page_size, LENS, seed=page_size)
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), backend=backend)
    assert out.shape == (5, 1, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (5, 16, 1) and lse.dtype == torch.float32
    check(case, out, lse, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_precise_mode_and_a_page_size_off_the_tile(backend):
    """The precise score product (fp16 with fp32 sums in the triton kernel), pages of 3 rows (not a power of two,
    tiles straddle pages) and a softmax scale of the caller's."""
    case = make_paged_case("fp8", 3, [5, 0, 200, 1], seed=3)
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), softmax_scale=0.07, backend=backend,
                                                  precision="precise")
    check(case, out, lse, backend, "precise", softmax_scale=0.07)


@needs_interpreter
@pytest.mark.parametrize("schedule", ["fixed", "balanced"])
@pytest.mark.parametrize("chunked_pages,v_cast_first", [(True, True), (False, False)])
def test_triton_walks_pages_of_whole_tiles_both_ways(chunked_pages, v_cast_first, schedule):
    """Pages of 64 rows (whole tiles) as NVIDIA's plans take them (the chunked walk, FP8 V converted before its
    transpose) and as AMD's do (row by row: the chunked walk does not compile for gfx950 with Triton 3.6; V
    transposed as bytes) give the truth, over 2 splits or the balanced schedule's pieces."""
    case = make_paged_case("fp8", 64, LENS, seed=21)
    problem = mla_decode.api.make_problem(len(LENS), case.kv_cache.dtype, "cpu", layout="paged", page_size=64,
                                          max_pages=case.block_table.shape[1])
    plan = (2, 64, 4, 3, False, chunked_pages, v_cast_first)
    decode = mla_decode.DecodePlan(problem, "triton", backend_options={"plan": plan, "schedule": schedule})
    assert (decode.impl.key.plan.chunked_pages, decode.impl.key.plan.v_cast_first) == (chunked_pages, v_cast_first)
    check(case, *decode.run(*case.args()), "triton")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("q_len,num_heads", [(2, 16), (4, 16), (1, 32), (2, 128), (1, 8), (3, 8), (1, 24), (1, 1),
                                             (1, 40), (2, 72)])
def test_serving_shapes(backend, q_len, num_heads):
    """q_len 2 and 4 (causal: token t sees the first len - q_len + 1 + t slots; a token that sees nothing gives out
    0 and LSE -inf) and 32 or 128 heads; 1, 8 (Kimi-K2 at TP8), 24, 40 and 72 (tensor-parallel splits), whose q_len x
    heads the triton kernel's groups of 16 rows do not divide (the last group's extra rows masked). Lengths 0, 1 and
    3 give tokens that see nothing beside tokens that see one slot; 130 crosses a tile."""
    case = make_paged_case("fp8", 16, [0, 1, 3, 130], seed=q_len * num_heads, q_len=q_len, num_heads=num_heads)
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), causal=case.causal, backend=backend)
    assert out.shape == (4, q_len, num_heads, 512) and lse.shape == (4, num_heads, q_len)
    check(case, out, lse, backend)


@needs_interpreter
@pytest.mark.parametrize("q_len,num_heads,block_h,splits",
                         [(2, 16, 32, 2), (2, 32, 32, 2), (4, 16, 32, 1), (4, 16, 64, 2), (2, 128, 64, 2),
                          (3, 8, 32, 1), (3, 8, 16, 1)])
def test_triton_takes_more_query_rows_a_program(q_len, num_heads, block_h, splits):
    """A plan's block_h of 32 or 64 query rows a program (16 by default): the causal mask is per query row, so a group
    that spans tokens (16 heads) gives each its own positions; a sequence of several groups puts each in its rows
    (a group offset of 16 rows fails such cases); one split writes the output and LSE directly, two the partials;
    3 tokens x 8 heads leave the last group part empty (its rows masked)."""
    case = make_paged_case("fp8", 16, [0, 1, 3, 130], seed=block_h + q_len, q_len=q_len, num_heads=num_heads)
    problem = mla_decode.api.make_problem(4, case.kv_cache.dtype, "cpu", layout="paged", page_size=16,
                                          max_pages=case.block_table.shape[1], num_heads=num_heads, q_len=q_len,
                                          causal=case.causal)
    plan = (splits, 64, 4, 3, False, True, True, block_h)
    decode = mla_decode.DecodePlan(problem, "triton", backend_options={"plan": plan, "schedule": "fixed"})
    assert decode.impl.split_grid == (splits, -(-q_len * num_heads // block_h), 4)
    check(case, *decode.run(*case.args()), "triton")


@needs_interpreter
@pytest.mark.parametrize("block_h", [8, 48])
def test_triton_refuses_a_block_h_the_kernel_cannot_take(block_h):
    """8 (below the MMA's 16) and 48 (not a power of 2) query rows a program are refused with the reason, before any
    kernel."""
    problem = mla_decode.api.make_problem(2, torch.float8_e4m3fn, "cpu", layout="paged", page_size=16, max_pages=4,
                                          q_len=2, causal=True)
    with pytest.raises(ValueError, match=f"block_h .* must be a power of 2, at least 16; got {block_h}$"):
        mla_decode.DecodePlan(problem, "triton", backend_options={"plan": (1, 64, 4, 3, False, True, True, block_h)})


def test_backend_options_name_what_each_plan_takes():
    """Each registry record's options (what backend_options may hold) are its plan class's keyword arguments after
    the problem."""
    import inspect

    from mla_decode.aiter_backend import AiterDecode
    from mla_decode.cuda import CudaDecode
    from mla_decode.torch_backend import TorchDecode
    from mla_decode.triton import TritonDecode

    classes = {"torch": TorchDecode, "cuda": CudaDecode, "triton": TritonDecode, "aiter": AiterDecode}
    assert set(classes) == set(mla_decode.BACKENDS)
    for record in mla_decode.BACKEND_REGISTRY:
        takes = tuple(name for name in inspect.signature(classes[record.name]).parameters if name != "problem")
        assert record.options == takes, record.name


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_options_another_backend_does_not_take_are_refused(backend):
    """backend_options are one backend's (the triton backend's plan): a backend that takes none, or not these, says so
    rather than dropping them."""
    problem = mla_decode.api.make_problem(2, torch.float8_e4m3fn, "cpu", layout="paged", page_size=16, max_pages=4)
    takes = "\\['target', 'plan', 'schedule', 'min_share'\\]" if backend == "triton" else "none"
    with pytest.raises(ValueError, match=f"backend_options: the {backend} backend takes {takes}, not \\['variant'\\]"):
        mla_decode.DecodePlan(problem, backend, backend_options={"variant": "persistent"})


@pytest.mark.parametrize("kv_format", ["bf16", "mxfp4"])
def test_other_head_counts(kv_format):
    """8 heads (Kimi-K2 at TP8) in the other formats: the triton kernel (where the interpreter runs it) and the torch
    backend serve them."""
    case = make_paged_case(kv_format, 16, [3, 40], seed=8, num_heads=8)
    backends = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    for backend in backends:
        check(case, *mla_decode.mla_decode_with_kvcache(*case.args(), backend=backend), backend)


@pytest.mark.parametrize("q_len,num_heads", [(1, 1), (1, 8), (2, 8), (1, 24), (1, 40), (2, 72), (1, 128)])
def test_cuda_plans_any_head_count(monkeypatch, q_len, num_heads):
    """The cuda kernels take any head count: a sequence's q_len x heads query rows in ceil(q_len x heads / 16) units
    of 16 (the last masked past its rows; a unit may span tokens; common.cuh's unit_groups), or of 32 or 64 where
    they come in those, the grid and the partials sized for them (GPU-faked here: the kernels' masks run in
    test_library_gpu)."""
    D = pytest.importorskip("mla_decode.cuda.decode")
    P = pytest.importorskip("mla_decode.cuda.plan")
    monkeypatch.setattr(D, "unusable_reason", lambda *args: None)
    monkeypatch.setattr(D, "device_facts", lambda device, precise: P.DeviceFacts(132, lambda rows: 2, 64))
    problem = mla_decode.api.make_problem(4, torch.float8_e4m3fn, "cpu", layout="paged", page_size=64, max_pages=4,
                                          q_len=q_len, num_heads=num_heads, causal=q_len > 1)
    assert D.cuda_unusable_reason(problem) is None
    rows = P.plan_unit_rows(problem, D.device_facts(problem.device, False))
    assert rows == P.QUERY_ROWS or q_len * num_heads % rows == 0
    assert P.query_units(problem, rows) == 4 * -(-q_len * num_heads // rows)


def test_grids_past_the_launch_limits_are_refused(monkeypatch):
    """A grid dimension holds at most 65535: the cuda kernels' units of the plan's 16 or 32 query rows (counted once
    the backend serves the device: faked here), the triton kernel's batch and groups. Past them each backend refuses
    with the reason (auto then passes over it) instead of failing at launch."""
    from mla_decode.backends import cuda_unusable_reason, triton_unusable_reason

    D = pytest.importorskip("mla_decode.cuda.decode")
    P = pytest.importorskip("mla_decode.cuda.plan")
    monkeypatch.setattr(D, "unusable_reason", lambda *args: None)
    monkeypatch.setattr(D, "device_facts", lambda device, precise: P.DeviceFacts(132, lambda rows: 1, 16))  # 16 rows
    big = mla_decode.api.make_problem(2048, torch.float8_e4m3fn, "cpu", layout="paged", page_size=64, max_pages=4,
                                      q_len=4, num_heads=128, causal=True)  # 65536 units of 16 rows
    assert "ceil(q_len x heads / 16) = 65536 units of query rows, more than the grid's 65535" in cuda_unusable_reason(
        big)
    assert cuda_unusable_reason(big._replace(batch=2047)) is None
    monkeypatch.setattr(D, "plan_unit_rows", lambda problem, facts: 32)  # the Hopper kernel's units: half as many
    assert cuda_unusable_reason(big) is None
    assert "ceil(q_len x heads / 32) = 65536 units of query rows" in cuda_unusable_reason(big._replace(batch=4096))
    if mla_decode.triton.common.triton is not None:
        assert "batch 65536" in triton_unusable_reason(big._replace(batch=65536, q_len=1, num_heads=16))
        assert "batch" not in (triton_unusable_reason(big._replace(batch=65535, q_len=1, num_heads=16)) or "")


def test_non_causal_multi_token_sees_everything():
    case = make_paged_case("fp8", 16, [5, 33], seed=7, q_len=3, causal=False)
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), causal=False, backend="torch")
    check(case, out, lse, "torch")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_plan_runs_again_with_new_lengths_and_tables(backend):
    """One plan, two batches of the same shapes but other lengths, pages and data, into the caller's buffers: each
    result is its own batch's (a stale plan, or a kernel that read the first batch's lengths, fails)."""
    first = make_paged_case("fp8", 16, [40, 3, 0], seed=1)
    second = make_paged_case("fp8", 16, [2, 45, 17], seed=2)
    assert first.block_table.shape == second.block_table.shape  # the caches differ: a plan does not fix their size
    decode = mla_decode.plan(3, 16, first.block_table.shape[1], torch.float8_e4m3fn, "cpu", backend=backend)
    assert decode.backend == backend
    out = torch.full((3, 1, 16, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((3, 16, 1), float("nan"))
    for case in (first, second):
        got = decode.run(*case.args(), out=out, lse=lse)
        assert got[0] is out and got[1] is lse
        check(case, out, lse, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ragged_plan_matches_the_paged_call(backend):
    """The ragged layout (kv_indptr over consecutive rows, the leaderboard's) gives what page size 1 gives over the
    same rows."""
    case = make_paged_case("mxfp4", 1, [9, 0, 70], seed=4)
    kv, scale, indptr = ragged_twin(case)
    decode = mla_decode.plan_ragged(3, kv.dtype, "cpu", 70, backend=backend, kv_scale_dtype=scale.dtype)
    out, lse = decode.run_ragged(case.q, kv, indptr, scale)
    check(case, out, lse, backend)


# ---------------------------------------------------------------------------------------------------------------
# Invalid contents (testkit.paged.BAD_CONTENTS): never followed; NaN rows from the kernels, an error from the
# checking option and from torch
# ---------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("name", sorted(BAD_CONTENTS))
def test_invalid_contents_give_nan_rows_or_an_error(name):
    """Sequence 1's table or length is invalid: the triton kernel gives it NaN (out and LSE) and the others their
    truth, reading nothing outside the cache; check_contents=True and the torch backend raise, naming it."""
    edit_table, edit_lens, field = BAD_CONTENTS[name]
    case = make_paged_case("fp8", 16, [20, 45, 7], seed=5)
    table, lens = case.block_table.clone(), case.cache_seqlens.clone()
    (edit_table or edit_lens)(table, lens)
    args = (case.q, case.kv_cache, table, lens, case.kv_scale)
    out, lse = mla_decode.mla_decode_with_kvcache(*args, backend="triton")
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    keep = [0, 2]
    ref_out, ref_lse = paged_reference(case, q=kernel_queries(case, "triton"))
    out_error, lse_error = errors(out[keep], lse[keep], ref_out[keep], ref_lse[keep])
    assert out_error < OUT_BOUND and lse_error < LSE_BOUND
    for backend, option in (("triton", True), ("torch", False)):
        with pytest.raises(ValueError, match="^" + re.escape(field)):
            mla_decode.mla_decode_with_kvcache(*args, backend=backend, check_contents=option)


@needs_interpreter
@pytest.mark.parametrize("page_size", [16, 64])
def test_a_bad_page_only_token_1_reaches_spares_token_0_in_one_group(page_size):
    """8 heads x 2 tokens, causal: one group of 16 query rows holds both tokens. Sequence 1's last page, outside the
    cache, holds only its last position, which token 1 alone sees: token 1's rows come out NaN, token 0's (same group)
    and the other sequences' keep their truth. A flag for the whole group would make token 0 NaN too."""
    lens = [20, page_size * 3 + 1, 7]
    case = make_paged_case("fp8", page_size, lens, seed=12, q_len=2, num_heads=8)
    table = case.block_table.clone()
    table[1, 3] = 10_000
    out, lse = mla_decode.mla_decode_with_kvcache(case.q, case.kv_cache, table, case.cache_seqlens, case.kv_scale,
                                                  causal=True, backend="triton")
    assert torch.isnan(out[1, 1]).all() and torch.isnan(lse[1, :, 1]).all()
    ref_out, ref_lse = paged_reference(case, q=kernel_queries(case, "triton"))  # over the table as it was
    for rows, tokens in (([0, 2], slice(None)), ([1], slice(0, 1))):
        out_error, lse_error = errors(out[rows][:, tokens], lse[rows][:, :, tokens], ref_out[rows][:, tokens],
                                      ref_lse[rows][:, :, tokens])
        assert out_error < OUT_BOUND and lse_error < LSE_BOUND, (rows, out_error, lse_error)


# ---------------------------------------------------------------------------------------------------------------
# The bounds fail on planted bugs
# ---------------------------------------------------------------------------------------------------------------


def test_bounds_fail_on_bugs():
    """Each bound (testkit.paged's OUT_BOUND and LSE_BOUND) fails for: the softmax scale 1% high, the output 2% high,
    one sequence's last row left out, all-zero outputs; the correct call passes."""
    case = make_paged_case("fp8", 16, [130, 77, 5], seed=11)
    ref_out, ref_lse = paged_reference(case)
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), backend="torch")
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < OUT_BOUND and lse_error < LSE_BOUND, (out_error, lse_error)
    scaled = mla_decode.mla_decode_with_kvcache(*case.args(), softmax_scale=1.01 / math.sqrt(576), backend="torch")
    shorter = case.cache_seqlens.clone()
    shorter[0] -= 1
    dropped = mla_decode.mla_decode_with_kvcache(case.q, case.kv_cache, case.block_table, shorter, case.kv_scale,
                                                 backend="torch")
    bugs = {"softmax scale x 1.01": scaled, "output x 1.02": ((out.float() * 1.02).to(out.dtype), lse),
            "a row left out": dropped, "zeros": (torch.zeros_like(out), lse)}
    for bug, (bad_out, bad_lse) in bugs.items():
        out_error, lse_error = errors(bad_out, bad_lse, ref_out, ref_lse)
        assert out_error >= OUT_BOUND or lse_error >= LSE_BOUND, bug
        if bug != "output x 1.02" and bug != "zeros":
            assert lse_error >= LSE_BOUND, bug  # the LSE catches what changes the scores or the rows on its own
        if bug != "a row left out":
            assert out_error >= 2 * OUT_BOUND, (bug, out_error)


# ---------------------------------------------------------------------------------------------------------------
# Bad arguments: a ValueError or TypeError naming the argument, before any kernel runs
# ---------------------------------------------------------------------------------------------------------------


def _good():
    case = make_paged_case("fp8", 16, [5, 9], seed=0)
    return dict(q=case.q, kv_cache=case.kv_cache, block_table=case.block_table, cache_seqlens=case.cache_seqlens,
                kv_scale=case.kv_scale)


BAD_ARGUMENTS = {
    "q float32": (dict(q=lambda a: a.float()), ValueError, "q.dtype"),
    "q 3-d": (dict(q=lambda a: a[:, 0]), ValueError, "q.shape"),
    "q strided": (dict(q=lambda a: a.transpose(0, 2).contiguous().transpose(0, 2)), ValueError, "q: expected a "
                  "contiguous"),
    "q 575 wide": (dict(q=lambda a: a[..., :575].contiguous()), ValueError, "q.shape"),
    "kv_cache float32": (dict(kv_cache=lambda a: a.float()), TypeError, "kv_cache.dtype"),
    "kv_cache 3-d": (dict(kv_cache=lambda a: a[:, :, 0]), ValueError, "kv_cache.shape"),
    "kv_cache mxfp4 576 wide": (dict(kv_cache=lambda a: a.view(torch.uint8)), ValueError, "kv_cache.shape[-1]"),
    "block_table int64": (dict(block_table=lambda a: a.long()), ValueError, "block_table.dtype"),
    "block_table 1-d": (dict(block_table=lambda a: a[0]), ValueError, "block_table.shape"),
    "cache_seqlens int64": (dict(cache_seqlens=lambda a: a.long()), ValueError, "cache_seqlens.dtype"),
    "cache_seqlens too long": (dict(cache_seqlens=lambda a: torch.cat([a, a])), ValueError, "cache_seqlens.shape"),
    "cache_seqlens a list": (dict(cache_seqlens=lambda a: a.tolist()), TypeError, "cache_seqlens"),
    "kv_scale missing": (dict(kv_scale=lambda a: None), TypeError, "kv_scale"),
    "kv_scale float64": (dict(kv_scale=lambda a: a.double()), ValueError, "kv_scale.dtype"),
    "kv_scale two values": (dict(kv_scale=lambda a: torch.cat([a, a])), ValueError, "kv_scale.shape"),
    "block_table on meta": (dict(block_table=lambda a: a.to("meta")), ValueError, "block_table: expected a tensor "
                            "on cpu"),
}


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENTS))
def test_bad_argument_names_itself(name):
    edits, exc, field = BAD_ARGUMENTS[name]
    args = _good()
    args.update({key: edit(args[key]) for key, edit in edits.items()})
    with pytest.raises(exc) as info:
        mla_decode.mla_decode_with_kvcache(**args, backend="torch")
    assert str(info.value).startswith(field), str(info.value)


BAD_SETTINGS = {
    "softmax_scale negative": (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    "softmax_scale nan": (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    "precision": (dict(precision="exact"), ValueError, "precision"),
    "backend": (dict(backend="rocm"), ValueError, "backend"),
    "causal not a bool": (dict(causal=1), TypeError, "causal"),
    "max_seqlen negative": (dict(max_seqlen=-1), ValueError, "max_seqlen"),
}


@pytest.mark.parametrize("name", sorted(BAD_SETTINGS))
def test_bad_setting_names_itself(name):
    settings, exc, field = BAD_SETTINGS[name]
    with pytest.raises(exc) as info:
        mla_decode.mla_decode_with_kvcache(**_good(), **{"backend": "torch", **settings})
    assert str(info.value).startswith(field), str(info.value)


def test_bf16_cache_takes_no_scale_and_mxfp4_wants_its_block_scales():
    bf16 = make_paged_case("bf16", 16, [3], seed=0)
    with pytest.raises(ValueError, match="^kv_scale: expected None"):
        mla_decode.mla_decode_with_kvcache(*bf16.args()[:4], torch.ones(1), backend="torch")
    mx = make_paged_case("mxfp4", 16, [3], seed=0)
    with pytest.raises(ValueError, match="^kv_scale: expected E8M0 block scales of shape"):
        mla_decode.mla_decode_with_kvcache(*mx.args()[:4], mx.kv_scale[:, :, :, :17].contiguous(), backend="torch")


def test_a_plan_refuses_other_shapes_by_name():
    case = make_paged_case("fp8", 16, [5, 9], seed=0)
    decode = mla_decode.plan(2, 16, case.block_table.shape[1], torch.float8_e4m3fn, "cpu", backend="torch")
    with pytest.raises(ValueError, match=r"^block_table.shape: expected \(2, 2\)"):
        decode.run(case.q, case.kv_cache, case.block_table[:, :1].contiguous(), case.cache_seqlens, case.kv_scale)
    with pytest.raises(ValueError, match=r"^kv_cache.dtype: expected torch.float8_e4m3fn \(the plan's\)"):
        decode.run(case.q, case.kv_cache.view(torch.float8_e4m3fnuz), case.block_table, case.cache_seqlens,
                   case.kv_scale)
    with pytest.raises(ValueError, match=r"^out.shape"):
        decode.run(*case.args(), out=torch.empty(2, 1, 16, 511, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^run: expected kv_indptr"):
        mla_decode.plan_ragged(2, torch.float8_e4m3fn, "cpu", 9, backend="torch").run(*case.args())


def test_auto_picks_torch_on_the_cpu_and_says_what_it_passed_over():
    decode = mla_decode.plan(2, 16, 4, torch.float8_e4m3fn, "cpu")
    assert decode.backend == "torch" and decode.passed_over == ()
