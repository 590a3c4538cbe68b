"""The leaderboard adapter: custom_kernel over the amd-mixed-mla competition tuple, turned into the library's ragged
call. The settings the leaderboard cannot pass (backend, cache format, precision) come from MLA_* variables or the
DEFAULT_* constants below: this module is the only place that reads them.

The competition's input (task.py's input_t):
  q:         (total_q, 16, 576) bfloat16, total_q = batch x q_seq_len, sequence b's tokens consecutive
  kv_data:   "fp8":   (kv (total_kv, 1, 576) float8_e4m3fn (e4m3fnuz on gfx942), scale (1,) float32)
             "mxfp4": (kv (total_kv, 1, 288) float4_e2m1fn_x2 or uint8, two E2M1 codes a byte, low nibble = even
                       element; scales E8M0 (rows >= total_kv, cols >= 18), padded (M_pad, 24) or (M, 18))
             "bf16":  (total_kv, 1, 576) bfloat16 (not read)
  qo_indptr: (batch + 1,) int32 = [0, L, 2L, ..., batch L], L = q_seq_len
  kv_indptr: (batch + 1,) int32, sequence b owns KV rows kv_indptr[b]:kv_indptr[b+1] (0 = first, non-decreasing,
             last <= total_kv)
  config:    batch_size, num_heads (16), num_kv_heads (1), qk_head_dim (576), v_head_dim (512), q_seq_len (L),
             kv_seq_len (every sequence's length in a uniform batch; None or the maximum otherwise; when
             batch * kv_seq_len == total_kv every sequence has exactly kv_seq_len rows), sm_scale
Output: (total_q, 16, 512) bfloat16. With L > 1 the tokens are causal (reference.py's rule: token i of L sees the
first n - L + 1 + i rows). A token that sees no KV rows gives zeros; an invalid kv_indptr range gives NaN
rows on the GPU backends (MLA_VALIDATE=1: an error, at the cost of a host sync; the torch backend always checks).
"""

import functools
import math
import os
from typing import NamedTuple

import torch

from .aiter_backend import aiter_variant
from .api import CacheNames, DecodePlan, expect_ragged_inputs, make_problem
from .backends import BACKEND_CHOICES, BackendUnavailable, select_backend
from .contract import (
    DISPATCH_LIMIT,
    FP4X2_DTYPES,
    FP8_DTYPES,
    NUM_KV_HEADS,
    PRECISIONS,
    QK_HEAD_DIM,
    V_HEAD_DIM,
    expect,
    expect_tensor,
    kv_format_of_dtype,
    remember,
)

NUM_HEADS = 16
LEADERBOARD_KV_FORMATS = ("fp8", "mxfp4")
CONFIG_KEYS = ("batch_size", "num_heads", "num_kv_heads", "qk_head_dim", "v_head_dim", "q_seq_len", "kv_seq_len",
               "sm_scale")

# What runs when MLA_BACKEND / MLA_KV_FORMAT / MLA_PRECISION are unset, as on the leaderboard (it sets no
# environment variables): edit these to submit another backend ("triton", "torch"), the MXFP4 cache ("mxfp4") or
# the precise score product ("precise").
DEFAULT_BACKEND = "auto"
DEFAULT_KV_FORMAT = "fp8"
DEFAULT_PRECISION = "fast"


# ---------------------------------------------------------------------------------------------------------
# Validation of the competition tuple: shapes, dtypes and config, without reading device memory (no host sync)
# ---------------------------------------------------------------------------------------------------------


def _expect_pair(x, field: str, first: str, second: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"{field}: expected a (tensor, scale) pair, got {type(x).__name__}")
    return expect_tensor(x[0], first), expect_tensor(x[1], second)


def _expect_same_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"q and {name} are on different devices ({device}, {x.device})")


