"""The aiter backend (mla_decode/aiter_backend.py, through submission.py's leaderboard adapter) on the CPU, against
a stand-in aiter built from the recorded signatures of the leaderboard runner's aiter (RUNNER, f3be04a12a), MAR15 and
the newest examined (NEWEST), plus the PyPI wheel's (WHEEL) for the version guard. tests/aiter_standin.py says what
the stand-in models; nothing here needs a real aiter or a GPU. The library's paged path: tests/test_aiter_paged.py.

Two references: the BF16 truth through reference.check_implementation (the leaderboard's rule and the strict
per-sequence gate), and fp32 attention over exactly the FP8 data the kernel is given (Q quantized as the backend
does, bit for bit reference.quantize_fp8, and the FP8 KV, both dequantized), where only the bf16 rounding of the
output remains: TIGHT.
"""

import gc
import inspect

import pytest
import torch
from aiter_standin import MODELLED, TIGHT, HostReadsForbidden, Recorded, drop, inside_standin, make, modified
from q_quant_ref import AMAXES, assert_quantized_as_the_reference, scaled_q
from torch.utils._python_dispatch import TorchDispatchMode

import reference as R
import submission as S
from testkit.attention import assert_matches, fp8_per_tensor, fp32_attention

CPU = torch.device("cpu")
E4M3FN, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz

LENGTHS = {  # KV length of every sequence
    "uniform": [64] * 4,  # config kv_seq_len proves the lengths: one metadata fill, reused
    "uniform_split": [1000] * 2,  # longer than a CU's share: split work merged by the reduce
    "length_one": [1] * 5,
    "odd": [3, 5, 7, 9, 11, 13],
    "varlen_with_empty": [1, 7, 0, 33, 129, 1, 2],  # refilled every call; the empty sequence must give zeros
    "single_long": [3001],
}


def fp32_over_fp8(data, fp8=E4M3FN):
    """Exact fp32 attention over the FP8 data the kernel gets (Q quantized as the backend does, the FP8 KV)."""
    return fp32_attention(data, "fp8", fp8_per_tensor(data[0], fp8))


def tight_error(data, out, fp8=E4M3FN) -> float:
    return R.worst_row_relative_l2(out, fp32_over_fp8(data, fp8))


# --- correctness through the dispatcher, both recorded commits ---------------------------------------------


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))  # MAR15's signatures are RUNNER's: contract test only
@pytest.mark.parametrize("case", sorted(LENGTHS))
def test_backend_matches_both_references(standin, version, case):
    aiter = standin(version)
    lengths = LENGTHS[case]
    for call in range(2):  # the second call reuses the plan (same shapes, new values)
        data = make(lengths, seed=100 * call + len(case))
        out = S.custom_kernel(data)
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == (len(lengths), 16, 512) and out.is_contiguous()
        assert_matches(data, out, fp32_over_fp8(data), TIGHT)
    uniform = len(set(lengths)) == 1
    assert len(aiter.calls_to("get_mla_metadata_info_v1")) == 1  # one plan
    assert aiter.stats["metadata_fills"] == (1 if uniform else 2)  # refilled only when lengths are not proven
    assert len(aiter.calls_to("mla_decode_fwd")) == 2
    if case in ("uniform_split", "single_long"):
        assert aiter.stats["work_split"] > 0  # the reduce path ran
    if case == "varlen_with_empty":
        assert aiter.stats["work_empty"] > 0  # the stand-in wrote NaN there; the backend must have zeroed it


def test_no_kv_at_all_gives_zeros_without_calling_aiter(standin):
    aiter = standin("RUNNER")
    q = torch.randn((2, 16, 576), dtype=torch.bfloat16)
    kv = torch.empty((0, 1, 576), dtype=E4M3FN)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    config = dict(make([1, 1], 0)[4], kv_seq_len=0)
    out = S.custom_kernel((q, {"fp8": (kv, torch.ones(1))}, indptr, torch.zeros(3, dtype=torch.int32), config))
    assert torch.equal(out, torch.zeros_like(out)) and aiter.calls == []


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
def test_q_beyond_the_fp8_range_gives_no_nan(standin, version):
    """|q| up to ~4500 (10x the e4m3fn maximum 448), with the KV scaled down so the softmax stays soft."""
    standin(version)
    q, kv_data, qo_indptr, kv_indptr, config = make([40, 17, 3], seed=5)
    q = (q.float() * 1000).to(torch.bfloat16)
    kv_bf16 = (kv_data["bf16"].float() / 1000).to(torch.bfloat16)
    kv_data = {"bf16": kv_bf16, "fp8": R.quantize_fp8(kv_bf16, E4M3FN)}
    data = (q, kv_data, qo_indptr, kv_indptr, config)
    assert q.float().abs().max() > 448
    out = S.custom_kernel(data)
    assert torch.isfinite(out).all()
    assert_matches(data, out, fp32_over_fp8(data), TIGHT)


