"""FlashMLA's decode interface over mla_decode's plans: an engine that calls FlashMLA's dense decode switches by
changing its import,

    from mla_decode.flash_mla import get_mla_metadata, flash_mla_with_kvcache, flash_mla_with_kvcache_fp8

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)  # once a step
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                      tile_scheduler_metadata, num_splits, causal=True)  # each layer

The names, order and defaults of the arguments are those of flash_mla/flash_mla_interface.py in vllm-project/FlashMLA
at 46d64a8ebef03fa50b4ae74937276a5c940e3f95 (the commit vLLM pins); backend and precision come after them, keyword
only. Served: the dense decode, a BF16 cache (flash_mla_with_kvcache) or an FP8 e4m3 cache with one scale for the
whole cache (flash_mla_with_kvcache_fp8), page sizes of any size, s_q >= 1, causal or not, on whatever backend
`auto` picks (torch on the CPU). Refused with a ValueError naming the argument: sparse attention (topk, indices),
FlashMLA's 656-byte "FP8 with scale" cache (is_fp8_kvcache=True in flash_mla_with_kvcache), fp16, and more than one
KV head.

Shapes (FlashMLA's):
  q:             (batch, s_q, h_q, 576) bfloat16 (flash_mla_with_kvcache_fp8: float8_e4m3fn, with descale_q)
  k_cache:       (num_blocks, page_block_size, 1, 576) bfloat16 (or float8 e4m3 with descale_k), contiguous
  block_table:   (batch, max_num_blocks_per_seq) int32
  cache_seqlens: (batch,) int32, contiguous
  out:           (batch, s_q, h_q, 512) bfloat16
  lse:           (batch, h_q, s_q) float32: the natural log of the softmax denominator of the scaled scores, as
                 FlashMLA's; +inf (FlashMLA's value, where mla_decode's is -inf) for a query that sees no key
"""

import math

import torch

from .api import DecodePlan, make_problem, version_of
from .contract import (
    DEFAULT_SOFTMAX_SCALE,
    FP8_DTYPES,
    NUM_KV_HEADS,
    PLAN_CACHE_LIMIT,
    QK_HEAD_DIM,
    V_HEAD_DIM,
    expect,
    expect_int,
    expect_on_device,
    expect_softmax_scale,
    expect_tensor,
    remember,
)

__all__ = ["MlaMetadata", "flash_mla_with_kvcache", "flash_mla_with_kvcache_fp8", "get_mla_metadata"]

_PLANS: dict = {}  # the Problem's inputs and the backend -> DecodePlan; bounded by PLAN_CACHE_LIMIT


class MlaMetadata:
    """What get_mla_metadata returns in place of FlashMLA's tile_scheduler_metadata tensor: opaque to the engine, which
    passes it to flash_mla_with_kvcache with the same cache_seqlens and nothing else.

    It holds the cache_seqlens tensor it was made from (a reference, so that memory cannot be freed and reused by
    another tensor while the metadata lives), that tensor's version counter at the time (an in-place write after it
    makes the metadata stale), and the facts given with it: num_q_tokens_per_head_k (s_q * h_q // h_kv), num_heads_k,
    num_heads_q and is_fp8_kvcache. Making it reads no length on the host and launches one small kernel (num_splits),
    so it can run inside a CUDA graph capture.

    `schedules` holds the step's schedule of each plan that ran with it (DecodePlan.schedule(cache_seqlens), made on the
    GPU at the first layer that runs that plan and reused by the later layers of the step: the work-balanced schedule
    where the plan cuts one, else an empty one)."""

    __slots__ = ("cache_seqlens", "version", "num_q_tokens_per_head_k", "num_heads_k", "num_heads_q",
                 "is_fp8_kvcache", "schedules")

    def __init__(self, cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                 num_heads_q: int | None, is_fp8_kvcache: bool):
        self.cache_seqlens = cache_seqlens
        self.version = version_of(cache_seqlens)
        self.num_q_tokens_per_head_k = num_q_tokens_per_head_k
        self.num_heads_k = num_heads_k
        self.num_heads_q = num_heads_q
        self.is_fp8_kvcache = is_fp8_kvcache
        self.schedules: dict = {}

    def __repr__(self) -> str:
        return (f"MlaMetadata(batch={self.cache_seqlens.shape[0]}, num_q_tokens_per_head_k="
                f"{self.num_q_tokens_per_head_k}, num_heads_k={self.num_heads_k}, num_heads_q={self.num_heads_q}, "
                f"is_fp8_kvcache={self.is_fp8_kvcache}, device={self.cache_seqlens.device})")


