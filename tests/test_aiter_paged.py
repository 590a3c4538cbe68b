"""The library's aiter backend on a PAGED cache, through the public call (mla_decode.mla_decode_with_kvcache(...,
backend="aiter", return_lse=False)) and a plan, on the CPU against the stand-in aiter of tests/aiter_standin.py.

mla_decode.aiter_backend.AiterDecode expands the block table's pages to token indices on the device and calls aiter
at page size 1 (the gfx950 kernels ignore the page size: docs/aiter-contract.md). The inputs are
testkit.paged.make_paged_case's: pages in shuffled order, every slot no sequence owns poisoned with the FP8 NaN
byte, and the table's entries past a sequence's last page pointing at a poisoned page or outside the cache; the
stand-in faults on any kv_indices entry outside the cache. So a row read that a sequence does not own gives NaN, a
read outside the cache an error, and a row skipped misses the float64 truth (testkit.paged.paged_reference, over
the Q the aiter path reads: FP8 per tensor, testkit.attention.fp8_per_tensor). Bound: TIGHT, the ragged path's
(tests/test_aiter_backend.py: bf16 output rounding only), on the worst query token.

The library's modules (mla_decode.*) are other module objects than submission.py's; the `standin` fixture
(tests/conftest.py) empties both's aiter caches and import probes around each test.
"""

import math

import pytest
import torch
from aiter_standin import TIGHT, HostReadsForbidden

import mla_decode
import mla_decode.aiter_backend as AB
from mla_decode.api import DecodePlan, make_problem
from testkit.attention import fp8_per_tensor
from testkit.paged import make_paged_case, owned_rows, paged_reference

CPU = torch.device("cpu")
E4M3FN = torch.float8_e4m3fn
DEFAULT_SCALE = 1.0 / math.sqrt(576)
PAGE_SIZES = (1, 16, 64)
# 0, 1, odd, multiples of 16 and 64 and not, one longer than most CUs' share (the stand-in splits it)
LENS = [0, 1, 7, 33, 64, 65, 130, 0, 1000]


