"""reference.py against independent float64 math, the SPEC's MXFP4 vectors, and the checker's negative controls."""

import math
from pathlib import Path

import pytest
import torch
import yaml

import reference as R
from testkit.attention import fp32_attention

# The aiter contract's MXFP4 example: one row of 128 bf16 values (4 blocks of 32) and what aiter's
# dynamic_mxfp4_quant writes.
SPEC_BLOCK0 = [3.703125, -3.703125, 2.5, -2.5, 1.25, -1.25, 0.75, 0.25, -0.25, 0.2001953125, -0.10009765625, 3.5,
               1.75, 0.0, 1.25, 0.6015625, -0.8984375, 1.1015625, 2.203125, -2.90625, 3.203125, 0.050048828125,
               -0.400390625, 1.6015625, 2.75, -3.25, 0.125, 0.375, -1.75, 2.0, -0.0, 1.0]
SPEC_BLOCK1 = [7.0, -6.5, 5.0, -5.0, 3.0, 1.0, 0.5, 0.490234375, 2.5, 1.125, 0.0, -0.30078125, 0.6015625, -0.8984375,
               1.203125, -1.5, 1.796875, -0.0, 0.30078125, -0.6015625, 0.8984375, -1.203125, 1.5, -1.796875, 0.0,
               -0.30078125, 0.6015625, -0.8984375, 1.203125, -1.5, 1.796875, -0.0]
SPEC_BLOCK2 = [0.30078125, -0.25, 0.10009765625, 0.0625, 0.15625, -0.03125, 0.046875, 0.2001953125] + [
    0.01 * k for k in range(24)]
SPEC_PACKED = {
    "away": "e6d5b312096804132ad40539d5104c28d6d51301138091a1829091a28091a182e623955200112122334344445555556600000000"
            "000000000000000000000000",
    "even": "e6c4a202086804122ad40539d5104c28d6c41300128091a1829091a28091a182e623945200112122334344445555556600000000"
            "000000000000000000000000",
}
SPEC_SCALE_BYTES = [127, 128, 123, 0]


def spec_row() -> torch.Tensor:
    return torch.tensor(SPEC_BLOCK0 + SPEC_BLOCK1 + SPEC_BLOCK2 + [0.0] * 32).to(torch.bfloat16).reshape(1, 128)


@pytest.mark.parametrize("ties,padded", [("away", True), ("even", False)])
def test_mxfp4_bit_exact_on_spec_vector(ties, padded):
    packed, scales = R.quantize_mxfp4(spec_row(), ties=ties, padded=padded)
    assert packed.view(torch.uint8).numpy().tobytes().hex() == SPEC_PACKED[ties]
    s = scales.view(torch.uint8)
    assert s[0, :4].tolist() == SPEC_SCALE_BYTES
    if padded:  # the runner's layout: (ceil(M/256)*256, ceil(blocks/8)*8), padding a defined (NaN) byte
        assert tuple(s.shape) == (256, 8)
        assert (s[0, 4:] == R.MXFP4_SCALE_PAD_BYTE).all() and (s[1:] == R.MXFP4_SCALE_PAD_BYTE).all()
    else:
        assert tuple(s.shape) == (1, 4)


def test_mxfp4_packing_order_and_worked_examples():
    # Element 0 of block 0 is 3.703125 -> code 0x6 in the LOW nibble; element 1 is -3.703125 -> 0xE in the high one.
    packed, _ = R.quantize_mxfp4(spec_row())
    first = packed.view(torch.uint8)[0, 0].item()
    assert first & 0xF == 0x6 and first >> 4 == 0xE
    # SPEC scale rule examples: amax -> scale byte.
    for amax, byte in [(3.703125, 127), (7.0, 128), (6.9, 127), (6.0, 127), (1.0, 125), (0.30078125, 123),
                       (448.0, 134), (0.0, 0)]:
        row = torch.zeros(1, 32)
        row[0, 5] = amax
        _, s = R.quantize_mxfp4(row.to(torch.bfloat16), padded=False)
        assert s.view(torch.uint8).item() == byte, amax


@pytest.mark.parametrize("padded", [True, False])
def test_mxfp4_dequantize_roundtrip_and_layouts(padded):
    torch.manual_seed(0)
    x = torch.randn(300, 1, 576).to(torch.bfloat16)
    packed, scales = R.quantize_mxfp4(x, padded=padded)
    assert tuple(packed.shape) == (300, 1, 288)
    assert tuple(scales.shape) == ((512, 24) if padded else (300, 18))
    deq = R.dequantize_mxfp4(packed, scales)
    assert tuple(deq.shape) == (300, 1, 576)
    # Every value is a representable E2M1 value times its block scale, within half a code step of x.
    blocks = x.float().reshape(300, 18, 32)
    step = torch.exp2(scales.view(torch.uint8)[:300, :18].float() - 127.0).unsqueeze(-1)  # spacing <= 1 unit
    err = (deq.reshape(300, 18, 32) - blocks).abs()
    assert (err <= step + 1e-6).all()
    rel = (deq - x.float()).norm() / x.float().norm()
    assert 0.05 < rel < 0.15  # 4-bit error: present, and bounded