def _expect_config_int(x, field: str, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{field}: expected an int{' or None' if allow_none else ''}, got {type(x).__name__}")


def _validate_config(config, batch: int) -> None:
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, got {type(config).__name__}")
    missing = [k for k in CONFIG_KEYS if k not in config]
    expect(not missing, "config", f"keys {list(CONFIG_KEYS)}", f"a dict missing {missing}")
    for key, want in (("num_heads", NUM_HEADS), ("num_kv_heads", NUM_KV_HEADS), ("qk_head_dim", QK_HEAD_DIM),
                      ("v_head_dim", V_HEAD_DIM)):
        _expect_config_int(config[key], f"config[{key!r}]")
        expect(config[key] == want, f"config[{key!r}]", str(want), config[key])
    _expect_config_int(config["q_seq_len"], "config['q_seq_len']")
    expect(config["q_seq_len"] >= 1, "config['q_seq_len']", ">= 1", config["q_seq_len"])
    _expect_config_int(config["batch_size"], "config['batch_size']")
    expect(config["batch_size"] == batch, "config['batch_size']", f"{batch} (len(qo_indptr) - 1)",
           config["batch_size"])
    _expect_config_int(config["kv_seq_len"], "config['kv_seq_len']", allow_none=True)
    expect(config["kv_seq_len"] is None or config["kv_seq_len"] >= 0, "config['kv_seq_len']", "None or >= 0",
           config["kv_seq_len"])
    sm = config["sm_scale"]
    expect(isinstance(sm, (int, float)) and not isinstance(sm, bool) and math.isfinite(sm) and sm > 0,
           "config['sm_scale']", "a positive finite float", repr(sm))


def _validate_qo_indptr(x, device: torch.device) -> torch.Tensor:
    x = expect_tensor(x, "qo_indptr")
    expect(x.dtype == torch.int32, "qo_indptr.dtype", "torch.int32", x.dtype)
    expect(x.dim() == 1 and x.shape[0] >= 2, "qo_indptr.shape", "(batch + 1,) with batch >= 1", tuple(x.shape))
    _expect_same_device(x, "qo_indptr", device)
    expect(x.is_contiguous(), "qo_indptr", "a contiguous tensor", "a strided view")
    return x


# What the checks call the two elements of each KV format's (tensor, scale) pair.
_KV_NAMES = {"fp8": CacheNames("the FP8 cache (kv_data['fp8'][0])", "the FP8 scale (kv_data['fp8'][1])"),
             "mxfp4": CacheNames("the MXFP4 cache (kv_data['mxfp4'][0])",
                                 "the MXFP4 block scales (kv_data['mxfp4'][1])")}


def _validate_kv(kv_data, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv, scale) of the format that will be read, a pair whose cache holds that format; the api checks the rest
    (_new_dispatch)."""
    if not isinstance(kv_data, dict):
        raise TypeError(f"kv_data: expected a dict of KV formats, got {type(kv_data).__name__}")
    expect(kv_format in kv_data, "kv_data", f"a {kv_format!r} entry", f"keys {sorted(kv_data)}")
    names = _KV_NAMES[kv_format]
    kv, scale = _expect_pair(kv_data[kv_format], f"kv_data[{kv_format!r}]", names.kv, names.scale)
    expect(kv_format_of_dtype(kv.dtype, f"{names.kv}.dtype") == kv_format, f"{names.kv}.dtype",
           f"one of {FP8_DTYPES if kv_format == 'fp8' else FP4X2_DTYPES}", kv.dtype)
    return kv, scale


def validate(data: object, kv_format: str) -> tuple:
    """The competition tuple's own checks, without reading device memory (no host sync): its structure, q's shape,
    qo_indptr, the config and the format's pair. The tensors the library's ragged call takes (q, the cache and its
    scale, kv_indptr) are checked by the api's own checks where the call is planned (_new_dispatch). Returns (q, kv,
    kv_scale, qo_indptr, kv_indptr, config) for the chosen KV format."""
    if not (isinstance(data, (tuple, list)) and len(data) == 5):
        raise TypeError("data: expected (q, kv_data, qo_indptr, kv_indptr, config)")
    q, kv_data, qo_indptr, kv_indptr, config = data
    q = expect_tensor(q, "q")
    expect(q.dim() == 3 and q.shape[1] == NUM_HEADS and q.shape[2] == QK_HEAD_DIM, "q.shape",
           f"(total_q, {NUM_HEADS}, {QK_HEAD_DIM})", tuple(q.shape))
    qo_indptr = _validate_qo_indptr(qo_indptr, q.device)
    batch = qo_indptr.shape[0] - 1
    _validate_config(config, batch)
    q_len = config["q_seq_len"]
    expect(q.shape[0] == batch * q_len, "q.shape[0]", f"{batch * q_len} (batch x q_seq_len)", q.shape[0])
    kv, scale = _validate_kv(kv_data, kv_format)
    return q, kv, scale, qo_indptr, kv_indptr, config


def validate_indptr_contents(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, total_kv: int,
                             kv_seq_len: int | None, q_len: int = 1) -> list[int]:
    """Host-side check of the indptr contents (a device sync). Returns the KV lengths."""
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    expect(qo == [b * q_len for b in range(len(qo))], "qo_indptr",
           f"[0, {q_len}, ..., batch x {q_len}] (q_seq_len = {q_len} queries per sequence)", qo[:8])
    expect(kvp[0] == 0, "kv_indptr[0]", "0", kvp[0])
    lens = [b - a for a, b in zip(kvp[:-1], kvp[1:], strict=True)]
    expect(min(lens) >= 0, "kv_indptr", "non-decreasing values", kvp[:8])
    expect(kvp[-1] <= total_kv, "kv_indptr[-1]", f"<= total_kv = {total_kv}", kvp[-1])
    if kv_seq_len is not None:
        expect(max(lens) <= kv_seq_len, "config['kv_seq_len']", f">= the longest sequence ({max(lens)})",
               kv_seq_len)
        # aiter plans are reused without reading kv_indptr on this promise (aiter_backend._aiter_plan_key).
        if len(lens) * kv_seq_len == total_kv:
            expect(min(lens) == kv_seq_len, "kv_indptr", f"every length == config['kv_seq_len'] = {kv_seq_len} "
                   "(batch * kv_seq_len == total_kv declares a uniform batch)", f"lengths {lens[:8]}")
    return lens


# ---------------------------------------------------------------------------------------------------------
# Settings: the environment (MLA_*) over the DEFAULT_* constants, read here and nowhere else
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def _env_keys(names: tuple[str, ...]) -> tuple:
    return tuple(map(os.environ.encodekey, names))


def _env_values(names: tuple[str, ...]) -> tuple:
    """os.environ's values of `names`, as it stores them (bytes on POSIX), None where unset. Every call reads them,
    and the leaderboard sets none: os.environ.get raises and catches a KeyError for each unset name, so this reads
    CPython's dict behind os.environ (_data, written by os.environ's own methods) instead, and falls back to the
    public API elsewhere (docs/design-notes.md, "The leaderboard adapter's host path")."""
    environ = os.environ
    try:
        return tuple(map(environ._data.get, _env_keys(names)))
    except AttributeError:  # not CPython's os._Environ: no such dict
        return tuple(map(environ.get, names))


def _env(name: str) -> str | None:
    """os.environ.get(name), at the cost of _env_values."""
    (value,) = _env_values((name,))
    return value if value is None or isinstance(value, str) else os.environ.decodevalue(value)


def _setting(name: str, default: str, choices: tuple) -> str:
    """The environment's `name`, else `default` (a DEFAULT_* constant); a value outside `choices` is an error naming
    where it came from."""
    value = _env(name)
    value = default if value is None else value
    if value not in choices:  # not expect(): its message would be formatted on every call
        source = name if name in os.environ else "DEFAULT_" + name.removeprefix("MLA_")
        raise ValueError(f"{source}: expected one of {choices}, got {value!r}")
    return value


def select_kv_format() -> str:
    return _setting("MLA_KV_FORMAT", DEFAULT_KV_FORMAT, LEADERBOARD_KV_FORMATS)


def select_precision() -> str:
    """"fast": the FP8 cache's score product as an fp8 x fp8 MMA (Q rounded to e4m3 per head), whose sums lose
    accuracy under a large common logit offset; "precise": that product in fp16 with fp32 sums, at some speed."""
    return _setting("MLA_PRECISION", DEFAULT_PRECISION, PRECISIONS)


def select_backend_setting() -> str:
    return _setting("MLA_BACKEND", DEFAULT_BACKEND, BACKEND_CHOICES)


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


class _Dispatch(NamedTuple):
    """custom_kernel's decision for one kind of input, made once after validate (_new_dispatch), then looked up by
    the input's kind (see dispatch)."""

    backend: str
    kv_format: str
    check_contents: bool  # the indptr contents checked on the host (the torch backend, or MLA_VALIDATE=1)
    plan: DecodePlan  # the library's ragged plan for this kind of input


