"""MLA decode (DeepSeek's multi-head latent attention, forward_absorb form) over paged FP8, MXFP4 and BF16 caches,
on NVIDIA (CUDA and Triton kernels), AMD (aiter and Triton) and any CPU (torch).

    out, lse = mla_decode.mla_decode_with_kvcache(q, kv_cache, block_table, cache_seqlens, kv_scale)

or, for a serving loop and CUDA graphs, a plan made once and run many times:

    decode = mla_decode.plan(batch_size, page_size, max_pages, kv_cache.dtype, device)
    out, lse = decode.run(q, kv_cache, block_table, cache_seqlens, kv_scale)

mla_decode.api's docstring gives the layouts.
"""

__version__ = "0.2.0"

from .api import DecodePlan, StepSchedule, mla_decode_with_kvcache, plan, plan_ragged
from .backends import BACKEND_REGISTRY, BACKENDS, select_backend
from .contract import KV_FORMATS, LAYOUTS, PRECISIONS, Problem

__all__ = ["__version__", "BACKEND_REGISTRY", "BACKENDS", "KV_FORMATS", "LAYOUTS", "PRECISIONS", "DecodePlan",
           "Problem", "StepSchedule", "mla_decode_with_kvcache", "plan", "plan_ragged", "select_backend"]