def test_fp8_roundtrip_error_bound():
    torch.manual_seed(1)
    x = torch.randn(4096, 1, 576).to(torch.bfloat16)
    x_fp8, scale = R.quantize_fp8(x, torch.float8_e4m3fn)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (1,)
    assert math.isclose(scale.item(), x.float().abs().max().item() / 448.0, rel_tol=1e-6)
    deq = x_fp8.float() * scale
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal floor.
    assert ((deq - x.float()).abs() <= x.float().abs() * 2 ** -4 + scale * 2 ** -9).all()
    assert 0.01 < (deq - x.float()).norm() / x.float().norm() < 0.05


def naive_float64(q, kv, kv_lens, sm_scale):
    """Textbook attention, one head at a time, in float64."""
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    start = 0
    for b, n in enumerate(kv_lens):
        keys = kv[start:start + n, 0].double()
        for h in range(q.shape[1]):
            if n == 0:
                continue
            s = keys @ q[b, h].double() * sm_scale
            p = torch.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ keys[:, :512]
        start += n
    return out


@pytest.mark.parametrize("kv_lens", [[64, 64, 64], [1, 7, 0, 33, 128, 1], [257]])
def test_ref_kernel_matches_float64(kv_lens):
    data = R.generate_varlen_input(kv_lens, seed=11, device=torch.device("cpu"))
    q, kv_data = data[0], data[1]
    out = R.ref_kernel(data)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (len(kv_lens), 16, 512)
    exact = naive_float64(q, kv_data["bf16"], kv_lens, R.SM_SCALE)
    assert R.relative_l2(out, exact) < 4e-3  # bf16 output rounding only
    zero_rows = [b for b, n in enumerate(kv_lens) if n == 0]
    assert all((out[b] == 0).all() for b in zero_rows)


def test_generate_input_contract():
    q, kv_data, qo_indptr, kv_indptr, config = R.generate_input(3, 1, 40, seed=5)
    assert q.dtype == torch.bfloat16 and tuple(q.shape) == (3, 16, 576)
    assert tuple(kv_data["bf16"].shape) == (120, 1, 576)
    kv_fp8, scale = kv_data["fp8"]
    assert kv_fp8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and tuple(scale.shape) == (1,)
    fp4, fp4_scale = kv_data["mxfp4"]
    assert tuple(fp4.shape) == (120, 1, 288) and tuple(fp4_scale.shape) == (256, 24)
    assert qo_indptr.tolist() == [0, 1, 2, 3] and kv_indptr.tolist() == [0, 40, 80, 120]
    assert qo_indptr.dtype == kv_indptr.dtype == torch.int32
    assert config["kv_seq_len"] == 40 and config["sm_scale"] == R.SM_SCALE
    # Same seed, same data; another seed, other data.
    assert torch.equal(R.generate_input(3, 1, 40, seed=5)[0], q)
    assert not torch.equal(R.generate_input(3, 1, 40, seed=6)[0], q)
    assert R.generate_varlen_input([3, 9], seed=1)[4]["kv_seq_len"] == 9  # variable length: the maximum


@pytest.fixture(scope="module")
def case():
    data = R.generate_varlen_input([1024, 1024, 5, 1, 300], seed=3, device=torch.device("cpu"))
    return data, R.ref_kernel(data)


def test_check_accepts_correct_outputs(case, monkeypatch):
    data, ref = case
    assert R.check_implementation(data, ref.clone())[0]
    ok, msg = R.check_implementation(data, fp32_attention(data, "fp8").bfloat16())
    assert ok and "rel_l2=" in msg and "bound 0.08" in msg
    monkeypatch.setenv("MLA_KV_FORMAT", "mxfp4")
    out4 = fp32_attention(data, "mxfp4").bfloat16()
    assert R.check_implementation(data, out4)[0]
    monkeypatch.setenv("MLA_KV_FORMAT", "fp8")
    assert not R.check_implementation(data, out4)[0]  # the 4-bit error is over the FP8 bound


