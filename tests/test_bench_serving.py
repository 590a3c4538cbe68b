"""bench/serving.py on the CPU: the dry run's JSON, Markdown and compact table (every row and method reported, the
Triton kernel and the memory walk run in Triton's interpreter, the GPU peers skipped with their reasons); its pages
and float64 reference (held to the library's torch backend: the same causal rule and dequantization); FlashMLA's and
FlashInfer's calls through stand-ins that hold the arguments to those libraries' definitions; and negative controls:
a planted output or LSE off by 1.25x its bound is FAIL and sets exit status 1, while the exact answer passes."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mla_decode
from bench import harness, serving

ROOT = Path(__file__).resolve().parent.parent
SERVING = ROOT / "bench" / "serving.py"
DRY_ROWS = ["2x100-h16-q1", "3x70-h32-q2"]
TRITON_METHODS = ("triton-fp8", "triton-fp8-precise", "triton-mxfp4")
GPU_PEERS = ("flashmla-bf16", "flashmla-fp8", "flashinfer-bf16", "flashinfer-fp8")
ROW_BYTES = {"fp8": 576, "mxfp4": 288 + 18, "bf16": 1152}
# The library's torch backend (fp32, bf16 output) against the float64 reference: its bf16 rounding is ~1.7e-3.
TORCH_OUT_BOUND = 5e-3
TORCH_LSE_BOUND = 1e-4
PLANTED_EXCESS = 1.25  # the planted errors' size, in units of the bound they must break


def cpu_env() -> dict[str, str]:
    """A subprocess on the CPU: no GPU visible, no MLA_ settings, the Triton kernels in the interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_")}
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    return env


