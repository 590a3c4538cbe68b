"""The cuda backend (NVIDIA): CUDA kernels (csrc/) built at first use with the machine's nvcc and called through
ctypes. One split kernel per GPU family, each for the ragged and the paged layout: on Hopper (sm_90a) warpgroup MMAs
on FP8 (MXFP4 dequantized to e5m2), a CTA serving 16, 32 or 64 query rows; elsewhere (sm_80+, and the precise mode)
mma.sync in fp16 on 16 rows. With several splits per sequence the CTAs merge their own partials: one launch a call.
build.py builds and loads the library, plan.py plans a launch on the CPU, decode.py launches it; docs/design-notes.md
has the measurements behind each choice. Nothing here imports the rest of mla_decode.
"""

from .decode import CudaDecode, cuda_unusable_reason, launch_splits
from .plan import LaunchKey

__all__ = ["CudaDecode", "LaunchKey", "cuda_unusable_reason", "launch_splits"]
