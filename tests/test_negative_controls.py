"""GPU negative controls: each GPU kernel's output is held, per sequence (the worst one), to the float64 emulation of
what it rounds (testkit.emulation.emulate) under a bound that the same kernel fails with a planted bug: sm_scale 1%
high, the output 2% high, one sequence's last KV row left out. The calls, the batches and the measurements behind the
bounds are testkit/controls.py's, measured by bench/negative_controls.py (docs/2026-12-01-amd-check.md has the table).

Two kinds of data, random-normal and grid (testkit.inputs.generate_grid_input, on which every kernel's roundings are
exact). On random data the cuda wgmma kernels (FP8 and MXFP4) are held loosest: their e4m3 P is emulated exactly
(testkit.emulation.emulate walks their splits and tiles), but their FP8 scores still move a few of its roundings.
"""

import pytest
import torch

import reference as R
import testkit.controls as NC
from testkit.emulation import E4M3_P_RANDOM_BOUND, emulation_of
from testkit.inputs import GRID_REL_L2_BOUND

# (kernel, data) -> the bound on the worst sequence's error against the emulation. Measured on the H200
# (bench/negative_controls.py, 2026-12-01, both batches of each kind), the correct call / the smallest planted bug:
# random: cuda wgmma fp8 8.0e-3 / 2.07e-2 (9.6e-3 at worst over test_cuda_gpu's shapes), cuda mxfp4 6.0e-3 / 2.03e-2;
# triton fp8 fast 2.0e-3 / 1.30e-2; cuda mma.sync 2.3e-3 / 1.34e-2; triton fp8 precise 1.7e-3 / 1.32e-2; triton mxfp4
# 1.7e-3 / 1.41e-2. grid: every kernel 1.7-2.4e-3 / 1.09e-2 or more.
# Kernels that round P to e4m3 (the cuda wgmma kernels; the triton backend's Hopper kernel, whose measurement on
# random data was 3.6e-3 to 9.6e-3 against its emulation over the task shapes, H200 2026-12-03) take the looser bound.
# The triton precise figures are the portable kernel's; on sm_90 the Hopper kernel's precise mode serves those calls
# now and passed the same bound and planted bugs (H200 2026-12-03; its own figures not measured).


def bound_of(kernel: str, data_kind: str, data) -> float:
    if data_kind == "grid":
        return GRID_REL_L2_BOUND
    return E4M3_P_RANDOM_BOUND if emulation_of(data, *NC.KERNELS[kernel])[0] == "+Q+P" else 6e-3


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                                reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module", params=NC.BATCHES, ids=" ".join)
def batch(request):
    return request.param, NC.batch_input(request.param)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", sorted(NC.KERNELS))
def test_the_kernel_meets_its_bound_and_every_planted_bug_fails_it(batch, kernel):
    (data_kind, _), data = batch
    bound = bound_of(kernel, data_kind, data)
    backend, kv_format, _ = NC.KERNELS[kernel]
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    exact = NC.exact(kernel, data)
    correct = NC.call(kernel, data, "correct")
    assert R.worst_row_relative_l2(correct, exact) < bound
    if kv_format == "fp8" or data_kind == "grid":  # a 1-row MXFP4 sequence of random data misses the leaderboard's
        # rule by its quantization alone; the grid's MXFP4 cache is exact
        ok, msg = R.check_implementation(data, correct, kv_format)
        assert ok, msg
    for bug in NC.BUGS[1:]:
        error = R.worst_row_relative_l2(NC.call(kernel, data, bug), exact)
        assert error > bound, f"{kernel} with '{bug}' passes the bound: {error:.3e} < {bound:g}"