def test_dry_run_reports_every_row_and_method(tmp_path):
    pytest.importorskip("triton")
    out_json, out_md = tmp_path / "serving.json", tmp_path / "serving.md"
    proc = subprocess.run([sys.executable, str(SERVING), "--dry-run", "--iters", "1", "--warmup", "0", "--json",
                           str(out_json), "--markdown", str(out_md)], cwd=ROOT, env=cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result, markdown = json.loads(out_json.read_text()), out_md.read_text()
    assert [s["name"] for s in result["shapes"]] == DRY_ROWS
    assert [s["kv_rows"] for s in result["shapes"]] == [100 + 93, 70 + 63 + 56]  # kv - (7 b) % 64
    rows = {(r["shape"], r["method"]): r for r in result["results"]}
    assert set(rows) == {(s, m.name) for s in DRY_ROWS for m in serving.METHODS}  # never silently dropped
    for r in rows.values():
        assert r["status"] in ("ok", "skipped"), r
        assert r["status"] == "ok" or r["reason"], r  # every skip says why
        assert r["kv_bytes"] == r["kv_rows"] * ROW_BYTES[r["kv_format"]]
        assert r["flops"] == 2 * r["q_len"] * r["heads"] * r["kv_rows"] * (576 + 512)
    for name in TRITON_METHODS:  # the 16-head q_len 1 row is what the triton backend serves in any case
        r = rows[(DRY_ROWS[0], name)]
        bound = serving.SERVING_BOUNDS[r["kv_format"]]
        assert r["status"] == "ok" and r["median_us"] > 0 and len(r["times_us"]) == 1, r
        assert 0 < r["rel_l2"] < bound.out and 0 <= r["lse_err"] < bound.lse and r["tflops"] > 0, r
    for shape in DRY_ROWS:
        walk = rows[(shape, "memwalk-fp8")]
        assert walk["status"] == "ok" and walk["check"].startswith("checksum") and walk["tflops"] is None, walk
        assert rows[(shape, "cuda-fp8")]["status"] == "skipped"
        for name in GPU_PEERS:
            assert rows[(shape, name)]["status"] == "skipped" and "needs an NVIDIA GPU" in rows[(shape, name)]["reason"]
    summary = result["methods"]["triton-fp8"]
    assert summary["geomean_us"] > 0 and summary["shapes_total"] == 2 and summary["geomean_vs_best_peer"] is None
    assert result["meta"]["dry_run"] and result["meta"]["complete"]
    assert set(result["meta"]["bounds"]) == {"bf16", "fp8", "mxfp4"}

    tail = proc.stdout.strip().splitlines()[-6:]  # header, rule, one line per row, geomean, vs best peer
    assert tail[0].split()[:2] == ["shape", "cuda-fp8"] and tail[0].split()[-2:] == ["FP8", "floor"]
    assert [line.split()[0] for line in tail[2:4]] == DRY_ROWS
    assert tail[4].startswith("geomean") and tail[5].startswith("vs best peer")
    assert markdown.startswith("### Serving grid") and "| geomean |" in markdown
    assert "| shape | cuda-fp8 | cuda-fp8-precise | cuda-mxfp4 | triton-fp8 |" in markdown
    assert "- `flashmla-fp8` skipped or failed: FlashMLA needs an NVIDIA GPU" in markdown


@pytest.mark.parametrize("heads,q_len", [(16, 1), (32, 2)])
def test_reference_is_the_torch_backends_attention(heads, q_len):
    """serving.py's float64 truth, per format, against the library's torch backend (fp32 over the exactly dequantized
    rows each sequence owns; causal for q_len > 1 as the README says) over the same shuffled pages."""
    case = serving.Case(serving.ServingShape(3, 70, heads, q_len, 16, seed=5), torch.device("cpu"))
    for kv_format in ("bf16", "fp8", "mxfp4"):
        kv, scale = case.cache(kv_format)
        decode = mla_decode.plan(3, 16, case.block_table.shape[1], kv.dtype, "cpu", num_heads=heads, q_len=q_len,
                                 causal=q_len > 1, backend="torch",
                                 kv_scale_dtype=torch.uint8 if scale is None else scale.dtype)
        verdict = serving.attention_check(case, kv_format, serving.as_returned)(
            decode.run(case.q, kv, case.block_table, case.cache_seqlens, scale))
        assert verdict.rel_l2 < TORCH_OUT_BOUND and verdict.lse_err < TORCH_LSE_BOUND, (kv_format, verdict)


@pytest.mark.parametrize("spec", ["serving.yml", "serving_heads.yml", "uneven.yml"])
def test_the_specs_load(spec):
    """Both grids of rows parse, each row valid, none repeated."""
    shapes = serving.load_shapes(ROOT / spec)
    assert shapes and len({s.name for s in shapes}) == len(shapes)


def test_spreads_give_the_lengths_they_name(tmp_path):
    """Each spread of uneven.yml's rows: uniform all kv; normal about kv with a wide spread; lognormal a long tail;
    one-long one sequence of kv; range 1 to kv; every length at least q_len. An unknown spread is refused."""
    def lengths(spread, batch=128, kv=4096, q_len=2):
        return serving.ServingShape(batch, kv, 16, q_len, 64, seed=7, spread=spread).lengths()

    assert lengths("uniform") == [4096] * 128
    normal = torch.tensor(lengths("normal"), dtype=torch.float64)
    assert abs(normal.mean() - 4096) < 400 and 1500 < normal.std() < 2600 and normal.min() >= 2
    lognormal = lengths("lognormal", batch=256, kv=2048)
    assert sorted(lognormal)[128] < 4096 and max(lognormal) > 32768
    assert sorted(lengths("one-long", batch=32, kv=65536)) == [serving.ONE_LONG_OTHERS] * 31 + [65536]
    assert lengths("range", batch=8, kv=32768, q_len=1)[::7] == [1, 32768]
    assert serving.ServingShape(8, 4096, 16, 1, 64, seed=1, spread="normal").name == "8x4k-h16-q1-normal"
    spec = tmp_path / "bad.yml"
    spec.write_text("rows:\n  - {batch: 2, kv: 128, heads: 16, q_len: 1, page: 64, seed: 1, spread: zipf}\n")
    with pytest.raises(SystemExit, match="expected a spread of"):
        serving.load_shapes(spec)


def test_pages_are_shuffled_and_each_owned_by_one_sequence():
    case = serving.Case(serving.ServingShape(5, 200, 16, 1, 64, seed=3), torch.device("cpu"))
    assert case.lens == [200, 193, 186, 179, 172]
    owned = [p for b in range(5) for p in case.block_table[b, :-(-case.lens[b] // 64)].tolist()]
    assert sorted(owned) == list(range(case.num_pages)) and owned != sorted(owned)
    rows = torch.cat([case.owned_rows(b) for b in range(5)])
    assert rows.numel() == sum(case.lens) and rows.unique().numel() == rows.numel()


def test_planted_wrong_output_or_lse_is_FAIL(tmp_path, monkeypatch):
    """The exact answer (rounded to bf16) passes; the output scaled or the LSE shifted by 1.25x the FP8 bound fails,
    is still timed, and makes the exit status 1."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the read ceiling from torch alone: fast
    monkeypatch.setattr(serving, "get_device", lambda: torch.device("cpu"))
    bound = serving.SERVING_BOUNDS["fp8"]

    def planted(out_scale: float, lse_shift: float):
        def prepare(ctx, case):
            out, lse = case.reference("fp8")
            answer = ((out * out_scale).to(torch.bfloat16), (lse + lse_shift).float())
            return harness.Prepared(fn=lambda: answer, check=serving.attention_check(case, "fp8", serving.as_returned))

        return prepare

    controls = [harness.Method("exact", "ours", "fp8", "the float64 truth in bf16", planted(1.0, 0.0)),
                harness.Method("out-off", "ours", "fp8", "output scaled", planted(1 + PLANTED_EXCESS * bound.out, 0.0)),
                harness.Method("lse-off", "ours", "fp8", "LSE shifted", planted(1.0, PLANTED_EXCESS * bound.lse))]
    monkeypatch.setattr(serving, "METHODS", tuple(controls))
    out_json = tmp_path / "planted.json"
    assert serving.main(["--dry-run", "--iters", "1", "--warmup", "0", "--json", str(out_json)]) == 1
    rows = {(r["shape"], r["method"]): r for r in json.loads(out_json.read_text())["results"]}
    for shape in DRY_ROWS:
        assert rows[(shape, "exact")]["status"] == "ok", rows[(shape, "exact")]
        for name in ("out-off", "lse-off"):
            assert rows[(shape, name)]["status"] == "FAIL" and rows[(shape, name)]["median_us"] is not None
        assert rows[(shape, "out-off")]["rel_l2"] > bound.out
        assert rows[(shape, "lse-off")]["lse_err"] == pytest.approx(PLANTED_EXCESS * bound.lse, rel=1e-3)


def torch_decode(q, kv_cache, block_table, cache_seqlens, kv_scale, causal: bool) -> tuple:
    """The library's torch backend on a paged call: (out (batch, q_len, heads, 512), lse (batch, heads, q_len))."""
    batch, q_len, heads, _ = q.shape
    decode = mla_decode.plan(batch, kv_cache.shape[1], block_table.shape[1], kv_cache.dtype, q.device,
                             num_heads=heads, q_len=q_len, causal=causal, backend="torch")
    return decode.run(q, kv_cache, block_table, cache_seqlens, kv_scale)


class StandinFlashMLA:
    """FlashMLA's four ops as its sources define them (vllm-project/FlashMLA 46d64a8, csrc/pybind.cpp and
    csrc/extension/sm90/dense_fp8/pybind.cpp): argument order, shapes and dtypes checked, the math by the torch
    backend. The FP8 op dequantizes q with descale_q and the cache with descale_k."""

    @staticmethod
    def _metadata(seqlens, rows_per_kv_head, h_k):
        assert seqlens.dtype == torch.int32 and h_k == 1 and rows_per_kv_head >= 1
        return torch.zeros(1, dtype=torch.int32), torch.zeros(seqlens.shape[0] + 1, dtype=torch.int32)

    def get_mla_decoding_metadata(self, seqlens, rows_per_kv_head, h_k, h_q, is_fp8_kvcache, topk):
        assert rows_per_kv_head % h_q == 0 and not is_fp8_kvcache and topk is None
        return self._metadata(seqlens, rows_per_kv_head, h_k)

    def get_mla_decoding_metadata_dense_fp8(self, seqlens, rows_per_kv_head, h_k):
        return self._metadata(seqlens, rows_per_kv_head, h_k)

    @staticmethod
    def _check(q, kv, head_size_v, seqlens, table):
        assert q.dim() == 4 and q.shape[-1] == 576 and head_size_v == 512 and kv.shape[1:] == (64, 1, 576)
        assert seqlens.shape == (q.shape[0],) and table.shape[0] == q.shape[0] and table.dtype == torch.int32

    def fwd_kvcache_mla(self, q, kv, head_size_v, seqlens, table, softmax_scale, causal, meta, splits, is_fp8,
                        indices):
        self._check(q, kv, head_size_v, seqlens, table)
        assert q.dtype == kv.dtype == torch.bfloat16 and not is_fp8 and indices is None
        assert softmax_scale == pytest.approx(576 ** -0.5)
        return list(torch_decode(q, kv, table, seqlens, None, causal))

    def fwd_kvcache_mla_fp8(self, q, kv, head_size_v, seqlens, table, softmax_scale, causal, meta, splits,
                            descale_q, descale_k):
        self._check(q, kv, head_size_v, seqlens, table)
        assert q.dtype == kv.dtype == torch.float8_e4m3fn and descale_q.shape == descale_k.shape == (1,)
        return list(torch_decode((q.float() * descale_q).bfloat16(), kv, table, seqlens, descale_k, causal))


class StandinMLAWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper as its docstrings define it (0.7.4): CSR page metadata, queries
    packed (tokens, heads, 576), q_len query rows per sequence, out (tokens, heads, 512) and the LSE (tokens, heads)
    written into the caller's buffers; the math by the torch backend over the pages the CSR lists."""

    def __init__(self, workspace, backend):
        assert workspace.dtype == torch.uint8 and backend == "fa3"

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, lse_mode):
        assert (head_dim_ckv, head_dim_kpe, q_data_type, lse_mode) == (512, 64, torch.bfloat16, "basee")
        self.metadata, self.heads, self.page, self.causal, self.kv_dtype = (metadata, num_heads, page_size, causal,
                                                                            kv_data_type)

    def run(self, *, query, kv_cache, out, lse, return_lse, return_lse_base_on_e, ckv_scale=None, kpe_scale=None):
        qo_indptr, page_indptr, indices, lens = self.metadata
        assert return_lse and return_lse_base_on_e and kv_cache.dtype == self.kv_dtype and ckv_scale == kpe_scale
        batch, q_len = lens.shape[0], int(qo_indptr[1] - qo_indptr[0])
        assert qo_indptr.tolist() == list(range(0, batch * q_len + 1, q_len))
        pages = [indices[page_indptr[b]:page_indptr[b + 1]].cpu() for b in range(batch)]
        table = torch.zeros((batch, max(len(p) for p in pages)), dtype=torch.int32)
        for b, p in enumerate(pages):
            table[b, :len(p)] = p
        scale = None if ckv_scale is None else torch.tensor([ckv_scale])
        o, lse_bhs = torch_decode(query.view(batch, q_len, self.heads, 576), kv_cache.unsqueeze(2), table, lens, scale,
                                  self.causal)
        out.copy_(o.view(batch * q_len, self.heads, 512))
        lse.copy_(lse_bhs.transpose(1, 2).reshape(batch * q_len, self.heads))
        return out, lse


def test_peer_calls_through_stand_ins(tmp_path, monkeypatch):
    """FlashMLA's and FlashInfer's rows through stand-ins that hold the arguments to the peers' own definitions and do
    the math on the torch backend: the glue (metadata, packing, CSR pages, the LSE's layout, the FP8 scales) passes
    its check at both dry-run rows, and the fastest peer gets the ratio 1."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(serving, "get_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(serving.ServingContext, "flashmla", lambda self, kv_format: StandinFlashMLA())
    flashinfer = SimpleNamespace(mla=SimpleNamespace(BatchMLAPagedAttentionWrapper=StandinMLAWrapper,
                                                     MLAPlanMetadata=SimpleNamespace(csr=lambda *csr: csr)))
    monkeypatch.setattr(serving.ServingContext, "flashinfer", lambda self: flashinfer)
    out_json = tmp_path / "peers.json"
    assert serving.main(["--dry-run", "--methods", ",".join(GPU_PEERS), "--iters", "1", "--warmup", "0", "--json",
                         str(out_json)]) == 0
    results = json.loads(out_json.read_text())["results"]
    assert len(results) == len(DRY_ROWS) * len(GPU_PEERS)
    for r in results:
        assert r["status"] == "ok" and r["vs_best_peer"] >= 1.0, r
    for shape in DRY_ROWS:
        assert min(r["vs_best_peer"] for r in results if r["shape"] == shape) == 1.0
