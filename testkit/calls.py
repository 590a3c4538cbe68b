"""The library's ragged call on the competition's input tuple: how the tests and the tuning scripts run one backend's
kernel with a chosen plan, through the public face (mla_decode.plan_ragged), not the leaderboard adapter."""

from collections.abc import Callable

import torch

import mla_decode


def ragged_call(data, kv_format: str, backend: str = "triton", precision: str = "fast", plan=None,
                library=mla_decode, schedule: str | None = None) -> tuple[object, Callable[[], torch.Tensor]]:
    """(the plan, a call that runs it) for `backend`'s kernel on data = (q, kv_data, qo_indptr, kv_indptr, config)
    reading kv_data[kv_format]; the call returns (batch, 16, 512) bfloat16. plan: the backend's plan override (the
    triton backend's TritonPlan or its first fields, the others its own choice), else its own; library: mla_decode,
    or a module with the same plan_ragged (a submission file); schedule: the backend's schedule option ("balanced"
    or "fixed"), else its default."""
    q, kv_data, _, kv_indptr, config = data
    kv, scale = kv_data[kv_format]
    options = {name: value for name, value in (("plan", plan), ("schedule", schedule)) if value is not None}
    batch = q.shape[0]
    max_seqlen = config["kv_seq_len"] if config["kv_seq_len"] is not None else -(-kv.shape[0] // batch)
    decode = library.plan_ragged(batch, kv.dtype, q.device, max_seqlen, softmax_scale=config["sm_scale"],
                                 backend=backend, precision=precision, return_lse=False, kv_scale_dtype=scale.dtype,
                                 kv_scale_stride=scale.stride(0) if kv_format == "mxfp4" else None,
                                 backend_options=options or None)
    q4 = q.view(batch, 1, *q.shape[1:])
    return decode, lambda: decode.run_ragged(q4, kv, kv_indptr, scale)[0].view(batch, *q.shape[1:-1], -1)


def ragged_decode(data, kv_format: str, backend: str = "triton", precision: str = "fast", plan=None,
                  schedule: str | None = None) -> torch.Tensor:
    """ragged_call's plan, made and run once."""
    return ragged_call(data, kv_format, backend, precision, plan, schedule=schedule)[1]()
