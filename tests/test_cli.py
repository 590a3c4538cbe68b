"""python -m mla_decode on the CPU: the environment and each backend's verdict, a decode checked against float64
(which a wrong decode fails), and `bench` over a grid file."""

import subprocess
import sys
from pathlib import Path

import torch

import mla_decode.__main__ as cli
from mla_decode.api import DecodePlan

ROOT = Path(__file__).resolve().parent.parent


def test_the_command_prints_the_environment_the_backends_and_a_checked_decode():
    done = subprocess.run([sys.executable, "-m", "mla_decode"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"mla_decode {cli.__version__}, python ") and "torch " in out
    for name in ("aiter", "cuda", "triton", "torch"):
        assert f"\n  {name:7s} serves: " in out, out
    assert "  torch   serves: fp8 16 heads, bf16 16 heads, mxfp4 16 heads, fp8 128 heads MTP 2, bf16 8 heads" in out
    assert "auto picks: fp8 16 heads -> torch" in out
    assert "decode: torch backend, fp8 cache" in out and "against float64 (bound 0.06) ok;" in out, out


def test_a_wrong_decode_fails_the_check(monkeypatch, capsys):
    """Negative controls: a decode that writes zeros, or skips the last KV row of each sequence, exits 1."""
    run = DecodePlan.run

    def zeros(self, *args, out=None, **kwargs):
        run(self, *args, out=out, **kwargs)
        out.zero_()
        return out, None

    def short(self, q, kv_cache, block_table, cache_seqlens, kv_scale=None, **kwargs):
        return run(self, q, kv_cache, block_table, (cache_seqlens - 1).clamp(min=0), kv_scale, **kwargs)

    for bug in (zeros, short):
        monkeypatch.setattr(DecodePlan, "run", bug)
        assert cli.main([]) == 1
        assert "FAILED" in capsys.readouterr().out


def test_the_check_reads_no_unowned_slot():
    """The checked batch holds NaN in every slot no sequence owns (a decode that reads one comes out NaN)."""
    batch = cli.Batch([5, 0, 17], "fp8", 16, 1, 16, torch.device("cpu"))
    rows = batch.kv_cache.float().view(-1, 576)
    assert rows.isnan().any(dim=1).sum() == rows.shape[0] - 22


def test_bench_times_each_row_of_a_grid(tmp_path, capsys):
    grid = tmp_path / "grid.yml"
    grid.write_text("rows:\n  - {batch: 3, kv: 40, heads: 16, q_len: 2, page: 16, seed: 1}\n"
                    "  - {batch: 2, kv: 9, heads: 8, q_len: 1, page: 4, seed: 2, format: bf16}\n")
    assert cli.main(["bench", "--grid", str(grid), "--iters", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("batch"))
    rows = [line.split() for line in lines[header + 1:]]
    assert [row[:7] for row in rows] == [["3", "40", "16", "2", "fp8", "normal", "torch"],
                                         ["2", "9", "8", "1", "bf16", "normal", "torch"]]
