"""The test kit's own promises: grid data makes the fast kernels' roundings exact, and the emulation of the wgmma
kernel's P rounding is its walk of splits and tiles written out."""

import math

import pytest
import torch

import reference as R
from testkit.emulation import (
    P_LOG2_BIAS,
    Tiling,
    _round_e4m3,
    e4m3_p_attention,
    kernel_emulation,
    round_q_per_head,
    schedule_pieces,
)
from testkit.inputs import GRID_Q_TERMS, GRID_REL_L2_BOUND, generate_grid_input


@pytest.mark.parametrize("kv_lens", [[1024] * 3, [8191, 1, 0, 517]], ids=["uniform", "mixed"])
def test_grid_input_makes_the_fast_kernels_roundings_exact(kv_lens):
    """generate_grid_input's promises: every cache holds the keys exactly, each head's logits (log2 units) lie near
    integers within GRID_Q_TERMS / 2 of each other, Q is exactly e4m3 after its per-head scale, and P rounded to e4m3
    (biased as the wgmma kernel stores it, or not) changes the output only by the unrounded row sums' 2^(offset) gain
    (~1e-3), far below a 1% sm_scale error's."""
    data = generate_grid_input(kv_lens, seed=1, device=torch.device("cpu"))
    q, kv_data, _, kv_indptr, config = data
    keys = kv_data["bf16"][:, 0].double()
    kv8, kv_scale = kv_data["fp8"]
    assert torch.allclose(kv8[:, 0].double() * kv_scale.double(), keys, rtol=1e-6, atol=0)
    assert torch.equal(R.dequantize_mxfp4(*kv_data["mxfp4"], torch.float64)[:, 0], keys)
    q_scale = 448.0 / q.double().abs().amax(dim=-1, keepdim=True)
    assert torch.equal(_round_e4m3(q.double() * q_scale), q.double() * q_scale)
    bounds = kv_indptr.tolist()
    for b in range(len(kv_lens)):
        logits = q[b].double() @ keys[bounds[b]:bounds[b + 1]].T * config["sm_scale"] * math.log2(math.e)
        if logits.numel():
            assert (logits - logits.round()).abs().max() < 0.01
            assert (logits.amax(dim=-1) - logits.amin(dim=-1)).max() <= GRID_Q_TERMS + 0.01
    exact = kernel_emulation(data, "cache")
    assert (exact.flatten(1).norm(dim=1)[torch.tensor(kv_lens) > 0] > 0.05).all()  # no all-zero rows
    assert R.worst_row_relative_l2(kernel_emulation(data, "+Q+P"), exact) < 1.5e-3
    wrong = (q, kv_data, data[2], kv_indptr, dict(config, sm_scale=config["sm_scale"] * 1.01))
    assert R.worst_row_relative_l2(kernel_emulation(wrong, "+Q+P"), exact) > 3 * GRID_REL_L2_BOUND


def walk_like_the_wgmma_kernel(data, tiling: Tiling) -> torch.Tensor:
    """The wgmma kernel's algorithm as a plain loop (mla_decode/cuda/csrc/wgmma.cuh, float64): per split of whole
    64-row tiles (or per piece of the tiling's schedule), the running maximum per tile, P = 2^(logit - (max - 8))
    rounded to e4m3, the rescales, the row sums of the unrounded P, and with several splits (pieces) bf16 partials
    merged by their log2-sum-exp (a piece of no row weighs 0)."""
    q, kv_data, _, kv_indptr, config = data
    kv, scale = kv_data["fp8"]
    keys = kv[:, 0].double() * scale.double()
    q8, q_scale = round_q_per_head(q)
    qd = q8.double() / q_scale.double()
    out = torch.zeros((q.shape[0], 16, 512), dtype=torch.float64)
    bounds = kv_indptr.tolist()
    for b in range(len(bounds) - 1):
        n = bounds[b + 1] - bounds[b]
        logits = qd[b] @ keys[bounds[b]:bounds[b + 1]].T * config["sm_scale"] * math.log2(math.e)
        values = keys[bounds[b]:bounds[b + 1], :512]
        per_split = math.ceil(math.ceil(n / tiling.num_splits) / tiling.block_n) * tiling.block_n
        if tiling.pieces is None:
            ranges = [(lo, min(lo + per_split, n)) for lo in range(0, n, max(per_split, 1))]
        else:
            ranges = [(lo * tiling.block_n, min(hi * tiling.block_n, n)) for lo, hi in tiling.pieces[b]]
        partials = []
        for lo, hi in ranges:
            m = torch.full((16, 1), -math.inf, dtype=torch.float64)
            row_sum = torch.zeros((16, 1), dtype=torch.float64)
            acc = torch.zeros((16, 512), dtype=torch.float64)
            if hi <= lo:  # a piece of no row
                partials.append((acc, m))
                continue
            for t0 in range(lo, hi, tiling.block_n):
                t1 = min(t0 + tiling.block_n, hi)
                new_max = torch.maximum(m, logits[:, t0:t1].amax(dim=-1, keepdim=True))
                alpha, m = torch.exp2(m - new_max), new_max
                p = torch.exp2(logits[:, t0:t1] - (new_max - P_LOG2_BIAS))
                row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
                acc = acc * alpha + _round_e4m3(p) @ values[t0:t1]
            partials.append((acc / row_sum, m + torch.log2(row_sum) - P_LOG2_BIAS))
        if not partials:
            continue
        if len(ranges) == 1 and (tiling.num_splits == 1 or tiling.pieces is not None):
            out[b] = partials[0][0]
            continue
        lse = torch.stack([lse for _, lse in partials])
        weights = torch.exp2(lse - lse.amax(dim=0))
        rounded = torch.stack([o for o, _ in partials]).to(tiling.partial_dtype).double()
        out[b] = (weights * rounded).sum(dim=0) / weights.sum(dim=0)
    return out


