"""testkit/attention.py, the backend tests' shared reference: it reads what each backend reads, and its check
fails on wrong outputs."""

import numpy as np
import pytest
import torch

import reference as R
from testkit.attention import assert_matches, dequantized_cache, fp8_per_head, fp8_per_tensor, fp32_attention

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def data():
    return R.generate_varlen_input([40, 0, 1, 300], seed=17, device=CPU)


def test_dequantized_cache_is_the_cache_each_format_holds(data):
    kv_data = data[1]
    fp8, scale = kv_data["fp8"]
    assert torch.equal(dequantized_cache(kv_data, "fp8"), fp8.float() * scale)
    mxfp4 = dequantized_cache(kv_data, "mxfp4")
    assert mxfp4.shape == kv_data["bf16"].shape and mxfp4.dtype == torch.float32
    assert torch.equal(mxfp4, R.dequantize_mxfp4(*kv_data["mxfp4"]))
    for fmt, bound in (("fp8", 0.07), ("mxfp4", 0.2)):  # each close to the bf16 cache, none equal to it
        rel = R.relative_l2(dequantized_cache(kv_data, fmt), kv_data["bf16"])
        assert 1e-3 < rel < bound, (fmt, rel)
    with pytest.raises(ValueError, match="kv_format: expected 'fp8' or 'mxfp4', got 'bf16'"):
        dequantized_cache(kv_data, "bf16")


def test_fp32_attention_is_float64_attention_over_the_dequantized_data(data):
    q, kv_data, qo, kvp, config = data
    for fmt in ("fp8", "mxfp4"):
        for q_used in (None, fp8_per_head(q), fp8_per_tensor(q)):
            exact = R.attention_reference(q if q_used is None else q_used, dequantized_cache(kv_data, fmt).double(),
                                          qo, kvp, config["sm_scale"], compute_dtype=torch.float64)
            out = fp32_attention(data, fmt, q_used)
            assert out.dtype == torch.float32 and R.worst_row_relative_l2(out, exact) < 1e-5


def test_fp8_q_forms(data):
    q = data[0]
    q8, scale = R.quantize_fp8(q, torch.float8_e4m3fn)
    assert torch.equal(fp8_per_tensor(q), q8.float() * scale)
    per_head = fp8_per_head(q)
    peak = per_head.abs().amax(dim=-1)  # each head's largest |q| maps to 448, an e4m3 value: kept but for fp32 ulps
    torch.testing.assert_close(peak, q.float().abs().amax(dim=-1), rtol=1e-6, atol=0)
    for form in (per_head, fp8_per_tensor(q)):
        rel = R.relative_l2(form, q)
        assert 1e-3 < rel < 0.06, rel  # E4M3: 3 mantissa bits


def test_fp8_per_head_scales_by_the_quotient_the_kernel_computes():
    """448 / max|q_h| as the IEEE fp32 quotient (numpy's, the interpreted kernel's), not 448 times a reciprocal:
    an ulp of the scale moves the values at an E4M3 rounding tie by a whole step."""
    q = torch.randn((256, 16, 576), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    scale = torch.from_numpy(np.float32(448.0) / q.float().abs().amax(dim=-1, keepdim=True).numpy())
    assert torch.equal(fp8_per_head(q), (q.float() * scale).to(torch.float8_e4m3fn).float() / scale)


def test_assert_matches_accepts_the_rounded_exact_output_and_rejects_wrong_ones(data):
    exact = fp32_attention(data, "fp8")
    assert "BF16 truth" in assert_matches(data, exact.bfloat16(), exact, 4e-3)
    one_missing = exact.bfloat16().index_fill_(0, torch.tensor([3]), 0.0)
    empty_not_zero = exact.bfloat16().index_fill_(0, torch.tensor([1]), 1e-3)
    for wrong in (torch.zeros_like(exact, dtype=torch.bfloat16), one_missing, empty_not_zero):
        with pytest.raises(AssertionError, match="worst_row_relative_l2"):
            assert_matches(data, wrong, exact, 4e-3)
    with pytest.raises(AssertionError, match="failed"):  # a metric that passes anything: the BF16 truth still fails it
        assert_matches(data, torch.zeros_like(exact, dtype=torch.bfloat16), exact, 4e-3, metric=lambda out, ref: 0.0)