# What a call's choices read besides its input: the environment (a changed variable is another kind of call) and the
# DEFAULT_* constants.
_SETTING_VARIABLES = ("MLA_BACKEND", "MLA_KV_FORMAT", "MLA_PRECISION", "MLA_VALIDATE", "MLA_AITER_VARIANT",
                      "TRITON_INTERPRET")
_KV_FORMAT_OF: dict = {}  # those settings -> the KV format they select (select_kv_format)
_DISPATCH: dict = {}  # (settings, every input attribute validate reads, the config's items) -> _Dispatch


def _choose(problem, backend: str) -> str:
    """select_backend under the adapter's settings: its error names MLA_BACKEND (or the DEFAULT_BACKEND it came
    from)."""
    try:
        return select_backend(problem, backend).backend
    except BackendUnavailable as e:
        raise RuntimeError(f"MLA_BACKEND={e.backend}: {e.reason}") from None


def leaderboard_backend(device: torch.device, kv_format: str | None = None, precision: str | None = None) -> str:
    """The backend custom_kernel's settings pick on `device` for the leaderboard's shape (kv_format and precision
    default to the settings' too); before AITER_VARIANTS, which may send a shape from aiter to triton."""
    kv_dtype = torch.float8_e4m3fn if (kv_format or select_kv_format()) == "fp8" else torch.uint8
    problem = make_problem(1, kv_dtype, device, layout="ragged", max_seqlen=1, precision=precision or
                           select_precision(), return_lse=False)
    return _choose(problem, select_backend_setting())