@pytest.mark.parametrize("fp8", (E4M3FN, E4M3FNUZ))
@pytest.mark.parametrize("amax", AMAXES)
def test_q_quantization_is_reference_quantize_fp8(fp8, amax):
    """The device-side dynamic scale in its torch form (no triton on the CPU), for any finite bf16 q (largest |q|
    from 0 to near the bf16 maximum 3.39e38) and both FP8 flavours: no NaN, no Inf; exactly reference.quantize_fp8
    wherever max|q| >= 2.7e-5 or < 4.7e-20, and in between a scale at most 1e-12 / fp8 max above the reference's,
    the values its quantization. The triton form: tests/test_triton.py (interpreter) and the GPU test below.
    (This session interprets Triton on the CPU, so the torch form is asked for: allow_triton=False.)"""
    quant = S.QQuantizer(3, fp8, CPU, allow_triton=False)
    assert quant.blocks == 0
    assert_quantized_as_the_reference(scaled_q(3, amax), quant, fp8, exact=False)


@pytest.mark.parametrize("failing", ("jit", "compiled"))
def test_q_quantization_falls_back_to_torch_when_triton_fails(monkeypatch, caplog, failing):
    """The triton form failing to build (the JIT launch) or to launch later (the compiled kernels): the torch form
    from then on, with a warning, and the same result."""
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no compiler for this GPU")

        def __call__(self, *args):
            raise RuntimeError("the launch failed")

    if S.triton is None:
        pytest.skip("no triton here")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton form is chosen on the CPU, then fails to launch
    quant = S.QQuantizer(2, E4M3FN, CPU)
    assert quant.blocks > 0
    if failing == "jit":
        monkeypatch.setattr(S, "_q_absmax_kernel", Broken())
    else:
        quant.launchers = (Broken(), Broken())
    assert_quantized_as_the_reference(scaled_q(2, 4.0), quant, E4M3FN, exact=True)
    assert quant.blocks == 0 and "falls back to torch" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or S.triton is None, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("batch", (1, 4, 32, 64, 256))
def test_gpu_q_quantization_in_triton_is_reference_quantize_fp8(batch):
    """The triton form on a GPU (e4m3fn, the gfx950 FP8; the real compiler): bit for bit the reference."""
    quant = S.QQuantizer(batch, E4M3FN, torch.device("cuda"))
    assert quant.blocks > 0
    for amax in AMAXES:
        assert_quantized_as_the_reference(scaled_q(batch, amax, "cuda"), quant, E4M3FN, exact=True)


def test_gfx942_fp8_flavour(standin):
    """aiter.dtypes.fp8 is e4m3fnuz on gfx942: the backend quantizes Q to it (maximum 240) and passes the check."""
    standin("NEWEST", arch="gfx942")
    data = make([50, 7, 128], seed=3, fp8=E4M3FNUZ)
    assert_matches(data, S.custom_kernel(data), fp32_over_fp8(data, E4M3FNUZ), TIGHT)


def test_kv_of_another_fp8_flavour_is_refused(standin):
    standin("RUNNER")  # gfx950: e4m3fn; an e4m3fnuz cache would be misread by the kernel
    with pytest.raises(ValueError, match=r"aiter\.dtypes\.fp8"):
        S.custom_kernel(make([5, 9], seed=1, fp8=E4M3FNUZ))


def test_fp8_rounding_of_p_keeps_the_strict_gate(standin):
    """aiter's own torch model of the kernel also rounds the unnormalised softmax weights to FP8 before P x V; with
    that modelled the BF16 check still passes (the tight bound is not expected to hold then)."""
    aiter = standin("RUNNER", round_p_to_fp8=True)
    for lengths in ([1024] * 2, [1, 7, 0, 33, 129, 1, 2]):
        data = make(lengths, seed=11)
        ok, msg = R.check_implementation(data, S.custom_kernel(data))
        assert ok, msg
    assert aiter.stats["work_direct"] + aiter.stats["work_split"] > 0


# --- the call itself follows the recorded contract ----------------------------------------------------------


