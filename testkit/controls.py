"""Negative controls: each GPU kernel through custom_kernel, correct and with a planted bug, on the batches its
bounds were measured on. bench/negative_controls.py measures them; tests/test_negative_controls.py holds each kernel
to a bound every bug fails.

The bugs are made by changing the call, not the kernel:
  sm_scale x 1.01   the kernel run with config["sm_scale"] 1% high
  out x 1.02        its output scaled by 1.02
  last row dropped  the first sequence's last KV row left out (kv_indptr[1] - 1: the next sequence gains it)
"""

import torch

import reference as R
from testkit.emulation import emulate
from testkit.inputs import generate_grid_input
from utils import scoped_env

# name -> (backend, KV format, precision)
KERNELS = {
    "cuda wgmma fp8": ("cuda", "fp8", "fast"),
    "cuda mma.sync fp8": ("cuda", "fp8", "precise"),
    "cuda mxfp4": ("cuda", "mxfp4", "fast"),
    "triton fp8 fast": ("triton", "fp8", "fast"),
    "triton fp8 precise": ("triton", "fp8", "precise"),
    "triton mxfp4": ("triton", "mxfp4", "fast"),
}
LENGTHS = {"mixed": [8191, 1, 4096, 0, 517, 33], "uniform 64x1024": [1024] * 64}
DATA = {"random": R.generate_varlen_input, "grid": generate_grid_input}
BATCHES = [(kind, lengths) for kind in DATA for lengths in LENGTHS]  # ("random", "mixed"), ...


def batch_input(batch: tuple[str, str]):
    """The input of a BATCHES entry (data kind, lengths name), the same on every call."""
    kind, lengths = batch
    return DATA[kind](LENGTHS[lengths], seed=len(LENGTHS[lengths]))


BUGS = ("correct", "sm_scale x 1.01", "out x 1.02", "last row dropped")


def with_bug(run, data, bug: str) -> torch.Tensor:
    """run(data) (a decode of an input tuple) with `bug` (BUGS) planted by changing the call, not the kernel."""
    q, kv_data, qo, kvp, config = data
    if bug == "sm_scale x 1.01":
        config = dict(config, sm_scale=config["sm_scale"] * 1.01)
    elif bug == "last row dropped":
        kvp = kvp.clone()
        kvp[1] -= 1
        config = dict(config, kv_seq_len=None)
    out = run((q, kv_data, qo, kvp, config))
    return out.float() * 1.02 if bug == "out x 1.02" else out


def exact(kernel: str, data) -> torch.Tensor:
    """The float64 emulation of what the kernel rounds on `data` (testkit.emulation.emulate), what every call is
    held to."""
    return emulate(data, *KERNELS[kernel])


def call(kernel: str, data, bug: str) -> torch.Tensor:
    """custom_kernel with the kernel's backend, format and precision forced, and `bug` planted."""
    import submission

    backend, kv_format, precision = KERNELS[kernel]
    with scoped_env({"MLA_BACKEND": backend, "MLA_KV_FORMAT": kv_format, "MLA_PRECISION": precision}):
        return with_bug(submission.custom_kernel, data, bug)