def token_errors(out: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Each query token's relative L2 error over all heads against the float64 truth (a token whose truth is zero
    must be zero: its error is then 0, else huge); NaN where out has a NaN."""
    o = out.double().flatten(0, 1).flatten(1)
    r = ref.flatten(0, 1).flatten(1)
    return ((o - r).norm(dim=1) / r.norm(dim=1).clamp(min=1e-30)).tolist()


def fp8_q_reference(case, softmax_scale: float | None = None) -> torch.Tensor:
    """float64 attention over the rows each sequence owns, with Q rounded as the aiter path rounds it."""
    return paged_reference(case, softmax_scale, q=fp8_per_tensor(case.q))[0]


def decode(case, **kwargs) -> torch.Tensor:
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), backend="aiter", return_lse=False, **kwargs)
    assert lse is None
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (case.q.shape[0], 1, 16, 512) and out.is_contiguous()
    return out


def assert_tight(case, out: torch.Tensor, softmax_scale: float | None = None) -> None:
    errors = token_errors(out, fp8_q_reference(case, softmax_scale))
    assert max(errors) < TIGHT, errors  # NaN compares false: a NaN row fails too


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_matches_the_float64_truth(standin, version, page_size):
    aiter = standin(version)
    for call in range(2):  # the second call reuses the plan: same shapes, other pages, lengths of the same batch
        case = make_paged_case("fp8", page_size, LENS, seed=10 * page_size + call)
        out = decode(case)
        assert_tight(case, out)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[7], torch.zeros_like(out[7]))
    assert len(mla_decode.api._PLANS) == 1 and len(AB._AITER_PLANS) == 1
    assert len(aiter.calls_to("get_mla_metadata_info_v1")) == 1  # one aiter plan
    assert aiter.stats["metadata_fills"] == 2  # the library promises no lengths: refilled on every call
    assert aiter.stats["work_split"] > 0  # the long sequence went through the reduce
    assert aiter.stats["work_empty"] > 0  # the stand-in wrote NaN for the empty ones; the backend zeroed them
    num_pages, batch = case.kv_cache.shape[0], len(LENS)
    slots = page_size * case.block_table.shape[1]
    for call in aiter.calls_to("mla_decode_fwd"):  # page size 1, whatever the cache's
        d = call.arguments
        assert d["page_size"] == 1 and d["kv_buffer"].shape == (num_pages * page_size, 1, 1, 576)
        assert d["kv_indices"].shape == (batch * slots,) and d["kv_indices"].dtype == torch.int32
        assert d["kv_indptr"].shape == (batch + 1,)
        if d["kv_indptr"].value is not None:
            assert d["kv_indptr"].value[-1].item() == sum(LENS)  # every owned row once, no other


@pytest.mark.parametrize("variant", sorted(AB.AITER_VARIANT_SPECS))
def test_every_variant_on_a_paged_cache(standin, variant):
    """A plan of each variant (backend_options, as the leaderboard adapter passes them), page size 16: the same
    token indices through every call form. a16w8 reads the bf16 Q itself."""
    aiter = standin("RUNNER")
    case = make_paged_case("fp8", 16, LENS, seed=5)
    problem = make_problem(len(LENS), E4M3FN, "cpu", layout="paged", page_size=16,
                           max_pages=case.block_table.shape[1], return_lse=False, scale_dtype=None)
    plan = DecodePlan(problem, "aiter", backend_options={"variant": variant})
    out, lse = plan.run(*case.args())
    q = fp8_per_tensor(case.q) if AB.AITER_VARIANT_SPECS[variant].q == "fp8" else None
    errors = token_errors(out, paged_reference(case, q=q)[0])
    assert lse is None and max(errors) < TIGHT, errors
    assert {key.variant for key in AB._AITER_PLANS} == {variant}
    assert aiter.launches  # the stand-in ran it


def test_invalid_lengths_and_pages_give_nan_for_that_sequence_only(standin):
    """A negative length, one past the table's capacity, a used page outside the cache (past the end, negative):
    that sequence's rows are all NaN, nothing is read outside the cache (the stand-in faults), the others are right.
    Table entries past a sequence's length may point anywhere (make_paged_case puts junk there). An invalid
    sequence reads nothing: aiter sees it with no rows."""
    aiter = standin("RUNNER")
    lens = [5, 40, 17, 0, 70, 33, 9]
    case = make_paged_case("fp8", 16, lens, seed=3)
    ref = fp8_q_reference(case)
    num_pages, capacity = case.kv_cache.shape[0], 16 * case.block_table.shape[1]
    seqlens, table = case.cache_seqlens.clone(), case.block_table.clone()
    seqlens[1] = -3  # a negative length
    seqlens[5] = capacity + 1  # longer than its table row holds
    table[2, 0] = num_pages + 7  # a page it reads, outside the cache
    table[4, 1] = -1  # likewise, negative
    bad = {1, 2, 4, 5}
    out = decode(case._replace(cache_seqlens=seqlens, block_table=table))
    for b in range(len(lens)):
        if b in bad:
            assert torch.isnan(out[b]).all(), b
        else:
            assert not torch.isnan(out[b]).any(), b
    good = sorted(set(range(len(lens))) - bad)
    errors = token_errors(out[good], ref[good])
    assert max(errors) < TIGHT and torch.equal(out[3], torch.zeros_like(out[3])), errors
    kv_indptr = aiter.calls_to("mla_decode_fwd")[-1].arguments["kv_indptr"].value
    assert (kv_indptr[1:] - kv_indptr[:-1]).tolist() == [0 if b in bad else n for b, n in enumerate(lens)]
    out = decode(case)  # the same plan, valid inputs again: right everywhere
    assert_tight(case, out)


def test_a_paged_cache_without_pages_gives_zeros_or_nan_without_calling_aiter(standin):
    aiter = standin("RUNNER")
    case = make_paged_case("fp8", 16, [0, 0], seed=1)
    case = case._replace(kv_cache=case.kv_cache[:0])
    out = decode(case)
    assert torch.equal(out, torch.zeros_like(out)) and aiter.calls == []
    out = decode(case._replace(cache_seqlens=torch.tensor([0, 3], dtype=torch.int32)))  # its page cannot exist
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isnan(out[1]).all() and aiter.calls == []


def test_return_lse_is_refused_naming_the_lse(standin):
    standin("RUNNER")
    case = make_paged_case("fp8", 16, [5, 9], seed=1)
    for call in (lambda: mla_decode.mla_decode_with_kvcache(*case.args(), backend="aiter", return_lse=True),
                 lambda: mla_decode.mla_decode_with_kvcache(*case.args(), backend="aiter")):  # the default asks one
        with pytest.raises(RuntimeError, match="LSE"):
            call()


def test_the_softmax_scale_given_is_used_and_1pct_off_fails_the_bound(standin):
    """Negative control: a call whose softmax_scale is 1% off matches the truth at that scale, and misses the truth
    at the default scale by more than TIGHT (measured ~1.2e-2 worst token): the bound can see a 1% error."""
    standin("RUNNER")
    case = make_paged_case("fp8", 16, LENS, seed=2)
    off = DEFAULT_SCALE * 1.01
    out = decode(case, softmax_scale=off)
    assert_tight(case, out, off)
    assert max(token_errors(out, fp8_q_reference(case))) > TIGHT
    assert max(token_errors(torch.zeros_like(out), fp8_q_reference(case))) > TIGHT  # nor does an all-zero output pass


def test_the_page_table_is_followed(standin):
    """Negative control: the same cache read with another sequence's pages (two table rows swapped) misses the
    truth: the result depends on the table, not on where the rows lie."""
    standin("RUNNER")
    case = make_paged_case("fp8", 16, [40, 40, 40], seed=6)
    assert_tight(case, decode(case))
    swapped = case._replace(block_table=case.block_table[[1, 0, 2]].contiguous())
    errors = token_errors(decode(swapped), fp8_q_reference(case))
    assert errors[0] > TIGHT and errors[1] > TIGHT and errors[2] < TIGHT, errors


def test_other_lengths_and_tables_of_the_same_shapes_refill(standin):
    """One plan, called with other lengths and pages in tables of the same shapes: never stale metadata."""
    aiter = standin("NEWEST")
    for seed, lens in enumerate(([3, 50, 17], [50, 17, 3], [17, 3, 50], [3, 50, 17])):
        case = make_paged_case("fp8", 16, lens, seed=seed)
        assert_tight(case, decode(case))
    assert len(AB._AITER_PLANS) == 1 and aiter.stats["metadata_fills"] == 4


def test_a_paged_run_reads_nothing_on_the_host(standin, monkeypatch):
    """After the first run, a plan's run (out given) makes no host read (a device sync on a GPU): the pages are
    expanded on the device. The Q quantization in its torch form (without Triton's interpreter, whose own copies
    are not the backend's work)."""
    standin("RUNNER")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_paged_case("fp8", 16, LENS, seed=4)
    plan = mla_decode.plan(len(LENS), 16, case.block_table.shape[1], E4M3FN, "cpu", backend="aiter",
                           return_lse=False)
    plan.run(*case.args())
    out = torch.empty((len(LENS), 1, 16, 512), dtype=torch.bfloat16)
    case = make_paged_case("fp8", 16, LENS, seed=5)
    with HostReadsForbidden():
        plan.run(*case.args(), out=out)
    assert_tight(case, out)


def test_a_paged_plan_refuses_the_uniform_length_promise(standin):
    """kv_seq_len (the leaderboard's promise, ragged only) on a paged plan would key a plan that never reads the
    token indptr the pages expand to: refused at the door."""
    standin("RUNNER")
    problem = make_problem(4, E4M3FN, "cpu", layout="paged", page_size=16, max_pages=3, return_lse=False)
    with pytest.raises(ValueError, match="kv_seq_len: expected None for a paged plan"):
        DecodePlan(problem, "aiter", backend_options={"kv_seq_len": 36})
    DecodePlan(problem, "aiter", backend_options={"kv_seq_len": None})  # no promise: fine


def test_gfx942_fp8_flavour_on_a_paged_cache(standin):
    """aiter.dtypes.fp8 is e4m3fnuz on gfx942: an e4m3fnuz cache is read, Q quantized to it (maximum 240); an
    e4m3fn cache there is refused, naming aiter.dtypes.fp8."""
    standin("NEWEST", arch="gfx942")
    fnuz = torch.float8_e4m3fnuz
    case = make_paged_case("fp8", 16, LENS, seed=8, fp8=fnuz)
    out = decode(case)
    errors = token_errors(out, paged_reference(case, q=fp8_per_tensor(case.q, fnuz))[0])
    assert max(errors) < TIGHT, errors
    with pytest.raises(ValueError, match=r"aiter\.dtypes\.fp8"):
        decode(make_paged_case("fp8", 16, LENS, seed=8))


# --- q_len 2 and 4 (causal MTP decode) and 128 heads: aiter's non-persistent kernel, one split per sequence --------

# lengths 0 and 1, shorter than q_len (2, 3), odd, and longer than a kernel tile
MTP_LENS = [0, 1, 2, 3, 5, 17, 64, 130, 0, 300]
OTHER_SHAPES = sorted(shape for shape in AB.AITER_SHAPES if shape != (1, 16))  # (q_len, heads)


def mtp_decode(case, **kwargs) -> torch.Tensor:
    batch, q_len, heads, _ = case.q.shape
    out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), causal=case.causal, backend="aiter",
                                                  return_lse=False, **kwargs)
    assert lse is None
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (batch, q_len, heads, 512) and out.is_contiguous()
    return out


