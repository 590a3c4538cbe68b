"""The work-balanced schedule on the GPU. The cuda backend: the schedule kernel lists exactly the pieces and the parts'
first pieces of the CPU reference (mla_decode.schedule.schedule_items and part_first); balanced decodes of uneven
batches (lengths 0, 1, odd, one long sequence beside short ones, heavy tails; shuffled pages, NaN in every unowned
slot) meet the float64 truth within the library's GPU bounds and agree with the fixed splits. Both backends that cut
it (cuda, triton): a step's schedule serves every layer, is refused when stale, replays in a CUDA graph with new
lengths, and two threads on two streams get what each gets alone; planted faults in the schedule (a tile dropped, a
tile taken twice, a piece's count wrong) fail the bounds. The triton backend's schedule kernel and decodes:
tests/test_triton_gpu.py."""

import threading

import pytest
import torch

import mla_decode
from mla_decode.schedule import CUTS, fill_schedule, make_schedule, pack_schedule, part_first, schedule_items
from testkit.balanced import balanced_plan, plan_truth
from testkit.paged import errors, make_paged_case, ragged_twin

needs_nvidia = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                                  reason="needs an NVIDIA GPU")
pytestmark = [pytest.mark.gpu, needs_nvidia]
BACKENDS = ("cuda", "triton")  # the backends that cut the balanced schedule
SPREADS = {
    "edges": [0, 1, 63, 64, 65, 127, 1001, 0, 5000, 3],
    "one-long": [20000] + [700] * 15,
    "lognormal": [int(x) for x in torch.exp(torch.randn(24, generator=torch.Generator().manual_seed(5)) * 1.3
                                            + 7.0).clamp(max=30000)],
}
# A wide batch for the schedule kernels alone: the pack cut sorts 4096 keys (the most it takes) over many rounds
WIDE = [int(x) for x in torch.randint(0, 300, (2100,), generator=torch.Generator().manual_seed(6))]


def backend_plan(backend: str, case, precision: str = "fast", **options):
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    return balanced_plan(backend, case, precision, **options)


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("min_share,slack", [(1, 0), (7, 0), (1, 14)])
@pytest.mark.parametrize("spread", sorted(SPREADS) + ["wide"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_the_schedule_kernel_lists_the_reference_pieces(spread, page_size, min_share, slack, cut):
    """The kernel's pieces are the reference's, bit for bit (the line cut takes no slack)."""
    lens = {**SPREADS, "wide": WIDE}[spread]
    case = make_paged_case("fp8", page_size, lens, seed=1, device="cuda")
    plan = backend_plan("cuda", case, min_share=min_share, cut=cut, slack=slack)
    made = plan.schedule(case.cache_seqlens)
    capacity = case.block_table.shape[1] * page_size
    lengths, parts, max_items = case.cache_seqlens.cpu(), plan.impl.parts, plan.impl.max_items
    if cut != "line":
        cut_of = {"fill": fill_schedule, "pack": pack_schedule}[cut]
        want = cut_of(lengths, parts, capacity, min_share=min_share, max_items=max_items, slack=slack)
    else:
        s = make_schedule(lengths, parts, capacity, min_share=min_share)
        want = torch.cat([schedule_items(s, max_items).flatten(), part_first(s)])
    assert torch.equal(made.items.cpu(), want)
    kv, _, indptr = ragged_twin(case)  # the ragged plan cuts the same pieces from kv_indptr
    ragged = mla_decode.plan_ragged(len(lens), kv.dtype, "cuda", max(lens), backend="cuda",
                                    backend_options={"schedule": "balanced", "min_share": min_share, "cut": cut,
                                                     "slack": slack})
    assert ragged.impl.parts == plan.impl.parts
    assert torch.equal(ragged.schedule(indptr).items.cpu(), want)


# The cut's options beside the plan's defaults (the fill cut): the line cut, the pack cut, a least share that cuts
# fewer, larger pieces, and a slack that keeps more sequences whole in longer parts
CUT_OPTIONS = {"default": {}, "line": {"cut": "line"}, "pack": {"cut": "pack"}, "least-share": {"min_share": 9},
               "slack": {"slack": 30}}


@pytest.mark.parametrize("options", sorted(CUT_OPTIONS))
@pytest.mark.parametrize("num_heads,q_len", [(16, 1), (32, 2), (128, 1), (64, 2)])
@pytest.mark.parametrize("kernel", [("fp8", "fast"), ("fp8", "precise"), ("mxfp4", "fast"), ("bf16", "fast")],
                         ids="-".join)
@pytest.mark.parametrize("spread", sorted(SPREADS))
def test_balanced_decodes_meet_the_truth(spread, kernel, num_heads, q_len, options):
    kv_format, precision = kernel
    if precision == "precise" and (num_heads, q_len) != (16, 1):
        pytest.skip("one shape of the precise kernel: its units are 16 rows, like the first")
    if options == "least-share" and (kernel != ("fp8", "fast") or q_len != 1):
        pytest.skip("a least share: the 16- and 64-row FP8 fast kernels (the cut is the kernels' input alone)")
    if options == "slack" and kernel not in (("fp8", "fast"), ("bf16", "fast")):
        pytest.skip("a slack: the FP8 and BF16 fast kernels (the cut is the kernels' input alone)")
    case = make_paged_case(kv_format, 64 if spread != "edges" else 16, SPREADS[spread], seed=len(spread),
                           device="cuda", q_len=q_len, num_heads=num_heads)
    plan = backend_plan("cuda", case, precision, **CUT_OPTIONS[options])
    out = torch.full((*case.q.shape[:3], 512), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    out, lse = plan.run(*case.args(), out=out)
    (ref_out, ref_lse), (out_bound, lse_bound) = plan_truth(case, plan, precision)
    out_error, lse_error = errors(out, lse, ref_out, ref_lse)
    assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"
    fixed_out, fixed_lse = backend_plan("cuda", case, precision, schedule="fixed").run(*case.args())
    assert errors(out, lse, fixed_out.double().cpu(), fixed_lse.double().cpu())[0] < out_bound


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_schedule_serves_every_layer_and_a_stale_one_is_refused(backend):
    case = make_paged_case("fp8", 64, SPREADS["one-long"], seed=2, device="cuda")
    plan = backend_plan(backend, case)
    step = plan.schedule(case.cache_seqlens)
    alone = plan.run(*case.args())
    for _ in range(3):  # the layers of a step
        assert all(torch.equal(a, b) for a, b in zip(plan.run(*case.args(), schedule=step), alone, strict=True))
    with pytest.raises(ValueError, match="schedule: expected one made from the lengths tensor passed here"):
        plan.run(*case.args()[:3], case.cache_seqlens.clone(), case.kv_scale, schedule=step)
    case.cache_seqlens[1] -= 1  # the next step's lengths, written in place
    with pytest.raises(ValueError, match="stale"):
        plan.run(*case.args(), schedule=step)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_replays_the_schedule_with_new_lengths(backend):
    """One step (the schedule kernel, then two layers' runs) captured in a CUDA graph and replayed with other lengths:
    what the eager calls give, bit for bit, and the truth."""
    lens = SPREADS["lognormal"]
    case = make_paged_case("fp8", 64, lens, seed=3, device="cuda")
    plan = backend_plan(backend, case)
    out = torch.empty((len(lens), 1, 16, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((len(lens), 16, 1), dtype=torch.float32, device="cuda")

    def step():
        schedule = plan.schedule(case.cache_seqlens)
        for _ in range(2):
            plan.run(*case.args(), out=out, lse=lse, schedule=schedule)

    step()  # outside the capture first (twice: triton's JIT, then its compiled kernels' launchers)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):  # lengths of another step, shorter than the pages they own
        gen = torch.Generator().manual_seed(seed)
        new = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens]
        case.cache_seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        eager_out, eager_lse = plan.run(*case.args())
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        shorter = case._replace(cache_seqlens=case.cache_seqlens.clone())
        (ref_out, ref_lse), (out_bound, lse_bound) = plan_truth(shorter, plan, "fast")
        out_error, lse_error = errors(out, lse, ref_out, ref_lse)
        assert out_error < out_bound and lse_error < lse_bound, f"out {out_error:.2e}, lse {lse_error:.2e}"


@pytest.mark.parametrize("backend,kv_format,schedule", [("cuda", "fp8", "fixed"), ("cuda", "fp8", "balanced"),
                                                        ("cuda", "mxfp4", "balanced"), ("triton", "fp8", None),
                                                        ("triton", "bf16", None)])
def test_two_threads_on_two_streams_get_what_each_gets_alone(backend, kv_format, schedule):
    """One plan called from two threads at once, each on its own stream, with inputs of the same shapes: each call
    gets its own partials (and schedule), so each gets what it gets alone, bit for bit."""
    cases = [make_paged_case(kv_format, 64, SPREADS["one-long"], seed=7 + i, device="cuda") for i in range(2)]
    case = cases[0]
    batch, q_len, heads = case.q.shape[:3]
    if backend == "cuda":
        pytest.importorskip("mla_decode.cuda")
    scale_dtype = torch.uint8 if case.kv_scale is None else case.kv_scale.dtype
    plan = mla_decode.plan(batch, 64, case.block_table.shape[1], case.kv_cache.dtype, "cuda", num_heads=heads,
                           q_len=q_len, backend=backend, kv_scale_dtype=scale_dtype,
                           backend_options=None if schedule is None else {"schedule": schedule})
    alone = [plan.run(*c.args()) for c in cases]
    torch.cuda.synchronize()
    results: dict = {}
    start = threading.Barrier(2)

    def caller(i: int) -> None:
        stream = torch.cuda.Stream()
        start.wait()
        with torch.cuda.stream(stream):
            outs = [plan.run(*cases[i].args()) for _ in range(20)]
        stream.synchronize()
        results[i] = outs

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert all(torch.equal(o, alone[i][0]) and torch.equal(l_, alone[i][1]) for o, l_ in results[i])


def tile_rows(plan) -> int:
    """The rows of a tile of the plan's schedule: the cuda kernels' 64, the triton plan's block_n."""
    return 64 if plan.backend == "cuda" else plan.impl.key.plan.block_n


def poison_partials(plan) -> None:
    """NaN in the partial slots the plan's next run on this stream uses (as a fresh workspace may hold anything)."""
    if plan.backend == "cuda":
        from mla_decode.cuda.decode import current_raw_stream

        part_o, part_lse = plan.impl.workspace(current_raw_stream(torch.cuda.current_device())).buffers[:2]
    else:
        work = plan.impl.workspace()
        part_o, part_lse = work.part_o, work.part_lse
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", ["dropped", "twice", "count"])
def test_a_planted_schedule_fault_fails_the_bounds(fault, backend):
    """On the precise kernel (the tightest bounds) and short sequences cut into pieces of a tile or two, one tile
    dropped, one tile taken twice, or a sequence's first piece counting one fewer (the combine, which reads that count,
    leaves out the last piece, half the sequence's positions) moves its output past the bounds; the partials
    poisoned first."""
    case = make_paged_case("fp8", 16, SPREADS["edges"], seed=4, device="cuda")
    plan = backend_plan(backend, case, "precise")
    step = plan.schedule(case.cache_seqlens)
    ref, (out_bound, lse_bound) = plan_truth(case, plan, "precise")
    out, lse = plan.run(*case.args(), schedule=step)
    good = errors(out, lse, *ref)
    assert good[0] < out_bound and good[1] < lse_bound
    poison_partials(plan)
    items = step.items[:plan.impl.max_items * 4].view(-1, 4)  # a view: the faults land in the step's schedule
    count, index = items[:, 3] & 0xFFFF, items[:, 3] >> 16
    rows_a_tile = tile_rows(plan)
    tiles = (case.cache_seqlens.long() + rows_a_tile - 1) // rows_a_tile
    short = tiles[items[:, 0].clamp(min=0).long()] <= 20
    k = int(((items[:, 0] >= 0) & short & (items[:, 2] > items[:, 1]) & (index < count - 1)).nonzero()[0])
    if fault == "dropped":
        items[k, 2] -= 1
    elif fault == "twice":
        items[k + 1, 1] -= 1  # the next piece of the sequence starts a tile early
    else:  # the last piece of three or more holding the largest share of its sequence's positions
        lens = case.cache_seqlens.long()[items[:, 0].clamp(min=0).long()]
        rows = (torch.minimum(items[:, 2].long() * rows_a_tile, lens) - items[:, 1].long() * rows_a_tile).clamp(min=0)
        share = torch.where((items[:, 0] >= 0) & (index == count - 1) & (count >= 3), rows / lens.clamp(min=1), -1.0)
        last = int(share.argmax())
        items[last - int(index[last]), 3] -= 1  # its first piece, whose count the merge reads
    out = torch.full_like(out, float("nan"))
    bad = errors(*plan.run(*case.args(), out=out, schedule=step), *ref)
    assert bad[0] > out_bound or bad[1] > lse_bound, bad
