"""The aiter path's variants (mla_decode/aiter_backend.py, reached through submission.py: AITER_VARIANT_SPECS,
AITER_VARIANTS, aiter_variant; the leaderboard adapter's MLA_AITER_VARIANT) on the CPU, against
the stand-in aiter of tests/aiter_standin.py at the recorded commits: numerics of every variant against both
references, the kernels each one launches per call, the plan cache across shapes and variants, the selection
(table and MLA_AITER_VARIANT), and the version guard with the one-split call's fallback.

Two references, as in test_aiter_backend.py: the BF16 truth through reference.check_implementation (the
leaderboard's rule and the strict per-sequence gate), and fp32 attention over exactly the inputs the kernel is given
(FP8 Q quantized as reference.quantize_fp8 does, or the bf16 Q itself for a16w8; the FP8 KV), where only the bf16
rounding of the output remains: TIGHT.
"""

import logging
from pathlib import Path

import pytest
import torch
import yaml
from aiter_standin import HostReadsForbidden, drop, inside_standin, make, modified
from torch.utils._python_dispatch import TorchDispatchMode

import reference as R
import submission as S
from testkit.controls import BUGS, with_bug
from testkit.emulation import kernel_emulation
from testkit.inputs import GRID_REL_L2_BOUND, generate_grid_input

CPU = torch.device("cpu")
E4M3FN = torch.float8_e4m3fn
TIGHT = 4e-3  # worst-row relative L2 vs fp32 attention over the same inputs: bf16 output rounding only
VARIANTS = sorted(S.AITER_VARIANT_SPECS)
LENGTHS = {
    "uniform": [64] * 4,  # one metadata fill, reused
    "uniform_split": [1000] * 2,  # longer than a CU's share: partials merged by the reduce
    "varlen_with_empty": [1, 7, 0, 33, 129, 1, 2],  # refilled every call; the empty sequence must give zeros
}
STAGE1 = {  # the kernel each variant's stage 1 runs (GFX950_KERNELS)
    "fp8": "mla_a8w8_qh16_qseqlen1_gqaratio16_ps",
    "bf16": "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps",
    "single": "mla_a8w8_qh16_qseqlen1_gqaratio16",
}