@pytest.mark.parametrize("version", MODELLED)
def test_the_call_follows_the_contract(standin, version):
    aiter = standin(version)
    lengths = [4, 9, 1]
    data = make(lengths, seed=2)
    S.custom_kernel(data)
    total_kv, batch = sum(lengths), len(lengths)
    (info,) = aiter.calls_to("get_mla_metadata_info_v1")
    assert info.arguments["fast_mode"] is True and info.arguments["q_dtype"] == info.arguments["kv_dtype"] == E4M3FN
    (meta,) = aiter.calls_to("get_mla_metadata_v1")
    a = meta.arguments
    assert (a["page_size"], a["kv_granularity"], a["max_seqlen_qo"], a["fast_mode"]) == (1, 16, 1, True)
    assert a["dtype_q"] == a["dtype_kv"] == E4M3FN and torch.equal(a["kv_last_page_lens"].value,
                                                                  torch.ones(batch, dtype=torch.int32))
    (dec,) = aiter.calls_to("mla_decode_fwd")
    d = dec.arguments
    assert d["kv_buffer"].shape == (total_kv, 1, 1, 576) and d["kv_buffer"].dtype == E4M3FN  # page size 1
    assert d["page_size"] == 1 and d["nhead_kv"] == 1 and type(d["max_seqlen_q"]) is int
    assert torch.equal(d["kv_indices"].value, torch.arange(total_kv, dtype=torch.int32))
    assert torch.equal(d["kv_last_page_lens"].value, torch.ones(batch, dtype=torch.int32))
    assert type(d["sm_scale"]) is float and d["sm_scale"] == data[4]["sm_scale"]
    assert d["q"].dtype == E4M3FN and d["q_scale"].dtype == torch.float32 and d["q_scale"].shape == (1,)
    assert d["kv_scale"].dtype == torch.float32 and d["kv_scale"].shape == (1,)
    assert d["o"].dtype == torch.bfloat16 and d["o"].shape == (batch, 16, 512) and d["o"].contiguous
    assert d["num_kv_splits_indptr"] is None and d["work_meta_data"].dtype == torch.uint64
    # the version guard checks exactly the names the calls use
    for name, (positional, keywords) in (("mla_decode_fwd", S._AITER_DECODE_ARGS),
                                         ("get_mla_metadata_info_v1", S._AITER_INFO_ARGS),
                                         ("get_mla_metadata_v1", S._AITER_METADATA_ARGS)):
        for call in aiter.calls_to(name):
            assert call.n_positional == len(positional) and set(call.keywords) == set(keywords), name


class Allocations(TorchDispatchMode):
    """Records the aten ops that return a fresh tensor (no alias: not a view, not in-place, not out=), outside
    the stand-in (what aiter allocates itself is its business)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = any(r.alias_info is None and str(r.type) == "Tensor" for r in func._schema.returns)
        if fresh and not inside_standin():
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("lengths", ([64] * 4, [5, 0, 17]), ids=("plan reused", "metadata refilled"))
def test_steady_state_call_allocates_only_o_and_never_reads_on_host(standin, monkeypatch, lengths):
    """A whole leaderboard call (the adapter's dispatch, the library's plan, aiter_forward) once the plan exists. The
    Q quantization in its torch form, as on a CPU without Triton's interpreter (whose own copies of every argument
    are not the backend's work; on a GPU the triton form allocates nothing either)."""
    standin("RUNNER")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    S.custom_kernel(make(lengths, seed=1))  # builds the plan
    inputs = make(lengths, seed=2)
    allocations = Allocations()
    with HostReadsForbidden(), allocations:
        out = S.custom_kernel(inputs)
    (plan,) = S._AITER_PLANS.values()
    assert plan.q_quant.blocks == 0  # the torch form ran
    assert allocations.ops == ["aten.new_empty.default"]  # o
    assert tight_error(make(lengths, seed=2), out) < TIGHT


# --- the plan cache: reused only when the lengths are proven, never stale ------------------------------------


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
def test_same_batch_and_total_kv_with_other_lengths_refills(standin, version):
    aiter = standin(version)
    sequence = [([20, 20, 20], 20), ([10, 30, 20], 30), ([30, 20, 10], 30), ([45, 5, 10], None), ([20, 20, 20], 20)]
    for seed, (lengths, kv_seq_len) in enumerate(sequence):  # batch 3 and total_kv 60 every time
        data = make(lengths, seed, kv_seq_len=kv_seq_len)
        assert_matches(data, S.custom_kernel(data), fp32_over_fp8(data), TIGHT)
    assert len(S._AITER_PLANS) == 2  # ("uniform", 20) and ("lengths read on device",)
    assert aiter.stats["metadata_fills"] == 1 + 3  # the uniform plan once; every non-uniform call refilled