def blind_tokens(lens: list[int], q_len: int) -> list[tuple[int, int]]:
    """The (sequence, token) pairs that see no row: token t sees the first n - q_len + 1 + t."""
    return [(b, t) for b, n in enumerate(lens) for t in range(q_len) if n - q_len + 1 + t <= 0]


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
@pytest.mark.parametrize("page_size", (1, 16))
@pytest.mark.parametrize("shape", OTHER_SHAPES)
def test_mtp_and_128_heads_match_the_float64_truth(standin, version, page_size, shape):
    """Shuffled pages with NaN in every unowned slot, lengths 0, 1 and shorter than q_len: every token within TIGHT
    of the causal float64 truth, the tokens that see nothing exactly zero. One plan, called twice; aiter gets q and o
    as (batch x q_len, heads, ...) with qo_indptr in steps of q_len and max_seqlen_q = q_len, non-persistent with one
    split per sequence (no metadata), and runs the kernel AITER_SHAPES names."""
    q_len, heads = shape
    aiter = standin(version)
    batch = len(MTP_LENS)
    for call in range(2):
        case = make_paged_case("fp8", page_size, MTP_LENS, seed=100 * call + 7 * q_len + heads, q_len=q_len,
                               num_heads=heads)
        out = mtp_decode(case)
        assert_tight(case, out)
        for b, t in blind_tokens(MTP_LENS, q_len):
            assert torch.equal(out[b, t], torch.zeros_like(out[b, t])), (b, t)
    assert len(AB._AITER_PLANS) == 1 and {key.variant for key in AB._AITER_PLANS} == {AB.AITER_SINGLE_VARIANT}
    assert aiter.calls_to("get_mla_metadata_info_v1") == [] and aiter.calls_to("get_mla_metadata_v1") == []
    assert aiter.stats["work_empty"] > 0  # the stand-in wrote NaN for the empty sequences; the backend zeroed them
    kernel = AB.AITER_SHAPES[shape]
    assert aiter.launches == 2 * ((["fill valid_split_count"] if version == "NEWEST" else []) + [kernel])
    for call in aiter.calls_to("mla_decode_fwd"):
        d = call.arguments
        assert d["max_seqlen_q"] == q_len and d["work_meta_data"] is None and d["num_kv_splits"] == 1
        assert d["q"].shape == (batch * q_len, heads, 576) and d["q"].dtype == E4M3FN
        assert d["o"].shape == (batch * q_len, heads, 512) and d["page_size"] == 1
        assert d["qo_indptr"].value.tolist() == [b * q_len for b in range(batch + 1)]
        assert d["num_kv_splits_indptr"].value.tolist() == list(range(batch + 1))
        assert "causal" not in call.keywords  # NEWEST's default (True) picks the masked kernel; RUNNER has no flag


