"""GPU negative controls: each GPU kernel's output is held, per sequence (the worst one), to the float64 emulation of
what it rounds (reference.kernel_emulation) under a bound that the same kernel fails with a planted bug: sm_scale 1%
high, the output 2% high, one sequence's last KV row left out. The calls, the batches and the measurements behind the
bounds are bench/negative_controls.py's (docs/2026-12-01-amd-check.md has the table).

Two kinds of data. On random-normal data the cuda backend's wgmma kernels (FP8 and MXFP4) have no bound: they round
P to e4m3, and the FP8 MMA's scores (Hopper's keeps ~14 bits of each sum) move enough of those roundings that the
correct kernel is 2.5e-2 from its emulation, against 2.9-3.1e-2 with sm_scale x 1.01. On grid data
(reference.generate_grid_input) every kernel's roundings are exact and every kernel has a bound.
"""

import pytest
import torch
from bench_scripts import load_bench_script

import reference as R

NC = load_bench_script("negative_controls")

# (kernel, data) -> the bound on the worst sequence's error against the emulation. Measured on the H200
# (bench/negative_controls.py, 2026-12-01; both batches of each kind), the correct call / the smallest planted bug:
# random: triton fp8 fast 6.5e-3 / 1.37e-2; cuda mma.sync 2.3e-3 / 1.34e-2; triton fp8 precise 1.7e-3 / 1.32e-2;
# triton mxfp4 1.7e-3 / 1.41e-2. grid (23:05): cuda wgmma fp8 and mxfp4 and mma.sync 2.4e-3 / 1.15e-2 (wgmma 1.70e-2),
# the triton kernels 1.7e-3 / 1.09e-2.
BOUNDS = {("triton fp8 fast", "random"): 1.0e-2, ("cuda mma.sync fp8", "random"): 6e-3,
          ("triton fp8 precise", "random"): 6e-3, ("triton mxfp4", "random"): 6e-3}
BOUNDS |= {(kernel, "grid"): R.GRID_REL_L2_BOUND for kernel in NC.KERNELS}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                                reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module", params=NC.BATCHES)
def batch(request):
    return request.param, NC.batch_input(request.param)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", sorted(NC.KERNELS))
def test_the_kernel_meets_its_bound_and_every_planted_bug_fails_it(batch, kernel):
    name, data = batch
    data_kind = name.split(" ")[0]
    bound = BOUNDS.get((kernel, data_kind))
    if bound is None:
        pytest.skip(f"{kernel} has no separating bound on {name} data (the module's docstring says why)")
    backend, kv_format, _, emulation = NC.KERNELS[kernel]
    if backend == "cuda":
        pytest.importorskip("mla_decode_cuda")
    exact = R.kernel_emulation(data, emulation, kv_format)
    correct = NC.call(kernel, data, "correct")
    assert R.worst_row_relative_l2(correct, exact) < bound
    if kv_format == "fp8" or data_kind == "grid":  # a 1-row MXFP4 sequence of random data misses the leaderboard's
        # rule by its quantization alone; the grid's MXFP4 cache is exact
        ok, msg = R.check_implementation(data, correct, kv_format)
        assert ok, msg
    for bug in NC.BUGS[1:]:
        error = R.worst_row_relative_l2(NC.call(kernel, data, bug), exact)
        assert error > bound, f"{kernel} with '{bug}' passes the bound: {error:.3e} < {bound:g}"
