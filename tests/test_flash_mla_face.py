"""mla_decode.flash_mla, FlashMLA's interface, on the CPU (auto picks the torch backend there): against a float64
reference of this file's own over fresh random data (uneven lengths with 0 and 1, shuffled page tables whose unused
entries point far outside the cache, NaN in every cache slot no sequence owns), BF16 and FP8, s_q 1 and 2, causal;
the LSE's convention (natural log, +inf where nothing is seen); the metadata's tie to its cache_seqlens; the bad
arguments' messages; and the negative controls that show the bound fails a zero output, a dropped KV row, a read
past a sequence's end and a base-2 LSE."""

import math
import os
from pathlib import Path

import pytest
import torch

import mla_decode
from mla_decode import flash_mla
from mla_decode.flash_mla import MlaMetadata, flash_mla_with_kvcache, flash_mla_with_kvcache_fp8, get_mla_metadata
from mla_decode.triton.common import triton

PAGE = 16
HEADS = 16
LENS = [0, 1, 37, 64, 130, 5]  # empty, one row, mid-page, page-exact, several pages, short
INVALID_PAGE = 2147480000  # what FlashMLA's test writes in the table past a sequence's pages
SCALE = 576 ** -0.5
FP8 = torch.float8_e4m3fn
# bf16 output: its rounding is <= 2^-8 |x| (8 significant bits); fp32 sums add ~1e-6. The bound is twice that; a
# dropped row moves an output by ~1e-2, over 700 times it here (test_negative_controls_fail_the_bound).
OUT_REL, OUT_ABS = 2.0 ** -7, 2e-5
# fp32 LSE: < 1e-6 off. A dropped row moves it by that row's weight (>= ~1e-3 here), base 2 by a factor 1.44.
LSE_REL = 1e-5


