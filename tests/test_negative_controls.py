"""GPU negative controls: each GPU kernel's output is held, per sequence (the worst one), to the float64 emulation of
what it rounds (reference.kernel_emulation) under a bound that the same kernel fails with a planted bug: sm_scale 1%
high, the output 2% high, one sequence's last KV row left out. The calls and the measurements behind the bounds are
bench/negative_controls.py's (docs/2026-12-01-amd-check.md has the table).

Not here: the cuda backend's wgmma kernels (FP8 and MXFP4). Their emulation ("+Q+P") does not model the FP8 MMA's
accumulation (Hopper's keeps ~14 bits of each sum), which leaves them 2.5e-2 from it, while sm_scale x 1.01 gives
2.9-3.1e-2: no bound separates the two; they keep tests/test_cuda.py's checks.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

import reference as R

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("negative_controls", ROOT / "bench" / "negative_controls.py")
NC = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(NC)

# Measured on the H200 (bench/negative_controls.py, 2026-12-01; both batches of NC.BATCHES): worst-sequence error of
# the correct call / of the smallest planted bug. triton fp8 fast 6.5e-3 / 1.37e-2; cuda mma.sync 2.3e-3 / 1.34e-2;
# triton fp8 precise 1.7e-3 / 1.32e-2; triton mxfp4 1.7e-3 / 1.41e-2.
BOUNDS = {"triton fp8 fast": 1.0e-2, "cuda mma.sync fp8": 6e-3, "triton fp8 precise": 6e-3, "triton mxfp4": 6e-3}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                                reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module", params=sorted(NC.BATCHES))
def batch(request):
    data = R.generate_varlen_input(NC.BATCHES[request.param], seed=len(NC.BATCHES[request.param]))
    return request.param, data


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", sorted(BOUNDS))
def test_the_kernel_meets_its_bound_and_every_planted_bug_fails_it(batch, kernel):
    _, data = batch
    backend, kv_format, _, emulation = NC.KERNELS[kernel]
    if backend == "cuda":
        pytest.importorskip("mla_decode_cuda")
    exact = R.kernel_emulation(data, emulation, kv_format)
    bound = BOUNDS[kernel]
    correct = NC.call(kernel, data, "correct")
    assert R.worst_row_relative_l2(correct, exact) < bound
    if kv_format == "fp8":  # a 1-row MXFP4 sequence misses the leaderboard's rule by its quantization alone
        ok, msg = R.check_implementation(data, correct, kv_format)
        assert ok, msg
    for bug in NC.BUGS[1:]:
        error = R.worst_row_relative_l2(NC.call(kernel, data, bug), exact)
        assert error > bound, f"{kernel} with '{bug}' passes the bound: {error:.3e} < {bound:g}"