def half_cache_output(data):
    """The page_size=2 bug: attend to the even tokens only."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv = kv_data["bf16"]
    out = torch.zeros(q.shape[0], 16, 512)
    for b, (k0, k1) in enumerate(zip(kv_indptr[:-1].tolist(), kv_indptr[1:].tolist(), strict=True)):
        rows = kv[k0:k1:2]
        out[b] = R.attention_reference(q[b:b + 1], rows, torch.tensor([0, 1]), torch.tensor([0, rows.shape[0]]),
                                       config["sm_scale"])[0]
    return out.bfloat16()


NEGATIVE_CONTROLS = {
    "zeros": lambda data, ref: torch.zeros_like(ref),
    "nan": lambda data, ref: ref.clone().index_fill_(0, torch.tensor([1]), float("nan")),
    "inf": lambda data, ref: ref.clone().index_fill_(1, torch.tensor([3]), float("inf")),
    "wrong_shape": lambda data, ref: ref[:, :, :256].clone(),
    "wrong_dtype": lambda data, ref: ref.float(),
    "half_cache": lambda data, ref: half_cache_output(data),
    "unscaled_fp8": lambda data, ref: R.attention_reference(
        data[0], data[1]["fp8"][0].float(), data[2], data[3], data[4]["sm_scale"]).bfloat16(),
    "one_sequence_missing": lambda data, ref: ref.clone().index_fill_(0, torch.tensor([0]), 0.0),
    "not_a_tensor": lambda data, ref: ref.tolist(),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE_CONTROLS))
def test_check_rejects_wrong_outputs(case, name):
    data, ref = case
    ok, msg = R.check_implementation(data, NEGATIVE_CONTROLS[name](data, ref))
    assert not ok, msg


def test_strict_gate_rejects_zeros_where_the_leaderboard_rule_passes():
    # With long sequences the outputs are ~0.04 in size, so rtol=atol=0.1 accepts an all-zero output.
    data = R.generate_varlen_input([8192] * 2, seed=9, device=torch.device("cpu"))
    ref = R.ref_kernel(data)
    zeros = torch.zeros_like(ref)
    assert R.leaderboard_match(zeros, ref, 0.1, 0.1, 0.05)[0]
    ok, msg = R.check_implementation(data, zeros)
    assert not ok and "strict gate" in msg


@pytest.mark.parametrize("kv_lens", [[1024] * 4, [1, 7, 37, 5, 1], [8192]])
def test_measured_quantization_error_is_within_the_bounds(kv_lens):
    """The bounds in REL_L2_BOUND hold with margin for exact fp32 math over each quantized cache."""
    data = R.generate_varlen_input(kv_lens, seed=21, device=torch.device("cpu"))
    ref = R.ref_kernel(data)
    fp8 = R.worst_row_relative_l2(fp32_attention(data, "fp8").bfloat16(), ref)
    mx = R.worst_row_relative_l2(fp32_attention(data, "mxfp4").bfloat16(), ref)
    assert 0.005 < fp8 < R.REL_L2_BOUND["fp8"] / 1.5
    assert 0.03 < mx < R.REL_L2_BOUND["mxfp4"] / 1.5


def test_mxfp4_agrees_with_aiter_where_aiter_imports():
    """On a ROCm machine with aiter, generate_input uses aiter's quantizer: ours must give the same bytes."""
    fp4_utils = pytest.importorskip("aiter.utility.fp4_utils", reason="aiter is only on AMD machines")
    torch.manual_seed(3)
    x = torch.randn(512, 576, dtype=torch.bfloat16, device="cuda")
    packed, scales = fp4_utils.dynamic_mxfp4_quant(x)
    padded = scales.shape[1] != 18  # (512, 24) from the runner's aiter, (512, 18) from aiter since 2026-03-18
    ties = "away" if padded else "even"  # the runner's aiter pads and ties away; aiter from 2026-03-18 does neither
    ours_packed, ours_scales = R.quantize_mxfp4(x, ties=ties, padded=padded)
    assert torch.equal(packed.view(torch.uint8), ours_packed.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8)[:512, :18], ours_scales.view(torch.uint8)[:512, :18])


def task_yml_cases(section):
    with open(Path(__file__).parent.parent / "task.yml") as f:
        return yaml.safe_load(f)[section]


@pytest.mark.gpu
@pytest.mark.parametrize("case", task_yml_cases("tests"), ids=lambda c: f"{c['batchsize']}x{c['kvseqlen']}")
def test_zeros_are_rejected_on_every_task_yml_case(case):
    """An all-zero output has relative error 1.0 in every sequence: the strict gate rejects it on every case, also
    where the leaderboard rule alone accepts it (64 x 8192, 256 x 8192)."""
    data = R.generate_input(**case)
    ref = R.ref_kernel(data)
    ok, msg = R.check_implementation(data, torch.zeros_like(ref))
    assert not ok, msg
    assert R.check_implementation(data, ref)[0]
