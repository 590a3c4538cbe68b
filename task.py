"""Types shared by the harness, the reference and the submission (the leaderboard's contract).

input_t  = (q, kv_data, qo_indptr, kv_indptr, config)
  q:         (total_q, 16, 576) bfloat16, absorbed query; total_q = batch * q_seq_len
  kv_data:   {"bf16": (total_kv, 1, 576) bfloat16,
              "fp8":  ((total_kv, 1, 576) float8 (e4m3fn, e4m3fnuz on gfx942), (1,) float32 scale),
              "mxfp4": ((total_kv, 1, 288) float4_e2m1fn_x2 or uint8, E8M0 block scales)}
  qo_indptr: (batch + 1,) int32, query rows of sequence b are qo_indptr[b]:qo_indptr[b+1]
  kv_indptr: (batch + 1,) int32, KV rows of sequence b are kv_indptr[b]:kv_indptr[b+1]
  config:    dict of MLA sizes (batch_size, num_heads, qk_head_dim, v_head_dim, q_seq_len,
             kv_seq_len, sm_scale, ...), see reference.generate_input
output_t = (total_q, 16, 512) bfloat16
"""

from typing import TypedDict, TypeVar

import torch

input_t = TypeVar("input_t", bound=tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor, dict])
output_t = TypeVar("output_t", bound=torch.Tensor)


class TestSpec(TypedDict):
    batchsize: int
    qseqlen: int
    kvseqlen: int
    seed: int
