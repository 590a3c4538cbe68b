"""The contract every backend shares: MLA's sizes, the KV formats and their dtypes, what a plan is made for
(`Problem`), the argument checks that name what they expected, the bounded plan caches and the logger.

MLA decode in the forward_absorb form: the query heads share one latent KV head of 576 dims; keys use all 576,
values the first 512. A cache row is stored in one of three formats:
  "fp8":   576 FP8 values (float8_e4m3fn; float8_e4m3fnuz on gfx942), one float32 scale for the whole cache
  "mxfp4": 288 bytes of E2M1 codes (two a byte, the low nibble the even element; uint8 or float4_e2m1fn_x2) and
           18 E8M0 block scales (one per 32 values; uint8 or float8_e8m0fnu) in a tensor beside it
  "bf16":  576 bfloat16 values, no scale
"""

import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576: a query or key row
V_HEAD_DIM = KV_LORA_RANK  # 512: a value or output row, the key's first dims
NUM_KV_HEADS = 1
MXFP4_BLOCK = 32  # values per E8M0 scale
MXFP4_BLOCKS_PER_ROW = QK_HEAD_DIM // MXFP4_BLOCK  # 18
MXFP4_ROW_BYTES = QK_HEAD_DIM // 2  # 288: two E2M1 codes a byte
DEFAULT_SOFTMAX_SCALE = 1.0 / math.sqrt(QK_HEAD_DIM)
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: their score scale is softmax_scale * log2(e)
LN2 = 0.6931471805599453  # their log-sum-exp comes out in base 2; the caller's is natural

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP4X2_DTYPES = tuple(d for d in (getattr(torch, "float4_e2m1fn_x2", None), torch.uint8) if d is not None)
E8M0_DTYPES = tuple(d for d in (getattr(torch, "float8_e8m0fnu", None), torch.uint8) if d is not None)
KV_FORMATS = ("fp8", "mxfp4", "bf16")
ROW_WIDTH = {"fp8": QK_HEAD_DIM, "mxfp4": MXFP4_ROW_BYTES, "bf16": QK_HEAD_DIM}  # a cache row's last dim
PRECISIONS = ("fast", "precise")
LAYOUTS = ("paged", "ragged")

log = logging.getLogger("mla_decode")
Device = torch.device | str | int  # what torch.device() takes


class Problem(NamedTuple):
    """What a plan is made for: every fact a backend's choice, its split plan and its compiled kernels depend on.
    Lengths, page tables and data are not in it: a plan reads them on the device at every run."""

    device: torch.device
    batch: int
    q_len: int  # query tokens per sequence
    num_heads: int  # query heads sharing the latent KV head
    kv_format: str  # KV_FORMATS
    kv_dtype: torch.dtype  # the cache's own dtype (e4m3fn or e4m3fnuz; uint8 or float4_e2m1fn_x2; bfloat16)
    scale_dtype: torch.dtype | None  # the scale's dtype: float32 (fp8), E8M0 bytes (mxfp4), None (bf16)
    scale_stride: int  # MXFP4: elements between one row's block scales and the next's; else 0
    layout: str  # "paged": block_table + cache_seqlens; "ragged": kv_indptr over consecutive rows
    page_size: int  # rows per page (paged); 0 for ragged
    max_pages: int  # block_table's columns (paged); 0 for ragged
    max_seqlen: int  # the longest sequence the split plan is sized for
    causal: bool
    softmax_scale: float
    precision: str  # PRECISIONS
    return_lse: bool

    @property
    def qk_scale(self) -> float:
        """The kernels' score scale: softmax_scale * log2(e)."""
        return self.softmax_scale * LOG2E


def expect(cond: bool, field: str, expected: str, got: object) -> None:
    """A ValueError naming the argument, what was expected and what came, when cond is false."""
    if not cond:
        raise ValueError(f"{field}: expected {expected}, got {got}")


def expect_tensor(x: object, field: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{field}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def expect_int(x: object, field: str, minimum: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{field}: expected an int, got {type(x).__name__}")
    if minimum is not None:
        expect(x >= minimum, field, f">= {minimum}", x)
    return x


def expect_choice(x: object, field: str, choices: tuple) -> str:
    expect(x in choices, field, f"one of {choices}", repr(x))
    return x


def expect_on_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (q's device), got one on {x.device}")


def expect_softmax_scale(x: object) -> float:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
    expect(ok, "softmax_scale", "a positive finite float", repr(x))
    return float(x)


def kv_format_of_dtype(dtype: torch.dtype, field: str = "kv_dtype") -> str:
    """The format a cache of this dtype holds: FP8, BF16, or MXFP4 codes (uint8 / float4_e2m1fn_x2)."""
    if dtype in FP8_DTYPES:
        return "fp8"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype in FP4X2_DTYPES:
        return "mxfp4"
    raise TypeError(f"{field}: expected one of {FP8_DTYPES + (torch.bfloat16,) + FP4X2_DTYPES} (FP8, BF16 or MXFP4 "
                    f"codes), got {dtype}")


def kv_format_of(kv_cache: torch.Tensor, field: str = "kv_cache") -> str:
    """The format a cache's dtype says it holds, with the row width that format has."""
    kv_format = kv_format_of_dtype(kv_cache.dtype, f"{field}.dtype")
    width = ROW_WIDTH[kv_format]
    expect(kv_cache.dim() >= 1 and kv_cache.shape[-1] == width, f"{field}.shape[-1]",
           f"{width} (a {kv_format} row)", tuple(kv_cache.shape))
    return kv_format


# Bounded caches: every plan cache is a dict keyed by named facts, kept to a limit by remember().
PLAN_CACHE_LIMIT = 64  # plans of the one-shot call and the backends' launch plans; a server uses a handful of shapes
DISPATCH_LIMIT = 256  # kinds of call of the leaderboard adapter; the leaderboard makes 8 or so


def remember(cache: dict, key: object, value: object, limit: int) -> object:
    """cache[key] = value, after evicting the oldest entries (a dict keeps insertion order) until fewer than `limit`
    remain; returns value."""
    while cache and len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


@functools.cache
def _queue_handle() -> Callable[[torch.device], int] | None:
    """mla_decode.device_queue.current_handle where the package is installed; None in the leaderboard file alone
    (its module is kept out of it: see there)."""
    try:
        from mla_decode.device_queue import current_handle
    except ImportError:
        return None
    return current_handle


def caller_key(device: torch.device) -> tuple[int, int]:
    """(this thread, the handle of its current queue of work on `device`; 0 off the GPU, or in the leaderboard file
    alone): a plan keeps a workspace per key, so that callers on two queues or two threads never share partials."""
    handle = _queue_handle()
    if device.type != "cuda" or handle is None:
        return threading.get_ident(), 0
    return threading.get_ident(), handle(device)