def test_plan_key_rule():
    fns, fp8 = ("decode", "info", "metadata"), E4M3FN
    q = torch.empty((4, 16, 576), dtype=torch.bfloat16)
    kv = torch.empty((400, 1, 576), dtype=fp8)
    key = lambda kv_seq_len: S._aiter_plan_key(fns, fp8, q, kv, kv_seq_len)  # noqa: E731
    assert key(100).uniform_len == 100  # 4 x 100 == 400: every length is 100
    for not_proven in (None, 150, 99, 0):  # None, a maximum with 4 x max != 400, or nonsense: read on the device
        assert key(not_proven).uniform_len is None
    assert key(100) != S._aiter_plan_key(fns, fp8, q[:2], kv, 200)  # batch is in the key
    other_device = torch.empty((4, 16, 576), dtype=torch.bfloat16, device="meta")
    assert key(100) != S._aiter_plan_key(fns, fp8, other_device, kv, 100)  # and the device


def test_a_stale_plan_would_be_caught(standin, monkeypatch):
    """Negative control: a cache that ignored the lengths (a variable batch keyed as a proven uniform one, never
    refilled) serves metadata for other lengths, and the checks catch it; the real key refills and is right."""
    standin("RUNNER")
    data = make([10, 30, 20], seed=0)  # batch 3, total_kv 60: the same totals as a uniform batch of 20
    assert tight_error(data, S.custom_kernel(data)) < TIGHT
    real_key = S._aiter_plan_key
    monkeypatch.setattr(S, "_AITER_PLANS", {})
    monkeypatch.setattr(S, "_aiter_plan_key", lambda *args: real_key(*args)._replace(uniform_len=20))
    monkeypatch.setattr(S, "_DISPATCH", {})  # the key is made once per kind of input, by dispatch
    out = S.custom_kernel(data)  # metadata of lengths 20, 20, 20
    assert tight_error(data, out) > 0.3
    ok, msg = R.check_implementation(data, out)
    assert not ok, msg


def test_invalid_kv_indptr_gives_nan_and_no_read_outside_the_cache(standin):
    """aiter trusts kv_indptr; the backend hands it a clamped, non-decreasing copy and NaNs the output when the
    caller's was invalid (the stand-in faults on any kv_indices read outside the cache)."""
    standin("RUNNER")
    q, kv_data, qo, kvp, config = make([10, 30, 20], seed=4, kv_seq_len=None)
    for bad in ([0, 10, 5, 60], [0, 10, 40, 70], [-3, 10, 40, 60]):
        out = S.custom_kernel((q, kv_data, qo, torch.tensor(bad, dtype=torch.int32), config))
        assert torch.isnan(out).all(), bad
    good = (q, kv_data, qo, kvp, config)
    assert tight_error(good, S.custom_kernel(good)) < TIGHT  # the same plan, valid again: right again


def test_plan_buffers_stay_alive_across_calls(standin):
    standin("NEWEST")
    for seed in range(3):
        gc.collect()  # only the plan cache holds the six buffers between calls
        data = make([33, 2, 90], seed)
        assert tight_error(data, S.custom_kernel(data)) < TIGHT


def test_plan_cache_is_bounded(standin, monkeypatch):
    standin("RUNNER")
    monkeypatch.setattr(S, "PLAN_CACHE_LIMIT", 2)
    for batch in (1, 2, 3):
        S.custom_kernel(make([8] * batch, seed=batch))
    assert [key.batch for key in S._AITER_PLANS] == [2, 3]


# --- page size 2: the negative control the design started from -----------------------------------------------


def metadata_buffers(aiter, batch, fp8):
    info = aiter.get_mla_metadata_info_v1(batch, 1, 16, fp8, fp8, is_sparse=False, fast_mode=True,
                                          intra_batch_mode=False)
    return [torch.empty(shape, dtype=dtype) for shape, dtype in info]


