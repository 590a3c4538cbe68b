"""The raw handle of the current CUDA stream on a device: what contract.caller_key keys the plans' workspaces by, so
that callers on two streams never share partials.

Not part of the leaderboard file: the leaderboard's server refuses an upload holding the word "stream" in any case, and
tools/bundle.py inlines only the modules the adapter imports at their top level. caller_key imports this module where
the mla_decode package is installed; the leaderboard file alone keys by thread, its one caller launching on one
stream.
"""

import torch

_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def current_handle(device: torch.device) -> int:
    """The current stream's raw handle on `device` (a GPU), through the private call Triton and Inductor make:
    torch.cuda.current_stream builds a Stream object each call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream
