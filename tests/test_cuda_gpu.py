"""The cuda backend's kernels on an NVIDIA GPU with nvcc (`pytest -m gpu tests/test_cuda_gpu.py`): the wgmma kernel
(Hopper, FP8 and MXFP4) and the mma.sync one at each stage count, through submission.custom_kernel, against the
emulation of what each rounds: the task's cases, ragged batches, every split count, the split barrier, no row read
outside a sequence, invalid ranges and misaligned inputs. The build, the plan and the choice of backend, on the CPU:
tests/test_cuda.py."""

from typing import NamedTuple

import pytest
import torch

import mla_decode
import mla_decode.cuda.build as B
import mla_decode.cuda.plan as P
import reference as R
import submission as S
from testkit.attention import assert_grid_match, nan_outside
from testkit.emulation import E4M3_P_RANDOM_BOUND, emulate, kernel_emulation

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                               reason="needs an NVIDIA GPU")

def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == B.WGMMA_CAPABILITY


# (kernel, KV format, shared-memory limit per block, the stages the mma.sync kernel then runs with): the wgmma kernel
# (Hopper only) with both formats; the mma.sync kernel, built for this GPU whatever it is, with its stages for
# 227 KB (4), A100's 163 KB (3) and the 99 KB of sm_86 / sm_89 / sm_120 (2).
CUDA_KERNELS = [
    pytest.param(("wgmma", fmt, 0, 0), id=f"wgmma-{fmt}",
                 marks=pytest.mark.skipif(not on_hopper(), reason="the wgmma kernel is Hopper's"))
    for fmt in ("fp8", "mxfp4")
] + [pytest.param(("mma_sync", "fp8", limit, stages), id=f"mma_sync-{stages}stages")
     for limit, stages in ((0, 4), (166912, 3), (101376, 2))]


# The wgmma kernels on random-normal data against their emulation (the walk's splits and tiles included). Measured on
# the H200 over the task shapes and varlen batches below (bench/emulation_errors.py): worst sequence 9.6e-3 (FP8) and
# 7.9e-3 (MXFP4). Planted bugs (tests/test_negative_controls.py): sm_scale x 1.01 2.4e-2, the output x 1.02 2.0e-2.
RANDOM_WGMMA_BOUND = E4M3_P_RANDOM_BOUND


class CudaCase(NamedTuple):
    """What the cuda_backend fixture set up: the KV format, the bound on the worst sequence's relative L2 error against
    the emulation of what the kernel rounds on random-normal data, whether the kernel is the wgmma one, which rounds
    Q per head and P to e4m3 (the mma.sync kernel keeps both in fp16), and the bound against fp32 attention. On grid
    data (testkit.inputs.generate_grid_input, where those roundings are exact) both are held to
    testkit.inputs.GRID_REL_L2_BOUND.
    """

    kv_format: str
    random_bound: float
    wgmma: bool
    fp32_bound: float  # against fp32 attention with bf16 Q (Q's rounding not modelled): wgmma measured 0.029-0.039

    def emulate(self, data) -> torch.Tensor:
        """The emulation of what the kernel rounds on `data`: the wgmma kernel's with its launch plan's walk
        (testkit.emulation.emulate; cuda_plan as the test may have patched it)."""
        if self.wgmma:
            return emulate(data, "cuda", self.kv_format, "fast")
        return kernel_emulation(data, "cache", self.kv_format)


@pytest.fixture(params=CUDA_KERNELS)
def cuda_backend(monkeypatch, request):
    """MLA_BACKEND=cuda with one kernel, KV format and shared-memory limit; returns its CudaCase."""
    kernel, kv_format, smem_limit, stages = request.param
    monkeypatch.setenv("MLA_BACKEND", "cuda")
    monkeypatch.setenv("MLA_KV_FORMAT", kv_format)
    monkeypatch.delenv("MLA_PRECISION", raising=False)
    monkeypatch.setattr(B, "_LIBS", {})
    monkeypatch.setattr(S, "_DISPATCH", {})  # custom_kernel's plans: they depend on the kernel's CTAs per SM
    if kernel == "mma_sync":
        monkeypatch.setattr(B, "WGMMA_CAPABILITY", None)
    lib = B.library(torch.cuda.get_device_capability())
    assert lib.mla_unit_ctas_per_sm(16) == (2 if kernel == "wgmma" else 1)
    if lib.mla_limit_shared_memory(0) < stages:  # the mma.sync kernel on a GPU with less shared memory
        pytest.skip(f"this GPU's shared memory per block holds fewer than {stages} stages")
    assert lib.mla_limit_shared_memory(smem_limit) == stages  # the limit took effect
    wgmma = kernel == "wgmma"
    yield CudaCase(kv_format, RANDOM_WGMMA_BOUND if wgmma else 5e-3, wgmma, 0.05 if wgmma else 5e-3)
    lib.mla_limit_shared_memory(0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,kv_len", [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192),
                                          (256, 1024), (256, 8192)])