def tight_error(data, out, variant: str) -> float:
    """Worst-row relative L2 of `out` against fp32 attention over the Q and KV the variant's kernel is given."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, kv_scale = kv_data["fp8"]
    if S.AITER_VARIANT_SPECS[variant].q == "fp8":
        q8, q_scale = R.quantize_fp8(q, E4M3FN)
        q_in = q8.float() * q_scale
    else:
        q_in = q.float()
    expected = R.attention_reference(q_in, kv.float() * kv_scale, qo_indptr, kv_indptr, config["sm_scale"])
    return R.worst_row_relative_l2(out, expected)


def assert_right(data, out, variant: str) -> None:
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (data[0].shape[0], 16, 512) and out.is_contiguous()
    assert tight_error(data, out, variant) < TIGHT
    ok, msg = R.check_implementation(data, out)
    assert ok, msg


def expected_kernels(variant: str, version: str) -> list[str]:
    """The aiter kernels one call of `variant` runs at `version` (a plan whose lengths are proven)."""
    spec = S.AITER_VARIANT_SPECS[variant]
    if spec.call == "single":
        return (["fill valid_split_count"] if version == "NEWEST" else []) + [STAGE1["single"]]
    return [STAGE1[spec.q], "mla_reduce_v1"]


# --- numerics: every variant, both recorded commits, against both references ---------------------------------


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
@pytest.mark.parametrize("case", sorted(LENGTHS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_matches_both_references(standin, monkeypatch, variant, case, version):
    aiter = standin(version)
    monkeypatch.setenv("MLA_AITER_VARIANT", variant)
    lengths = LENGTHS[case]
    for call in range(2):  # the second call reuses the plan (same shapes, new values)
        data = make(lengths, seed=100 * call + len(case))
        assert_right(data, S.custom_kernel(data), variant)
    spec = S.AITER_VARIANT_SPECS[variant]
    persistent = spec.call != "single"
    assert len(aiter.calls_to("get_mla_metadata_info_v1")) == int(persistent)  # one plan
    uniform = len(set(lengths)) == 1
    assert aiter.stats["metadata_fills"] == (int(persistent) if uniform else 2 * persistent)
    if persistent and case == "uniform_split":
        assert aiter.stats["work_split"] > 0  # the reduce merged partials
    if case == "varlen_with_empty":
        assert aiter.stats["work_empty"] > 0  # the stand-in wrote NaN there; the backend must have zeroed it


GRID_LENGTHS = {"uniform_split": [1000] * 2, "mixed": [1, 7, 0, 33, 1029, 1, 2]}


def assert_grid_controls(data, variant: str) -> None:
    """On grid data (testkit.inputs.generate_grid_input: the Q, KV and P roundings of the FP8 kernels exact) the
    output is within testkit.inputs.GRID_REL_L2_BOUND of exact attention over the cache, worst sequence, and each
    planted bug of testkit.controls (sm_scale x 1.01, the output x 1.02, a row left out) is not."""
    exact = kernel_emulation(data, "cache", "fp8")
    bound = GRID_REL_L2_BOUND
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLA_AITER_VARIANT", variant)
        errors = {bug: R.worst_row_relative_l2(with_bug(S.custom_kernel, data, bug), exact) for bug in BUGS}
    assert errors["correct"] < bound, errors
    assert all(errors[bug] > bound for bug in BUGS[1:]), errors


@pytest.mark.parametrize("case", sorted(GRID_LENGTHS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_on_grid_data_every_variant_meets_a_bound_that_a_1pct_bug_fails(standin, variant, case):
    """The stand-in as aiter's torch model has it (P rounded to FP8 per work item, which random data cannot model
    without the real work split: see test_gpu_every_variant_on_the_real_aiter) on grid data, where that rounding
    is exact."""
    standin("RUNNER", round_p_to_fp8=True)
    assert_grid_controls(generate_grid_input(GRID_LENGTHS[case], seed=3, device=CPU), variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_q_beyond_the_fp8_range_gives_no_nan(standin, monkeypatch, variant):
    """|q| up to ~4500 (10x the e4m3fn maximum 448): the FP8 variants' dynamic scale keeps it finite."""
    standin("RUNNER")
    monkeypatch.setenv("MLA_AITER_VARIANT", variant)
    q, kv_data, qo_indptr, kv_indptr, config = make([40, 17, 3], seed=5)
    q = (q.float() * 1000).to(torch.bfloat16)
    kv_bf16 = (kv_data["bf16"].float() / 1000).to(torch.bfloat16)
    data = (q, {"bf16": kv_bf16, "fp8": R.quantize_fp8(kv_bf16, E4M3FN)}, qo_indptr, kv_indptr, config)
    out = S.custom_kernel(data)
    assert torch.isfinite(out).all()
    assert_right(data, out, variant)


# --- launches per call, and nothing else on the device -------------------------------------------------------