def ragged_of(case):
    """The paged case's sequences laid out ragged (rows in table order, consecutive), with poisoned rows after the
    last sequence: (kv_cache (rows, 1, 576), kv_indptr)."""
    rows = [owned_rows(case, b) for b in range(case.q.shape[0])]
    poison = case.kv_cache.view(-1, 576)[~torch.isfinite(case.keys).all(dim=1)][:3]  # unowned: the FP8 NaN byte
    kv = torch.cat([case.kv_cache.view(-1, 576)[torch.cat(rows)], poison])
    kv_indptr = torch.tensor([0] + [int(n) for n in torch.tensor([len(r) for r in rows]).cumsum(0)], dtype=torch.int32)
    return kv.view(-1, 1, 576), kv_indptr


@pytest.mark.parametrize("shape", OTHER_SHAPES)
def test_mtp_and_128_heads_on_a_ragged_cache(standin, shape):
    """The library's ragged plan: the same truth, NaN rows after the last sequence never read."""
    q_len, heads = shape
    standin("RUNNER")
    case = make_paged_case("fp8", 1, MTP_LENS, seed=3 * q_len + heads, q_len=q_len, num_heads=heads)
    kv, kv_indptr = ragged_of(case)
    plan = mla_decode.plan_ragged(len(MTP_LENS), E4M3FN, "cpu", max(MTP_LENS), num_heads=heads, q_len=q_len,
                                  causal=True, backend="aiter", return_lse=False)
    out, _ = plan.run_ragged(case.q, kv, kv_indptr, case.kv_scale)
    assert_tight(case, out)


