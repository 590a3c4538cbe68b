"""The aiter path's Q quantization (QQuantizer of mla_decode/aiter_backend.py, reached as submission.QQuantizer)
against reference.quantize_fp8: the inputs and the assertion that its torch form (tests/test_aiter_backend.py) and its
triton form (tests/test_triton.py, interpreted and on a GPU) share."""

import torch

import reference as R
import submission as S

AMAXES = (0.0, 1e-30, 1e-15, 1e-6, 2.7e-5, 4.0, 1e3, 3.3e38)  # largest |q|: 0 to near the bf16 maximum 3.39e38


def scaled_q(batch: int, amax: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """A random bf16 Q (batch, 16, 576) whose largest |q| is `amax`."""
    q = torch.randn((batch, S.NUM_HEADS, S.QK_HEAD_DIM), device=device)
    q = (q / q.abs().max() * amax).to(torch.bfloat16)
    assert torch.isfinite(q).all()
    return q


def assert_quantized_as_the_reference(q: torch.Tensor, quant: "S.QQuantizer", fp8: torch.dtype, exact: bool) -> None:
    """quant(q) is reference.quantize_fp8(q, fp8) bit for bit, values and scale; where `exact` is False (the torch
    form's one-kernel scale), max|q| in [4.7e-20, 2.7e-5) may instead give a scale at most 1e-12 / fp8 max above the
    reference's, the values its quantization."""
    q8 = quant(q)
    want, want_scale = R.quantize_fp8(q, fp8)
    assert torch.isfinite(q8.float()).all() and torch.isfinite(quant.scale).all()
    top = q.abs().max().item()
    if exact or top >= 2.7e-5 or top < 4.7e-20:
        assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8)) and torch.equal(quant.scale, want_scale)
    else:
        assert want_scale <= quant.scale <= want_scale * (1 + 2**-23) + 1e-12 / torch.finfo(fp8).max
        assert torch.equal(q8, (q.float() / quant.scale).to(fp8))