LENGTHS = [1000, 1, 0, 130, 64, 65, 300]


@pytest.mark.parametrize("num_splits,parts", [(1, None), (2, None), (3, None), (8, None), (None, 5), (None, 40)])
def test_the_e4m3_p_emulation_is_the_wgmma_kernels_walk(num_splits, parts):
    """kernel_emulation's "+Q+P" against the kernel's loop written out, on odd, empty, one-row and one-tile-plus-one
    lengths, over splits or a balanced schedule's pieces (pieces of many tiles, and of one or none); and it is not
    the "+Q" emulation (P's rounding shows)."""
    data = R.generate_varlen_input(LENGTHS, seed=5, device=torch.device("cpu"))
    tiling = Tiling(num_splits=num_splits) if parts is None else Tiling(pieces=schedule_pieces(LENGTHS, parts))
    emulated = kernel_emulation(data, "+Q+P", "fp8", tiling)
    assert torch.allclose(emulated, walk_like_the_wgmma_kernel(data, tiling), rtol=1e-12, atol=1e-12)
    assert R.worst_row_relative_l2(emulated, kernel_emulation(data, "+Q")) > 5e-3


@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_paged_reference_rounds_p_as_a_walk_would(num_splits):
    """paged_reference with a tiling (the kernels that round P to e4m3, on MTP and other head counts): its LSE is the
    exact one (the row sums are not rounded), its output is not (P's rounding alone: ~2e-2 of the worst token, what
    the wgmma kernels measure against the exact truth);
    a causal token's result depends on its own rows only where the walk is one split (tiles from the sequence's
    start), and a token that sees nothing gets zeros and -inf."""
    from testkit.paged import make_paged_case, owned_rows, paged_reference

    case = make_paged_case("fp8", 16, [700, 2, 130, 65], seed=num_splits, q_len=3, num_heads=24)
    exact_out, exact_lse = paged_reference(case)
    out, lse = paged_reference(case, tiling=Tiling(num_splits, 64, torch.float32))
    finite = exact_lse > -math.inf
    assert torch.equal(finite, lse > -math.inf) and not finite[1, :, 0].any()  # 2 rows: token 0 of 3 sees none
    assert torch.allclose(lse[finite], exact_lse[finite], rtol=0, atol=1e-9)
    assert (out[1, 0] == 0).all()
    error = R.worst_row_relative_l2(out.flatten(0, 1), exact_out.flatten(0, 1))
    assert 5e-3 < error < 4e-2
    if num_splits == 1:  # a token's unseen rows change nothing: the same as its own rows alone
        keys = case.keys[:, :512].double()
        rows = owned_rows(case, 0)
        logits = case.q[0, 0].double() @ case.keys[rows][:698].double().T * (576 ** -0.5 * math.log2(math.e))
        alone, _ = e4m3_p_attention(logits, keys[rows][:698], Tiling(1, 64, torch.float32))
        assert torch.allclose(out[0, 0], alone, rtol=1e-12, atol=1e-12)