@pytest.mark.parametrize("version", ("RUNNER", "NEWEST"))
@pytest.mark.parametrize("q_len", (2, 4))
def test_mtp_tuples_through_the_leaderboard_adapter(standin, version, q_len):
    """custom_kernel with config q_seq_len 2 or 4 (qo_indptr in steps of it), MLA_BACKEND=aiter: the adapter passes
    the table's variant, which does not apply to q_len > 1: the plan runs AITER_SINGLE_VARIANT. Both references."""
    import reference as R
    import submission as S
    from testkit.attention import assert_matches, fp32_attention

    standin(version)
    for call in range(2):
        data = R.generate_varlen_input([0, 1, 2, 3, 77, 130], seed=q_len + call, qseqlen=q_len, device=CPU)
        out = S.custom_kernel(data)
        assert tuple(out.shape) == (6 * q_len, 16, 512)
        assert_matches(data, out, fp32_attention(data, "fp8", fp8_per_tensor(data[0])), TIGHT, kv_format="fp8")
    assert {key.variant for key in S._AITER_PLANS} == {S.AITER_SINGLE_VARIANT} and len(S._AITER_PLANS) == 1


def test_mtp_bad_pages_give_nan_only_to_the_tokens_that_see_them(standin):
    """q_len 4: a sequence whose last owned slot lies on a page outside the cache keeps the tokens that stop before
    it (tokens 0-2 see the first n - 3 + t slots) and gives NaN to token 3; a page outside the cache at its first
    slot gives NaN to every token; a length past the table's capacity too. The others are right."""
    standin("RUNNER")
    lens = [33, 20, 9, 40]
    case = make_paged_case("fp8", 16, lens, seed=11, q_len=4)
    ref = fp8_q_reference(case)
    num_pages, capacity = case.kv_cache.shape[0], 16 * case.block_table.shape[1]
    seqlens, table = case.cache_seqlens.clone(), case.block_table.clone()
    table[0, 2] = num_pages + 1  # slot 32, sequence 0's last (n = 33): only token 3 sees it
    table[1, 0] = -1  # slot 0 of sequence 1: every token sees it
    seqlens[2] = capacity + 1
    out = mtp_decode(case._replace(cache_seqlens=seqlens, block_table=table))
    assert torch.isnan(out[0, 3]).all() and torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert not torch.isnan(out[0, :3]).any() and not torch.isnan(out[3]).any()
    errors = token_errors(torch.cat([out[0, :3], out[3]])[None], torch.cat([ref[0, :3], ref[3]])[None])
    assert max(errors) < TIGHT, errors


