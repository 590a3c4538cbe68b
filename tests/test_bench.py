"""bench/leaderboard.py on the CPU: the dry run's table and JSON, rows never dropped, the memory-only walks and the
read-ceiling kernel checked in the Triton interpreter, and negative controls (a wrong output is FAIL, a raising
method is ERROR, a backend not built yet is skipped) with the exit status they set. Any GPU is hidden (subprocesses)
or passed over (in process), so a GPU machine checks the same CPU rows."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reference as R
from bench import harness, leaderboard

ROOT = Path(__file__).resolve().parent.parent
LEADERBOARD = ROOT / "bench" / "leaderboard.py"


def cpu_env(interpret: bool) -> dict[str, str]:
    """The environment of a subprocess on the CPU: no GPU visible, no MLA_ settings, TRITON_INTERPRET as asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_") and k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_bench(tmp_path: Path, *args: str, interpret: bool = False) -> tuple[subprocess.CompletedProcess, dict, str]:
    env = cpu_env(interpret)
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, str(LEADERBOARD), "--dry-run", "--json", str(out_json), "--markdown",
                           str(out_md), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out_json.read_text()), out_md.read_text()


def test_dry_run_reports_every_row_and_prints_the_compact_table_last(tmp_path):
    proc, result, markdown = run_bench(tmp_path)
    shapes = [s["name"] for s in result["shapes"]]
    assert shapes == ["2x64", "3x37"]
    rows = {(r["shape"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(s, m.name) for s in shapes for m in leaderboard.METHODS}  # never silently dropped
    for r in rows.values():
        assert r["status"] in ("ok", "skipped"), r
        assert r["status"] == "ok" or r["reason"], r  # every skip says why
    for s in shapes:
        ours = rows[(s, "torch-fp8")]
        assert ours["median_us"] > 0 and ours["back_to_back_us"] > 0 and len(ours["times_us"]) == 3
        assert ours["host_us"] > 0 and ours["host_fresh_us"] > 0
        assert 0 < ours["rel_l2"] < R.REL_L2_BOUND["fp8"]
        assert ours["vs_best_peer"] == pytest.approx(ours["median_us"] / rows[(s, "torch-ref")]["median_us"])
        assert ours["kv_bytes"] == ours["kv_rows"] * 576 and ours["kv_rows"] == ours["batch"] * ours["kv"]
        assert rows[(s, "triton-mxfp4")]["kv_bytes"] == ours["kv_rows"] * (288 + 18)
        for name in ("cuda-mxfp4", "triton-fp8", "flashinfer-bf16", "flashinfer-fp8", "memwalk-fp8"):
            assert rows[(s, name)]["status"] == "skipped"
    ceiling = result["anchors"]["read_ceiling"]
    assert ceiling["gbps"] > 0 and ceiling["kernel"] == "torch int32 sum"
    assert result["methods"]["torch-fp8"]["geomean_us"] > 0 and result["methods"]["torch-fp8"]["shapes_timed"] == 2
    assert result["methods"]["torch-fp8"]["geomean_host_fresh_us"] > 0
    assert result["meta"]["dry_run"] and result["meta"]["complete"]
    assert result["meta"]["versions"]["torch"] == torch.__version__

    tail = proc.stdout.strip().splitlines()[-8:]  # header, rule, one line per shape, geomean, ratio, host times
    assert tail[0].split()[:4] == ["shape", "cuda-fp8", "cuda-fp8-precise", "cuda-mxfp4"]
    assert tail[0].split()[-2:] == ["FP8", "floor"]
    assert [line.split()[0] for line in tail[2:4]] == shapes
    assert tail[4].startswith("geomean") and tail[5].startswith("vs best peer")
    assert tail[6].startswith("host µs") and tail[7].startswith("host fresh µs")
    per_row = [line for line in proc.stdout.splitlines() if line.split()[:2] == ["2x64", "torch-fp8"]]
    assert len(per_row) == 1 and ", host " in per_row[0] and ", host fresh " in per_row[0]
    detail_header = next(line for line in proc.stdout.splitlines() if line.startswith("method"))
    assert re.search(r"b2b µs +host µs +host fresh µs", detail_header), detail_header  # widths follow the cells
    assert markdown.startswith("### ") and "| geomean |" in markdown
    assert "| shape | cuda-fp8 | cuda-fp8-precise | cuda-mxfp4 | triton-fp8 | triton-fp8-precise |" in markdown
    assert "| host µs |" in markdown and "| host fresh µs |" in markdown
    assert "- `flashinfer-fp8` skipped or failed: FlashInfer needs an NVIDIA GPU" in markdown


def test_memory_walks_and_read_ceiling_in_the_interpreter(tmp_path):
    _, result, _ = run_bench(tmp_path, "--shapes", "3x37", "--methods", "memwalk-fp8,memwalk-mxfp4,torch-ref",
                             "--iters", "1", "--warmup", "0", interpret=True)
    triton_candidates = [c for c in result["anchors"]["read_ceiling"]["candidates"] if c["kernel"].startswith("triton")]
    assert len(triton_candidates) == 3 and all(c["gbps"] > 0 for c in triton_candidates)  # each verified its sum
    launches = {e["launch"]: e for e in result["anchors"]["empty_launch"]}
    assert launches["empty Triton kernel"]["median_us"] > 0
    rows = {r["method"]: r for r in result["rows"]}
    for name, row_bytes in (("memwalk-fp8", 576), ("memwalk-mxfp4", 306)):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["check"].startswith("checksum") and rows[name]["kv_bytes"] == 3 * 37 * row_bytes
        assert rows[name]["host_us"] > 0 and rows[name]["host_fresh_us"] is None  # a floor: no fresh figure


# Run in a fresh interpreter: TRITON_INTERPRET must be set before triton is first imported, which this test
# process may already have done.
MEMWALK_VARLEN = """
import sys, torch
sys.path[:0] = [sys.argv[1]]
import reference as R
from bench import floor_kernels as fk
for kv_format in ("fp8", "mxfp4"):
    data = R.generate_varlen_input([5, 40, 1, 33], seed=3, device=torch.device("cpu"))
    kv_data, kv_indptr = data[1], data[3]
    expected = fk.kv_checksum(kv_format, kv_data, kv_indptr)
    for splits, block_n in ((1, 32), (3, 32), (2, 64)):
        walk = fk.MemWalk(kv_format, kv_data, kv_indptr, splits, block_n)
        assert walk.checksum(walk()) == expected, (kv_format, splits, block_n)
    short = kv_indptr.clone()
    short[-1] -= 1  # one row fewer: the checksum must see it
    assert fk.kv_checksum(kv_format, kv_data, short) != expected
print("memwalk ok")
"""


def test_memwalk_checksum_covers_exactly_the_rows_of_kv_indptr():
    """Variable and odd lengths, a length-1 sequence, split counts that do not divide the tiles, both formats."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", MEMWALK_VARLEN, str(ROOT)], env=cpu_env(True), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "memwalk ok" in proc.stdout, proc.stderr[-3000:]


def test_fresh_calls_bind_a_new_input_each_time():
    """The host time on fresh inputs must see a different input on every call, of the same shape."""
    make = leaderboard.fresh_calls(leaderboard.Shape(2, 16, 5), lambda data: data)  # binds nothing: returns the input
    inputs = [make() for _ in range(3)]
    assert all(data[0].shape == inputs[0][0].shape and data[3].tolist() == [0, 16, 32] for data in inputs)
    digests = {hash(data[0].float().cpu().numpy().tobytes()) for data in inputs}
    assert len(digests) == 3
    assert not torch.equal(inputs[0][1]["bf16"], inputs[1][1]["bf16"])


def test_flashinfer_page_table_over_the_contiguous_cache():
    kv_indptr = torch.tensor([0, 128, 256, 320], dtype=torch.int32)
    page_indptr, indices, lens = leaderboard._flashinfer_pages(kv_indptr, 320, 64)
    assert page_indptr.tolist() == [0, 2, 4, 5] and indices.tolist() == [0, 1, 2, 3, 4]
    assert lens.tolist() == [128, 128, 64] and lens.dtype == torch.int32
    assert leaderboard._flashinfer_pages(torch.tensor([0, 100, 164], dtype=torch.int32), 164, 64) is None
    page_indptr, indices, lens = leaderboard._flashinfer_pages(torch.tensor([0, 3, 3, 5], dtype=torch.int32), 5, 1)
    assert page_indptr.tolist() == [0, 3, 3, 5] and indices.tolist() == [0, 1, 2, 3, 4] and lens.tolist() == [3, 0, 2]


def test_negative_controls_fail_error_and_skip(tmp_path, monkeypatch, capsys):
    """A zero output must be FAIL, an exception ERROR (both set exit status 1), NotImplementedError skipped."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(leaderboard, "get_device", lambda: torch.device("cpu"))

    def zeros(ctx, shape, data, expected):
        return harness.Prepared(fn=lambda: torch.zeros_like(expected),
                                check=leaderboard._check_attention(data, expected, "fp8"))

    def raises(ctx, shape, data, expected):
        raise RuntimeError("kernel exploded")

    def not_built(ctx, shape, data, expected):
        raise NotImplementedError("triton backend: not built yet")

    controls = [harness.Method("zeros", "ours", "fp8", "all-zero output", zeros),
                harness.Method("raises", "ours", "fp8", "raises", raises),
                harness.Method("not-built", "ours", "fp8", "stub", not_built)]
    monkeypatch.setattr(leaderboard, "METHODS", (*leaderboard.METHODS, *controls))
    out_json = tmp_path / "r.json"
    status = leaderboard.main(["--dry-run", "--methods", "torch-ref,zeros,raises,not-built", "--iters", "1",
                               "--warmup", "0", "--json", str(out_json)])
    assert status == 1
    rows = {(r["shape"], r["method"]): r for r in json.loads(out_json.read_text())["rows"]}
    for shape in ("2x64", "3x37"):
        assert rows[(shape, "zeros")]["status"] == "FAIL" and rows[(shape, "zeros")]["rel_l2"] == 1.0
        assert rows[(shape, "zeros")]["median_us"] is not None  # still timed, flagged
        assert rows[(shape, "raises")]["status"] == "ERROR"
        assert rows[(shape, "raises")]["reason"] == "RuntimeError: kernel exploded"
        assert rows[(shape, "not-built")]["status"] == "skipped"
        assert "not built yet" in rows[(shape, "not-built")]["reason"]
    assert "FAIL: 2x64 zeros" in capsys.readouterr().out


Q_QUANT = """
import runpy, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import triton_interpreter
triton_interpreter.patch()  # the interpreter's fp32 -> fp8 rounding (see there)
sys.argv = ["q_quant.py", "--batches", "1,3", "--iters", "2"]
runpy.run_path(sys.path[0] + "/bench/q_quant.py", run_name="__main__")
"""


def test_q_quant_script_checks_and_times_both_forms():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", Q_QUANT, str(ROOT)], env=cpu_env(True), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows), proc.stdout


def test_host_path_dry_run_splits_a_call_and_times_a_baseline_beside_it(tmp_path):
    """The dry run on the CPU: every scenario and column, with this repo's submission.py as the baseline."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host_path.py"), "--dry-run", "--json", str(out),
                           "--baseline", str(ROOT / "submission.py")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["results"]["torch 2x64"]
    assert set(result) == {"repeated", "fresh", "control"}
    assert all(row[c] > 0 for row in result.values() for c in ("dispatch", "forward", "call", "baseline"))