def test_gpu_task_cases(cuda_backend, batch, kv_len):
    bound = cuda_backend.random_bound
    data = R.generate_input(batch, 1, kv_len, seed=batch + kv_len)
    out = S.custom_kernel(data)
    ok, msg = R.check_implementation(data, out)
    assert ok, msg
    assert R.worst_row_relative_l2(out, cuda_backend.emulate(data)) < bound
    assert torch.equal(S.custom_kernel(data), out)  # deterministic, and the cached launch is reused
    assert_grid_match(S.custom_kernel, cuda_backend.emulate, [kv_len] * batch, seed=batch + kv_len)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lens", [[1], [0, 5, 1, 77, 1000, 3], [8191, 1, 4096, 0], [513] * 40,
                                  list(range(0, 3000, 97))], ids=lambda x: f"b{len(x)}_max{max(x)}")
def test_gpu_varlen(cuda_backend, lens):
    bound = cuda_backend.random_bound
    data = R.generate_varlen_input(lens, seed=len(lens))
    out = S.custom_kernel(data)
    exact = cuda_backend.emulate(data)
    assert R.worst_row_relative_l2(out, exact) < bound  # zero rows for empty sequences
    ok, msg = R.check_implementation(data, out)
    # The checks must pass wherever the exact computation over the same cache passes them: a lone one-row MXFP4
    # sequence (lens [1]) misses the leaderboard rule even computed exactly (5.08% of elements, limit 5%).
    assert ok or not R.check_implementation(data, exact.to(torch.bfloat16))[0], msg
    assert_grid_match(S.custom_kernel, cuda_backend.emulate, lens, seed=len(lens))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16, 32])  # 4 x 32 CTAs: within one per SM (cooperative launch)
def test_gpu_every_split_count(cuda_backend, monkeypatch, splits):
    """Every merge width (merge_quads' W = 8, 4, 2, 1 and its shuffles from 32 splits) on odd, empty and one-row
    sequences, with splits that get no rows; the second input reuses the first's plan and workspace, and its output
    owes nothing to the first's partials. (cuda_plan is patched before custom_kernel makes its first plan: the
    fixture emptied submission._DISPATCH.)"""
    bound = cuda_backend.random_bound
    monkeypatch.setattr(P, "cuda_plan", lambda *args: splits)
    for seed in (splits, splits + 100):
        data = R.generate_varlen_input([1, 777, 0, 3001], seed=seed)
        out = S.custom_kernel(data)
        assert R.worst_row_relative_l2(out, cuda_backend.emulate(data)) < bound
    assert_grid_match(S.custom_kernel, cuda_backend.emulate, [1, 777, 0, 3001], seed=splits)
    assert [decision.plan.impl.num_splits for decision in S._DISPATCH.values()] == [splits]  # one plan, reused