class DeviceWork(TorchDispatchMode):
    """The aten ops the backend itself runs (outside the stand-in), split into fresh allocations and compute (each
    a kernel on a GPU); views and metadata-only ops are neither. Host reads (a device sync on a GPU) fail."""

    HOST_READS = {"aten._local_scalar_dense.default", "aten.item.default"}
    ALLOCATIONS = {"aten.empty.memory_format", "aten.new_empty.default", "aten.empty_like.default"}

    def __init__(self):
        super().__init__()
        self.allocations, self.compute = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if inside_standin():
            return out
        name = str(func)
        assert name not in self.HOST_READS, f"host read (a device sync on a GPU): {name}"
        if name in self.ALLOCATIONS:
            self.allocations.append(name)
        elif not any(r.alias_info is not None for r in func._schema.returns) and func._schema.returns:
            self.compute.append(name)
        elif any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            self.compute.append(name)  # in-place or out=
        return out


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
@pytest.mark.parametrize("lengths", ([64] * 4, [1000] * 2), ids=("direct work", "split work"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_launches_per_call_are_as_declared(standin, monkeypatch, variant, lengths, version):
    """One steady-state call of a leaderboard-like (uniform) shape (the whole custom_kernel: the adapter, the
    library's plan, aiter_forward): the aiter kernels the stand-in ran, plus the backend's own device ops (the Q
    quantization's, in its torch form here, as on a CPU without Triton's interpreter: QQuantizer.launches), total
    AiterVariant.launches with the two-kernel triton form of the GPU; o is the only allocation; no host read."""
    aiter = standin(version)
    monkeypatch.setenv("MLA_AITER_VARIANT", variant)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter's own copies are not the backend's work
    spec = S.AITER_VARIANT_SPECS[variant]
    S.custom_kernel(make(lengths, seed=1))  # builds the plan, fills the metadata
    inputs = make(lengths, seed=2)
    before, work = len(aiter.launches), DeviceWork()
    with HostReadsForbidden(), work:
        out = S.custom_kernel(inputs)
    kernels = aiter.launches[before:]
    (plan,) = S._AITER_PLANS.values()
    assert spec.q != "fp8" or plan.q_quant.blocks == 0  # the torch form ran
    assert kernels == expected_kernels(variant, version)
    assert work.allocations == ["aten.new_empty.default"]  # o
    quant_launches = plan.q_quant.launches if spec.q == "fp8" else 0
    assert len(work.compute) == quant_launches, work.compute
    newest_fill = int(version == "NEWEST" and spec.call == "single")
    assert len(kernels) - newest_fill + (quant_launches and 2) == spec.launches
    assert tight_error(make(lengths, seed=2), out, variant) < TIGHT


def test_a16w8_passes_q_unpadded_and_unquantized(standin, monkeypatch):
    """a16w8: the caller's bf16 q itself goes to stage 1 (no copy, no padding to the kernel's 4-row tile: the C++
    pads max_seqlen_q only for the kernel lookup), with max_seqlen_q 1, no q_scale, the KV scale, and metadata for a
    bf16 Q."""
    aiter = standin("RUNNER")
    monkeypatch.setenv("MLA_AITER_VARIANT", "a16w8_ps")
    data = make([33, 2, 90], seed=3)
    assert_right(data, S.custom_kernel(data), "a16w8_ps")
    (call,) = aiter.calls_to("mla_decode_fwd")
    d = call.arguments
    assert d["q"].data_ptr == data[0].data_ptr() and d["q"].shape == (3, 16, 576) and d["q"].dtype == torch.bfloat16
    assert d["max_seqlen_q"] == 1 and d["q_scale"] is None and d["kv_scale"].dtype == torch.float32
    (meta,) = aiter.calls_to("get_mla_metadata_v1")
    assert meta.arguments["dtype_q"] == torch.bfloat16 and meta.arguments["dtype_kv"] == E4M3FN
    (info,) = aiter.calls_to("get_mla_metadata_info_v1")
    assert info.arguments["q_dtype"] == torch.bfloat16


def test_single_split_variant_gives_every_sequence_one_split(standin, monkeypatch):
    aiter = standin("RUNNER")
    monkeypatch.setenv("MLA_AITER_VARIANT", "fp8_nps")
    data = make([5, 300, 1], seed=6)
    assert_right(data, S.custom_kernel(data), "fp8_nps")
    (call,) = aiter.calls_to("mla_decode_fwd")
    assert call.n_positional == 8 and set(call.keywords) == set(S._AITER_SINGLE_ARGS[1])  # what the guard checks
    d = call.arguments
    assert d["num_kv_splits"] == 1 and torch.equal(d["num_kv_splits_indptr"].value, torch.arange(4, dtype=torch.int32))
    assert d["work_meta_data"] is None and torch.equal(d["kv_last_page_lens"].value, torch.ones(3, dtype=torch.int32))
    assert aiter.calls_to("get_mla_metadata_info_v1") == [] and aiter.stats["work_split"] == 0


# --- the plan cache across shapes and variants -------------------------------------------------------------------


def test_plans_are_reused_across_shapes_and_variants(standin, monkeypatch):
    """Two shapes with a variant each from the table and a third with the default, called in turn: one plan per
    shape (one info call and one metadata fill per persistent one), each reused, each call right."""
    aiter = standin("RUNNER")
    monkeypatch.setattr(S, "AITER_VARIANTS", {(4, 64): ("a16w8_ps", "test"), (2, 1000): ("fp8_nps", "test")})
    for seed in range(3):
        for lengths, variant in (([64] * 4, "a16w8_ps"), ([1000] * 2, "fp8_nps"), ([64] * 3, "fp8_ps")):
            assert_right(data := make(lengths, seed), S.custom_kernel(data), variant)
    assert sorted(key.variant for key in S._AITER_PLANS) == ["a16w8_ps", "fp8_nps", "fp8_ps"]
    assert len(aiter.calls_to("get_mla_metadata_info_v1")) == 2 and aiter.stats["metadata_fills"] == 2
    assert len(aiter.calls_to("mla_decode_fwd")) == 9


def test_the_same_shape_under_another_variant_gets_its_own_plan(standin, monkeypatch):
    standin("RUNNER")
    data = make([64] * 4, seed=0)
    for variant in ("fp8_ps", "a16w8_ps", "fp8_ps"):
        monkeypatch.setenv("MLA_AITER_VARIANT", variant)
        assert_right(data, S.custom_kernel(data), variant)
    assert [key.variant for key in S._AITER_PLANS] == ["fp8_ps", "a16w8_ps"]


# --- selection -----------------------------------------------------------------------------------------------


def test_default_table_is_todays_path_for_every_leaderboard_shape():
    task = yaml.safe_load((Path(__file__).resolve().parent.parent / "task.yml").read_text())
    shapes = {(t["batchsize"], t["kvseqlen"]) for t in task["benchmarks"]}
    assert shapes == set(S.AITER_VARIANTS) and len(shapes) == 8
    for variant, source in S.AITER_VARIANTS.values():
        assert variant == S.AITER_DEFAULT_VARIANT == "fp8_ps" and "no MI355X measurement" in source


def test_table_then_environment_pick_the_variant(standin, monkeypatch):
    aiter = standin("RUNNER")
    monkeypatch.setattr(S, "AITER_VARIANTS", {(4, 64): ("fp8_nps", "test")})
    assert_right(data := make([64] * 4, seed=1), S.custom_kernel(data), "fp8_nps")
    assert aiter.launches[-1] == STAGE1["single"]
    monkeypatch.setenv("MLA_AITER_VARIANT", "a16w8_ps")
    assert_right(data, S.custom_kernel(data), "a16w8_ps")
    assert aiter.launches[-2:] == [STAGE1["bf16"], "mla_reduce_v1"]
    assert S.dispatch(data)[0].plan.impl.variant == "a16w8_ps"  # the adapter passed MLA_AITER_VARIANT on
    forced = S._env("MLA_AITER_VARIANT")  # what the adapter reads and passes as `forced`
    assert S.aiter_variant(4, 64, forced) == "a16w8_ps" and S.aiter_variant(7, None, forced) == "a16w8_ps"
    assert S.aiter_variant(4, 64) == "fp8_nps"  # the library itself reads no environment
    monkeypatch.delenv("MLA_AITER_VARIANT")
    forced = S._env("MLA_AITER_VARIANT")
    assert forced is None
    assert S.aiter_variant(4, 64, forced) == "fp8_nps" and S.aiter_variant(7, None, forced) == S.AITER_DEFAULT_VARIANT
    assert S.dispatch(data)[0].plan.impl.variant == "fp8_nps"


def test_unknown_variant_names_are_errors_naming_their_source(standin, monkeypatch):
    aiter = standin("RUNNER")
    monkeypatch.setenv("MLA_AITER_VARIANT", "fp8_fastest")
    with pytest.raises(ValueError, match=r"MLA_AITER_VARIANT: expected one of .*'fp8_ps'.*got 'fp8_fastest'"):
        S.custom_kernel(make([64] * 4, seed=1))
    monkeypatch.delenv("MLA_AITER_VARIANT")
    monkeypatch.setattr(S, "AITER_VARIANTS", {(4, 64): ("fp8-ps", "typo")})
    with pytest.raises(ValueError, match=r"AITER_VARIANTS\[\(4, 64\)\]: expected one of .*got 'fp8-ps'"):
        S.custom_kernel(make([64] * 4, seed=1))
    assert aiter.launches == []


# --- the version guard per variant ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_wheel_is_refused_before_any_call_for_every_variant(standin, monkeypatch, variant):
    aiter = standin("WHEEL")
    monkeypatch.setenv("MLA_AITER_VARIANT", variant)
    with pytest.raises(RuntimeError, match="2026-02-02"):
        S.custom_kernel(make([5, 9], seed=1))
    assert aiter.calls == []


@pytest.mark.parametrize("variant, function, dropped", [
    ("fp8_nps", "mla_decode_fwd", "num_kv_splits_indptr"),
])
def test_a_call_form_that_does_not_fit_falls_back_to_the_checked_one(standin, monkeypatch, caplog, variant,
                                                                     function, dropped):
    aiter = standin("RUNNER", functions=modified("RUNNER", function, drop(dropped)))
    monkeypatch.setenv("MLA_AITER_VARIANT", variant)
    with caplog.at_level(logging.WARNING, logger="mla_decode"):
        assert_right(data := make([40, 3], seed=2), S.custom_kernel(data), variant)
    assert "cannot take the" in caplog.text and dropped in caplog.text
    assert aiter.launches[-2:] == [STAGE1["fp8"], "mla_reduce_v1"]  # persistent mla_decode_fwd


# --- the stand-in enforces what the variants rely on (so the tests above mean something) ------------------------


def test_standin_has_no_non_persistent_a16w8_kernel(standin):
    aiter = standin("RUNNER").modules["aiter"]
    q, kv_data, qo_indptr, kv_indptr, config = make([30, 2], seed=1)
    kv, kv_scale = kv_data["fp8"]
    o = torch.empty((2, 16, 512), dtype=torch.bfloat16)
    args = (q, kv.view(-1, 1, 1, 576), o, qo_indptr, kv_indptr, torch.arange(32, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), 1)
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel"):
        aiter.mla.mla_decode_fwd(*args, sm_scale=config["sm_scale"], num_kv_splits=1,
                                 num_kv_splits_indptr=torch.arange(3, dtype=torch.int32), kv_scale=kv_scale)
    with pytest.raises(NotImplementedError, match="kv_last_page_lens"):  # the non-persistent kernel reads them
        q8, q_scale = R.quantize_fp8(q, E4M3FN)
        aiter.mla.mla_decode_fwd(q8, *args[1:6], torch.zeros(2, dtype=torch.int32), 1, sm_scale=config["sm_scale"],
                                 num_kv_splits=1, num_kv_splits_indptr=torch.arange(3, dtype=torch.int32),
                                 q_scale=q_scale, kv_scale=kv_scale)


# --- on a ROCm GPU with the real aiter (skipped elsewhere, the H200 included) ------------------------------------


def real_aiter_on_rocm() -> bool:
    if not torch.cuda.is_available() or torch.version.hip is None:
        return False
    try:
        import aiter  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not real_aiter_on_rocm(), reason="needs a ROCm GPU with aiter")
@pytest.mark.parametrize("lengths", ([1024] * 4, [8192] * 4, [8192] * 64, [1, 7, 0, 33, 129, 1, 2], [3001]),
                         ids=("4x1024", "4x8192", "64x8192", "varlen_with_empty", "single_long"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_every_variant_on_the_real_aiter(monkeypatch, variant, lengths):
    """The real kernels behind every call form (the stand-in's model of them is what the CPU tests check): both
    references, two calls per plan, and the grid data's bound with its planted bugs. NEVER RUN: no ROCm GPU has been
    lent to this project.

    On random data its bound (0.04) cannot also catch a 1% sm_scale error. The FP8 kernels round the unnormalised
    softmax weights of each work item (its own running maximum) to FP8 before P x V, as aiter's torch model does: an
    emulation that does not walk the real metadata's work split rounds other values. Measured on the CPU: the
    stand-in with round_p_to_fp8 (P rounded per work item of its split model) against a float64 emulation rounding P
    over whole sequences (Q per tensor as the path quantizes it): worst-sequence error 1.9-2.7e-2 for the correct
    call, 2.3-3.1e-2 with sm_scale x 1.01, 2.7-3.5e-2 with the output x 1.02 (4x1024, mixed lengths, 3001; two
    seeds). Grid data makes that rounding exact whatever the split, so there the bound is
    reference.GRID_REL_L2_BOUND and the planted bugs fail it (the CPU test of the stand-in shows the same). A kernel
    that scaled P by other than a power of two before rounding it would miss that bound by its own rounding: the
    first ROCm run tells."""
    monkeypatch.setenv("MLA_BACKEND", "aiter")
    monkeypatch.setenv("MLA_AITER_VARIANT", variant)
    for seed in range(2):
        data = R.generate_varlen_input(lengths, seed, device=torch.device("cuda"))
        out = S.custom_kernel(data)
        # 0.04: the FP8 kernels round the softmax weights to FP8 before P x V (aiter's own torch model does), which
        # the stand-in with round_p_to_fp8 puts at up to 0.019 on these shapes; a wrong result is above 0.3
        assert tight_error(data, out, variant) < 0.04
        ok, msg = R.check_implementation(data, out)
        assert ok, msg
    assert_grid_controls(generate_grid_input(lengths, seed=3, device=torch.device("cuda")), variant)


def test_a_shape_chosen_for_triton_runs_triton_under_auto_only(standin, monkeypatch):
    """AITER_VARIANTS can send a shape to the triton backend (ROCM_TRITON): auto on ROCm then runs triton there, and
    the library's plan for the same problem chooses as custom_kernel does (both read the registry); a forced
    MLA_BACKEND=aiter runs the default variant."""
    standin()
    data = make([8] * 4, seed=1)
    monkeypatch.setattr(S, "AITER_VARIANTS", {(4, 8): (S.ROCM_TRITON, "test")})
    S.custom_kernel(data)
    assert [key.variant for key in S._AITER_PLANS] == [S.AITER_DEFAULT_VARIANT]
    monkeypatch.setenv("MLA_BACKEND", "auto")
    registry = tuple(record._replace(considered_on=lambda device: True) if record.name in ("aiter", "triton")
                     else record for record in S.BACKEND_REGISTRY)  # auto considers both here, as on ROCm
    monkeypatch.setattr(S, "BACKEND_REGISTRY", registry)
    decision = S.dispatch(data)[0]
    assert decision.backend == "triton" and isinstance(decision.plan.impl, S.TritonDecode), decision
    assert isinstance(decision.plan.impl.key, S.TritonKey), decision
    library = S.plan_ragged(4, data[1]["fp8"][0].dtype, "cpu", 8, return_lse=False)
    assert library.backend == "triton"
    assert any("AITER_VARIANTS runs the triton backend" in line for line in library.passed_over), library.passed_over
    monkeypatch.setattr(S, "AITER_VARIANTS", {})
    again = S.plan_ragged(4, data[1]["fp8"][0].dtype, "cpu", 8, return_lse=False)
    assert again.backend == "aiter", again.passed_over