def _same_tensor(held: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether `given` is `held` or a view of exactly its elements. `held` is kept alive by the metadata, so no other
    live tensor's storage can start at its address: comparing storages and views is comparing tensors."""
    if given is held:
        return True
    return (given.device == held.device and given.dtype == held.dtype and given.shape == held.shape
            and given.stride() == held.stride() and given.storage_offset() == held.storage_offset()
            and given.untyped_storage().data_ptr() == held.untyped_storage().data_ptr())


def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_heads_q: int | None = None, is_fp8_kvcache: bool = False, topk: int | None = None
                     ) -> tuple[MlaMetadata, torch.Tensor]:
    """FlashMLA's get_mla_metadata -> (tile_scheduler_metadata, num_splits), once a decode step, before the layers.

    cache_seqlens: (batch,) int32, contiguous: the same tensor (or a view of exactly its elements) must be passed to
    every flash_mla_with_kvcache call that uses the result, unwritten in between.
    num_q_tokens_per_head_k: s_q * h_q // h_kv. num_heads_k: 1 (MLA's one latent KV head). num_heads_q: h_q, optional.
    is_fp8_kvcache: True for the calls of flash_mla_with_kvcache_fp8. topk: must be None (no sparse attention).

    Returns an MlaMetadata (opaque: pass it along) and num_splits, (batch + 1,) int32 on cache_seqlens' device: one
    split a sequence as a prefix sum (0, 1, ..., batch), for engines that pass it along or copy it; the kernels do not
    read it. Nothing is read on the host."""
    expect(topk is None, "topk", "None (mla_decode serves the dense decode, not sparse attention)", topk)
    expect_tensor(cache_seqlens, "cache_seqlens")
    expect(cache_seqlens.dtype == torch.int32, "cache_seqlens.dtype", "torch.int32", cache_seqlens.dtype)
    expect(cache_seqlens.dim() == 1 and cache_seqlens.shape[0] >= 1, "cache_seqlens.shape", "(batch,), batch >= 1",
           tuple(cache_seqlens.shape))
    expect(cache_seqlens.is_contiguous(), "cache_seqlens", "a contiguous tensor", "a strided view")
    expect_int(num_q_tokens_per_head_k, "num_q_tokens_per_head_k", 1)
    expect_int(num_heads_k, "num_heads_k", 1)
    expect(num_heads_k == NUM_KV_HEADS, "num_heads_k", f"{NUM_KV_HEADS} (MLA's latent KV head)", num_heads_k)
    if num_heads_q is not None:
        expect_int(num_heads_q, "num_heads_q", 1)
        expect(num_q_tokens_per_head_k % (num_heads_q // num_heads_k) == 0, "num_q_tokens_per_head_k",
               f"s_q * h_q // h_kv, a multiple of num_heads_q // num_heads_k = {num_heads_q // num_heads_k}",
               num_q_tokens_per_head_k)
    if not isinstance(is_fp8_kvcache, bool):
        raise TypeError(f"is_fp8_kvcache: expected a bool, got {type(is_fp8_kvcache).__name__}")
    batch = cache_seqlens.shape[0]
    num_splits = torch.arange(batch + 1, dtype=torch.int32, device=cache_seqlens.device)
    return MlaMetadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache), num_splits


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: MlaMetadata,
                           num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None, *,
                           backend: str = "auto", precision: str = "fast") -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense decode over a paged BF16 cache -> (out (b, s_q, h_q, 512) bf16, lse (b, h_q, s_q) fp32).

    q (b, s_q, h_q, 576) bf16; k_cache (num_blocks, page_block_size, 1, 576) bf16, contiguous; block_table
    (b, max_num_blocks_per_seq) int32; cache_seqlens (b,) int32: sequence i owns its first cache_seqlens[i] slots, in
    table order; head_dim_v: 512; tile_scheduler_metadata, num_splits: get_mla_metadata's, made from this
    cache_seqlens (a ValueError otherwise). softmax_scale: default 576 ** -0.5 (FlashMLA's head_dim ** -0.5).
    causal (s_q > 1): query token t sees the first cache_seqlens[i] - s_q + 1 + t slots. is_fp8_kvcache, indices:
    False and None (FlashMLA's "FP8 with scale" cache and sparse attention are not served; an FP8 cache with one
    scale goes to flash_mla_with_kvcache_fp8). backend, precision: mla_decode.plan's; BF16's products are the same in
    either precision."""
    expect(indices is None, "indices", "None (mla_decode serves the dense decode, not sparse attention)",
           "a tensor" if isinstance(indices, torch.Tensor) else type(indices).__name__)
    expect(is_fp8_kvcache is False, "is_fp8_kvcache",
           "False (FlashMLA's 656-byte 'FP8 with scale' cache is not served; an FP8 e4m3 cache with one scale goes to "
           "flash_mla_with_kvcache_fp8)", is_fp8_kvcache)
    expect_tensor(q, "q")
    expect(q.dtype == torch.bfloat16, "q.dtype", "torch.bfloat16 (mla_decode's kernels take bf16 q)", q.dtype)
    expect_tensor(k_cache, "k_cache")
    expect(k_cache.dtype == torch.bfloat16, "k_cache.dtype",
           "torch.bfloat16, q's (an FP8 cache goes to flash_mla_with_kvcache_fp8)", k_cache.dtype)
    return _decode(q, k_cache, None, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                   softmax_scale, causal, False, backend, precision)


def flash_mla_with_kvcache_fp8(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: MlaMetadata,
                               num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                               descale_q: torch.Tensor | None = None, descale_k: torch.Tensor | None = None, *,
                               backend: str = "auto", precision: str = "precise"
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense FP8 decode -> (out (b, s_q, h_q, 512) bf16, lse (b, h_q, s_q) fp32): q and the cache in
    float8 e4m3, each with one float32 scale, q ~= q_fp8 * descale_q and kv ~= k_cache * descale_k.

    q (b, s_q, h_q, 576) and k_cache (num_blocks, page_block_size, 1, 576), contiguous, of one FP8 dtype
    (float8_e4m3fn; float8_e4m3fnuz where the backend reads it); descale_q, descale_k: (1,) float32 on q's device,
    both required. The other arguments are flash_mla_with_kvcache's; get_mla_metadata is called with
    is_fp8_kvcache=True for these calls.

    descale_k is the cache's scale as mla_decode takes it (kv_scale). mla_decode's kernels take q in bf16, so q is
    dequantized first, (q.float() * descale_q) rounded to bf16: exact when descale_q is a power of two (e4m3's 3
    mantissa bits fit bf16's 7), else each element rounded to bf16, relative error <= 2^-9; one elementwise pass
    over q. precision: "precise" (the default) computes the scores with that q as it is, as FlashMLA's kernel does
    with its FP8 q; "fast" rounds q to e4m3 per head once more for FP8 products (faster, less exact)."""
    expect_tensor(q, "q")
    expect(q.dtype in FP8_DTYPES, "q.dtype", f"one of {FP8_DTYPES} (FlashMLA's FP8 q, with descale_q)", q.dtype)
    expect_tensor(k_cache, "k_cache")
    expect(k_cache.dtype == q.dtype, "k_cache.dtype", f"{q.dtype}, q's", k_cache.dtype)
    _expect_descale(descale_q, "descale_q", q.device)
    _expect_descale(descale_k, "descale_k", q.device)
    expect(q.dim() == 4 and q.shape[-1] == QK_HEAD_DIM, "q.shape", f"(batch, s_q, h_q, {QK_HEAD_DIM})",
           tuple(q.shape))
    # Our kernels take bf16 q: dequantize here (one elementwise pass; exact for power-of-two descale_q)
    q_bf16 = (q.float() * descale_q).to(torch.bfloat16)
    return _decode(q_bf16, k_cache, descale_k, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                   num_splits, softmax_scale, causal, True, backend, precision)


def _expect_descale(x, name: str, device: torch.device) -> None:
    expect(x is not None, name, "a (1,) float32 tensor (required with an FP8 q and cache)", None)
    expect_tensor(x, name)
    expect(x.dtype == torch.float32 and x.numel() == 1 and x.dim() == 1, name, "a (1,) float32 tensor",
           f"{tuple(x.shape)} {x.dtype}")
    expect_on_device(x, name, device)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, kv_scale: torch.Tensor | None, block_table: torch.Tensor,
            cache_seqlens: torch.Tensor, head_dim_v: int, metadata: MlaMetadata, num_splits: torch.Tensor,
            softmax_scale: float | None, causal: bool, is_fp8: bool, backend: str, precision: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both entry points after their dtype checks: the shapes and the metadata checked, the plan found, the decode
    run, the LSE given FlashMLA's value for a query that sees nothing."""
    _expect_shapes(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits)
    batch, s_q, h_q = q.shape[:3]
    _expect_metadata(metadata, cache_seqlens, s_q * h_q // NUM_KV_HEADS, h_q, is_fp8)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    # FlashMLA's default, q.shape[-1] ** -0.5, with q.shape[-1] == 576
    softmax_scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else expect_softmax_scale(softmax_scale)
    # FlashMLA takes q and block_table with a unit last stride; our plans take them contiguous (a copy otherwise)
    q = q if q.is_contiguous() else q.contiguous()
    block_table = block_table if block_table.is_contiguous() else block_table.contiguous()
    if block_table.shape[1] == 0 or k_cache.shape[0] == 0:
        # FlashMLA takes a table or a cache of no pages (every length 0); our plans want one of each: a table whose
        # one column names no page, so that a positive length gives NaN (or the torch backend's error), not a read
        block_table = torch.full((batch, 1), -1, dtype=torch.int32, device=block_table.device)
        k_cache = torch.zeros((1, *k_cache.shape[1:]), dtype=k_cache.dtype, device=k_cache.device)
    page_size, max_pages = k_cache.shape[1], block_table.shape[1]
    causal = causal and s_q > 1  # FlashMLA's too: one query token has nothing to mask
    # The key is every input of the plan's Problem (make_problem's arguments; the rest are constants here), so a hit
    # skips making the Problem again
    key = (batch, s_q, h_q, page_size, max_pages, k_cache.dtype, q.device, softmax_scale, causal, precision, backend)
    plan = _PLANS.get(key)
    if plan is None:
        # max_seqlen from the shapes (the table's pages of page_size rows), never from the lengths: no host read
        problem = make_problem(batch, k_cache.dtype, q.device, layout="paged", page_size=page_size,
                               max_pages=max_pages, num_heads=h_q, q_len=s_q, max_seqlen=page_size * max_pages,
                               softmax_scale=softmax_scale, causal=causal, precision=precision, return_lse=True)
        plan = remember(_PLANS, key, DecodePlan(problem, backend), PLAN_CACHE_LIMIT)
    out = torch.empty((batch, s_q, h_q, V_HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((batch, h_q, s_q), dtype=torch.float32, device=q.device)
    schedule = metadata.schedules.get(plan)
    if schedule is None:  # the step's first layer on this plan
        schedule = metadata.schedules[plan] = plan.schedule(cache_seqlens)
    plan.run(q, k_cache, block_table, cache_seqlens, kv_scale, out=out, lse=lse, schedule=schedule)
    # mla_decode's LSE of a query that sees nothing is -inf, FlashMLA's +inf; NaN (an invalid length) stays NaN
    lse.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=math.inf)
    return out, lse


def _expect_shapes(q: torch.Tensor, k_cache: torch.Tensor, block_table, cache_seqlens, head_dim_v,
                   num_splits) -> None:
    """The shapes FlashMLA's call takes (its dtypes checked by the entry point, the rest by the plan's run)."""
    batch = q.shape[0] if q.dim() == 4 else -1
    # Every layer of a step checks these: a good call passes before any message is formatted
    if (type(head_dim_v) is int and head_dim_v == V_HEAD_DIM and q.dim() == 4 and q.shape[-1] == QK_HEAD_DIM
            and k_cache.dim() == 4 and k_cache.shape[2:] == (NUM_KV_HEADS, QK_HEAD_DIM) and k_cache.is_contiguous()
            and isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.shape[0] == batch
            and isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.shape == (batch,)
            and isinstance(num_splits, torch.Tensor) and num_splits.shape == (batch + 1,)
            and num_splits.dtype == torch.int32 and num_splits.device == q.device):
        return
    expect_int(head_dim_v, "head_dim_v")
    expect(head_dim_v == V_HEAD_DIM, "head_dim_v", f"{V_HEAD_DIM} (MLA's value width)", head_dim_v)
    expect(q.dim() == 4 and q.shape[-1] == QK_HEAD_DIM, "q.shape", f"(batch, s_q, h_q, {QK_HEAD_DIM})",
           tuple(q.shape))
    expect(k_cache.dim() == 4 and k_cache.shape[2:] == (NUM_KV_HEADS, QK_HEAD_DIM), "k_cache.shape",
           f"(num_blocks, page_block_size, {NUM_KV_HEADS}, {QK_HEAD_DIM})", tuple(k_cache.shape))
    expect(k_cache.is_contiguous(), "k_cache", "a contiguous tensor", "a strided view")
    expect_tensor(block_table, "block_table")
    expect(block_table.dim() == 2 and block_table.shape[0] == batch, "block_table.shape",
           f"({batch}, max_num_blocks_per_seq) (q's batch)", tuple(block_table.shape))
    expect_tensor(cache_seqlens, "cache_seqlens")
    expect(cache_seqlens.shape == (batch,), "cache_seqlens.shape", f"({batch},) (q's batch)",
           tuple(cache_seqlens.shape))
    expect_tensor(num_splits, "num_splits")
    expect(num_splits.shape == (batch + 1,) and num_splits.dtype == torch.int32, "num_splits",
           f"({batch + 1},) int32 (get_mla_metadata's)", f"{tuple(num_splits.shape)} {num_splits.dtype}")
    expect_on_device(num_splits, "num_splits", q.device)


def _expect_metadata(metadata, cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, h_q: int,
                     is_fp8: bool) -> None:
    """The metadata was made by get_mla_metadata from this cache_seqlens, unwritten since, for this call's shape."""
    if not isinstance(metadata, MlaMetadata):
        raise TypeError(f"tile_scheduler_metadata: expected the MlaMetadata of mla_decode.flash_mla.get_mla_metadata, "
                        f"got {type(metadata).__name__}")
    # Every layer of a step checks this: a good call passes before any message is formatted
    version, held = version_of(cache_seqlens), metadata.version
    if (_same_tensor(metadata.cache_seqlens, cache_seqlens) and (version is None or held is None or version == held)
            and metadata.num_q_tokens_per_head_k == num_q_tokens_per_head_k
            and metadata.num_heads_q in (None, h_q) and metadata.is_fp8_kvcache == is_fp8):
        return
    field = "tile_scheduler_metadata"
    expect(_same_tensor(metadata.cache_seqlens, cache_seqlens), field,
           "metadata made from this cache_seqlens tensor (get_mla_metadata(cache_seqlens, ...) once a step, the same "
           "tensor to every layer)", "metadata made from another tensor")
    expect(version is None or held is None or version == held, field,
           "metadata made after cache_seqlens was last written (call get_mla_metadata again after updating it)",
           "stale metadata: cache_seqlens was written in place since")
    expect(metadata.num_q_tokens_per_head_k == num_q_tokens_per_head_k, field,
           f"metadata for num_q_tokens_per_head_k = s_q * h_q // h_kv = {num_q_tokens_per_head_k} (q's shape)",
           f"metadata for {metadata.num_q_tokens_per_head_k}")
    expect(metadata.num_heads_q in (None, h_q), field, f"metadata for num_heads_q = {h_q} (q's heads)",
           f"metadata for {metadata.num_heads_q}")
    call = "flash_mla_with_kvcache_fp8" if is_fp8 else "flash_mla_with_kvcache"
    expect(metadata.is_fp8_kvcache == is_fp8, field, f"metadata made with is_fp8_kvcache={is_fp8} for {call}",
           f"metadata made with is_fp8_kvcache={metadata.is_fp8_kvcache}")