def _new_dispatch(q, kv, scale, kv_indptr, config, kv_format: str) -> _Dispatch:
    """The plan of a validated kind of input, its tensors checked by the api's checks against the problem first."""
    precision, backend = select_precision(), select_backend_setting()
    q_len, kv_seq_len = config["q_seq_len"], config["kv_seq_len"]
    batch = q.shape[0] // q_len
    max_seqlen = kv_seq_len if kv_seq_len is not None else -(-kv.shape[0] // batch)
    names = _KV_NAMES[kv_format]
    problem = make_problem(batch, kv.dtype, q.device, layout="ragged", q_len=q_len, causal=q_len > 1,
                           max_seqlen=max_seqlen, softmax_scale=float(config["sm_scale"]), precision=precision,
                           return_lse=False, scale_dtype=scale.dtype, names=names,
                           scale_stride=scale.stride(0) if kv_format == "mxfp4" and scale.dim() == 2 else None)
    expect_ragged_inputs(problem, q.unflatten(0, (batch, q_len)), kv, kv_indptr, scale, names)
    chosen = _choose(problem, backend)  # as the library chooses: the registry's records
    options = None
    if chosen == "aiter":  # the config's uniform-length promise, and the variant of AITER_VARIANTS or the override
        options = {"variant": aiter_variant(batch, kv_seq_len, _env("MLA_AITER_VARIANT")), "kv_seq_len": kv_seq_len}
    elif chosen == "cuda" or (chosen == "triton" and kv_seq_len is not None and batch * kv_seq_len == kv.shape[0]):
        # the leaderboard's batches are uniform (every length kv_seq_len: equal splits are balanced); the cuda
        # backend's face keeps the fixed splits it was tuned with whatever the lengths
        options = {"schedule": "fixed"}
    decode = DecodePlan(problem, chosen, backend_options=options)
    check = decode.backend == "torch" or _env("MLA_VALIDATE") == "1"
    return _Dispatch(decode.backend, kv_format, check, decode)


def dispatch(data: object) -> tuple:
    """(decision, q, kv, kv_scale, qo_indptr, kv_indptr, config): custom_kernel's first half, everything before a
    backend runs. The first call of a kind (the settings, each tensor's shape, dtype, device and contiguity, the
    scale's strides, the config's items and their types) validates it and plans it; later calls of that kind look
    the decision up: validate reads nothing else, so an input of the same kind passes it again."""
    settings = (_env_values(_SETTING_VARIABLES), DEFAULT_BACKEND, DEFAULT_KV_FORMAT, DEFAULT_PRECISION)
    kv_format = _KV_FORMAT_OF.get(settings)
    if kv_format is None:
        kv_format = remember(_KV_FORMAT_OF, settings, select_kv_format(), DISPATCH_LIMIT)  # raises on a bad value
    try:
        if not isinstance(data, (tuple, list)):
            raise TypeError
        q, kv_data, qo_indptr, kv_indptr, config = data
        kv, scale = kv_data[kv_format]
        # Contiguity is all validate asks of the strides, but of the scale's (the MXFP4 scales' row stride is read);
        # the config's value types tell 6.0 from 6, which compare and hash equal.
        key = (settings, q.shape, q.dtype, q.device, q.is_contiguous(), qo_indptr.shape, qo_indptr.dtype,
               qo_indptr.device, qo_indptr.is_contiguous(), kv_indptr.shape, kv_indptr.dtype, kv_indptr.device,
               kv_indptr.is_contiguous(), kv.shape, kv.dtype, kv.device, kv.is_contiguous(), scale.shape,
               scale.stride(), scale.dtype, scale.device, tuple(config.items()), tuple(map(type, config.values())))
        decision = _DISPATCH.get(key)
    except (TypeError, ValueError, KeyError, AttributeError):  # not a valid input: validate says why
        key = decision = None
    if decision is None:
        q, kv, scale, qo_indptr, kv_indptr, config = validate(data, kv_format)
        decision = _new_dispatch(q, kv, scale, kv_indptr, config, kv_format)
        if key is not None:
            remember(_DISPATCH, key, decision, DISPATCH_LIMIT)
    return decision, q, kv, scale, qo_indptr, kv_indptr, config


def forward(decision: _Dispatch, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, qo_indptr: torch.Tensor,
            kv_indptr: torch.Tensor, config: dict) -> torch.Tensor:
    """custom_kernel's second half: the decided plan, run on dispatch's outputs (checked by kind already)."""
    if decision.check_contents:
        validate_indptr_contents(qo_indptr, kv_indptr, kv.shape[0], config["kv_seq_len"], config["q_seq_len"])
    problem = decision.plan.problem
    batch, q_len = problem.batch, problem.q_len
    out = q.new_empty((batch, q_len, NUM_HEADS, V_HEAD_DIM))  # q is bf16; new_empty parses no dtype or device
    decision.plan.launch(q.view(batch, q_len, NUM_HEADS, QK_HEAD_DIM), kv, scale, kv_indptr, None, out, None)
    return out.view(batch * q_len, NUM_HEADS, V_HEAD_DIM)


def custom_kernel(data: tuple) -> torch.Tensor:
    """data = (q, kv_data, qo_indptr, kv_indptr, config) -> (total_q, 16, 512) bfloat16."""
    return forward(*dispatch(data))