def make_case(seed: int, s_q: int, fp8: bool = False, lens=LENS, page: int = PAGE, heads: int = HEADS,
              descale_q: float = 0.5, descale_k: float = 0.09375) -> dict:
    """Fresh random inputs as FlashMLA takes them, and their exact float64 values (q64, kv64)."""
    g = torch.Generator().manual_seed(seed)
    batch, pages_of = len(lens), [-(-n // page) for n in lens]
    max_pages, num_pages = max(pages_of) + 1, sum(pages_of) + 3  # a spare column and 3 pages nobody owns
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((batch, max_pages), INVALID_PAGE, dtype=torch.int32)
    owned = torch.zeros(num_pages, page, dtype=torch.bool)
    for b, n in enumerate(lens):
        pages, order = order[:pages_of[b]], order[pages_of[b]:]
        table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for j in range(n):
            owned[pages[j // page], j % page] = True
    kv = torch.randn(num_pages, page, 1, 576, generator=g)
    kv[~owned] = float("nan")  # every slot no sequence owns: a read of one shows as NaN
    q = torch.randn(batch, s_q, heads, 576, generator=g)
    case = {"block_table": table, "cache_seqlens": torch.tensor(lens, dtype=torch.int32), "s_q": s_q, "fp8": fp8}
    if fp8:
        case["q"], case["k_cache"] = (q / descale_q).to(FP8), (kv / descale_k).to(FP8)
        case["descale_q"] = torch.tensor([descale_q], dtype=torch.float32)
        case["descale_k"] = torch.tensor([descale_k], dtype=torch.float32)
        case["q64"], case["kv64"] = case["q"].double() * descale_q, case["k_cache"].double() * descale_k
    else:
        case["q"], case["k_cache"] = q.bfloat16(), kv.bfloat16()
        case["q64"], case["kv64"] = case["q"].double(), case["k_cache"].double()
    return case


def reference(case: dict, causal: bool, scale: float = SCALE, drop: tuple | None = None, lens=None) -> tuple:
    """Float64 attention over the rows each sequence owns, in table order -> (out (b, s_q, h, 512), lse (b, h, s_q)),
    lse natural and +inf where a query sees nothing (out 0 there). drop (b, j): leave out sequence b's row j (a
    negative control); lens: lengths to read instead of cache_seqlens (another)."""
    q64, rows, table = case["q64"], case["kv64"].reshape(-1, 576), case["block_table"]
    batch, s_q, heads, _ = q64.shape
    page = case["kv64"].shape[1]
    lens = case["cache_seqlens"].tolist() if lens is None else lens
    out = torch.zeros(batch, s_q, heads, 512, dtype=torch.float64)
    lse = torch.full((batch, heads, s_q), math.inf, dtype=torch.float64)
    for b, n in enumerate(lens):
        positions = [j for j in range(n) if drop != (b, j)]
        if not positions:
            continue
        keys = rows[[int(table[b, j // page]) * page + j % page for j in positions]]
        scores = torch.einsum("thd,nd->thn", q64[b], keys) * scale
        limit = torch.tensor([n - s_q + 1 + t if causal else n for t in range(s_q)])  # query t sees j < limit[t]
        seen = torch.tensor(positions)[None, :] < limit[:, None]  # (s_q, n')
        scores = scores.masked_fill(~seen[:, None, :], -math.inf)
        any_seen = seen.any(dim=-1)  # (s_q,)
        weights = torch.softmax(torch.where(any_seen[:, None, None], scores, 0.0), dim=-1)
        out[b] = torch.where(any_seen[:, None, None], weights @ keys[:, :512], 0.0)
        lse[b] = torch.where(any_seen[:, None], torch.logsumexp(scores, dim=-1), math.inf).T
    return out, lse


def worst(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
          out_rel: float = OUT_REL) -> float:
    """The largest error over its bound, out's and lse's (<= 1 passes; inf for a NaN, or +inf where the reference
    has none or lacks one)."""
    out, lse = out.double(), lse.double()
    out_ratio = (out - ref_out).abs() / (out_rel * ref_out.abs() + OUT_ABS)
    if out_ratio.isnan().any():
        return math.inf
    empty = ref_lse == math.inf
    if not torch.equal(empty, lse == math.inf) or lse.isnan().any():
        return math.inf
    lse_ratio = ((lse - ref_lse).abs() / (LSE_REL * (1 + ref_lse.abs())))[~empty]
    return max(out_ratio.max().item(), lse_ratio.max().item() if lse_ratio.numel() else 0.0)


def run(case: dict, causal: bool, **kwargs) -> tuple:
    """The engine's two calls: the metadata once, then the decode."""
    batch, s_q, heads = case["q"].shape[:3]
    metadata, num_splits = get_mla_metadata(case["cache_seqlens"], s_q * heads, 1, heads, case["fp8"])
    args = (case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"], 512, metadata, num_splits)
    if case["fp8"]:
        return flash_mla_with_kvcache_fp8(*args, causal=causal, descale_q=case["descale_q"],
                                          descale_k=case["descale_k"], **kwargs)
    return flash_mla_with_kvcache(*args, causal=causal, **kwargs)


CALLS = [(1, False), (2, False), (2, True)]
# conftest.py turns Triton's interpreter on where there is no GPU
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or triton is None,
                                       reason="needs triton under its interpreter (a CPU-only machine)")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("s_q, causal", CALLS)
def test_decode_matches_float64(fp8, s_q, causal):
    case = make_case(seed=10 * s_q + causal + 100 * fp8, s_q=s_q, fp8=fp8)
    out, lse = run(case, causal)
    assert out.shape == (6, s_q, HEADS, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (6, HEADS, s_q) and lse.dtype == torch.float32
    assert worst(out, lse, *reference(case, causal)) <= 1


@needs_interpreter
@pytest.mark.parametrize("fp8, s_q, causal", [(False, 1, False), (True, 2, True)], ids=["bf16", "fp8-causal"])
def test_triton_backend_under_the_interpreter(fp8, s_q, causal):
    """The face over a plan that reads nothing on the host (the triton kernel, interpreted on the CPU). The
    interpreter's bf16 cast truncates (up to one ulp, 2^-7): the out bound doubles."""
    case = make_case(seed=31 + fp8, s_q=s_q, fp8=fp8, lens=[0, 1, 37, 64, 130])
    out, lse = run(case, causal, backend="triton")
    assert worst(out, lse, *reference(case, causal), out_rel=2 * OUT_REL) <= 1


def test_page_size_64_and_128_heads():
    """FlashMLA's own page size and head count, and a q_len of 2 with s_q * h_q = 256 query rows a sequence."""
    case = make_case(seed=7, s_q=2, lens=[3, 0, 129, 64], page=64, heads=128)
    out, lse = run(case, causal=True)
    assert worst(out, lse, *reference(case, causal=True)) <= 1


def test_negative_controls_fail_the_bound():
    """The bound of test_decode_matches_float64 fails: a zero output; a reference that drops sequence b's first or
    last row, for every sequence that has one; one that reads a slot past a sequence's end (NaN there); and an LSE in
    base 2, or -inf (mla_decode's own value) where nothing is seen."""
    for fp8 in (False, True):
        case = make_case(seed=3 + fp8, s_q=2, fp8=fp8)
        ref_out, ref_lse = reference(case, causal=True)
        out, lse = run(case, causal=True)
        assert worst(out, lse, ref_out, ref_lse) <= 1
        assert worst(torch.zeros_like(out), lse, ref_out, ref_lse) > 1
        for b, n in enumerate(LENS):
            for j in {0, n - 1} if n else ():
                assert worst(*reference(case, True, drop=(b, j)), ref_out, ref_lse) > 1, (b, j)
        past = [n + 1 if n % PAGE else n for n in LENS]  # a spare slot of the last page: poisoned
        assert worst(*reference(case, True, lens=past), ref_out, ref_lse) == math.inf
        assert worst(out, lse / math.log(2), ref_out, ref_lse) > 1
        assert worst(out, torch.where(lse == math.inf, -math.inf, lse), ref_out, ref_lse) == math.inf


def test_lse_is_natural_and_inf_where_nothing_is_seen():
    """One key: lse is that key's scaled score exactly (natural log of exp(score)); an empty sequence gives out 0 and
    lse +inf, and with s_q 2 causal a length-1 sequence's first token sees nothing, its second the one key."""
    case = make_case(seed=5, s_q=2, lens=[1, 0])
    out, lse = run(case, causal=True)
    key = case["kv64"].reshape(-1, 576)[int(case["block_table"][0, 0]) * PAGE]
    score = (case["q64"][0, 1] @ key) * SCALE  # (heads,)
    torch.testing.assert_close(lse[0, :, 1].double(), score, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0, 1].double(), key[:512].expand(HEADS, 512), atol=0, rtol=2.0 ** -8)
    assert (lse[0, :, 0] == math.inf).all() and (out[0, 0] == 0).all()
    assert (lse[1] == math.inf).all() and (out[1] == 0).all()


def test_fp8_q_is_dequantized_as_documented():
    """With a descale_q that is no power of two, the FP8 path is the BF16-q decode of (q.float() * descale_q) rounded
    to bf16 over the same cache and scale, bit for bit; with a power of two it is exact (the float64 test above)."""
    case = make_case(seed=11, s_q=2, fp8=True, descale_q=0.37)
    out, lse = run(case, causal=True)
    q_bf16 = (case["q"].float() * 0.37).bfloat16()
    want_out, want_lse = mla_decode.mla_decode_with_kvcache(q_bf16, case["k_cache"], case["block_table"],
                                                            case["cache_seqlens"], case["descale_k"], causal=True,
                                                            precision="precise")
    assert torch.equal(out, want_out)
    assert torch.equal(lse, torch.where(want_lse == -math.inf, math.inf, want_lse))


def test_softmax_scale_default_and_plans_keyed_on_it():
    """softmax_scale None is 576 ** -0.5 (FlashMLA's head_dim ** -0.5); another scale gets its own plan and its own
    result, matching the reference at that scale; a repeated call makes no new plan."""
    case = make_case(seed=13, s_q=1)
    default, explicit = run(case, False), run(case, False, softmax_scale=SCALE)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    plans = len(flash_mla._PLANS)
    run(case, False)
    assert len(flash_mla._PLANS) == plans
    out, lse = run(case, False, softmax_scale=0.1)
    assert worst(out, lse, *reference(case, False, scale=0.1)) <= 1
    assert worst(*default, *reference(case, False, scale=0.1)) > 1


def test_metadata_is_opaque_and_tied_to_its_cache_seqlens():
    case = make_case(seed=17, s_q=1)
    lens, heads = case["cache_seqlens"], HEADS
    metadata, num_splits = get_mla_metadata(lens, heads, 1)
    assert isinstance(metadata, MlaMetadata) and metadata.cache_seqlens is lens
    assert torch.equal(num_splits, torch.arange(7, dtype=torch.int32))
    args = (case["q"], case["k_cache"], case["block_table"])

    flash_mla_with_kvcache(*args, lens[:], 512, metadata, num_splits)  # a view of exactly its elements: the same
    with pytest.raises(ValueError, match="tile_scheduler_metadata: .*made from another tensor"):
        flash_mla_with_kvcache(*args, lens.clone(), 512, metadata, num_splits)  # equal contents, other memory
    other, _ = get_mla_metadata(lens.clone(), heads, 1)
    with pytest.raises(ValueError, match="tile_scheduler_metadata: .*another tensor"):
        flash_mla_with_kvcache(*args, lens, 512, other, num_splits)
    with pytest.raises(ValueError, match="tile_scheduler_metadata: .*num_q_tokens_per_head_k = s_q \\* h_q"):
        flash_mla_with_kvcache(*args, lens, 512, get_mla_metadata(lens, 2 * heads, 1)[0], num_splits)
    with pytest.raises(ValueError, match="tile_scheduler_metadata: .*num_heads_q = 16"):
        flash_mla_with_kvcache(*args, lens, 512, get_mla_metadata(lens, heads, 1, 8)[0], num_splits)
    with pytest.raises(ValueError, match="tile_scheduler_metadata: .*is_fp8_kvcache=False"):
        flash_mla_with_kvcache(*args, lens, 512, get_mla_metadata(lens, heads, 1, None, True)[0], num_splits)
    with pytest.raises(TypeError, match="tile_scheduler_metadata: expected the MlaMetadata"):
        flash_mla_with_kvcache(*args, lens, 512, torch.zeros(132, 8, dtype=torch.int32), num_splits)
    lens[2] += 1  # the engine updated the lengths in place and kept last step's metadata: stale
    with pytest.raises(ValueError, match="tile_scheduler_metadata: .*stale metadata"):
        flash_mla_with_kvcache(*args, lens, 512, metadata, num_splits)
    fresh, num_splits = get_mla_metadata(lens, heads, 1)
    flash_mla_with_kvcache(*args, lens, 512, fresh, num_splits)


def test_a_step_makes_one_schedule_per_plan_and_its_layers_reuse_it(monkeypatch):
    """The step's schedule is made at the first layer that runs a plan (DecodePlan.schedule) and passed to that
    layer's run and every later one: one schedule a plan a step, none made again by the layers."""
    case = make_case(seed=21, s_q=1)
    lens = case["cache_seqlens"]
    metadata, num_splits = get_mla_metadata(lens, HEADS, 1)
    made, given = [], []
    real_schedule, real_run = mla_decode.DecodePlan.schedule, mla_decode.DecodePlan.run

    def schedule(self, seqs):
        made.append(self)
        return real_schedule(self, seqs)

    def run(self, *args, schedule=None, **kwargs):
        given.append(schedule)
        return real_run(self, *args, schedule=schedule, **kwargs)

    monkeypatch.setattr(mla_decode.DecodePlan, "schedule", schedule)
    monkeypatch.setattr(mla_decode.DecodePlan, "run", run)
    args = (case["q"], case["k_cache"], case["block_table"], lens, 512, metadata, num_splits)
    for _ in range(3):  # three layers of one step
        flash_mla_with_kvcache(*args)
    assert len(made) == 1 and list(metadata.schedules) == made
    assert len(given) == 3 and all(g is metadata.schedules[made[0]] for g in given)


def test_inference_mode_as_flashmla_test_runs():
    """FlashMLA's test makes its tensors under torch.inference_mode: they have no version counter, and the call works
    (the tie to the tensor still holds)."""
    with torch.inference_mode():
        case = make_case(seed=19, s_q=2)
        out, lse = run(case, causal=True)
        metadata, num_splits = get_mla_metadata(case["cache_seqlens"], 2 * HEADS, 1)
        with pytest.raises(ValueError, match="another tensor"):
            flash_mla_with_kvcache(case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"].clone(),
                                   512, metadata, num_splits)
    assert worst(out, lse, *reference(case, causal=True)) <= 1


def _bad_calls():
    """(what to change in a good call, the argument the message must name)."""
    return [
        ({"head_dim_v": 128}, "head_dim_v"),
        ({"indices": torch.zeros(6, 1, 64, dtype=torch.int32)}, "indices"),
        ({"is_fp8_kvcache": True}, "is_fp8_kvcache"),
        ({"q": "fp16"}, "q.dtype"),
        ({"q": "short"}, "q.shape"),
        ({"k_cache": "fp8"}, "k_cache.dtype"),
        ({"k_cache": "two_heads"}, "k_cache.shape"),
        ({"k_cache": "strided"}, "k_cache"),
        ({"block_table": "int64"}, "block_table.dtype"),
        ({"block_table": "batch"}, "block_table.shape"),
        ({"cache_seqlens": "batch"}, "cache_seqlens.shape"),
        ({"num_splits": "short"}, "num_splits"),
        ({"softmax_scale": -1.0}, "softmax_scale"),
        ({"causal": 1}, "causal"),
        ({"backend": "nope"}, "backend"),
    ]


def _mutate(case: dict, change: dict) -> dict:
    q, k, table, lens = case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"]
    metadata, num_splits = get_mla_metadata(lens, HEADS, 1)
    call = {"q": q, "k_cache": k, "block_table": table, "cache_seqlens": lens, "head_dim_v": 512,
            "tile_scheduler_metadata": metadata, "num_splits": num_splits}
    forms = {"fp16": q.half(), "short": q[..., :512], "fp8": k.to(FP8), "two_heads": k.expand(-1, -1, 2, -1),
             "strided": k[:, ::2], "int64": table.long(), "batch": None}
    for name, value in change.items():
        if name == "block_table" and value == "batch":
            value = table[:3]
        elif name == "cache_seqlens" and value == "batch":
            value = lens[:3]
        elif name == "num_splits" and value == "short":
            value = num_splits[:3]
        elif isinstance(value, str) and name != "backend":
            value = forms[value]
        call[name] = value
    return call


@pytest.mark.parametrize("change, field", _bad_calls(), ids=lambda x: str(x) if isinstance(x, str) else None)
def test_bad_arguments_are_named(change, field):
    case = make_case(seed=23, s_q=1)
    with pytest.raises((ValueError, TypeError), match=f"^{field.replace('.', '[.]')}"):
        flash_mla_with_kvcache(**_mutate(case, change))


def test_bad_metadata_and_fp8_arguments_are_named():
    lens = torch.tensor([3, 4], dtype=torch.int32)
    for call, field in [
        (lambda: get_mla_metadata(lens, 16, 1, topk=128), "topk"),
        (lambda: get_mla_metadata(lens, 16, 2), "num_heads_k"),
        (lambda: get_mla_metadata(lens, 0, 1), "num_q_tokens_per_head_k"),
        (lambda: get_mla_metadata(lens, 24, 1, 16), "num_q_tokens_per_head_k"),
        (lambda: get_mla_metadata(lens.long(), 16, 1), "cache_seqlens.dtype"),
        (lambda: get_mla_metadata(torch.zeros(4, dtype=torch.int32)[::2], 16, 1), "cache_seqlens"),
        (lambda: get_mla_metadata([3, 4], 16, 1), "cache_seqlens"),
    ]:
        with pytest.raises((ValueError, TypeError), match=f"^{field}"):
            call()
    case = make_case(seed=29, s_q=1, fp8=True)
    metadata, num_splits = get_mla_metadata(case["cache_seqlens"], HEADS, 1, HEADS, True)
    args = (case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"], 512, metadata, num_splits)
    scales = {"descale_q": case["descale_q"], "descale_k": case["descale_k"]}
    for change, field in [({"descale_q": None}, "descale_q"), ({"descale_k": None}, "descale_k"),
                          ({"descale_k": torch.ones(2)}, "descale_k"),
                          ({"descale_q": torch.ones(1, dtype=torch.float64)}, "descale_q")]:
        with pytest.raises((ValueError, TypeError), match=f"^{field}"):
            flash_mla_with_kvcache_fp8(*args, **{**scales, **change})
    with pytest.raises(ValueError, match="^q.dtype"):
        flash_mla_with_kvcache_fp8(case["q"].bfloat16(), *args[1:], **scales)
    with pytest.raises(ValueError, match="^k_cache.dtype"):
        flash_mla_with_kvcache_fp8(case["q"], case["k_cache"].bfloat16(), *args[2:], **scales)
    with pytest.raises(ValueError, match="^tile_scheduler_metadata: .*is_fp8_kvcache=True"):
        flash_mla_with_kvcache_fp8(*args[:5], get_mla_metadata(case["cache_seqlens"], HEADS, 1)[0], num_splits,
                                   **scales)


def test_a_table_and_cache_of_no_pages():
    """FlashMLA takes a block_table of no columns and a cache of no pages when every length is 0 (its test makes
    them): out 0, lse +inf. A positive length there names no page: the torch backend says so (the GPU ones give NaN)."""
    q = torch.randn(2, 2, HEADS, 576).bfloat16()
    table, cache = torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0, 64, 1, 576, dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32)
    out, lse = flash_mla_with_kvcache(q, cache, table, lens, 512, *get_mla_metadata(lens, 2 * HEADS, 1), causal=True)
    assert (out == 0).all() and (lse == math.inf).all()
    lens[1] = 3
    with pytest.raises(ValueError, match=r"^block_table\[1, 0\]"):
        flash_mla_with_kvcache(q, cache, table, lens, 512, *get_mla_metadata(lens, 2 * HEADS, 1))


SYNTHETIC_TEST = '''"""Shaped like FlashMLA's dense decode test: TestParam, test_flash_mla(t), main(dtype)."""
import dataclasses

import torch

import flash_mla


@dataclasses.dataclass
class TestParam:
    b: int
    s_q: int
    is_fp8: bool = False
    topk: int = None
    test_performance: bool = False
    have_zero_seqlen_k: bool = False
    want_minus_inf: bool = False  # a case that must fail: it expects mla_decode's -inf, not FlashMLA's +inf


@torch.inference_mode()
def test_flash_mla(t):
    lens = torch.tensor([0] + [5] * (t.b - 1), dtype=torch.int32)
    metadata, num_splits = flash_mla.get_mla_metadata(lens, t.s_q * 16, 1, 16, t.is_fp8, t.topk)
    q = torch.randn(t.b, t.s_q, 16, 576)
    cache = torch.randn(t.b, 64, 1, 576)
    table = torch.arange(t.b, dtype=torch.int32).view(t.b, 1)
    if t.is_fp8:
        one = torch.ones(1)
        out, lse = flash_mla.flash_mla_with_kvcache_fp8(q.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn),
                                                        table, lens, 512, metadata, num_splits, causal=True,
                                                        descale_q=one, descale_k=one)
    else:
        out, lse = flash_mla.flash_mla_with_kvcache(q.bfloat16(), cache.bfloat16(), table, lens, 512, metadata,
                                                    num_splits, causal=True)
    assert (lse[0] == (float("-inf") if t.want_minus_inf else float("inf"))).all()
    assert lse[1:].isfinite().all() and out.shape == (t.b, t.s_q, 16, 512)


def main(dtype):
    torch.set_default_dtype(torch.float32)
    for t in [TestParam(2, 1), TestParam(3, 2, is_fp8=True), TestParam(2, 1, is_fp8=True, topk=128),
              TestParam(2, 1, want_minus_inf=True), TestParam(2, 2, have_zero_seqlen_k=True),
              TestParam(2, 1, test_performance=True)]:
        test_flash_mla(t)
'''


@pytest.fixture
def isolated_imports(monkeypatch):
    """sys.path and the stand-in's modules as they were, after a test that runs bench/flashmla_test.py in-process."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "flash_mla" or name.startswith("flash_mla.") or name == "flashmla_decoding_test":
            del sys.modules[name]


def test_bench_runner_on_a_synthetic_flashmla_test(tmp_path, isolated_imports):
    """bench/flashmla_test.py: the stand-in answers `import flash_mla` with our functions (and names what it lacks);
    each case runs through the file's own test_flash_mla, sparse ones skipped, failures recorded, the exit status 1;
    --only, --caches and --shard select."""
    import json

    from bench import flashmla_test

    test_file = tmp_path / "test_flash_mla_decoding.py"
    test_file.write_text(SYNTHETIC_TEST)
    summary_file = tmp_path / "summary.json"
    assert flashmla_test.main([str(tmp_path), "--json", str(summary_file)]) == 1
    summary = json.loads(summary_file.read_text())
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (4, 1, {"sparse": 1, "not selected": 0})
    assert "want_minus_inf=True" in summary["failures"][0]["case"]
    assert flashmla_test.main([str(test_file), "--only", "corner,performance", "--json", str(summary_file)]) == 0
    summary = json.loads(summary_file.read_text())
    assert (summary["passed"], summary["skipped"]["not selected"]) == (2, 3)
    assert flashmla_test.main([str(test_file), "--only", "correctness", "--shard", "2/3", "--json",
                               str(summary_file)]) == 0
    assert json.loads(summary_file.read_text())["passed"] == 1  # the 2nd of 3 correctness cases
    assert flashmla_test.main([str(test_file), "--only", "correctness", "--caches", "fp8", "--json",
                               str(summary_file)]) == 0
    summary = json.loads(summary_file.read_text())
    assert (summary["passed"], summary["skipped"]["not selected"]) == (1, 4)  # the one dense FP8 case
    with pytest.raises(SystemExit):
        flashmla_test.main([str(test_file), "--caches", "fp16"])

    package = flashmla_test.write_standin(tmp_path / "standin")
    module = flashmla_test.import_test(test_file, tmp_path / "standin")
    import flash_mla

    assert flash_mla.get_mla_metadata is get_mla_metadata and module.flash_mla is flash_mla
    assert flash_mla.flash_mla_with_kvcache.func is flash_mla_with_kvcache
    assert Path(flash_mla.__file__).parent == package
    with pytest.raises(AttributeError, match="flash_mla.flash_mla_sparse_fwd: the stand-in"):
        flash_mla.flash_mla_sparse_fwd  # noqa: B018


FETCHED = Path(__file__).resolve().parent.parent / ".peers" / "flashmla-test" / "test_flash_mla_decoding.py"


@pytest.mark.skipif(not FETCHED.is_file(), reason="FlashMLA's test is fetched, not committed: .peers/flashmla-test/")
def test_flashmla_own_test_on_the_cpu(tmp_path, isolated_imports):
    """FlashMLA's unmodified test_flash_mla, its reference and tolerances, on bench/flashmla_test.py's small CPU cases
    (BF16 and FP8, s_q 1 and 2, causal, varlen, zero lengths, all-zero lengths), where the fetched file is present."""
    import json

    from bench import flashmla_test

    summary_file = tmp_path / "summary.json"
    assert flashmla_test.main([str(FETCHED), "--cpu-smoke", "--json", str(summary_file)]) == 0
    summary = json.loads(summary_file.read_text())
    assert summary["failed"] == 0 and summary["passed"] == 5 and summary["skipped"]["sparse"] == 1