def decode_directly(aiter, data, page_size, buffers=None, **overrides):
    """The aiter call built by hand against the stand-in, with the KV viewed as pages of `page_size` tokens (the
    way the original design did it for page size 2): kv_indptr in pages, one index per page, full last pages."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, kv_scale = kv_data["fp8"]
    fp8 = aiter.dtypes.fp8
    batch, total_kv = q.shape[0], kv.shape[0]
    q8, q_scale = R.quantize_fp8(q, fp8)
    page_indptr = (kv_indptr // page_size).to(torch.int32)
    last_page_lens = torch.full((batch,), page_size, dtype=torch.int32)
    if buffers is None:
        buffers = metadata_buffers(aiter, batch, fp8)
        aiter.get_mla_metadata_v1(qo_indptr, page_indptr, last_page_lens, 16, 1, True, buffers[0], buffers[2],
                                  buffers[1], buffers[3], buffers[4], buffers[5], page_size=page_size,
                                  kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True,
                                  dtype_q=fp8, dtype_kv=fp8)
    o = torch.empty((batch, 16, 512), dtype=torch.bfloat16)
    kwargs = dict(page_size=page_size, nhead_kv=1, sm_scale=config["sm_scale"], work_meta_data=buffers[0],
                  work_indptr=buffers[1], work_info_set=buffers[2], reduce_indptr=buffers[3],
                  reduce_final_map=buffers[4], reduce_partial_map=buffers[5], q_scale=q_scale, kv_scale=kv_scale)
    kwargs.update(overrides)
    args = [q8, kv.view(total_kv // page_size, page_size, 1, 576), o, qo_indptr, page_indptr,
            torch.arange(total_kv // page_size, dtype=torch.int32), last_page_lens, 1]
    aiter.mla.mla_decode_fwd(*args, **kwargs)
    return o


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
def test_page_size_2_reads_only_even_tokens_and_fails_the_strict_gate(standin, version):
    standin(version)
    import aiter

    data = make([1024] * 4, seed=7)
    assert tight_error(data, decode_directly(aiter, data, page_size=1)) < TIGHT  # the control
    out = decode_directly(aiter, data, page_size=2)
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, kv_scale = kv_data["fp8"]
    even_only = R.attention_reference(fp8_per_tensor(q), kv[0::2].float() * kv_scale, qo_indptr, kv_indptr // 2,
                                      config["sm_scale"])
    assert R.worst_row_relative_l2(out, even_only) < TIGHT  # what the gfx950 kernel computes: the even tokens
    assert tight_error(data, out) > 0.3
    ok, msg = R.check_implementation(data, out)
    assert not ok and msg.startswith("strict gate failed"), msg  # the leaderboard's loose rule alone passes it


# --- the version guard -------------------------------------------------------------------------------------


def test_wheel_is_refused_before_any_call_with_the_version_needed(standin, monkeypatch):
    aiter = standin("WHEEL")
    inspected = []
    real_signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, *a, **k: inspected.append(fn) or real_signature(fn, *a, **k))
    data = make([5, 9], seed=1)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="2026-02-02") as error:
            S.custom_kernel(data)
    message = str(error.value)
    assert "739c63177e" in message and "amd-aiter 0.1.7.post2.dev18" in message and "MLA_BACKEND=" in message
    assert "unexpected keyword argument 'page_size'" in message  # mla_decode_fwd
    assert "unexpected keyword argument 'intra_batch_mode'" in message  # get_mla_metadata_info_v1
    assert "aiter.get_mla_metadata_v1 takes (seqlens_qo_indptr, seqlens_kv_indptr, num_heads_per_head_k" in message
    assert aiter.calls == []  # refused before any aiter function ran
    assert len(inspected) == 3  # the verdict is cached: the second call inspected nothing


def swap_work_buffers(params):
    i, j = (next(k for k, p in enumerate(params) if p["name"] == n) for n in ("work_info_set", "work_indptr"))
    params[i], params[j] = params[j], params[i]


INCOMPATIBLE = {  # the version hazards of docs/aiter-contract.md, on otherwise recorded signatures
    "dtype_q dropped (main 2026-07-13..14)": ("NEWEST", "get_mla_metadata_v1", drop("dtype_q", "dtype_kv"),
                                              "dtype_q"),
    "work buffers swapped (before 2025-12-11)": ("RUNNER", "get_mla_metadata_v1", swap_work_buffers,
                                                 "by position"),
    "no page_size (before 2026-02-02)": ("RUNNER", "mla_decode_fwd", drop("page_size", "nhead_kv"), "page_size"),
    "no intra_batch_mode (before 2025-12-07)": ("RUNNER", "get_mla_metadata_info_v1", drop("intra_batch_mode"),
                                                "intra_batch_mode"),
}


@pytest.mark.parametrize("case", sorted(INCOMPATIBLE))
def test_incompatible_signatures_are_refused(standin, case):
    version, function, edit, mentioned = INCOMPATIBLE[case]
    aiter = standin(version, functions=modified(version, function, edit))
    with pytest.raises(RuntimeError, match="2026-02-02") as error:
        S.custom_kernel(make([5, 9], seed=1))
    assert mentioned in str(error.value) and aiter.calls == []


def test_an_opaque_signature_is_not_refused(standin):
    """A compiled op whose wrapper hides its signature ((*args, **kwargs)) cannot be checked; it is not refused."""
    aiter = standin("RUNNER")
    import aiter as module

    module.get_mla_metadata_v1.__signature__ = inspect.Signature(
        [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
         inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    data = make([5, 9], seed=1)
    assert tight_error(data, S.custom_kernel(data)) < TIGHT and aiter.stats["metadata_fills"] == 1


# --- the stand-in enforces what it claims (so the tests above mean something) ----------------------------------


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
@pytest.mark.parametrize("mistake", ["misspelled keyword", "extra positional", "tensor sm_scale",
                                     "torch int max_seqlen_q", "float64 q_scale", "3-D kv_buffer", "2-D o",
                                     "non-contiguous o", "no kv_scale", "fnuz q", "logit_cap"])
def test_standin_rejects_a_wrong_call(standin, version, mistake):
    standin(version)
    import aiter

    data = make([40, 3], seed=4)
    _, kv_data, qo_indptr, kv_indptr, config = data
    kv, kv_scale = kv_data["fp8"]
    bad = {
        "misspelled keyword": ({"pagesize": 1}, TypeError),
        "tensor sm_scale": ({"sm_scale": torch.tensor(config["sm_scale"])}, TypeError),
        "float64 q_scale": ({"q_scale": torch.ones(1, dtype=torch.float64)}, TypeError),
        "no kv_scale": ({"kv_scale": None}, RuntimeError),
        "logit_cap": ({"logit_cap": 30.0}, AssertionError),
    }
    if mistake in bad:
        overrides, error = bad[mistake]
        with pytest.raises(error):
            decode_directly(aiter, data, page_size=1, **overrides)
        return
    buffers = metadata_buffers(aiter, 2, E4M3FN)
    lens = torch.ones(2, dtype=torch.int32)
    aiter.get_mla_metadata_v1(qo_indptr, kv_indptr, lens, 16, 1, True, buffers[0], buffers[2], buffers[1],
                              buffers[3], buffers[4], buffers[5], page_size=1, fast_mode=True)
    q8, q_scale = R.quantize_fp8(data[0], E4M3FN)
    o = torch.empty((2, 16, 512), dtype=torch.bfloat16)
    args = [q8, kv.view(-1, 1, 1, 576), o, qo_indptr, kv_indptr, torch.arange(43, dtype=torch.int32), lens, 1]
    kwargs = dict(page_size=1, nhead_kv=1, sm_scale=config["sm_scale"], work_meta_data=buffers[0],
                  work_indptr=buffers[1], work_info_set=buffers[2], reduce_indptr=buffers[3],
                  reduce_final_map=buffers[4], reduce_partial_map=buffers[5], q_scale=q_scale, kv_scale=kv_scale)
    error = {"extra positional": TypeError, "torch int max_seqlen_q": TypeError, "3-D kv_buffer": ValueError,
             "2-D o": ValueError, "non-contiguous o": RuntimeError, "fnuz q": TypeError}[mistake]
    aiter.mla.mla_decode_fwd(*args, **kwargs)  # the unchanged call works
    if mistake == "extra positional":
        args += [1] * 30
    elif mistake == "torch int max_seqlen_q":
        args[7] = torch.tensor(1)
    elif mistake == "3-D kv_buffer":
        args[1] = kv
    elif mistake == "2-D o":
        args[2] = o.view(2, -1)
    elif mistake == "non-contiguous o":
        args[2] = torch.empty((16, 2, 512), dtype=torch.bfloat16).transpose(0, 1)
    elif mistake == "fnuz q":
        args[0] = R.quantize_fp8(data[0], E4M3FNUZ)[0]
    with pytest.raises(error):
        aiter.mla.mla_decode_fwd(*args, **kwargs)


def test_standin_checks_the_buffers_against_the_info_function(standin):
    standin("RUNNER")
    import aiter

    data = make([40, 3], seed=4)
    buffers = metadata_buffers(aiter, 3, E4M3FN)  # sized for batch 3, used for batch 2
    with pytest.raises(RuntimeError, match="get_mla_metadata_info_v1 says"):
        aiter.get_mla_metadata_v1(data[2], data[3], torch.ones(2, dtype=torch.int32), 16, 1, True, buffers[0],
                                  buffers[2], buffers[1], buffers[3], buffers[4], buffers[5], page_size=1)


def test_standin_requires_the_six_buffers_alive_and_together(standin):
    standin("NEWEST")
    import aiter

    data = make([40, 3], seed=4)
    first = metadata_buffers(aiter, 2, E4M3FN)
    decode_directly(aiter, data, page_size=1)  # fills and uses its own buffers: fine
    lens = torch.ones(2, dtype=torch.int32)
    for buffers in (first, second := metadata_buffers(aiter, 2, E4M3FN)):
        aiter.get_mla_metadata_v1(data[2], data[3], lens, 16, 1, True, buffers[0], buffers[2], buffers[1],
                                  buffers[3], buffers[4], buffers[5], page_size=1)
    assert tight_error(data, decode_directly(aiter, data, 1, buffers=first)) < TIGHT
    with pytest.raises(RuntimeError, match="mixed metadata"):  # work_meta_data of one fill, work list of another
        decode_directly(aiter, data, 1, buffers=[first[0]] + second[1:])
    with pytest.raises(RuntimeError, match="mixed metadata"):  # reduce buffers of another fill
        decode_directly(aiter, data, 1, buffers=first[:3] + second[3:])
    first[1] = torch.zeros_like(first[1])  # the filled work_indptr is dropped: nothing keeps it alive
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer alive"):
        decode_directly(aiter, data, 1, buffers=first)


def test_recorded_calls_keep_no_tensor_alive(standin):
    aiter = standin("RUNNER")
    S.custom_kernel(make([3, 4], seed=0))
    for call in aiter.calls:
        assert not any(isinstance(v, torch.Tensor) for v in call.arguments.values())
    assert all(isinstance(aiter.calls_to(name)[0].arguments[arg], Recorded)
               for name, arg in (("get_mla_metadata_v1", "work_indptr"), ("mla_decode_fwd", "q")))


def test_precise_mode_never_runs_aiter(standin, monkeypatch):
    """aiter's kernels take FP8 Q: MLA_PRECISION=precise refuses a forced aiter, and auto on ROCm then takes another
    backend."""
    standin()
    monkeypatch.setenv("MLA_PRECISION", "precise")
    with pytest.raises(RuntimeError, match="MLA_BACKEND=aiter: .*no precise mode"):
        S.leaderboard_backend(CPU)
    monkeypatch.setenv("MLA_BACKEND", "auto")
    monkeypatch.setattr(torch.version, "hip", "6.4")
    S.cuda_auto_reason.cache_clear()
    try:
        assert S.leaderboard_backend(torch.device("cuda", 0), "fp8") in ("triton", "torch")
        monkeypatch.setenv("MLA_PRECISION", "fast")
        assert S.leaderboard_backend(torch.device("cuda", 0), "fp8") == "aiter"
    finally:
        S.cuda_auto_reason.cache_clear()


def test_auto_passes_aiter_over_for_mxfp4_and_precise_saying_why(standin, monkeypatch, caplog):
    """On ROCm with aiter importable, auto takes aiter for the FP8 cache in the fast mode only: for the MXFP4 cache
    or the precise mode it takes the next backend that can (triton on a GPU), and logs why aiter was passed over; a
    forced aiter is refused for either, naming the reason."""
    standin()
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(S, "_ANNOUNCED", set())
    gpu = torch.device("cuda", 0)
    next_best = "triton" if S.triton is not None else "torch"
    with pytest.raises(RuntimeError, match="MLA_BACKEND=aiter: aiter reads the FP8 cache only, not mxfp4"):
        S.leaderboard_backend(gpu, "mxfp4", "fast")
    monkeypatch.setenv("MLA_BACKEND", "auto")
    with caplog.at_level("INFO", logger="mla_decode"):
        assert S.leaderboard_backend(gpu, "mxfp4", "fast") == next_best
        assert S.leaderboard_backend(gpu, "fp8", "precise") == next_best
        assert S.leaderboard_backend(gpu, "fp8", "fast") == "aiter"
    assert "passed over: aiter: aiter reads the FP8 cache only, not mxfp4" in caplog.text, caplog.text
    assert "passed over: aiter: aiter's kernels take FP8 Q (no precise mode)" in caplog.text, caplog.text


# --- the shapes aiter serves: AITER_SHAPES, causal where q_len > 1, and the reasons for the rest ---------------------

SERVED = {(1, 16), (2, 16), (4, 16), (1, 128), (2, 128)}
REFUSED = {  # (q_len, heads, causal) -> what the reason says
    (3, 16, True): "not q_len 3 with 16 heads",  # aiter pads 3 to its qseqlen-4 kernel; not established
    (8, 16, True): "not q_len 8 with 16 heads",
    (4, 128, True): "not q_len 4 with 128 heads",
    (1, 32, False): "not q_len 1 with 32 heads",  # folded into 16-head groups by aiter's persistent path only
    (1, 48, False): "folds into 16-head groups only in its persistent path",
    (1, 64, False): "not q_len 1 with 64 heads",
    (1, 8, False): "not q_len 1 with 8 heads",
    (2, 16, False): "mask causally",
    (4, 16, False): "mask causally",
    (2, 128, False): "mask causally",
}


def problem_of(q_len: int, heads: int, causal: bool, **kwargs):
    from mla_decode.api import make_problem

    return make_problem(4, E4M3FN, CPU, layout="paged", page_size=16, max_pages=4, num_heads=heads, q_len=q_len,
                        causal=causal, return_lse=False, scale_dtype=None, **kwargs)


def test_the_shapes_served_are_exactly_aiter_shapes(standin):
    import mla_decode.aiter_backend as AB

    standin()
    assert set(AB.AITER_SHAPES) == SERVED
    for q_len, heads in SERVED:
        assert AB.aiter_unusable_reason(problem_of(q_len, heads, True)) is None
    assert AB.aiter_unusable_reason(problem_of(1, 16, False)) is None  # one token: the mask changes nothing
    assert AB.aiter_unusable_reason(problem_of(1, 128, False)) is None
    assert "LSE" in AB.aiter_unusable_reason(problem_of(2, 16, True)._replace(return_lse=True))


@pytest.mark.parametrize("refused", sorted(REFUSED))
def test_other_shapes_are_refused_naming_what_aiter_serves(standin, refused):
    """A forced aiter is refused before anything runs, with a reason that names the shape asked for and what aiter
    serves (or that its q_len > 1 kernels mask causally)."""
    import mla_decode
    import mla_decode.aiter_backend as AB
    from testkit.paged import make_paged_case

    aiter = standin()
    q_len, heads, causal = refused
    reason = AB.aiter_unusable_reason(problem_of(q_len, heads, causal))
    assert reason is not None and REFUSED[refused] in reason, reason
    if causal:
        assert "serves q_len 1, 2 or 4 with 16 heads and q_len 1 or 2 with 128 heads" in reason
    case = make_paged_case("fp8", 16, [5, 40], seed=1, q_len=q_len, num_heads=heads, causal=causal)
    with pytest.raises(RuntimeError, match=f"backend='aiter': .*{REFUSED[refused]}"):
        mla_decode.mla_decode_with_kvcache(*case.args(), causal=causal, backend="aiter", return_lse=False)
    assert aiter.calls == []


def test_auto_passes_aiter_over_for_a_shape_it_does_not_serve(standin, monkeypatch, caplog):
    """On ROCm, auto takes aiter for q_len 2 (causal) and passes it over, saying why, for q_len 3 or non-causal (on a
    GPU of 4 CUs, which the 4 sequences' one-split grid fills)."""
    import mla_decode.aiter_backend as AB
    import mla_decode.backends as SEL

    standin()
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(SEL, "_ANNOUNCED", set())
    monkeypatch.setattr(AB, "compute_units", lambda device: 4)
    gpu = torch.device("cuda", 0)

    def chosen(q_len, causal):
        problem = problem_of(q_len, 16, causal)._replace(device=gpu)
        return SEL.select_backend(problem, "auto")

    assert chosen(2, True).backend == "aiter" and chosen(4, True).backend == "aiter"
    for q_len, causal, why in ((3, True, "not q_len 3 with 16 heads"), (2, False, "mask causally")):
        selection = chosen(q_len, causal)
        assert selection.backend != "aiter" and any(why in line for line in selection.passed_over), selection


@pytest.mark.parametrize("q_len,heads,batch,cus,taken", [(2, 16, 4, 256, False), (2, 16, 256, 256, True),
                                                         (4, 16, 255, 256, False), (2, 128, 128, 256, True),
                                                         (1, 128, 128, 256, False), (1, 16, 1, 256, True)])
def test_auto_takes_the_one_split_kernel_only_where_its_grid_fills_the_gpu(standin, monkeypatch, q_len, heads, batch,
                                                                          cus, taken):
    """aiter's one-split kernel (every shape but q_len 1 x 16 heads) runs a workgroup a sequence (a token at 128
    heads): auto passes it over, saying so, where that is fewer workgroups than the GPU has CUs, and a forced aiter
    takes it anyway; the leaderboard's persistent kernel splits by itself and is taken at any batch."""
    import mla_decode.aiter_backend as AB
    import mla_decode.backends as SEL

    standin()
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(SEL, "_ANNOUNCED", set())
    monkeypatch.setattr(AB, "compute_units", lambda device: cus)
    problem = problem_of(q_len, heads, True)._replace(device=torch.device("cuda", 0), batch=batch)
    selection = SEL.select_backend(problem, "auto")
    assert (selection.backend == "aiter") == taken, selection
    if not taken:
        assert any("one-split kernel" in line and f"on {cus} CUs" in line for line in selection.passed_over)
    assert SEL.select_backend(problem, "aiter").backend == "aiter"