@pytest.mark.parametrize("shift", (-1, 1))
def test_a_causal_limit_off_by_one_fails_the_bound(standin, shift):
    """Negative control: a kernel whose causal limit is one row early or late (a stand-in with mask_shift) misses the
    float64 truth by more than TIGHT, and so does a non-causal reading (every token its whole sequence)."""
    standin("RUNNER", mask_shift=shift)
    case = make_paged_case("fp8", 16, MTP_LENS, seed=9, q_len=2)
    assert max(token_errors(mtp_decode(case), fp8_q_reference(case))) > TIGHT
    non_causal = paged_reference(case._replace(causal=False), q=fp8_per_tensor(case.q))[0]
    assert max(token_errors(non_causal, fp8_q_reference(case))) > TIGHT


def test_a_forced_variant_does_not_apply_to_mtp(standin, caplog):
    """A persistent variant asked for at q_len 2 (backend_options, as the leaderboard adapter passes its table's
    name): the plan runs AITER_SINGLE_VARIANT, and says so once."""
    standin("RUNNER")
    case = make_paged_case("fp8", 16, MTP_LENS, seed=1, q_len=2)
    problem = make_problem(len(MTP_LENS), E4M3FN, "cpu", layout="paged", page_size=16, q_len=2, causal=True,
                           max_pages=case.block_table.shape[1], return_lse=False, scale_dtype=None)
    with caplog.at_level("INFO", logger="mla_decode"):
        out, _ = DecodePlan(problem, "aiter", backend_options={"variant": "fp8_ps"}).run(*case.args())
    assert_tight(case, out)
    assert {key.variant for key in AB._AITER_PLANS} == {AB.AITER_SINGLE_VARIANT}
    assert "'fp8_ps' applies to q_len 1 with 16 heads" in caplog.text


def test_an_mtp_paged_run_reads_nothing_on_the_host(standin, monkeypatch):
    """q_len 4: after the first run, a plan's run makes no host read (the tokens that see nothing, and the bad-page
    limits, are worked out on the device). The Q quantization in its torch form, as above."""
    standin("RUNNER")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_paged_case("fp8", 16, MTP_LENS, seed=4, q_len=4)
    plan = mla_decode.plan(len(MTP_LENS), 16, case.block_table.shape[1], E4M3FN, "cpu", q_len=4, causal=True,
                           backend="aiter", return_lse=False)
    plan.run(*case.args())
    out = torch.empty((len(MTP_LENS), 4, 16, 512), dtype=torch.bfloat16)
    case = make_paged_case("fp8", 16, MTP_LENS, seed=5, q_len=4)
    with HostReadsForbidden():
        plan.run(*case.args(), out=out)
    assert_tight(case, out)