@pytest.mark.gpu
@needs_gpu
def test_gpu_barrier_counts_every_arrival_and_an_oversized_grid_fails_to_launch(cuda_backend, monkeypatch):
    """The per-sequence barrier's counts grow by the split count per launch (every CTA arrived once; the next launch
    waits for the next multiple); a split grid larger than the GPU holds at once is refused by the
    cooperative launch instead of hanging, and split counts the merge does not take (not a power of two, above 512)
    are refused before any launch."""
    for lens in ([700, 3, 1, 2000], [1000] * 4):
        data = R.generate_varlen_input(lens, seed=5)
        for _ in range(3):
            S.custom_kernel(data)
    torch.cuda.synchronize()
    plans = [decision.plan.impl for decision in S._DISPATCH.values()]
    # each plan's one workspace (this thread, this stream): its partials, then its counters
    counts = [(workspace.buffers[2].tolist(), plan.num_splits) for plan in plans
              for workspace in plan._workspaces.values()]
    assert len(counts) == 2 and all(count == [3 * splits] * 4 and splits > 1 for count, splits in counts)
    data = R.generate_input(4, 1, 1024, seed=1)
    for splits, error in ((256, 720), (3, 1), (1024, 1)):  # too large for a cooperative launch; not a power of two
        monkeypatch.setattr(P, "cuda_plan", lambda *args, n=splits: n)  # or too many
        monkeypatch.setattr(S, "_DISPATCH", {})  # a new plan, with that split count
        with pytest.raises(RuntimeError, match=f"launch failed with cudaError {error}$"):
            S.custom_kernel(data)
        assert [decision.plan.impl.num_splits for decision in S._DISPATCH.values()] == [splits]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("keep", range(5))
def test_gpu_reads_no_row_outside_a_sequence(cuda_backend, keep):
    """Every cache row outside sequence `keep` is NaN, those past kv_indptr[-1] included: its output stays within
    the kernel's bound of the fp32 computation (bf16 Q) on the clean cache."""
    kv_format, bound = cuda_backend.kv_format, cuda_backend.fp32_bound
    data, exact = nan_outside(R.generate_varlen_input([5, 1, 0, 700, 3, 9], seed=keep), kv_format, keep, 1)
    out = S.custom_kernel(data)[keep]
    assert torch.isfinite(out).all()
    assert R.worst_row_relative_l2(out[None], exact[None]) < bound


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_seq_len", [None, 2048])  # 1 split, and several (the merge)
def test_gpu_invalid_ranges_give_nan_rows(cuda_backend, kv_seq_len):
    """kv_indptr ranges that run backwards or past the cache give NaN rows, the valid sequence a finite one: the
    library's ragged plan on the cuda backend, its split plan sized as the leaderboard adapter sizes it (kv_seq_len,
    else ceil(total_kv / batch))."""
    kv_format = cuda_backend.kv_format
    q, kv_data, qo, kvp, config = R.generate_varlen_input([100, 200, 50, 70], seed=3)
    kv, scale = kv_data[kv_format]
    batch = q.shape[0]
    bad = torch.tensor([0, 100, 50, 420 + 1000, 420], dtype=torch.int32, device=q.device)
    max_seqlen = kv_seq_len if kv_seq_len is not None else -(-kv.shape[0] // batch)
    decode = mla_decode.plan_ragged(batch, kv.dtype, q.device, max_seqlen, backend="cuda", precision="fast",
                                    softmax_scale=config["sm_scale"], return_lse=False, kv_scale_dtype=scale.dtype,
                                    kv_scale_stride=scale.stride(0) if kv_format == "mxfp4" else None,
                                    backend_options={"schedule": "fixed"})
    assert decode.backend == "cuda" and (decode.impl.num_splits > 1) == (kv_seq_len is not None)
    out, _ = decode.run_ragged(q.view(batch, 1, 16, 576), kv, bad, scale)
    torch.cuda.synchronize()
    out = out.view(batch, 16, 512)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all() and torch.isnan(out[3]).all()
    assert torch.isfinite(out[0]).all()


@pytest.mark.gpu
@needs_gpu
def test_gpu_an_input_off_a_16_byte_boundary_is_refused(monkeypatch):
    """The kernel's loads are 16 bytes wide: a q one element past a boundary (a valid contiguous tensor) is refused
    by name, after an aligned input of the same kind was run (the remembered decision does not skip the check)."""
    monkeypatch.setenv("MLA_BACKEND", "cuda")
    monkeypatch.delenv("MLA_KV_FORMAT", raising=False)
    monkeypatch.setattr(S, "_DISPATCH", {})  # the aligned input below makes this kind's plan
    q, kv_data, qo, kvp, config = R.generate_varlen_input([37, 5], seed=2)
    S.custom_kernel((q, kv_data, qo, kvp, config))
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    with pytest.raises(ValueError, match="must start on 16-byte boundaries"):
        S.custom_kernel((shifted, kv_data, qo, kvp, config))
